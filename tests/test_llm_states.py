"""Linear-attention and SSM hybrids served exactly (issue #22): running states stored where a prefix can end.

A state layer (transformers' ``LinearAttentionLayer``: Gated DeltaNet in Qwen3-Next and
Qwen3.5, Mamba mixers in Jamba, Nemotron-H) keeps a fixed-size state instead of per-token KV.
PrefixCache stores it at each request's end (and before its last token) and every
``STATE_EVERY_TOKENS`` while a miss is computed; a lookup restores the longest prefix for which
every layer's state and every attention layer's KV are stored.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from promptstore.errors import UnsupportedModelError
from promptstore.llm import PrefixCache

from counting import Counting
from llm_zoo import build, vocab_of
from llm_zoo import greedy_tokens as greedy
from llm_zoo import plain_scores as plain
from transparency import assert_same, assert_transparent

ATOL = 1e-4
HYBRIDS = ["qwen3_next", "jamba", "nemotron_h", "lfm3", "falcon_h1"]  # DeltaNet; Mamba; cache-less layers; sliding; state and KV in one layer


@pytest.fixture(scope="module")
def models():
    built = {}
    for name in HYBRIDS:
        model, why = build(name)
        assert model is not None, why
        built[name] = model
    return built


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
    import promptstore.llm._engine as prefix

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


@pytest.mark.parametrize("name", ["qwen3_next", "falcon_h1"])
def test_a_hit_stores_the_state_where_its_prompt_parts_so_the_next_one_resumes_there(name, models, store, monkeypatch):
    """A shared system prompt, then requests of their own: the first hit resumes at the last stored state before
    the shared part's end and stores one there; every later request resumes at the end of the shared part."""
    import promptstore.llm._engine as prefix

    monkeypatch.setattr(prefix, "STATE_EVERY_TOKENS", 16)
    model = models[name]
    vocab = vocab_of(model)
    rng = np.random.default_rng(3)
    system = rng.integers(1, vocab, 43).tolist()  # parts inside a block, past the last multiple of 16
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    served = []
    for _ in range(3):
        ids = system + rng.integers(1, vocab, 7).tolist()
        assert_same(pc.prefill(ids)[1], plain(model, ids), ATOL, "a request after the shared system prompt")
        served.append(pc.stats["last"]["served"])
    assert served == [0, 32, 43]


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


STEPWISE = ["mamba", "falcon_mamba"]  # mixers that start every multi-token forward from a zero state


@pytest.mark.parametrize("name", STEPWISE)
def test_a_mixer_that_continues_a_state_one_token_at_a_time_is_served_stepwise(name, store):
    """Mamba's and Falcon-Mamba's own mixers do not continue a state over several tokens (pieces differ from
    one pass), but do one token at a time: a hit runs its tokens one per forward from the restored state."""
    model, why = build(name)
    assert model is not None, why
    vocab = vocab_of(model)
    rng = np.random.default_rng(5)
    doc = rng.integers(1, vocab, 40).tolist()
    pc = PrefixCache(model, None, store=store, block_tokens=8, reuse="always")
    assert pc.engine.stepwise() and pc.engine.layout()[0] == 0
    assert_same(pc.prefill(doc)[1], plain(model, doc), ATOL, f"{name}: the document (one pass)")
    for q in range(3):
        ids = doc + rng.integers(1, vocab, 4 + q).tolist()
        assert_same(pc.prefill(ids)[1], plain(model, ids), ATOL, f"{name}: question {q}")
        assert pc.stats["last"]["served"] == len(doc)  # the state where the document ended
        assert_same(pc.prefill(ids)[1], plain(model, ids), ATOL, f"{name}: question {q} again")
        assert pc.stats["last"]["served"] == len(ids) - 1
    ids = doc + [3, 4, 5, 6, 7]
    out = pc.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert pc.stats["last"]["served"] == len(doc)
    assert_same(out[0].tolist(), greedy(model, ids, 8), 0, f"{name}: greedy tokens")


