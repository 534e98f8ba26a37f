"""promptstore.vision.pipeline: transformers' zero-shot vision pipelines, their text tower from the store.

Each served pipeline is compared with transformers' own pipeline over the same model object and
inputs (random weights at small sizes; the same code paths as the released checkpoints): the same
labels in the same order, the same scores and boxes. A second call runs no text at all (counted by
a hook on the text tower's embeddings, tests/counting.py); a new label encodes itself and one
stored label, checked (vision/_verify.py). OWL's image tower runs once per image instead of once
per label.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    CLIPConfig,
    CLIPImageProcessor,
    CLIPModel,
    MetaClip2Config,
    MetaClip2Model,
    Owlv2Config,
    Owlv2ForObjectDetection,
    Owlv2ImageProcessor,
    OwlViTConfig,
    OwlViTForObjectDetection,
    OwlViTImageProcessor,
    Siglip2Config,
    Siglip2ImageProcessor,
    Siglip2Model,
    SiglipConfig,
    SiglipImageProcessor,
    SiglipModel,
)
from transformers import pipeline as transformers_pipeline

import promptstore.vision._pipelines as pipelines_module
from promptstore import PromptStore
from promptstore.errors import InvalidInputError, PromptStoreWarning, UnsupportedModelError
from promptstore.vision import pipeline

from counting import Counting
from test_owl import SMALL, clip_tokenizer_in

LABELS = ["a forklift", "a pallet", "a person in a hard hat", "a cardboard box"]
TOWER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
CLASSIFY, DETECT = "zero-shot-image-classification", "zero-shot-object-detection"


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """A CLIP BPE tokenizer (built offline) for the classifiers (64 tokens: SigLIP pads to 64) and OWL (16)."""
    long = clip_tokenizer_in(tmp_path_factory.mktemp("tok64"))
    long.model_max_length = 64
    return {"classify": long, "detect": clip_tokenizer_in(tmp_path_factory.mktemp("tok16"))}


def classifier(family: str, seed: int = 0):
    """(model, image processor) of a zero-shot classifier family, small and random."""
    torch.manual_seed(seed)
    text = dict(TOWER, vocab_size=49408, max_position_embeddings=64)
    vision = dict(TOWER, image_size=64, patch_size=16)
    clip_images = CLIPImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64})
    if family == "clip":
        return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=32)).eval(), clip_images
    if family == "metaclip_2":
        return MetaClip2Model(MetaClip2Config(text_config=text, vision_config=vision, projection_dim=32)).eval(), clip_images
    if family == "siglip2":
        return (Siglip2Model(Siglip2Config(text_config=text, vision_config=dict(TOWER, num_patches=16, patch_size=16))).eval(),
                Siglip2ImageProcessor(max_num_patches=16, patch_size=16))
    return (SiglipModel(SiglipConfig(text_config=text, vision_config=vision)).eval(),
            SiglipImageProcessor(size={"height": 64, "width": 64}))


def detector(family: str, seed: int = 0):
    torch.manual_seed(seed)
    if family == "owlv2":
        return Owlv2ForObjectDetection(Owlv2Config(**SMALL)).eval(), Owlv2ImageProcessor(size={"height": 128, "width": 128})
    return (OwlViTForObjectDetection(OwlViTConfig(**SMALL)).eval(),
            OwlViTImageProcessor(size={"height": 128, "width": 128}, crop_size={"height": 128, "width": 128}))


def pictures(n: int = 2, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (80 + 16 * i, 100, 3), dtype=np.uint8)) for i in range(n)]


def text_tower(model):
    for path in ("text_model", "owlv2.text_model", "owlvit.text_model"):
        try:
            return pipelines_module._attr(model, path)
        except AttributeError:
            continue
    raise AssertionError(type(model))


def same_scores(got, want, atol: float = 1e-6) -> None:
    """Pipeline outputs (one image's list, or a list of them) equal: labels in order, boxes, scores."""
    if got and isinstance(got[0], list):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            same_scores(g, w, atol)
        return
    assert [(g["label"], g.get("box")) for g in got] == [(w["label"], w.get("box")) for w in want]
    assert max(abs(g["score"] - w["score"]) for g, w in zip(got, want, strict=True)) <= atol


@pytest.mark.parametrize("family", ["clip", "metaclip_2", "siglip", "siglip2"])
def test_zero_shot_classification_equals_transformers_and_a_hit_runs_no_text(family, tokenizers, store):
    model, images = classifier(family)
    Counting(text_tower(model).embeddings)
    args = dict(model=model, tokenizer=tokenizers["classify"], image_processor=images)
    plain = transformers_pipeline(CLASSIFY, **args)
    served = pipeline(CLASSIFY, store=store, **args)
    assert isinstance(served, type(plain))
    picture = pictures(1)[0]
    with Counting(text_tower(model).embeddings) as runs:
        miss = served(picture, candidate_labels=LABELS)
    assert runs.rows == len(LABELS)
    with Counting(text_tower(model).embeddings) as runs:
        hit = served(pictures(2), candidate_labels=LABELS, hypothesis_template="This is a photo of {}.")
    assert runs.rows == 0
    same_scores(miss, plain(picture, candidate_labels=LABELS))
    same_scores(hit, plain(pictures(2), candidate_labels=LABELS))
    # A new label: it is encoded with one stored prompt, checked. A new template: only its prompts.
    with Counting(text_tower(model).embeddings) as runs:
        more = served(picture, candidate_labels=[*LABELS, "a truck"])
    assert runs.rows == 2
    same_scores(more, plain(picture, candidate_labels=[*LABELS, "a truck"]))
    with Counting(text_tower(model).embeddings) as runs:
        other = served(picture, candidate_labels=LABELS[:2], hypothesis_template="a picture of {}")
    assert runs.rows == 2
    same_scores(other, plain(picture, candidate_labels=LABELS[:2], hypothesis_template="a picture of {}"))


def test_a_text_weight_edit_misses_and_a_vision_edit_still_hits(tokenizers, store):
    model, images = classifier("clip")
    Counting(model.text_model.embeddings)
    args = dict(model=model, tokenizer=tokenizers["classify"], image_processor=images)
    served, plain = pipeline(CLASSIFY, store=store, **args), transformers_pipeline(CLASSIFY, **args)
    picture = pictures(1)[0]
    served(picture, candidate_labels=LABELS)
    with torch.no_grad():
        model.vision_model.post_layernorm.weight.mul_(1.5)
    with Counting(model.text_model.embeddings) as runs:
        got = served(picture, candidate_labels=LABELS)
    assert runs.rows == 0
    same_scores(got, plain(picture, candidate_labels=LABELS))
    with torch.no_grad():
        model.text_model.final_layer_norm.weight.mul_(1.5)
    with Counting(model.text_model.embeddings) as runs:
        got = served(picture, candidate_labels=LABELS)
    assert runs.rows == len(LABELS)
    same_scores(got, plain(picture, candidate_labels=LABELS))


def test_what_changes_between_set_up_and_the_first_call_is_seen_by_that_call(tokenizers, store):
    """A served pipeline names its text tower as it is made; a weight edited through ``.data`` (no
    version counter moves), a setting or a hook changed before its first call is seen by that call."""
    model, images = classifier("clip")
    Counting(model.text_model.embeddings)
    args = dict(model=model, tokenizer=tokenizers["classify"], image_processor=images)
    plain, picture = transformers_pipeline(CLASSIFY, **args), pictures(1)[0]
    pipeline(CLASSIFY, store=store, **args)(picture, candidate_labels=LABELS)
    for edit in (lambda: model.text_model.final_layer_norm.weight.data.mul_(1.5),
                 lambda: setattr(model.text_model.final_layer_norm, "eps", 0.5),
                 lambda: model.text_model.final_layer_norm.register_forward_hook(lambda m, args, out: out + 0.25)):
        served = pipeline(CLASSIFY, store=store, **args)
        edit()
        with Counting(model.text_model.embeddings) as runs:
            got = served(picture, candidate_labels=LABELS)
        assert runs.rows == len(LABELS)
        same_scores(got, plain(picture, candidate_labels=LABELS))


@pytest.mark.parametrize("edit", ["data", "numpy", "file"])
def test_a_tower_loaded_from_files_is_named_by_its_pages_and_any_write_misses(edit, tokenizers, tmp_path, monkeypatch):
    """Weights ``from_pretrained`` leaves mapped from the file are named by the kernel's page proof,
    not hashed; a write through ``.data``, through a numpy view, or to the file itself is seen."""
    import promptstore._digest as digest

    monkeypatch.setattr(digest, "_PROOF_MIN_TOTAL", 0)  # a small tower: use the proof as for a real one
    monkeypatch.setattr(digest, "_RACY_S", 0.0)  # saved just now: let its digests be remembered
    monkeypatch.setenv("PROMPTSTORE_DIGESTS", str(tmp_path / "digests.sqlite3"))
    built, images = classifier("clip")
    built.save_pretrained(tmp_path / "model")
    model = CLIPModel.from_pretrained(tmp_path / "model").eval()
    embedding = model.text_model.embeddings.token_embedding.weight
    embedding.sum()  # its pages read in, as a loaded model's are
    pages = digest._Pages()
    assert pages.file_range(embedding.data_ptr(), embedding.numel() * 4) is not None, "not file-mapped"
    pages.close()
    Counting(model.text_model.embeddings)
    args = dict(model=model, tokenizer=tokenizers["classify"], image_processor=images)
    plain, picture = transformers_pipeline(CLASSIFY, **args), pictures(1)[0]
    served = pipeline(CLASSIFY, store=PromptStore(tmp_path / "store"), **args)
    served(picture, candidate_labels=LABELS)
    with Counting(model.text_model.embeddings) as runs:
        served(picture, candidate_labels=LABELS)
    assert runs.rows == 0
    ids = tokenizers["classify"](LABELS[0])["input_ids"]
    row = ids[1]  # the first label's first word: every call reads this row
    if edit == "data":
        embedding.data[row] += 0.5  # no version counter moves
    elif edit == "numpy":
        embedding.detach().numpy()[row] += 0.5
    else:
        with open(tmp_path / "model" / "model.safetensors", "r+b") as f:  # pages not yet copied follow the file
            header = int.from_bytes(f.read(8), "little")
            meta = json.loads(f.read(header))["text_model.embeddings.token_embedding.weight"]
            f.seek(8 + header + meta["data_offsets"][0] + row * embedding.shape[1] * 4)
            f.write(np.full(embedding.shape[1], 3.0, np.float32).tobytes())
        assert float(embedding[row, 0]) == 3.0
    with Counting(model.text_model.embeddings) as runs:
        got = served(picture, candidate_labels=LABELS)
    assert runs.rows == len(LABELS)
    same_scores(got, plain(picture, candidate_labels=LABELS))


def test_a_new_process_store_serves_every_label(tokenizers, tmp_path):
    model, images = classifier("siglip")
    Counting(model.text_model.embeddings)
    args = dict(model=model, tokenizer=tokenizers["classify"], image_processor=images)
    picture = pictures(1)[0]
    with PromptStore(tmp_path / "s") as first:
        pipeline(CLASSIFY, store=first, **args)(picture, candidate_labels=LABELS)
    with PromptStore(tmp_path / "s", memory_bytes=0) as reopened, Counting(model.text_model.embeddings) as runs:
        got = pipeline(CLASSIFY, store=reopened, **args)(picture, candidate_labels=LABELS)
    assert runs.rows == 0
    same_scores(got, transformers_pipeline(CLASSIFY, **args)(picture, candidate_labels=LABELS))


@pytest.mark.parametrize("family", ["owlv2", "owlvit"])
def test_zero_shot_detection_equals_transformers_and_runs_the_image_tower_once_per_image(
        family, tokenizers, store, monkeypatch):
    model, images = detector(family)
    base = model.owlv2 if family == "owlv2" else model.owlvit
    Counting(base.text_model.embeddings)
    # Image-tower runs counted by its embeddings' class (a hook on the image side would make the served
    # pipeline run it once per label, as transformers' does: a hook might count on that).
    image, embeddings = [], type(base.vision_model.embeddings)
    forward = embeddings.forward
    monkeypatch.setattr(embeddings, "forward", lambda self, *a, **k: (image.append(1), forward(self, *a, **k))[1])
    args = dict(model=model, tokenizer=tokenizers["detect"], image_processor=images)
    plain, served = transformers_pipeline(DETECT, **args), pipeline(DETECT, store=store, **args)
    pics = pictures(2)
    call = dict(candidate_labels=LABELS, threshold=0.0, top_k=20)
    with Counting(base.text_model.embeddings) as text:
        want = [plain(p, **call) for p in pics]
    assert text.rows == len(pics) * len(LABELS) and len(image) == len(pics) * len(LABELS)  # both once per label
    image.clear()
    with Counting(base.text_model.embeddings) as text:
        miss = [served(p, **call) for p in pics]
    assert text.rows == len(LABELS) and len(image) == len(pics)  # each label encoded once, each image once
    image.clear()
    with Counting(base.text_model.embeddings) as text:
        hit = served(pics[0], **call)
    assert text.rows == 0 and len(image) == 1  # the image, and no text
    for got, ref in zip([*miss, hit], [*want, want[0]], strict=True):
        same_scores(got, ref, atol=1e-5)


@pytest.mark.parametrize("family", ["owlv2", "grounding_dino"])
def test_a_detection_call_names_its_text_side_once_and_every_call_anew(family, tokenizers, store, monkeypatch):
    if family == "grounding_dino":
        model, tokenizer, images = grounding()
        tower = model.model.text_backbone
    else:
        model, images = detector(family)
        tokenizer, tower = tokenizers["detect"], text_tower(model)
    args = dict(model=model, tokenizer=tokenizer, image_processor=images)
    plain, served = transformers_pipeline(DETECT, **args), pipeline(DETECT, store=store, **args)
    named = []
    real = pipelines_module._TextSide.fingerprint
    monkeypatch.setattr(pipelines_module._TextSide, "fingerprint", lambda self: (named.append(1), real(self))[1])
    picture, call = pictures(1)[0], dict(candidate_labels=LABELS, threshold=0.0, top_k=20)
    # A miss names the call, then checks the name again before storing each label it computed; a hit
    # names the call once, not once per label.
    for names in (1 + len(LABELS), 2 + len(LABELS)):
        same_scores(served(picture, **call), plain(picture, **call), atol=1e-5)
        assert len(named) == names
    with torch.no_grad():  # between calls: the next call names the edited tower
        next(tower.parameters()).add_(0.25)
    want = plain(picture, **call)
    with Counting(tower.embeddings) as runs:
        same_scores(served(picture, **call), want, atol=1e-5)
    assert runs.rows == len(LABELS) and len(named) == 3 + 2 * len(LABELS)


def test_a_detection_call_cut_short_leaves_nothing_a_later_call_of_the_same_image_reuses(tokenizers, store):
    model, images = detector("owlv2")
    Counting(model.owlv2.text_model.embeddings)
    args = dict(model=model, tokenizer=tokenizers["detect"], image_processor=images)
    plain, served = transformers_pipeline(DETECT, **args), pipeline(DETECT, store=store, **args)
    picture, call = pictures(1)[0], dict(candidate_labels=LABELS, threshold=0.0, top_k=20)
    with Counting(model.owlv2.text_model.embeddings) as runs:
        runs.stop_after(2)  # Ctrl-C at the second label, after the first label's image tower ran
        with pytest.raises(KeyboardInterrupt):
            served(picture, **call)
    with torch.no_grad():  # the image tower and the text tower edited before the same image is asked again
        model.owlv2.vision_model.post_layernorm.bias.add_(0.5)
        model.owlv2.text_model.final_layer_norm.bias.add_(0.5)
    same_scores(served(picture, **call), plain(picture, **call), atol=1e-5)


class _Armed:
    """A module-level switch, so that the hook reading it keeps one identity (tests/counting.py's pattern)."""

    edit: float = 0.0


ARMED = _Armed()


def edit_text_once(module, args, output):
    """On the image tower: adds ARMED.edit to the text tower's last norm once, mid-call (a hook's edit)."""
    if ARMED.edit:
        with torch.no_grad():
            module.edited.final_layer_norm.bias.add_(ARMED.edit)
        ARMED.edit = 0.0


def test_what_the_tower_computes_after_an_edit_mid_call_is_not_stored_under_the_calls_name(tokenizers, store):
    model, images = detector("owlv2")
    base = model.owlv2
    base.vision_model.edited = base.text_model  # what the hook reaches
    base.vision_model.register_forward_hook(edit_text_once)
    args = dict(model=model, tokenizer=tokenizers["detect"], image_processor=images)
    plain, served = transformers_pipeline(DETECT, **args), pipeline(DETECT, store=store, **args)
    picture, call = pictures(1)[0], dict(candidate_labels=LABELS, threshold=0.0, top_k=20)
    bias = base.text_model.final_layer_norm.bias.detach().clone()
    ARMED.edit = 0.5
    served(picture, **call)  # its first label before the image tower, the others after the edit
    assert ARMED.edit == 0.0
    with torch.no_grad():
        base.text_model.final_layer_norm.bias.copy_(bias)  # back to the tower the call was named by
    same_scores(served(picture, **call), plain(picture, **call), atol=1e-5)


def test_detection_in_batches_of_labels_equals_transformers(tokenizers, store):
    """``batch_size=2``: the collated inputs carry a list of call marks and a list of is_last flags; each
    batch is named afresh and runs its own image tower, and the result is the plain pipeline's."""
    model, images = detector("owlv2")
    args = dict(model=model, tokenizer=tokenizers["detect"], image_processor=images)
    plain, served = transformers_pipeline(DETECT, **args), pipeline(DETECT, store=store, **args)
    picture, call = pictures(1)[0], dict(candidate_labels=LABELS, threshold=0.0, top_k=20)
    want = plain(picture, **call)
    for _ in range(2):  # a miss, then a hit
        same_scores(served(picture, batch_size=2, **call), want, atol=1e-5)


def test_a_stored_label_that_differs_from_the_tower_now_is_not_served(tokenizers, store, monkeypatch):
    model, images = classifier("clip")
    args = dict(model=model, tokenizer=tokenizers["classify"], image_processor=images)
    monkeypatch.setattr(pipelines_module._TextSide, "fingerprint", lambda self: "tower:blind")
    served, plain = pipeline(CLASSIFY, store=store, **args), transformers_pipeline(CLASSIFY, **args)
    picture = pictures(1)[0]
    served(picture, candidate_labels=LABELS[:2])
    with torch.no_grad():  # a change the (blinded) key does not see
        model.text_model.final_layer_norm.weight.mul_(1.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = served(picture, candidate_labels=LABELS)
    assert sum(issubclass(w.category, PromptStoreWarning) for w in caught) == 1
    same_scores(got, plain(picture, candidate_labels=LABELS))


def test_other_tasks_and_families_are_refused_before_any_work(tokenizers, store):
    with pytest.raises(InvalidInputError):
        pipeline("text-generation", model=None, store=store)
    model, images = detector("owlv2")
    with pytest.raises(UnsupportedModelError):  # a detector's model under the classification task
        pipeline(CLASSIFY, model=model, tokenizer=tokenizers["classify"], image_processor=images, store=store)
    assert store.ls() == []


def grounding(tmp_path_factory=None, seed: int = 0):
    """A small random Grounding DINO (Swin and BERT from transformers' classes), its image processor and
    a BERT tokenizer over a few words."""
    import tempfile

    from transformers import (
        BertConfig,
        BertTokenizer,
        GroundingDinoConfig,
        GroundingDinoForObjectDetection,
        GroundingDinoImageProcessor,
        SwinConfig,
    )

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", "a", "forklift", "pallet", "person", "in", "hard", "hat",
             "cardboard", "box", "truck"]
    vocab = Path(tempfile.mkdtemp()) / "vocab.txt"
    vocab.write_text("\n".join(words) + "\n")
    torch.manual_seed(seed)
    config = GroundingDinoConfig(
        backbone_config=SwinConfig(embed_dim=32, depths=[1, 1, 1, 1], num_heads=[1, 2, 4, 8], out_indices=[2, 3, 4],
                                   window_size=7, image_size=224),
        text_config=BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                               vocab_size=len(words)),
        d_model=32, encoder_layers=1, decoder_layers=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_queries=20,
        encoder_attention_heads=4, decoder_attention_heads=4, num_feature_levels=4, encoder_n_points=2,
        decoder_n_points=2, max_text_len=32)
    model = GroundingDinoForObjectDetection(config).eval()
    return model, BertTokenizer(str(vocab)), GroundingDinoImageProcessor(size={"shortest_edge": 224, "longest_edge": 224})


