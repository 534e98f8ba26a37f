"""promptstore.vision against a real YOLOE (yoloe-11s-seg.yaml) and a real MobileCLIP2-B text
tower (open_clip, random weights from a fixed seed): right shapes, right cost, exact checks.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import ultralytics
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from ultralytics import YOLOE
from ultralytics.utils import ASSETS

from promptstore import PromptStore
from promptstore.errors import InvalidInputError, ModelUnavailableError
from promptstore.vision import (
    OpenCLIPTextEncoder,
    UltralyticsTextEncoder,
    export_npz,
    import_npz,
    set_classes,
    visual_pe,
)
from promptstore.vision._classes import Recipes, detector_fingerprint

from conftest import run_python

WAREHOUSE = ["forklift", "pallet", "cardboard box", "safety vest", "hard hat", "person", "pallet jack", "ladder"]
LVIS = Path(ultralytics.__file__).parent / "cfg" / "datasets" / "lvis.yaml"


def yoloe(seed: int = 0) -> YOLOE:
    torch.manual_seed(seed)  # a yaml-built YOLOE is random: a seed makes "the same weights"
    return YOLOE("yoloe-11s-seg.yaml")


@pytest.fixture(scope="module")
def encoder():
    return OpenCLIPTextEncoder("MobileCLIP2-B", seed=0)


def stand_in_text_model(encoder, path: Path) -> Path:
    """A TorchScript text encoder traced here from the open_clip tower: it stands in for ultralytics' mobileclip_blt.ts."""
    import warnings

    import open_clip

    class Tower(torch.nn.Module):
        def __init__(self, enc):
            super().__init__()
            self.model = enc._build()

        def forward(self, tokens):
            return torch.nn.functional.normalize(self.model(tokens), dim=-1)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit's tracer and deprecation warnings
        torch.jit.trace(Tower(encoder).eval(), open_clip.tokenize(["forklift", "pallet"]), check_trace=False).save(str(path))
    return path


@pytest.fixture(scope="module")
def own_text_model(tmp_path_factory, encoder):
    """A working folder holding the model's own text model file, so set_classes' default encoder runs."""
    folder = tmp_path_factory.mktemp("own-text-model")
    stand_in_text_model(encoder, folder / "mobileclip_blt.ts")
    return folder


def lvis_names(n: int) -> list[str]:
    import yaml

    return list(yaml.safe_load(LVIS.read_text())["names"].values())[:n]


def test_applied_pe_is_the_heads_mapping_of_the_encoder_output(encoder, store):
    model = yoloe()
    report = set_classes(model, WAREHOUSE, store=store, encoder=encoder)
    assert (report.misses, report.hits, report.encoder_loaded) == (len(WAREHOUSE), 0, True)
    feats = encoder.encode(WAREHOUSE)
    with torch.no_grad():
        expected = model.model.model[-1].get_tpe(torch.from_numpy(feats)[None])
    assert (model.model.pe - expected).abs().max().item() <= 1e-5
    assert list(model.model.names.values()) == WAREHOUSE
    results = model.predict(str(ASSETS / "bus.jpg"), verbose=False)
    assert len(results) == 1 and results[0].boxes is not None  # random weights: maybe no boxes, but it runs


def test_warm_set_classes_in_a_fresh_process_never_builds_the_encoder(encoder, tmp_path):
    folder = tmp_path / "store"
    set_classes(yoloe(), WAREHOUSE, store=PromptStore(folder), encoder=encoder)
    out = run_python(
        f"""
        import json, torch
        from ultralytics import YOLOE
        from promptstore import PromptStore
        from promptstore.vision import OpenCLIPTextEncoder, set_classes

        class NoBuild(OpenCLIPTextEncoder):
            def _build(self):
                raise AssertionError("the encoder was built on a full hit")

        torch.manual_seed(0)
        model = YOLOE("yoloe-11s-seg.yaml")
        names = {WAREHOUSE!r}
        r = set_classes(model, names, store=PromptStore({str(folder)!r}), encoder=NoBuild("MobileCLIP2-B"))
        r2 = set_classes(model, names[::-1], store=PromptStore({str(folder)!r}), encoder=NoBuild("MobileCLIP2-B"))
        print(json.dumps([r.hits, r.misses, r.encoder_loaded, r.from_set, r2.hits, r2.misses, r2.from_set]))
        """
    )
    assert json.loads(out.stdout.splitlines()[-1]) == [8, 0, False, True, 8, 0, False]


