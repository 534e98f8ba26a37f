"""transformers' OWLv2 / OWL-ViT detection with text queries from the store.

The detectors encode every text query on every call. Here each query's embedding (the text
tower's pooled output, projected and L2-normalised: exactly what the detector's forward feeds
its class head) is stored under the text side's fingerprint, and detection runs through the
model's own heads (``image_embedder``, ``class_predictor``, ``box_predictor``,
``objectness_predictor``) with those embeddings. On a hit the text tower never runs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from promptstore import PromptStore
from promptstore._live import Generators
from promptstore.errors import InvalidInputError

from ._classes import TEXT_KIND, Recipes
from ._verify import Drew, Refuted, check_draws, check_feature, warn_refuted

__all__ = ["owl_detect", "owl_query_fingerprint"]


def _base(model: Any) -> tuple[Any, str]:
    """(the detector's CLIP-like base model, its family) or a clear error."""
    name = type(model).__name__
    if name == "Owlv2ForObjectDetection":
        return model.owlv2, "owlv2"
    if name == "OwlViTForObjectDetection":
        return model.owlvit, "owlvit"
    raise InvalidInputError(f"expected transformers' Owlv2ForObjectDetection or OwlViTForObjectDetection, got {name}")


def _check_queries(queries: Any) -> list[str]:
    """The queries as the processor takes them: a non-empty list of strings. Repeats and control
    characters are the caller's (each exact string is its own key, encoded as the processor encodes it)."""
    if isinstance(queries, (str, bytes)) or not isinstance(queries, Sequence) or not queries:
        raise InvalidInputError("queries must be a non-empty list of strings")
    for q in queries:
        if not isinstance(q, str):
            raise InvalidInputError(f"queries must be strings, got {q!r}")
        try:
            q.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidInputError(f"query {q!r} is not valid Unicode (a lone surrogate)") from None
    return list(queries)


def owl_query_fingerprint(model: Any, processor: Any) -> str:
    """Names what turns a text query into this detector's query embedding, as it runs now.

    The live identity (:mod:`promptstore._live`) of the text tower and the projection (every
    tensor, setting, hook and the code their forward reaches), the processor with its
    tokenizer (options, special and added tokens, vocabulary; read on every call) but not its
    image processor, the ambient torch state (autocast), and the model class and device type.

    Raises:
        InvalidInputError: not an OWL detector and its processor.
        UnsupportedModelError: dropout active in training mode, or state that cannot be named.
    """
    from promptstore._live import ambient_identity, module_identity, tokenizer_identity

    base, family = _base(model)
    if getattr(processor, "tokenizer", None) is None:
        raise InvalidInputError("processor must be the detector's processor (Owlv2Processor / OwlViTProcessor)")
    device = next(model.parameters()).device.type
    text = module_identity(base.text_model, what=f"{family}'s text tower")
    projection = module_identity(base.text_projection, what=f"{family}'s text projection")
    # The processor's text side only: its image processor never sees a query.
    processor_id = tokenizer_identity(processor, "processor", ignore=("image_processor",))
    return (f"{family}-text:{type(model).__qualname__}:device={device}:{text}:{projection}:"
            f"{processor_id}:{ambient_identity()}")


def _query_embeddings(model: Any, processor: Any, queries: list[str], store: PromptStore) -> tuple[Any, int]:
    """(normalised query embeddings on the model's device, how many were encoded now).

    Raises:
        Drew: the text tower drew random numbers (the generators put back, nothing stored).
    """
    import torch

    base, _ = _base(model)
    recipes = Recipes(store, owl_query_fingerprint(model, processor))
    device = next(model.parameters()).device
    found: dict[str, np.ndarray] = {}
    for q in dict.fromkeys(queries):
        entry = store.get(recipes.text(q), kind=TEXT_KIND)
        if entry is not None and entry.tensors.get("text") is not None and entry.tensors["text"].ndim == 1:
            found[q] = entry.tensors["text"]
    missing = [q for q in dict.fromkeys(queries) if q not in found]
    # The text tower runs anyway: one stored query is encoded again in its batch and compared
    # before anything is stored (see _verify.py); a mismatch computes every query now.
    probe = next(iter(found), None) if missing else None
    if probe is not None:
        missing = [probe, *missing]
    if missing:
        before = Generators()
        t0 = time.perf_counter()
        emb = _encode(model, processor, missing)
        each = (time.perf_counter() - t0) / len(missing)
        host = emb.float().cpu().numpy()
        check_draws(before, "the text tower")  # Drew: owl_detect runs the plain call
        try:
            if probe is not None:
                check_feature(probe, found[probe], host[0])
        except Refuted as exc:
            warn_refuted("owl_detect", exc)
            dtype = next(model.parameters()).dtype
            return _encode(model, processor, queries).to(dtype=dtype), len(queries)
        if probe is not None:
            missing, host = missing[1:], host[1:]
        for q, e in zip(missing, host, strict=True):
            store.put(recipes.text(q), {"text": e}, kind=TEXT_KIND, cost_s=each, meta={"name": q, "encoder": recipes.efp})
            found[q] = e
    dtype = next(model.parameters()).dtype
    return torch.from_numpy(np.stack([found[q] for q in queries])).to(device=device, dtype=dtype), len(missing)


def _encode(model: Any, processor: Any, queries: list[str]) -> Any:
    """The queries' normalised embeddings computed now, as the detector's forward computes them."""
    import torch

    base, _ = _base(model)
    device = next(model.parameters()).device
    enc = processor(text=list(queries), return_tensors="pt")
    with torch.no_grad():
        out = base.text_model(input_ids=enc["input_ids"].to(device), attention_mask=enc["attention_mask"].to(device))
        emb = base.text_projection(out.pooler_output)
        # The detector's own normalisation (OwlViTModel / Owlv2Model.forward).
        return emb / torch.linalg.norm(emb, ord=2, dim=-1, keepdim=True)


def owl_detect(model: Any, processor: Any, queries: Sequence[str], *, images: Any = None, pixel_values: Any = None,
               store: PromptStore | None = None, interpolate_pos_encoding: bool = False) -> Any:
    """``model(**processor(text=[queries] * n, images=images))`` with each query's embedding from the store.

    Args:
        model: ``Owlv2ForObjectDetection`` or ``OwlViTForObjectDetection``, in eval mode.
        processor: its processor (``Owlv2Processor`` / ``OwlViTProcessor``).
        queries: the text queries, the same for every image (distinct, visible strings).
        images: images for ``processor(images=...)``; or give ``pixel_values`` already processed.
        store: default ``PromptStore()``.
        interpolate_pos_encoding: as the model's forward takes it.

    Returns:
        The model's own output class (``Owlv2ObjectDetectionOutput`` / ``OwlViTObjectDetectionOutput``)
        with ``logits``, ``pred_boxes``, ``objectness_logits`` (OWLv2), ``class_embeds``,
        ``image_embeds``, ``text_embeds`` and ``vision_model_output`` as the plain call gives them
        (``text_model_output`` is None: the text tower did not run), so the processor's
        ``post_process_*`` functions take it as it is.

    Raises:
        InvalidInputError: a model or processor of another kind, bad queries, no images, a
            left-padding tokenizer.
    """
    import torch

    _base(model)
    queries = _check_queries(queries)
    if getattr(getattr(processor, "tokenizer", None), "padding_side", "right") == "left":
        # The detector tells padded query slots by their first token (transformers' query_mask:
        # input_ids[..., 0] > 0): left padding marks every padded query as absent, so the plain
        # call masks them out of the logits. Nothing served could equal that usefully.
        raise InvalidInputError("OWL queries need a right-padding tokenizer: with padding_side='left' the detector "
                                "reads every padded query as absent (set processor.tokenizer.padding_side = 'right')")
    if (images is None) == (pixel_values is None):
        raise InvalidInputError("give images or pixel_values (one of them)")
    if pixel_values is None:
        pixel_values = processor(images=images, return_tensors="pt")["pixel_values"]
    if not isinstance(pixel_values, torch.Tensor) or pixel_values.ndim != 4:
        raise InvalidInputError("pixel_values must be a (batch, 3, height, width) tensor")
    store = store if store is not None else PromptStore()
    device = next(model.parameters()).device
    try:
        query_embeds, _ = _query_embeddings(model, processor, queries, store)
    except Drew as exc:
        # The text tower drew random numbers (the generators put back): the plain call, every image its own draw.
        warn_refuted("owl_detect", exc)
        text = processor(text=[queries] * pixel_values.shape[0], return_tensors="pt")
        with torch.no_grad():
            return model(input_ids=text["input_ids"].to(device), attention_mask=text["attention_mask"].to(device),
                         pixel_values=pixel_values.to(device), interpolate_pos_encoding=interpolate_pos_encoding)
    with torch.no_grad():
        feature_map, vision_outputs = model.image_embedder(pixel_values=pixel_values.to(device),
                                                           interpolate_pos_encoding=interpolate_pos_encoding)[:2]
        batch, h, w, dim = feature_map.shape
        image_feats = feature_map.reshape(batch, h * w, dim)
        query = query_embeds[None].expand(batch, -1, -1)
        mask = torch.ones(batch, len(queries), dtype=torch.bool, device=device)
        logits, class_embeds = model.class_predictor(image_feats, query, mask)
        boxes = model.box_predictor(image_feats, feature_map, interpolate_pos_encoding)
        extra = {}
        if hasattr(model, "objectness_predictor"):
            extra["objectness_logits"] = model.objectness_predictor(image_feats)
    from transformers.models.owlv2.modeling_owlv2 import Owlv2ObjectDetectionOutput
    from transformers.models.owlvit.modeling_owlvit import OwlViTObjectDetectionOutput

    cls = Owlv2ObjectDetectionOutput if extra else OwlViTObjectDetectionOutput
    # ignore[arg-type]: transformers types these outputs' fields without None, though each defaults to None
    return cls(image_embeds=feature_map, text_embeds=query, pred_boxes=boxes, logits=logits, class_embeds=class_embeds,
               text_model_output=None, vision_model_output=vision_outputs, **extra)  # type: ignore[arg-type]
