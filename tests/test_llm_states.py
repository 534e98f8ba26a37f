"""Linear-attention and SSM hybrids served exactly (issue #22): running states stored where a prefix can end.

A state layer (transformers' ``LinearAttentionLayer``: Gated DeltaNet in Qwen3-Next and
Qwen3.5, Mamba mixers in Jamba, Nemotron-H) keeps a fixed-size state instead of per-token KV.
PrefixCache stores it at each request's end (and before its last token) and every
``STATE_EVERY_TOKENS`` while a miss is computed; a lookup restores the longest prefix for which
every layer's state and every attention layer's KV are stored.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from promptstore import PromptStore
from promptstore.errors import UnsupportedModelError
from promptstore.llm import PrefixCache

from llm_zoo import build, vocab_of
from transparency import assert_same, assert_transparent

ATOL = 1e-4
HYBRIDS = ["qwen3_next", "jamba", "nemotron_h", "lfm3", "falcon_h1"]  # DeltaNet; Mamba; cache-less layers; sliding; state and KV in one layer


@pytest.fixture
def store(tmp_path):
    with PromptStore(tmp_path / "store", memory_bytes="64MiB") as s:
        yield s


@pytest.fixture(scope="module")
def models():
    built = {}
    for name in HYBRIDS:
        model, why = build(name)
        assert model is not None, why
        built[name] = model
    return built


def plain(model, ids):
    with torch.no_grad():
        return model(torch.as_tensor([ids])).logits[0, -1]


def greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.as_tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0].tolist()


def test_the_hybrids_here_keep_running_states_beside_kv(models):
    from transformers import DynamicCache

    for name, model in models.items():
        kinds = {type(layer).__name__ for layer in DynamicCache(config=model.config).layers}
        both = "LinearAttentionAndFullAttentionLayer" in kinds  # a state and KV in each layer
        assert both or ("LinearAttentionLayer" in kinds and kinds & {"DynamicLayer", "DynamicSlidingWindowLayer"}), \
            (name, kinds)


@pytest.mark.parametrize("name", HYBRIDS)
def test_a_document_then_questions_after_it_equal_a_recompute(name, models, store):
    """The document alone, then questions after it: each resumes from the state at the document's end."""
    model = models[name]
    vocab = vocab_of(model)
    rng = np.random.default_rng(0)
    doc = rng.integers(1, vocab, 45).tolist()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    assert_same(pc.prefill(doc)[1], plain(model, doc), ATOL, f"{name}: the document")
    for q in range(3):
        ids = doc + rng.integers(1, vocab, 5 + q).tolist()
        assert_transparent(lambda ids=ids: pc.prefill(ids)[1], lambda ids=ids: plain(model, ids), atol=ATOL,
                           what=f"{name}: question {q}")
        assert pc.stats["last"]["served"] == len(ids) - 1  # the second run: the state before the last token
    pc.prefill(doc + [3, 4, 5, 6])
    assert pc.stats["last"]["served"] == len(doc)  # the state where the document ended


@pytest.mark.parametrize("name", HYBRIDS)
def test_generation_and_a_continued_chat_equal_a_recompute(name, models, store):
    model = models[name]
    vocab = vocab_of(model)
    prompt = np.random.default_rng(1).integers(1, vocab, 30).tolist()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    want = greedy(model, prompt, 12)
    for _ in range(2):
        out = pc.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
        assert_same(out[0].tolist(), want, 0, f"{name}: greedy tokens")
    assert pc.stats["last"]["served"] == len(prompt) - 1
    turn = want + [7, 8, 9]
    assert_same(pc.prefill(turn)[1], plain(model, turn), ATOL, f"{name}: next turn")
    assert pc.stats["last"]["served"] == len(want) - 1  # the state generate left, before its last token


def test_a_miss_stores_states_every_so_often_and_a_diverging_prompt_resumes_from_the_last(models, store, monkeypatch):
    import promptstore.llm._prefix as prefix

    monkeypatch.setattr(prefix, "STATE_EVERY_TOKENS", 16)
    model = models["qwen3_next"]
    vocab = vocab_of(model)
    rng = np.random.default_rng(2)
    a = rng.integers(1, vocab, 50).tolist()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    pc.prefill(a)
    states = {int(e.key.hex(), 16) for e in store.ls("llm.state")}
    assert len(states) == 5  # after 16, 32 and 48 tokens, before the last one and after it
    b = a[:40] + rng.integers(1, vocab, 6).tolist()  # leaves `a` inside its fifth block
    assert_same(pc.prefill(b)[1], plain(model, b), ATOL, "a prompt that diverges past a stored state")
    assert pc.stats["last"]["served"] == 32  # KV runs to 40 tokens; the last state before it is at 32


def test_a_stored_state_that_does_not_fit_is_a_miss_never_a_crash(models, store):
    model = models["qwen3_next"]
    doc = np.random.default_rng(3).integers(1, vocab_of(model), 20).tolist()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    pc.prefill(doc)
    for info in store.ls("llm.state"):  # the same keys, each state tensor cut short
        entry = store.get(info.key, kind="llm.state")
        bad = {n: np.ascontiguousarray(t[..., :1]) for n, t in entry.tensors.items()}
        store.delete(info.key)
        store.put(info.key, bad, kind="llm.state")
    ids = doc + [5, 6, 7]
    assert_same(pc.prefill(ids)[1], plain(model, ids), ATOL, "after states of another shape")
    assert pc.stats["last"]["served"] == 0


def test_a_pure_ssm_model_is_refused_before_anything_is_stored(store):
    model, why = build("mamba")
    assert model is not None, why
    with pytest.raises(UnsupportedModelError, match="running state"):
        PrefixCache(model, None, store=store)
    assert not store.ls("llm.kv") and not store.ls("llm.state")


def test_chunkcache_refuses_running_states(models, store):
    from promptstore.llm import ChunkCache

    with pytest.raises(UnsupportedModelError, match="SSM"):
        ChunkCache(models["qwen3_next"], None, store=store)


def test_patched_state_layer_code_is_another_key(models, store, monkeypatch):
    """The state layers' cache code runs in every forward: patched, nothing stored before is served,
    and the model is checked again (a miss runs in pieces: exact only for code that passed the check)."""
    from transformers import cache_utils

    model = models["qwen3_next"]
    doc = np.random.default_rng(4).integers(1, vocab_of(model), 30).tolist()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    pc.prefill(doc)
    ids = doc + [5, 6, 7]
    original = cache_utils.LinearAttentionLayer.update_recurrent_state
    monkeypatch.setattr(cache_utils.LinearAttentionLayer, "update_recurrent_state",
                        lambda self, s, *a, **kw: original(self, s, *a, **kw))  # other code, the same numbers
    assert_same(pc.prefill(ids)[1], plain(model, ids), ATOL, "after the state code was replaced")
    assert pc.stats["last"]["served"] == 0
    monkeypatch.setattr(cache_utils.LinearAttentionLayer, "update_recurrent_state",
                        lambda self, s, *a, **kw: original(self, s + 1.0, *a, **kw))  # pieces differ from one pass
    kept = {e.key for e in store.ls("llm.state")}
    with pytest.raises(UnsupportedModelError, match="in pieces"):
        pc.prefill(ids)
    assert {e.key for e in store.ls("llm.state")} == kept  # refused before anything was stored