def test_changing_the_head_misses_pe_but_hits_text_and_changing_the_encoder_misses_both(encoder, store):
    set_classes(yoloe(), WAREHOUSE, store=store, encoder=encoder)
    other_head = yoloe()
    with torch.no_grad():
        next(other_head.model.model[-1].reprta.parameters()).add_(0.01)
    r = set_classes(other_head, WAREHOUSE, store=store, encoder=encoder)
    assert (r.hits, r.text_hits, r.misses, r.encoder_loaded) == (0, 8, 0, True)  # encoder object already built
    r = set_classes(yoloe(), WAREHOUSE, store=store, encoder=OpenCLIPTextEncoder("MobileCLIP2-B", seed=1))
    assert (r.hits, r.text_hits, r.misses) == (0, 0, 8)


def test_partial_overlap_encodes_only_new_names(encoder, store):
    model = yoloe()
    set_classes(model, WAREHOUSE[:5], store=store, encoder=encoder)
    r = set_classes(model, WAREHOUSE[3:], store=store, encoder=encoder)
    assert (r.hits, r.misses) == (2, 3)


def test_trimmed_context_equals_the_77_token_context(encoder):
    names = lvis_names(48) + ["a very long class name about a yellow forklift carrying three wooden pallets"]
    trimmed = encoder.encode(names)
    encoder.trim = False
    try:
        full = encoder.encode(names)
    finally:
        encoder.trim = True
    assert np.abs(trimmed - full).max() <= 1e-5
    assert np.allclose(np.linalg.norm(trimmed, axis=1), 1.0, atol=1e-5)
    # and against open_clip's own text tower forward on the full context
    import open_clip

    with torch.no_grad():
        ref = torch.nn.functional.normalize(encoder._build()(open_clip.get_tokenizer("MobileCLIP2-B")(names)), dim=-1)
    assert np.abs(trimmed - ref.numpy()).max() <= 1e-5


def test_npz_written_by_us_loads_in_ultralytics(encoder, store, tmp_path):
    model = yoloe()
    set_classes(model, WAREHOUSE, store=store, encoder=encoder)
    export_npz(model, tmp_path / "classes.npz")
    other = yoloe()
    other.load_prompt_embeddings(tmp_path / "classes.npz")
    assert torch.equal(other.model.pe, model.model.pe)
    assert list(other.model.names.values()) == WAREHOUSE


def test_npz_written_by_ultralytics_imports_and_its_handle_serves_it_without_an_encoder(encoder, store, tmp_path):
    source = yoloe()
    set_classes(source, WAREHOUSE, store=PromptStore(tmp_path / "elsewhere"), encoder=encoder)
    source.save_prompt_embeddings(tmp_path / "theirs.npz")
    target = yoloe()
    report = import_npz(target, tmp_path / "theirs.npz", store=store)
    assert report.names == 8 and torch.equal(target.model.pe, source.model.pe)
    assert report.source.startswith("npz:") and len(report.source) == 68
    # One entry of its own; nothing under the encoder's keys (its names are not known to be text).
    assert [e.kind for e in store.ls()] == ["vision.npz"]
    assert import_npz(yoloe(), tmp_path / "theirs.npz", store=store).source == report.source  # content-addressed
    assert len(store.ls()) == 1
    # The handle serves any subset in any order, without an encoder (this model's mobileclip:blt is not on disk):
    fresh = yoloe()
    r = set_classes(fresh, WAREHOUSE[3::-1], store=store, source=report.source)
    assert (r.hits, r.misses, r.encoder_loaded, r.from_set, r.source) == (4, 0, False, True, report.source)
    assert torch.equal(fresh.model.pe, source.model.pe[:, [3, 2, 1, 0]])
    assert list(fresh.model.names.values()) == WAREHOUSE[3::-1]
    # Without the handle the names are text to encode, as if nothing had been imported:
    with pytest.raises(ModelUnavailableError, match="mobileclip_blt.ts"):
        set_classes(fresh, WAREHOUSE[:4], store=store)
    assert torch.equal(fresh.model.pe, source.model.pe[:, [3, 2, 1, 0]])  # unchanged by the refusal
    # The entry travels in a bundle: another store serves the handle with no file at hand.
    assert store.export_bundle(tmp_path / "npz.psb", kind="vision.npz") == 1
    with PromptStore(tmp_path / "air-gapped") as other:
        other.import_bundle(tmp_path / "npz.psb")
        set_classes(fresh, WAREHOUSE, store=other, source=report.source)
    assert torch.equal(fresh.model.pe, source.model.pe)


def _visual_prompt_npz(path: Path) -> Path:
    """What ultralytics users do: predict with visual prompts (classes become object0, object1), then save them."""
    model = yoloe()
    prompts = {"bboxes": np.array([[221.5, 405.8, 344.9, 857.5], [30.0, 60.0, 300.0, 500.0]]), "cls": np.array([0, 1])}
    model.predict(str(ASSETS / "bus.jpg"), visual_prompts=prompts, refer_image=str(ASSETS / "bus.jpg"), verbose=False)
    assert list(model.model.names.values()) == ["object0", "object1"]
    return model.save_prompt_embeddings(path)