def test_a_stepwise_model_is_recomputed_where_its_steps_would_take_longer(store):
    """reuse="auto": the measured cost of one-token forwards against one pass decides (planted rates)."""
    from promptstore.llm._decide import RATES_KIND, Rates

    model, why = build("mamba")
    assert model is not None, why
    vocab = vocab_of(model)
    rng = np.random.default_rng(6)
    doc = rng.integers(1, vocab, 40).tolist()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    pc.prefill(doc)
    rates = Rates(store, model, pc.engine.layout()[4], model.device)
    one = rates.work(0, 1)
    for step_tokens, served in ((30.0, 0), (0.5, 40)):  # a step costs 30 / half a token of one pass
        store.put(rates.key, {"full": np.full(3, 1e-3 / one), "step": np.full(3, step_tokens * 1e-3)}, kind=RATES_KIND)
        ids = doc + rng.integers(1, vocab, 6).tolist()
        pc.engine._rates = None  # read the planted rates
        assert_same(pc.prefill(ids)[1], plain(model, ids), ATOL, f"a step costing {step_tokens} tokens")
        assert pc.stats["last"]["served"] == served and pc.stats["last"]["declined"] == 40 - served


def test_a_stepwise_model_is_served_in_a_fresh_process(tmp_path):
    code = """
    import sys, json
    sys.path.insert(0, sys.argv[2])
    import numpy as np
    from promptstore import PromptStore
    from promptstore.llm import PrefixCache
    from llm_zoo import build, vocab_of, plain_scores
    model, _ = build("falcon_mamba")
    doc = np.random.default_rng(7).integers(1, vocab_of(model), 40).tolist()
    ids = doc + [int(x) for x in sys.argv[3].split(",")] if sys.argv[3] else doc
    pc = PrefixCache(model, None, store=PromptStore(sys.argv[1]), block_tokens=8, reuse="always")
    got = pc.prefill(ids)[1]
    print(json.dumps({"served": pc.stats["last"]["served"], "diff": (got - plain_scores(model, ids)).abs().max().item()}))
    """
    from pathlib import Path

    from conftest import run_python

    here = str(Path(__file__).parent)
    runs = [json.loads(run_python(code, str(tmp_path / "s"), here, q).stdout.splitlines()[-1]) for q in ("", "5,6,7")]
    assert runs[0]["served"] == 0 and runs[1]["served"] == 40
    assert max(r["diff"] for r in runs) <= ATOL


def test_a_model_of_running_states_only_is_served_from_its_states(store):
    """Mamba2: every layer a state, none KV. Blocks hold no KV, only their place in the chain."""
    model, why = build("mamba2")
    assert model is not None, why
    vocab = vocab_of(model)
    rng = np.random.default_rng(5)
    doc = rng.integers(1, vocab, 40).tolist()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    assert pc.engine.layout()[0] == 0
    pc.prefill(doc)
    ids = doc + rng.integers(1, vocab, 6).tolist()
    assert_transparent(lambda: pc.prefill(ids)[1], lambda: plain(model, ids), atol=ATOL, what="mamba2, a question")
    out = pc.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    assert_same(out[0].tolist(), greedy(model, ids, 8), 0, "mamba2: greedy tokens")
    assert pc.stats["last"]["served"] == len(ids) - 1
    turn = out[0].tolist() + [4, 5]
    assert_same(pc.prefill(turn)[1], plain(model, turn), ATOL, "mamba2: the next turn")
    assert pc.stats["last"]["served"] == len(ids)  # not what generate left (not stored): where the prefill of ids ended


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


def test_a_bfloat16_hybrid_stores_and_restores_its_states(models, store):
    """bfloat16 state tensors go to the store as raw bits named BF16, and come back as bfloat16."""
    model = build("qwen3_next")[0].to(torch.bfloat16)
    doc = np.random.default_rng(5).integers(1, vocab_of(model), 20).tolist()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    pc.prefill(doc)
    dtypes = {d for info in store.ls("llm.state") for d in store.get(info.key, kind="llm.state").dtypes.values()}
    assert "BF16" in dtypes  # the convolution windows are bfloat16
    ids = doc + [5, 6, 7]
    assert_same(pc.prefill(ids)[1].float(), plain(model, ids).float(), 0, "bfloat16 states restored")
    assert pc.stats["last"]["served"] == len(doc)


