"""Weight edits between calls: after each, cache-on equals cache-off, for both adapters (issue #10).

Detected edits (all by hashing every weight and buffer on every call): in-place under no_grad,
``.data`` assignment, in-place writes on ``.data``, ``.half()`` then ``.float()``, ``.to()``,
``load_state_dict``, a submodule swapped, and a merged LoRA adapter (peft). The first call
after an edit must miss the old entries, and its result must equal a plain recompute.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP

import promptstore._digest as digest
from promptstore import PromptStore
from promptstore.llm import PrefixCache
from promptstore.llm._model import _make_resident
from promptstore.vision import OpenCLIPTextEncoder, set_classes

from transparency import assert_transparent
from vision_ref import detector, reference_pe

EDITS = ["no_grad_in_place", "data_assignment", "in_place_on_data", "half_then_float", "to_float64",
         "load_state_dict", "submodule_swap", "lora_merge"]


def _llama(seed: int = 0, hidden: int = 64) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)).eval()


def _mapped_llama(folder, monkeypatch) -> LlamaForCausalLM:
    """A model loaded from safetensors files, its weights still the file's pages (the fingerprint's shortcut, #12)."""
    monkeypatch.setattr(digest, "_RACY_S", 0.0)  # the files were written just now: let their digests be memoised
    monkeypatch.setenv("PROMPTSTORE_DIGESTS", str(folder / "digests.sqlite3"))
    _llama(hidden=256).save_pretrained(folder / "model")
    model = LlamaForCausalLM.from_pretrained(folder / "model").eval()
    _make_resident(model)  # what load_model does: the pages read in
    q = model.model.layers[0].self_attn.q_proj.weight
    pages = digest._Pages()
    assert pages.file_range(q.data_ptr(), q.numel() * q.element_size()) is not None, "weights are not file-mapped"
    pages.close()
    return model


def _edit(module: torch.nn.Module, weight: torch.nn.Parameter, how: str, other: torch.nn.Module,
          swap: tuple[torch.nn.Module, str, torch.nn.Module]) -> torch.nn.Module:
    """Apply one kind of edit; returns the module to use afterwards."""
    if how == "no_grad_in_place":
        with torch.no_grad():
            weight.add_(0.02)
    elif how == "data_assignment":
        weight.data = weight.data + 0.02
    elif how == "in_place_on_data":
        weight.data[0] += 0.5  # moves neither the version counter nor the data pointer
    elif how == "half_then_float":
        module.half().float()
    elif how == "to_float64":
        module.to(torch.float64)
    elif how == "load_state_dict":
        module.load_state_dict(other.state_dict())
    elif how == "submodule_swap":
        parent, name, new = swap
        setattr(parent, name, new)
    elif how == "lora_merge":
        peft = pytest.importorskip("peft")
        lora = peft.get_peft_model(module, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():
            for n, p in lora.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)  # peft starts B at zero: a merge would change nothing
        module = lora.merge_and_unload()
    return module


@pytest.mark.parametrize("source", ["built", "mapped"])
@pytest.mark.parametrize("how", EDITS)
def test_llm_edit_is_detected(how, source, tmp_path, monkeypatch):
    """Built in memory (hashed every time) or loaded from files (named by the files while their pages are untouched)."""
    model = _llama() if source == "built" else _mapped_llama(tmp_path, monkeypatch)
    hidden = model.config.hidden_size
    ids = np.random.default_rng(0).integers(0, 300, 50).tolist()
    with PromptStore(tmp_path / "s") as store:
        PrefixCache(model, None, store=store, block_tokens=8).prefill(ids)  # blocks of the unedited weights
        swap = (model.model.layers[1], "mlp", LlamaMLP(model.config))
        model = _edit(model, model.model.layers[0].self_attn.q_proj.weight, how, _llama(seed=1, hidden=hidden),
                      swap).eval()
        served = _served_after(model, store, ids, f"scores after {how}")
        assert served == [0, len(ids) - 1], served  # the old entries missed, the new ones then hit (all but the last token)


def _served_after(model, store, ids, what):
    """Cache-on equals cache-off for ``model`` (run twice); returns the tokens served each time."""
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    served = []

    def cached():
        logits = pc.prefill(ids)[1]
        served.append(pc.stats["last"]["served"])
        return logits

    def plain():
        with torch.no_grad():
            return model(torch.as_tensor([ids])).logits[0, -1]

    assert_transparent(cached, plain, atol=1e-4, what=what)
    return served


def _yoloe_parts(model):
    head = model.model.model[-1]
    return head, head.reprta.m.w3.weight


@pytest.mark.parametrize("how", [e for e in EDITS if e not in ("lora_merge", "to_float64")])
def test_detector_head_edit_is_detected(how, tmp_path):
    encoder = OpenCLIPTextEncoder("MobileCLIP2-B")
    names = ["forklift", "pallet", "stop!~", "hard hat"]
    model = detector("yoloe-11s-seg.yaml")
    with PromptStore(tmp_path / "s") as store:
        set_classes(model, names, store=store, encoder=encoder)  # entries of the unedited head
        head, weight = _yoloe_parts(model)
        other = detector("yoloe-11s-seg.yaml", seed=1)
        from ultralytics.nn.modules.block import Residual, SwiGLUFFN

        torch.manual_seed(5)
        swap = (head, "reprta", Residual(SwiGLUFFN(head.embed, head.embed)))
        _edit(head, weight, how, other.model.model[-1], swap)
        reports = []

        def cached():
            reports.append(set_classes(model, names, store=store, encoder=encoder))
            return model.model.pe[0].float().numpy()

        assert_transparent(cached, lambda: reference_pe(model, encoder, names), atol=1e-5,
                           what=f"class embeddings after {how}")
        assert reports[0].hits == 0 and reports[0].text_hits == len(names)  # head changed, encoder did not
        assert reports[1].from_set


PATCHED = '''
import torch
from transformers import LlamaForCausalLM as _Base


class ScaledEmbedding(torch.nn.Embedding):
    def forward(self, ids):
        return super().forward(ids) * 1.5


class LlamaForCausalLM(_Base):  # same name, config and weights as the stock class; other code
    def __init__(self, config):
        super().__init__(config)
        old = self.model.embed_tokens
        self.model.embed_tokens = ScaledEmbedding(old.num_embeddings, old.embedding_dim, old.padding_idx)
'''


def test_other_code_with_the_same_name_config_and_weights_misses(tmp_path, monkeypatch):
    """The fingerprint names the code too: a same-named class from another file computes other KV."""
    (tmp_path / "patched_llama.py").write_text(PATCHED)
    monkeypatch.syspath_prepend(str(tmp_path))
    import patched_llama

    stock = _llama()
    other = patched_llama.LlamaForCausalLM(stock.config).eval()
    other.load_state_dict(stock.state_dict())
    assert type(other).__name__ == type(stock).__name__
    ids = np.random.default_rng(3).integers(0, 300, 50).tolist()
    with PromptStore(tmp_path / "s") as store:
        PrefixCache(stock, None, store=store, block_tokens=8).prefill(ids)
        served = _served_after(other, store, ids, "scores of other code")
        assert served == [0, len(ids) - 1]