def _renamed_npz(path: Path, encoder) -> Path:
    """ImageNet's WordNet ids as prompts: ultralytics displays (and saves) them renamed, "n01440764" as "tench".

    So the NPZ says "tench" for the embedding of the text "n01440764": its names are not what was encoded.
    """
    model = yoloe()
    set_classes(model, ["n01440764", "n01443537"], store=PromptStore(path.parent / "renamer"), encoder=encoder)
    assert list(model.model.names.values()) == ["tench", "goldfish"]  # ultralytics' check_class_names renamed them
    return model.save_prompt_embeddings(path)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_an_npz_of_visual_prompts_or_renamed_classes_never_serves_those_names_as_text(encoder, store, tmp_path,
                                                                                      own_text_model, monkeypatch):
    """Issue #20: import_npz stored each NPZ name's embedding under the encoder's key for that name.

    The model's own text model is on disk here (set_classes' default encoder, as import_npz's was), so
    a stored embedding under its keys would be served: only what it computes may be.
    """
    npzs = {"visual": _visual_prompt_npz(tmp_path / "vp.npz"), "renamed": _renamed_npz(tmp_path / "renamed.npz", encoder)}
    monkeypatch.chdir(own_text_model)
    from promptstore.vision._classes import default_encoder

    assert default_encoder(yoloe()).weights.resolve() == (own_text_model / "mobileclip_blt.ts").resolve()
    handles = {k: import_npz(yoloe(), path, store=store).source for k, path in npzs.items()}
    for k, path in npzs.items():
        with np.load(path) as f:
            names, emb = f["names"].tolist(), torch.from_numpy(f["embeddings"])
        # Cache on (after the import) equals cache off: one name (a per-name lookup), then the whole
        # vocabulary (a vocabulary lookup; the one name is the encoder's own entry by now).
        for asked, counts in ((names[1:], (0, 1, False)), (names, (1, 1, False))):
            model = yoloe()
            r = set_classes(model, asked, store=store)
            assert (r.hits, r.misses, r.from_set) == counts and r.source is None and r.encoder_loaded, k
            off = yoloe()
            set_classes(off, asked, store=PromptStore(tmp_path / f"off-{k}-{len(asked)}"))
            assert (model.model.pe - off.model.pe).abs().max().item() <= 1e-5, k  # the encoder's batches differ
            assert not torch.allclose(model.model.pe, emb[:, len(names) - len(asked):], atol=1e-3), k
        # Asked for by its handle, the NPZ is what comes back, name by name:
        model = yoloe()
        r = set_classes(model, names[::-1], store=store, source=handles[k])
        assert (r.hits, r.misses, r.encoder_loaded) == (2, 0, False) and torch.equal(model.model.pe, emb.flip(1)), k
        assert list(model.model.names.values()) == names[::-1]
        # ... and now the encoder's entries for those names are there, and the handle still serves the NPZ:
        r = set_classes(model, names, store=store)
        assert r.from_set and not torch.equal(model.model.pe, emb)
        set_classes(model, names, store=store, source=handles[k])
        assert torch.equal(model.model.pe, emb)


def test_an_npz_handle_is_refused_where_it_cannot_be_served(encoder, store, tmp_path):
    path = _renamed_npz(tmp_path / "renamed.npz", encoder)
    handle = import_npz(yoloe(), path, store=store).source
    model = yoloe()
    set_classes(model, ["person"], store=store, encoder=encoder)
    before_names, before_pe, before_entries = dict(model.model.names), model.model.pe.clone(), len(store.ls())
    cases = [
        (["n01440764"], handle, InvalidInputError, "does not hold"),  # what was encoded is not what the NPZ says
        (["tench"], "renamed.npz", InvalidInputError, "handle"),  # a path is no handle
        (["tench"], "npz:" + "0" * 64, ModelUnavailableError, "not in this store"),
        (["tench"], "npz:" + "0" * 10, InvalidInputError, "handle"),  # hex, but not 64 characters of it
        (["tench"], "0" * 68, InvalidInputError, "handle"),  # 68 hex characters without the "npz:"
        (["tench"], "npz:X" + "0" * 63, InvalidInputError, "handle"),  # one character is not hex (the first)
    ]
    for names, source, error, match in cases:
        with pytest.raises(error, match=match):
            set_classes(model, names, store=store, source=source)
    with PromptStore(store.path, namespace="other") as other, pytest.raises(ModelUnavailableError):
        set_classes(model, ["tench"], store=other, source=handle)  # a namespace never serves another's NPZ
    torch.manual_seed(0)
    medium = YOLOE("yoloe-11m-seg.yaml")
    with pytest.raises(InvalidInputError, match="made for 'yoloe-11s'"):
        set_classes(medium, ["tench"], store=store, source=handle)
    assert model.model.names == before_names and torch.equal(model.model.pe, before_pe)
    assert len(store.ls()) == before_entries
    # The handle not in the store was one lookup of an NPZ, and stats() counts its miss as one.
    kinds = store.stats()["kinds"]
    assert kinds["vision.npz"]["misses"] == 1 and "unknown" not in kinds


