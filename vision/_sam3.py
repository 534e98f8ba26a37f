"""SAM 3 concept prompts (ultralytics) from the store.

``SAM3SemanticModel.set_classes(text)`` runs SAM 3's 354M-parameter text encoder over every prompt
whenever the prompts change, in every process; ``SAM3SemanticPredictor`` (images) and
``SAM3VideoSemanticPredictor`` (videos) both call it. :func:`serve_sam3` makes that call read the
store: each prompt's language features, padding mask and token embeddings (what
``backbone.forward_text`` returns for it) are stored under the text side's live identity (the
language backbone's weights, settings, hooks and code, its tokenizer, the ``forward_text`` code
around it; ambient torch state) and the prompt; only prompts the store lacks are encoded, and when
every prompt hits the encoder does not run. ``model.text_embeddings`` and ``model.names`` come out
as ``set_classes`` leaves them.

Where the encoder runs anyway, one stored prompt is encoded again in its batch and compared
(:mod:`._verify`); on a mismatch every prompt is encoded now, with a warning, and nothing is stored.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from promptstore import PromptStore
from promptstore._live import Generators
from promptstore.errors import InvalidInputError, UnsupportedModelError

from ._classes import TEXT_KIND, Recipes, describe_ahead
from ._verify import Refuted, check_draws, check_feature, warn_refuted
from ._zeroshot import _STORED, _storable

__all__ = ["serve_sam3"]

_PARTS = ("language_features", "language_mask", "language_embeds")  # what forward_text returns, per prompt


def serve_sam3(model: Any, store: PromptStore | None = None) -> Any:
    """Make ``model.set_classes(text)`` read its prompts' text features from ``store``; returns ``model``.

    Args:
        model: ultralytics' ``SAM3SemanticModel`` (a predictor's ``.model``), in eval mode.
        store: default ``PromptStore()``.

    Raises:
        InvalidInputError: not a SAM 3 semantic model.
        UnsupportedModelError: a model in training mode.
    """
    if type(model).__name__ != "SAM3SemanticModel" or not hasattr(getattr(model, "backbone", None), "forward_text"):
        raise InvalidInputError(f"expected ultralytics' SAM3SemanticModel, got {type(model).__name__}")
    if model.training:
        raise UnsupportedModelError("SAM 3 in training mode: call .eval()")
    side = _Sam3Text(model, store if store is not None else PromptStore())
    # An instance attribute: the predictors call self.model.set_classes(text=...).
    model.set_classes = side.set_classes
    describe_ahead(side.fingerprint)
    return model


class _Sam3Text:
    def __init__(self, model: Any, store: PromptStore) -> None:
        self.model, self.store = model, store
        self.encoded = 0  # prompts the text encoder ran on (checks included)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Sam3Text:
        """A copy of the model serves itself: described as the copy, over the same store (a store is shared,
        as between processes; its files and connections are not copied)."""
        import copy

        new = _Sam3Text.__new__(_Sam3Text)
        memo[id(self)] = new
        new.model, new.store = copy.deepcopy(self.model, memo), self.store
        new.encoded = 0
        return new

    def fingerprint(self) -> str:
        from promptstore._live import ambient_identity, module_identity

        backbone = self.model.backbone
        device = next(backbone.language_backbone.parameters()).device.type
        live = module_identity(backbone, entries=("forward_text",), skip="vision_backbone",
                               what="SAM 3's text side")
        return f"sam3-text:{type(self.model).__qualname__}:device={device}:{live}:{ambient_identity()}"

    def set_classes(self, text: list[str]) -> None:
        """``SAM3SemanticModel.set_classes``: ``text_embeddings`` and ``names`` for ``text``, from the store."""
        import torch

        names = _prompts(text)
        recipes = Recipes(self.store, self.fingerprint())
        dtype = self.model.backbone.language_backbone.resizer.weight.dtype
        found: dict[str, dict[str, Any]] = {}
        rows: list[dict[str, Any]] | None = None  # per prompt, where the store is not used
        for name in dict.fromkeys(names):
            parts = _read(self.store.get(recipes.text(name), kind=TEXT_KIND), dtype)
            if parts is not None:
                found[name] = parts
        missing = [n for n in dict.fromkeys(names) if n not in found]
        probe = next(iter(found), None) if missing else None
        if missing:
            batch = ([probe] if probe is not None else []) + missing
            before = Generators()
            t0 = time.perf_counter()
            fresh = self._encode(batch)
            each = (time.perf_counter() - t0) / len(batch)
            try:
                check_draws(before, "SAM 3's text encoder")
                if probe is not None:
                    check_feature(probe, found[probe]["language_features"].float().numpy(),
                                  fresh[0]["language_features"].float().numpy(), str(dtype))
                    fresh = fresh[1:]
            except Refuted as exc:
                warn_refuted("SAM 3 set_classes", exc)
                rows = self._encode(names)  # every prompt, repeats too, as ultralytics' own call encodes them
                missing, fresh = [], []  # nothing stored from a refuted encoder
            for name, parts in zip(missing, fresh, strict=True):
                tensors = {k: (_storable(v) if k != "language_mask" else v.numpy().astype(np.uint8))
                           for k, v in parts.items()}
                self.store.put(recipes.text(name), tensors, kind=TEXT_KIND, cost_s=each,
                               meta={"name": name, "encoder": recipes.efp})
                found[name] = parts
        if rows is None:
            rows = [found[n] for n in names]
        device = self.model.backbone.language_backbone.resizer.weight.device
        self.model.text_embeddings = {
            "language_features": torch.stack([r["language_features"] for r in rows], 1).to(device),
            "language_mask": torch.stack([r["language_mask"] for r in rows], 0).to(device),
            "language_embeds": torch.stack([r["language_embeds"] for r in rows], 1).to(device),
        }
        self.model.names = text  # as ultralytics' set_classes leaves it (a tuple stays one, a string too)

    def _encode(self, names: list[str]) -> list[dict[str, Any]]:
        """``forward_text`` over ``names`` now, split per prompt (CPU tensors)."""
        import torch

        self.encoded += len(names)
        with torch.no_grad():
            out = self.model.backbone.forward_text(names)
        return [{"language_features": out["language_features"][:, i].detach().cpu(),
                 "language_mask": out["language_mask"][i].detach().cpu(),
                 "language_embeds": out["language_embeds"][:, i].detach().cpu()} for i in range(len(names))]


def _prompts(text: Any) -> list[str]:
    """The prompts ``set_classes`` encodes: a string is one prompt, as ultralytics' tokenizer takes it; any text
    it encodes is served (duplicates, empty strings, control characters: each prompt is keyed by its own text).

    Raises:
        InvalidInputError: not a string or a non-empty sequence of strings, or text that is not valid Unicode.
    """
    prompts = [text] if isinstance(text, str) else list(text) if isinstance(text, (list, tuple)) else None
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise InvalidInputError(f"SAM 3 prompts must be a string or a non-empty list of strings, got {text!r}")
    for p in prompts:
        try:
            p.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidInputError(f"SAM 3 prompt {p!r} is not valid Unicode (a lone surrogate)") from None
    return prompts


def _read(entry: Any, dtype: Any) -> dict[str, Any] | None:
    """A stored prompt's parts as CPU tensors (the features in ``dtype``), or None (a miss)."""
    import torch

    if entry is None or any(k not in entry.tensors for k in _PARTS):
        return None
    out: dict[str, Any] = {}
    for k in ("language_features", "language_embeds"):
        if entry.dtypes.get(k) != _STORED.get(str(dtype).removeprefix("torch.")) or entry.tensors[k].ndim != 2:
            return None
        arr = np.array(entry.tensors[k])
        out[k] = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16) if dtype == torch.bfloat16 else torch.from_numpy(arr)
    mask = np.array(entry.tensors["language_mask"])
    if mask.ndim != 1:
        return None
    out["language_mask"] = torch.from_numpy(mask.astype(bool))
    return out
