"""promptstore.vision.serve_sam3: SAM 3's concept prompts (ultralytics' SAM3SemanticModel.set_classes) from the store.

SAM 3's weights are not available offline: the model is built by ultralytics' own builder
(``build_sam3_image_model``) from a checkpoint that holds no tensors, so every weight keeps its
random initialisation at the real sizes (848M parameters, a 354M-parameter text encoder). The
builder tokenises with the ``clip`` package's SimpleTokenizer, which is not installable offline:
open_clip's SimpleTokenizer (the same BPE vocabulary and context handling) stands in for it. The
text transformer's positional embedding is created empty (NaN until a checkpoint fills it) and is
initialised as open_clip's.

Each served ``set_classes`` is compared with ultralytics' own on the same model: the same
``text_embeddings`` (features, padding mask, token embeddings) and ``names``. Text encoder runs are
counted by a hook on the text transformer (tests/counting.py).
"""

from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch

import promptstore.vision._sam3 as sam3_module
from promptstore import PromptStore
from promptstore.errors import InvalidInputError, PromptStoreWarning
from promptstore.vision import serve_sam3

from counting import Counting

PROMPTS = ["a forklift", "a pallet", "a person in a hard hat"]


@pytest.fixture(scope="module")
def sam3(tmp_path_factory):
    """(the model, ultralytics' own set_classes bound to it) with random weights."""
    from open_clip.tokenizer import SimpleTokenizer

    if "clip" not in sys.modules:
        clip = types.ModuleType("clip")
        clip.simple_tokenizer = types.SimpleNamespace(SimpleTokenizer=SimpleTokenizer)
        sys.modules["clip"] = clip
    from ultralytics.models.sam.build_sam3 import build_sam3_image_model

    empty = tmp_path_factory.mktemp("sam3") / "random.pt"
    torch.save({"model": {}}, empty)
    torch.manual_seed(0)
    model = build_sam3_image_model(str(empty))
    # Created empty (the checkpoint fills it): initialised as open_clip initialises its text towers'.
    with torch.no_grad():
        torch.nn.init.normal_(model.backbone.language_backbone.encoder.positional_embedding, std=0.01)
        encoder = model.backbone.language_backbone.encoder
        torch.nn.init.normal_(encoder.text_projection, std=encoder.text_projection.shape[0] ** -0.5)
    Counting(model.backbone.language_backbone.encoder)
    return model, type(model).set_classes.__get__(model)


def stock(sam3, prompts):
    model, set_classes = sam3
    set_classes(prompts)
    return {k: v.clone() for k, v in model.text_embeddings.items()}, list(model.names)


def encoded(model, prompts):
    with Counting(model.backbone.language_backbone.encoder) as runs:
        model.set_classes(prompts)
    return {k: v.clone() for k, v in model.text_embeddings.items()}, list(model.names), runs.rows


def same(got, want) -> None:
    assert got[1] == want[1]
    assert set(got[0]) == set(want[0])
    for k, v in want[0].items():
        assert got[0][k].shape == v.shape and got[0][k].dtype == v.dtype
        assert (got[0][k].float() - v.float()).abs().max().item() <= 1e-5, k


@pytest.fixture
def store(tmp_path):
    with PromptStore(tmp_path / "store", memory_bytes=0) as s:
        yield s


@pytest.fixture
def served(sam3, store):
    model, set_classes = sam3
    yield serve_sam3(model, store)
    del model.set_classes  # ultralytics' own again, for the next test


def test_set_classes_equals_ultralytics_and_a_hit_never_runs_the_text_encoder(sam3, served, tmp_path):
    want = stock(sam3, PROMPTS)
    *miss, rows = encoded(served, PROMPTS)
    assert rows == len(PROMPTS)
    same(miss, want)
    *hit, rows = encoded(served, PROMPTS)
    assert rows == 0
    same(hit, want)
    # Another order and a new prompt: only the new one is encoded, with one stored prompt checked.
    more = [PROMPTS[2], "a ladder", PROMPTS[0]]
    *got, rows = encoded(served, more)
    assert rows == 2
    same(got, stock(sam3, more))


def test_a_reopened_store_serves_every_prompt(sam3, tmp_path):
    model, _ = sam3
    want = stock(sam3, PROMPTS)
    try:
        with PromptStore(tmp_path / "s") as first:
            serve_sam3(model, first).set_classes(PROMPTS)
        with PromptStore(tmp_path / "s", memory_bytes=0) as reopened:
            *got, rows = encoded(serve_sam3(model, reopened), PROMPTS)
    finally:
        del model.set_classes
    assert rows == 0
    same(got, want)


def test_an_edited_text_encoder_misses_and_equals_a_recompute(sam3, served):
    encoded(served, PROMPTS)
    layer_norm = served.backbone.language_backbone.encoder.ln_final
    original = layer_norm.bias.detach().clone()
    try:
        with torch.no_grad():
            layer_norm.bias.add_(0.3)
        *got, rows = encoded(served, PROMPTS)
        assert rows == len(PROMPTS)
        same(got, stock(sam3, PROMPTS))
    finally:
        with torch.no_grad():
            layer_norm.bias.copy_(original)


