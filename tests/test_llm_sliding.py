"""Sliding-window attention served exactly (issue #22).

Blocks hold every token's KV, as for full attention; a restored sliding layer keeps them all and
hands attention what transformers' ``DynamicSlidingWindowLayer`` would after a one-pass prefill.
Windows here are short (12 tokens) so that prompts, block boundaries and generation cross them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from promptstore.errors import UnsupportedModelError
from promptstore.llm import PrefixCache

from llm_zoo import greedy_tokens as greedy
from llm_zoo import plain_scores as plain
from transparency import assert_same, assert_transparent

WINDOW = 12
ATOL = 1e-4


def _small(**extra):
    return {**dict(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2), **extra}


def mistral(window=WINDOW, seed=0):
    """Every layer sliding."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    return MistralForCausalLM(MistralConfig(**_small(sliding_window=window))).eval()


def gemma2(seed=0):
    """Sliding and full layers alternating, soft-capped scores."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(seed)
    return Gemma2ForCausalLM(Gemma2Config(**_small(head_dim=16, sliding_window=WINDOW, num_hidden_layers=3))).eval()


def qwen2_hybrid(seed=0):
    """Full layers below ``max_window_layers``, sliding above."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(**_small(num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1))
    return Qwen2ForCausalLM(cfg).eval()


MODELS = {"mistral": mistral, "gemma2": gemma2, "qwen2_hybrid": qwen2_hybrid}


def layer_kinds(model):
    from transformers import DynamicCache

    return [type(layer).__name__ for layer in DynamicCache(config=model.config).layers]


def test_the_models_here_have_the_layers_they_are_named_for():
    assert set(layer_kinds(mistral())) == {"DynamicSlidingWindowLayer"}
    assert set(layer_kinds(gemma2())) == {"DynamicSlidingWindowLayer", "DynamicLayer"}
    assert set(layer_kinds(qwen2_hybrid())) == {"DynamicSlidingWindowLayer", "DynamicLayer"}
    ids = np.random.default_rng(0).integers(1, 500, 40).tolist()
    model = mistral()
    # The window changes the scores: a test that ran within it would prove nothing.
    assert float((plain(model, ids) - plain(mistral(window=4096), ids)).abs().max()) > 1e-2


@pytest.mark.parametrize("restored", [0, 5, 11, 12, 13, 30])
def test_a_restored_sliding_layer_hands_attention_what_transformers_layer_does(restored):
    """Against ``DynamicSlidingWindowLayer`` itself: each update's keys and values, mask sizes and length."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from promptstore.llm._buffers import reserved_layer_classes

    sliding = reserved_layer_classes()["DynamicSlidingWindowLayer"]
    gen = torch.Generator().manual_seed(restored)
    steps = [restored, 1, 7, 1, 20, 1, 1]
    chunks = [(torch.randn(1, 2, n, 16, generator=gen), torch.randn(1, 2, n, 16, generator=gen)) for n in steps]
    theirs = DynamicSlidingWindowLayer(WINDOW)
    if restored:
        theirs.update(*chunks[0])
    # Room for two more tokens only: the buffer must grow on the way.
    kbuf, vbuf = torch.zeros(1, 2, restored + 2, 16), torch.zeros(1, 2, restored + 2, 16)
    kbuf[:, :, :restored], vbuf[:, :, :restored] = chunks[0]
    ours = sliding(kbuf, vbuf, restored, theirs)
    for k, v in chunks[1:]:
        q = k.shape[-2]
        assert ours.get_mask_sizes(q) == theirs.get_mask_sizes(q)
        assert ours.get_seq_length() == theirs.get_seq_length()
        got, want = ours.update(k, v), theirs.update(k, v)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
    # Every token's KV is still there, for the blocks stored after a request.
    everything = torch.cat([k for k, _ in chunks], dim=-2)
    assert torch.equal(ours.keys, everything)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("block_tokens", [4, 8, 16])
def test_prompts_past_the_window_equal_a_recompute(name, block_tokens, store):
    """Lengths inside and past the window; block boundaries inside it, at it and past it; unaligned divergence."""
    model = MODELS[name]()
    pc = PrefixCache(model, None, store=store, block_tokens=block_tokens)
    rng = np.random.default_rng(1)
    base = rng.integers(1, 500, 61).tolist()
    other = rng.integers(1, 500, 9).tolist()
    for ids in (base[:5], base[:WINDOW - 1], base[:WINDOW], base[:WINDOW + 1], base, base[:2 * block_tokens],
                base[:2 * block_tokens + 1], base[:29] + other, base[:3] + other):
        assert_transparent(lambda ids=ids: pc.prefill(ids)[1], lambda ids=ids: plain(model, ids), atol=ATOL,
                           what=f"{name}, {len(ids)} tokens")
        assert pc.stats["last"]["served"] == len(ids) - 1  # the second run: all but the last token from the store
    pc.prefill(base)
    assert pc.stats["last"]["served"] == len(base) - 1


@pytest.mark.parametrize("name", sorted(MODELS))
def test_generation_past_the_window_and_a_continued_chat_equal_a_recompute(name, store):
    model = MODELS[name]()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    prompt = np.random.default_rng(2).integers(1, 500, 2 * WINDOW + 3).tolist()
    n = 2 * WINDOW  # generation runs a whole window past the prompt
    want = greedy(model, prompt, n)
    for _ in range(2):  # cold, then served
        out = pc.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        assert_same(out[0].tolist(), want, 0, f"{name}: greedy tokens")
    assert pc.stats["last"]["served"] == len(prompt) - 1
    # The next turn: the generated text, then a new message. Generated blocks are served.
    turn = want + np.random.default_rng(3).integers(1, 500, 7).tolist()
    assert_same(pc.prefill(turn)[1], plain(model, turn), ATOL, f"{name}: next turn")
    assert pc.stats["last"]["served"] >= (len(want) - 1) // 8 * 8
    reply = greedy(model, turn, 5)
    assert_same(pc.generate(turn, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)[0].tolist(),
                reply, 0, f"{name}: the next turn's reply")


def test_a_model_whose_cache_ignores_its_window_is_refused_before_anything_is_stored(store):
    """Moshi's decoder masks as if it had no window while its cache keeps one: pieces differ from one pass."""
    from llm_zoo import build

    model, why = build("moshi")
    assert model is not None, why
    with pytest.raises(UnsupportedModelError, match="in pieces"):
        PrefixCache(model, None, store=store, block_tokens=8)
    assert not store.ls("llm.kv")


