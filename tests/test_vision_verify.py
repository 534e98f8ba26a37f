"""Verified hits, vision side (vision/_verify.py): a call whose text encoder runs anyway re-encodes one
stored prompt in its batch, and a stored prompt that differs from what the encoder computes now is
never served.

Each test blinds the keys (the encoder's fingerprint says nothing changed), changes the text
side the way a user could without the keys seeing it (a function the tower calls swapped), and
asks for a vocabulary that is partly stored: the result equals the plain call, with a warning.
With the keys in force the same change is another key (a miss). A full hit runs no text at all
and is served on its keys alone (YOLOE never even loads its encoder).
"""

from __future__ import annotations

import warnings

import numpy as np
import open_clip
import pytest
import torch
import torch.nn.functional as F
from open_clip import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES, build_zero_shot_classifier
from ultralytics import YOLOE

import promptstore.vision._owl as owl_module
import promptstore.vision._zeroshot as zeroshot_module
from promptstore.errors import PromptStoreWarning
from promptstore.vision import OpenCLIPTextEncoder, owl_detect, set_classes
from promptstore.vision._verify import FEATURE_TOLERANCE, feature_error

from test_owl import QUERIES, build, clip_tokenizer, images, plain  # noqa: F401 - clip_tokenizer is a fixture

CLASSES = list(IMAGENET_CLASSNAMES[:6])
TEMPLATES = list(OPENAI_IMAGENET_TEMPLATES[:3])


@pytest.fixture
def norm_changed():
    """A function the text towers call, replaced (what a patched kernel or activation does)."""
    original = F.layer_norm

    def changed(x, *args, **kwargs):
        return original(x, *args, **kwargs) * 1.05

    def apply():
        F.layer_norm = changed

    yield apply
    F.layer_norm = original


def _warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [w for w in caught if issubclass(w.category, PromptStoreWarning)]


def test_a_zero_shot_classifier_over_a_changed_tower_equals_open_clip(store, norm_changed, monkeypatch):
    torch.manual_seed(0)
    model = open_clip.create_model("ViT-B-32", pretrained=None).eval()
    tok = open_clip.get_tokenizer("ViT-B-32")
    monkeypatch.setattr(zeroshot_module, "tower_fingerprint", lambda model, tokenizer: "tower:blind")
    zero_shot_classifier = zeroshot_module.zero_shot_classifier
    zero_shot_classifier(model, tok, CLASSES[:3], TEMPLATES, store=store)  # stored from the tower as it was
    norm_changed()
    want = build_zero_shot_classifier(model, tok, CLASSES, TEMPLATES)
    got, caught = _warnings(lambda: zero_shot_classifier(model, tok, CLASSES, TEMPLATES, store=store))
    assert (got - want).abs().max().item() <= 1e-5
    assert len(caught) == 1 and "differs from what the encoder computes now" in str(caught[0].message)


def test_an_unchanged_tower_passes_its_check_and_serves(store):
    torch.manual_seed(0)
    model = open_clip.create_model("ViT-B-32", pretrained=None).eval()
    tok = open_clip.get_tokenizer("ViT-B-32")
    zeroshot_module.zero_shot_classifier(model, tok, CLASSES[:3], TEMPLATES, store=store)
    got, caught = _warnings(lambda: zeroshot_module.zero_shot_classifier(model, tok, CLASSES, TEMPLATES, store=store))
    assert not caught
    assert (got - build_zero_shot_classifier(model, tok, CLASSES, TEMPLATES)).abs().max().item() <= 1e-5


