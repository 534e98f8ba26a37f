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
from transformers.models.llama import modeling_llama

from promptstore.errors import InvalidInputError, UnsupportedModelError
from promptstore.llm import ChunkCache, PrefixCache

from conftest import run_python
from models import tiny_llama
from transparency import assert_same, assert_transparent

IDS = np.random.default_rng(7).integers(0, 500, 45).tolist()
ATOL = 1e-4


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
    model = tiny_llama()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    pc.prefill(IDS)
    before = plain(model)
    SETTINGS[change](model)
    assert served_after(pc, what=change) == 0
    if change != "unread_config_field":
        assert not torch.allclose(plain(model), before, atol=1e-3), "the change must matter for this test to bite"


# -- hooks -------------------------------------------------------------------------------------
def test_a_steering_hook_is_keyed_by_what_it_captures(store):
    model = tiny_llama()
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
    model = tiny_llama()
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
    model = tiny_llama()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    pc.prefill(IDS)
    original = modeling_llama.LlamaMLP.forward
    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", lambda self, x: original(self, x) * 0.5)
    assert served_after(pc, what="patched LlamaMLP.forward") == 0


def test_a_method_patched_onto_one_instance_misses(store):
    model = tiny_llama()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    pc.prefill(IDS)
    mlp = model.model.layers[0].mlp
    mlp.forward = types.MethodType(lambda self, x: self.down_proj(torch.relu(self.up_proj(x))), mlp)
    assert served_after(pc, what="instance forward") == 0


def test_a_patched_module_function_misses(store, monkeypatch):
    model = tiny_llama()
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
        model = tiny_llama()
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
    model = tiny_llama(attention_dropout=0.2)
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
    model = tiny_llama()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    pc.prefill(IDS)
    model.train()
    assert served_after(pc, what="training mode, no dropout") == 0  # its own key space


@pytest.fixture
def lora():
    peft = pytest.importorskip("peft")
    base = tiny_llama()
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
    qa = torch.ao.quantization.quantize_dynamic(tiny_llama(seed=0), {torch.nn.Linear}, dtype=torch.qint8)
    qb = torch.ao.quantization.quantize_dynamic(tiny_llama(seed=0), {torch.nn.Linear}, dtype=torch.qint8)
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
    model = tiny_llama()
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

    model = tiny_llama()
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

    model = tiny_llama()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    config = GenerationConfig(max_new_tokens=6, do_sample=False)
    want = model.generate(torch.as_tensor([IDS]), attention_mask=torch.ones(1, len(IDS), dtype=torch.long),
                          generation_config=config)
    for _ in range(2):
        assert pc.generate(IDS, generation_config=config).tolist() == want.tolist()


# -- raw crashes -------------------------------------------------------------------------------------
def test_a_lookup_made_under_inference_mode_continues_outside_it(store):
    model = tiny_llama()
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
    model = tiny_llama(num_hidden_layers=1)
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

    model = tiny_llama()
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

    pc = PrefixCache(tiny_llama(), None, store=store, block_tokens=8)
    before = pc.fingerprint
    original = cache_utils.DynamicLayer.update
    monkeypatch.setattr(cache_utils.DynamicLayer, "update", lambda self, k, v, *a, **kw: original(self, k, v * 1.5, *a, **kw))
    assert pc.fingerprint != before


def test_a_torch_function_mode_is_keyed_by_its_fields(store):
    scale = _noisy_mode()
    model = tiny_llama()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    with scale(1.0):
        pc.prefill(IDS)
    with scale(2.0):
        want = plain(model)
        assert served_after(pc, what="function mode with another field", want=want) == 0


def test_torch_compile_is_refused_before_anything_is_stored(store):
    model = tiny_llama()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    model.model.layers[0].mlp.compile(backend="eager")
    with pytest.raises(UnsupportedModelError, match="torch.compile"):
        pc.prefill(IDS)
    assert not store.ls("llm.kv")


def test_chunk_cache_follows_rotary_frequencies_changed_live(store):
    model = tiny_llama()
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
    model = tiny_llama()
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    pc.prefill(IDS)
    model.set_attn_implementation("eager")
    assert served_after(pc, what="attention implementation switched to eager") == 0