def test_an_entry_under_a_handles_key_that_is_not_that_npz_is_never_served(store, tmp_path):
    """A store is shared (one folder, bundles from other hosts): what it holds under a handle's key is
    checked against the handle, so content that is not the NPZ the handle names is refused, never served."""
    handle = import_npz(yoloe(), _npz(tmp_path / "ab.npz"), store=store).source
    [info] = store.ls(kind="vision.npz")
    good = store.get(info.key)
    pe, payload, meta = np.array(good.tensors["pe"]), np.array(good.tensors["names"]), dict(good.meta)
    replaced = [
        {"pe": pe + 1, "names": payload},  # other embeddings for the same names
        {"pe": pe, "names": np.frombuffer(b"not a vocabulary", np.uint8)},  # names import_npz never wrote
        {"pe": pe, "names": np.concatenate([payload, np.zeros(1, np.uint8)])},  # a byte past the last name
        {"pe": pe},  # no names at all
    ]
    model = yoloe()
    before = dict(model.model.names)
    for tensors in replaced:
        store.put(info.key, tensors, kind="vision.npz", meta=meta)
        with pytest.raises(ModelUnavailableError, match="not in this store"):
            set_classes(model, ["a", "b"], store=store, source=handle)
    assert model.model.names == before and getattr(model.model, "pe", None) is None  # never applied


def test_a_handle_alone_serves_from_the_default_store_and_reports_what_it_did(encoder, tmp_path, monkeypatch):
    """set_classes(source=...) without a store reads PromptStore()'s, and its report is what happened:
    each name from the NPZ's one entry, nothing encoded, the seconds it took, whether the encoder passed
    along was built. The inner detection model carries no NPZ model id: refused, as import_npz does."""
    monkeypatch.setenv("PROMPTSTORE_DIR", str(tmp_path / "default"))
    handle = import_npz(yoloe(), _npz(tmp_path / "ab.npz")).source
    encoder.encode(["pallet"])  # built
    model = yoloe()
    t0 = time.perf_counter()
    r = set_classes(model, ["b"], source=handle, encoder=encoder)
    took = time.perf_counter() - t0
    assert (r.names, r.hits, r.text_hits, r.misses, r.encoder_loaded, r.from_set, r.source) == (
        1, 1, 0, 0, True, True, handle)
    assert 0 <= r.seconds <= took
    assert list(model.model.names.values()) == ["b"]
    assert set_classes(model, ["a", "b"], source=handle).encoder_loaded is False  # no encoder at all
    with pytest.raises(InvalidInputError, match="needs an ultralytics.YOLOE"):
        set_classes(model.model, ["a"], source=handle)


# Pinned like tests/test_keys.py's GOLDEN: a class prompt stored by one release, or an NPZ handle kept
# in a config file, is found by the next only while these recipes stay as they are.
GOLDEN_RECIPES = {
    "text": "ca93ac919a75bf7a9c8165c3ab224925dc450bdb1a9fcc688adf3bdef028cf31",
    "pe": "aec56df3f0688d162301e1ad59a209bb0fe366fad7c7da431946cf109ca0af2f",
    "vocabulary": "91fe94c0f3c7f30a44dfd463e4c42f5aaba6a0433267a8139faf25aee16688ac",
}
GOLDEN_HANDLE = "npz:98afd667403fe63a1da4b494196ec0c188e31f4d11009cad8a341664be625111"
GOLDEN_NPZ_KEY = "cfcc0e761fc96cb19a05aadc7e2742e6ee84ec0f7a483cfdf01c4d75efe387e1"


def test_class_prompt_keys_and_npz_handles_are_pinned(store, tmp_path):
    keys = Recipes(store, "encoder-fp", "detector-fp")
    assert keys.text("forklift").hex() == GOLDEN_RECIPES["text"]
    assert keys.pe("forklift").hex() == GOLDEN_RECIPES["pe"]
    assert keys.vocabulary(["forklift", "pallet"]).hex() == GOLDEN_RECIPES["vocabulary"]
    emb = np.arange(1024, dtype=np.float32).reshape(1, 2, 512) / 1024  # names "a", "b"; model yoloe-11s
    assert import_npz(yoloe(), _npz(tmp_path / "ab.npz", embeddings=emb), store=store).source == GOLDEN_HANDLE
    assert [i.key.hex() for i in store.ls()] == [GOLDEN_NPZ_KEY]