def test_a_restored_window_is_not_served_to_another_window(store):
    """The window is the model's: blocks stored with one are never served with another."""
    ids = np.random.default_rng(4).integers(1, 500, 40).tolist()
    a, b = mistral(window=WINDOW), mistral(window=WINDOW + 4)  # the same weights
    PrefixCache(a, None, store=store, block_tokens=8).prefill(ids)
    pc = PrefixCache(b, None, store=store, block_tokens=8)
    assert_same(pc.prefill(ids)[1], plain(b, ids), ATOL, "another window")
    assert pc.stats["last"]["served"] == 0


# -- keys and values of different widths (multi-head latent attention) ------------------------------
@pytest.mark.parametrize("model_type", ["deepseek_v3", "minicpm3"])
def test_keys_and_values_of_different_widths_are_stored_apart_and_equal_a_recompute(model_type, store):
    from llm_zoo import build

    model, why = build(model_type)
    assert model is not None, why
    vocab = model.get_input_embeddings().num_embeddings
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    _, _, k_dim, v_dim, _ = pc.engine.layout()
    assert k_dim != v_dim  # what this test is for
    rng = np.random.default_rng(5)
    base = rng.integers(1, vocab, 45).tolist()
    for ids in (base[:20], base, base[:13] + rng.integers(1, vocab, 6).tolist()):
        assert_transparent(lambda ids=ids: pc.prefill(ids)[1], lambda ids=ids: plain(model, ids), atol=ATOL,
                           what=f"{model_type}, {len(ids)} tokens")
        assert pc.stats["last"]["served"] == len(ids) - 1
    stored = [store.get(e.key, kind="llm.kv") for e in store.ls("llm.kv")]
    blocks = [e for e in stored if "k" in e.tensors]
    assert blocks and all(e.tensors["k"].shape[-1] == k_dim and e.tensors["v"].shape[-1] == v_dim for e in blocks)
    out = pc.generate(base, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    assert_same(out[0].tolist(), greedy(model, base, 6), 0, f"{model_type}: greedy tokens")


def test_chunkcache_refuses_a_sliding_window_model_before_anything_is_stored(store):
    from promptstore.llm import ChunkCache

    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        ChunkCache(mistral(), None, store=store)
    assert not store.ls("llm.kv")


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_a_one_token_prompt_equals_a_recompute(name, store):
    """Nothing to look up: a fresh cache's first request runs into buffers allocated for the miss alone."""
    model = MODELS[name]()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    assert_same(pc.prefill([7])[1], plain(model, [7]), ATOL, f"{name}: prefill of one token")
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    out = pc.generate([9], max_new_tokens=14, min_new_tokens=14, do_sample=False, pad_token_id=0)
    assert_same(out[0].tolist(), greedy(model, [9], 14), 0, f"{name}: generation from one token")
