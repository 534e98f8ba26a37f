"""promptstore.vision.serve_omdet: OmDet-Turbo's class and task caches backed by the store.

A small random OmDet-Turbo (a Swin backbone and a CLIP text tower from transformers' own classes;
the same code paths as the released checkpoint) is compared with a fresh copy of itself, whose own
in-process caches start empty: the detector's class logits and boxes are equal on a miss, on a hit,
from a reopened store in a new model object, and for a vocabulary larger than ``cache_size``. Text
rows are counted by a hook on the text tower's embeddings (tests/counting.py).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    DetrImageProcessor,
    OmDetTurboForObjectDetection,
    OmDetTurboProcessor,
)

import promptstore.vision._omdet as omdet_module
from promptstore import PromptStore
from promptstore.errors import InvalidInputError, PromptStoreWarning
from promptstore.vision import serve_omdet

from counting import Counting
from models import tiny_omdet_config
from test_owl import clip_tokenizer_in

CLASSES = ["forklift", "pallet", "person", "cardboard box", "ladder"]  # more than cache_size (3)


def build(seed: int = 0) -> OmDetTurboForObjectDetection:
    torch.manual_seed(seed)
    config = tiny_omdet_config(cache_size=3)
    model = OmDetTurboForObjectDetection(config).eval()
    Counting(model.language_backbone.model.embeddings)
    return model


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    tokenizer = clip_tokenizer_in(tmp_path_factory.mktemp("tok"))
    tokenizer.model_max_length = 77
    return OmDetTurboProcessor(image_processor=DetrImageProcessor(size={"height": 224, "width": 224}),
                               tokenizer=tokenizer)


@pytest.fixture
def store(tmp_path):
    with PromptStore(tmp_path / "store", memory_bytes=0) as s:
        yield s


def inputs(processor, classes=CLASSES):
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (200, 240, 3), dtype=np.uint8))
    return processor(images=[image], text=[list(classes)], task=["Detect {}.".format(", ".join(classes))],
                     return_tensors="pt")


def edit(model) -> None:
    """A text-tower weight changed in place (a shift: the detector's cosine logits ignore a uniform scale)."""
    with torch.no_grad():
        model.language_backbone.model.final_layer_norm.bias.add_(0.3)


def detect(model, batch):
    with torch.no_grad(), Counting(model.language_backbone.model.embeddings) as runs:
        out = model(**batch)
    return out, runs.rows


def same(a, b) -> None:
    assert (a.decoder_class_logits - b.decoder_class_logits).abs().max().item() <= 1e-5
    assert (a.decoder_coord_logits - b.decoder_coord_logits).abs().max().item() <= 1e-5


def test_a_hit_and_a_new_process_equal_the_plain_detector_and_run_no_text(processor, store, tmp_path):
    batch = inputs(processor)
    want, plain_rows = detect(build(), batch)
    assert plain_rows == len(CLASSES) + 1
    model = serve_omdet(build(), store)
    miss, rows = detect(model, batch)
    assert rows == len(CLASSES) + 1
    hit, rows = detect(model, batch)
    assert rows == 0  # five classes through caches of three: served from the store, nothing evicted for good
    same(miss, want)
    same(hit, want)
    with PromptStore(tmp_path / "store", memory_bytes=0) as reopened:
        fresh, rows = detect(serve_omdet(build(), reopened), batch)
    assert rows == 0
    same(fresh, want)


def test_transformers_own_caches_thrash_over_cache_size(processor):
    model, batch = build(), inputs(processor)
    detect(model, batch)
    _, rows = detect(model, batch)
    assert rows > 0  # what serve_omdet removes: an LRU of 3 classes cycling through 5


def served_as_edited(model, batch):
    """``model`` (served, edited) detects as a plain detector edited the same way, encoding both classes
    and one check; returns what the edited detector gives."""
    edited = build()
    edit(edited)
    want, _ = detect(edited, batch)
    got, rows = detect(model, batch)
    assert rows == 2 + 1
    same(got, want)
    return want


def test_an_edited_text_tower_misses_where_transformers_own_cache_serves_what_it_computed_before(processor, store):
    batch = inputs(processor, CLASSES[:2])  # within cache_size: transformers' own caches keep every value
    plain, model = build(), serve_omdet(build(), store)
    detect(plain, batch)
    detect(model, batch)
    edit(plain)
    edit(model)
    want = served_as_edited(model, batch)
    stale, rows = detect(plain, batch)  # its own caches, keyed by token ids only, serve the old values
    assert rows == 0
    assert (stale.decoder_class_logits - want.decoder_class_logits).abs().max().item() > 1e-4


def test_an_edit_between_serving_and_the_first_call_is_seen_by_that_call(processor, store):
    """serve_omdet names the language backbone as it serves it; an edit before the first forward misses."""
    batch = inputs(processor, CLASSES[:2])
    detect(serve_omdet(build(), store), batch)  # stored under the backbone as built
    model = serve_omdet(build(), store)
    edit(model)
    served_as_edited(model, batch)


def test_a_stored_value_that_differs_from_the_tower_now_is_recomputed(processor, store, monkeypatch):
    monkeypatch.setattr(omdet_module._Backbone, "fingerprint", lambda self: "omdet:blind")
    model = serve_omdet(build(), store)
    detect(model, inputs(processor, CLASSES[:2]))
    edit(model)  # a change the (blinded) key does not see
    edited = build()
    edit(edited)
    batch = inputs(processor)
    want, _ = detect(edited, batch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, _ = detect(model, batch)
    assert sum(issubclass(w.category, PromptStoreWarning) for w in caught) == 1
    same(got, want)


def test_serving_again_from_another_store_reads_only_that_store(processor, store, tmp_path):
    batch = inputs(processor)
    model = serve_omdet(build(), store)
    detect(model, batch)
    with PromptStore(tmp_path / "other", memory_bytes=0) as other:
        serve_omdet(model, other)
        _, rows = detect(model, batch)
        assert rows == len(CLASSES) + 1  # nothing in the other store
        _, rows = detect(model, batch)
        assert rows == 0
    assert len(model._forward_pre_hooks) == 1


def test_other_models_are_refused(store):
    with pytest.raises(InvalidInputError):
        serve_omdet(torch.nn.Linear(2, 2), store)


def test_tenants_never_read_each_others_classes(processor, tmp_path):
    batch = inputs(processor)
    want, _ = detect(build(), batch)
    with PromptStore(tmp_path / "s", namespace="tenant-a", memory_bytes=0) as a, \
            PromptStore(tmp_path / "s", namespace="tenant-b", memory_bytes=0) as b:
        detect(serve_omdet(build(), a), batch)
        got, rows = detect(serve_omdet(build(), b), batch)  # a fresh model: nothing in transformers' own caches
        assert rows == len(CLASSES) + 1
        same(got, want)
        assert {e.key for e in a.ls()}.isdisjoint({e.key for e in b.ls()})
        _, rows = detect(serve_omdet(build(), a), batch)
        assert rows == 0


def test_left_padding_is_computed_as_a_fresh_model_computes_it(processor, store):
    """transformers keys its caches by a row's unmasked ids, but the backbone sees the padded row: with left
    padding (positions shifted) a row is neither served nor stored, and equals what a fresh model computes."""
    import copy

    padded = copy.deepcopy(processor)
    detect(serve_omdet(build(), store), inputs(processor))  # the store holds every row, right-padded
    padded.tokenizer.padding_side = "left"
    batch = inputs(padded)
    want, _ = detect(build(), batch)
    got, rows = detect(serve_omdet(build(), store), batch)
    assert rows >= len(CLASSES)
    same(got, want)


def test_a_copy_of_a_served_detector_serves_itself(processor, store):
    """copy.deepcopy (an EMA copy, say) gives a detector served from the same store, described as the copy: an
    edit to the copy misses, and the original is unchanged."""
    import copy

    batch = inputs(processor)
    model = serve_omdet(build(), store)
    first, _ = detect(model, batch)
    twin = copy.deepcopy(model)
    hit, rows = detect(twin, batch)
    assert rows == 0
    same(hit, first)
    edit(twin)
    plain = build()
    plain.load_state_dict(twin.state_dict())
    want, _ = detect(plain, batch)
    got, rows = detect(twin, batch)
    assert rows == len(CLASSES) + 1
    same(got, want)
    again, rows = detect(model, batch)
    assert rows == 0
    same(again, first)


def test_a_language_backbone_that_draws_random_numbers_is_kept_in_process_as_transformers_keeps_it_and_not_stored(
        processor, store):
    """Each forward equals the plain detector's under the same seed (whose own cache keeps a draw in the process,
    as the served one does); nothing reaches the store, so another process draws its own."""
    batch = inputs(processor)
    plain_model, model = build(), serve_omdet(build(), store)
    for m in (plain_model, model):
        m.language_backbone.model.final_layer_norm.register_forward_hook(
            lambda m, args, out: out + 0.1 * torch.randn_like(out))
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        want, _ = detect(plain_model, batch)
        torch.manual_seed(seed)
        with pytest.warns(PromptStoreWarning, match="drew random numbers"):
            got, _ = detect(model, batch)
        same(got, want)
    assert store.ls() == []