class UsersEncoder:
    """A user's own TextEncoder (the protocol asks for no ``batch``): the real open_clip tower behind it,
    the size of each ``encode`` call kept, Ctrl-C (KeyboardInterrupt) at the call ``interrupt_at``."""

    def __init__(self, inner, interrupt_at: int | None = None) -> None:
        self.inner, self.interrupt_at, self.calls = inner, interrupt_at, []

    fingerprint = property(lambda self: self.inner.fingerprint)
    dim = property(lambda self: self.inner.dim)
    loaded = property(lambda self: self.inner.loaded)

    def encode(self, texts):
        self.calls.append(len(texts))
        if len(self.calls) == self.interrupt_at:
            raise KeyboardInterrupt
        return self.inner.encode(texts)


def test_an_interrupted_set_classes_keeps_each_finished_chunk_of_twice_the_batch(encoder, store):
    """Issue #13 in this process: names are encoded and stored in chunks of 2 x the encoder's batch (of
    2 x 64 for an encoder without one), each text feature with its share of its chunk's seconds, so
    Ctrl-C keeps every finished chunk and a rerun encodes only the rest. A name's detector-ready
    embedding then costs its encoding plus the head's mapping."""
    names = lvis_names(138)
    interrupted = UsersEncoder(encoder, interrupt_at=3)
    with pytest.raises(KeyboardInterrupt):
        set_classes(yoloe(), names[:24], store=store, encoder=interrupted, batch=2)
    assert interrupted.calls == [4, 4, 4] and len(store.ls(kind="vision.text")) == 8
    no_batch = UsersEncoder(encoder, interrupt_at=2)  # no batch attribute
    spent_before = sum(i.cost_s for i in store.ls(kind="vision.text"))
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        set_classes(yoloe(), names, store=store, encoder=no_batch)
    took = time.perf_counter() - t0
    # the first chunk also re-encodes one stored name (the partial hit's check)
    assert no_batch.calls == [129, 2] and len(store.ls(kind="vision.text")) == 136
    assert 0 < sum(i.cost_s for i in store.ls(kind="vision.text")) - spent_before <= took
    model = yoloe()
    r = set_classes(model, names, store=store, encoder=UsersEncoder(encoder))
    assert (r.text_hits, r.misses) == (136, 2)
    keys = Recipes(store, encoder.fingerprint, detector_fingerprint(model))
    for name in names[-2:]:  # encoded by this call
        assert store.get(keys.pe(name)).cost_s >= store.get(keys.text(name)).cost_s > 0


def test_class_prompt_bundle_moves_to_a_new_folder(encoder, store, tmp_path):
    set_classes(yoloe(), WAREHOUSE, store=store, encoder=encoder)
    assert store.export_bundle(tmp_path / "classes.psb", kind="vision.pe") == 8
    with PromptStore(tmp_path / "new") as new:
        assert new.import_bundle(tmp_path / "classes.psb") == 8
        r = set_classes(yoloe(), WAREHOUSE, store=new, encoder=OpenCLIPTextEncoder("MobileCLIP2-B"))
        assert (r.hits, r.misses, r.encoder_loaded) == (8, 0, False)


@pytest.mark.parametrize("names", [[], ["a", "a"], ["ok", 3], [" "], [""], "forklift", ["x", None]])
def test_bad_names_store_nothing_and_leave_the_model_alone(encoder, store, names):
    model = yoloe()
    set_classes(model, ["person"], store=store, encoder=encoder)
    before_names, before_pe, before_entries = dict(model.model.names), model.model.pe.clone(), len(store.ls())
    with pytest.raises(InvalidInputError):
        set_classes(model, names, store=store, encoder=encoder)
    assert model.model.names == before_names and torch.equal(model.model.pe, before_pe)
    assert len(store.ls()) == before_entries


def _npz(path, **overrides):
    data = {"embeddings": np.random.default_rng(0).standard_normal((1, 2, 512)).astype(np.float32),
            "names": np.asarray(["a", "b"], dtype=np.str_), "model": np.asarray("yoloe-11s", dtype=np.str_)}
    data.update(overrides)
    np.savez(path, **{k: v for k, v in data.items() if v is not None})
    return path


@pytest.mark.parametrize(
    "bad",
    [
        {"embeddings": np.full((1, 2, 512), np.nan, np.float32)},
        {"embeddings": np.zeros((1, 2, 256), np.float32)},
        {"embeddings": np.zeros((1, 2, 512), np.float64)},
        {"model": np.asarray("yoloe-26l", dtype=np.str_)},
        {"extra": np.zeros(1)},
        {"names": None},
        {"names": np.asarray(["a", "a"], dtype=np.str_)},
        {"names": np.asarray([{"pickled": True}, 2], dtype=object)},
    ],
)
def test_bad_npz_is_refused_and_changes_nothing(store, tmp_path, bad):
    model = yoloe()
    before = dict(model.model.names)
    path = _npz(tmp_path / "bad.npz", **bad)
    with pytest.raises(InvalidInputError):
        import_npz(model, path, store=store)
    assert model.model.names == before and store.ls() == []


