"""owl_detect against transformers' own OWLv2 / OWL-ViT call (random-init models from configs, no hub)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import open_clip
import pytest
import torch
from transformers import (
    CLIPTokenizer,
    Owlv2Config,
    Owlv2ForObjectDetection,
    Owlv2ImageProcessor,
    Owlv2Processor,
    OwlViTConfig,
    OwlViTForObjectDetection,
    OwlViTImageProcessor,
    OwlViTProcessor,
)

from promptstore import PromptStore
from promptstore.errors import InvalidInputError
from promptstore.vision import owl_detect
from promptstore.vision._classes import TEXT_KIND

from counting import Counting

QUERIES = ["a forklift", "a pallet", "a person in a hard hat", "a cardboard box"]
SMALL = dict(text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              max_position_embeddings=16, vocab_size=49408),
             vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                image_size=128, patch_size=32), projection_dim=64)  # OWL heads need projection_dim == text width


def clip_tokenizer_in(folder) -> CLIPTokenizer:
    """OWL's CLIP tokenizer, built offline from the BPE vocabulary open_clip ships (the same vocabulary)."""
    from pathlib import Path

    bpe = open_clip.get_tokenizer("ViT-B-32")
    folder = Path(folder)
    names = {"<start_of_text>": "<|startoftext|>", "<end_of_text>": "<|endoftext|>"}
    (folder / "vocab.json").write_text(json.dumps({names.get(k, k): v for k, v in bpe.encoder.items()}))
    merges = sorted(bpe.bpe_ranks.items(), key=lambda kv: kv[1])
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(pair) for pair, _ in merges) + "\n")
    # OWL's tokenizer pads with "!" (id 0) to 16 tokens: the detector reads id 0 first as "padded query".
    return CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), pad_token="!", model_max_length=16)


@pytest.fixture(scope="module")
def clip_tokenizer(tmp_path_factory):
    return clip_tokenizer_in(tmp_path_factory.mktemp("clip-tokenizer"))


def detector(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "owlv2":
        return Owlv2ForObjectDetection(Owlv2Config(**SMALL)).eval(), Owlv2Processor
    model = OwlViTForObjectDetection(OwlViTConfig(**SMALL)).eval()
    return model, OwlViTProcessor


def build(kind, tokenizer, seed=0):
    model, processor_cls = detector(kind, seed)
    image_cls = Owlv2ImageProcessor if kind == "owlv2" else OwlViTImageProcessor
    image_processor = image_cls(size={"height": 128, "width": 128}, crop_size={"height": 128, "width": 128})
    TextRuns(model)  # counted from the start (tests/counting.py)
    return model, processor_cls(image_processor=image_processor, tokenizer=tokenizer)


def images(n=2, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, (96 + 16 * i, 120, 3), dtype=np.uint8) for i in range(n)]


class TextRuns(Counting):
    """Counts text-tower rows (a hook on its embeddings; see tests/counting.py)."""

    def __init__(self, model) -> None:
        super().__init__((model.owlv2 if hasattr(model, "owlv2") else model.owlvit).text_model.embeddings)


def plain(model, processor, queries, imgs):
    inputs = processor(text=[list(queries)] * len(imgs), images=imgs, return_tensors="pt")
    with torch.no_grad():
        return model(**inputs)


def miss_then_hit(model, processor, imgs, store):
    """Two detections of QUERIES: the first runs the text tower on every query, the second on none."""
    with TextRuns(model) as runs:
        miss = owl_detect(model, processor, QUERIES, images=imgs, store=store)
    assert runs.rows == len(QUERIES)
    with TextRuns(model) as runs:
        hit = owl_detect(model, processor, QUERIES, images=imgs, store=store)
    assert runs.rows == 0
    return miss, hit