# -- identity details found by mutation testing (each a stale key or a lost refusal) --------------------
def _fast_tokenizer(model):
    """A transformers fast tokenizer over a tokenizers model, with a special token held as an AddedToken."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(model), bos_token=AddedToken("<s>", special=True))


def _tokenizer_models():
    """Vocabularies the identity's fixed probe text cannot tell the edits apart by: either every character of
    the probe is in the vocabulary (no unknown token in it), or none is (and BPE without unk_token drops them)."""
    from tokenizers import models

    from promptstore._live._tokenizers import _PROBE

    chars = sorted(set(_PROBE))
    cover = {t: i for i, t in enumerate(chars + ["[UNK]", "<unk>", "d", "g", "dg", "gd", "<0xE2>", "<0x82>", "<0xAC>"])}
    pieces = {t: i for i, t in enumerate(chars + ["##" + c for c in chars] + ["[UNK]", "<unk>"])}
    return {
        "bpe": lambda: models.BPE(cover, [("d", "g")], unk_token="[UNK]"),
        "bpe_prefix": lambda: models.BPE({"d": 0, "##g": 1, "@@g": 2}, [], continuing_subword_prefix="##"),
        "bpe_suffix": lambda: models.BPE({"d": 0, "g</w>": 1, "g<w>": 2}, [], end_of_word_suffix="</w>"),
        "wordpiece": lambda: models.WordPiece(pieces, unk_token="[UNK]"),
        "wordpiece_prefix": lambda: models.WordPiece({"[UNK]": 0, "d": 1, "##g": 2, "@@g": 3}, unk_token="[UNK]"),
        "wordpiece_long": lambda: models.WordPiece({"[UNK]": 0, "d": 1, "##d": 2}, unk_token="[UNK]"),
        "wordlevel": lambda: models.WordLevel({_PROBE: 0, "[UNK]": 1, "<unk>": 2}, unk_token="[UNK]"),
    }


# (model, setting, new value, a text whose tokens the edit changes)
MODEL_SETTINGS = [("bpe", "unk_token", "<unk>", "€"), ("bpe", "fuse_unk", True, "€€"), ("bpe", "byte_fallback", True, "€"),
                  ("bpe", "dropout", 1.0, "dg"), ("bpe", "ignore_merges", True, "gd"),
                  ("bpe_prefix", "continuing_subword_prefix", "@@", "dg"), ("bpe_suffix", "end_of_word_suffix", "<w>", "dg"),
                  ("wordpiece", "unk_token", "<unk>", "€"), ("wordpiece_prefix", "continuing_subword_prefix", "@@", "dg"),
                  ("wordpiece_long", "max_input_chars_per_word", 200, "d" * 150), ("wordlevel", "unk_token", "<unk>", "zzz")]


@pytest.mark.parametrize(("kind", "setting", "value", "text"), MODEL_SETTINGS,
                         ids=[f"{k}-{s}" for k, s, _, _ in MODEL_SETTINGS])
def test_a_tokenizer_model_setting_edited_in_place_changes_the_identity(kind, setting, value, text):
    """Every model setting the Python API can edit in place is read on every call: the identity moves at
    once, although the model's vocabulary digest is remembered (and the probe text tokenizes as before)."""
    from promptstore._live import tokenizer_identity

    make = _tokenizer_models()[kind]
    tok, untouched = _fast_tokenizer(make()), _fast_tokenizer(make())
    before = tokenizer_identity(tok)
    assert tokenizer_identity(tok) == before  # remembered, unchanged
    original = getattr(tok.backend_tokenizer.model, setting)
    setattr(tok.backend_tokenizer.model, setting, value)
    # (text is encoded only now: BPE caches a word's tokens and keeps them through a setting's edit)
    assert tok(text, add_special_tokens=False)["input_ids"] != untouched(text, add_special_tokens=False)["input_ids"]
    assert tokenizer_identity(tok) != before, f"{setting} edited in place kept the old identity"
    setattr(tok.backend_tokenizer.model, setting, original)
    assert tokenizer_identity(tok) == before


def test_a_tokenizer_model_replaced_by_one_with_other_merges_changes_the_identity():
    """Same type, settings, size and vocabulary, other merges: the tokens of the probe text tell them apart."""
    from tokenizers import models

    from promptstore._live import tokenizer_identity
    from promptstore._live._tokenizers import _PROBE

    a, b, c = _PROBE[:3]
    vocab = {a: 0, b: 1, c: 2, a + b: 3, b + c: 4}
    tok = _fast_tokenizer(models.BPE(vocab, [(a, b)]))
    before, tokens = tokenizer_identity(tok), tok(a + b + c, add_special_tokens=False)["input_ids"]
    tok.backend_tokenizer.model = models.BPE(vocab, [(b, c)])
    assert tok(a + b + c, add_special_tokens=False)["input_ids"] != tokens
    assert tokenizer_identity(tok) != before


def test_a_raw_tokenizer_keeps_encode_special_tokens_between_calls():
    """A tokenizers.Tokenizer used as it is: encode_special_tokens, set once, changes every later encode."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    from promptstore._live import tokenizer_identity

    backend = Tokenizer(models.WordLevel({"a": 0, "<": 1, "|": 2, "x": 3, ">": 4, "[UNK]": 5}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.add_special_tokens([AddedToken("<|x|>", special=True)])
    before, tokens = tokenizer_identity(backend), backend.encode("a<|x|>").ids
    backend.encode_special_tokens = True
    assert backend.encode("a<|x|>").ids != tokens
    assert tokenizer_identity(backend) != before


def test_a_tokenizer_holding_a_tokenizers_part_is_keyed_by_it():
    """A Python-side tokenizer that holds a tokenizers part (a normaliser) is described by its state."""
    from tokenizers import normalizers

    from promptstore._live import tokenizer_identity

    class Normalising:
        def __init__(self, normalizer):
            self.normalizer = normalizer

        def __call__(self, text):
            return self.normalizer.normalize_str(text).split()

    tok = Normalising(normalizers.Lowercase())
    before = tokenizer_identity(tok)
    tok.normalizer = normalizers.Strip()
    assert tok(" A b ") != Normalising(normalizers.Lowercase())(" A b ")
    assert tokenizer_identity(tok) != before


def test_the_prefix_cache_fingerprint_follows_its_tokenizer(store):
    from tokenizers import models

    tok = _fast_tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    pc = PrefixCache(tiny_llama(), tok, store=store, block_tokens=8)
    before = pc.fingerprint
    tok.backend_tokenizer.model.unk_token = "b"
    assert pc.fingerprint != before


_FOLDER_IDENTITY = """
import json, sys
from transformers import AutoTokenizer
from promptstore._live import _tokenizers, load_tokenizer, tokenizer_identity
serialised = []
state = _tokenizers._state
_tokenizers._state = lambda part: (serialised.append(type(part).__name__), state(part))[1]
tok = (load_tokenizer if sys.argv[3] == "recorded" else AutoTokenizer.from_pretrained)(sys.argv[1])
exec(sys.argv[2])  # an edit made after loading
print(json.dumps({"identity": tokenizer_identity(tok), "serialised": serialised,
                  "tokens": tok("abc dg gd", add_special_tokens=False)["input_ids"]}))
