"""Verified hits: a hit recomputes a few of its served positions and compares their KV (llm/_verify.py).

Two defences stand between a stale entry and a user: keys that name what runs, and the check of
every hit. Each must hold on its own. The changes below are the ones a description cannot
enumerate in general (a swapped kernel, a patched activation, a class attribute, an object a
module calls, an attribute set on a tensor later, a parametrization's cache), with the classic
ones beside them (weights edited in place, a hook, a config value). Every case runs with both
defences, with the keys alone (``verify=False``), and with the check alone (the description
told to say "nothing changed"): cache-on equals cache-off wherever the defence in force sees the
change, and the cases the keys alone miss are listed, so that the check is shown to be what
catches them.
"""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils import parametrize
from transformers import LlamaForCausalLM

import promptstore.llm._engine as prefix_module
from promptstore import PromptStore
from promptstore.errors import PromptStoreWarning
from promptstore.llm import ChunkCache, PrefixCache
from promptstore.llm._verify import TOLERANCE, VERIFY_POSITIONS, check_positions

from conftest import run_python
from models import tiny_llama

IDS = np.random.default_rng(11).integers(0, 500, 70).tolist()
ATOL = 1e-4


def tiny(seed: int = 0, attn: str = "sdpa") -> LlamaForCausalLM:
    return tiny_llama(seed, attn=attn)


def plain(model, ids=IDS):
    with torch.no_grad():
        return model(torch.as_tensor([ids])).logits[0, -1]


# -- the changes: each returns an undo ---------------------------------------------------------
class Gain(torch.nn.Module):
    """A user's wrapper whose forward reads a *class* attribute."""

    gain = 1.0

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) * type(self).gain


class Helper:
    """A plain object a module holds and calls (a router, a quantizer helper)."""

    def __call__(self, x):
        return x