def test_npz_parser_failures_are_typed_errors(store, tmp_path):
    """Found by test_fuzz_npz_import: numpy's .npy header parser raises tokenize.TokenError."""
    path = _npz(tmp_path / "f.npz")
    raw = bytearray(path.read_bytes())
    raw[82] = 91
    path.write_bytes(raw)
    with pytest.raises(InvalidInputError):
        import_npz(yoloe(), path, store=store)
    header = io.BytesIO()  # a header promising 2 TiB: refused at once, nothing allocated
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (1, 2**30, 512)})
    with zipfile.ZipFile(tmp_path / "huge.npz", "w") as z, np.load(_npz(tmp_path / "ok.npz")) as ok:
        z.writestr("embeddings.npy", header.getvalue() + bytes(64))
        for name in ("names", "model"):
            member = io.BytesIO()
            np.save(member, ok[name])
            z.writestr(f"{name}.npy", member.getvalue())
    with pytest.raises(InvalidInputError):
        import_npz(yoloe(), tmp_path / "huge.npz", store=store)
    with zipfile.ZipFile(tmp_path / "bz2.npz", "w", compression=zipfile.ZIP_BZIP2) as z, zipfile.ZipFile(tmp_path / "ok.npz") as ok:
        for name in ok.namelist():
            z.writestr(name, ok.read(name))
    with pytest.raises(InvalidInputError, match="stored or deflated"):
        import_npz(yoloe(), tmp_path / "bz2.npz", store=store)
    assert store.ls() == []


def test_not_an_npz_at_all(store, tmp_path):
    (tmp_path / "junk.npz").write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(InvalidInputError):
        import_npz(yoloe(), tmp_path / "junk.npz", store=store)


def test_ultralytics_encoder_says_where_its_file_goes(tmp_path):
    enc = UltralyticsTextEncoder("mobileclip:blt")
    assert enc.fingerprint.startswith("ultralytics:mobileclip:blt:published:mobileclip_blt.ts:ambient:") and not enc.loaded
    with pytest.raises(ModelUnavailableError, match="weights folder"):
        enc.encode(["forklift"])
    with pytest.raises(InvalidInputError):
        UltralyticsTextEncoder("clip:ViT-B/32")


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_ultralytics_encoder_runs_a_torchscript_file(tmp_path, encoder):
    """A TorchScript text encoder built here from the open_clip tower stands in for mobileclip_blt.ts."""
    enc = UltralyticsTextEncoder("mobileclip:blt", weights=stand_in_text_model(encoder, tmp_path / "mobileclip_blt.ts"))
    assert enc.fingerprint.startswith("ultralytics:mobileclip:blt:file:")
    feats = enc.encode(["forklift", "pallet", "hard hat"])
    assert feats.shape == (3, 512) and np.abs(feats - encoder.encode(["forklift", "pallet", "hard hat"])).max() <= 1e-5


def test_yoloworld_gets_raw_text_features(store):
    from ultralytics import YOLOWorld

    torch.manual_seed(0)
    model = YOLOWorld("yolov8s-worldv2.yaml")
    enc = OpenCLIPTextEncoder("ViT-B-32", seed=0)
    report = set_classes(model, WAREHOUSE[:3], store=store, encoder=enc)
    assert report.misses == 3
    assert np.abs(model.model.txt_feats[0].numpy() - enc.encode(WAREHOUSE[:3])).max() <= 1e-5
    assert model.model.model[-1].nc == 3
    assert len(model.predict(str(ASSETS / "bus.jpg"), verbose=False)) == 1


def test_visual_prompts_are_computed_once(store):
    prompts = {"bboxes": np.array([[221.5, 405.8, 344.9, 857.5]]), "cls": np.array([0])}
    model = yoloe()
    first = visual_pe(model, ASSETS / "bus.jpg", prompts, store=store)
    assert not first.hit and first.classes == 1
    vpe = model.model.pe.clone()
    # ultralytics' own path gives the same embedding
    reference = yoloe()
    reference.predict(str(ASSETS / "bus.jpg"), visual_prompts=prompts, refer_image=str(ASSETS / "bus.jpg"), verbose=False)
    assert (reference.model.pe - vpe).abs().max().item() <= 1e-5
    again = yoloe()
    second = visual_pe(again, ASSETS / "bus.jpg", prompts, store=store)
    assert second.hit and torch.equal(again.model.pe, vpe)
    assert len(again.predict(str(ASSETS / "zidane.jpg"), verbose=False)) == 1
    moved = {"bboxes": prompts["bboxes"] + 1.0, "cls": prompts["cls"]}
    assert not visual_pe(again, ASSETS / "bus.jpg", moved, store=store).hit