"""


def _folder_identity(folder, memo, edit="", how="recorded"):
    import json

    proc = run_python(_FOLDER_IDENTITY, str(folder), edit, how, env={"PROMPTSTORE_DIGESTS": memo})
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_tokenizer_from_a_folder_is_named_in_a_fresh_process_without_serialising_its_vocabulary(tmp_path):
    """The backend's vocabulary digest is remembered between processes under the files it was loaded from
    (load_tokenizer, which load_model uses): a fresh process serialises no model, and gets the identity a
    process without the memo computes; another tokenizer.json, or an edit after loading, is another identity;
    a file rewritten after loading changes nothing the loaded tokenizer is named by; a tokenizer loaded
    without its files recorded serialises its vocabulary in every process."""
    from tokenizers import models

    from promptstore._live._tokenizers import _PROBE

    a, b, c = _PROBE[:3]
    vocab = {a: 0, b: 1, c: 2, a + b: 3, b + c: 4, "d": 5, "g": 6, "dg": 7, "gd": 8, "[UNK]": 9}
    folder, other = tmp_path / "tok", tmp_path / "other"
    _fast_tokenizer(models.BPE(vocab, [(a, b), ("d", "g")], unk_token="[UNK]")).save_pretrained(folder)
    # Other merges the fixed probe text never meets (no "d" or "g" in it): only the file tells them apart.
    _fast_tokenizer(models.BPE(vocab, [(a, b), ("g", "d")], unk_token="[UNK]")).save_pretrained(other)
    memo = str(tmp_path / "digests.sqlite3")
    (tmp_path / "first.json").write_bytes((folder / "tokenizer.json").read_bytes())
    first = _folder_identity(folder, memo)
    assert first["serialised"].count("BPE") == 1  # the first process serialises the vocabulary once
    fresh = _folder_identity(folder, memo)
    assert "BPE" not in fresh["serialised"], "a fresh process serialised the vocabulary although its files are known"
    assert fresh["identity"] == first["identity"] == _folder_identity(folder, "")["identity"]
    # The same folder, another tokenizer.json (other merges, same size, settings and probe tokens): another identity.
    (folder / "tokenizer.json").write_bytes((other / "tokenizer.json").read_bytes())
    changed = _folder_identity(folder, memo)
    assert "BPE" in changed["serialised"] and changed["tokens"] != first["tokens"]
    assert changed["identity"] != first["identity"]
    assert changed["identity"] == _folder_identity(folder, "")["identity"]
    # Edits after loading are read on every call, memo or not: an added token, a model setting.
    for edit in ("tok.add_tokens(['zz'])", "tok.backend_tokenizer.model.unk_token = 'd'"):
        edited = _folder_identity(folder, memo, edit)
        assert edited["identity"] != changed["identity"], edit
        assert edited["identity"] == _folder_identity(folder, "", edit)["identity"], edit
    # The file rewritten after loading: the loaded tokenizer keeps its identity, and a later process that
    # loads the rewritten file is not handed the old vocabulary's digest.
    back = f"open(sys.argv[1] + '/tokenizer.json', 'wb').write(open({str(tmp_path / 'first.json')!r}, 'rb').read())"
    rewritten = _folder_identity(folder, memo, back)
    assert rewritten["identity"] == changed["identity"] and rewritten["tokens"] == changed["tokens"]
    after = _folder_identity(folder, memo)
    assert after["identity"] == first["identity"] and after["tokens"] == first["tokens"]
    # Loaded without its files recorded: serialised in every process, with the same identity.
    plain = [_folder_identity(folder, memo, how="plain") for _ in range(2)]
    assert all("BPE" in p["serialised"] for p in plain) and plain[0]["identity"] == first["identity"]


def test_a_tokenizer_identity_does_not_keep_the_tokenizer_alive():
    import gc
    import weakref

    from tokenizers import models

    from promptstore._live import tokenizer_identity

    tok = _fast_tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tokenizer_identity(tok)
    ref = weakref.ref(tok)
    del tok
    gc.collect()
    assert ref() is None, "the identity's memo keeps the tokenizer (and everything it holds) alive"


def test_autocast_is_refused_before_anything_is_stored(store):
    from promptstore._live import autocast_active

    pc = PrefixCache(tiny_llama(), None, store=store, block_tokens=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_active(torch, "cpu") == "torch.bfloat16"
        with pytest.raises(UnsupportedModelError, match="autocast"):
            pc.prefill(IDS)
    assert autocast_active(torch, "cpu") is None
    assert not store.ls("llm.kv")


@pytest.mark.parametrize("patched", ["DynamicCache.__init__", "DynamicLayer", "DynamicSlidingWindowLayer"])
def test_the_cache_classes_restored_caches_run_are_keyed(store, monkeypatch, patched):
    """transformers' cache classes, and promptstore's layers that restored caches run in their place."""
    from transformers import cache_utils

    from promptstore.llm._buffers import reserved_layer_classes

    pc = PrefixCache(tiny_llama(), None, store=store, block_tokens=8)
    before = pc.fingerprint
    if patched == "DynamicCache.__init__":
        original = cache_utils.DynamicCache.__init__
        monkeypatch.setattr(cache_utils.DynamicCache, "__init__", lambda self, *a, **kw: original(self, *a, **kw))
    else:
        cls = reserved_layer_classes()[patched]  # the layer promptstore restores in place of this one
        original = cls.update
        monkeypatch.setattr(cls, "update", lambda self, k, v, *a, **kw: original(self, k, v * 1.5, *a, **kw))
    assert pc.fingerprint != before


def test_classes_identity_follows_init_and_call(monkeypatch):
    from promptstore._live import classes_identity

    class Scaler:
        def __init__(self):
            self.s = 1.0

        def __call__(self, x):
            return x * self.s

    before = classes_identity(Scaler)
    monkeypatch.setattr(Scaler, "__call__", lambda self, x: x * self.s * 2)
    after_call = classes_identity(Scaler)
    assert after_call != before
    monkeypatch.setattr(Scaler, "__init__", lambda self: setattr(self, "s", 3.0))
    assert classes_identity(Scaler) != after_call


def test_a_numpy_array_on_the_forward_path_is_refused(store):
    """An array's values cannot be read through its fields: refused, never keyed by its type alone."""
    model = tiny_llama()
    model.model.layers[0].mlp.table = np.ones(3)
    with pytest.raises(UnsupportedModelError, match="table"):
        PrefixCache(model, None, store=store, block_tokens=8).prefill(IDS)
    assert not store.ls("llm.kv")