def test_prompts_shorter_than_a_block_store_and_resume_their_states(models, store):
    """A state after fewer tokens than a block lives under the chain's root, and is found there."""
    model = models["qwen3_next"]
    rng = np.random.default_rng(6)
    short = rng.integers(1, vocab_of(model), 5).tolist()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    assert_same(pc.prefill(short)[1], plain(model, short), ATOL, "a prompt shorter than a block")
    ids = short + [9, 10]
    assert_same(pc.prefill(ids)[1], plain(model, ids), ATOL, "after it")
    assert pc.stats["last"]["served"] == len(short)
    pc.prefill([11, 12])  # states after 1 token (before the last) and after 2
    ids = [11, 13, 14]
    assert_same(pc.prefill(ids)[1], plain(model, ids), ATOL, "sharing one token")
    assert pc.stats["last"]["served"] == 1


def test_each_prompt_keeps_its_own_state_when_only_an_earlier_block_differs(models, store):
    """Two prompts alike but for their third block: a state is keyed by its last full block, so by the whole prefix."""
    model = models["qwen3_next"]
    vocab = vocab_of(model)
    rng = np.random.default_rng(7)
    first, end = rng.integers(1, vocab, 16).tolist(), rng.integers(1, vocab, 4).tolist()
    a = first + rng.integers(1, vocab, 8).tolist() + end
    b = first + rng.integers(1, vocab, 8).tolist() + end
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    pc.prefill(a)
    pc.prefill(b)
    ids = b + [5, 6]
    assert_same(pc.prefill(ids)[1], plain(model, ids), ATOL, "b's own state after a's")
    assert pc.stats["last"]["served"] == len(b)
    # Each state is a child of the last full block before it: it goes when that block goes.
    parents = {info.key: info.parent for info in store.ls("llm.state")}
    for seq in (a, b, ids):
        seq = np.array(seq)
        for n in range(9, len(seq) + 1):
            key = pc.engine.request().state_key(seq, n)
            if key in parents:
                assert parents[key] == pc.engine.request().block_keys(seq, n // 8)[-1], n


def test_a_prompt_leaving_a_generated_answer_part_way_resumes_before_the_prompt_end(models, store):
    """generate stores the state before the prompt's last token and at the end; one diverging two
    tokens into the answer resumes from the first (found by walking back token by token)."""
    model = models["qwen3_next"]
    prompt = np.random.default_rng(8).integers(1, vocab_of(model), 26).tolist()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    out = pc.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)[0].tolist()
    seq = np.array(out)
    assert {n for n in range(1, len(seq)) if pc.engine.request().state_key(seq, n) in store} == {25, 37}
    ids = out[:28] + [(out[28] + 1) % vocab_of(model), 3]
    assert_same(pc.prefill(ids)[1], plain(model, ids), ATOL, "diverging inside the answer")
    assert pc.stats["last"]["served"] == 25  # KV for 28 tokens; the state before the prompt's last token


def test_stored_costs_are_the_measured_compute_time(models, store, monkeypatch):
    """Each entry's cost_s (what store.stats() counts as seconds saved on a hit) is the time its
    tokens took: every forward takes one second here."""
    import types

    import promptstore.llm._engine as prefix

    clock = iter(range(10**6))
    monkeypatch.setattr(prefix, "time", types.SimpleNamespace(perf_counter=lambda: float(next(clock))))
    monkeypatch.setattr(prefix, "STATE_EVERY_TOKENS", 16)
    model = models["qwen3_next"]
    a = np.random.default_rng(9).integers(1, vocab_of(model), 50)
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    pc.prefill(a.tolist())  # forwards over 0-16, 16-32, 32-48, 48-49 and 49-50: one second each
    cost = {info.key: info.cost_s for info in store.ls()}
    keys = pc.engine.request().block_keys(a, 6)
    assert [cost[k] for k in keys] == [0.5] * 6  # 8 of a piece's 16 tokens
    pointers = [pc.engine.request().tail_key(keys[b - 1] if b else None, int(a[8 * b])) for b in range(6)]  # to each full block
    assert [cost[k] for k in pointers] == [0.5] * 6
    assert [cost[pc.engine.request().state_key(a, n)] for n in (16, 32, 48, 50)] == [1.0, 2.0, 3.0, 5.0]  # the whole prefix
    tail = pc.engine.request().tail_key(keys[-1], int(a[48]))
    assert cost[tail] == pytest.approx(0.2)  # 2 tokens at the request's 5 s / 50 tokens
    pc.prefill(a.tolist())  # the same prompt: its tail is already stored, and kept as it was
    assert {info.key: info.cost_s for info in store.ls()}[tail] == pytest.approx(0.2)