def test_set_classes_over_a_changed_encoder_equals_the_plain_encoding(store, norm_changed, monkeypatch):
    encoder = OpenCLIPTextEncoder("ViT-B-32", seed=0)
    monkeypatch.setattr(type(encoder), "fingerprint", property(lambda self: "encoder:blind"))
    torch.manual_seed(0)
    model = YOLOE("yoloe-11s-seg.yaml")
    names = ["forklift", "pallet", "ladder", "person"]
    set_classes(model, names[:2], store=store, encoder=encoder)
    norm_changed()
    report, caught = _warnings(lambda: set_classes(model, names, store=store, encoder=encoder))
    assert report.hits == 0 and report.misses == len(names) and len(caught) == 1
    feats = encoder.encode(names)  # the changed tower, as a plain encoding runs it
    with torch.no_grad():
        expected = model.model.model[-1].get_tpe(torch.from_numpy(feats)[None])
    assert (model.model.pe - expected).abs().max().item() <= 1e-5
    assert list(model.model.names.values()) == names


def test_owl_queries_over_a_changed_tower_equal_the_plain_call(store, norm_changed, monkeypatch, clip_tokenizer):
    model, processor = build("owlv2", clip_tokenizer)
    imgs = images()
    monkeypatch.setattr(owl_module, "owl_query_fingerprint", lambda model, processor: "owl:blind")
    owl_detect(model, processor, QUERIES[:1], images=imgs, store=store)
    norm_changed()
    want = plain(model, processor, QUERIES, imgs)
    got, caught = _warnings(lambda: owl_detect(model, processor, QUERIES, images=imgs, store=store))
    assert (got.logits - want.logits).abs().max().item() <= 1e-4 and len(caught) == 1


def test_the_feature_check_bites_at_its_bound():
    a = np.ones(16, np.float32)
    assert feature_error(a, a) == 0.0
    assert feature_error(a, a * (1 + 2 * FEATURE_TOLERANCE["float32"])) > FEATURE_TOLERANCE["float32"]
    assert feature_error(a, np.full(16, np.nan)) == float("inf")


def test_the_feature_check_takes_the_bound_of_the_dtype_torch_names():
    """Callers pass ``str(tensor.dtype)``: float32's bound for "torch.float32", the coarsest for a dtype it has none for."""
    from promptstore.vision._verify import Refuted, check_feature

    a = np.linspace(-1, 1, 16).astype(np.float32)
    off = a * (1 + 1e-3)  # past float32's bound, within bfloat16's
    with pytest.raises(Refuted):
        check_feature("a prompt", a, off, "torch.float32")
    with pytest.raises(Refuted):
        check_feature("a prompt", a, off, "float32")
    check_feature("a prompt", a, off, "torch.bfloat16")
    check_feature("a prompt", a, off, "torch.float8_e4m3fn")  # no bound of its own: bfloat16's
    with pytest.raises(Refuted):
        check_feature("a prompt", a, a * (1 + 4 * FEATURE_TOLERANCE["bfloat16"]), "torch.float8_e4m3fn")


def test_the_error_of_unit_norm_features_is_relative():
    """Text features are L2-normalized: a rounding difference of one stands, a real one does not."""
    a = np.random.default_rng(0).standard_normal(512)
    a /= np.linalg.norm(a)
    b = a.copy()
    b[0] += 1e-6
    assert feature_error(a, b) == pytest.approx(1e-6, rel=1e-6)
    half = a * 0.5
    assert feature_error(half, half * (1 + 1e-5)) == pytest.approx(1e-5, rel=1e-6)


# A text side that draws random numbers (a user's hook adding noise, a layer that samples): what it computes is one
# draw, so nothing of it is stored and every call equals the plain call under the same seed (before the check, the
# first call's draw was stored and served to every later seed).

def noisy(module) -> None:
    """A hook that adds noise drawn from torch's generator to ``module``'s output."""
    module.register_forward_hook(lambda m, args, out: out + 0.1 * torch.randn_like(out))


def draws_each_seed(plain, served) -> list:
    """Per seed, the plain call and the served one from the same generator state: their results, side by side."""
    pairs = []
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        want = plain()
        torch.manual_seed(seed)
        with pytest.warns(PromptStoreWarning, match="drew random numbers"):
            got = served()
        pairs.append((got, want))
    return pairs