def test_code_compiled_under_a_non_python_file_name_is_named_by_its_code(store, tmp_path):
    """A notebook compiles its cells under the notebook's own file name: two versions of a cell share
    that file, line and constants, and differ only in their bytecode."""
    notebook = tmp_path / "analysis.ipynb"
    notebook.write_text("{}")

    def cell(op):
        namespace = {}
        source = f"def forward(self, x):\n    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) {op} 2\n"
        exec(compile(source, str(notebook), "exec"), namespace)
        return types.MethodType(namespace["forward"], mlp)

    model = tiny_llama()
    mlp = model.model.layers[0].mlp
    mlp.forward = cell("*")
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    pc.prefill(IDS)
    mlp.forward = cell("/")
    assert served_after(pc, what="a notebook cell run again, edited") == 0


def test_code_from_a_python_file_is_named_by_its_source_not_its_bytecode(tmp_path):
    """Keys stay the same across Python versions, whose bytecode for one file differs (stood in for here by
    a code object rebuilt with other bytecode)."""
    from promptstore._live._walk import CODE_MEMO

    path = tmp_path / "steer.py"
    path.write_text("def act(x):\n    return x * 2\n")
    namespace = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    code = namespace["act"].__code__
    other = compile("def act(x):\n    return x / 2\n", "<other>", "exec").co_consts[0]
    assert other.co_code != code.co_code
    assert CODE_MEMO.get(code.replace(co_code=other.co_code))[0] == CODE_MEMO.get(code)[0]


def test_code_without_a_source_file_is_named_with_its_flags():
    """``lambda *a: a`` and ``lambda **a: a`` compile to the same bytecode; called with nothing they return
    () and {}."""
    from promptstore._live import module_identity

    namespace = {}
    exec("positional = lambda *a: a\nkeywords = lambda **a: a\n", namespace)
    holder = torch.nn.Linear(2, 2)
    holder.fn = namespace["positional"]
    before = module_identity(holder)
    holder.fn = namespace["keywords"]
    assert holder.fn() != namespace["positional"]()
    assert module_identity(holder) != before


@pytest.mark.parametrize("edit", ["replace", "add", "remove", "clear"])
def test_a_large_table_edited_in_place_changes_the_identity(edit):
    """A merges table of 5,000 entries held by a module (checked between walks by the dict's version
    tag where CPython's can be read): every kind of edit is seen, and undoing it gives the identity back."""
    from promptstore._live import module_structure

    holder = torch.nn.Linear(2, 2)
    table = {(str(i), str(i + 1)): i for i in range(5000)}
    holder.ranks = table
    before = module_structure(holder)[0]
    assert module_structure(holder)[0] == before
    saved = dict(table)
    if edit == "replace":
        table[("0", "1")] = 4999
    elif edit == "add":
        table[("a", "b")] = 5000
    elif edit == "remove":
        del table[("7", "8")]
    else:
        table.clear()
    assert module_structure(holder)[0] != before
    table.clear()
    table.update(saved)
    assert module_structure(holder)[0] == before


def test_a_table_changed_while_it_is_described_is_described_again():
    """Another thread changing a dict between the walk's read of its version tag and of its items (simulated at
    the tag's read): the next check must not keep a description of the items before the change."""
    import promptstore._live._walk as walk_module
    from promptstore._live import module_structure, reset_memos

    holder = torch.nn.Linear(2, 2)
    table = {f"k{i}": i for i in range(16)}
    holder.table = table
    real, raced = walk_module._dict_version, []

    def racing(d):
        if d is table and not raced:
            raced.append(1)
            table["k0"] = 99  # lands between the tag's read and the items'
        return real(d)

    walk_module._dict_version = racing
    try:
        module_structure(holder)
    finally:
        walk_module._dict_version = real
    assert raced
    memoised = module_structure(holder)[0]
    reset_memos()
    assert module_structure(holder)[0] == memoised


def test_an_objects_dict_replaced_whole_changes_the_identity():
    from promptstore._live import module_structure

    class Settings:
        def __init__(self, scale: float) -> None:
            self.scale = scale

    holder = torch.nn.Linear(2, 2)
    holder.settings = Settings(2.0)
    before = module_structure(holder)[0]
    holder.settings.__dict__ = {"scale": 3.0}  # the old dict is left as it was
    assert module_structure(holder)[0] != before


def test_an_object_with_slots_is_keyed_by_what_they_hold():
    from promptstore._live import module_identity

    class Scale:
        __slots__ = ("factor",)

        def __init__(self, factor):
            self.factor = factor

    holder = torch.nn.Linear(2, 2)
    holder.scale = Scale(1.0)
    before = module_identity(holder)
    holder.scale.factor = 2.0  # edited in place: the same object
    assert module_identity(holder) != before


def test_two_functions_on_one_line_with_the_same_names_and_constants_are_told_apart():
    """Code from a file is named by its place in it: the columns too, not the line alone."""
    from promptstore._live import module_identity

    module = torch.nn.Linear(2, 2)
    double, half = (lambda x: x * 2), (lambda x: x / 2)  # one line; the same names and constants
    module.fn = double
    before = module_identity(module)
    module.fn = half
    assert module_identity(module) != before


def test_a_tokenizer_holding_a_native_part_without_its_own_state_is_refused():
    """tokenizers.Regex has no state of its own to read (only object.__getstate__): refused, never named by its type."""
    from tokenizers import Regex

    from promptstore._live import tokenizer_identity

    class Splitting:
        def __init__(self, pattern):
            self.pattern = pattern

        def __call__(self, text):
            return text.split()

    with pytest.raises(UnsupportedModelError, match="serialisable state"):
        tokenizer_identity(Splitting(Regex(r"\s+")))