@pytest.mark.parametrize("kind", ["owlv2", "owlvit"])
def test_boxes_and_logits_equal_the_plain_call_and_a_hit_never_runs_the_text_tower(kind, clip_tokenizer, tmp_path):
    model, processor = build(kind, clip_tokenizer)
    imgs = images()
    ref = plain(model, processor, QUERIES, imgs)
    with PromptStore(tmp_path / "s") as store:
        cold, warm = miss_then_hit(model, processor, imgs, store)
        assert len(store.ls(kind=TEXT_KIND)) == len(QUERIES)
    for out in (cold, warm):
        assert type(out) is type(ref)
        for name in ("logits", "pred_boxes", "class_embeds", "image_embeds", "text_embeds") + (
                ("objectness_logits",) if kind == "owlv2" else ()):
            a, b = getattr(out, name), getattr(ref, name)
            assert a.shape == b.shape, name
            assert (a - b).abs().max().item() <= 1e-5, name
    # The processor's own post-processing takes the output as it is.
    target = torch.tensor([[im.shape[0], im.shape[1]] for im in imgs])
    post = processor.post_process_grounded_object_detection(warm, threshold=0.0, target_sizes=target)
    ref_post = processor.post_process_grounded_object_detection(ref, threshold=0.0, target_sizes=target)
    assert torch.allclose(post[0]["boxes"], ref_post[0]["boxes"], atol=1e-4)


def test_a_new_query_encodes_only_itself_and_order_follows_the_queries(clip_tokenizer, tmp_path):
    model, processor = build("owlv2", clip_tokenizer)
    imgs = images(1)
    with PromptStore(tmp_path / "s") as store:
        owl_detect(model, processor, QUERIES, images=imgs, store=store)
        queries = [QUERIES[2], "a ladder", QUERIES[0]]
        with TextRuns(model) as runs:
            out = owl_detect(model, processor, queries, images=imgs, store=store)
        assert runs.rows == 1 + 1  # the new query, and one stored query encoded again as the hit's check
    ref = plain(model, processor, queries, imgs)
    assert (out.logits - ref.logits).abs().max().item() <= 1e-5


def test_an_edited_text_weight_misses_and_a_vision_edit_still_hits(clip_tokenizer, tmp_path):
    model, processor = build("owlv2", clip_tokenizer)
    imgs = images(1)
    with PromptStore(tmp_path / "s") as store:
        owl_detect(model, processor, QUERIES, images=imgs, store=store)
        with torch.no_grad():
            model.owlv2.text_projection.weight.data[0, 0] += 1.0  # through .data: no version counter sees it
        with TextRuns(model) as runs:
            out = owl_detect(model, processor, QUERIES, images=imgs, store=store)
        assert runs.rows == len(QUERIES)
        assert (out.logits - plain(model, processor, QUERIES, imgs).logits).abs().max().item() <= 1e-5
        # A vision-side edit changes no query embedding: still hits.
        with torch.no_grad():
            model.layer_norm.weight.data += 0.1
        with TextRuns(model) as runs:
            owl_detect(model, processor, QUERIES, images=imgs, store=store)
        assert runs.rows == 0


def test_another_detector_gets_no_hits(clip_tokenizer, tmp_path):
    a, processor = build("owlv2", clip_tokenizer, seed=0)
    b, _ = build("owlv2", clip_tokenizer, seed=1)
    with PromptStore(tmp_path / "s") as store:
        owl_detect(a, processor, QUERIES, images=images(1), store=store)
        with TextRuns(b) as runs:
            owl_detect(b, processor, QUERIES, images=images(1), store=store)
        assert runs.rows == len(QUERIES)


@pytest.mark.parametrize("kwargs", [
    {"queries": []}, {"queries": ["a\ud800"]}, {"queries": [3]}, {"queries": "a forklift"},
    {"images": None}, {"pixel_values": torch.zeros(3, 128, 128)},
])
def test_bad_input_fails_before_any_work(clip_tokenizer, tmp_path, kwargs):
    model, processor = build("owlv2", clip_tokenizer)
    args = {"queries": QUERIES, "images": images(1), **kwargs}
    if "pixel_values" in kwargs:
        args.pop("images")
    with PromptStore(tmp_path / "s") as store, TextRuns(model) as runs:
        with pytest.raises(InvalidInputError):
            owl_detect(model, processor, args.pop("queries"), store=store, **args)
        assert runs.rows == 0 and not store.ls()


def test_repeated_and_newline_ended_queries_equal_the_plain_call(clip_tokenizer, tmp_path):
    """What the processor accepts is accepted: a repeated query, and one ending in a newline."""
    model, processor = build("owlv2", clip_tokenizer)
    queries = ["a forklift", "a forklift", "a pallet\n", "a pallet"]
    imgs = images(1)
    want = plain(model, processor, queries, imgs)
    with PromptStore(tmp_path / "s") as store:
        miss = owl_detect(model, processor, queries, images=imgs, store=store)
        with TextRuns(model) as runs:
            hit = owl_detect(model, processor, queries, images=imgs, store=store)
    assert runs.rows == 0
    for got in (miss, hit):
        assert (got.logits - want.logits).abs().max().item() <= 1e-5
        assert (got.pred_boxes - want.pred_boxes).abs().max().item() <= 1e-5