def swin_runs(monkeypatch) -> list[int]:
    """Runs of Swin's embeddings (the start of Grounding DINO's image backbone), counted by their class's forward:
    a hook on the backbone would make the served pipeline run it once per label, as transformers' does."""
    from transformers.models.swin.modeling_swin import SwinEmbeddings

    runs: list[int] = []
    forward = SwinEmbeddings.forward

    def counted(self, *args, **kwargs):
        runs.append(1)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(SwinEmbeddings, "forward", counted)
    return runs


def test_grounding_dino_serves_its_text_backbone_and_the_fused_result_equals_the_plain_call(store, monkeypatch):
    model, tokenizer, images = grounding()
    text = model.model.text_backbone.embeddings
    Counting(text)
    image = swin_runs(monkeypatch)  # once per label in the plain call, once per image in the served one
    args = dict(model=model, tokenizer=tokenizer, image_processor=images)
    plain, served = transformers_pipeline(DETECT, **args), pipeline(DETECT, store=store, **args)
    pics = pictures(2)
    call = dict(candidate_labels=LABELS, threshold=0.0, top_k=20)
    want = [plain(p, **call) for p in pics]
    assert len(image) == len(pics) * len(LABELS)
    image.clear()
    with Counting(text) as runs:
        miss = served(pics[0], **call)
    assert runs.rows == len(LABELS) and len(image) == 1
    image.clear()
    with Counting(text) as runs:
        hit = [served(p, **call) for p in pics]
    assert runs.rows == 0 and len(image) == len(pics)
    for got, ref in zip([miss, *hit], [want[0], *want], strict=True):
        same_scores(got, ref, atol=1e-5)
    # An edited text weight: another key, every label encoded again, equal to the plain call.
    with torch.no_grad():
        model.model.text_backbone.embeddings.LayerNorm.bias.add_(0.3)
    with Counting(text) as runs:
        edited = served(pics[0], **call)
    assert runs.rows == len(LABELS)
    same_scores(edited, plain(pics[0], **call), atol=1e-5)
    # An edit to the image backbone between calls is computed, not reused from an earlier call.
    with torch.no_grad():
        model.model.backbone.conv_encoder.model.swin.embeddings.norm.bias.add_(0.3)
    same_scores(served(pics[0], **call), plain(pics[0], **call), atol=1e-5)