def test_a_torchscript_submodule_is_keyed_by_its_code_training_flag_and_tensors():
    """A scripted module keeps its state in C++: its compiled code, its flag and its own tensors name it."""
    from promptstore._live import module_identity

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)

    torch.manual_seed(0)
    model = Wrapper(torch.jit.script(torch.nn.Linear(4, 4))).eval()
    seen = {module_identity(model)}
    with torch.no_grad():
        model.inner.weight[0, 0] += 1.0  # in place, inside the scripted module
    seen.add(module_identity(model))
    model.inner.train()
    seen.add(module_identity(model))
    model.inner.eval()
    model.inner = torch.jit.script(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    seen.add(module_identity(model))
    assert len(seen) == 4


def test_refuse_random_names_a_training_dropout_and_passes_in_eval():
    from promptstore._live import refuse_random

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1))
    model.train()
    with pytest.raises(UnsupportedModelError, match="1"):  # the dropout's place in the tree
        refuse_random(model)
    model.eval()
    refuse_random(model)


def test_describe_lines_show_what_changed_between_two_calls():
    from promptstore._live import describe_lines, module_identity

    model = tiny_llama()
    before = describe_lines(model)
    assert before and all(isinstance(line, str) for line in before)
    model.model.norm.variance_epsilon = 0.5
    after = describe_lines(model)
    changed = [line for line in after if line not in before]
    assert changed and any("0.5" in line for line in changed)
    assert module_identity(model) != module_identity(tiny_llama())


# -- identity details found by mutation testing, second pass ----------------------------------------------
def test_autocast_is_read_per_device_through_the_older_torch_functions():
    """torch 2.1-2.3 (supported) has no is_autocast_enabled(device): the fallback reads the CPU's own flag and
    dtype for "cpu" and the GPU's for "cuda", so the ambient identity is the one the newer functions give."""
    from promptstore._live import autocast_active
    from promptstore._live._ambient import ambient_lines

    class OlderTorch:
        """torch as torch 2.3 spells autocast: one function per device type, no device argument."""

        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def is_autocast_enabled():  # the GPU's flag; passing a device is a TypeError there
            return torch.is_autocast_enabled("cuda")

        @staticmethod
        def is_autocast_cpu_enabled():
            return torch.is_autocast_enabled("cpu")

        @staticmethod
        def get_autocast_cpu_dtype():
            return torch.get_autocast_dtype("cpu")

        @staticmethod
        def get_autocast_gpu_dtype():
            return torch.get_autocast_dtype("cuda")

    older = OlderTorch()
    outside = ambient_lines(older)
    assert outside == ambient_lines(torch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_active(older, "cpu") == "torch.bfloat16"
        assert autocast_active(older, "cuda") is None
        assert ambient_lines(older) == ambient_lines(torch) != outside


@pytest.mark.parametrize("flag", ["allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction",
                                  "allow_tf32"])
def test_a_cublas_precision_switch_flipped_is_another_ambient_identity(flag):
    """cuBLAS's reduced-precision reductions (and TF32) change a GPU matmul's numbers; the switches can be
    flipped on any build, and each is keyed."""
    from promptstore._live import ambient_identity

    matmul = torch.backends.cuda.matmul
    before, was = ambient_identity(), getattr(matmul, flag)
    try:
        setattr(matmul, flag, not was)
    except (RuntimeError, AttributeError) as exc:
        pytest.skip(f"this torch build cannot set {flag}: {exc}")
    try:
        assert getattr(matmul, flag) is (not was)
        assert ambient_identity() != before, f"{flag} flipped kept the ambient identity"
    finally:
        setattr(matmul, flag, was)
    assert ambient_identity() == before


class _PackedLinear(torch.nn.Module):
    """A hand-rolled int8 layer: its weights packed for the quantized engine (an opaque TorchScript object,
    which its own _save_to_state_dict unpacks), its bias a float parameter."""

    def __init__(self, weight):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(weight.shape[0]))
        self.pack(weight)

    def pack(self, weight):
        self.packed = torch.ops.quantized.linear_prepack(torch.quantize_per_tensor(weight, 0.01, 0, torch.qint8), None)

    def forward(self, x):
        return torch.ops.quantized.linear_dynamic(x, self.packed) + self.bias

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = torch.ops.quantized.linear_unpack(self.packed)[0]


def test_packed_weights_are_keyed_through_what_the_state_dict_saves():
    """Packed weights live in C++: the identity reads them through the module's _save_to_state_dict, beside
    its parameters (here a bias saved under a name sorted first), in torch's dynamic quantization and in a
    hand-rolled layer alike."""
    from promptstore._live import module_identity

    torch.manual_seed(0)
    x = torch.randn(2, 8)
    layer = _PackedLinear(torch.randn(4, 8) * 0.1)
    before, out = module_identity(layer), layer(x)
    layer.pack(torch.randn(4, 8) * 0.1)  # repacked: other weights, the same parameters
    assert not torch.allclose(layer(x), out)
    assert module_identity(layer) != before

    model = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(torch.nn.Linear(8, 4)), {torch.nn.Linear},
                                                   dtype=torch.qint8)
    before, out = module_identity(model), model(x)
    model[0].set_weight_bias(torch.quantize_per_tensor(torch.randn(4, 8) * 0.1, 0.01, 0, torch.qint8), None)
    assert not torch.allclose(model(x), out)
    assert module_identity(model) != before


def test_an_opaque_torchscript_object_its_state_dict_does_not_save_is_refused():
    """The same packed weights on a module whose state_dict does not save them: nothing can read them."""
    from promptstore._live import module_identity

    holder = torch.nn.Linear(8, 4)
    holder.packed = torch.ops.quantized.linear_prepack(
        torch.quantize_per_tensor(torch.randn(4, 8) * 0.1, 0.01, 0, torch.qint8), None)
    with pytest.raises(UnsupportedModelError, match="packed"):
        module_identity(holder)


