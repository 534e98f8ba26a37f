"""Live-state differential suite, vision side (issue #20): towers, heads and tokenizers changed while live.

Each case caches a result, changes the live tower, head or tokenizer the way a user would
(a hook, a plain setting, patched code, autocast, a tokenizer option, an added token, training
mode), and asks again: the result equals the plain call on the tower as it is now (cache on
equals cache off), or the call is refused with a typed error before anything is stored.
Covers zero_shot_classifier (open_clip), set_classes (YOLOE head and the encoder's tower)
and owl_detect (OWL-ViT).
"""

from __future__ import annotations

import numpy as np
import open_clip
import pytest
import torch
from open_clip import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES, build_zero_shot_classifier

from promptstore import PromptStore
from promptstore.errors import UnsupportedModelError
from promptstore.vision import OpenCLIPTextEncoder, owl_detect, set_classes, zero_shot_classifier
from promptstore.vision._classes import TEXT_KIND

from conftest import run_python
from transparency import assert_transparent
from vision_ref import applied_pe, detector, reference_pe

CLASSES = list(IMAGENET_CLASSNAMES[:6])
TEMPLATES = list(OPENAI_IMAGENET_TEMPLATES[:3])
NAMES = ["forklift", "pallet", "stop!~", "hard hat"]


def clip(seed: int = 0):
    torch.manual_seed(seed)
    return open_clip.create_model("ViT-B-32", pretrained=None).eval(), open_clip.get_tokenizer("ViT-B-32")


@pytest.fixture
def store(tmp_path):
    with PromptStore(tmp_path / "s", memory_bytes="256MiB") as s:
        yield s


def zs_after(model, tok, store, what, tokenizer_for_plain=None):
    """zero_shot_classifier equals open_clip's own build on the tower as it is now (twice)."""
    assert_transparent(lambda: zero_shot_classifier(model, tok, CLASSES, TEMPLATES, store=store),
                       lambda: build_zero_shot_classifier(model, tokenizer_for_plain or tok, CLASSES, TEMPLATES),
                       atol=1e-5, what=what)


# -- open_clip zero-shot classifiers ------------------------------------------------------------
def _steer_final_norm(model):
    vec = torch.randn(model.ln_final.normalized_shape[0]) * 0.5
    model.ln_final.register_forward_hook(lambda m, a, out: out + vec)
    return vec


def _eps(model):
    model.transformer.resblocks[0].ln_1.eps = 50.0


def _patched_class(model, monkeypatch):
    original = open_clip.transformer.ResidualAttentionBlock.forward
    monkeypatch.setattr(open_clip.transformer.ResidualAttentionBlock, "forward",
                        lambda self, q, *a, **k: original(self, q, *a, **k) * 0.5)


def _pre_hook(model):
    model.token_embedding.register_forward_pre_hook(lambda m, args: (torch.flip(args[0], dims=[1]),))


ZS_CHANGES = {"steering_hook_on_final_norm": lambda m, mp: _steer_final_norm(m), "norm_eps": lambda m, mp: _eps(m),
              "patched_block_forward": _patched_class, "pre_hook_on_embedding": lambda m, mp: _pre_hook(m)}


@pytest.mark.parametrize("change", list(ZS_CHANGES))
def test_zero_shot_after_a_live_change_equals_open_clip(change, store, monkeypatch):
    model, tok = clip()
    before = zero_shot_classifier(model, tok, CLASSES, TEMPLATES, store=store)
    ZS_CHANGES[change](model, monkeypatch)
    zs_after(model, tok, store, change)
    assert (build_zero_shot_classifier(model, tok, CLASSES, TEMPLATES) - before).abs().max() > 1e-4  # it mattered


def test_a_steering_vector_edited_in_place_misses(store):
    model, tok = clip()
    vec = _steer_final_norm(model)
    zero_shot_classifier(model, tok, CLASSES, TEMPLATES, store=store)
    vec.mul_(4)
    zs_after(model, tok, store, "steering vector edited in place")


@pytest.mark.parametrize("option", ["clean_fn", "clean_option"])
def test_zero_shot_after_a_tokenizer_option_changed_equals_open_clip(option, store):
    model, tok = clip()
    zero_shot_classifier(model, tok, CLASSES, TEMPLATES, store=store)
    if option == "clean_fn":
        tok.clean_fn = lambda text: text.upper()  # changed in place, after first use
    else:
        tok = open_clip.tokenizer.SimpleTokenizer(clean="whitespace")  # another option, same vocabulary
    zs_after(model, tok, store, f"tokenizer {option} changed")


def test_zero_shot_built_under_autocast_is_never_served_to_fp32(store):
    model, tok = clip()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        zero_shot_classifier(model, tok, CLASSES, TEMPLATES, store=store)
    zs_after(model, tok, store, "fp32 after autocast")


