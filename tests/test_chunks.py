"""ChunkCache: passages reused anywhere in a prompt, against transformers computing the same ids.

The exact cases are differential: ``recompute=1.0`` against a full prefill, over several
architectures, passage orders and selections; a single passage right after the anchor against
PrefixCache's exact reuse. The approximate settings are checked for what they promise (the
question and the chosen tokens computed, approximate KV never stored as exact prefix blocks);
their quality is measured by bench/chunk_quality.py, not asserted here.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from promptstore import PromptStore
from promptstore.errors import InvalidInputError, UnsupportedModelError
from promptstore.llm import ChunkCache, PrefixCache
from promptstore.llm._chunks import (
    CHUNK_KIND,
    GUARD_EXACT_ABOVE,
    GUARD_FALL,
    GUARD_SAFETY,
    _kl,
    _rotary_frequencies,
    _rotate,
)
from promptstore.llm._decide import GUARD_PROBE_EVERY

import llm_zoo
from conftest import run_python
from models import full_logits, tiny_llama

ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


def segments(vocab: int, seed: int, sizes=(37, 50, 23, 41)) -> tuple[list[int], list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    anchor = rng.integers(1, vocab, 11).tolist()
    passages = [rng.integers(1, vocab, n).tolist() for n in sizes]
    question = rng.integers(1, vocab, 7).tolist()
    return anchor, passages, question


def kv_of(out):
    """The cache a forward returned (transformers 5.24 calls it ``cache``, earlier ones ``past_key_values``)."""
    return out.cache if getattr(out, "cache", None) is not None else out.past_key_values


def run_orders(model, store, recompute, select, vocab, seed=0):
    """Every passage order in turn (the first request stores the passages): max score difference per request."""
    cc = ChunkCache(model, store=store, recompute=recompute, select=select)
    anchor, passages, question = segments(vocab, seed)
    diffs = []
    for order in ([0, 1, 2, 3], [3, 1, 0, 2], [2, 3, 1, 0]):
        segs = [anchor, *[passages[i] for i in order], question]
        ids = [t for s in segs for t in s]
        cache, logits = cc.prefill(segs)
        assert cache.get_seq_length() == len(ids)
        last = cc.stats["last"]
        assert last["served"] + last["recomputed"] + last["computed"] == last["queried"] == len(ids)
        diffs.append((logits - full_logits(model, ids)).abs().max().item())
    return cc, diffs


@pytest.mark.parametrize("select", ["recent", "blend", "first"])
def test_recompute_all_equals_a_full_prefill(tiny, store, select):
    cc, diffs = run_orders(tiny, store, 1.0, select, 500)
    assert max(diffs) <= ATOL
    assert cc.stats["last"]["recomputed"] > 0  # passages did come from the store, then were recomputed


# Families with rotate-half RoPE that PrefixCache serves, one each; partial rotary included (stablelm, persimmon).
ORACLE_TYPES = ["llama", "qwen2", "qwen3", "gemma", "olmo2", "stablelm", "persimmon", "granite", "phi", "gpt_neox",
                "falcon", "glm4_moe"]


@pytest.mark.parametrize("model_type", ORACLE_TYPES)
def test_recompute_all_equals_a_full_prefill_across_architectures(model_type, store):
    model, why = llm_zoo.build(model_type)
    assert model is not None, why
    vocab = llm_zoo.vocab_of(model)
    cc, diffs = run_orders(model, store, 1.0, "blend", vocab, seed=1)
    assert max(diffs) <= ATOL * max(1.0, float(full_logits(model, list(range(1, 9))).abs().max()))
    # Moved without recompute, layer 0 (which sees no other token's state) must equal a direct
    # computation at the new positions: the rotation of stored keys is exact for this architecture.
    anchor, passages, question = segments(vocab, 1)
    segs = [anchor, passages[3], passages[1], passages[0], passages[2], question]
    cache, _ = ChunkCache(model, store=store, recompute=0.0).prefill(segs)
    with torch.no_grad():
        ref = model(torch.as_tensor([[t for s in segs for t in s]]), use_cache=True)
    ref_cache = kv_of(ref)
    k, rk = cache.layers[0].keys, ref_cache.layers[0].keys
    v, rv = cache.layers[0].values, ref_cache.layers[0].values
    scale = max(1.0, rk.abs().max().item())
    assert (k - rk).abs().max().item() <= 1e-5 * scale and (v - rv).abs().max().item() <= 1e-5 * scale


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_both_attention_kernels_take_the_recompute_mask(impl, store):
    model = tiny_llama(attn_implementation=impl)
    _, diffs = run_orders(model, store, 1.0, "recent", 500, seed=2)
    assert max(diffs) <= ATOL


def test_a_single_passage_after_the_anchor_equals_prefix_reuse(tiny, tmp_path):
    anchor, passages, question = segments(500, 3)
    with PromptStore(tmp_path / "a") as a, PromptStore(tmp_path / "b") as b:
        cc = ChunkCache(tiny, store=a, recompute=0.0)
        cc.prefill([anchor, passages[0], [9, 9]])  # stores the anchor blocks and the passage
        _, chunk_logits = cc.prefill([anchor, passages[0], question])
        assert cc.stats["last"]["computed"] == len(question)
        pc = PrefixCache(tiny, store=b)
        pc.prefill(anchor + passages[0] + [9, 9])
        _, prefix_logits = pc.prefill(anchor + passages[0] + question)
        assert pc.stats["last"]["served"] == cc.stats["last"]["served"]
    # Not bit-equal: the passage was computed in its own forward (another split of the same tokens),
    # which moves float rounding at the 1e-7 level, as transformers alone does for any split.
    assert (chunk_logits - prefix_logits).abs().max().item() <= 1e-5


def test_moved_keys_equal_keys_computed_at_the_new_position(tiny):
    """Layer 0 sees no other token's state: a moved passage's layer-0 KV must equal a direct computation."""
    inv = _rotary_frequencies(tiny)
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        at0 = kv_of(tiny(ids, use_cache=True)).layers[0].keys[0].clone()
        at300 = kv_of(tiny(ids, position_ids=torch.arange(300, 337)[None], use_cache=True)).layers[0].keys[0]
    _rotate(at0, np.arange(37), np.arange(300, 337), inv)
    assert (at0 - at300).abs().max().item() <= 1e-5


def test_question_and_chosen_tokens_are_computed_and_nothing_approximate_is_stored_as_exact(tiny, store):
    anchor, passages, question = segments(500, 4)
    cc = ChunkCache(tiny, store=store, recompute=0.25, select="recent")
    cc.prefill([anchor, *passages, question])  # stores the anchor and every passage
    segs = [anchor, passages[2], passages[0], passages[3], passages[1], question]
    _, logits = cc.prefill(segs)
    last = cc.stats["last"]
    moved = sum(len(p) for p in (passages[0], passages[3], passages[1]))
    assert last["computed"] == len(question)
    assert last["recomputed"] == round(0.25 * moved)
    assert last["served"] == len(anchor) + len(passages[2]) + moved - last["recomputed"]
    # Approximate KV (moved passages) is never served as an exact prefix.
    pc = PrefixCache(tiny, store=store)
    ids = [t for s in segs for t in s]
    pc.lookup(ids)
    _, exact = pc.prefill(ids)
    assert pc.stats["last"]["served"] <= len(anchor) + len(passages[2])
    assert (exact - full_logits(tiny, ids)).abs().max().item() <= ATOL
    assert store.ls(kind=CHUNK_KIND)


def test_generate_with_recompute_all_equals_model_generate(tiny, store):
    anchor, passages, question = segments(500, 5)
    cc = ChunkCache(tiny, store=store, recompute=1.0)
    cc.prefill([anchor, *passages, question])
    segs = [anchor, passages[1], passages[3], passages[0], question]
    ids = [t for s in segs for t in s]
    out = cc.generate(segs, max_new_tokens=12, do_sample=False)
    with torch.no_grad():
        ref = tiny.generate(torch.as_tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                            max_new_tokens=12, do_sample=False)
    assert out[0].tolist() == ref[0].tolist()
    assert cc.stats["last"]["recomputed"] > 0


@pytest.mark.parametrize("model_type,why", [
    ("gpt2", "no rotary"),          # learned absolute positions
    ("bloom", "no rotary"),         # ALiBi
    ("mpt", "no rotary"),           # ALiBi
    ("gptj", "no rotary"),          # RoPE from a precomputed sin/cos table
    ("cohere", "does not move"),    # interleaved RoPE: the probe finds that a rotate-half rotation is wrong for it
])
def test_models_whose_positions_cannot_move_are_refused_before_anything_is_stored(model_type, why, store):
    model, reason = llm_zoo.build(model_type)
    assert model is not None, reason
    with pytest.raises(UnsupportedModelError) as err:
        ChunkCache(model, store=store)
    text = str(err.value)
    assert ("no rotary module" in text) if why == "no rotary" else ("does not move" in text)
    assert not store.ls(kind=CHUNK_KIND)


def test_length_dependent_rope_is_refused(store):
    model = tiny_llama(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(UnsupportedModelError):
        ChunkCache(model, store=store)


def test_flash_style_kernels_without_a_mask_are_refused(store):
    model = tiny_llama()
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(UnsupportedModelError, match="sdpa"):
        ChunkCache(model, store=store)


@pytest.mark.parametrize("kwargs", [{"recompute": 1.5}, {"recompute": -0.1}, {"recompute": True}, {"select": "best"},
                                    {"max_kl": -0.1}, {"max_kl": "0.1"}, {"max_kl": float("nan")}, {"max_kl": True},
                                    {"max_kl": float("inf")}])
def test_bad_settings_are_refused(tiny, store, kwargs):
    with pytest.raises(InvalidInputError):
        ChunkCache(tiny, store=store, **kwargs)


@pytest.mark.parametrize("segs", [[], [[1, 2, 3]], "a string", [[1, 2], []], [[1, 2], [1, 10**6], [3]],
                                  [[1, 2], [[1, 2], [3, 4]], [5]], [[1, 2], [1.5, 2.0], [3]]])
def test_bad_segments_fail_before_any_work(tiny, store, segs):
    cc = ChunkCache(tiny, store=store)
    before = len(store.ls())
    with pytest.raises(InvalidInputError):
        cc.prefill(segs)
    assert len(store.ls()) == before


def test_text_segments_need_a_tokenizer(tiny, store):
    with pytest.raises(InvalidInputError, match="tokenizer"):
        ChunkCache(tiny, store=store).prefill(["system", "passage", "question"])


def test_a_damaged_passage_entry_is_a_miss_not_an_error(tiny, tmp_path):
    anchor, passages, question = segments(500, 6)
    with PromptStore(tmp_path / "s", memory_bytes=0) as s:
        cc = ChunkCache(tiny, store=s, recompute=1.0)
        cc.prefill([anchor, *passages, question])
        for path in (tmp_path / "s").rglob("*"):
            if path.is_file() and path.stat().st_size > 20000:  # the passages' KV files
                data = bytearray(path.read_bytes())
                data[len(data) // 2] ^= 0xFF
                path.write_bytes(bytes(data))
        with pytest.warns(Warning):
            _, logits = cc.prefill([anchor, passages[3], passages[0], passages[1], passages[2], question])
    ids = anchor + passages[3] + passages[0] + passages[1] + passages[2] + question
    assert (logits - full_logits(tiny, ids)).abs().max().item() <= ATOL


def test_a_fresh_process_serves_the_stored_passages(tmp_path):
    code = """
    import sys, json, torch, numpy as np
    sys.path.insert(0, sys.argv[2])
    from test_chunks import segments
    from models import full_logits, tiny_llama
    from promptstore import PromptStore
    from promptstore.llm import ChunkCache
    model = tiny_llama()
    anchor, passages, question = segments(500, 7)
    cc = ChunkCache(model, store=PromptStore(sys.argv[1]), recompute=float(sys.argv[3]))
    order = [int(c) for c in sys.argv[4]]
    segs = [anchor, *[passages[i] for i in order], question]
    _, logits = cc.prefill(segs)
    ids = [t for s in segs for t in s]
    print(json.dumps({"stats": cc.stats["last"], "diff": (logits - full_logits(model, ids)).abs().max().item()}))
    """
    from pathlib import Path

    here = str(Path(__file__).parent)
    first = json.loads(run_python(code, str(tmp_path / "s"), here, "1.0", "0123").stdout.splitlines()[-1])
    assert first["stats"]["served"] == 0
    again = json.loads(run_python(code, str(tmp_path / "s"), here, "1.0", "3102").stdout.splitlines()[-1])
    assert again["stats"]["computed"] == 7  # the question only: the anchor and every passage came from the store
    assert again["stats"]["served"] + again["stats"]["recomputed"] == again["stats"]["queried"] - 7
    assert again["diff"] <= ATOL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")
def test_gpu_passages_move_and_recompute_exactly(tmp_path):
    with torch.device("cuda"):
        model = tiny_llama()
    anchor, passages, question = segments(500, 8)
    segs = [anchor, passages[2], passages[0], passages[3], passages[1], question]
    ids = [t for s in segs for t in s]
    for memory in ("64MiB", 0):  # passages from the memory tier, then from files
        with PromptStore(tmp_path / f"s{memory}", memory_bytes=memory) as s:
            ChunkCache(model, store=s).prefill([anchor, *passages, question])
            cache, logits = ChunkCache(model, store=s, recompute=1.0).prefill(segs)
            assert (logits - full_logits(model, ids)).abs().max().item() <= ATOL
            cache, _ = ChunkCache(model, store=s, recompute=0.0).prefill(segs)
            with torch.no_grad():
                out = model(torch.as_tensor([ids], device="cuda"), use_cache=True)
            ref = kv_of(out).layers[0]
            assert (cache.layers[0].keys - ref.keys).abs().max().item() <= 1e-5
            assert (cache.layers[0].values - ref.values).abs().max().item() <= 1e-5


def test_an_edited_weight_never_serves_a_stored_passage(tmp_path):
    """The exact case (one passage right after the anchor) before and after an in-place edit through .data."""
    model = tiny_llama(seed=3)
    anchor, passages, question = segments(500, 9)
    segs = [anchor, passages[0], question]
    with PromptStore(tmp_path / "s") as s:
        cc = ChunkCache(model, store=s, recompute=0.0)
        cc.prefill(segs)
        with torch.no_grad():
            model.model.layers[1].self_attn.v_proj.weight.data[0] += 0.5
        _, logits = cc.prefill(segs)
        assert cc.stats["last"]["served"] == 0
    assert (logits - full_logits(model, [t for x in segs for t in x])).abs().max().item() <= ATOL


# -- behaviours a planted bug once got past (#21) ---------------------------------------------------
def test_a_passage_stored_after_one_anchor_is_not_served_after_another_of_the_same_length(tiny, store):
    anchor, passages, question = segments(500, 21)
    other = [(t % 499) + 1 for t in anchor[::-1]]  # as long as the anchor, other tokens
    assert len(other) == len(anchor) and other != anchor
    cc = ChunkCache(tiny, store=store, recompute=1.0)
    cc.prefill([anchor, passages[0], passages[1], question])
    segs = [other, passages[0], passages[1], question]
    _, logits = cc.prefill(segs)
    assert cc.stats["last"]["served"] == 0  # neither passage: their KV was computed after another anchor
    assert (logits - full_logits(tiny, [t for s in segs for t in s])).abs().max().item() <= ATOL


def layer_values(cache, layer: int) -> torch.Tensor:
    """A cache's values at one layer, per position: (positions, heads * head dim)."""
    v = cache.layers[layer].values[0]
    return v.permute(1, 0, 2).reshape(v.shape[1], -1)


