"""set_classes from the store, and ultralytics' prompt-embedding NPZ files both ways.

Two levels of entries per class name:
  ``vision.text``  the encoder's raw text feature, keyed by the encoder fingerprint + the name;
  ``vision.pe``    the detector-ready embedding, keyed additionally by the detector head that
                   maps text features to it (YOLOE's RepRTA weights).
and one ``vision.peset`` entry per vocabulary (the ordered names), so a vocabulary seen
before comes back in one read however many names it has.
"""

from __future__ import annotations

import os
import time
import unicodedata
import zipfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
from tqdm import tqdm

from promptstore import PromptStore, make_key
from promptstore._live import Generators
from promptstore.errors import InvalidInputError, ModelUnavailableError, PromptStoreError

from ._encoders import TextEncoder, UltralyticsTextEncoder
from ._verify import Refuted, check_draws, check_feature, warn_refuted

__all__ = ["set_classes", "export_npz", "import_npz", "ClassesReport", "detector_fingerprint", "vocabulary_payload",
           "TEXT_KIND", "PE_KIND", "SET_KIND", "NPZ_KIND"]

TEXT_KIND, PE_KIND, SET_KIND, NPZ_KIND = "vision.text", "vision.pe", "vision.peset", "vision.npz"
NPZ_KEYS = {"embeddings", "names", "model"}


@dataclass(frozen=True)
class ClassesReport:
    """What set_classes did."""

    names: int
    hits: int  #: names whose detector-ready embedding came from the store
    text_hits: int  #: names whose raw text feature came from the store (the head ran, not the encoder)
    misses: int  #: names the text encoder ran for
    seconds: float
    encoder_loaded: bool  #: whether the text encoder was built (never on a full hit)
    from_set: bool  #: the whole vocabulary came from one stored entry
    #: the imported NPZ the embeddings came from (``"npz:"`` + a digest of its content): what
    #: ``import_npz`` returns, to pass as ``set_classes(..., source=...)``; None for text prompts
    source: str | None = None


def _visible(ch: str) -> bool:
    return unicodedata.category(ch)[0] not in "ZC"  # not a separator, control, format or surrogate


def check_names(names: Any) -> list[str]:
    """Validate class names before anything is stored or changed.

    A class name is a string of valid Unicode (no lone surrogates) without control characters
    (tabs, newlines, NUL...: tokenizers fold or drop them, so two different names would
    share one embedding), holding at least one visible character (not only spaces or
    zero-width characters). Names are distinct.

    Raises:
        InvalidInputError: anything else, naming the first offending name.
    """
    if isinstance(names, (str, bytes)) or not isinstance(names, Sequence):
        raise InvalidInputError(f"class names must be a list of strings, got {type(names).__name__}")
    names = list(names)
    if not names:
        raise InvalidInputError("class names must not be empty")
    for n in names:
        if not isinstance(n, str):
            raise InvalidInputError(f"class names must be strings, got {n!r}")
        try:
            n.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidInputError(f"class name {n!r} is not valid Unicode (a lone surrogate)") from None
        if any(unicodedata.category(ch) == "Cc" for ch in n):
            raise InvalidInputError(f"class name {n!r} holds a control character")
        if not any(_visible(ch) for ch in n):
            raise InvalidInputError(f"class names must hold a visible character, got {n!r} (ultralytics reserves ' ')")
    counts = Counter(names)
    if len(counts) != len(names):
        raise InvalidInputError(f"duplicate class names: {sorted(n for n, c in counts.items() if c > 1)[:20]}")
    return cast("list[str]", names)  # each checked to be a str above


def vocabulary_payload(names: Sequence[str]) -> bytes:
    """An ordered vocabulary as key payload: each name length-prefixed, never joined by a separator."""
    out = bytearray(len(names).to_bytes(8, "little"))
    for n in names:
        data = n.encode("utf-8")
        out += len(data).to_bytes(8, "little") + data
    return bytes(out)


def _names_from_payload(data: bytes) -> list[str] | None:
    """The inverse of :func:`vocabulary_payload`; None for bytes it did not make."""
    if len(data) < 8:
        return None
    count, pos, names = int.from_bytes(data[:8], "little"), 8, []
    for _ in range(count):
        if pos + 8 > len(data):
            return None
        size = int.from_bytes(data[pos : pos + 8], "little")
        pos += 8
        if pos + size > len(data):
            return None
        try:
            names.append(data[pos : pos + size].decode("utf-8"))
        except UnicodeDecodeError:
            return None
        pos += size
    return names if pos == len(data) else None