def test_grounding_dino_with_a_hook_on_its_image_backbone_runs_it_for_every_label(store):
    """A hook sees every label's run, as in transformers' pipeline (a stateful hook's output would differ)."""
    model, tokenizer, images = grounding()
    seen: list[int] = []
    model.model.backbone.register_forward_hook(lambda module, args, out: seen.append(1))
    args = dict(model=model, tokenizer=tokenizer, image_processor=images)
    plain, served = transformers_pipeline(DETECT, **args), pipeline(DETECT, store=store, **args)
    call = dict(candidate_labels=LABELS, threshold=0.0, top_k=20)
    pic = pictures(1)[0]
    want = plain(pic, **call)
    assert len(seen) == len(LABELS)
    same_scores(served(pic, **call), want, atol=1e-5)
    assert len(seen) == 2 * len(LABELS)


def test_served_detection_from_two_threads_leaves_the_model_whole(store):
    """Two threads calling one served pipeline: every answer equals the plain call's, and the model's own parts
    are back in place after (a swap saving another thread's stand-in as the original would leave it there)."""
    import threading

    model, tokenizer, images = grounding()
    backbone, tower = model.model.backbone, model.model.text_backbone
    args = dict(model=model, tokenizer=tokenizer, image_processor=images)
    plain, served = transformers_pipeline(DETECT, **args), pipeline(DETECT, store=store, **args)
    call = dict(candidate_labels=LABELS, threshold=0.0, top_k=20)
    pics = pictures(2)
    want = [plain(p, **call) for p in pics]
    served(pics[0], **call)  # stored: the threads' calls are hits (the text backbone swapped too)
    got: dict[int, list] = {}

    def run(i: int) -> None:
        got[i] = [served(pics[i % 2], **call) for _ in range(3)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert model.model.backbone is backbone and model.model.text_backbone is tower
    for i, answers in got.items():
        for answer in answers:
            same_scores(answer, want[i % 2], atol=1e-5)
    same_scores(plain(pics[1], **call), want[1], atol=1e-5)


@pytest.mark.parametrize("family", ["clip", "siglip", "grounding_dino"])
def test_a_fresh_process_with_another_hash_seed_is_served_every_label_and_equals_the_plain_pipeline(family, tmp_path):
    """Two real processes (another ``PYTHONHASHSEED`` each) on one folder: the second runs no text and
    answers what transformers' own pipeline answers in that process."""
    from conftest import run_python

    (tmp_path / "tok").mkdir()
    code = f"""
        import json, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_pipelines import *
        from test_pipelines import transformers_pipeline
        from counting import Counting
        if {family!r} == "grounding_dino":
            model, tokenizer, images = grounding()
            tower, task, call = model.model.text_backbone.embeddings, DETECT, dict(threshold=0.0, top_k=20)
        else:
            model, images = classifier({family!r})
            tokenizer = clip_tokenizer_in({str(tmp_path / "tok")!r})
            tokenizer.model_max_length = 64
            tower, task, call = model.text_model.embeddings, CLASSIFY, {{}}
        args = dict(model=model, tokenizer=tokenizer, image_processor=images)
        Counting(tower)
        with PromptStore({str(tmp_path / "s")!r}) as store, Counting(tower) as runs:
            got = pipeline(task, store=store, **args)(pictures(1)[0], candidate_labels=LABELS, **call)
            rows = runs.rows
        want = transformers_pipeline(task, **args)(pictures(1)[0], candidate_labels=LABELS, **call)
        print("RESULT", json.dumps({{"rows": rows, "got": got, "want": want}}))
    """
    runs = [json.loads(run_python(code, env={"PYTHONHASHSEED": seed}).stdout.split("RESULT")[-1])
            for seed in ("1", "2")]
    assert [r["rows"] for r in runs] == [len(LABELS), 0]
    for r in runs:
        same_scores(r["got"], r["want"], atol=1e-5)


@pytest.mark.parametrize("task", [CLASSIFY, DETECT])
def test_tenants_never_read_each_others_labels(task, tokenizers, tmp_path):
    if task == CLASSIFY:
        model, images = classifier("clip")
        tower, args = model.text_model.embeddings, dict(tokenizer=tokenizers["classify"], image_processor=images)
    else:
        model, images = detector("owlv2")
        tower, args = model.owlv2.text_model.embeddings, dict(tokenizer=tokenizers["detect"], image_processor=images)
    Counting(tower)
    picture = pictures(1)[0]
    with PromptStore(tmp_path / "s", namespace="tenant-a") as a, PromptStore(tmp_path / "s", namespace="tenant-b") as b:
        pipeline(task, model=model, store=a, **args)(picture, candidate_labels=LABELS)
        with Counting(tower) as runs:
            pipeline(task, model=model, store=b, **args)(picture, candidate_labels=LABELS)
        assert runs.rows == len(LABELS)  # b computes its own
        assert {e.key for e in a.ls()}.isdisjoint({e.key for e in b.ls()})
        with Counting(tower) as runs:
            pipeline(task, model=model, store=a, **args)(picture, candidate_labels=LABELS)
        assert runs.rows == 0


@pytest.mark.parametrize("family,change", [("clip", "padding_side"), ("metaclip_2", "padding_side"),
                                           ("siglip", "padding_side"), ("siglip", "pad_token"),
                                           ("siglip2", "pad_token")])
def test_a_tokenizers_padding_is_part_of_what_names_a_row(family, change, tokenizers, tmp_path):
    """Left padding shifts a CLIP row's positions; SigLIP pools its last position, a pad: a row stored with
    one padding is not served to another (a fresh store's answer is the plain one, and so is the warm one)."""
    import copy

    model, images = classifier(family)
    Counting(text_tower(model).embeddings)
    tokenizer = copy.deepcopy(tokenizers["classify"])
    args = dict(model=model, tokenizer=tokenizer, image_processor=images)
    plain, served = transformers_pipeline(CLASSIFY, **args), pipeline(CLASSIFY, store=PromptStore(tmp_path), **args)
    picture = pictures(1)[0]
    same_scores(served(picture, candidate_labels=LABELS), plain(picture, candidate_labels=LABELS), atol=1e-5)
    if change == "padding_side":
        tokenizer.padding_side = "left"
    else:
        tokenizer.pad_token = "<|endoftext|>"
    want = plain(picture, candidate_labels=LABELS)
    with Counting(text_tower(model).embeddings) as runs:
        same_scores(served(picture, candidate_labels=LABELS), want, atol=1e-5)
    assert runs.rows == len(LABELS)


def test_a_clip_label_hits_whatever_the_longest_label_of_the_call(tokenizers, store):
    """Right padding after a CLIP row's end-of-text token changes nothing: a label stored in one call hits in a
    call whose other labels pad it further."""
    model, images = classifier("clip")
    Counting(text_tower(model).embeddings)
    args = dict(model=model, tokenizer=tokenizers["classify"], image_processor=images)
    plain, served = transformers_pipeline(CLASSIFY, **args), pipeline(CLASSIFY, store=store, **args)
    picture = pictures(1)[0]
    served(picture, candidate_labels=LABELS[:2])
    longer = [*LABELS[:2], "a person in a hard hat standing beside a red forklift in a warehouse aisle"]
    with Counting(text_tower(model).embeddings) as runs:
        got = served(picture, candidate_labels=longer)
    assert runs.rows == 2  # the new label and one stored label encoded again to check it: the other hits
    same_scores(got, plain(picture, candidate_labels=longer), atol=1e-5)


@pytest.mark.parametrize("where", ["hook", "pre_hook", "base_hook", "forward"])
def test_owl_with_a_users_hook_or_patch_on_the_detectors_forward_equals_the_plain_call(where, tokenizers, store):
    """A hook or patch on the detector (or the base model holding its text tower) sees what the text tower returned,
    whole in the plain call: the forward then runs as transformers' own, text tower included (a stand-in's output
    would carry the pooled rows only; see test_a_users_hook_on_the_model_that_reads_what_the_text_tower_returned_gets_it)."""
    model, images = detector("owlv2")
    if where == "hook":
        model.register_forward_hook(lambda module, args, out: (setattr(out, "logits", out.logits * 0.5), out)[1])
    elif where == "pre_hook":
        model.register_forward_pre_hook(
            lambda module, args, kwargs: (args, {**kwargs, "pixel_values": kwargs["pixel_values"] * 0.5}),
            with_kwargs=True)
    elif where == "base_hook":
        model.owlv2.register_forward_hook(lambda module, args, out: (setattr(out, "text_embeds", -out.text_embeds), out)[1])
    else:
        forward = model.forward
        model.forward = lambda *a, **k: (lambda out: (setattr(out, "logits", out.logits - 1.0), out)[1])(forward(*a, **k))
    Counting(model.owlv2.text_model.embeddings)
    args = dict(model=model, tokenizer=tokenizers["detect"], image_processor=images)
    plain, served = transformers_pipeline(DETECT, **args), pipeline(DETECT, store=store, **args)
    call = dict(candidate_labels=LABELS, threshold=0.0, top_k=20)
    pic = pictures(1)[0]
    want = plain(pic, **call)
    same_scores(served(pic, **call), want, atol=1e-5)
    with Counting(model.owlv2.text_model.embeddings) as runs:
        same_scores(served(pic, **call), want, atol=1e-5)
    assert runs.rows == len(LABELS)  # one forward per label, as transformers' pipeline runs it


def test_grounding_dinos_mask_function_is_part_of_the_text_sides_name(store, monkeypatch):
    """The text backbone's attention mask and positions come from a function of the model's module: replaced,
    the stored rows are not served."""
    import transformers.models.grounding_dino.modeling_grounding_dino as gd

    model, tokenizer, images = grounding()
    args = dict(model=model, tokenizer=tokenizer, image_processor=images)
    plain, served = transformers_pipeline(DETECT, **args), pipeline(DETECT, store=store, **args)
    call = dict(candidate_labels=LABELS, threshold=0.0, top_k=20)
    pic = pictures(1)[0]
    same_scores(served(pic, **call), plain(pic, **call), atol=1e-5)
    original = gd.generate_masks_with_special_tokens_and_transfer_map

    def attend_everywhere(input_ids, special_tokens):
        mask, positions = original(input_ids, special_tokens)
        return torch.ones_like(mask), positions

    monkeypatch.setattr(gd, "generate_masks_with_special_tokens_and_transfer_map", attend_everywhere)
    same_scores(served(pic, **call), plain(pic, **call), atol=1e-5)


def served_and_plain(model, images, tokenizers, store):
    """A served classification pipeline of ``model``, a picture, and the plain pipeline's answer on it."""
    args = dict(model=model, tokenizer=tokenizers["classify"], image_processor=images)
    plain, served = transformers_pipeline(CLASSIFY, **args), pipeline(CLASSIFY, store=store, **args)
    picture = pictures(1)[0]
    return served, picture, plain(picture, candidate_labels=LABELS)


def test_a_users_hook_reading_the_text_tower_during_a_served_forward_sees_the_tower(tokenizers, store):
    """While a served forward runs, its stand-in answers what the tower's attributes are; a state_dict taken
    meanwhile has the tower's own keys."""
    model, images = classifier("clip")
    read: list = []
    model.register_forward_pre_hook(lambda module, args: read.append(
        (module.text_model.config.hidden_size, sorted(module.state_dict())[:3])))
    served, picture, want = served_and_plain(model, images, tokenizers, store)
    same_scores(served(picture, candidate_labels=LABELS), want, atol=1e-5)
    same_scores(served(picture, candidate_labels=LABELS), want, atol=1e-5)
    assert len(read) == 3 and read[1] == read[0] and read[2] == read[0]


def test_a_row_is_named_by_its_own_ids_only_where_the_towers_pooling_cannot_reach_a_pad():
    """MetaCLIP 2 pools the first eos id whatever it is (no largest-id rule, unlike CLIP with the legacy eos 2):
    a row without one, padded with it, pools a pad, so its padding names it."""
    from transformers import MetaClip2TextConfig, MetaClip2TextModel

    torch.manual_seed(0)
    tower = MetaClip2TextModel(MetaClip2TextConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=16, eos_token_id=2, pad_token_id=2, bos_token_id=0)).eval()
    own = [0, 50, 51, 52]
    alone, padded = torch.tensor([own]), torch.tensor([own + [2, 2]])
    alone_mask, padded_mask = torch.ones_like(alone), torch.tensor([[1, 1, 1, 1, 0, 0]])
    with torch.no_grad():
        differ = (tower(input_ids=alone, attention_mask=alone_mask).pooler_output
                  - tower(input_ids=padded, attention_mask=padded_mask).pooler_output).abs().max().item() > 1e-3
    pooling = pipelines_module._EOS_POOLED["metaclip_2"]
    same_name = (pipelines_module._row_names(alone, alone_mask, pooling, 2)
                 == pipelines_module._row_names(padded, padded_mask, pooling, 2))
    assert differ and not same_name
    # With its eos among its own tokens the padding changes nothing, and the row is named by its own ids.
    ended = own + [2]
    assert (pipelines_module._row_names(torch.tensor([ended]), torch.ones(1, 5, dtype=torch.long), pooling, 2)
            == pipelines_module._row_names(torch.tensor([ended + [2]]), torch.tensor([[1] * 5 + [0]]), pooling, 2))


