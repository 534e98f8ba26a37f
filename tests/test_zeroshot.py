"""zero_shot_classifier against open_clip's own build_zero_shot_classifier (random-init towers, real shapes)."""

from __future__ import annotations

import inspect
import json
import time
import warnings
from pathlib import Path

import numpy as np
import open_clip
import pytest
import torch
from open_clip import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES, build_zero_shot_classifier

from promptstore import PromptStore
from promptstore.errors import InvalidInputError, PromptStoreWarning, UnsupportedModelError
from promptstore.vision import zero_shot_classifier
from promptstore.vision._classes import TEXT_KIND

from conftest import run_python
from counting import Counting

CLASSES = list(IMAGENET_CLASSNAMES[:10])
CHECKED = 1  # a call that runs the tower over a partly stored classifier also re-encodes one stored prompt
TEMPLATES = list(OPENAI_IMAGENET_TEMPLATES[:5])


def clip(name: str = "ViT-B-32", seed: int = 0):
    torch.manual_seed(seed)
    model = open_clip.create_model(name, pretrained=None).eval()
    Encoded(model)  # counted from the start: the counting hook is part of the tower's identity
    return model, open_clip.get_tokenizer(name)


@pytest.fixture(scope="module")
def vitb32():
    return clip()


class Encoded(Counting):
    """Counts the prompts the text tower really runs (a hook on its token embedding, tests/counting.py)."""

    def __init__(self, model) -> None:
        super().__init__(model.token_embedding)


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
        assert enc.rows == len(CLASSES) + CHECKED
        assert same(out, build_zero_shot_classifier(model, tok, CLASSES, more_templates)) <= 1e-6
        more_classes = CLASSES + ["forklift"]
        with Encoded(model) as enc:
            out = zero_shot_classifier(model, tok, more_classes, more_templates, store=store)
        assert enc.rows == len(more_templates) + CHECKED
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
    with PromptStore(tmp_path / "s") as store:
        with Encoded(model) as first, pytest.raises(KeyboardInterrupt):
            first.stop_after(2)
            zero_shot_classifier(model, tok, CLASSES, TEMPLATES, num_classes_per_batch=2, store=store)
        batches = first.batches
        assert batches == [10, 10]  # 2 classes x 5 templates per forward, as open_clip batches
        assert len(store.ls(kind=TEXT_KIND)) == 10  # the first batch was stored as it finished
        with Encoded(model) as enc:
            out = zero_shot_classifier(model, tok, CLASSES, TEMPLATES, num_classes_per_batch=2, store=store)
        assert enc.rows == len(CLASSES) * len(TEMPLATES) - 10 + CHECKED
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


# The tolerance of each dtype: float32 within 1e-6 as before; half and bfloat16 within one unit in
# the last place of a value below 1 (2**-10, 2**-7); float64 within 1e-12.
TOLERANCE = {torch.float32: 1e-6, torch.float16: 2**-10, torch.bfloat16: 2**-7, torch.float64: 1e-12}


def in_dtype(dtype):
    """ViT-B-32 (seed 0) cast as a user casts it: ``.half()``, ``.to(torch.bfloat16)``, ``.double()``."""
    model, tok = clip()
    return model.to(dtype), tok


# Half and double precision run a CPU's slow matmul paths (a minute and a half each on 2 cores) and
# reach no line float32 and bfloat16 miss: `make test-long` runs them.
@pytest.mark.parametrize("dtype", [d if d in (torch.float32, torch.bfloat16) else pytest.param(d, marks=pytest.mark.slow)
                                   for d in TOLERANCE], ids=str)