def npz_source(model_id: str, names: Sequence[str], embeddings: np.ndarray) -> str:
    """The handle of an NPZ's content: ``"npz:"`` + the key digest of its model id, names and embeddings.

    The same file, or any NPZ holding the same model id, names (in order) and float32 values, has
    the same handle on every machine and in every namespace; anything else has another.
    """
    emb = np.ascontiguousarray(embeddings, dtype="<f4")
    digest = make_key(NPZ_KIND, vocabulary_payload(names) + emb.tobytes(),
                      fingerprints=[f"model={model_id}", f"float32{list(emb.shape)}"])
    return "npz:" + digest.hex()


def _source_key(store: PromptStore, source: Any) -> bytes:
    if not (isinstance(source, str) and len(source) == 68 and source.startswith("npz:")
            and all(c in "0123456789abcdef" for c in source[4:])):
        raise InvalidInputError(f"source must be the handle import_npz returned (report.source, 'npz:' + 64 hex "
                                f"characters), got {source!r}")
    return store.key(NPZ_KIND, bytes.fromhex(source[4:]))


def _read_source(store: PromptStore, source: str, wrapper: Any, dim: int) -> tuple[list[str], np.ndarray]:
    """An imported NPZ's (names, (n, dim) embeddings), checked against its handle and this model.

    Raises:
        InvalidInputError: a malformed handle, an NPZ made for another model id or embedding width.
        ModelUnavailableError: the NPZ is not in this store (never imported here, or evicted).
    """
    entry = store.get(_source_key(store, source), kind=NPZ_KIND)
    names = pe = None
    model_id = entry.meta.get("model") if entry is not None else None
    if entry is not None and model_id is not None and entry.dtypes.get("names") == "U8" and entry.dtypes.get("pe") == "F32":
        names = _names_from_payload(entry.tensors["names"].tobytes())
        pe = entry.tensors["pe"]
    # Content-addressed: what the entry holds must be what the handle names, or it is no hit.
    if names is None or pe is None or pe.ndim != 2 or pe.shape[0] != len(names) \
            or npz_source(str(model_id), names, pe[None]) != source:
        raise ModelUnavailableError(f"the NPZ {source} is not in this store (namespace {store.namespace!r}): "
                                    "import_npz(model, 'its file.npz', store=store) puts it there")
    if model_id != _model_id(wrapper):
        raise InvalidInputError(f"the NPZ {source} was made for {model_id!r}, this model is {_model_id(wrapper)!r}")
    if pe.shape[1] != dim:
        raise InvalidInputError(f"the NPZ {source} holds {pe.shape[1]}-d embeddings, this detector takes {dim}-d ones")
    return names, pe


def _unwrap(model: Any) -> tuple[Any, Any, str]:
    """(ultralytics wrapper or None, the detection model, "yoloe" | "world")."""
    from ultralytics.nn.tasks import WorldModel, YOLOEModel

    for wrapper, inner in ((None, model), (model, getattr(model, "model", None))):
        if isinstance(inner, YOLOEModel):
            return wrapper, inner, "yoloe"
        if isinstance(inner, WorldModel):
            return wrapper, inner, "world"
    raise InvalidInputError(f"expected an ultralytics YOLOE or YOLOWorld model, got {type(model).__name__}")


class Recipes:
    """The keys of one (store, encoder, detector): every vision key is made here."""

    def __init__(self, store: PromptStore, encoder_fp: str, detector_fp: str | None = None) -> None:
        self.store, self.efp, self.dfp = store, encoder_fp, detector_fp

    def text(self, name: str) -> bytes:
        """A name's raw text feature: bound to the encoder only."""
        return self.store.key(TEXT_KIND, name, fingerprints=[self.efp])

    def pe(self, name: str) -> bytes:
        """A name's detector-ready embedding: bound to the encoder and the head."""
        return self.store.key(PE_KIND, name, fingerprints=[self.efp, str(self.dfp)])

    def vocabulary(self, names: Sequence[str]) -> bytes:
        """An ordered vocabulary's embeddings, in one entry."""
        return self.store.key(SET_KIND, vocabulary_payload(names), fingerprints=[self.efp, str(self.dfp)])