def recomputed_positions(tiny, segs, cache) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Which moved positions a request recomputed, told apart by their layer-1 values.

    Layer 1's values depend on layer 0 only, whose KV is exact after a move: a recomputed token's
    layer-1 values are those of a full prefill, a served one's are those computed after the anchor
    alone. Returns (moved positions, recomputed ones, each moved token's squared deviation).
    """
    anchor, passages = segs[0], segs[1:-1]
    ids = [t for s in segs for t in s]
    with torch.no_grad():
        full = layer_values(kv_of(tiny(torch.as_tensor([ids]), use_cache=True)), 1)
    moved, stale = [], []
    at = len(anchor) + len(passages[0])
    for p in passages[1:]:
        with torch.no_grad():
            alone = layer_values(kv_of(tiny(torch.as_tensor([anchor + p]), use_cache=True)), 1)[len(anchor):]
        moved.append(np.arange(at, at + len(p)))
        stale.append(alone)
        at += len(p)
    positions, stale = np.concatenate(moved), torch.cat(stale)
    got = layer_values(cache, 1)[torch.as_tensor(positions)]
    fresh = (got - full[positions]).abs().amax(dim=1) < (got - stale).abs().amax(dim=1)
    deviation = ((full[positions] - stale) ** 2).sum(dim=1).numpy()
    return positions, positions[fresh.numpy()], deviation


@pytest.mark.parametrize(("recompute", "seed"), [(0.25, 22), (0.4, 27), (0.05, 28)])
@pytest.mark.parametrize("select", ["recent", "blend", "first"])
def test_each_selection_recomputes_the_tokens_it_names(tiny, store, select, recompute, seed):
    """recent: the moved tokens nearest the question; blend: the most-deviating ones; first: each passage's first."""
    anchor, passages, question = segments(500, seed)
    segs = [anchor, *passages, question]
    cc = ChunkCache(tiny, store=store, recompute=recompute, select=select)
    cache, _ = cc.prefill(segs)
    positions, fresh, deviation = recomputed_positions(tiny, segs, cache)
    count = round(recompute * len(positions))
    assert len(fresh) == count
    if select == "recent":
        expected = positions[-count:]
    elif select == "blend":
        expected = np.sort(positions[np.argsort(-deviation)[:count]])
    else:
        per = -(-count // (len(passages) - 1))
        starts = np.cumsum([0] + [len(p) for p in passages[1:-1]])
        expected = np.sort(np.concatenate([positions[s : s + per] for s in starts]))[:count]
    assert fresh.tolist() == expected.tolist()


def attention_ranking(model, segs, n_candidates_from: int) -> np.ndarray:
    """Moved positions ranked by transformers' own attention probabilities (eager, output_attentions) of the
    question's tokens over the stitched stale KV, summed over layers, heads and question tokens."""
    ids = [t for s in segs for t in s]
    n_q = len(segs[-1])
    with PromptStore(memory_bytes="64MiB", disk_bytes=0) as s:
        stale, _ = ChunkCache(model, store=s, recompute=0.0).prefill(segs)  # the stitched KV, question included
    stale.crop(-n_q)
    with torch.no_grad():
        out = model(torch.as_tensor([ids[-n_q:]]), cache=stale, use_cache=True, output_attentions=True,
                    position_ids=torch.arange(len(ids) - n_q, len(ids))[None])
    score = sum(a[0].double().sum(dim=(0, 1)) for a in out.attentions)
    positions = np.arange(n_candidates_from, len(ids) - n_q)
    return positions[np.argsort(-score[torch.as_tensor(positions)].numpy(), kind="stable")]


@pytest.mark.parametrize(("recompute", "seed"), [(0.25, 22), (0.1, 27)])
def test_the_query_selection_recomputes_the_tokens_the_question_attends_to_most(store, recompute, seed):
    """The oracle is transformers' own eager attention probabilities of the question over the stitched KV."""
    model = tiny_llama(attn_implementation="eager")
    anchor, passages, question = segments(500, seed)
    segs = [anchor, *passages, question]
    cc = ChunkCache(model, store=store, recompute=recompute, select="query")
    cache, _ = cc.prefill(segs)
    positions, fresh, _ = recomputed_positions(model, segs, cache)
    count = round(recompute * len(positions))
    ranked = attention_ranking(model, segs, int(positions[0]))
    assert len(fresh) == count
    assert fresh.tolist() == np.sort(ranked[:count]).tolist()
    assert fresh.tolist() != positions[-count:].tolist()  # not what "recent" picks: the test tells them apart


@pytest.mark.parametrize("model_type", ["qwen3", "gemma", "phi", "stablelm", "glm4_moe"])
def test_the_query_selection_reads_queries_of_other_layouts_and_stays_exact_at_full_recompute(model_type, store):
    """Query norms per head (qwen3), offset RMSNorm (gemma), partial rotary (phi, stablelm, glm4_moe)."""
    model, why = llm_zoo.build(model_type)
    assert model is not None, why
    cc, diffs = run_orders(model, store, 1.0, "query", llm_zoo.vocab_of(model), seed=3)
    assert max(diffs) <= ATOL * max(1.0, float(full_logits(model, list(range(1, 9))).abs().max()))
    anchor, passages, question = segments(llm_zoo.vocab_of(model), 3)
    cc.recompute = 0.3  # the stored passages in a new order: ranked by the question's attention, 30% recomputed
    _, logits = cc.prefill([anchor, passages[1], passages[3], passages[0], passages[2], question])
    moved = len(passages[3]) + len(passages[0]) + len(passages[2])
    assert cc.stats["last"]["recomputed"] == round(0.3 * moved) and torch.isfinite(logits).all()


@pytest.mark.parametrize("model_type", ["gpt_neox", "olmo2"])
def test_the_query_selection_refuses_a_model_whose_queries_it_cannot_read(store, model_type):
    """gpt_neox: a fused query_key_value under gpt_neox.layers; olmo2: no norm before attention."""
    model, why = llm_zoo.build(model_type)
    assert model is not None, why
    with pytest.raises(UnsupportedModelError, match="query"):
        ChunkCache(model, store=store, select="query")
    assert not store.ls()


@pytest.mark.parametrize("select", ["recent", "query", "blend"])
def test_a_zero_bound_recomputes_everything_and_equals_a_full_prefill(tiny, store, select):
    """A zero bound accepts only the exact prefill (every moved token recomputed), whatever the estimates."""
    cc, diffs = run_orders(tiny, store, 0.1, select, 500)
    cc.max_kl = 0.0
    anchor, passages, question = segments(500, 0)
    segs = [anchor, passages[2], passages[0], passages[3], passages[1], question]
    ids = [t for s in segs for t in s]
    _, logits = cc.prefill(segs)
    last = cc.stats["last"]
    assert last["fraction"] == 1.0 and last["estimate"] == 0.0
    assert last["recomputed"] == sum(len(p) for p in segs[2:-1])
    assert (logits - full_logits(tiny, ids)).abs().max().item() <= ATOL


def test_the_guard_stops_at_the_first_budget_within_its_bound(tiny, store):
    """Each step's estimate is GUARD_SAFETY x KL(this budget || the previous one) (the first: against the stale
    KV); the request ends with the first budget whose estimate is within the bound, and reports it. A doubling
    past GUARD_EXACT_ABOVE of the moved tokens, or an estimate over GUARD_FALL ** (budgets left) x the bound,
    is the exact prefill instead."""
    anchor, passages, question = segments(500, 5)
    segs = [anchor, passages[3], passages[1], passages[0], passages[2], question]
    ids = [t for s in segs for t in s]
    ChunkCache(tiny, store=store, recompute=0.0).prefill([anchor, *passages, question])  # passages stored
    moved = sum(len(p) for p in segs[2:-1])
    logits = {}
    for fraction in (0.0, 0.1, 0.2, 0.4, 0.8):
        logits[fraction] = ChunkCache(tiny, store=store, recompute=fraction, select="recent").prefill(segs)[1]
    lp = {f: torch.log_softmax(x.double(), -1) for f, x in logits.items()}
    kl = {f: GUARD_SAFETY * float((lp[f].exp() * (lp[f] - lp[g])).sum())
          for f, g in ((0.1, 0.0), (0.2, 0.1), (0.4, 0.2))}
    assert 2 * 0.4 > GUARD_EXACT_ABOVE >= 0.4
    full = full_logits(tiny, ids)
    left = {0.1: 2, 0.2: 1, 0.4: 0}  # budgets still to try before exact
    hopeless = kl[0.1] / GUARD_FALL ** left[0.1]  # over this, 10% cannot come within the bound by 40%
    outcomes = set()
    for bound in [*sorted(kl.values()), 0.999 * min(kl.values()), hopeless / 1.01, hopeless * 1.01]:
        tried = []
        for f in (0.1, 0.2, 0.4):
            tried.append(f)
            if kl[f] <= bound * (1 + 1e-9) or kl[f] > bound * (1 + 1e-9) * GUARD_FALL ** left[f]:
                break
        stop = tried[-1] if kl[tried[-1]] <= bound * (1 + 1e-9) else 1.0
        outcomes.add((len(tried), stop))
        cc = ChunkCache(tiny, store=store, recompute=0.1, select="recent", max_kl=bound * (1 + 1e-9))
        passes = []  # how many moved tokens each repair pass recomputed (the rest of a run is the question)
        repair = cc._repair

        def counted(ids_, buffers, run, stop_, repair=repair, passes=passes):
            passes.append(int(np.count_nonzero(run < len(ids) - len(question))))
            return repair(ids_, buffers, run, stop_)

        cc._repair = counted
        _, got = cc.prefill(segs)
        # The exact prefill is a plain forward from the exact prefix on (PrefixCache's path), not a repair pass.
        assert passes == [round(f * moved) for f in tried], (bound, kl, passes)
        last = cc.stats["last"]
        assert last["recomputed"] == round(stop * moved), (bound, kl)
        assert last["fraction"] == last["recomputed"] / moved
        if stop == 1.0:  # 0.8 was never tried: the exact prefill
            assert last["estimate"] == 0.0 and (got - full).abs().max().item() <= ATOL
        else:
            assert last["estimate"] == pytest.approx(kl[stop], rel=1e-3, abs=1e-7)
            assert (got - logits[stop]).abs().max().item() <= ATOL
    assert (full - logits[0.8]).abs().max().item() > ATOL  # the budgets do differ from exact
    assert (1, 1.0) in outcomes and any(stop < 1.0 for _, stop in outcomes), outcomes  # both ends were reached


def test_a_guard_from_no_recompute_tries_the_smallest_budget_first(tiny, store):
    """recompute=0 gives the guard no estimate (a budget that recomputes nothing is no evidence): it tries 5%,
    not the exact prefill, however loose the bound."""
    anchor, passages, question = segments(500, 6)
    segs = [anchor, passages[3], passages[1], passages[0], passages[2], question]
    ChunkCache(tiny, store=store, recompute=0.0).prefill([anchor, *passages, question])
    moved = sum(len(p) for p in segs[2:-1])
    cc = ChunkCache(tiny, store=store, recompute=0.0, select="recent", max_kl=1e9)
    cc.prefill(segs)
    last = cc.stats["last"]
    assert last["recomputed"] == round(0.05 * moved) and 0.0 < last["estimate"] <= 1e9


def test_a_guard_that_keeps_ending_exact_goes_straight_to_the_exact_prefill_and_probes_now_and_then(tiny, store):
    """Trying the budgets costs the question's pass and a repair pass before the exact prefill: where the last
    tries all ended exact, a request runs the exact prefill at once (never slower than it by a try), trying
    again every GUARD_PROBE_EVERY-th request; where tries are accepted, it keeps trying. Each answer equals
    what its path gives: the exact ones a full prefill."""
    anchor, passages, question = segments(500, 8)
    ChunkCache(tiny, store=store, recompute=0.0).prefill([anchor, *passages, question])
    # Every request a new order: an order asked before is served whole from the blocks its exact prefill stored.
    orders = [[3, 1, 0, 2], [2, 0, 3, 1], [1, 3, 2, 0], [3, 2, 1, 0], [2, 3, 0, 1], [1, 0, 3, 2], [0, 3, 1, 2],
              [3, 0, 2, 1], [2, 1, 3, 0], [1, 2, 0, 3], [0, 2, 3, 1], [3, 2, 0, 1]]
    # Accepted tries first: they store no whole prompt, which the exact prefills do.
    for bound, want in ((1e9, [True] * 5), (0.0, [True] * 3 + [False] * (GUARD_PROBE_EVERY - 1) + [True, False])):
        cc = ChunkCache(tiny, store=store, recompute=0.1, select="recent", max_kl=bound)
        passes: list[str] = []
        question_pass = cc._pass

        def counted(*args, question_pass=question_pass, passes=passes, **kwargs):
            passes.append("question")
            return question_pass(*args, **kwargs)

        cc._pass = counted
        tried = []
        for i in range(len(want)):
            segs = [anchor, *[passages[j] for j in orders[i % len(orders)]], question]
            passes.clear()
            _, logits = cc.prefill(segs)
            tried.append(bool(passes))  # a try starts with the question's pass over the stitched KV
            if bound == 0.0:  # every request ends exact, tried or not
                assert cc.stats["last"]["fraction"] == 1.0
                assert (logits - full_logits(tiny, [t for s in segs for t in s])).abs().max().item() <= ATOL
            else:
                assert cc.stats["last"]["fraction"] < 1.0
        assert tried == want, (bound, tried)
        if bound == 0.0:  # going straight to exact with a passage never stored: a plain exact prefill, equal to a
            # full one, which computes nothing on the side (the passage is stored by a later try)
            fresh = segments(500, 9)[1][0]
            segs = [anchor, passages[2], fresh, passages[0], question]
            passes.clear()
            cache, logits = cc.prefill(segs)
            assert not passes and cc.stats["last"]["fraction"] == 1.0
            assert (logits - full_logits(tiny, [t for s in segs for t in s])).abs().max().item() <= ATOL
            assert cache.get_seq_length() == sum(len(s) for s in segs)
            assert cc._chunk_key(cc.engine.request(), np.array(anchor), np.array(fresh)) not in store


def test_what_the_guard_learned_about_its_cost_is_kept_in_the_store_per_setting(tiny, tmp_path):
    """Three tries that ended exact teach a guard to go straight to the exact prefill; a ChunkCache made later on the
    same folder (a restarted process) with the same setting goes straight from its first request, one with another
    bound learns on its own, and another folder knows nothing. Every answer equals a full prefill."""
    anchor, passages, question = segments(500, 8)
    # Every request a new order: an order asked before is served whole from the blocks its exact prefill stored.
    orders = [[3, 1, 0, 2], [2, 0, 3, 1], [1, 3, 2, 0], [3, 2, 1, 0], [2, 3, 0, 1], [1, 0, 3, 2], [0, 3, 1, 2],
              [3, 0, 2, 1]]

    def tries(folder, bound: float, requests: list[list[int]]) -> list[bool]:
        with PromptStore(folder) as store:
            ChunkCache(tiny, store=store, recompute=0.0).prefill([anchor, *passages, question])
            cc = ChunkCache(tiny, store=store, recompute=0.1, select="recent", max_kl=bound)
            question_pass, passes = cc._pass, []
            cc._pass = lambda *a, **k: passes.append(1) or question_pass(*a, **k)
            tried = []
            for order in requests:
                segs = [anchor, *[passages[j] for j in order], question]
                passes.clear()
                _, logits = cc.prefill(segs)
                tried.append(bool(passes))
                assert (logits - full_logits(tiny, [t for s in segs for t in s])).abs().max().item() <= ATOL
        return tried

    assert tries(tmp_path / "a", 0.0, orders[:4]) == [True, True, True, False]
    assert tries(tmp_path / "a", 0.0, orders[4:6]) == [False, False]  # restarted: straight at once
    assert tries(tmp_path / "a", 1e-12, orders[6:]) == [True, True]  # another setting: its own history
    assert tries(tmp_path / "b", 0.0, orders[4:6]) == [True, True]  # another store: nothing learned


def test_a_stored_passage_of_another_shape_is_a_miss(tiny, store):
    anchor, passages, question = segments(500, 23)
    cc = ChunkCache(tiny, store=store, recompute=1.0)
    key = cc._chunk_key(cc.engine.request(), np.array(anchor), np.array(passages[1]))
    bad = np.zeros((3, 2, len(passages[1]) - 1, 16), np.float32)  # one token short
    store.put(key, {"k": bad, "v": bad}, kind=CHUNK_KIND)
    segs = [anchor, passages[0], passages[1], question]
    _, logits = cc.prefill(segs)
    assert (logits - full_logits(tiny, [t for s in segs for t in s])).abs().max().item() <= ATOL


def test_anchor_and_passage_boundaries_are_part_of_the_passage_key(tiny, store):
    """[a, b] + [c, ...] and [a] + [b, c, ...]: the same tokens, split otherwise, are other passages."""
    anchor, passages, question = segments(500, 24)
    cc = ChunkCache(tiny, store=store, recompute=1.0)
    cc.prefill([anchor, passages[0], question])
    segs = [anchor[:-1], [anchor[-1]] + passages[0], question]
    _, logits = cc.prefill(segs)
    assert (logits - full_logits(tiny, [t for s in segs for t in s])).abs().max().item() <= ATOL
    assert cc.stats["last"]["served"] <= len(anchor)  # the exact prefix only: the passage is another one


def test_a_bfloat16_model_serves_its_stored_passages(store):
    """The host path converts stored bfloat16 KV into the buffers (they are viewed as int16)."""
    model = tiny_llama(seed=4).to(torch.bfloat16)
    anchor, passages, question = segments(500, 25)
    cc = ChunkCache(model, store=store, recompute=0.0)
    segs = [anchor, passages[0], passages[1], question]
    _, first = cc.prefill(segs)  # computes and stores the passages
    _, again = cc.prefill(segs)  # serves them
    assert cc.stats["last"]["served"] == len(anchor) + len(passages[0]) + len(passages[1])
    assert torch.equal(first, again)


@pytest.mark.parametrize(("recompute", "want"), [(0.0, 0), (0.001, 0), (1 / 114 * 1.2, 1)])
def test_a_budget_that_rounds_to_no_token_or_one_recomputes_that_many(store, recompute, want):
    """The second request runs its question, plus what the budget rounds to (114 moved tokens here), plus the check of its exact prefix."""
    from promptstore.llm._verify import VERIFY_POSITIONS

    from counting import Counting

    model = tiny_llama(seed=7)
    counter = Counting(model.get_input_embeddings())
    anchor, passages, question = segments(500, 29)
    for select, question_runs in (("recent", 1), ("query", 2 if want else 1)):  # "query" runs the question first
        cc = ChunkCache(model, store=store, recompute=recompute, select=select)
        cc.prefill([anchor, *passages, question])
        counter.reset()
        segs = [anchor, passages[0], passages[3], passages[1], passages[2], question]
        _, logits = cc.prefill(segs)
        assert cc.stats["last"]["recomputed"] == want
        assert counter.tokens == question_runs * len(question) + want + min(VERIFY_POSITIONS, len(anchor))


def test_blend_breaks_ties_in_deviation_by_position(tiny, store, monkeypatch):
    """Tokens that moved equally are taken earliest first, whatever sort numpy picks by default on this CPU."""
    cc = ChunkCache(tiny, store=store, recompute=0.5, select="blend")
    moved = [np.arange(11, 61), np.arange(61, 111)]
    deviation = np.tile(np.array([0.0, 1.0, 1.0, 0.0], np.float32), 25)  # ties everywhere
    monkeypatch.setattr(ChunkCache, "_deviation", lambda self, ids, buffers, candidates: deviation)
    chosen = cc._choose(np.zeros(120, np.int64), (None, None), moved, 0.5, None)
    candidates = np.concatenate(moved)
    assert chosen.tolist() == np.sort(candidates[deviation == 1.0]).tolist()[:50]
    deviation = np.tile(np.array([0.0, 2.0, 1.0, 1.0, 0.0], np.float32), 20)
    chosen = cc._choose(np.zeros(120, np.int64), (None, None), moved, 0.5, None)
    ones = candidates[deviation == 1.0]
    assert chosen.tolist() == np.sort(np.concatenate([candidates[deviation == 2.0], ones[:30]])).tolist()


def test_a_stored_passage_costs_the_time_its_forward_took(tiny, store, monkeypatch):
    """cost_s, what store.stats() counts as seconds saved when the passage is served: every forward takes 1 s here."""
    import types

    import promptstore.llm._chunks as chunks

    clock = iter(range(10**6))
    monkeypatch.setattr(chunks, "time", types.SimpleNamespace(perf_counter=lambda: float(next(clock))))
    anchor, passages, question = segments(500, 30)
    cc = ChunkCache(tiny, store=store, recompute=0.0)
    cc.prefill([anchor, passages[0], passages[1], question])
    assert sorted(info.cost_s for info in store.ls(CHUNK_KIND)) == [1.0, 1.0]


def test_the_query_selection_leaves_the_models_identity_as_it_was(store):
    """Its pass reads each layer's input through hooks that live only for that pass (transformers'
    output_hidden_states installs recording hooks for good): the very next request is served."""
    model = tiny_llama(seed=7)
    anchor, passages, question = segments(500, 29)
    cc = ChunkCache(model, store=store, recompute=0.05, select="query")
    before = cc.prefix.fingerprint
    cc.prefill([anchor, *passages, question])
    assert cc.prefix.fingerprint == before
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    cc.prefill([anchor, passages[0], passages[3], passages[1], passages[2], question])
    assert cc.stats["last"]["served"] > 0 and cc.stats["last"]["recomputed"] > 0


def test_the_move_check_is_stored_per_live_structure_and_frequencies(tmp_path, monkeypatch):
    """The move check's forwards run once per live structure and rotary frequencies, in any process
    sharing the store (its verdict is stored, like PrefixCache's model check); a live change of either
    runs it again, and a model that fails it is refused every time."""
    import promptstore.llm._chunks as chunks

    calls = []
    real = chunks._check_moves
    monkeypatch.setattr(chunks, "_check_moves", lambda *a: (calls.append(1), real(*a))[1])
    store = PromptStore(tmp_path / "s", memory_bytes=0)
    model = tiny_llama()
    ChunkCache(model, store=store)
    assert len(calls) == 1
    ChunkCache(model, store=PromptStore(tmp_path / "s"))  # another store on the folder: as a fresh process
    ChunkCache(tiny_llama(seed=3), store=store)  # other weights, same architecture
    assert len(calls) == 1
    rotary = model.model.rotary_emb
    rotary.inv_freq.mul_(1.5)  # other frequencies, in place
    cc = ChunkCache(model, store=store)
    assert len(calls) == 2
    model.config.rms_norm_eps = 1e-3  # a live setting: another structure
    anchor, passages, question = segments(500, 1)
    cc.prefill([anchor, passages[0], question])
    assert len(calls) == 3
    cohere, reason = llm_zoo.build("cohere")
    assert cohere is not None, reason
    for _ in range(2):
        with pytest.raises(UnsupportedModelError, match="does not move"):
            ChunkCache(cohere, store=store)
    assert len(calls) == 5


def test_generate_through_the_guards_straight_path_equals_model_generate(tiny, store):
    """Where the guard goes straight to the exact prefill, generate continues PrefixCache's cache (cropped by one
    token for the guard's whole-prompt build): the same greedy tokens as the model alone, in every order."""
    anchor, passages, question = segments(500, 8)
    ChunkCache(tiny, store=store, recompute=0.0).prefill([anchor, *passages, question])
    cc = ChunkCache(tiny, store=store, recompute=0.1, select="recent", max_kl=0.0)
    straight = 0
    for order in ([3, 1, 0, 2], [2, 0, 3, 1], [1, 3, 2, 0], [3, 2, 1, 0], [2, 3, 0, 1], [1, 0, 3, 2]):
        segs = [anchor, *[passages[j] for j in order], question]
        out = cc.generate(segs, max_new_tokens=6, do_sample=False)
        ids = torch.tensor([[t for s in segs for t in s]])
        want = tiny.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
        assert out[0].tolist() == want[0].tolist(), order
        straight += cc.stats["last"]["recomputed"] == 0  # nothing stored was read: the straight path
    assert straight >= 3  # after three tries that ended exact


def test_the_guards_kl_gives_tokens_a_model_rules_out_no_weight():
    """Scores of -inf (a vocabulary row a model masks, a banned token) have probability 0 on both sides: they add
    nothing to KL(p || q), which stays finite; the guard would otherwise read every such request as off by inf."""
    p = torch.tensor([2.0, 0.5, float("-inf"), -1.0])
    q = torch.tensor([1.5, 0.7, float("-inf"), -0.5])
    lp, lq = torch.log_softmax(p[[0, 1, 3]].double(), -1), torch.log_softmax(q[[0, 1, 3]].double(), -1)
    want = float((lp.exp() * (lp - lq)).sum())
    assert want > 0 and abs(_kl(p, q) - want) < 1e-12
    assert _kl(p, p) == 0.0
    assert _kl(p, torch.tensor([1.5, 0.7, 0.0, -0.5])) < float("inf")  # q allows what p rules out: still finite
