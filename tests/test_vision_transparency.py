"""Cache-on equals cache-off for promptstore.vision (issue #10).

The plain call is ultralytics' own ``get_text_pe`` (full 77-token context, batches of 80, the
head's RepRTA) with the same open_clip tower patched in (tests/vision_ref.py). The cached call
is ``set_classes`` through a store: cold, then warm, across batches of different make-up.
Class names come from Hypothesis over the whole BPE alphabet. Every open_clip text tower the
library accepts is covered (512-d towers through YOLOE, the others at the text level), on
YOLOE v8, 11 and 26 (seg and detect) and YOLO-World, with RepRTA given live weights.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from promptstore import PromptStore
from promptstore.errors import InvalidInputError, UnsupportedModelError
from promptstore.vision import OpenCLIPTextEncoder, set_classes
from promptstore.vision._classes import check_names, vocabulary_payload

from transparency import assert_same, assert_transparent
from vision_ref import ACCEPTED_TOWERS_FAST, _PatchedTextModel, accepted_towers, applied_pe, detector, reference_pe, with_tower

ATOL = 1e-5
BANG = ["stop!~", "look!->", "Yahoo!/Google sign", "stop", "look!", "wow!!!", "a!b!c", "!", "hey!?"]
DETECTORS = ["yoloe-v8s-seg.yaml", "yoloe-v8s.yaml", "yoloe-11s-seg.yaml", "yoloe-11s.yaml", "yoloe-26s-seg.yaml",
             "yoloe-26s.yaml", "yolov8s-world.yaml", "yolov8s-worldv2.yaml"]
# Names: punctuation runs (CLIP's "!" is token id 0), letters of many scripts, emoji, spaces,
# and characters check_names refuses (controls, zero-width only), long enough to pass 77 tokens.
ALPHABET = st.sampled_from(list("!!!~->/?.,:;'\"()[]{}#@&*+=_|\\^%$") + list("abcxyz ABC019") + list("éßøçñ漢字カナ한글ДЖ")
                           + ["🙂", "🚜", "\u200b", "\u00a0", "\u0301"])
NAME = st.text(ALPHABET, min_size=1, max_size=24) | st.text(ALPHABET, min_size=80, max_size=200)
REFUSED = st.sampled_from([None] * 24 + ["\x00", "\t", "\n", "\x7f", "\ud800", "\u200b"])


@pytest.fixture(scope="module")
def mobileclip():
    return OpenCLIPTextEncoder("MobileCLIP2-B")


def _store(tmp_path, name="s"):
    return PromptStore(tmp_path / name, memory_bytes="64MiB")


def _cached_and_plain(model, encoder, store, names):
    def cached():
        set_classes(model, names, store=store, encoder=encoder)
        return applied_pe(model)

    return cached, lambda: reference_pe(model, encoder, names)


# -- regressions ----------------------------------------------------------------------------
def test_names_holding_token_id_zero_equal_ultralytics_in_any_batch(mobileclip, tmp_path):
    tokens = mobileclip._tokenize(BANG)
    assert (tokens[:, 1:] == 0).any(), "the test needs names whose BPE holds id 0"
    model = detector("yoloe-11s-seg.yaml")
    with _store(tmp_path) as store:
        assert_transparent(*_cached_and_plain(model, mobileclip, store, BANG), atol=ATOL)
        # Each name alone, and in reversed batches of 2: what is cached never depends on batch mates.
        with _store(tmp_path, "alone") as alone:
            for name in BANG:
                set_classes(model, [name], store=alone, encoder=mobileclip)
                assert_same(applied_pe(model)[0], reference_pe(model, mobileclip, [name])[0], ATOL, name)
    feats = mobileclip.encode(BANG)
    assert len({f.round(4).tobytes() for f in feats}) == len(BANG)  # no two names collapse to one feature


@pytest.mark.parametrize("tower", ACCEPTED_TOWERS_FAST)
def test_tower_text_features_equal_open_clip_full_context(tower):
    _check_tower(tower)


@pytest.mark.slow
@pytest.mark.parametrize("tower", accepted_towers())
def test_every_accepted_tower(tower, tmp_path):
    _check_tower(tower)
    encoder = OpenCLIPTextEncoder(tower)
    if encoder.dim == 512:
        model = detector("yoloe-11s-seg.yaml")
        with _store(tmp_path) as store:
            assert_transparent(*_cached_and_plain(model, encoder, store, BANG + ["pallet", "hard hat"]), atol=ATOL)


def _check_tower(tower):
    names = BANG + ["forklift", "a very long class name " * 12, "漢字", "🚜 tractor"]
    encoder = OpenCLIPTextEncoder(tower, batch=4)  # small batches: several compositions
    ref = _PatchedTextModel(encoder)
    assert_transparent(lambda: encoder.encode(names), lambda: ref.encode_text(ref.tokenize(names)).numpy(),
                       atol=ATOL, what=f"{tower} features")
    assert ("context=trimmed" in encoder.fingerprint) == encoder.trim


def test_towers_with_hugging_face_tokenizers_are_refused():
    with pytest.raises(UnsupportedModelError, match="Hugging Face"):
        OpenCLIPTextEncoder("ViT-B-16-SigLIP")


def test_trim_setting_is_part_of_the_fingerprint():
    assert OpenCLIPTextEncoder("MobileCLIP2-B").fingerprint != OpenCLIPTextEncoder("MobileCLIP2-B", trim=False).fingerprint
    assert not OpenCLIPTextEncoder("MobileCLIP2-S0").trim  # bidirectional: trimming is never exact
    assert not OpenCLIPTextEncoder("coca_ViT-B-32").trim  # CLS token appended, pooled last


@pytest.mark.parametrize("cfg", DETECTORS)
def test_every_detector_equals_ultralytics(cfg, mobileclip, tmp_path):
    model = detector(cfg)
    names = ["forklift", "pallet", "stop!~", "person"]
    with _store(tmp_path) as store:
        assert_transparent(*_cached_and_plain(model, mobileclip, store, names), atol=ATOL, what=cfg)
        more = names[2:] + ["ladder", "look!->"]  # part hits, part misses, another vocabulary
        assert_transparent(*_cached_and_plain(model, mobileclip, store, more), atol=ATOL, what=cfg)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(names=st.lists(NAME, min_size=1, max_size=6, unique=True), refused=REFUSED)
def test_generated_names_are_transparent_or_refused(names, refused, mobileclip, tmp_path_factory):
    global _MODEL, _FOLDER
    if _MODEL is None:
        _MODEL, _FOLDER = detector("yoloe-11s-seg.yaml"), tmp_path_factory.mktemp("hyp")
    if refused is not None:
        names = [*names, refused if refused == "\u200b" else f"x{refused}y"]
    with PromptStore(_FOLDER, memory_bytes="64MiB") as store:  # kept across examples: later ones hit
        try:
            check_names(names)
        except InvalidInputError:
            event("refused")
            before = len(store.ls())
            with pytest.raises(InvalidInputError):
                set_classes(_MODEL, names, store=store, encoder=mobileclip)
            assert len(store.ls()) == before
            return
        event("compared with ultralytics")
        assert_transparent(*_cached_and_plain(_MODEL, mobileclip, store, names), atol=ATOL, repeats=1)


_MODEL = _FOLDER = None


# -- keys and validation --------------------------------------------------------------------
def test_vocabularies_are_framed_not_joined(mobileclip, tmp_path):
    assert vocabulary_payload(["fork lift", "pallet"]) != vocabulary_payload(["fork", "lift pallet"])
    assert vocabulary_payload(["ab", "c"]) != vocabulary_payload(["a", "bc"])
    model = detector("yoloe-11s-seg.yaml")
    with _store(tmp_path) as store:
        for names in (["fork|lift", "pallet"], ["fork", "lift|pallet"], ["fork,lift", "pallet"]):
            r = set_classes(model, names, store=store, encoder=mobileclip)
            assert not r.from_set
            assert_same(applied_pe(model), reference_pe(model, mobileclip, names), ATOL)


@pytest.mark.parametrize("bad", [["fork\0lift"], ["tab\there"], ["ok", "\ud800"], ["\u200b"], ["\u200b \u00a0"],
                                 [" "], ["a", "a"], [], "pallet", [3]])
def test_bad_names_are_refused_before_anything_is_stored(bad, mobileclip, tmp_path):
    model = detector("yoloe-11s-seg.yaml")
    with _store(tmp_path) as store:
        with pytest.raises(InvalidInputError):
            set_classes(model, bad, store=store, encoder=mobileclip)
        assert store.ls() == []


def test_duplicate_check_is_linear():
    names = [f"class {i}" for i in range(20_000)]
    t0 = time.perf_counter()
    check_names(names)
    assert time.perf_counter() - t0 < 1.0
    with pytest.raises(InvalidInputError, match="duplicate"):
        check_names(names + ["class 7"])


@pytest.mark.parametrize("cfg", ["yoloe-11s-seg.yaml", "yolov8s-worldv2.yaml"])
def test_an_encoder_of_the_wrong_width_stores_nothing(cfg, tmp_path):
    model = detector(cfg)
    wide = OpenCLIPTextEncoder("RN50x64")  # 1024-d features into a 512-d head
    with _store(tmp_path) as store:
        with pytest.raises(InvalidInputError, match="1024-d"):
            set_classes(model, ["pallet", "forklift"], store=store, encoder=wide)
        assert store.ls() == [] and not wide.loaded


def test_a_fused_head_is_refused_before_anything_is_stored(mobileclip, tmp_path):
    model = detector("yoloe-11s-seg.yaml")
    with _store(tmp_path) as store:
        set_classes(model, ["pallet", "forklift"], store=store, encoder=mobileclip)
        model.model.eval()
        model.model.model[-1].fuse(model.model.pe)  # the classes are fused into the head's weights
        n = len(store.ls())
        with pytest.raises(InvalidInputError, match="fused"):
            set_classes(model, ["ladder"], store=store, encoder=mobileclip)
        assert len(store.ls()) == n


def test_a_prompt_free_model_is_refused_before_anything_is_stored(mobileclip, tmp_path):
    model = detector("yoloe-11s-seg.yaml")
    model.model.eval()
    names = ["pallet", "forklift"]
    with with_tower(mobileclip):
        model.set_vocab(model.get_vocab(names), names)  # ultralytics' own prompt-free conversion
    with _store(tmp_path) as store:
        with pytest.raises(InvalidInputError, match="prompt-free"):
            set_classes(model, ["ladder"], store=store, encoder=mobileclip)
        assert store.ls() == []


def test_building_an_encoder_keeps_the_callers_random_stream():
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    OpenCLIPTextEncoder("ViT-S-16-alt").encode(["pallet"])
    assert torch.equal(torch.rand(3), expected)


def test_head_digest_cost_is_small():
    """The RepRTA head is hashed on every call; measured here so a regression shows."""
    from promptstore.vision._classes import detector_fingerprint

    model = detector("yoloe-11s-seg.yaml")
    detector_fingerprint(model)
    t0 = time.perf_counter()
    for _ in range(20):
        detector_fingerprint(model)
    per_call = (time.perf_counter() - t0) / 20
    print(f"RepRTA digest: {per_call * 1e3:.2f} ms per call")
    assert per_call < 0.05
    assert np.isfinite(per_call)