class _Rounding:
    """A forward hook object that rounds a layer's output through its ``dtype`` field."""

    def __init__(self, dtype):
        self.dtype = dtype

    def __call__(self, module, args, out):
        return out.to(self.dtype).to(out.dtype)


def test_a_hook_objects_dtype_field_is_keyed(store):
    """Plain objects keep every field (only a transformers config leaves out where it came from, its
    ``dtype`` among them): a hook's ``dtype`` edited in place is another key."""
    model = tiny_llama()
    rounding = _Rounding(torch.float32)
    model.model.layers[1].mlp.register_forward_hook(rounding)
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    pc.prefill(IDS)
    before = plain(model)
    rounding.dtype = torch.float8_e4m3fn  # float8 simulated on a float model
    assert not torch.allclose(plain(model), before, atol=1e-3), "the change must matter for this test to bite"
    assert served_after(pc, what="the hook now rounds to float8") == 0


_GAIN = 1.0  # a module-level setting the patched forward below reads as a global
_LLAMA_MLP_FORWARD = modeling_llama.LlamaMLP.forward


def _gained_mlp_forward(self, x):
    return _LLAMA_MLP_FORWARD(self, x) * _GAIN


def test_a_module_global_that_patched_code_reads_is_keyed(store, monkeypatch):
    import sys

    model = tiny_llama()
    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", _gained_mlp_forward)
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    pc.prefill(IDS)
    monkeypatch.setattr(sys.modules[__name__], "_GAIN", 3.0)
    assert served_after(pc, what="the module global the patched forward reads") == 0


def test_a_partial_of_a_class_is_keyed_by_the_class_and_its_arguments():
    """A layer factory (``functools.partial(nn.GELU, approximate=...)``) kept on a module."""
    import functools

    from promptstore._live import module_identity

    holder = torch.nn.Linear(2, 2)
    seen = set()
    for factory in (functools.partial(torch.nn.GELU, approximate="tanh"), functools.partial(torch.nn.GELU),
                    functools.partial(torch.nn.SiLU)):
        holder.make_act = factory
        seen.add(module_identity(holder))
    assert len(seen) == 3


def _script(source):
    """A TorchScript function compiled from source (as torch.jit.load gives one): no Python function behind it."""
    return torch.jit.CompilationUnit(source).act


_SCRIPTED = _script("def act(x):\n    return x * 2.0\n")


def _scripted_forward(self, x):
    return _LLAMA_MLP_FORWARD(self, _SCRIPTED(x))


def test_torchscript_functions_are_keyed_by_their_code(monkeypatch):
    """Held as an attribute, in a partial, or named as a module global by the code that runs: two TorchScript
    functions with other code are other identities (found by mutation testing: held or global, they were
    named by their type alone)."""
    import functools
    import sys

    from promptstore._live import module_identity

    double, half = _script("def act(x):\n    return x * 2.0\n"), _script("def act(x):\n    return x / 2.0\n")
    assert not torch.equal(double(torch.ones(1)), half(torch.ones(1)))
    holder = torch.nn.Linear(2, 2)
    for wrap in (lambda f: f, functools.partial):
        holder.act = wrap(double)
        before = module_identity(holder)
        holder.act = wrap(half)
        assert module_identity(holder) != before
    del holder.act

    model = tiny_llama()
    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", _scripted_forward)
    before = module_identity(model)
    monkeypatch.setattr(sys.modules[__name__], "_SCRIPTED", half)
    assert module_identity(model) != before


def test_a_partial_of_a_scripted_module_is_keyed_by_its_weights():
    """A scripted module reached as code (in a partial) is a module: its tensors are keyed, not only its code
    (found by mutation testing: its weights edited in place kept the identity)."""
    import functools

    from promptstore._live import module_identity

    torch.manual_seed(0)
    scripted = torch.jit.script(torch.nn.Linear(2, 2))
    holder = torch.nn.Linear(2, 2)
    holder.head = functools.partial(scripted)
    before = module_identity(holder)
    with torch.no_grad():
        scripted.weight.add_(1.0)
    assert module_identity(holder) != before


def test_a_torchscript_method_is_refused():
    """A scripted module's method runs on tensors held in C++, out of its reach; a loaded module's method has
    no Python field at all (found by mutation testing: held, it was named by its type alone)."""
    import functools
    import io

    from promptstore._live import module_identity

    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), buffer)
    buffer.seek(0)
    loaded = torch.jit.load(buffer)
    holder = torch.nn.Linear(2, 2)
    for held in (loaded.forward, functools.partial(torch.jit.script(torch.nn.Linear(2, 2)).forward)):
        holder.head = held
        with pytest.raises(UnsupportedModelError, match="TorchScript method"):
            module_identity(holder)
    holder.head = loaded  # the module itself: its code and tensors
    module_identity(holder)


class _SeededGenerator(np.random.Generator):
    """A user's generator class: a Python subclass, so it has a __dict__ (empty) where numpy's own has none."""


class _LegacyRandomState(np.random.RandomState):
    pass


NUMPY_GENERATORS = {"default_rng": lambda: np.random.default_rng(0), "bit_generator": lambda: np.random.PCG64(0),
                    "generator_subclass": lambda: _SeededGenerator(np.random.PCG64(0)),
                    "random_state_subclass": lambda: _LegacyRandomState(0)}


@pytest.mark.parametrize("kind", list(NUMPY_GENERATORS))
def test_a_numpy_generator_is_refused_as_random(store, kind):
    """Whatever its class (found by mutation testing: a subclass was keyed by its empty fields, and one
    draw would have been stored for good)."""
    model = tiny_llama()
    model.model.layers[0].mlp.rng = NUMPY_GENERATORS[kind]()
    with pytest.raises(UnsupportedModelError, match="random generator"):
        PrefixCache(model, None, store=store, block_tokens=8).prefill(IDS)
    assert not store.ls("llm.kv")