def test_each_dtype_gets_open_clips_dtype_and_values(dtype, tmp_path):
    """open_clip computes in the model's dtype (encode_text, mean, norm): so does the store, cold, warm and partly warm."""
    model, tok = in_dtype(dtype)
    ref = build_zero_shot_classifier(model, tok, CLASSES, TEMPLATES)
    assert ref.dtype == dtype
    with PromptStore(tmp_path / "s") as store:
        float32, _ = clip()  # the same weights in float32 first: its entries are never another dtype's
        zero_shot_classifier(float32, tok, CLASSES, TEMPLATES, store=store)
        with Encoded(model) as enc:
            cold = zero_shot_classifier(model, tok, CLASSES, TEMPLATES, store=store)
        assert enc.rows == (0 if dtype == torch.float32 else len(CLASSES) * len(TEMPLATES))
        with Encoded(model) as enc:
            warm = zero_shot_classifier(model, tok, CLASSES, TEMPLATES, store=store)
            more = zero_shot_classifier(model, tok, CLASSES + ["forklift"], TEMPLATES, store=store)
        assert enc.rows == len(TEMPLATES) + CHECKED  # only the new class's prompts
    ref_more = build_zero_shot_classifier(model, tok, CLASSES + ["forklift"], TEMPLATES)
    for out, expected in ((cold, ref), (warm, ref), (more, ref_more)):
        assert out.dtype == expected.dtype == dtype and out.device == expected.device
        assert same(out.double(), expected.double()) <= TOLERANCE[dtype]


@pytest.mark.parametrize("name", ["ViT-B-32", "MobileCLIP2-B"])
def test_open_clips_own_low_precision_is_stored_in_its_feature_dtype(name, tmp_path):
    """open_clip's convert_weights_to_lp (create_model(precision="bf16") for CLIP) converts only the matmul
    weights: embeddings and layer norms stay float32, encode_text returns bfloat16. The features' dtype is
    read off the text projection (the model's, or its ``text`` tower's for CustomTextCLIP), so they are
    stored and served: no fallback to open_clip's own build, no warning."""
    torch.manual_seed(0)
    model = open_clip.create_model(name, pretrained=None).eval()
    open_clip.convert_weights_to_lp(model, torch.bfloat16)
    Encoded(model.text if hasattr(model, "text") else model)
    tok = open_clip.get_tokenizer(name)
    text = getattr(model, "text", model)
    assert text.positional_embedding.dtype == torch.float32 and text.text_projection.dtype == torch.bfloat16
    ref = build_zero_shot_classifier(model, tok, CLASSES[:3], TEMPLATES[:2])
    with PromptStore(tmp_path / "s") as store, warnings.catch_warnings():
        warnings.simplefilter("error", PromptStoreWarning)
        cold = zero_shot_classifier(model, tok, CLASSES[:3], TEMPLATES[:2], store=store)
        with Encoded(text) as enc:
            warm = zero_shot_classifier(model, tok, CLASSES[:3], TEMPLATES[:2], store=store)
        assert enc.rows == 0 and len(store.ls(kind=TEXT_KIND)) == 6
    for out in (cold, warm):
        assert out.dtype == ref.dtype == torch.bfloat16
        assert same(out.double(), ref.double()) <= TOLERANCE[torch.bfloat16]


def test_entries_of_another_dtype_are_misses(tmp_path):
    """An older release kept float32 entries for a half model, under the same keys: they are never served."""
    from promptstore.vision._zeroshot import CLASS_KIND, CLASSIFIER_KIND

    model, tok = in_dtype(torch.float16)
    ref = build_zero_shot_classifier(model, tok, CLASSES[:3], TEMPLATES[:2])
    with PromptStore(tmp_path / "s") as store:
        zero_shot_classifier(model, tok, CLASSES[:3], TEMPLATES[:2], store=store)
        for kind, name in ((TEXT_KIND, "text"), (CLASS_KIND, "w"), (CLASSIFIER_KIND, "w")):
            for info in store.ls(kind=kind):
                entry = store.get(info.key, kind=kind)
                store.put(info.key, {name: entry.tensors[name].astype(np.float32)}, kind=kind, meta=entry.meta)
        with Encoded(model) as enc:
            out = zero_shot_classifier(model, tok, CLASSES[:3], TEMPLATES[:2], store=store)
        assert enc.rows == 6
    assert out.dtype == torch.float16 and same(out.double(), ref.double()) <= TOLERANCE[torch.float16]


