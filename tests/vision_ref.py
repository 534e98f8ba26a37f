"""Reference paths for the vision differential tests: ultralytics' own code, our tower patched in.

``reference_pe(model, encoder, names)`` runs ultralytics' ``get_text_pe`` (tokenize, encode in
batches of 80 at the full context, then the head's RepRTA for YOLOE) with ``build_text_model``
patched to return the same open_clip tower the encoder wraps, so the only difference from
``set_classes`` is what promptstore adds: lookups, batching by length, trimming, storage.
"""

from __future__ import annotations

import sys
import types
from typing import Any
from unittest import mock

import open_clip
import torch
from ultralytics import YOLOE, YOLOWorld

# A yaml-built YOLOE zero-initialises RepRTA's last layer, so its head maps any feature to its
# normalised self and hides head bugs: these seeds give it live weights.
HEAD_SEED = 1234

ACCEPTED_TOWERS_FAST = ["MobileCLIP2-B", "MobileCLIP2-S0", "coca_ViT-B-32", "ViT-S-16-alt", "PE-Core-S-16-384"]


def accepted_towers() -> list[str]:
    """One open_clip model per distinct text tower the library accepts (open_clip's own BPE)."""
    import json

    seen: dict[str, str] = {}
    for name in open_clip.list_models():
        text = open_clip.get_model_config(name).get("text_cfg", {})
        if "hf_model_name" in text or "hf_tokenizer_name" in text:
            continue
        seen.setdefault(json.dumps(text, sort_keys=True), name)
    return sorted(seen.values())


def live_head(model: Any, seed: int = HEAD_SEED) -> Any:
    """Give a YOLOE head's RepRTA seeded non-zero weights (in place); returns the model."""
    inner = model.model if hasattr(model, "model") and not isinstance(model, torch.nn.Sequential) else model
    head = inner.model[-1]
    if hasattr(head, "reprta"):
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in head.reprta.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def detector(cfg: str, seed: int = 0) -> Any:
    """A yaml-built YOLOE (live head) or YOLO-World, random weights from ``seed``."""
    torch.manual_seed(seed)
    model = YOLOWorld(cfg) if "world" in cfg else YOLOE(cfg)
    return live_head(model, HEAD_SEED + seed)


class _PatchedTextModel:
    """What ultralytics' build_text_model returns, over the encoder's own open_clip tower."""

    def __init__(self, encoder: Any) -> None:
        self.encoder = encoder
        self.tower = encoder._build()

    def tokenize(self, texts: list[str]) -> Any:
        return self.encoder._tokenizer(texts)

    @torch.no_grad()
    def encode_text(self, tokens: Any) -> Any:
        out = self.tower.encode_text(tokens) if hasattr(self.tower, "encode_text") else self.tower(tokens)
        out = out[0] if isinstance(out, tuple) else out
        return torch.nn.functional.normalize(out.float(), dim=-1)


def with_tower(encoder: Any) -> Any:
    """A context in which ultralytics' text model is the encoder's open_clip tower at the full context.

    ultralytics.nn.text_model imports the `clip` package at load; ultralytics imports
    build_text_model from it at call time, so a stand-in module is what it finds.
    """
    stand_in = types.ModuleType("ultralytics.nn.text_model")
    stand_in.build_text_model = lambda *a, **k: _PatchedTextModel(encoder)  # type: ignore[attr-defined]
    return mock.patch.dict(sys.modules, {"ultralytics.nn.text_model": stand_in})


def reference_pe(model: Any, encoder: Any, names: list[str]) -> Any:
    """ultralytics' own class embeddings for ``names`` (numpy, (n, dim))."""
    with with_tower(encoder), torch.no_grad():
        pe = model.model.get_text_pe(list(names))
    return pe[0].float().numpy()


def applied_pe(model: Any) -> Any:
    """The class embeddings the model now uses (numpy, (n, dim))."""
    inner = model.model
    t = inner.txt_feats if isinstance(model, YOLOWorld) else inner.pe
    return t[0].detach().float().numpy()