def test_a_refusal_inside_a_function_attribute_names_where_it_is():
    """What cannot be named is reported by its place: the attribute, then the closure cell."""
    from promptstore._live import module_identity

    table = np.ones(3)
    model = tiny_llama()
    model.model.layers[0].mlp.scale = lambda x: x * table[0]
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.0\.mlp\.scale<table>"):
        module_identity(model)


class _BoundScale(torch.nn.Module):
    """A layer that calls a builtin bound to a tensor it was given (``scale.mul``), not a Parameter of its own."""

    def __init__(self, inner, fn):
        super().__init__()
        self.inner, self.fn = inner, fn

    def forward(self, x):
        return self.fn(self.inner(x))


def test_a_builtin_bound_to_a_tensor_is_keyed_by_that_tensor(store):
    model = tiny_llama()
    scale = torch.full((64,), 1.5)
    model.model.layers[1].mlp = _BoundScale(model.model.layers[1].mlp, scale.mul)
    pc = PrefixCache(model, None, store=store, block_tokens=8)
    pc.prefill(IDS)
    scale[:] = 0.5  # edited in place: the bound method is the same object
    assert served_after(pc, what="the tensor a bound builtin multiplies by") == 0



# -- identity details found by mutation testing, third pass (the identity group's survivors) -------------
def _doubled_silu(x, inplace=False):
    return torch.nn.functional.sigmoid(x) * x * 2.0


def _halved_silu(x, inplace=False):
    return torch.nn.functional.sigmoid(x) * x * 0.5


def test_a_replaced_torch_function_is_another_ambient_identity(monkeypatch):
    """A function of torch's tables replaced by a user's (a patched activation) is named by its code, bare or
    behind a functools wrapper (lru_cache keeps what it wraps in __wrapped__): each replacement is another
    ambient identity, and torch's own function put back is the identity before (found by mutation testing:
    a replacement's description failed, and an lru_cache around any function passed for torch's own)."""
    import functools

    from promptstore._live import ambient_identity

    F = torch.nn.functional
    x = torch.linspace(-2, 2, 5)
    before = ambient_identity()
    seen = {before}
    for replacement in (_doubled_silu, _halved_silu, functools.lru_cache(maxsize=None)(_doubled_silu),
                        functools.lru_cache(maxsize=None)(_halved_silu)):
        monkeypatch.setattr(F, "silu", replacement)
        assert not torch.allclose(F.silu(x), torch.sigmoid(x) * x)
        seen.add(ambient_identity())
    assert len(seen) == 5, "a replaced torch function kept another's ambient identity"
    monkeypatch.undo()
    assert ambient_identity() == before


@pytest.mark.parametrize("kernel", ["flash", "mem_efficient", "math", "cudnn"])
def test_an_attention_kernel_switched_off_is_another_ambient_identity(kernel):
    """Which scaled-dot-product attention kernels may run (torch.backends.cuda.enable_*_sdp, settable on any
    build) changes an attention's numbers: each switch is keyed (found by mutation testing: read from the
    wrong place, every switch read as absent)."""
    from promptstore._live import ambient_identity

    enable, enabled = getattr(torch.backends.cuda, f"enable_{kernel}_sdp"), getattr(torch.backends.cuda,
                                                                                   f"{kernel}_sdp_enabled")
    before, was = ambient_identity(), enabled()
    enable(not was)
    try:
        assert enabled() is (not was)
        assert ambient_identity() != before, f"the {kernel} attention kernel switched kept the ambient identity"
    finally:
        enable(was)
    assert ambient_identity() == before


def test_a_precision_set_through_the_per_backend_api_is_named_where_it_applies():
    """torch's per-backend precision API (torch.backends.<backend>.<op>.fp32_precision): a precision set on one
    operation is named on it alone, one set on torch.backends as a whole on every operation left at "none", and
    put back, the state named is the untouched one (found by mutation testing: every precision below
    torch.backends itself read as unreadable, whatever it was)."""
    from promptstore._live import ambient_identity
    from promptstore._live._ambient import ambient_lines

    backends, matmul = torch.backends, torch.backends.mkldnn.matmul
    before, untouched = ambient_identity(), ambient_lines(torch)
    was = backends.fp32_precision, matmul.fp32_precision
    try:
        matmul.fp32_precision = "bf16"
        lines = ambient_lines(torch)
        assert "mkldnn.matmul.fp32_precision:bf16" in lines
        assert "mkldnn.fp32_precision:ieee" in lines and "mkldnn.conv.fp32_precision:ieee" in lines
        matmul.fp32_precision = "none"
        backends.fp32_precision = "tf32"
        lines = ambient_lines(torch)
        for path in ("", "mkldnn", "mkldnn.matmul"):
            assert f"{path}.fp32_precision:tf32" in lines, path
        assert ambient_identity() != before
    finally:
        backends.fp32_precision, matmul.fp32_precision = was
    assert ambient_lines(torch) == untouched and ambient_identity() == before


def _tokenizer_folder(path):
    from tokenizers import models

    _fast_tokenizer(models.WordLevel({"a": 0, "b": 1, "ab": 2, "[UNK]": 3}, unk_token="[UNK]")).save_pretrained(path)
    return path