def test_open_clips_positional_arguments_batches_and_device(vitb32, tmp_path):
    model, tok = vitb32
    ours = list(inspect.signature(zero_shot_classifier).parameters.values())
    theirs = list(inspect.signature(build_zero_shot_classifier).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ours[:7]] == [(p.name, p.kind, p.default) for p in theirs]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in ours[7:]) and "store" in [p.name for p in ours[7:]]
    with PromptStore(tmp_path / "s") as store:
        with Encoded(model) as enc:
            out = zero_shot_classifier(model, tok, CLASSES, TEMPLATES, 3, torch.device("cpu"), False, store=store)
        assert enc.batches == [15, 15, 15, 5]  # 3 classes x 5 templates per forward pass, as open_clip
        with pytest.raises(TypeError):
            zero_shot_classifier(model, tok, CLASSES, TEMPLATES, 3, "cpu", False, store)  # store is keyword-only
    assert out.device == torch.device("cpu") and same(out, build_zero_shot_classifier(model, tok, CLASSES, TEMPLATES, 3,
                                                                                     "cpu", False)) <= 1e-6
    with PromptStore(tmp_path / "t") as store, Encoded(model) as enc:
        out = zero_shot_classifier(model, tok, CLASSES, TEMPLATES, None, "cpu", store=store)
        assert enc.batches == [50]  # None: every class in one forward pass, as open_clip
    assert same(out, build_zero_shot_classifier(model, tok, CLASSES, TEMPLATES, None)) <= 1e-6


@pytest.mark.parametrize("args", [{"num_classes_per_batch": -1}, {"num_classes_per_batch": 2.5},
                                  {"num_classes_per_batch": True}, {"device": "no-such-device"}])
def test_bad_batch_or_device_fails_before_any_work(vitb32, tmp_path, args):
    model, tok = vitb32
    with PromptStore(tmp_path / "s") as store:
        with Encoded(model) as enc, pytest.raises(InvalidInputError):
            zero_shot_classifier(model, tok, CLASSES, TEMPLATES, store=store, **args)
        assert enc.rows == 0 and not store.ls()


def test_use_tqdm_shows_a_bar(vitb32, tmp_path, capsys):
    model, tok = vitb32
    with PromptStore(tmp_path / "s") as store:
        zero_shot_classifier(model, tok, CLASSES[:2], TEMPLATES[:2], store=store)
        assert "encoding prompts" not in capsys.readouterr().err  # open_clip's default: no bar
        zero_shot_classifier(model, tok, CLASSES[2:4], TEMPLATES[:2], use_tqdm=True, store=store)
        assert "promptstore: encoding prompts" in capsys.readouterr().err


def test_under_autocast_it_is_open_clips_build_and_nothing_is_stored(vitb32, tmp_path):
    """Autocast makes the float32 tower give bfloat16 features: not what its weights say, so not what its keys name."""
    model, tok = vitb32
    with PromptStore(tmp_path / "s") as store:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref = build_zero_shot_classifier(model, tok, CLASSES[:3], TEMPLATES[:2])
            with pytest.warns(PromptStoreWarning, match="autocast"):
                out = zero_shot_classifier(model, tok, CLASSES[:3], TEMPLATES[:2], store=store)
        assert ref.dtype == torch.bfloat16 and out.dtype == ref.dtype and torch.equal(out, ref)
        assert not store.ls()
        plain = zero_shot_classifier(model, tok, CLASSES[:3], TEMPLATES[:2], store=store)
    assert plain.dtype == torch.float32
    assert same(plain, build_zero_shot_classifier(model, tok, CLASSES[:3], TEMPLATES[:2])) <= 1e-6