def test_visual_prompts_through_a_model_that_draws_random_numbers_are_computed_every_call_and_not_stored(store):
    """A hook adding noise to the visual-prompt head: each call is ultralytics' own draw (its first one was stored
    and served to every later seed)."""
    from promptstore.errors import PromptStoreWarning

    prompts = {"bboxes": np.array([[221.5, 405.8, 344.9, 857.5]]), "cls": np.array([0])}
    model = yoloe()
    model.model.model[-1].savpe.register_forward_hook(lambda m, args, out: out + 0.1 * torch.randn_like(out))
    seen = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        with pytest.warns(PromptStoreWarning, match="drew random numbers"):
            assert not visual_pe(model, ASSETS / "bus.jpg", prompts, store=store).hit
        seen.append(model.model.pe.clone())
    assert (seen[0] - seen[1]).abs().max().item() > 1e-3
    assert store.ls() == []


def test_a_second_identical_visual_prompt_on_the_same_model_hits(store):
    """ultralytics' predictor fuses Conv+BN in place on the first call: the key names the fused model."""
    prompts = {"bboxes": np.array([[221.5, 405.8, 344.9, 857.5]]), "cls": np.array([0])}
    model = yoloe()
    assert not visual_pe(model, ASSETS / "bus.jpg", prompts, store=store).hit
    assert visual_pe(model, ASSETS / "bus.jpg", prompts, store=store).hit


def test_grayscale_and_pil_reference_images_equal_ultralytics_own_path(store):
    """What ultralytics accepts is accepted: a 2-D grayscale array; and a PIL image (read as RGB) is
    another input than the array of its bytes (read as BGR)."""
    from PIL import Image

    prompts = {"bboxes": np.array([[221.5, 405.8, 344.9, 857.5]]), "cls": np.array([0])}
    rgb = np.asarray(Image.open(ASSETS / "bus.jpg").convert("RGB"))
    gray = np.ascontiguousarray(rgb[..., 0])
    for image in (gray, Image.fromarray(rgb), rgb):
        model = yoloe()
        assert not visual_pe(model, image, prompts, store=store).hit
        reference = yoloe()
        reference.predict(rgb, visual_prompts=prompts, refer_image=image, verbose=False)
        assert (reference.model.pe - model.model.pe).abs().max().item() <= 1e-5


@pytest.mark.parametrize("prompts", [{}, {"bboxes": np.zeros((1, 3)), "cls": np.array([0])},
                                     {"bboxes": np.zeros((2, 4)), "cls": np.array([0])},
                                     {"bboxes": np.array([[0, 0, np.nan, 1]]), "cls": np.array([0])}])
def test_bad_visual_prompts(store, prompts):
    with pytest.raises(InvalidInputError):
        visual_pe(yoloe(), ASSETS / "bus.jpg", prompts, store=store)
    assert store.ls() == []