def describe_ahead(fingerprint: Callable[[], str]) -> None:
    """Name a served model once as it is set up, so that its first call only re-checks the description.

    A model's first fingerprint in a process imports the live-identity modules and describes every
    module on the path (about 15 ms for CLIP's text tower); later ones re-check the reads that
    description rests on and digest the weights, as they would anyway. Like a model's warm-up
    forward, that first description is a cost of setting up, not of the first call. The weights are
    still digested on every call, so an edit made after set-up is seen.
    """
    try:
        fingerprint()
    except PromptStoreError:
        pass  # a model that cannot be named is refused, typed, by the call that needs the name


def encode_and_store(encoder: TextEncoder, names: list[str], recipes: Recipes,
                     probe: tuple[str, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Encode ``names`` in chunks, storing each chunk's text features as soon as it is done.

    An interrupted run (Ctrl-C, a crash) keeps every finished chunk, so running it again
    encodes only the rest. ``probe`` (a stored name and its stored feature) is encoded again
    in the first chunk and compared before anything is stored (see _verify.py).

    Returns:
        ``(features, seconds per name)``, in the order of ``names``.

    Raises:
        Refuted: the probe's feature differs from what the encoder computes now; :class:`Drew`: the encoder
            drew random numbers (the generators are put back as they stood before it first ran).
    """
    feats = np.empty((len(names), encoder.dim), np.float32)
    cost = np.zeros(len(names))
    before = Generators()
    chunk = max(2 * int(getattr(encoder, "batch", 64)), 1)  # the encoder's own bar stays off at this size
    bar = tqdm(total=len(names), desc="promptstore: encoding class names", unit="name", leave=False,
               disable=None if len(names) > chunk else True)
    for lo in range(0, len(names), chunk):
        part = names[lo : lo + chunk]
        checked = probe is not None and lo == 0
        t0 = time.perf_counter()
        out = encoder.encode([probe[0], *part] if checked and probe is not None else part)
        each = (time.perf_counter() - t0) / (len(part) + checked)
        try:
            check_draws(before, "the text encoder")
        except Refuted:
            bar.close()
            raise
        if checked:
            assert probe is not None
            check_feature(probe[0], probe[1], out[0])
            out = out[1:]
        for j, name in enumerate(part):
            recipes.store.put(recipes.text(name), {"text": out[j]}, kind=TEXT_KIND, cost_s=each,
                              meta={"name": name, "encoder": recipes.efp})
        feats[lo : lo + len(part)], cost[lo : lo + len(part)] = out, each
        bar.update(len(part))
    bar.close()
    return feats, cost


def _head_width(inner: Any, kind: str) -> int:
    """The text-feature width the detector's head takes.

    Raises:
        InvalidInputError: a head whose classes cannot be set from text (prompt-free, fused).
    """
    head = inner.model[-1]
    if kind == "world":
        return int(head.cv3[0][-1].out_channels)
    if hasattr(head, "lrpc"):
        raise InvalidInputError("this is a prompt-free YOLOE model (its vocabulary is built in); use a text/visual "
                                "prompt model such as yoloe-11s-seg")
    if getattr(head, "is_fused", False):
        raise InvalidInputError("this YOLOE model's class embeddings are fused into its head; set classes on an "
                                "unfused model")
    return int(head.embed)


def check_target(model: Any, encoder: TextEncoder | None) -> tuple[Any, Any, str, int]:
    """(wrapper, detection model, kind, embedding width), after every check that can fail.

    Raises:
        InvalidInputError: not a YOLOE/YOLOWorld model, a prompt-free or fused head, or an
            encoder whose feature width the head does not take.
    """
    wrapper, inner, kind = _unwrap(model)
    width = _head_width(inner, kind)
    if encoder is not None and encoder.dim != width:
        raise InvalidInputError(f"the encoder gives {encoder.dim}-d text features but this detector's head takes "
                                f"{width}-d ones; use the encoder the detector was trained with")
    return wrapper, inner, kind, width


def detector_fingerprint(model: Any) -> str:
    """What maps text features to this detector's class embeddings.

    YOLOE: ``head.get_tpe`` as it runs now (:mod:`promptstore._live`: RepRTA's weights, the
    head's settings and hooks, the live code). YOLOWorld uses the raw text features.

    Raises:
        UnsupportedModelError: RepRTA in training mode with dropout, or state that cannot be named.
    """
    _, inner, kind = _unwrap(model)
    if kind == "world":
        return "yoloworld:raw-text-features"
    from promptstore._live import ambient_identity, module_identity

    head = inner.model[-1]
    # get_tpe as it runs now: the head's settings and hooks, the code get_tpe reaches (RepRTA,
    # then normalisation) and RepRTA's every tensor; the head's detection branches never see text.
    others = tuple(name for name in head._modules if name != "reprta")
    # nc is the vocabulary's size, set by set_classes itself; get_tpe never reads it.
    live = module_identity(head, entries=("get_tpe",), skip=others, ignore=("nc",), what="the YOLOE head")
    return f"yoloe-head:{type(head).__name__}:{head.embed}:{live}:{ambient_identity()}"


def default_encoder(model: Any) -> TextEncoder:
    """The model's own text encoder (YOLOE's ``text_model``), through UltralyticsTextEncoder."""
    _, inner, kind = _unwrap(model)
    variant = getattr(inner, "text_model", None) if kind == "yoloe" else None
    if variant not in ("mobileclip:blt", "mobileclip2:b"):
        raise InvalidInputError(
            f"no offline encoder for this model's text model {variant or 'clip:ViT-B/32'!r}; pass encoder=, e.g. "
            "OpenCLIPTextEncoder('ViT-B-32', pretrained=PATH)"
        )
    return UltralyticsTextEncoder(variant)


def _apply(model: Any, names: Sequence[str], pe: np.ndarray) -> None:
    import torch

    wrapper, inner, kind = _unwrap(model)
    param = next(inner.parameters())
    # A private, writable copy: stored arrays are read-only views of the cache.
    tensor = torch.from_numpy(np.array(pe, dtype=np.float32, copy=True))[None].to(param.device, param.dtype)
    if kind == "yoloe":
        if wrapper is not None:
            wrapper.set_classes(names, tensor)
            wrapper.predictor = None
        else:
            inner.set_classes(names, tensor)
        return
    # YOLOWorld: what WorldModel.set_classes and YOLOWorld.set_classes do, with our features.
    inner.txt_feats = tensor
    inner.model[-1].nc = len(names)
    inner.names = dict(enumerate(names))
    if wrapper is not None:
        wrapper.predictor = None


def set_classes(model: Any, names: Sequence[str], store: PromptStore | None = None,
                encoder: TextEncoder | None = None, batch: int | None = None, *,
                source: str | None = None) -> ClassesReport:
    """Give a YOLOE (or YOLOWorld) model its classes, computing only what the store lacks.

    Looks the vocabulary up as a whole, then each name's detector-ready embedding, then its
    raw text feature; encodes only the names missing at both levels (sorted by length, in
    batches), maps them with the model's own head, stores everything, and calls the model's
    ``set_classes(names, embeddings)``. A full hit never builds the text encoder.

    The names are text for the encoder: an imported NPZ is never used here unless asked for
    with ``source``, since its names are only labels (``object0`` for a visual prompt, a
    renamed class), whatever they spell.

    Args:
        model: ``ultralytics.YOLOE`` / ``YOLOWorld``, or their inner detection model.
        names: class names, distinct and non-blank.
        store: default ``PromptStore()``.
        encoder: default: the model's own text model through :class:`UltralyticsTextEncoder`
            (its ``.ts`` file must be on disk if anything has to be encoded).
        batch: texts per encoder pass.
        source: the handle of an NPZ imported into this store (``import_npz(...).source``):
            take these names' embeddings from it, by its names, in the order given (any
            subset of them), as ``load_prompt_embeddings`` would apply them; nothing is
            encoded. Needs an ``ultralytics.YOLOE`` of the NPZ's model id.

    Returns:
        A :class:`ClassesReport`.

    Raises:
        InvalidInputError: bad names or model; with ``source``: a malformed handle, a name the
            NPZ does not hold, another model id. Nothing is stored and the model is unchanged.
        ModelUnavailableError: something had to be encoded and the encoder's weights are
            missing; or the ``source`` NPZ is not in this store (import it again).
    """
    import torch

    t0 = time.perf_counter()
    names = check_names(names)
    if batch is not None and (not isinstance(batch, int) or isinstance(batch, bool) or batch <= 0):
        raise InvalidInputError(f"batch must be a positive int, got {batch!r}")
    if source is not None:
        return _classes_from_source(model, names, store, source, t0, encoder)
    encoder = encoder if encoder is not None else default_encoder(model)
    wrapper, inner, kind, dim = check_target(model, encoder)  # everything that can fail, before any store work
    store = store if store is not None else PromptStore()
    if batch is not None:
        encoder.batch = batch  # type: ignore[attr-defined]
    keys = Recipes(store, encoder.fingerprint, detector_fingerprint(model))
    set_key = keys.vocabulary(names)
    whole = store.get(set_key, kind=SET_KIND)
    if whole is not None and whole.tensors.get("pe", np.empty(0)).shape == (len(names), dim):
        _apply(model, names, whole.tensors["pe"])
        return ClassesReport(len(names), len(names), 0, 0, time.perf_counter() - t0, encoder.loaded, True)

    pe = np.empty((len(names), dim), np.float32)
    cost = np.zeros(len(names))
    need_pe = []
    for i, name in enumerate(names):
        e = store.get(keys.pe(name), kind=PE_KIND)
        if e is not None and e.tensors.get("pe", np.empty(0)).shape == (dim,):
            pe[i], cost[i] = e.tensors["pe"], e.cost_s
        else:
            need_pe.append(i)
    text = np.empty((len(names), encoder.dim), np.float32)
    need_text = []
    for i in need_pe:
        e = store.get(keys.text(names[i]), kind=TEXT_KIND)
        if e is not None and e.tensors.get("text", np.empty(0)).shape == (encoder.dim,):
            text[i], cost[i] = e.tensors["text"], e.cost_s
        else:
            need_text.append(i)
    # The encoder and the head run anyway: each also recomputes one stored entry, and a stored
    # entry that differs from what they compute now is never served (see _verify.py).
    hits = [i for i in range(len(names)) if i not in set(need_pe)]
    before = Generators()
    try:
        if need_text:
            probe = _stored_text(names, [i for i in need_pe if i not in set(need_text)], text, hits, keys, encoder.dim)
            feats, each = encode_and_store(encoder, [names[i] for i in need_text], keys, probe=probe)
            text[need_text], cost[need_text] = feats, each
        mapped, probe_pe = None, None
        if need_pe:
            t1 = time.perf_counter()
            if kind == "yoloe":
                probe_pe = next(((i, e.tensors["text"]) for i in hits[:1]
                                 for e in [store.get(keys.text(names[i]), kind=TEXT_KIND)]
                                 if e is not None and e.tensors.get("text", np.empty(0)).shape == (encoder.dim,)), None)
                rows = text[need_pe] if probe_pe is None else np.concatenate([text[need_pe], probe_pe[1][None]])
                param = next(inner.parameters())
                with torch.inference_mode():
                    x = torch.from_numpy(np.ascontiguousarray(rows, np.float32))[None].to(param.device, param.dtype)
                    mapped = inner.model[-1].get_tpe(x)[0].float().cpu().numpy()
                check_draws(before, "the detector's text head")
                if probe_pe is not None:
                    check_feature(names[probe_pe[0]], pe[probe_pe[0]], mapped[-1])
                    mapped = mapped[:-1]
            else:
                mapped = text[need_pe]
    except Refuted as exc:
        warn_refuted("set_classes", exc)
        return _without_store(model, names, encoder, kind, inner, t0)
    if need_pe:
        assert mapped is not None
        each_pe = (time.perf_counter() - t1) / len(need_pe)
        for j, i in enumerate(need_pe):
            pe[i] = mapped[j]
            cost[i] += each_pe
            store.put(keys.pe(names[i]), {"pe": mapped[j]}, kind=PE_KIND,
                      cost_s=float(cost[i]), meta={"name": names[i], "encoder": keys.efp, "detector": str(keys.dfp)})
    store.put(set_key, {"pe": pe}, kind=SET_KIND, cost_s=float(cost.sum()),
              meta={"names": str(len(names)), "encoder": keys.efp, "detector": str(keys.dfp)})
    _apply(model, names, pe)
    return ClassesReport(len(names), len(names) - len(need_pe), len(need_pe) - len(need_text), len(need_text),
                         time.perf_counter() - t0, encoder.loaded, False)


def _stored_text(names: Sequence[str], text_hits: list[int], text: np.ndarray, pe_hits: list[int], keys: Recipes,
                 dim: int) -> tuple[str, np.ndarray] | None:
    """A name whose text feature is stored, and that feature: to encode again beside the misses."""
    if text_hits:
        return names[text_hits[0]], text[text_hits[0]]
    for i in pe_hits[:1]:
        e = keys.store.get(keys.text(names[i]), kind=TEXT_KIND)
        if e is not None and e.tensors.get("text", np.empty(0)).shape == (dim,):
            return names[i], e.tensors["text"]
    return None


def _without_store(model: Any, names: Sequence[str], encoder: TextEncoder, kind: str, inner: Any,
                   t0: float) -> ClassesReport:
    """Every name encoded and mapped now, nothing read from or written to the store: a refuted encoder."""
    import torch

    text = encoder.encode(list(names))
    if kind == "yoloe":
        param = next(inner.parameters())
        with torch.inference_mode():
            x = torch.from_numpy(np.ascontiguousarray(text, np.float32))[None].to(param.device, param.dtype)
            pe = inner.model[-1].get_tpe(x)[0].float().cpu().numpy()
    else:
        pe = np.asarray(text, np.float32)
    _apply(model, names, pe)
    return ClassesReport(len(names), 0, 0, len(names), time.perf_counter() - t0, encoder.loaded, False)


def _model_id(wrapper: Any) -> str:
    model_id: str = wrapper._prompt_embedding_model()
    return model_id


def export_npz(model: Any, path: str | os.PathLike[str]) -> Path:
    """Write the model's current classes exactly as ``YOLOE.save_prompt_embeddings`` does.

    Raises:
        InvalidInputError: not a YOLOE wrapper, classes not set, or a path not ending in .npz.
    """
    wrapper, inner, kind = _unwrap(model)
    if wrapper is None or kind != "yoloe":
        raise InvalidInputError("export_npz needs an ultralytics.YOLOE model (the NPZ is bound to its checkpoint name)")
    path = Path(path)
    if path.suffix.lower() != ".npz":
        raise InvalidInputError(f"prompt embedding files end in .npz, not {path.suffix!r}")
    pe = getattr(inner, "pe", None)
    names = list(inner.names.values()) if isinstance(inner.names, dict) else list(inner.names)
    if pe is None or pe.ndim != 3 or pe.shape[0] != 1 or pe.shape[1] != len(names) or not bool(pe.isfinite().all()):
        raise InvalidInputError("the model has no finite class embeddings matching its names; call set_classes first")
    np.savez_compressed(path, embeddings=pe.detach().cpu().float().numpy(), names=np.asarray(names, dtype=np.str_),
                        model=np.asarray(_model_id(wrapper), dtype=np.str_))
    return path


def _classes_from_source(model: Any, names: list[str], store: PromptStore | None, source: str, t0: float,
                         encoder: TextEncoder | None) -> ClassesReport:
    wrapper, inner, kind = _unwrap(model)
    if wrapper is None or kind != "yoloe":
        raise InvalidInputError("set_classes(source=...) needs an ultralytics.YOLOE model (an NPZ is bound to its model id)")
    dim = _head_width(inner, kind)
    store = store if store is not None else PromptStore()
    held, pe = _read_source(store, source, wrapper, dim)
    row = {n: i for i, n in enumerate(held)}
    absent = [n for n in names if n not in row]
    if absent:
        raise InvalidInputError(f"the NPZ {source} does not hold {absent[:20]} (it holds {held[:20]}"
                                f"{'...' if len(held) > 20 else ''}); its names are labels, matched exactly")
    _apply(model, names, pe[[row[n] for n in names]])
    return ClassesReport(len(names), len(names), 0, 0, time.perf_counter() - t0,
                         bool(encoder is not None and encoder.loaded), True, source)


def import_npz(model: Any, path: str | os.PathLike[str], store: PromptStore | None = None) -> ClassesReport:
    """Read an ultralytics prompt-embedding NPZ, validate it, store it, and apply it.

    What ``YOLOE.load_prompt_embeddings`` does, checked more strictly. An NPZ's names are
    labels: text prompts (``set_classes`` then ``save_prompt_embeddings``), visual prompts
    (``predict(visual_prompts=...)`` names them ``object0``, ``object1``...) or classes renamed
    for display, in one format that does not say which. So the NPZ is stored as one entry of
    its own (kind ``vision.npz``), keyed by its content (model id, names, embeddings), never
    under the encoder's keys for those names: a later ``set_classes(model, names)`` encodes the
    names as text, as before the import. To reuse the NPZ from the store (another process or
    host sharing it, no file at hand), pass the returned ``report.source`` handle:
    ``set_classes(model, names, store=store, source=report.source)``.

    Returns:
        A :class:`ClassesReport` whose ``source`` is the NPZ's handle (the same for the same
        content on every machine); nothing was encoded.

    Raises:
        InvalidInputError: unreadable file, pickled objects, missing or extra keys, another
            model's id, names not distinct strings, wrong shape or dimension, NaN or inf.
            Nothing is stored and the model is unchanged.
    """
    t0 = time.perf_counter()
    wrapper, inner, kind = _unwrap(model)
    if wrapper is None or kind != "yoloe":
        raise InvalidInputError("import_npz needs an ultralytics.YOLOE model")
    _head_width(inner, kind)
    try:
        with zipfile.ZipFile(path) as zf:
            if any(i.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED) for i in zf.infolist()):
                # bzip2/LZMA members inflate without an output bound before numpy sees a byte.
                raise InvalidInputError(f"{path}: NPZ members must be stored or deflated (np.savez / savez_compressed)")
        with np.load(path, allow_pickle=False) as data:
            files = set(data.files)
            if files != NPZ_KEYS:
                raise InvalidInputError(f"an NPZ of prompt embeddings holds exactly {sorted(NPZ_KEYS)}, got {sorted(files)}")
            embeddings, names, model_id = data["embeddings"], data["names"], data["model"]
    except InvalidInputError:
        raise
    except Exception as exc:  # noqa: BLE001
        # Untrusted bytes reach numpy's header parser and zipfile, which raise more than their
        # documented errors (tokenize.TokenError, NotImplementedError, MemoryError were found by
        # fuzzing); pickled arrays are a ValueError. All of them mean "not a usable NPZ".
        raise InvalidInputError(f"{path} is not a readable prompt-embedding NPZ: {exc}") from None
    if model_id.ndim != 0 or model_id.dtype.kind != "U":
        raise InvalidInputError("the NPZ's model id must be a scalar string")
    if str(model_id.item()) != _model_id(wrapper):
        raise InvalidInputError(f"the NPZ was made for {model_id.item()!r}, this model is {_model_id(wrapper)!r}")
    if names.ndim != 1 or names.dtype.kind != "U":
        raise InvalidInputError("the NPZ's names must be a 1-D string array")
    names_list = check_names(names.tolist())
    dim = inner.model[-1].embed
    if embeddings.dtype != np.float32 or embeddings.shape != (1, len(names_list), dim):
        raise InvalidInputError(f"embeddings must be float32 of shape (1, {len(names_list)}, {dim}), "
                                f"got {embeddings.dtype} {embeddings.shape}")
    if not np.isfinite(embeddings).all():
        raise InvalidInputError("embeddings must be finite (no NaN or inf)")
    store = store if store is not None else PromptStore()
    model_id = _model_id(wrapper)
    source = npz_source(model_id, names_list, embeddings)
    store.put(_source_key(store, source), {"pe": embeddings[0], "names": np.frombuffer(vocabulary_payload(names_list), np.uint8)},
              kind=NPZ_KIND, cost_s=time.perf_counter() - t0,
              meta={"model": model_id, "names": str(len(names_list)), "file": Path(path).name})
    _apply(model, names_list, embeddings[0])
    return ClassesReport(len(names_list), 0, 0, 0, time.perf_counter() - t0, False, False, source)