def test_an_edit_between_serving_and_the_first_call_is_seen_by_that_call(sam3, store):
    """serve_sam3 names the text side as it serves it; an edit before the first set_classes misses."""
    model, _ = sam3
    layer_norm = model.backbone.language_backbone.encoder.ln_final
    original = layer_norm.bias.detach().clone()
    try:
        serve_sam3(model, store).set_classes(PROMPTS)  # stored under the encoder as built
        served = serve_sam3(model, store)
        with torch.no_grad():
            layer_norm.bias.add_(0.3)
        *got, rows = encoded(served, PROMPTS)
        assert rows == len(PROMPTS)
        same(got, stock(sam3, PROMPTS))
    finally:
        del model.set_classes
        with torch.no_grad():
            layer_norm.bias.copy_(original)


def test_a_stored_prompt_that_differs_from_the_encoder_now_is_not_served(sam3, served, monkeypatch):
    monkeypatch.setattr(sam3_module._Sam3Text, "fingerprint", lambda self: "sam3:blind")
    encoded(served, PROMPTS[:2])
    layer_norm = served.backbone.language_backbone.encoder.ln_final
    original = layer_norm.bias.detach().clone()
    try:
        with torch.no_grad():  # a change the (blinded) key does not see
            layer_norm.bias.add_(0.3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            *got, _ = encoded(served, PROMPTS)
        assert sum(issubclass(w.category, PromptStoreWarning) for w in caught) == 1
        same(got, stock(sam3, PROMPTS))
    finally:
        with torch.no_grad():
            layer_norm.bias.copy_(original)


def test_bad_input_is_refused_before_any_work(sam3, served, store):
    for bad in ([], ["a forklift", 3], "\ud800", None):
        with pytest.raises(InvalidInputError):
            served.set_classes(bad)
    with pytest.raises(InvalidInputError):
        serve_sam3(torch.nn.Linear(2, 2), store)
    assert store.ls() == []


def test_tenants_never_read_each_others_prompts(sam3, tmp_path):
    model, _ = sam3
    want = stock(sam3, PROMPTS)
    try:
        with PromptStore(tmp_path / "s", namespace="tenant-a", memory_bytes=0) as a, \
                PromptStore(tmp_path / "s", namespace="tenant-b", memory_bytes=0) as b:
            serve_sam3(model, a).set_classes(PROMPTS)
            *got, rows = encoded(serve_sam3(model, b), PROMPTS)
            assert rows == len(PROMPTS)
            same(got, want)
            assert {e.key for e in a.ls()}.isdisjoint({e.key for e in b.ls()})
            *_, rows = encoded(serve_sam3(model, a), PROMPTS)
            assert rows == 0
    finally:
        del model.set_classes


def test_names_and_copies_are_as_ultralytics_leaves_them(sam3, served):
    """``names`` is the object given (a tuple stays a tuple), and a deep copy of a served model serves itself."""
    import copy

    prompts = tuple(PROMPTS)
    want = stock(sam3, list(prompts))
    served.set_classes(prompts)
    assert served.names is prompts
    twin = copy.deepcopy(served)
    *got, rows = encoded(twin, list(prompts))
    assert rows == 0
    same(got, want)
    assert twin.set_classes.__self__.model is twin


@pytest.mark.parametrize("prompts", ["a forklift", ["a pallet", "a pallet", ""], ["a\tforklift", "a pallet\n"]])
def test_text_ultralytics_encodes_is_served_as_it_encodes_it(sam3, served, prompts):
    """A string is one prompt; duplicates, empty prompts and control characters are encoded as ultralytics does."""
    model, set_classes = sam3
    set_classes(prompts)
    want = ({k: v.clone() for k, v in model.text_embeddings.items()}, model.names)
    served.set_classes(prompts)
    *got, rows = encoded(served, prompts)
    assert rows == 0
    assert served.names == want[1] and type(served.names) is type(prompts)
    same((got[0], want[1]), want)


def test_a_text_encoder_that_draws_random_numbers_equals_ultralytics_under_each_seed_and_stores_nothing(sam3, served,
                                                                                                      store):
    """A hook adding noise: each call is one draw (the first one was stored and served to every later seed)."""
    model, _ = sam3
    handle = model.backbone.language_backbone.encoder.ln_final.register_forward_hook(
        lambda m, args, out: out + 0.1 * torch.randn_like(out))
    try:
        got_first = None
        for seed in (0, 1, 2):
            torch.manual_seed(seed)
            want = stock(sam3, PROMPTS + PROMPTS[:1])  # a repeated prompt is its own draw, as ultralytics encodes it
            torch.manual_seed(seed)
            with pytest.warns(PromptStoreWarning, match="drew random numbers"):
                got = encoded(served, PROMPTS + PROMPTS[:1])[:2]
            same(got, want)
            if got_first is None:
                got_first = got
        assert (got_first[0]["language_features"] - got[0]["language_features"]).abs().max().item() > 1e-3
    finally:
        handle.remove()
    assert store.ls() == []
