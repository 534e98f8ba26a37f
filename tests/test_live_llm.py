"""Live-state differential suite, LLM side (issue #20): a model changed *while live* never gets stale hits.

Each case stores KV through one PrefixCache, changes the live model the way a user would
(a plain attribute, a hook, an adapter switch, training mode, patched code, a registered
attention function, autocast, a tokenizer edit, config that changes the cache), and then
asks the *same* PrefixCache again: the result equals a recompute of the model as it is now
(cache on equals cache off), or the request is refused with a typed error before anything
is stored. Each change is also undone, and the original entries must still serve.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama

from promptstore import PromptStore
from promptstore.errors import InvalidInputError, UnsupportedModelError
from promptstore.llm import ChunkCache, PrefixCache

from conftest import run_python
from transparency import assert_same, assert_transparent

IDS = np.random.default_rng(7).integers(0, 500, 45).tolist()
ATOL = 1e-4


def tiny(seed: int = 0, **config) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=1024)
    return LlamaForCausalLM(LlamaConfig(**{**cfg, **config})).eval()


@pytest.fixture
def store(tmp_path):
    with PromptStore(tmp_path / "store", memory_bytes="256MiB") as s:
        yield s


def plain(model, ids=IDS):
    with torch.no_grad():
        return model(torch.as_tensor([ids])).logits[0, -1]


def served_after(pc, ids=IDS, what="after the change", want=None):
    """Cache-on equals cache-off (twice); the tokens served by the first of the two."""
    served = []

    def cached():
        out = pc.prefill(ids)[1]
        served.append(pc.stats["last"]["served"])
        return out

    assert_transparent(cached, (lambda: want) if want is not None else (lambda: plain(pc.model, ids)), atol=ATOL,
                       what=what)
    assert served[1] == len(ids) - 1  # the second run is served from what the first stored
    return served[0]


# -- state that is not a tensor --------------------------------------------------------------
def _set_eps(m):
    m.model.norm.variance_epsilon = 0.5


def _set_scaling(m):
    for layer in m.model.layers:
        layer.self_attn.scaling = layer.self_attn.scaling * 3


def _set_rotary_scaling(m):
    m.model.rotary_emb.attention_scaling = 1.7


def _set_layer_eps(m):
    m.model.layers[1].input_layernorm.variance_epsilon = 2.0


def _set_original_inv_freq(m):
    # A tensor held as a plain attribute (not a buffer): transformers' rotary keeps one.
    m.model.rotary_emb.inv_freq = m.model.rotary_emb.inv_freq * 0.5


def _set_config_head_dim_scale(m):
    m.config.attention_multiplier = 2.0  # a config field the model does not read: keyed, outputs equal


SETTINGS = {"norm_eps": _set_eps, "attention_scaling": _set_scaling, "rotary_attention_scaling": _set_rotary_scaling,
            "layer_norm_eps": _set_layer_eps, "rotary_inv_freq_attribute": _set_original_inv_freq,
            "unread_config_field": _set_config_head_dim_scale}


@pytest.mark.parametrize("change", list(SETTINGS))
def test_a_changed_plain_setting_misses_and_equals_a_recompute(store, change):
    model = tiny()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    pc.prefill(IDS)
    before = plain(model)
    SETTINGS[change](model)
    assert served_after(pc, what=change) == 0
    if change != "unread_config_field":
        assert not torch.allclose(plain(model), before, atol=1e-3), "the change must matter for this test to bite"


# -- hooks -------------------------------------------------------------------------------------
def test_a_steering_hook_is_keyed_by_what_it_captures(store):
    model = tiny()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    base = pc.prefill(IDS)[1]
    vec = torch.randn(64) * 0.5
    handle = model.model.layers[1].register_forward_hook(lambda mod, args, out: (out[0] + vec,) + tuple(out[1:])
                                                         if isinstance(out, tuple) else out + vec)
    assert served_after(pc, what="with a steering hook") == 0
    vec.mul_(3)  # the captured tensor edited in place: another steering strength
    assert served_after(pc, what="after the steering vector changed") == 0
    handle.remove()
    assert_same(pc.prefill(IDS)[1], base, ATOL, "hook removed")
    assert pc.stats["last"]["served"] == len(IDS) - 1  # the unhooked entries serve again


def test_pre_hooks_global_hooks_and_kwargs_hooks_are_keyed(store):
    model = tiny()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    pc.prefill(IDS)
    h1 = model.model.layers[0].mlp.register_forward_pre_hook(lambda mod, args: (args[0] * 1.5,))
    assert served_after(pc, what="pre-hook") == 0
    h1.remove()
    h2 = torch.nn.modules.module.register_module_forward_hook(
        lambda mod, args, out: out * 0.9 if isinstance(mod, torch.nn.Linear) else None)
    try:
        assert served_after(pc, what="global forward hook") == 0
    finally:
        h2.remove()
    h3 = model.model.layers[2].register_forward_pre_hook(
        lambda mod, args, kwargs: (args, {**kwargs, "hidden_states": kwargs["hidden_states"] * 0.5})
        if "hidden_states" in kwargs else (tuple(a * 0.5 if torch.is_tensor(a) and a.is_floating_point() else a
                                                 for a in args), kwargs), with_kwargs=True)
    assert served_after(pc, what="pre-hook with kwargs") == 0
    h3.remove()


# -- live code -----------------------------------------------------------------------------
def test_a_patched_class_method_misses(store, monkeypatch):
    model = tiny()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    pc.prefill(IDS)
    original = modeling_llama.LlamaMLP.forward
    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", lambda self, x: original(self, x) * 0.5)
    assert served_after(pc, what="patched LlamaMLP.forward") == 0


def test_a_method_patched_onto_one_instance_misses(store):
    model = tiny()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    pc.prefill(IDS)
    mlp = model.model.layers[0].mlp
    mlp.forward = types.MethodType(lambda self, x: self.down_proj(torch.relu(self.up_proj(x))), mlp)
    assert served_after(pc, what="instance forward") == 0


def test_a_patched_module_function_misses(store, monkeypatch):
    model = tiny()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    pc.prefill(IDS)
    original = modeling_llama.apply_rotary_pos_emb

    def half_rotary(q, k, cos, sin, *args, **kwargs):
        return original(q, k, cos * 0.5, sin * 0.5, *args, **kwargs)

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", half_rotary)
    assert served_after(pc, what="patched apply_rotary_pos_emb") == 0


def test_a_registered_attention_function_registered_again_misses(store):
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def scaled(module, q, k, v, mask, scaling=None, **kw):
        return sdpa_attention_forward(module, q, k, v, mask, scaling=scaling, **kw)

    def hotter(module, q, k, v, mask, scaling=None, **kw):
        return sdpa_attention_forward(module, q, k, v, mask, scaling=(scaling or 1.0) * 2.0, **kw)

    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register("ps_live_test", scaled)
    AttentionMaskInterface.register("ps_live_test", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    try:
        model = tiny()
        model.set_attn_implementation("ps_live_test")
        pc = PrefixCache(model, None, store=store, block_tokens=8)
        pc.prefill(IDS)
        AttentionInterface.register("ps_live_test", hotter)  # same name, other function
        assert served_after(pc, what="attention function registered again") == 0
    finally:
        AttentionInterface._global_mapping.pop("ps_live_test", None)
        AttentionMaskInterface._global_mapping.pop("ps_live_test", None)


# -- training mode, adapters, packed weights ---------------------------------------------------------
def test_training_mode_with_dropout_is_refused_before_anything_is_stored(store):
    model = tiny(attention_dropout=0.2)
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    model.train()
    with pytest.raises(UnsupportedModelError, match="training mode"):
        pc.prefill(IDS)
    with pytest.raises(UnsupportedModelError, match="training mode"):
        pc.generate(IDS, max_new_tokens=2, do_sample=False)
    assert not store.ls("llm.kv")
    model.eval()
    assert served_after(pc, what="back in eval mode") == 0


def test_training_mode_without_dropout_is_keyed_and_exact(store):
    model = tiny()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    pc.prefill(IDS)
    model.train()
    assert served_after(pc, what="training mode, no dropout") == 0  # its own key space


@pytest.fixture
def lora():
    peft = pytest.importorskip("peft")
    base = tiny()
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), adapter_name="a")
    model.add_adapter("b", peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)  # peft starts B at zero: adapters would change nothing
    return model.eval()


def test_unmerged_lora_adapters_switched_live_never_cross(store, lora):
    pc = PrefixCache(lora, None, store=store, block_tokens=8)
    pc.prefill(IDS)
    with lora.disable_adapter():
        assert served_after(pc, what="adapter disabled") == 0
    lora.set_adapter("b")
    assert served_after(pc, what="adapter b") == 0
    lora.set_adapter("a")  # back: peft now holds "a" where it held ["a"], another key (a miss, never wrong)
    assert_same(pc.prefill(IDS)[1], plain(lora), ATOL, "adapter a again")


def test_two_dynamically_quantized_models_never_share_entries(store):
    qa = torch.ao.quantization.quantize_dynamic(tiny(seed=0), {torch.nn.Linear}, dtype=torch.qint8)
    qb = torch.ao.quantization.quantize_dynamic(tiny(seed=0), {torch.nn.Linear}, dtype=torch.qint8)
    with torch.no_grad():  # same float embeddings; other packed weights
        qb.model.layers[0].mlp.down_proj.set_weight_bias(
            torch.quantize_per_tensor(torch.randn(64, 128) * 0.1, 0.01, 0, torch.qint8), None)
    try:
        pa = PrefixCache(qa, None, store=store, block_tokens=8)
    except UnsupportedModelError as exc:  # refused is also honest; then nothing may be stored
        assert not store.ls("llm.kv"), exc
        return
    assert pa.fingerprint != PrefixCache(qb, None, store=store, block_tokens=8).fingerprint
    pa.prefill(IDS)
    assert served_after(PrefixCache(qb, None, store=store, block_tokens=8), what="other packed weights") == 0


# -- ambient torch state --------------------------------------------------------------------------
def test_autocast_is_keyed_or_refused_and_never_served_to_fp32(store):
    model = tiny()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        try:
            want = plain(model)
            assert_transparent(lambda: pc.prefill(IDS)[1], lambda: want, atol=ATOL, what="under autocast")
        except UnsupportedModelError:
            pass  # refused, typed
    assert served_after(pc, what="fp32 after autocast") == 0


# -- the cache's structure changed on a live model ------------------------------------------------------
def test_a_sliding_window_set_on_a_live_model_is_rechecked(store):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, sliding_window=None)).eval()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    pc.prefill(IDS)
    model.config.sliding_window = 16  # the cache now drops old tokens, and attention sees fewer
    assert len(IDS) > 16
    assert served_after(pc, what="sliding window set live") == 0
    model.config.sliding_window = 24  # another window: other KV again
    assert served_after(pc, what="another sliding window") == 0


# -- generation settings, resolved like model.generate --------------------------------------------------
@pytest.mark.parametrize("how", ["model_config_beams", "passed_config_sequences", "kwargs_beams", "static_cache",
                                 "one_token_prompt_beams"])
def test_generation_settings_prefixcache_cannot_serve_are_refused_before_any_work(store, how):
    from transformers import GenerationConfig

    model = tiny()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    ids, kwargs = IDS, {"max_new_tokens": 3}
    if how == "model_config_beams":
        model.generation_config.num_beams = 2
    elif how == "passed_config_sequences":
        kwargs["generation_config"] = GenerationConfig(num_return_sequences=2, do_sample=True, max_new_tokens=3)
    elif how == "kwargs_beams":
        kwargs["num_beams"] = 3
    elif how == "static_cache":
        kwargs["cache_implementation"] = "static"
    else:
        model.generation_config.num_beams = 2
        ids = IDS[:1]
    with pytest.raises(InvalidInputError):
        pc.generate(ids, **kwargs)
    assert not store.ls("llm.kv")  # nothing stored, nothing run (the model check was stored when pc was built)


def test_generation_config_greedy_settings_are_resolved_and_exact(store):
    from transformers import GenerationConfig

    model = tiny()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    config = GenerationConfig(max_new_tokens=6, do_sample=False)
    want = model.generate(torch.as_tensor([IDS]), attention_mask=torch.ones(1, len(IDS), dtype=torch.long),
                          generation_config=config)
    for _ in range(2):
        assert pc.generate(IDS, generation_config=config).tolist() == want.tolist()


# -- raw crashes -------------------------------------------------------------------------------------
def test_a_lookup_made_under_inference_mode_continues_outside_it(store):
    model = tiny()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    pc.prefill(IDS)
    with torch.inference_mode():
        cache, n = pc.lookup(IDS)
    assert n == len(IDS) - 1
    with torch.no_grad():
        out = model(torch.as_tensor([IDS[n:]]), past_key_values=cache).logits[0, -1]
        more = model(torch.as_tensor([[3]]), past_key_values=cache).logits[0, -1]
    assert_same(out, plain(model), ATOL, "continued outside inference mode")
    assert_same(more, plain(model, IDS + [3]), ATOL, "one more token")


def test_chunk_cache_blend_on_a_one_layer_model_is_exact_or_refused(store):
    model = tiny(num_hidden_layers=1)
    segs = [IDS[:6], IDS[6:20], IDS[20:36], IDS[36:]]
    try:
        cc = ChunkCache(model, None, store=store, recompute=1.0, select="blend")
    except (UnsupportedModelError, InvalidInputError):
        return
    logits = cc.prefill(segs)[1]
    assert_same(logits, plain(model, [t for s in segs for t in s]), ATOL, "blend on one layer")


# -- a fresh process ---------------------------------------------------------------------------------
CHILD = '''
import sys, numpy as np, torch
from transformers import LlamaConfig, LlamaForCausalLM
from promptstore import PromptStore
from promptstore.llm import PrefixCache
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)).eval()
if sys.argv[2] == "hook":
    vec = torch.full((64,), 0.3)
    model.model.layers[1].register_forward_hook(lambda m, a, o: (o[0] + vec,) + tuple(o[1:]) if isinstance(o, tuple) else o + vec)
ids = np.random.default_rng(7).integers(0, 500, 45).tolist()
with PromptStore(sys.argv[1]) as store:
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    logits = pc.prefill(ids)[1]
    with torch.no_grad():
        want = model(torch.as_tensor([ids])).logits[0, -1]
print(pc.stats["last"]["served"], float((logits - want).abs().max()))
'''


def test_a_fresh_process_without_the_hook_never_reads_the_hooked_entries(tmp_path):
    folder = str(tmp_path / "shared")
    first = run_python(CHILD, folder, "hook").stdout.split()
    assert first[0] == "0" and float(first[1]) <= ATOL
    second = run_python(CHILD, folder, "plain").stdout.split()
    assert second[0] == "0", "the unhooked process was served the hooked process's KV"
    assert float(second[1]) <= ATOL
    again = run_python(CHILD, folder, "hook").stdout.split()
    assert again[0] == str(len(IDS) - 1) and float(again[1]) <= ATOL  # each keeps its own entries


# -- found by an adversarial review of the first version (each was a silent stale hit) ----------------------
class _Scaled(torch.nn.Module):
    FACTOR = 1.0  # a class constant forward reads

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * self.w * self.FACTOR


class _Sub(_Scaled):
    def forward(self, x):
        return super().forward(x) + 0.0  # the parent's forward runs too


def _with_extra(model, module):
    norm = model.model.layers[0].post_attention_layernorm
    model.model.layers[0].post_attention_layernorm = torch.nn.Sequential(norm, module)
    return model


def _noisy_mode():
    from torch.overrides import TorchFunctionMode

    class Scale(TorchFunctionMode):
        def __init__(self, s):
            super().__init__()
            self.s = s

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            return out * self.s if func is torch.nn.functional.silu else out

    return Scale


def _patch_no_grad_partial(model, scale):
    import functools

    mlp = model.model.layers[0].mlp

    def fwd(self, x, scale):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) * scale

    mlp.forward = torch.no_grad()(functools.partial(fwd, mlp, scale=scale))


@pytest.mark.parametrize("change", ["parent_call_patched", "super_forward_patched", "class_constant",
                                    "no_grad_partial_forward", "parameter_attribute", "large_tensor_table"])
def test_live_changes_found_by_review_miss_and_equal_a_recompute(store, monkeypatch, change):
    from transformers import modeling_layers

    model = tiny()
    if change in ("super_forward_patched", "class_constant"):
        _with_extra(model, _Sub(64))
    if change == "no_grad_partial_forward":
        _patch_no_grad_partial(model, 1.0)
    if change == "parameter_attribute":
        norm = model.model.norm
        norm.weight.gain = 1.0
        monkeypatch.setattr(type(norm), "forward", lambda self, h: self.weight * getattr(self.weight, "gain", 1.0) * h)
    if change == "large_tensor_table":
        model.model.layers[0].mlp.table = [torch.zeros(4) for _ in range(5000)]
        original = modeling_llama.LlamaMLP.forward
        monkeypatch.setattr(modeling_llama.LlamaMLP, "forward",
                            lambda self, x: original(self, x) + (self.table[2500].sum() if hasattr(self, "table") else 0))
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    pc.prefill(IDS)
    if change == "parent_call_patched":
        original_call = modeling_layers.GradientCheckpointingLayer.__call__
        monkeypatch.setattr(modeling_layers.GradientCheckpointingLayer, "__call__",
                            lambda self, *a, **k: (lambda o: (o[0] * 1.3, *o[1:]) if isinstance(o, tuple) else o * 1.3)(
                                original_call(self, *a, **k)))
    elif change == "super_forward_patched":
        monkeypatch.setattr(_Scaled, "forward", lambda self, x: x * self.w * 2.0)
    elif change == "class_constant":
        monkeypatch.setattr(_Scaled, "FACTOR", 3.0)
    elif change == "no_grad_partial_forward":
        _patch_no_grad_partial(model, 3.0)
    elif change == "parameter_attribute":
        model.model.norm.weight.gain = 3.0
    elif change == "large_tensor_table":
        model.model.layers[0].mlp.table = [torch.full((4,), float(i == 2500)) for i in range(5000)]  # a new table
    assert served_after(pc, what=change) == 0


def test_patched_cache_code_is_another_key(store, monkeypatch):
    """The cache classes every attention layer calls are keyed too (equality is not claimed: restored
    caches write through promptstore's own layer class, so a patched DynamicLayer.update is library
    internals, README: out of contract)."""
    from transformers import cache_utils

    pc = PrefixCache(tiny(), None, store=store, block_tokens=8)
    before = pc.fingerprint
    original = cache_utils.DynamicLayer.update
    monkeypatch.setattr(cache_utils.DynamicLayer, "update", lambda self, k, v, *a, **kw: original(self, k, v * 1.5, *a, **kw))
    assert pc.fingerprint != before


def test_a_torch_function_mode_is_keyed_by_its_fields(store):
    scale = _noisy_mode()
    model = tiny()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    with scale(1.0):
        pc.prefill(IDS)
    with scale(2.0):
        want = plain(model)
        assert served_after(pc, what="function mode with another field", want=want) == 0


def test_torch_compile_is_refused_before_anything_is_stored(store):
    model = tiny()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    model.model.layers[0].mlp.compile(backend="eager")
    with pytest.raises(UnsupportedModelError, match="torch.compile"):
        pc.prefill(IDS)
    assert not store.ls("llm.kv")


def test_chunk_cache_follows_rotary_frequencies_changed_live(store):
    model = tiny()
    segs = [IDS[:6], IDS[6:20], IDS[20:36], IDS[36:]]
    cc = ChunkCache(model, None, store=store, recompute=1.0)
    cc.prefill(segs)
    rotary = model.model.rotary_emb
    rotary.inv_freq = rotary.inv_freq * 0.5
    assert torch.equal(cc._inv_freq, rotary.inv_freq) is False
    logits = cc.prefill(segs)[1]
    assert torch.equal(cc._inv_freq, rotary.inv_freq)
    assert_same(logits, plain(model, [t for s in segs for t in s]), ATOL, "recompute=1.0 after inv_freq changed")


def test_attention_implementation_switched_live_misses_and_equals_a_recompute(store):
    model = tiny()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    pc.prefill(IDS)
    model.set_attn_implementation("eager")
    assert served_after(pc, what="attention implementation switched to eager") == 0
