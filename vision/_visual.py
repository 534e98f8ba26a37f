"""YOLOE visual prompts from the store: a reference image plus boxes, embedded once.

The key covers the reference image's bytes, the prompt geometry, the inference size and
the whole detector's live identity (backbone and the visual-prompt head), so a reference set
is computed once and reused by every process, and never by another model.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from promptstore import PromptStore
from promptstore._live import Generators
from promptstore.errors import InvalidInputError

from ._classes import _apply, _head_width, _unwrap
from ._verify import Drew, warn_refuted

__all__ = ["visual_pe", "VisualReport", "VISUAL_KIND"]

VISUAL_KIND = "vision.vpe"


@dataclass(frozen=True)
class VisualReport:
    """What visual_pe did."""

    classes: int
    hit: bool
    seconds: float


def _image_digest(image: Any) -> str:
    h = xxhash.xxh3_128()
    if isinstance(image, (str, os.PathLike)):
        path = Path(image)
        if not path.is_file():
            raise InvalidInputError(f"reference image {path} is not a file")
        h.update(b"file:" + path.read_bytes())
    else:
        # ultralytics reads a PIL image as RGB and an array as BGR: the same bytes are two inputs.
        pil = type(image).__module__.startswith("PIL.")
        arr = np.asarray(image)
        if arr.dtype not in (np.uint8, np.uint16) or arr.ndim not in (2, 3) or not all(arr.shape):
            raise InvalidInputError("a reference image is a path, a PIL image or an HxW or HxWxC uint8/uint16 array")
        h.update(f"{'pil:' + image.mode if pil else 'array'}:{arr.dtype}:{arr.shape}".encode())
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()


def _prompt_digest(prompts: dict[str, Any]) -> tuple[str, int]:
    if not isinstance(prompts, dict) or "bboxes" not in prompts or "cls" not in prompts:
        raise InvalidInputError("visual_prompts is a dict with 'bboxes' (N, 4) and 'cls' (N,)")
    boxes = np.asarray(prompts["bboxes"], dtype=np.float64)
    cls = np.asarray(prompts["cls"])
    if boxes.ndim != 2 or boxes.shape[1] != 4 or cls.ndim != 1 or len(cls) != len(boxes) or not len(boxes):
        raise InvalidInputError("visual_prompts needs N >= 1 boxes of 4 numbers and one class index per box")
    if not np.issubdtype(cls.dtype, np.integer) or cls.min() < 0 or not np.isfinite(boxes).all():
        raise InvalidInputError("class indices must be non-negative integers and boxes finite")
    h = xxhash.xxh3_128()
    for name in sorted(prompts):
        arr = np.ascontiguousarray(np.asarray(prompts[name], dtype=np.float64))
        h.update(f"{name}:{arr.shape}".encode())
        h.update(arr.tobytes())
    return h.hexdigest(), len(np.unique(cls))


def visual_pe(model: Any, refer_image: Any, visual_prompts: dict[str, Any], store: PromptStore | None = None,
              imgsz: int = 640) -> VisualReport:
    """Set a YOLOE model's classes from visual prompts on a reference image, via the store.

    Args:
        model: an ``ultralytics.YOLOE``.
        refer_image: path, PIL image, or HxW / HxWxC uint8 or uint16 array (BGR, as ultralytics reads arrays).
        visual_prompts: ``{"bboxes": (N, 4) xyxy pixels, "cls": (N,) class index per box}``.
        store: default ``PromptStore()``.
        imgsz: inference size the embedding is computed at.

    Returns:
        A :class:`VisualReport`; afterwards ``model.predict`` detects the prompted classes
        (named ``object0``, ``object1``... as ultralytics names them). The model is fused
        (Conv+BN) as ultralytics' predictor fuses it.

    Raises:
        InvalidInputError: bad image, prompts or model; nothing is stored, the model unchanged.
    """
    t0 = time.perf_counter()
    wrapper, inner, kind = _unwrap(model)
    if wrapper is None or kind != "yoloe":
        raise InvalidInputError("visual prompts need an ultralytics.YOLOE model")
    _head_width(inner, kind)  # prompt-free or fused heads are refused before any work
    image_fp = _image_digest(refer_image)
    prompt_fp, n_cls = _prompt_digest(visual_prompts)
    if hasattr(inner, "is_fused") and not inner.is_fused():
        # ultralytics' predictor fuses Conv+BN in place the first time it runs the model (this call's
        # miss path too): fused first, the key names the model every later call sees.
        inner.fuse(verbose=False)
    detector = _detector_identity(inner)
    store = store if store is not None else PromptStore()
    # Fixed-width digests and an int, framed as fingerprints: nothing is joined by a separator.
    key = store.key(VISUAL_KIND, b"", fingerprints=[detector, image_fp, prompt_fp, f"imgsz={imgsz}"])
    names = [f"object{i}" for i in range(n_cls)]
    entry = store.get(key, kind=VISUAL_KIND)
    dim = inner.model[-1].embed
    if entry is not None and entry.tensors.get("vpe", np.empty(0)).shape == (n_cls, dim):
        _apply(model, names, entry.tensors["vpe"])
        return VisualReport(n_cls, True, time.perf_counter() - t0)
    before = Generators()
    vpe = _compute(wrapper, inner, refer_image, visual_prompts, imgsz)
    if before.moved():
        # The model drew random numbers (a user's hook): this embedding is one draw, ultralytics' own, not stored.
        warn_refuted("visual_pe", Drew("the YOLOE model"))
    else:
        store.put(key, {"vpe": vpe}, kind=VISUAL_KIND, cost_s=time.perf_counter() - t0,
                  meta={"image": image_fp, "prompts": prompt_fp, "detector": detector})
    _apply(model, names, vpe)
    return VisualReport(n_cls, False, time.perf_counter() - t0)


def _detector_identity(inner: Any) -> str:
    """The whole detector as it runs now (backbone, visual-prompt head; :mod:`promptstore._live`)."""
    from promptstore._live import ambient_identity, module_identity

    # No dropout check: ultralytics' predictor puts the model in eval mode before it embeds.
    # nc, names and pe follow the classes last applied (by this call too): the embedding never reads
    # them (YOLOEModel.predict returns the visual embedding before get_cls_pe reads pe).
    # The head apart, as set_classes keys it: its own nc is set with the classes too.
    head = f"model.{len(inner.model) - 1}"
    body = module_identity(inner, entries=("forward", "predict", "get_visual_pe", "get_vpe"), skip=head,
                           ignore=("nc", "names", "pe"), what="the YOLOE model", random=True)
    live = module_identity(inner.model[-1], entries=("forward", "get_vpe"), ignore=("nc",), what="the YOLOE head",
                           random=True)
    return f"yoloe-detector:{type(inner).__name__}:{body}:{live}:{ambient_identity()}"


def _compute(wrapper: Any, inner: Any, refer_image: Any, prompts: dict[str, Any], imgsz: int) -> np.ndarray:
    """ultralytics' own visual-prompt path (as YOLOE.predict runs it for a refer_image)."""
    from ultralytics.models import yolo

    predictor_cls = yolo.yoloe.YOLOEVPSegPredictor if inner.task == "segment" else yolo.yoloe.YOLOEVPDetectPredictor
    overrides = {**wrapper.overrides, "task": inner.task, "mode": "predict", "save": False, "batch": 1,
                 "verbose": False, "imgsz": imgsz}
    predictor = predictor_cls(overrides=overrides)
    predictor.set_prompts({k: np.asarray(v) for k, v in prompts.items()})
    predictor.setup_model(model=inner, verbose=False)
    source = str(refer_image) if isinstance(refer_image, (str, os.PathLike)) else np.asarray(refer_image)
    vpe = predictor.get_vpe(source)
    out: np.ndarray = vpe[0].detach().float().cpu().numpy()
    return out