def test_zero_shot_in_training_mode_with_dropout_is_refused_before_anything_is_stored(store):
    model, tok = clip()
    model.train()
    model.transformer.resblocks[0].attn.dropout = 0.2
    with pytest.raises(UnsupportedModelError, match="training mode"):
        zero_shot_classifier(model, tok, CLASSES, TEMPLATES, store=store)
    assert not store.ls()
    model.eval()
    zs_after(model, tok, store, "back in eval mode")


AUTOCAST_CHILD = '''
import sys, torch, open_clip
from open_clip import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES, build_zero_shot_classifier
from promptstore import PromptStore
from promptstore.vision import zero_shot_classifier
torch.manual_seed(0)
model, tok = open_clip.create_model("ViT-B-32", pretrained=None).eval(), open_clip.get_tokenizer("ViT-B-32")
classes, templates = list(IMAGENET_CLASSNAMES[:6]), list(OPENAI_IMAGENET_TEMPLATES[:3])
with PromptStore(sys.argv[1]) as store:
    if sys.argv[2] == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = zero_shot_classifier(model, tok, classes, templates, store=store)
            want = build_zero_shot_classifier(model, tok, classes, templates)
    else:
        got = zero_shot_classifier(model, tok, classes, templates, store=store)
        want = build_zero_shot_classifier(model, tok, classes, templates)
print(float((got.float() - want.float()).abs().max()))
'''


def test_a_fresh_fp32_process_never_reads_what_an_autocast_process_stored(tmp_path):
    folder = str(tmp_path / "shared")
    assert float(run_python(AUTOCAST_CHILD, folder, "autocast").stdout.split()[-1]) <= 1e-2
    assert float(run_python(AUTOCAST_CHILD, folder, "fp32").stdout.split()[-1]) <= 1e-5


# -- YOLOE set_classes: the head and the encoder's tower ------------------------------------------------
@pytest.fixture(scope="module")
def encoder():
    return OpenCLIPTextEncoder("MobileCLIP2-B")


def set_classes_after(model, encoder, store, what):
    def cached():
        set_classes(model, NAMES, store=store, encoder=encoder)
        return applied_pe(model)

    assert_transparent(cached, lambda: reference_pe(model, encoder, NAMES), atol=1e-5, what=what)


def test_a_hook_on_the_yoloe_head_misses_and_equals_ultralytics(encoder, store):
    model = detector("yoloe-11s-seg.yaml")
    set_classes(model, NAMES, store=store, encoder=encoder)
    head = model.model.model[-1]
    handle = head.reprta.register_forward_hook(lambda m, a, out: out * -1.0 + 0.1)
    try:
        set_classes_after(model, encoder, store, "hooked RepRTA")
    finally:
        handle.remove()
    report = set_classes(model, NAMES, store=store, encoder=encoder)
    assert report.from_set  # without the hook, the first entries serve again


def test_a_patched_get_tpe_misses(encoder, store, monkeypatch):
    model = detector("yoloe-11s-seg.yaml")
    set_classes(model, NAMES, store=store, encoder=encoder)
    head = model.model.model[-1]
    cls = type(head)
    original = cls.get_tpe
    monkeypatch.setattr(cls, "get_tpe", lambda self, tpe: None if tpe is None else original(self, tpe * 2.0) * -1)
    set_classes_after(model, encoder, store, "patched get_tpe")


def test_a_hook_on_the_encoders_built_tower_misses(store):
    encoder = OpenCLIPTextEncoder("MobileCLIP2-B")
    model = detector("yoloe-11s-seg.yaml")
    set_classes(model, NAMES, store=store, encoder=encoder)  # builds the tower
    tower = encoder._build()
    vec = torch.randn(encoder.dim) * 0.3
    final = tower.ln_final if hasattr(tower, "ln_final") else next(m for m in tower.modules()
                                                                   if isinstance(m, torch.nn.LayerNorm))
    final.register_forward_hook(lambda m, a, out: out + vec[: out.shape[-1]])
    set_classes_after(model, encoder, store, "hooked text tower")


def test_set_classes_under_autocast_is_never_served_to_fp32(encoder, store):
    model = detector("yoloe-11s-seg.yaml")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        set_classes(model, NAMES, store=store, encoder=encoder)
    set_classes_after(model, encoder, store, "fp32 after autocast")


# -- OWL-ViT text queries ------------------------------------------------------------------------
@pytest.fixture
def owl(tmp_path):
    from test_owl import build, clip_tokenizer_in

    return build("owlvit", clip_tokenizer_in(tmp_path))


def _owl_plain(model, processor, queries, images):
    inputs = processor(text=[list(queries)] * len(images), images=images, return_tensors="pt")
    with torch.no_grad():
        return model(**inputs).logits


OWL_QUERIES = ["a forklift", "a pallet", "a hard hat"]


def owl_after(model, processor, store, images, what, queries=OWL_QUERIES):
    assert_transparent(lambda: owl_detect(model, processor, queries, images=images, store=store).logits,
                       lambda: _owl_plain(model, processor, queries, images), atol=1e-4, what=what)