def test_warm_classes_cli(tmp_path):
    names = tmp_path / "names.txt"
    names.write_text("\n".join(WAREHOUSE) + "\n")
    exe = Path(sys.executable).parent / "promptstore"
    cmd = [str(exe), "--dir", str(tmp_path / "s"), "--json", "warm-classes", str(names), "--encoder", "open_clip:MobileCLIP2-B"]
    first = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    assert (first["encoded"], first["already_stored"]) == (8, 0)
    second = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    assert (second["encoded"], second["already_stored"]) == (0, 8)
    with_detector = subprocess.run([*cmd, "--detector", "yoloe-11s-seg.yaml"], capture_output=True, text=True, check=True)
    assert json.loads(with_detector.stdout)["encoded"] == 0  # text features were already there
    bad = subprocess.run([str(exe), "--dir", str(tmp_path / "s"), "warm-classes", str(names), "--encoder", "nope"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "encoder is" in bad.stderr


_npz_values = st.one_of(
    hnp.arrays(st.sampled_from([np.float32, np.float64, np.float16, np.int64, np.uint8, np.bool_]),
               hnp.array_shapes(min_dims=0, max_dims=3, max_side=4)),
    hnp.arrays(np.float32, st.tuples(st.integers(0, 2), st.integers(0, 3), st.sampled_from([512, 511])),
               elements=st.floats(-2, 2, width=32) | st.sampled_from([np.nan, np.inf])),
    st.lists(st.text(max_size=6), max_size=4).map(lambda xs: np.asarray(xs, dtype=np.str_)),
    st.text(max_size=12).map(lambda x: np.asarray(x, dtype=np.str_)),
    st.none(),
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(overrides=st.just({}) | st.dictionaries(st.sampled_from(["embeddings", "names", "model", "extra"]), _npz_values, max_size=3),
       flip=st.none() | st.tuples(st.integers(0, 4000), st.integers(0, 255)))
def test_fuzz_npz_import(tmp_path_factory, overrides, flip):
    """Any NPZ (a valid one with fields replaced or a byte changed) either imports exactly or is a typed error changing nothing."""
    d = tmp_path_factory.mktemp("npz")
    path = _npz(d / "f.npz", **overrides)
    if flip is not None:
        raw = bytearray(path.read_bytes())
        raw[flip[0] % len(raw)] = flip[1]
        path.write_bytes(raw)
    model = yoloe()
    before = dict(model.model.names)
    with PromptStore(d / "s") as store:
        try:
            import_npz(model, path, store=store)
        except InvalidInputError:
            event("refused")
            assert model.model.names == before and store.ls() == []
        else:
            event("imported")
            with np.load(path, allow_pickle=False) as f:
                names, emb = f["names"].tolist(), f["embeddings"]
            assert list(model.model.names.values()) == names
            assert torch.equal(model.model.pe.cpu(), torch.from_numpy(emb.astype(np.float32)).reshape(model.model.pe.shape))


def test_an_interrupted_warm_classes_keeps_finished_batches_and_resumes(tmp_path):
    """Issue #13: Ctrl-C threw away every name already encoded. Now: one line, exit 130, and a rerun continues."""
    names = tmp_path / "names.txt"
    names.write_text("\n".join(lvis_names(40)))
    store = tmp_path / "store"
    code = f"""
        import sys
        import promptstore.vision._cli as vcli
        from promptstore.cli import main
        real = vcli.parse_encoder

        def interrupting(spec, seed):
            enc = real(spec, seed)
            calls = []
            encode = enc.encode
            def encode_then_stop(texts):
                calls.append(1)
                if len(calls) == 3:
                    raise KeyboardInterrupt  # what Ctrl-C raises
                return encode(texts)
            enc.encode = encode_then_stop
            return enc

        vcli.parse_encoder = interrupting
        sys.exit(main(["warm-classes", {str(names)!r}, "--encoder", "open_clip:ViT-S-16-alt", "--batch", "4",
                       "--dir", {str(store)!r}]))
    """
    proc = run_python(code, check=False)
    assert proc.returncode == 130, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("promptstore: interrupted") and "Traceback" not in proc.stderr
    assert any(line.startswith("promptstore: warning:") and "random weights" in line for line in lines)
    with PromptStore(store) as s:
        assert len(s.ls(kind="vision.text")) == 16  # two finished chunks of 2 x batch
    again = subprocess.run([sys.executable, "-m", "promptstore.cli", "warm-classes", str(names), "--encoder",
                            "open_clip:ViT-S-16-alt", "--batch", "4", "--dir", str(store), "--json"],
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["encoded"] == 24


def _traced_text_tower(path, seed: int) -> None:
    """A small TorchScript text tower with the interface of ultralytics' MobileCLIP .ts files
    ((n, 77) token ids in, (n, 512) features out), saved to ``path``."""
    torch.manual_seed(seed)
    tower = torch.nn.Sequential(torch.nn.Embedding(49408, 8), torch.nn.Flatten(), torch.nn.Linear(8 * 77, 512)).eval()
    torch.jit.save(torch.jit.trace(tower, torch.zeros(2, 77, dtype=torch.long)), str(path))


def test_an_encoder_is_keyed_by_the_weights_file_bytes_it_loaded(tmp_path):
    """A weights file replaced between construction and the first build, or after the build: the
    features are stored under the digest of the bytes loaded, and a replaced file is loaded again."""
    a, b, path = tmp_path / "a.ts", tmp_path / "b.ts", tmp_path / "mobileclip_blt.ts"
    _traced_text_tower(a, 1)
    _traced_text_tower(b, 2)
    path.write_bytes(a.read_bytes())
    encoder = UltralyticsTextEncoder("mobileclip:blt", weights=path)
    as_a = encoder.fingerprint
    path.write_bytes(b.read_bytes())  # replaced before the first build
    feats = encoder.encode(["a forklift"])
    fresh_b = UltralyticsTextEncoder("mobileclip:blt", weights=b)
    assert encoder.fingerprint == fresh_b.fingerprint != as_a
    assert np.array_equal(feats, fresh_b.encode(["a forklift"]))
    path.write_bytes(a.read_bytes())  # replaced after the build: built again from it
    fresh_a = UltralyticsTextEncoder("mobileclip:blt", weights=a)
    assert encoder.fingerprint == fresh_a.fingerprint
    assert np.array_equal(encoder.encode(["a forklift"]), fresh_a.encode(["a forklift"]))
