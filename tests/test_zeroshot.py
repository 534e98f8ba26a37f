"""zero_shot_classifier against open_clip's own build_zero_shot_classifier (random-init towers, real shapes)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import open_clip
import pytest
import torch
from open_clip import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES, build_zero_shot_classifier

from promptstore import PromptStore
from promptstore.errors import InvalidInputError
from promptstore.vision import zero_shot_classifier
from promptstore.vision._classes import TEXT_KIND

from conftest import run_python

CLASSES = list(IMAGENET_CLASSNAMES[:10])
TEMPLATES = list(OPENAI_IMAGENET_TEMPLATES[:5])


def clip(name: str = "ViT-B-32", seed: int = 0):
    torch.manual_seed(seed)
    return open_clip.create_model(name, pretrained=None).eval(), open_clip.get_tokenizer(name)


@pytest.fixture(scope="module")
def vitb32():
    return clip()


class Encoded:
    """Counts the prompts the text tower really runs (a hook on its token embedding)."""

    def __init__(self, model) -> None:
        self.rows = 0
        self.handle = model.token_embedding.register_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        self.rows += args[0].shape[0]

    def __enter__(self) -> Encoded:
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


def same(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


def test_equals_open_clip_cold_and_warm_and_warm_never_runs_the_tower(vitb32, tmp_path):
    model, tok = vitb32
    ref = build_zero_shot_classifier(model, tok, CLASSES, TEMPLATES)
    with PromptStore(tmp_path / "s") as store:
        with Encoded(model) as enc:
            cold = zero_shot_classifier(model, tok, CLASSES, TEMPLATES, store=store)
        assert enc.rows == len(CLASSES) * len(TEMPLATES)
        with Encoded(model) as enc:
            warm = zero_shot_classifier(model, tok, CLASSES, TEMPLATES, store=store)
        assert enc.rows == 0
    assert same(cold, ref) <= 1e-6 and same(warm, ref) <= 1e-6


def test_a_new_template_or_class_encodes_only_its_own_prompts(vitb32, tmp_path):
    model, tok = vitb32
    with PromptStore(tmp_path / "s") as store:
        zero_shot_classifier(model, tok, CLASSES, TEMPLATES, store=store)
        more_templates = TEMPLATES + [OPENAI_IMAGENET_TEMPLATES[20]]
        with Encoded(model) as enc:
            out = zero_shot_classifier(model, tok, CLASSES, more_templates, store=store)
        assert enc.rows == len(CLASSES)
        assert same(out, build_zero_shot_classifier(model, tok, CLASSES, more_templates)) <= 1e-6
        more_classes = CLASSES + ["forklift"]
        with Encoded(model) as enc:
            out = zero_shot_classifier(model, tok, more_classes, more_templates, store=store)
        assert enc.rows == len(more_templates)
        assert same(out, build_zero_shot_classifier(model, tok, more_classes, more_templates)) <= 1e-6


def test_string_templates_and_open_clips_own_repeated_imagenet_names(vitb32, tmp_path):
    model, tok = vitb32
    names = [n for n in IMAGENET_CLASSNAMES if n in ("missile", "sunglasses")] + ["tabby cat"]
    assert len(names) == 5  # open_clip names two classes "missile" and two "sunglasses"
    templates = ["a photo of a {}.", "a blurry photo of the {}.", "{}"]
    with PromptStore(tmp_path / "s") as store:
        out = zero_shot_classifier(model, tok, names, templates, store=store)
    assert same(out, build_zero_shot_classifier(model, tok, names, templates)) <= 1e-6


@pytest.mark.parametrize("name", ["RN50", "convnext_base"])
def test_other_towers_equal_open_clip(name, tmp_path):
    model, tok = clip(name)
    with PromptStore(tmp_path / "s") as store:
        out = zero_shot_classifier(model, tok, CLASSES[:4], TEMPLATES[:3], store=store)
        again = zero_shot_classifier(model, tok, CLASSES[:4], TEMPLATES[:3], store=store)
    ref = build_zero_shot_classifier(model, tok, CLASSES[:4], TEMPLATES[:3])
    assert same(out, ref) <= 1e-6 and same(again, ref) <= 1e-6


def test_an_edited_text_weight_misses_and_equals_open_clip_again(tmp_path):
    model, tok = clip()
    with PromptStore(tmp_path / "s") as store:
        zero_shot_classifier(model, tok, CLASSES[:3], TEMPLATES[:2], store=store)
        with torch.no_grad():
            model.ln_final.weight.data[0] += 0.5  # through .data: no version counter sees it
        with Encoded(model) as enc:
            out = zero_shot_classifier(model, tok, CLASSES[:3], TEMPLATES[:2], store=store)
        assert enc.rows == 6
    assert same(out, build_zero_shot_classifier(model, tok, CLASSES[:3], TEMPLATES[:2])) <= 1e-6


def test_an_image_tower_edit_does_not_change_the_text_side(vitb32, tmp_path):
    model, tok = clip()
    with PromptStore(tmp_path / "s") as store:
        zero_shot_classifier(model, tok, CLASSES[:3], TEMPLATES[:2], store=store)
        with torch.no_grad():
            next(model.visual.parameters()).add_(1.0)
        with Encoded(model) as enc:
            zero_shot_classifier(model, tok, CLASSES[:3], TEMPLATES[:2], store=store)
        assert enc.rows == 0


def test_an_interrupted_build_resumes_where_it_stopped(vitb32, tmp_path):
    model, tok = vitb32
    batches = []

    def stop_second(module, args, output):
        batches.append(args[0].shape[0])
        if len(batches) == 2:
            raise KeyboardInterrupt

    with PromptStore(tmp_path / "s") as store:
        handle = model.token_embedding.register_forward_hook(stop_second)
        try:
            with pytest.raises(KeyboardInterrupt):
                zero_shot_classifier(model, tok, CLASSES, TEMPLATES, store=store, batch=8)
        finally:
            handle.remove()
        assert len(store.ls(kind=TEXT_KIND)) == 8  # the first batch was stored as it finished
        with Encoded(model) as enc:
            out = zero_shot_classifier(model, tok, CLASSES, TEMPLATES, store=store, batch=8)
        assert enc.rows == len(CLASSES) * len(TEMPLATES) - 8
    assert same(out, build_zero_shot_classifier(model, tok, CLASSES, TEMPLATES)) <= 1e-6


@pytest.mark.parametrize("classes,templates", [
    ([], TEMPLATES), (CLASSES, []), ("cat", TEMPLATES), (["cat", "do\x00g"], TEMPLATES), (["cat", "   "], TEMPLATES),
    (CLASSES, ["a {}", lambda c: c]), (CLASSES, ["a {0} {1}"]), (CLASSES, [lambda c: ""]), (CLASSES, "a {}"),
])
def test_bad_input_fails_before_any_work(vitb32, tmp_path, classes, templates):
    model, tok = vitb32
    with PromptStore(tmp_path / "s") as store:
        with Encoded(model) as enc, pytest.raises(InvalidInputError):
            zero_shot_classifier(model, tok, classes, templates, store=store)
        assert enc.rows == 0 and not store.ls()


def test_a_fresh_process_builds_the_classifier_from_the_store(vitb32, tmp_path):
    model, tok = vitb32
    code = """
    import sys, json, torch, open_clip
    from open_clip import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES
    from promptstore import PromptStore
    from promptstore.vision import zero_shot_classifier
    torch.manual_seed(0)
    model = open_clip.create_model("ViT-B-32", pretrained=None).eval()
    rows = []
    model.token_embedding.register_forward_hook(lambda m, a, o: rows.append(a[0].shape[0]))
    w = zero_shot_classifier(model, open_clip.get_tokenizer("ViT-B-32"), list(IMAGENET_CLASSNAMES[:10]),
                             list(OPENAI_IMAGENET_TEMPLATES[:5]), store=PromptStore(sys.argv[1]))
    torch.save(w, sys.argv[2])
    print(json.dumps({"encoded": sum(rows)}))
    """
    runs = [json.loads(run_python(code, str(tmp_path / "s"), str(tmp_path / f"w{i}.pt")).stdout.splitlines()[-1])
            for i in range(2)]
    assert runs[0]["encoded"] == 50 and runs[1]["encoded"] == 0
    ref = build_zero_shot_classifier(model, tok, CLASSES, TEMPLATES)
    for i in range(2):
        assert same(torch.load(Path(tmp_path / f"w{i}.pt")), ref) <= 1e-6
    assert np.isfinite(ref.numpy()).all()


def test_a_classifier_travels_in_a_bundle_to_an_air_gapped_store(vitb32, tmp_path):
    """Built on one machine, exported, imported elsewhere: the other store builds it without running the tower."""
    from promptstore.vision._zeroshot import CLASSIFIER_KIND

    model, tok = vitb32
    with PromptStore(tmp_path / "a") as a:
        built = zero_shot_classifier(model, tok, CLASSES[:3], TEMPLATES[:2], store=a)
        assert a.export_bundle(tmp_path / "zs.bundle", kind=CLASSIFIER_KIND) == 1
    with PromptStore(tmp_path / "b") as b:
        assert b.import_bundle(tmp_path / "zs.bundle") == 1
        with Encoded(model) as enc:
            again = zero_shot_classifier(model, tok, CLASSES[:3], TEMPLATES[:2], store=b)
        assert enc.rows == 0
    assert torch.equal(built, again)


def test_a_changed_setting_that_is_no_weight_misses_and_equals_open_clip(tmp_path):
    """Pooling, training mode: settings outside the weights change the features, so they change the key."""
    model, tok = clip()
    with PromptStore(tmp_path / "s") as store:
        zero_shot_classifier(model, tok, CLASSES[:3], TEMPLATES[:2], store=store)
        model.text_pool_type = "first"  # open_clip pools the first token instead of the end-of-text one
        with Encoded(model) as enc:
            out = zero_shot_classifier(model, tok, CLASSES[:3], TEMPLATES[:2], store=store)
        assert enc.rows == 6
    assert same(out, build_zero_shot_classifier(model, tok, CLASSES[:3], TEMPLATES[:2])) <= 1e-6