def test_a_prompt_resuming_before_stored_blocks_stores_the_blocks_after_them(models, store, monkeypatch):
    """KV stored past the last state: the request runs from the state, skips the blocks already stored and stores the rest."""
    import promptstore.llm._engine as prefix

    monkeypatch.setattr(prefix, "STATE_EVERY_TOKENS", 16)
    model = models["qwen3_next"]
    vocab = vocab_of(model)
    rng = np.random.default_rng(10)
    a = rng.integers(1, vocab, 50).tolist()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    pc.prefill(a)
    b = a[:44] + rng.integers(1, vocab, 20).tolist()
    pc.prefill(b)
    assert pc.stats["last"]["served"] == 32  # KV to 44 tokens, the last state before them at 32
    ids = b + [5]
    assert_same(pc.prefill(ids)[1], plain(model, ids), ATOL, "after b")
    assert pc.stats["last"]["served"] == len(b)


def test_after_generate_on_a_block_aligned_prompt_another_reply_resumes_before_its_last_token(models, store):
    """generate stores the state before the prompt's last token; with a prompt of whole blocks it lies
    just before a block boundary, and a later prompt that leaves the answer at once still finds it."""
    model = models["qwen3_next"]
    prompt = np.random.default_rng(6).integers(1, vocab_of(model), 16).tolist()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    out = pc.generate(prompt, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    other = [t for t in range(1, 10) if t != out[0, len(prompt)].item()][0]
    ids = prompt + [other, 5]
    assert_same(pc.prefill(ids)[1], plain(model, ids), ATOL, "another reply")
    assert pc.stats["last"]["served"] == len(prompt) - 1


def test_a_state_stored_after_a_one_token_piece_costs_the_runs_mean_rate(models, store, monkeypatch):
    """The state before a prompt's last token comes after a one-token forward: priced at the run's mean rate."""
    import promptstore.llm._engine as prefix

    model = models["qwen3_next"]
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    monkeypatch.setattr(prefix, "STATE_EVERY_TOKENS", 16)
    clock = iter(range(0, 10_000))
    monkeypatch.setattr(prefix.time, "perf_counter", lambda: float(next(clock)))  # every forward takes 1 s
    ids = np.random.default_rng(7).integers(1, vocab_of(model), 50).tolist()
    pc.prefill(ids)  # forwards over 16, 16, 16, 1 and 1 tokens: five seconds in all
    costs = sorted(e.cost_s for e in store.ls("llm.state"))
    assert len(costs) == 5 and costs[-1] <= 5.0 + 1e-9  # no state saves more than the whole prompt cost


def test_blocks_stored_by_a_run_resuming_mid_prompt_cost_its_rate(models, store, monkeypatch):
    """A hit that resumes at a stored state runs the rest in pieces: their blocks are priced at that run's
    rate (its seconds over the tokens it ran), not over the prompt from its start."""
    import types

    import promptstore.llm._engine as prefix

    monkeypatch.setattr(prefix, "STATE_EVERY_TOKENS", 16)
    model = models["qwen3_next"]
    rng = np.random.default_rng(11)
    a = rng.integers(1, vocab_of(model), 50).tolist()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    pc.prefill(a)
    clock = iter(range(10**6))
    monkeypatch.setattr(prefix, "time", types.SimpleNamespace(perf_counter=lambda: float(next(clock))))
    b = a[:40] + rng.integers(1, vocab_of(model), 30).tolist()
    pc.prefill(b)  # resumes at 32: forwards over 32-40 (where it parts from a) and 40-48, one second each
    assert pc.stats["last"]["served"] == 32
    block = pc.engine.request().block_keys(np.array(b), 6)[5]  # tokens 40-48: stored after the piece that ends at 48
    assert {info.key: info.cost_s for info in store.ls()}[block] == pytest.approx(1.0)  # 2 s / 16 tokens x 8


@pytest.mark.parametrize("name", ["qwen3_next", "jamba"])
def test_a_restored_cache_that_counts_other_tokens_than_it_was_served_is_recomputed(name, models, store, monkeypatch):
    """The model takes its next positions from the cache's own count: a restore that leaves a count the
    library does not know about wrong (planted here by zeroing every state layer's count) is a miss
    with a warning, equal to a recompute, instead of scores computed at the wrong positions."""
    import promptstore.llm._request as prefix
    from promptstore.errors import PromptStoreWarning

    real = prefix.restore_states

    def restore_then_forget_the_count(cache, entry, device, n_tokens):
        real(cache, entry, device, n_tokens)
        for layer in cache.layers:
            if hasattr(layer, "cumulative_length_linear"):
                layer.cumulative_length_linear = torch.zeros_like(layer.cumulative_length_linear)
            if hasattr(layer, "cumulative_length"):  # a layer keeping its count beside a state (jamba)
                layer.cumulative_length = 0

    model = models[name]
    ids = np.random.default_rng(9).integers(1, vocab_of(model), 30).tolist()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    pc.prefill(ids)
    monkeypatch.setattr(prefix, "restore_states", restore_then_forget_the_count)
    longer = ids + [3, 4, 5]
    with pytest.warns(PromptStoreWarning, match="counts 0 tokens after restoring 30"):
        got = pc.prefill(longer)[1]
    assert pc.stats["last"]["served"] == 0
    assert_same(got, plain(model, longer), ATOL, "after a restore that miscounts")


def test_a_cache_restored_under_inference_mode_continues_outside_it(models, store):
    """Restored states are normal tensors: the caller may continue the cache outside inference_mode."""
    model = models["qwen3_next"]
    ids = np.random.default_rng(8).integers(1, vocab_of(model), 30).tolist()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    pc.prefill(ids)
    with torch.inference_mode():
        cache, _ = pc.prefill(ids + [3, 4])
    assert pc.stats["last"]["served"] == len(ids)
    with torch.no_grad():
        out = model(torch.tensor([[5, 6]]), cache=cache, use_cache=True).logits[0, -1]
    assert_same(out, plain(model, ids + [3, 4, 5, 6]), ATOL, "continued outside inference_mode")


def test_state_lookups_are_counted_under_their_kind(models, store):
    """The store's per-kind counters show the state lookups: the hit that resumed, and the points that missed."""
    model = models["qwen3_next"]
    rng = np.random.default_rng(7)
    doc = rng.integers(0, vocab_of(model), 40).tolist()
    pc = PrefixCache(model, store=store, block_tokens=16)
    pc.prefill(doc)  # states after 39 and 40 tokens

    def counts() -> tuple[int, int]:
        kind = store.stats()["kinds"].get("llm.state", {})
        return kind.get("hits", 0), kind.get("misses", 0)

    hits, misses = counts()
    pc.prefill(doc + rng.integers(0, vocab_of(model), 5).tolist())  # resumes at the document's end
    assert pc.stats["last"]["served"] == 40 and counts() == (hits + 1, misses)
    pc.prefill(doc[:37] + rng.integers(0, vocab_of(model), 5).tolist())  # KV for 37 tokens, no state there or before
    assert pc.stats["last"]["served"] == 0 and counts()[0] == hits + 1 and counts()[1] >= misses + 6  # 37 down to 31


def test_a_stepwise_miss_runs_in_one_pass_even_where_it_parts_from_a_stored_prompt(store):
    """A prompt sharing blocks with a stored one but no state there is a miss: one pass to its last token (and
    that token), never one token per forward from where it parts."""
    model, why = build("mamba")
    assert model is not None, why
    vocab = vocab_of(model)
    rng = np.random.default_rng(8)
    a = rng.integers(1, vocab, 40).tolist()
    counted = Counting(model.get_input_embeddings())  # attached before the cache sees the model
    pc = PrefixCache(model, None, store=store, block_tokens=8, reuse="always")
    pc.prefill(a)
    b = a[:20] + rng.integers(1, vocab, 30).tolist()  # shares 2 full blocks of KV-less chain, no state at 16-20
    counted.reset()
    got = pc.prefill(b)[1]
    assert pc.stats["last"]["served"] == 0
    # One pass to the last token, then that token (storing the state before it on the way).
    assert len(counted.batches) == 2 and counted.tokens == len(b)
    assert_same(got, plain(model, b), ATOL, "a stepwise miss that parts from a stored prompt")


def test_lookup_refuses_a_stepwise_model_whose_cache_a_caller_would_continue_wrong(store):
    model, why = build("falcon_mamba")
    assert model is not None, why
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    with pytest.raises(UnsupportedModelError, match="one token per forward"):
        pc.lookup([1, 2, 3, 4, 5])