def test_warm_classes_builds_a_classifier_in_whole_classes(tmp_path, capsys, monkeypatch):
    """``promptstore warm-classes NAMES --templates ...``: --batch prompts per forward pass, rounded to whole classes."""
    from promptstore.cli import main

    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # main() sets its own one-line format
    (tmp_path / "names.txt").write_text("forklift\npallet\nladder\n")
    (tmp_path / "templates.txt").write_text("a photo of a {}.\na {} in a warehouse.\n")
    argv = ["--dir", str(tmp_path / "s"), "--json", "warm-classes", str(tmp_path / "names.txt"), "--templates",
            str(tmp_path / "templates.txt"), "--encoder", "open_clip:ViT-B-32", "--batch", "5"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # random weights, said in a warning
        assert main(argv) == 0
        first = json.loads(capsys.readouterr().out)
        assert main(argv) == 0
        second = json.loads(capsys.readouterr().out)
    assert (first["encoded"], first["shape"], second["encoded"]) == (6, [512, 3], 0)


@pytest.mark.parametrize("rows,width", [(1, 0), (0, 256)], ids=["one-more-class", "half-width"])
def test_a_whole_classifier_entry_of_another_shape_is_a_miss(vitb32, tmp_path, rows, width):
    """An entry under the classifier's own key whose tensor has another shape is never served as the classifier."""
    from promptstore.vision._zeroshot import CLASSIFIER_KIND

    model, tok = vitb32
    names, templates = CLASSES[:3], TEMPLATES[:2]
    ref = build_zero_shot_classifier(model, tok, names, templates)  # (512, 3): cache off
    with PromptStore(tmp_path / "s") as store:
        built = zero_shot_classifier(model, tok, names, templates, store=store)
        (info,) = store.ls(kind=CLASSIFIER_KIND)  # the key the call reads the whole classifier from
        entry = store.get(info.key, kind=CLASSIFIER_KIND)
        assert entry.tensors["w"].shape == (3, 512)
        wrong = np.random.default_rng(0).standard_normal((3 + rows, 512 - width)).astype(np.float32)
        store.put(info.key, {"w": wrong}, kind=CLASSIFIER_KIND, meta=entry.meta)
        with Encoded(model) as enc:
            out = zero_shot_classifier(model, tok, names, templates, store=store)
        assert enc.rows == 0  # rebuilt from the per-class entries, not from the wrong one
        with Encoded(model) as enc:
            again = zero_shot_classifier(model, tok, names, templates, store=store)  # the rebuilt entry is stored
        assert enc.rows == 0
        assert store.get(info.key, kind=CLASSIFIER_KIND).tensors["w"].shape == (3, 512)
    # A store holding only the wrong entry (nothing else to build from): every prompt is encoded.
    with PromptStore(tmp_path / "t") as fresh:
        fresh.put(info.key, {"w": wrong}, kind=CLASSIFIER_KIND, meta=entry.meta)
        with Encoded(model) as enc:
            cold = zero_shot_classifier(model, tok, names, templates, store=fresh)
        assert enc.rows == 6
        assert [i.key for i in fresh.ls(kind=CLASSIFIER_KIND)] == [info.key]  # the very key, now rewritten
        assert fresh.get(info.key, kind=CLASSIFIER_KIND).tensors["w"].shape == (3, 512)
    for result in (out, again, cold):
        assert torch.equal(result, built) and same(result, ref) <= 1e-6


def padded_tower(seed: int = 0):
    """A small open_clip text tower that reads every position (no causal mask: padding changes its output)
    and takes any sequence length up to its 77 positions, with ViT-B-32's SimpleTokenizer."""
    torch.manual_seed(seed)
    model = open_clip.CustomTextCLIP(64, dict(layers=1, width=64, patch_size=32, image_size=64),
                                     dict(context_length=77, vocab_size=49408, width=64, heads=2, layers=2,
                                          no_causal_mask=True)).eval()
    Counting(model.text.token_embedding)
    return model, open_clip.get_tokenizer("ViT-B-32")


def test_a_changed_tokenizer_context_length_misses_and_equals_open_clip(tmp_path):
    model, tok = padded_tower()
    names, templates = CLASSES[:3], TEMPLATES[:2]
    with PromptStore(tmp_path / "s") as store:
        before = zero_shot_classifier(model, tok, names, templates, store=store)
        assert same(before, build_zero_shot_classifier(model, tok, names, templates)) <= 1e-6
        tok.context_length = 12  # 12 tokens per prompt instead of 77: the tower sees less padding
        ref = build_zero_shot_classifier(model, tok, names, templates)
        assert same(ref, before) > 1e-3  # the change changes what the tower computes
        with Counting(model.text.token_embedding) as enc:
            out = zero_shot_classifier(model, tok, names, templates, store=store)
        assert enc.rows == 6
        with Counting(model.text.token_embedding) as enc:
            again = zero_shot_classifier(model, tok, names, templates, store=store)
        assert enc.rows == 0  # the new context's entries, stored under their own keys
        tok.context_length = 77
        with Counting(model.text.token_embedding) as enc:
            back = zero_shot_classifier(model, tok, names, templates, store=store)
        assert enc.rows == 0  # and the old ones are still there under theirs
    assert same(out, ref) <= 1e-6 and torch.equal(out, again) and torch.equal(back, before)


def fewer_merges(tok, names):
    """Drop the merges that make each word of ``names`` one token (the vocabulary stays as it is)."""
    words = {tok.bpe(w) for n in names for w in tok.clean_fn(n).split()}
    for pair in [p for p in tok.bpe_ranks if "".join(p) in words]:
        del tok.bpe_ranks[pair]


def reversed_merges(tok, names):
    """The same merges in the opposite order."""
    last = len(tok.bpe_ranks) - 1
    for pair, rank in list(tok.bpe_ranks.items()):
        tok.bpe_ranks[pair] = last - rank


@pytest.mark.parametrize("edit", [fewer_merges, reversed_merges], ids=["fewer", "reordered"])
def test_other_bpe_merges_with_the_same_vocabulary_miss_and_equal_open_clip(vitb32, tmp_path, edit):
    model, _ = vitb32
    tok = open_clip.get_tokenizer("ViT-B-32")  # its own: edited in place below
    names, templates = CLASSES[:3], TEMPLATES[:2]
    vocabulary, tokens = dict(tok.encoder), tok(names)
    with PromptStore(tmp_path / "s") as store:
        before = zero_shot_classifier(model, tok, names, templates, store=store)
        edit(tok, names)
        tok.cache = {t: t for t in ("<start_of_text>", "<end_of_text>")}  # its memo of words already split
        assert tok.encoder == vocabulary and not torch.equal(tok(names), tokens)
        ref = build_zero_shot_classifier(model, tok, names, templates)
        assert same(ref, before) > 1e-3
        with Encoded(model) as enc:
            out = zero_shot_classifier(model, tok, names, templates, store=store)
        assert enc.rows == 6
    assert same(out, ref) <= 1e-6


def slow_tower(module, args, output) -> None:
    """A forward hook making each text-tower call take 100 ms (module-level: no state, see tests/counting.py)."""
    time.sleep(0.1)


def test_stats_count_each_prompt_under_vision_text_and_a_hit_saves_what_its_miss_spent(tmp_path):
    """store.stats(): each prompt looked up is counted under vision.text, and the hits' seconds_saved is the
    encoding their misses recorded: at least the tower's own time, never more than the whole build took."""
    model, tok = clip()
    model.token_embedding.register_forward_hook(slow_tower)  # in place before the first call: one model
    classes, templates = CLASSES[:3], TEMPLATES[:2]
    with PromptStore(tmp_path / "s") as store:
        t0 = time.perf_counter()
        zero_shot_classifier(model, tok, classes, templates, store=store)
        took = time.perf_counter() - t0
        for info in store.ls(kind="vision.zsset") + store.ls(kind="vision.zsclass"):
            store.delete(info.key)  # the next build reads every prompt's feature again
        zero_shot_classifier(model, tok, classes, templates, store=store)
        text = store.stats()["kinds"]["vision.text"]
        assert "unknown" not in store.stats()["kinds"]
    assert (text["misses"], text["hits"]) == (6, 6)
    assert 0.1 <= text["seconds_saved"] <= took


@pytest.mark.parametrize("mask", ["simple", "random", "shuffle"])  # "syntax" needs nltk (not installed here)
def test_a_tokenizer_with_a_random_reduction_mask_is_refused_before_anything_is_stored(mask, tmp_path):
    """open_clip's reduction masks keep a random part of a text longer than the context: its tokens (and so
    its features) vary from call to call, so no stored feature may stand for them."""
    from open_clip.tokenizer import SimpleTokenizer

    model, _ = clip()
    tokenizer = SimpleTokenizer(context_length=77, reduction_mask=mask)
    long = " ".join(["a pallet stacked high beside the loading dock"] * 20)
    rows = tokenizer([long] * 8)
    assert len({tuple(r.tolist()) for r in rows}) > 1  # the same text, tokenized eight ways
    with PromptStore(tmp_path / "s") as store:
        with pytest.raises(UnsupportedModelError, match="reduction mask"):
            zero_shot_classifier(model, tokenizer, CLASSES[:2], TEMPLATES[:1], store=store)
        assert store.ls() == []