def test_a_tokenizer_loaded_in_this_process_is_named_from_its_files(tmp_path, monkeypatch):
    """load_tokenizer, in this process: the folder's tokenizer files are listed by digest, what the tokenizer
    was built from is recorded for that tokenizer and its backend only, and a second tokenizer loaded from the
    same files gets the same identity without its vocabulary being serialised again (its digest is known under
    those files). Found by mutation testing: these ran only in child processes, which import the unmutated
    package, so a wrong origin or none at all went unseen."""
    from tokenizers import models

    from promptstore import file_digest
    from promptstore._live import _tokenizers, load_tokenizer, tokenizer_files, tokenizer_identity
    from promptstore._live._tokenizers import TOKENIZER_FILES, tokenizer_origin

    folder = _tokenizer_folder(tmp_path / "tok")
    files = tokenizer_files(folder)
    assert files is not None and "tokenizer.json" in dict(files)
    assert dict(files) == {p.name: file_digest(p) for p in folder.iterdir() if p.name in TOKENIZER_FILES}
    assert tokenizer_files(tmp_path / "empty") is None

    first, second = load_tokenizer(folder), load_tokenizer(folder)
    origin = tokenizer_origin(first, first.backend_tokenizer)
    assert origin is not None and all(digest in origin for _, digest in files)
    assert tokenizer_origin(second, second.backend_tokenizer) == origin
    assert tokenizer_origin(second, first.backend_tokenizer) is None  # another owner of that backend: nothing
    assert tokenizer_origin(first, second.backend_tokenizer) is None

    serialised = []
    state = _tokenizers._state
    monkeypatch.setattr(_tokenizers, "_state", lambda part: (serialised.append(type(part).__name__), state(part))[1])
    identity = tokenizer_identity(first)
    serialised.clear()
    assert tokenizer_identity(second) == identity
    assert "WordLevel" not in serialised, "a tokenizer loaded from known files serialised its vocabulary again"
    tokenizer_identity(_fast_tokenizer(models.WordLevel({"a": 0, "b": 1, "ab": 2, "[UNK]": 3}, unk_token="[UNK]")))
    assert "WordLevel" in serialised  # one loaded any other way is serialised (the check above can fail)


def test_what_a_tokenizer_was_loaded_from_goes_with_it(tmp_path, monkeypatch):
    """The record load_tokenizer keeps holds the tokenizer's backend: it is dropped when the tokenizer goes
    (kept, every vocabulary ever loaded would stay alive), without an error in the weak reference's callback
    (found by mutation testing: a callback that raised was unseen)."""
    import gc
    import sys
    import weakref

    from promptstore._live import _tokenizers, load_tokenizer

    raised = []
    monkeypatch.setattr(sys, "unraisablehook", raised.append)
    folder = _tokenizer_folder(tmp_path / "tok")
    held = len(_tokenizers._ORIGINS)
    tok = load_tokenizer(folder)
    assert len(_tokenizers._ORIGINS) == held + 1
    ref = weakref.ref(tok)
    del tok
    gc.collect()
    assert ref() is None
    assert len(_tokenizers._ORIGINS) == held, "the record outlived its tokenizer (and keeps its backend alive)"
    assert not raised, [str(r.exc_value) for r in raised]


def test_a_models_description_is_remembered_while_it_lives_and_no_longer(monkeypatch):
    """module_identity describes an unchanged model once, then re-checks the reads it rests on; the memo goes
    when the model goes, and one emptied by reset_memos before that raises nothing when it does (found by
    mutation testing: a memo never kept went unseen)."""
    import gc
    import sys

    import promptstore._live as live
    from promptstore._live import module_identity, reset_memos

    raised, walks = [], []
    monkeypatch.setattr(sys, "unraisablehook", raised.append)
    walk_tree = live.walk_tree
    monkeypatch.setattr(live, "walk_tree", lambda *a, **k: (walks.append(1), walk_tree(*a, **k))[1])
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    first = module_identity(model)
    assert module_identity(model) == first and len(walks) == 1, "an unchanged model was described again"
    model[1].approximate = "tanh"
    assert module_identity(model) != first and len(walks) == 2  # a read changed: described again

    held = len(live._MEMO._d)
    other = torch.nn.Linear(4, 4)
    module_identity(other)
    assert len(live._MEMO._d) == held + 1
    del other
    gc.collect()
    assert len(live._MEMO._d) == held, "the memo outlived its model"

    reset_memos(digests=False)
    del model
    gc.collect()
    assert not raised, [str(r.exc_value) for r in raised]


def test_a_chain_nested_too_deep_through_bound_builtins_is_refused_not_a_crash():
    """Nesting is bounded however it is reached: objects each holding a builtin bound to a dict that holds the
    next (``{"next": node}.get``), too deep to describe, are refused with a typed error (found by mutation
    testing: the depth restarted at a bound builtin's owner, and a long chain ended in a RecursionError)."""
    from promptstore._live import module_identity

    class Node:
        follow = None

    head = Node()
    for _ in range(400):
        node = Node()
        node.follow = {"next": head}.get
        head = node
    holder = torch.nn.Linear(2, 2)
    holder.chain = head
    with pytest.raises(UnsupportedModelError, match="nested too deeply"):
        module_identity(holder)


def test_a_callable_passing_for_torchscript_without_code_is_refused():
    """An object whose class is named like TorchScript's function but holds no compiled code is refused with
    a typed error, as one with code that is not text is (found by mutation testing: it raised AttributeError)."""
    from promptstore._live import module_identity

    class ScriptFunction:
        def __call__(self, x):
            return x * 2

    holder = torch.nn.Linear(2, 2)
    holder.act = ScriptFunction()
    with pytest.raises(UnsupportedModelError, match="without code"):
        module_identity(holder)


def test_a_refusal_inside_a_tokenizer_names_where_it_is():
    """A tokenizers part that cannot be named is reported by its place in the tokenizer (found by mutation
    testing: its path was dropped from the message)."""
    from tokenizers import Regex

    from promptstore._live import tokenizer_identity

    class Splitting:
        def __init__(self, pattern):
            self.pattern = pattern

        def __call__(self, text):
            return text.split()

    with pytest.raises(UnsupportedModelError, match=r"splitter\.pattern: a tokenizers\.Regex"):
        tokenizer_identity(Splitting(Regex(r"\s+")), what="splitter")