def test_a_users_hook_that_rewrites_the_text_inputs_is_served_what_the_tower_computes_for_them(tokenizers, store):
    """A pre-hook that changes the ids the model gets: the stand-in, made for the pipeline's ids, runs the tower."""
    model, images = classifier("clip")

    def reverse(module, args, kwargs):
        ids = kwargs["input_ids"].clone()
        ids[:, 1:3] = ids[:, 1:3].flip(-1)
        return args, {**kwargs, "input_ids": ids}

    model.register_forward_pre_hook(reverse, with_kwargs=True)
    served, picture, want = served_and_plain(model, images, tokenizers, store)
    same_scores(served(picture, candidate_labels=LABELS), want, atol=1e-5)
    same_scores(served(picture, candidate_labels=LABELS), want, atol=1e-5)


@pytest.mark.parametrize("where", ["wrapped_forward", "vision_hook"])
def test_owl_with_a_wrapped_class_forward_or_a_stateful_image_side_hook_equals_the_plain_call(
        where, tokenizers, store, monkeypatch):
    """A class patch made with functools.wraps keeps transformers' __module__; a hook on the image tower sees
    it run once per label in transformers' pipeline: both make the detector's own forward run per label."""
    import functools

    model, images = detector("owlv2")
    if where == "wrapped_forward":
        forward = Owlv2ForObjectDetection.forward

        @functools.wraps(forward)
        def halved(self, *a, **k):
            out = forward(self, *a, **k)
            out.logits = out.logits * 0.5
            return out

        monkeypatch.setattr(Owlv2ForObjectDetection, "forward", halved)
    else:
        calls = [0]

        def drift(module, args, out):
            calls[0] += 1
            out.last_hidden_state[..., 0] += 0.5 * calls[0]  # one channel: a norm after it does not undo it

        model.owlv2.vision_model.register_forward_hook(drift)
    args = dict(model=model, tokenizer=tokenizers["detect"], image_processor=images)
    plain, served = transformers_pipeline(DETECT, **args), pipeline(DETECT, store=store, **args)
    call = dict(candidate_labels=LABELS, threshold=0.0, top_k=20)
    pic = pictures(1)[0]
    if where == "vision_hook":
        calls[0] = 0
        want = plain(pic, **call)
        calls[0] = 0
        same_scores(served(pic, **call), want, atol=1e-5)
    else:
        same_scores(served(pic, **call), plain(pic, **call), atol=1e-5)