def test_a_left_padding_tokenizer_is_refused_before_any_work(tmp_path):
    """The plain call reads a left-padded query as an absent one (its first token is padding) and masks it out."""
    (tmp_path / "tok").mkdir()
    tokenizer = clip_tokenizer_in(tmp_path / "tok")
    tokenizer.padding_side = "left"
    model, processor = build("owlv2", tokenizer)
    with PromptStore(tmp_path / "s") as store, TextRuns(model) as runs:
        with pytest.raises(InvalidInputError, match="right-padding"):
            owl_detect(model, processor, QUERIES, images=images(1), store=store)
        assert runs.rows == 0 and not store.ls()


def test_an_image_processor_setting_keeps_the_queries_hits(clip_tokenizer, tmp_path):
    """The processor's image side never sees a query: changing it is no new query key."""
    model, processor = build("owlv2", clip_tokenizer)
    imgs = images(1)
    with PromptStore(tmp_path / "s") as store:
        owl_detect(model, processor, QUERIES, images=imgs, store=store)
        processor.image_processor.do_rescale = False
        with TextRuns(model) as runs:
            got = owl_detect(model, processor, QUERIES, images=imgs, store=store)
    assert runs.rows == 0
    assert (got.logits - plain(model, processor, QUERIES, imgs).logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("kind", ["owlv2", "owlvit"])
def test_a_fresh_process_with_another_hash_seed_finds_the_queries(kind, tmp_path):
    """Code constants such as ``x in {"a", "b"}`` (a frozenset, iterated in an order each process's
    string hashing decides) are named the same in every process: a fresh process hits."""
    from conftest import run_python

    (tmp_path / "tok").mkdir()
    code = f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_owl import build, clip_tokenizer_in, images, QUERIES, TextRuns
        from promptstore import PromptStore
        from promptstore.vision import owl_detect
        model, processor = build({kind!r}, clip_tokenizer_in({str(tmp_path / "tok")!r}))
        with PromptStore({str(tmp_path / "s")!r}) as store, TextRuns(model) as runs:
            owl_detect(model, processor, QUERIES, images=images(1), store=store)
        print("ROWS", runs.rows)
    """
    rows = [int(run_python(code, env={"PYTHONHASHSEED": seed}).stdout.split("ROWS")[-1]) for seed in ("1", "2")]
    assert rows == [len(QUERIES), 0]


def test_other_models_are_refused(clip_tokenizer, tmp_path):
    with PromptStore(tmp_path / "s") as store, pytest.raises(InvalidInputError, match="Owl"):
        owl_detect(torch.nn.Linear(2, 2), None, QUERIES, images=images(1), store=store)


def test_a_changed_text_setting_that_is_no_weight_misses(clip_tokenizer, tmp_path):
    model, processor = build("owlv2", clip_tokenizer)
    imgs = images(1)
    with PromptStore(tmp_path / "s") as store:
        owl_detect(model, processor, QUERIES, images=imgs, store=store)
        model.owlv2.text_model.final_layer_norm.eps = 1e-1  # a setting, not a weight: it changes the embeddings
        with TextRuns(model) as runs:
            out = owl_detect(model, processor, QUERIES, images=imgs, store=store)
        assert runs.rows == len(QUERIES)
    assert (out.logits - plain(model, processor, QUERIES, imgs).logits).abs().max().item() <= 1e-5


FIELDS = ("logits", "pred_boxes", "class_embeds", "image_embeds", "text_embeds")


def outputs(out, kind="owlv2"):
    return {name: getattr(out, name) for name in FIELDS + (("objectness_logits",) if kind == "owlv2" else ())}


def test_a_changed_tokenizer_model_max_length_misses_and_equals_a_recompute(tmp_path):
    """OWL's processor pads every query to the tokenizer's model_max_length: another length is another
    input to the text tower (other rounding; a query longer than it fails), so it is a miss.

    The change is made after a call, and nothing calls the processor between it and owl_detect: the
    tokenizer's Rust backend keeps the padding its last call set (length 16), and that leftover is part
    of the fingerprint, so the key must change through model_max_length itself.
    """
    tok = clip_tokenizer_in(tmp_path)  # its own: edited in place below
    model, processor = build("owlv2", tok)
    imgs = images(1)
    plain(model, processor, QUERIES, imgs)  # a call first, as a session makes one (see below)
    with PromptStore(tmp_path / "s") as store:
        owl_detect(model, processor, QUERIES, images=imgs, store=store)
        tok.model_max_length = 10
        with TextRuns(model) as runs:
            out = owl_detect(model, processor, QUERIES, images=imgs, store=store)
        assert runs.rows == len(QUERIES)
        assert processor(text=QUERIES, return_tensors="pt")["input_ids"].shape == (len(QUERIES), 10)
        with PromptStore(tmp_path / "off") as empty:  # the same call with nothing stored: a recompute
            recompute = owl_detect(model, processor, QUERIES, images=imgs, store=empty)
        ref = plain(model, processor, QUERIES, imgs)
        for name, value in outputs(out).items():
            assert torch.equal(value, outputs(recompute)[name]), name
            assert (value - outputs(ref)[name]).abs().max().item() <= 1e-5, name
        # Shorter than a stored query ("a person in a hard hat" is 8 tokens): the plain call fails, and so
        # does this one, instead of serving the entry stored under the longer padding.
        tok.model_max_length = 6
        with pytest.raises(ValueError):
            plain(model, processor, QUERIES, imgs)
        with TextRuns(model) as runs, pytest.raises(ValueError):
            owl_detect(model, processor, QUERIES, images=imgs, store=store)
        assert runs.rows == 0


@pytest.mark.parametrize("kind", ["owlv2", "owlvit"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_a_half_or_bfloat16_detector_gets_its_own_dtype_from_the_store(kind, dtype, clip_tokenizer, tmp_path):
    """Entries hold the embeddings exactly (float32 holds every half and bfloat16 value): a hit gives the
    detector the very embeddings a miss computed, in its dtype, and both are the plain call's, bit for bit."""
    model, processor = build(kind, clip_tokenizer)
    model = model.to(dtype)
    imgs = images(1)  # one image: the plain call encodes the same batch of queries, so it rounds alike
    ref = plain(model, processor, QUERIES, imgs)
    assert ref.text_embeds.dtype == dtype
    with PromptStore(tmp_path / "s") as store:
        miss, hit = miss_then_hit(model, processor, imgs, store)
    for out in (miss, hit):
        assert out.text_embeds.dtype == out.image_embeds.dtype == dtype
        for name, value in outputs(out, kind).items():
            expected = outputs(ref, kind)[name]
            assert value.dtype == expected.dtype and torch.equal(value, expected), name


def test_a_processor_without_a_tokenizer_is_refused(clip_tokenizer, tmp_path):
    """The image processor alone has no tokenizer to name in the key: a typed error, nothing stored."""
    model, processor = build("owlv2", clip_tokenizer)
    with PromptStore(tmp_path / "s") as store:
        with pytest.raises(InvalidInputError, match="processor must be"):
            owl_detect(model, processor.image_processor, QUERIES, images=images(1), store=store)
        assert not store.ls()


def slow_text(module, args, output) -> None:
    """A forward hook making each text-tower call take 50 ms (module-level: no state, see tests/counting.py)."""
    time.sleep(0.05)


def test_stats_count_each_query_under_vision_text_and_a_hit_saves_what_its_miss_spent(clip_tokenizer, tmp_path):
    """store.stats(): every query looked up is counted under vision.text, and the hits' seconds_saved is
    the text work their misses recorded: at least the text tower's own time, never more than the call took."""
    model, processor = build("owlv2", clip_tokenizer)
    model.owlv2.text_model.register_forward_hook(slow_text)  # in place before the first call: one model
    queries = QUERIES + ["a ladder", "a shelf", "a truck", "a helmet"]
    pixel_values = processor(images=images(1), return_tensors="pt")["pixel_values"]
    with PromptStore(tmp_path / "s") as store:
        t0 = time.perf_counter()
        owl_detect(model, processor, queries, pixel_values=pixel_values, store=store)
        took = time.perf_counter() - t0
        with TextRuns(model) as runs:
            owl_detect(model, processor, queries, pixel_values=pixel_values, store=store)
        assert runs.rows == 0
        kinds = store.stats()["kinds"]
    assert list(kinds) == ["vision.text"]
    assert (kinds["vision.text"]["misses"], kinds["vision.text"]["hits"]) == (len(queries), len(queries))
    assert 0.05 <= kinds["vision.text"]["seconds_saved"] <= took
