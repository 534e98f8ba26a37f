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
import weakref
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from promptstore import PromptStore
from promptstore.errors import InvalidInputError

from ._encoders import TextEncoder, UltralyticsTextEncoder

__all__ = ["set_classes", "export_npz", "import_npz", "ClassesReport", "detector_fingerprint",
           "TEXT_KIND", "PE_KIND", "SET_KIND"]

TEXT_KIND, PE_KIND, SET_KIND = "vision.text", "vision.pe", "vision.peset"
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


def check_names(names: Any) -> list[str]:
    """Validate class names before anything is stored or changed.

    Raises:
        InvalidInputError: not a list of distinct, non-blank strings.
    """
    if isinstance(names, (str, bytes)) or not isinstance(names, Sequence):
        raise InvalidInputError(f"class names must be a list of strings, got {type(names).__name__}")
    names = list(names)
    if not names:
        raise InvalidInputError("class names must not be empty")
    for n in names:
        if not isinstance(n, str):
            raise InvalidInputError(f"class names must be strings, got {n!r}")
        if not n.strip():
            raise InvalidInputError(f"class names must not be blank, got {n!r} (ultralytics reserves ' ')")
    if len(set(names)) != len(names):
        dupes = sorted({n for n in names if names.count(n) > 1})
        raise InvalidInputError(f"duplicate class names: {dupes}")
    return names


def _unwrap(model: Any) -> tuple[Any, Any, str]:
    """(ultralytics wrapper or None, the detection model, "yoloe" | "world")."""
    from ultralytics.nn.tasks import WorldModel, YOLOEModel

    for wrapper, inner in ((None, model), (model, getattr(model, "model", None))):
        if isinstance(inner, YOLOEModel):
            return wrapper, inner, "yoloe"
        if isinstance(inner, WorldModel):
            return wrapper, inner, "world"
    raise InvalidInputError(f"expected an ultralytics YOLOE or YOLOWorld model, got {type(model).__name__}")


_head_memo: weakref.WeakKeyDictionary[Any, tuple[tuple[int, ...], str]] = weakref.WeakKeyDictionary()


def _digest_module(module: Any, label: str) -> str:
    """A digest of a module's weights, redone only when torch's in-place version counters move."""
    import torch

    params = list(module.state_dict(keep_vars=True).items())
    versions = tuple(t._version for _, t in params)
    cached = _head_memo.get(module)
    if cached is not None and cached[0] == versions:
        return cached[1]
    h = xxhash.xxh3_128(label.encode())
    for name, t in params:
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.view(-1).view(torch.uint8).numpy())
    fp = f"{label}:{h.hexdigest()}"
    _head_memo[module] = (versions, fp)
    return fp


def detector_fingerprint(model: Any) -> str:
    """What maps text features to this detector's class embeddings.

    YOLOE: the head's RepRTA weights (``head.get_tpe``). YOLOWorld uses the raw text features.
    """
    _, inner, kind = _unwrap(model)
    if kind == "world":
        return "yoloworld:raw-text-features"
    head = inner.model[-1]
    return _digest_module(head.reprta, f"yoloe-reprta:{type(head).__name__}:{head.embed}")


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