def _images():
    return [np.random.default_rng(0).integers(0, 255, (96, 120, 3), dtype=np.uint8)]


def test_owl_after_tokens_are_added_to_the_processors_tokenizer(owl, store):
    model, processor = owl
    images = _images()
    owl_detect(model, processor, OWL_QUERIES, images=images, store=store)
    processor.tokenizer.add_tokens(["forklift"])  # "a forklift" now tokenizes to another id
    model.owlvit.text_model.embeddings.token_embedding.weight.data[-1:] += 0  # the vocabulary the model has
    queries = ["a pallet", "a hard hat"]  # ids inside the model's vocabulary
    owl_after(model, processor, store, images, "added tokens", queries)
    assert len(store.ls(TEXT_KIND)) >= 5  # the queries were encoded again under the new tokenizer


def test_owl_after_a_hook_or_a_setting_on_the_text_tower(owl, store):
    model, processor = owl
    images = _images()
    owl_detect(model, processor, OWL_QUERIES, images=images, store=store)
    text = model.owlvit.text_model
    text.final_layer_norm.eps = 0.5
    owl_after(model, processor, store, images, "final norm eps")
    text.final_layer_norm.register_forward_hook(lambda m, a, out: out * 1.5)
    owl_after(model, processor, store, images, "hook on the final norm")


def test_owl_after_the_tokenizer_max_length_changed(owl, store):
    model, processor = owl
    images = _images()
    owl_detect(model, processor, OWL_QUERIES, images=images, store=store)
    processor.tokenizer.model_max_length = 12  # the processor pads queries to 12 tokens, not 16
    n = len(store.ls(TEXT_KIND))
    owl_after(model, processor, store, images, "max length 12")
    assert len(store.ls(TEXT_KIND)) == n + len(OWL_QUERIES)  # another tokenizer: encoded again


def test_a_patched_tokenizer_method_other_than_call_misses(store, monkeypatch):
    """SimpleTokenizer.__call__ runs self.encode: the class's methods it reaches are keyed (found by review)."""
    model, tok = clip()
    zero_shot_classifier(model, tok, CLASSES, TEMPLATES, store=store)
    original = type(tok).encode
    monkeypatch.setattr(type(tok), "encode", lambda self, text: original(self, text)[::-1])
    zs_after(model, tok, store, "patched SimpleTokenizer.encode")


def test_what_the_last_call_left_in_a_fast_tokenizers_backend_is_not_part_of_the_key(owl, store):
    """A transformers fast tokenizer sets its backend's truncation and padding on every call: the
    first detection (which leaves padding behind) and the second share one key."""
    model, processor = owl
    images = _images()
    first = owl_detect(model, processor, OWL_QUERIES, images=images, store=store)
    assert processor.tokenizer.backend_tokenizer.padding is not None  # what the first call left
    n = len(store.ls(TEXT_KIND))
    second = owl_detect(model, processor, OWL_QUERIES, images=images, store=store)
    assert len(store.ls(TEXT_KIND)) == n and torch.equal(first.logits, second.logits)
    processor.tokenizer("x")  # and back to no padding: still the same key
    owl_detect(model, processor, OWL_QUERIES, images=images, store=store)
    assert len(store.ls(TEXT_KIND)) == n


def test_a_bare_backends_padding_is_part_of_the_identity():
    """A tokenizers.Tokenizer used as it is keeps its padding between calls: that changes its output."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from promptstore._live import tokenizer_identity

    backend = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[PAD]": 2}, unk_token="a"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    holder = type("Holder", (), {})()
    holder.backend = backend
    before = tokenizer_identity(holder)
    backend.enable_padding(pad_id=2, pad_token="[PAD]", length=8)
    assert tokenizer_identity(holder) != before
    backend.no_padding()
    assert tokenizer_identity(holder) == before


def test_a_fast_tokenizer_subclass_with_its_own_encode_keeps_the_backends_padding_in_the_key():
    """A subclass may encode without resetting the backend: then what the backend holds is keyed again."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from promptstore._live import tokenizer_identity

    class Own(PreTrainedTokenizerFast):
        def _encode_plus(self, *args, **kwargs):  # e.g. one that skips set_truncation_and_padding
            return super()._encode_plus(*args, **kwargs)

    backend = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[PAD]": 2}, unk_token="a"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    plain_tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="a", pad_token="[PAD]")
    own = Own(tokenizer_object=backend, unk_token="a", pad_token="[PAD]")
    before_plain, before_own = tokenizer_identity(plain_tok), tokenizer_identity(own)
    for tok in (plain_tok, own):  # each holds its own copy of the backend
        tok.backend_tokenizer.enable_padding(pad_id=2, pad_token="[PAD]", length=8)
    assert tokenizer_identity(plain_tok) == before_plain  # transformers' encode resets it each call
    assert tokenizer_identity(own) != before_own