def test_a_zero_shot_classifier_whose_tower_draws_random_numbers_equals_open_clip_and_stores_nothing(store):
    torch.manual_seed(0)
    model = open_clip.create_model("ViT-B-32", pretrained=None).eval()
    tok = open_clip.get_tokenizer("ViT-B-32")
    noisy(model.ln_final)
    pairs = draws_each_seed(lambda: build_zero_shot_classifier(model, tok, CLASSES, TEMPLATES),
                            lambda: zeroshot_module.zero_shot_classifier(model, tok, CLASSES, TEMPLATES, store=store))
    for got, want in pairs:
        assert (got - want).abs().max().item() <= 1e-5
    assert (pairs[0][0] - pairs[1][0]).abs().max().item() > 1e-3  # each seed its own draw
    assert store.ls() == []


def test_set_classes_over_an_encoder_that_draws_random_numbers_stores_nothing(store):
    encoder = OpenCLIPTextEncoder("ViT-B-32", seed=0)
    encoder.encode(["warm"])  # built: a hook goes on the tower it runs
    noisy(encoder._model.ln_final)
    torch.manual_seed(0)
    model = YOLOE("yoloe-11s-seg.yaml")
    names = ["forklift", "pallet", "ladder"]

    def plain():
        with torch.no_grad():
            return model.model.model[-1].get_tpe(torch.from_numpy(encoder.encode(names))[None])

    def served():
        report = set_classes(model, names, store=store, encoder=encoder)
        assert report.misses == len(names)
        return model.model.pe.clone()

    pairs = draws_each_seed(plain, served)
    for got, want in pairs:
        assert (got - want).abs().max().item() <= 1e-5
    assert (pairs[0][0] - pairs[1][0]).abs().max().item() > 1e-4
    assert store.ls() == []


def test_owl_queries_from_a_tower_that_draws_random_numbers_equal_the_plain_call_and_store_nothing(store, clip_tokenizer):
    model, processor = build("owlv2", clip_tokenizer)
    noisy(model.owlv2.text_model.final_layer_norm)
    imgs = images(2)  # the plain call encodes the queries once per image, each its own draw
    pairs = draws_each_seed(lambda: plain(model, processor, QUERIES, imgs),
                            lambda: owl_detect(model, processor, QUERIES, images=imgs, store=store))
    for got, want in pairs:
        assert (got.logits - want.logits).abs().max().item() <= 1e-4
    assert (pairs[0][0].logits - pairs[1][0].logits).abs().max().item() > 1e-4
    assert store.ls() == []


def test_a_tower_that_does_not_draw_keeps_the_callers_generators_as_the_plain_call_leaves_them(store):
    """A miss over a deterministic tower leaves torch's, numpy's and Python's generators where they were."""
    import random

    torch.manual_seed(0)
    model = open_clip.create_model("ViT-B-32", pretrained=None).eval()
    tok = open_clip.get_tokenizer("ViT-B-32")
    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    got, caught = _warnings(lambda: zeroshot_module.zero_shot_classifier(model, tok, CLASSES, TEMPLATES, store=store))
    assert not caught and store.ls() != []
    after = (torch.rand(1).item(), np.random.rand(), random.random())
    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    assert after == (torch.rand(1).item(), np.random.rand(), random.random())


def test_draws_from_numpys_or_pythons_generator_are_seen_too(store):
    import random

    from promptstore._live import Generators
    from promptstore.vision._verify import Drew, check_draws

    for draw in (lambda: np.random.rand(), lambda: random.random(), lambda: torch.rand(1)):
        before = Generators()
        assert not before.moved()
        want = (draw(), before.restore())[0]  # drawn, then put back: the same number comes again
        assert not before.moved()
        draw()
        with pytest.raises(Drew):
            check_draws(before, "a draw")
        assert not before.moved() and float(draw()) == float(want)