class Routed(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.helper = Helper()

    def forward(self, x):
        return self.helper(self.inner(x))


class Tagged(torch.nn.Module):
    """Reads an attribute of its weight tensor (set by quantization or pruning tools)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) * getattr(self.inner.down_proj.weight, "scale", 1.0)


class Scale(torch.nn.Module):
    def forward(self, w):
        return w * 1.0


def _install(model, wrapper):
    """Wrap layer 0's MLP in ``wrapper`` (before anything is stored: the wrapper is part of the model)."""
    model.model.layers[0].mlp = wrapper(model.model.layers[0].mlp)


def swap_sdpa(model):
    original = F.scaled_dot_product_attention

    def sage_like(q, k, v, *args, **kwargs):  # another kernel: same call, slightly other numbers
        return original(q, k, v, *args, **kwargs) * 1.01

    F.scaled_dot_product_attention = sage_like
    return lambda: setattr(F, "scaled_dot_product_attention", original)


def patch_silu(model):
    original = F.silu

    def silu(x, inplace=False):
        return original(x) * 1.01

    F.silu = silu
    return lambda: setattr(F, "silu", original)


def patch_rsqrt(model):
    original = torch.rsqrt
    torch.rsqrt = lambda x, *a, **k: original(x, *a, **k) * 1.01
    return lambda: setattr(torch, "rsqrt", original)


def class_attribute(model):
    Gain.gain = 1.02
    return lambda: setattr(Gain, "gain", 1.0)


def helper_class_code(model):
    original = Helper.__call__
    Helper.__call__ = lambda self, x: x * 1.02
    return lambda: setattr(Helper, "__call__", original)


def tensor_attribute(model):
    weight = model.model.layers[0].mlp.inner.down_proj.weight
    weight.scale = 1.02
    return lambda: delattr(weight, "scale")


def parametrization_cache(model):
    """Inside ``parametrize.cached()`` the weight computed first is reused after its original is edited;
    the edit takes effect when the context closes (the undo), under the key it had inside."""
    proj = model.model.layers[1].self_attn.o_proj
    stack = contextlib.ExitStack()
    stack.enter_context(parametrize.cached())
    proj.weight  # noqa: B018 - computes and caches the parametrized weight
    with torch.no_grad():
        proj.parametrizations.weight.original.mul_(1.05)
    return stack.close


def weight_in_place(model):
    w = model.model.layers[1].mlp.down_proj.weight
    with torch.no_grad():
        w.mul_(1.02)

    def undo():
        with torch.no_grad():
            w.div_(1.02)
    return undo


def hook(model):
    handle = model.model.layers[0].register_forward_hook(lambda m, a, out: (out[0] * 1.02, *out[1:])
                                                         if isinstance(out, tuple) else out * 1.02)
    return handle.remove


def config_value(model):
    norm = model.model.layers[0].input_layernorm
    old = norm.variance_epsilon
    norm.variance_epsilon = 0.5
    return lambda: setattr(norm, "variance_epsilon", old)


# name -> (change, what to install first, whether the keys alone see it)
CASES = {
    "a swapped attention kernel (F.scaled_dot_product_attention)": (swap_sdpa, None, True),
    "a patched activation (F.silu)": (patch_silu, None, True),
    "a patched torch function (torch.rsqrt)": (patch_rsqrt, None, True),
    "a class attribute read by forward": (class_attribute, Gain, True),
    "the class code of an object a module calls": (helper_class_code, Routed, True),
    "an attribute set on a weight tensor later": (tensor_attribute, Tagged, False),
    "a parametrization's cached weight": (parametrization_cache, "parametrize", False),
    "weights edited in place": (weight_in_place, None, True),
    "a forward hook": (hook, None, True),
    "a module setting": (config_value, None, True),
}


def build(setup):
    model = tiny()
    if setup == "parametrize":
        parametrize.register_parametrization(model.model.layers[1].self_attn.o_proj, "weight", Scale())
    elif setup is not None:
        _install(model, setup)
    return model


@contextlib.contextmanager
def defences(mode, monkeypatch):
    """``both``; ``keys``: no check; ``check``: the description says nothing ever changes."""
    if mode == "check":
        monkeypatch.setattr(prefix_module, "model_fingerprint", lambda model, structure=None: "model:blind")
        monkeypatch.setattr(prefix_module, "ambient_fingerprint", lambda: "ambient:blind")
        monkeypatch.setattr(prefix_module, "cache_code_fingerprint", lambda: "code:blind")
        monkeypatch.setattr(prefix_module, "model_structure", lambda model: ("structure:blind", []))
    yield mode != "keys"


def _serve(pc, ids=IDS):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits = pc.prefill(ids)[1]
    return logits, [w for w in caught if issubclass(w.category, PromptStoreWarning)]


@pytest.mark.parametrize("mode", ["both", "keys", "check"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_live_change_after_storing_is_never_served_stale(case, mode, store, monkeypatch):
    """Stored, changed, asked twice (the second finds what the changed model stored, if anything), undone, asked again."""
    change, setup, described = CASES[case]
    model = build(setup)
    errors = []
    with defences(mode, monkeypatch) as verify:
        pc = PrefixCache(model, store=store, block_tokens=16, verify=verify)
        _serve(pc, IDS[:60])  # stored from the model as it was
        undo = change(model)
        try:
            for _ in range(2):
                want = plain(model)
                errors.append(float((_serve(pc)[0] - want).abs().max()))
        finally:
            undo()
        errors.append(float((_serve(pc)[0] - plain(model)).abs().max()))
    if mode != "keys" or described:
        assert max(errors) <= ATOL, f"{case}: served stale KV with {mode} ({errors})"
    else:
        # The keys alone miss this change: what the check is for (the 'both' and 'check' runs catch it).
        assert max(errors) > ATOL, f"{case}: the keys now see this change: mark it described"


@pytest.mark.parametrize("case", sorted(CASES))
def test_entries_stored_while_the_model_was_changed_are_refused_once_it_is_back(case, store, monkeypatch):
    """Cold: the change is there before anything is stored; entries a blind key stored then are checked later."""
    change, setup, _ = CASES[case]
    model = build(setup)
    with defences("check", monkeypatch):
        pc = PrefixCache(model, store=store, block_tokens=16)
        undo = change(model)
        try:
            _serve(pc, IDS[:60])  # stored from the changed model under the key of the unchanged one
        finally:
            undo()
        got, caught = _serve(pc)
        assert float((got - plain(model)).abs().max()) <= ATOL
        assert pc.stats["last"]["refuted"] == 1 and pc.stats["last"]["served"] == 0
        assert len(caught) == 1 and "first in layer" in str(caught[0].message)
        assert [i for i in store.ls() if i.kind == "llm.kv" and i.created > 0]  # nothing stored was lost


def test_a_refuted_key_stores_nothing_until_a_check_passes_again(store, monkeypatch):
    model = tiny()
    with defences("check", monkeypatch):
        pc = PrefixCache(model, store=store, block_tokens=16)
        pc.prefill(IDS[:40])
        undo = patch_silu(model)
        try:
            before = {i.key for i in store.ls()}
            _, caught = _serve(pc, IDS[:50])
            _, again = _serve(pc, IDS)  # refuted again: no second warning, and nothing stored under the key
            assert len(caught) == 1 and not again
            assert {i.key for i in store.ls()} == before
        finally:
            undo()
        pc.prefill(IDS)  # back as it was: the check passes, and the request stores its new blocks
        assert pc.stats["last"]["refuted"] == 0 and {i.key for i in store.ls()} > before


def test_a_fresh_process_checks_the_entries_another_process_stored(tmp_path, monkeypatch):
    """Another process stored KV from a kernel its key did not name; this one computes it again."""
    folder = tmp_path / "store"
    run_python(f"""
        import sys, torch
        import torch.nn.functional as F
        sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})
        import promptstore.llm._engine as P
        from test_verify import tiny, IDS
        from promptstore import PromptStore
        from promptstore.llm import PrefixCache
        P.ambient_fingerprint = lambda: P.__dict__["_real_ambient"]() if "_real_ambient" in P.__dict__ else None
        original = F.scaled_dot_product_attention
        real = __import__("promptstore.llm._fingerprint", fromlist=["x"]).ambient_fingerprint
        clean = real()  # the ambient state as an unchanged process names it
        P.ambient_fingerprint = lambda: clean
        F.scaled_dot_product_attention = lambda q, k, v, *a, **kw: original(q, k, v, *a, **kw) * 1.01
        with PromptStore({str(folder)!r}) as store:
            PrefixCache(tiny(), store=store, block_tokens=16).prefill(IDS[:60])
        """)
    model = tiny()
    with PromptStore(folder) as store:
        pc = PrefixCache(model, store=store, block_tokens=16)
        got, caught = _serve(pc)
    assert float((got - plain(model)).abs().max()) <= ATOL
    assert pc.stats["last"]["refuted"] == 1 and len(caught) == 1


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_generate_and_chunks_check_their_exact_prefix(attn, store, monkeypatch):
    model = tiny(attn=attn)
    with defences("check", monkeypatch):
        pc = PrefixCache(model, store=store, block_tokens=16)
        pc.generate(IDS[:60], max_new_tokens=1, do_sample=False)
        undo = patch_silu(model)
        try:
            out = pc.generate(IDS, max_new_tokens=6, do_sample=False)
            want = model.generate(torch.as_tensor([IDS]), max_new_tokens=6, do_sample=False)
            assert out.tolist() == want.tolist() and pc.stats["last"]["refuted"] == 1
            cc = ChunkCache(model, store=store, block_tokens=16, recompute=0.0)
            segs = [IDS[:60], IDS[60:66], IDS[66:]]
            _, logits = cc.prefill(segs)
            assert float((logits - plain(model)).abs().max()) <= ATOL
        finally:
            undo()


def test_the_checked_positions_cover_the_first_the_last_and_between():
    assert check_positions(1).tolist() == [0]
    assert check_positions(3).tolist() == [0, 1, 2]
    assert check_positions(100).tolist() == [0, 33, 66, 99]
    assert len(check_positions(10_000)) == VERIFY_POSITIONS


def test_a_check_leaves_the_served_kv_as_it_was(store):
    """The check writes its fresh KV where it recomputes: the stored values are put back, bit for bit."""
    from promptstore.llm._verify import verify_served

    model = tiny()
    pc = PrefixCache(model, store=store, block_tokens=16)
    pc.prefill(IDS)
    cache, n = pc.lookup(IDS)
    before = [layer.keys.clone() for layer in cache.layers], [layer.values.clone() for layer in cache.layers]
    k = torch.stack([layer.keys for layer in cache.layers])
    v = torch.stack([layer.values for layer in cache.layers])
    verdict = verify_served(model, pc.engine.cache_arg, (k, v), n, np.asarray(IDS), TOLERANCE["F32"])
    assert verdict is not None and verdict.ok and verdict.positions == VERIFY_POSITIONS
    assert all(torch.equal(a, b) for a, b in zip(before[0], [x for x in k], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(before[1], [x for x in v], strict=True))


# -- what the description now names or refuses (cheap closings of the same classes) -------------
@pytest.fixture
def precision_api():
    """torch's new per-backend precision API, set as a user would; put back afterwards."""
    paths = [("",), ("cuda", "matmul"), ("mkldnn", "matmul")]

    def holder(path):
        obj = torch.backends
        for part in filter(None, path):
            obj = getattr(obj, part)
        return obj

    old = [holder(p).fp32_precision for p in paths]
    yield lambda value: [setattr(holder(p), "fp32_precision", value) for p in paths]
    for p, value in zip(paths, old, strict=True):
        holder(p).fp32_precision = value
    torch.backends.fp32_precision = "none"


def test_the_new_precision_api_is_named_and_never_raises(store, precision_api):
    from promptstore._live import ambient_identity

    before = ambient_identity()
    precision_api("tf32")
    after = ambient_identity()  # the legacy flags raise RuntimeError once the new API is set
    assert after != before
    pc = PrefixCache(tiny(), store=store, block_tokens=16)
    logits = pc.prefill(IDS)[1]
    assert float((logits - plain(pc.model)).abs().max()) <= ATOL


def test_a_model_on_the_meta_device_is_refused(store):
    from promptstore.errors import UnsupportedModelError

    with torch.device("meta"):
        model = tiny()
    with pytest.raises(UnsupportedModelError, match="meta device"):
        PrefixCache(model, store=store)
    assert not list(store.ls())


def test_inputs_embeds_are_refused_before_any_work(store):
    from promptstore.errors import InvalidInputError

    pc = PrefixCache(tiny(), store=store, block_tokens=16)
    embeds = pc.model.get_input_embeddings()(torch.as_tensor([IDS])) * 1.5
    with pytest.raises(InvalidInputError, match="inputs_embeds"):
        pc.generate(IDS, inputs_embeds=embeds, max_new_tokens=2)
    assert not [i for i in store.ls() if i.kind == "llm.kv"]


@pytest.mark.parametrize("where", ["passed", "the model's own"])
def test_chunk_generate_refuses_beams_from_a_generation_config(where, store):
    from transformers import GenerationConfig

    from promptstore.errors import InvalidInputError

    model = tiny()
    cc = ChunkCache(model, store=store, block_tokens=16)
    kwargs = {"max_new_tokens": 2}
    if where == "passed":
        kwargs = {"generation_config": GenerationConfig(num_beams=2, max_new_tokens=2)}
    else:
        model.generation_config.num_return_sequences = 2
        model.generation_config.do_sample = True
    with pytest.raises(InvalidInputError, match="num_beams|num_return_sequences"):
        cc.generate([IDS[:30], IDS[30:60], IDS[60:]], **kwargs)
    assert not [i for i in store.ls() if i.kind.startswith("llm.kv") or i.kind.startswith("llm.chunk.kv")]


def test_a_prompt_tuning_adapter_is_refused(store):
    from peft import PromptTuningConfig, get_peft_model

    from promptstore.errors import UnsupportedModelError

    model = get_peft_model(tiny(), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)).eval()
    with pytest.raises(UnsupportedModelError, match="virtual tokens"):
        PrefixCache(model, store=store)


# -- the bound: unchanged models never fail their check -----------------------------------------
# The zoo's families the check runs on (others are served on their keys: running states, ALiBi
# from a 2-D mask, chunked attention; see verifiable and works_on in llm/_verify.py).
CHECKED_FAMILIES = ["deepseek_v3", "falcon", "gemma", "gemma2", "gpt2", "gpt_oss", "llama", "mistral", "mpt", "phi3",
                    "qwen2"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_type", CHECKED_FAMILIES)
def test_unchanged_models_pass_their_check(model_type, dtype, store):
    """The zoo's short-then-long requests, block-boundary lengths and divergences: every hit checked, none refuted."""
    from promptstore.errors import UnsupportedModelError

    import llm_zoo

    model, why = llm_zoo.build(model_type)
    assert model is not None, why
    model = model.to(dtype)
    try:
        pc = PrefixCache(model, store=store, block_tokens=16)
    except UnsupportedModelError:
        assert dtype == torch.bfloat16, f"{model_type} is served in float32"
        pytest.skip(f"{model_type} is refused in bfloat16 (pieces differ from one pass)")
    assert pc.engine.checkable, f"the check does not run on {model_type}"
    with warnings.catch_warnings():
        warnings.simplefilter("error", PromptStoreWarning)
        for ids in llm_zoo.prompts(llm_zoo.vocab_of(model)):
            pc.prefill(ids)
    assert pc.stats["total"]["verified"] >= 3 and pc.stats["total"]["refuted"] == 0


def test_eager_and_sdpa_pass_their_check_and_both_see_a_change(store, monkeypatch):
    for attn in ("sdpa", "eager"):
        model = tiny(attn=attn)
        with defences("check", monkeypatch):
            pc = PrefixCache(model, store=store, block_tokens=16)
            pc.prefill(IDS[:60])
            pc.prefill(IDS)
            assert pc.stats["last"]["verified"] == 1 and pc.stats["last"]["refuted"] == 0
            undo = patch_silu(model)
            try:
                _, caught = _serve(pc, IDS + [1, 2])
            finally:
                undo()
            assert pc.stats["last"]["refuted"] == 1 and len(caught) == 1


# -- where the check runs, and the verdict that decides it (works_on) ---------------------------
def counted(attn: str = "sdpa") -> LlamaForCausalLM:
    """The tiny model with the suite's counting hook on its embeddings (part of its identity from the start)."""
    from counting import Counting

    model = tiny(attn=attn)
    Counting(model.get_input_embeddings())
    return model


def forwards(model):
    from counting import Counting

    return Counting(model.get_input_embeddings())


def _verdict_entry(store):
    from promptstore.llm._verify import VERIFY_CHECK_KIND

    # The layout's verdict (_admission.py) is of the same kind; the check's is the one with "works".
    found = [(i.key, e) for i in store.ls(VERIFY_CHECK_KIND)
             if (e := store.get(i.key, kind=VERIFY_CHECK_KIND)) is not None and "works" in e.tensors]
    assert len(found) == 1, found
    return found[0]


def _check_hits(store) -> int:
    from promptstore.llm._verify import VERIFY_CHECK_KIND

    return int(store.stats()["kinds"].get(VERIFY_CHECK_KIND, {}).get("hits", 0))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_on_full_attention_the_check_rides_in_the_requests_own_forward(attn, store):
    """The self-test finds the in-forward check right on full attention: a hit then runs one forward, check included."""
    model = counted(attn)
    pc = PrefixCache(model, store=store, block_tokens=16)
    assert pc.engine.checkable and pc.engine.check_in_forward
    pc.prefill(IDS[:60])
    seen = forwards(model)
    logits = pc.prefill(IDS)[1]
    assert pc.stats["last"]["served"] == 60 and pc.stats["last"]["verified"] == 1 and pc.stats["last"]["refuted"] == 0
    assert len(seen.batches) == 1 and seen.tokens == len(IDS) - 60 + VERIFY_POSITIONS
    assert float((logits - plain(model)).abs().max()) <= ATOL


def test_the_verdict_is_stored_and_a_fresh_cache_reads_it_without_running_the_model(store):
    from promptstore.llm._verify import VERIFY_CHECK_KIND

    model = counted()
    pc = PrefixCache(model, store=store, block_tokens=16)
    # Both verdicts (the layout's and the check's) were looked up first: misses of their kind
    assert store.stats()["kinds"][VERIFY_CHECK_KIND]["misses"] == 2 and "unknown" not in store.stats()["kinds"]
    key, entry = _verdict_entry(store)
    assert (entry.meta["works"], entry.meta["in_forward"]) == ("1", "1")
    assert entry.tensors["works"].tolist() == [1, 1]
    hits = _check_hits(store)
    seen = forwards(model)
    fresh = PrefixCache(model, store=store, block_tokens=16)  # its own engine: nothing remembered in process
    assert not seen.batches, "the self-test ran again although its verdict was stored"
    assert _check_hits(store) == hits + 2  # the layout's verdict and the check's
    assert (fresh.engine.checkable, fresh.engine.check_in_forward) == (pc.engine.checkable, pc.engine.check_in_forward)
    assert fresh.engine.check_in_forward
    assert _verdict_entry(store)[0] == key


def test_a_stored_verdict_decides_where_the_check_runs(store):
    """The verdict in the store is what a fresh cache follows (as one stored for an architecture whose
    in-forward check failed, or whose check cannot run at all)."""
    from promptstore.llm._verify import VERIFY_CHECK_KIND

    model = counted()
    PrefixCache(model, store=store, block_tokens=16).prefill(IDS[:60])
    key, _ = _verdict_entry(store)

    def plant(works, in_forward):
        store.put(key, {"works": np.array([works, in_forward], np.int8)}, kind=VERIFY_CHECK_KIND,
                  meta={"works": str(works), "in_forward": str(in_forward)})
        return PrefixCache(model, store=store, block_tokens=16)

    alone = plant(1, 0)
    assert alone.engine.checkable and not alone.engine.check_in_forward
    seen = forwards(model)
    logits = alone.prefill(IDS)[1]
    # the check in a forward of its own (its positions only), then the request's tokens
    assert seen.batches == [1, 1] and seen.tokens == VERIFY_POSITIONS + len(IDS) - 60
    assert alone.stats["last"]["verified"] == 1 and alone.stats["last"]["served"] == 60
    assert float((logits - plain(model)).abs().max()) <= ATOL

    keys_only = plant(0, 0)
    assert not keys_only.engine.checkable and not keys_only.engine.check_in_forward
    seen = forwards(model)
    logits = keys_only.prefill(IDS)[1]
    assert len(seen.batches) == 1 and keys_only.stats["last"]["verified"] == 0
    assert keys_only.stats["last"]["served"] == len(IDS) - 1 and float((logits - plain(model)).abs().max()) <= ATOL


def test_a_fresh_process_reads_the_verdict_another_process_stored(tmp_path):
    """The verdict's key is the same in every process: a second process neither probes nor stores it again."""
    from promptstore.llm._verify import VERIFY_CHECK_KIND

    folder = tmp_path / "store"
    run_python(code=f"""
        import sys
        sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})
        from test_verify import tiny
        from promptstore import PromptStore
        from promptstore.llm import PrefixCache
        with PromptStore({str(folder)!r}) as store:
            assert PrefixCache(tiny(), store=store, block_tokens=16).engine.check_in_forward
        """)
    with PromptStore(folder) as store:
        before = {i.key for i in store.ls(VERIFY_CHECK_KIND)}
        assert len(before) == 2  # the layout's verdict and the check's
        pc = PrefixCache(tiny(), store=store, block_tokens=16)
        assert pc.engine.checkable and pc.engine.check_in_forward
        assert {i.key for i in store.ls(VERIFY_CHECK_KIND)} == before
        assert _check_hits(store) == 2 and store.stats()["kinds"][VERIFY_CHECK_KIND]["misses"] == 0


def test_lookup_of_a_refuted_hit_is_a_miss(store, monkeypatch):
    """lookup runs the check in a forward of its own: a hit that fails it returns nothing, as a miss does."""
    model = tiny()
    with defences("check", monkeypatch):
        pc = PrefixCache(model, store=store, block_tokens=16)
        pc.prefill(IDS[:60])
        assert pc.lookup(IDS)[1] == 60
        undo = patch_silu(model)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert pc.lookup(IDS) == (None, 0)
        finally:
            undo()
        assert len([w for w in caught if issubclass(w.category, PromptStoreWarning)]) == 1
        cache, n = pc.lookup(IDS)  # back as it was: the check passes again
        assert n == 60 and cache.get_seq_length() == 60


def _zero_values(model, layer):
    """A pruned layer: its value projection all zero, so the KV it stores has values of norm 0."""
    proj = model.model.layers[layer].self_attn.v_proj
    saved = proj.weight.detach().clone()
    with torch.no_grad():
        proj.weight.zero_()

    def undo():
        with torch.no_grad():
            proj.weight.copy_(saved)
    return undo


def test_kv_of_norm_zero_passes_its_check_and_a_change_from_it_is_seen(store, monkeypatch):
    """The relative error of all-zero stored values: 0 against zeros, past any bound against anything else."""
    model = tiny()
    unprune = _zero_values(model, -1)  # the last layer: nothing after it changes when its values do
    with defences("check", monkeypatch):
        pc = PrefixCache(model, store=store, block_tokens=16)
        assert pc.engine.checkable
        pc.prefill(IDS[:60])
        logits, caught = _serve(pc)
        assert pc.stats["last"]["verified"] == 1 and pc.stats["last"]["refuted"] == 0 and not caught
        assert pc.stats["last"]["served"] == 60 and float((logits - plain(model)).abs().max()) <= ATOL
        unprune()  # weights edited in place: a blind key still names the pruned model
        logits, caught = _serve(pc, IDS + [3])
        assert pc.stats["last"]["refuted"] == 1 and len(caught) == 1
        assert float((logits - plain(model, IDS + [3])).abs().max()) <= ATOL


def test_a_float64_model_passes_its_check_and_sees_a_change(store, monkeypatch):
    model = tiny().double()
    with defences("check", monkeypatch):
        pc = PrefixCache(model, store=store, block_tokens=16)
        assert pc.engine.checkable
        pc.prefill(IDS[:60])
        logits, caught = _serve(pc)
        assert pc.stats["last"]["verified"] == 1 and pc.stats["last"]["refuted"] == 0 and not caught
        assert float((logits - plain(model)).abs().max()) <= 1e-9
        undo = patch_silu(model)
        try:
            logits, caught = _serve(pc, IDS + [3])
            assert pc.stats["last"]["refuted"] == 1 and len(caught) == 1
            assert float((logits - plain(model, IDS + [3])).abs().max()) <= 1e-9
        finally:
            undo()


# -- where the check cannot run: served on the keys alone ---------------------------------------
class PositionsFromItsCache(LlamaForCausalLM):
    """A model whose forward takes positions from its cache's length, never from ``position_ids``
    (as some remote code does): a plain prefill is exact, a check at scattered positions is not."""

    def forward(self, input_ids=None, position_ids=None, cache=None, **kwargs):
        return super().forward(input_ids=input_ids, cache=cache, **kwargs)


def _served_on_keys_alone(model, store, prompts, atol):
    pc = PrefixCache(model, None, store=store, block_tokens=8, reuse="always")
    assert not pc.engine.checkable and not pc.engine.check_in_forward
    _, entry = _verdict_entry(store)
    assert (entry.meta["works"], entry.meta["in_forward"]) == ("0", "0") and entry.tensors["works"].tolist() == [0, 0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", PromptStoreWarning)
        for ids in prompts:
            logits = pc.prefill(ids)[1]
            assert float((logits - plain(model, ids)).abs().max()) <= atol
    assert pc.stats["total"]["served"] > 0 and pc.stats["total"]["verified"] == 0 and pc.stats["total"]["refuted"] == 0


def test_a_model_whose_check_disagrees_unchanged_is_served_on_its_keys_alone(store):
    from transformers import LlamaConfig

    from models import TINY_LLAMA

    torch.manual_seed(0)
    config = LlamaConfig(**TINY_LLAMA)
    config._attn_implementation = "sdpa"
    model = PositionsFromItsCache(config).eval()
    _served_on_keys_alone(model, store, [IDS[:40], IDS, IDS[:50] + [7, 8]], ATOL)


@pytest.mark.parametrize("model_type", ["bloom", "llama4_text"])  # ALiBi from a 2-D mask; chunked attention
def test_architectures_the_check_cannot_run_on_are_served_on_their_keys_alone(model_type, store):
    import llm_zoo

    model, why = llm_zoo.build(model_type)
    assert model is not None, why
    _served_on_keys_alone(model, store, llm_zoo.prompts(llm_zoo.vocab_of(model)), llm_zoo.ATOL)


def nemotron_without_mamba():
    """Nemotron-H of one attention layer and one MLP layer: its cache keeps KV for one and nothing for the other."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import llm_zoo

    config = AutoConfig.for_model("nemotron_h")
    llm_zoo._shrink(config, 0, set())
    config.layer_types, config.num_hidden_layers = ["full_attention", "mlp"], 2
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def test_a_model_with_cache_less_layers_passes_its_check_and_sees_a_change(store, monkeypatch):
    from promptstore.llm._verify import _layer_plan

    model = nemotron_without_mamba()
    assert _layer_plan(model) == (("full", "none"), None)
    ids = np.random.default_rng(3).integers(1, 100, 50).tolist()
    with defences("check", monkeypatch):
        pc = PrefixCache(model, None, store=store, block_tokens=8, reuse="always")
        assert pc.engine.checkable and not pc.engine.check_in_forward  # the check in a forward of its own
        pc.prefill(ids[:40])
        logits, caught = _serve(pc, ids)
        assert pc.stats["last"]["verified"] == 1 and pc.stats["last"]["refuted"] == 0 and not caught
        assert pc.stats["last"]["served"] == 40 and float((logits - plain(model, ids)).abs().max()) <= ATOL
        # Its only KV is layer 0's, computed from the layer's input: a change must come before it to be seen.
        proj = model.model.layers[0].mixer.k_proj.weight
        with torch.no_grad():
            proj.mul_(1.02)  # edited in place: a blind key still names the model as it was
        try:
            logits, caught = _serve(pc, ids + [5])
            assert pc.stats["last"]["refuted"] == 1 and len(caught) == 1
            assert float((logits - plain(model, ids + [5])).abs().max()) <= ATOL
        finally:
            with torch.no_grad():
                proj.div_(1.02)