def _apply(model: Any, names: list[str], pe: np.ndarray) -> None:
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
                encoder: TextEncoder | None = None, batch: int | None = None) -> ClassesReport:
    """Give a YOLOE (or YOLOWorld) model its classes, computing only what the store lacks.

    Looks the vocabulary up as a whole, then each name's detector-ready embedding, then its
    raw text feature; encodes only the names missing at both levels (sorted by length, in
    batches), maps them with the model's own head, stores everything, and calls the model's
    ``set_classes(names, embeddings)``. A full hit never builds the text encoder.

    Args:
        model: ``ultralytics.YOLOE`` / ``YOLOWorld``, or their inner detection model.
        names: class names, distinct and non-blank.
        store: default ``PromptStore()``.
        encoder: default: the model's own text model through :class:`UltralyticsTextEncoder`
            (its ``.ts`` file must be on disk if anything has to be encoded).
        batch: texts per encoder pass.

    Returns:
        A :class:`ClassesReport`.

    Raises:
        InvalidInputError: bad names or model. Nothing is stored and the model is unchanged.
        ModelUnavailableError: something had to be encoded and the encoder's weights are missing.
    """
    import torch

    t0 = time.perf_counter()
    names = check_names(names)
    wrapper, inner, kind = _unwrap(model)
    store = store if store is not None else PromptStore()
    encoder = encoder if encoder is not None else default_encoder(model)
    if batch is not None:
        encoder.batch = batch  # type: ignore[attr-defined]
    efp, dfp = encoder.fingerprint, detector_fingerprint(model)
    dim = inner.model[-1].embed if kind == "yoloe" else encoder.dim
    set_key = store.key(SET_KIND, "\0".join(names), fingerprints=[efp, dfp])
    whole = store.get(set_key, kind=SET_KIND)
    if whole is not None and whole.tensors.get("pe", np.empty(0)).shape == (len(names), dim):
        _apply(model, names, whole.tensors["pe"])
        return ClassesReport(len(names), len(names), 0, 0, time.perf_counter() - t0, encoder.loaded, True)

    pe = np.empty((len(names), dim), np.float32)
    cost = np.zeros(len(names))
    need_pe = []
    for i, name in enumerate(names):
        e = store.get(store.key(PE_KIND, name, fingerprints=[efp, dfp]), kind=PE_KIND)
        if e is not None and e.tensors.get("pe", np.empty(0)).shape == (dim,):
            pe[i], cost[i] = e.tensors["pe"], e.cost_s
        else:
            need_pe.append(i)
    text = np.empty((len(names), encoder.dim), np.float32)
    need_text = []
    for i in need_pe:
        e = store.get(store.key(TEXT_KIND, names[i], fingerprints=[efp]), kind=TEXT_KIND)
        if e is not None and e.tensors.get("text", np.empty(0)).shape == (encoder.dim,):
            text[i], cost[i] = e.tensors["text"], e.cost_s
        else:
            need_text.append(i)
    if need_text:
        t1 = time.perf_counter()
        feats = encoder.encode([names[i] for i in need_text])
        each = (time.perf_counter() - t1) / len(need_text)
        for j, i in enumerate(need_text):
            text[i], cost[i] = feats[j], each
            store.put(store.key(TEXT_KIND, names[i], fingerprints=[efp]), {"text": feats[j]}, kind=TEXT_KIND,
                      cost_s=each, meta={"name": names[i], "encoder": efp})
    if need_pe:
        t1 = time.perf_counter()
        if kind == "yoloe":
            param = next(inner.parameters())
            with torch.inference_mode():
                x = torch.from_numpy(text[need_pe])[None].to(param.device, param.dtype)
                mapped = inner.model[-1].get_tpe(x)[0].float().cpu().numpy()
        else:
            mapped = text[need_pe]
        each = (time.perf_counter() - t1) / len(need_pe)
        for j, i in enumerate(need_pe):
            pe[i] = mapped[j]
            cost[i] += each
            store.put(store.key(PE_KIND, names[i], fingerprints=[efp, dfp]), {"pe": mapped[j]}, kind=PE_KIND,
                      cost_s=float(cost[i]), meta={"name": names[i], "encoder": efp, "detector": dfp})
    store.put(set_key, {"pe": pe}, kind=SET_KIND, cost_s=float(cost.sum()),
              meta={"names": str(len(names)), "encoder": efp, "detector": dfp})
    _apply(model, names, pe)
    return ClassesReport(len(names), len(names) - len(need_pe), len(need_pe) - len(need_text), len(need_text),
                         time.perf_counter() - t0, encoder.loaded, False)


def _model_id(wrapper: Any) -> str:
    return wrapper._prompt_embedding_model()


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


def import_npz(model: Any, path: str | os.PathLike[str], store: PromptStore | None = None,
               encoder: TextEncoder | None = None) -> ClassesReport:
    """Read an ultralytics prompt-embedding NPZ, validate it, store it, and apply it.

    The embeddings are stored under this detector's fingerprint (and the encoder's, default:
    the model's own text model, named but not loaded), so a later ``set_classes`` with any
    of these names hits without an encoder.

    Raises:
        InvalidInputError: unreadable file, pickled objects, missing or extra keys, another
            model's id, names not distinct strings, wrong shape or dimension, NaN or inf.
            Nothing is stored and the model is unchanged.
    """
    t0 = time.perf_counter()
    wrapper, inner, kind = _unwrap(model)
    if wrapper is None or kind != "yoloe":
        raise InvalidInputError("import_npz needs an ultralytics.YOLOE model")
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
    encoder = encoder if encoder is not None else default_encoder(model)
    efp, dfp = encoder.fingerprint, detector_fingerprint(model)
    meta = {"encoder": efp, "detector": dfp, "source": f"npz:{Path(path).name}"}
    for i, name in enumerate(names_list):
        store.put(store.key(PE_KIND, name, fingerprints=[efp, dfp]), {"pe": embeddings[0, i]}, kind=PE_KIND,
                  meta={**meta, "name": name})
    store.put(store.key(SET_KIND, "\0".join(names_list), fingerprints=[efp, dfp]), {"pe": embeddings[0]},
              kind=SET_KIND, meta={**meta, "names": str(len(names_list))})
    _apply(model, names_list, embeddings[0])
    return ClassesReport(len(names_list), 0, 0, 0, time.perf_counter() - t0, encoder.loaded, False)
