"""Reuse or recompute (PrefixCache's reuse="auto", llm/_decide.py): both branches equal a recompute, and the
measured rates decide."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from promptstore import PromptStore
from promptstore.errors import InvalidInputError
from promptstore.llm import PrefixCache
from promptstore.llm._decide import DEFAULT_RHO, MIN_MEASURED_TOKENS, RATES_KIND, Rates, Work

from conftest import run_python
from models import full_logits, greedy
from test_llm import ATOL, tiny_model


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


def prompts(shared: int, total: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """A stored prompt, and a request sharing its first ``shared`` tokens out of ``total``."""
    rng = np.random.default_rng(seed)
    stored = rng.integers(0, 500, shared + 1).tolist()
    return stored, stored[:shared] + rng.integers(0, 500, total - shared).tolist()


def test_a_small_share_of_a_long_prompt_is_recomputed_and_equals_the_plain_scores(tiny, store):
    stored, ids = prompts(40, 800)
    pc = PrefixCache(tiny, store=store, block_tokens=16)
    pc.prefill(stored)
    _, logits = pc.prefill(ids)
    assert pc.stats["last"]["served"] == 0 and pc.stats["last"]["declined"] == 40
    assert pc.stats["last"]["computed"] == 800
    assert (logits - full_logits(tiny, ids)).abs().max().item() <= ATOL
    other = stored[:40] + np.random.default_rng(9).integers(0, 500, 660).tolist()
    out = pc.generate(other, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert pc.stats["last"]["served"] == 0 and pc.stats["last"]["declined"] == 40
    assert out[0].tolist() == greedy(tiny, other, n=4)


def test_a_large_share_is_served_and_equals_the_plain_scores(tiny, store):
    stored, ids = prompts(600, 800, seed=1)
    pc = PrefixCache(tiny, store=store, block_tokens=16)
    pc.prefill(stored)
    _, logits = pc.prefill(ids)
    assert pc.stats["last"]["served"] == 600 and pc.stats["last"]["declined"] == 0
    assert (logits - full_logits(tiny, ids)).abs().max().item() <= ATOL


def test_reuse_always_serves_any_stored_prefix(tiny, store):
    stored, ids = prompts(40, 800, seed=2)
    pc = PrefixCache(tiny, store=store, block_tokens=16, reuse="always")
    pc.prefill(stored)
    _, logits = pc.prefill(ids)
    assert pc.stats["last"]["served"] == 40 and pc.stats["last"]["declined"] == 0
    assert (logits - full_logits(tiny, ids)).abs().max().item() <= ATOL


@pytest.mark.parametrize("bad", ["never", None, True, "AUTO"])
def test_a_bad_reuse_setting_is_refused(tiny, store, bad):
    with pytest.raises(InvalidInputError, match="reuse"):
        PrefixCache(tiny, store=store, reuse=bad)


def put_rates(store: PromptStore, model, full: float, tail: float) -> None:
    rates = Rates(store, model, torch.float32, torch.device("cpu"))
    store.put(rates.key, {"full": np.full(3, full), "tail": np.full(3, tail)}, kind=RATES_KIND)


@pytest.mark.parametrize(("rho", "shared", "served"), [(3.0, 400, 0), (0.5, 40, 40), (1.0, 400, 400)])
def test_the_measured_rates_decide(tiny, store, rho, shared, served):
    """A setting whose forwards over stored KV measured 3x slower per unit of work declines half a prompt;
    one where they measured faster serves even a small share."""
    put_rates(store, tiny, 1e-9, rho * 1e-9)
    stored, ids = prompts(shared, 800, seed=3)
    pc = PrefixCache(tiny, store=store, block_tokens=16)
    pc.prefill(stored)
    _, logits = pc.prefill(ids)
    assert pc.stats["last"]["served"] == served and pc.stats["last"]["declined"] == shared - served
    assert (logits - full_logits(tiny, ids)).abs().max().item() <= ATOL


def test_rates_are_measured_kept_in_the_store_and_read_by_a_fresh_process(tiny, store, tmp_path):
    """Also when this process runs another number of threads than a fresh one (libraries set it)."""
    pc = PrefixCache(tiny, store=store, block_tokens=16)
    stored, ids = prompts(600, 800, seed=4)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        pc.prefill(stored)  # a full prefill of 601 tokens
        pc.prefill(ids)  # 200 tokens over 600 served
        pc.prefill(stored[:5] + [1])  # too short to measure
        store.flush()
        rates = Rates(store, tiny, torch.float32, torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
    assert len(rates.samples["full"]) == 1 and len(rates.samples["tail"]) == 1
    assert rates.rho() != DEFAULT_RHO and rates.rho() > 0  # measured (its value is the machine's, not asserted)
    code = """
    import sys, torch
    sys.path.insert(0, "tests")
    from promptstore import PromptStore
    from promptstore.llm._decide import Rates
    from test_llm import tiny_model
    with PromptStore(sys.argv[1]) as store:
        print(Rates(store, tiny_model(), torch.float32, torch.device("cpu")).rho())
    """
    assert float(run_python(code, str(tmp_path / "store")).stdout.split()[-1]) == pytest.approx(rates.rho())


def test_work_counts_weights_and_attention():
    model = tiny_model()
    work = Work(model)
    assert work.layers == 3 and work.width == 64
    assert work.params == sum(p.numel() for p in model.model.layers.parameters()) + model.model.norm.weight.numel()
    # From no cache the causal half; over a served prefix every new position against every key.
    attention = 4 * work.layers * work.width
    assert work(0, 800) == pytest.approx(2 * work.params * 800 + attention * 799 * 800 / 2)
    assert work(100, 800) == pytest.approx(2 * work.params * 700 + attention * 800 * 700)
    # So a small served share costs more work than it saves.
    assert work(100, 800) > work(0, 800) - work(0, 100)
    assert work(5, 5) == 0.0 and MIN_MEASURED_TOKENS > 0


def test_rho_compares_seconds_per_unit_of_work(tiny, store):
    """A forward over 400 served tokens that took as long as a full prefill of all 800 did the less work,
    so it ran slower per unit: rho is the ratio of seconds per unit of work, not of seconds."""
    rates = Rates(store, tiny, torch.float64, torch.device("cpu"))
    assert rates.rho() == DEFAULT_RHO
    rates.record(0, 800, 2.0)
    rates.record(400, 800, 2.0)
    rates.record(790, 800, 5.0)  # too few tokens to measure
    assert rates.rho() == pytest.approx(rates.work(0, 800) / rates.work(400, 800))
    assert not rates.reuse(400, 800) and not rates.reuse(0, 800)