@pytest.mark.parametrize("task,family", [(CLASSIFY, "clip"), (DETECT, "owlv2")])
def test_a_pipeline_handed_another_model_serves_that_model(task, family, tokenizers, store):
    """``pipe.model = other`` (transformers' pipelines read ``self.model`` at each call): the text side is that
    model's, named and served as its own. A detector kept the first model's text tower and ran the second's heads
    on it (OWLv2 scores off by 0.03, other labels first)."""
    make = classifier if task == CLASSIFY else detector
    (first, images), (second, _) = make(family, seed=0), make(family, seed=1)
    args = dict(tokenizer=tokenizers["classify" if task == CLASSIFY else "detect"], image_processor=images)
    call = dict(candidate_labels=LABELS, **({} if task == CLASSIFY else {"threshold": 0.0, "top_k": 10}))
    picture = pictures(1)[0]
    served = pipeline(task, store=store, model=first, **args)
    same_scores(served(picture, **call), transformers_pipeline(task, model=first, **args)(picture, **call), atol=1e-5)
    served.model = second
    want = transformers_pipeline(task, model=second, **args)(picture, **call)
    with Counting(text_tower(second).embeddings) as runs:
        same_scores(served(picture, **call), want, atol=1e-5)
    assert runs.rows == len(LABELS)  # the second model's own rows, encoded and stored
    with Counting(text_tower(second).embeddings) as runs:
        same_scores(served(picture, **call), want, atol=1e-5)
    assert runs.rows == 0


