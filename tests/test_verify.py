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
