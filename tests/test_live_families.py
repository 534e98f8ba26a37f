"""Live changes on the families served since issue #22: sliding windows, latent attention (MLA), running states.

The live-identity and weight-edit suites (tests/test_live_llm.py, tests/test_weight_edits.py)
run on Llama-style models; here the same kinds of change are made, after a first cached call,
to one model of each new family: cache-on must equal cache-off, and nothing stored before the
change is served after it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from promptstore import PromptStore
from promptstore.llm import PrefixCache

from llm_zoo import build, vocab_of
from transparency import assert_transparent

FAMILIES = ["mistral", "gemma2", "deepseek_v3", "qwen3_next"]  # sliding; sliding and full; MLA; Gated DeltaNet
ATOL = 1e-4


def _first_linear(model):
    return next(m for m in model.modules() if isinstance(m, torch.nn.Linear))


def _edit_weight(model):
    with torch.no_grad():
        _first_linear(model).weight[0, 0] += 0.5  # in place: no new Parameter, no version counter bump via .data


def _hook(model):
    _first_linear(model).register_forward_hook(lambda mod, args, out: out * 1.25)


def _norm_eps(model):
    for m in model.modules():
        for attr in ("variance_epsilon", "eps"):
            if isinstance(getattr(m, attr, None), float):
                setattr(m, attr, 0.5)


def _head_through_data(model):
    model.lm_head.weight.data.mul_(0.75)  # through .data, which torch's version counter never sees


CHANGES = {"weight edited in place": _edit_weight, "forward hook": _hook, "norm epsilon": _norm_eps,
           "head scaled through .data": _head_through_data}


@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("family", FAMILIES)
def test_a_live_change_after_a_cached_call_misses_and_equals_a_recompute(family, change, tmp_path):
    model, why = build(family)
    assert model is not None, why
    ids = np.random.default_rng(0).integers(1, vocab_of(model), 30).tolist()
    with PromptStore(tmp_path / "store", memory_bytes="64MiB") as store:
        pc = PrefixCache(model, None, store=store, block_tokens=8)
        pc.prefill(ids)
        pc.prefill(ids)
        assert pc.stats["last"]["served"] == len(ids) - 1  # cached before the change
        CHANGES[change](model)
        served = []

        def cached():
            out = pc.prefill(ids)[1]
            served.append(pc.stats["last"]["served"])
            return out

        def plain():
            with torch.no_grad():
                return model(torch.as_tensor([ids])).logits[0, -1]

        assert_transparent(cached, plain, atol=ATOL, what=f"{family}, {change}")
        assert served == [0, len(ids) - 1]  # nothing from before the change; then what the first run stored