@pytest.mark.parametrize("reads", ["token_states", "calls_tower"])
def test_a_users_hook_on_the_model_that_reads_what_the_text_tower_returned_gets_it(reads, tokenizers, store):
    """A hook on the model (which holds the text tower) sees the tower's whole output, as in the plain call: the
    forward runs as transformers' own. The stand-in's output carries the pooled rows only: such a hook failed
    (AttributeError on the token states), and one calling the tower got the stand-in's answer."""
    model, images = classifier("clip")
    seen: list = []

    def hook(module, args, kwargs, out):
        if reads == "token_states":
            seen.append(out.text_model_output.last_hidden_state.sum().item())
        else:
            seen.append(module.text_model(input_ids=kwargs["input_ids"],
                                          attention_mask=kwargs["attention_mask"]).last_hidden_state.sum().item())

    model.register_forward_hook(hook, with_kwargs=True)
    served, picture, want = served_and_plain(model, images, tokenizers, store)
    for _ in range(2):
        same_scores(served(picture, candidate_labels=LABELS), want, atol=1e-5)
    assert len(seen) == 3 and seen[1] == pytest.approx(seen[0], rel=1e-5) and seen[2] == pytest.approx(seen[0], rel=1e-5)


def test_a_text_tower_that_draws_random_numbers_is_computed_every_call_and_nothing_of_it_stored(tokenizers, store):
    """A hook that adds noise to the tower's output: each call is one draw, so nothing is stored and every call
    equals the plain pipeline's under the same seed (its first call's noise was served to every later seed)."""
    model, images = classifier("clip")
    model.text_model.register_forward_hook(
        lambda module, args, out: (setattr(out, "pooler_output", out.pooler_output + torch.randn_like(out.pooler_output)), out)[1])
    # The image side draws too (after the text side's miss would have): the call runs as transformers' own, in its order.
    model.vision_model.post_layernorm.register_forward_hook(lambda module, args, out: out + 0.1 * torch.randn_like(out))
    args = dict(model=model, tokenizer=tokenizers["classify"], image_processor=images)
    plain, served = transformers_pipeline(CLASSIFY, **args), pipeline(CLASSIFY, store=store, **args)
    picture = pictures(1)[0]
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        want = plain(picture, candidate_labels=LABELS)
        torch.manual_seed(seed)
        with pytest.warns(PromptStoreWarning, match="drew random numbers"):
            got = served(picture, candidate_labels=LABELS)
        same_scores(got, want, atol=1e-5)
    assert store.ls() == []


def test_a_grounding_dino_text_backbone_that_draws_random_numbers_is_computed_every_call_and_nothing_stored(store):
    model, tokenizer, images = grounding()
    model.model.text_backbone.encoder.layer[-1].output.LayerNorm.register_forward_hook(
        lambda m, args, out: out + 0.1 * torch.randn_like(out))
    args = dict(model=model, tokenizer=tokenizer, image_processor=images)
    plain, served = transformers_pipeline(DETECT, **args), pipeline(DETECT, store=store, **args)
    picture, call = pictures(1)[0], dict(candidate_labels=LABELS, threshold=0.0, top_k=20)
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        want = plain(picture, **call)
        torch.manual_seed(seed)
        with pytest.warns(PromptStoreWarning, match="drew random numbers"):
            got = served(picture, **call)
        same_scores(got, want, atol=1e-5)
    assert store.ls() == []
