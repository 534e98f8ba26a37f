"""Fingerprints of what produces KV tensors: the live model, the tokenizer, the ambient torch state.

A fingerprint names the exact computation *as it runs now*, so any change that could change
a KV tensor changes it too: weights however edited (hashed on every request; torch's version
counters miss writes through ``param.data``), every module setting, hooks,
adapters, training mode, the live code and registered attention functions, autocast and
matmul precision. All of it comes from :mod:`promptstore._live`, which the vision adapter uses too.
"""

from __future__ import annotations

from typing import Any

from promptstore import digest_tensors
from promptstore._live import ambient_identity, classes_identity, module_structure, tokenizer_identity

__all__ = ["cache_code_fingerprint", "model_fingerprint", "model_structure", "tokenizer_fingerprint", "ambient_fingerprint"]


def model_structure(model: Any) -> tuple[str, list[tuple[str, Any]]]:
    """Everything the model computes with except the weights' bytes (class, config, settings, hooks,
    code), and its tensors, to digest with :func:`model_fingerprint`.

    Raises:
        UnsupportedModelError: something on the forward path that cannot be named exactly.
    """
    structure, tensors = module_structure(model, what=type(model).__name__)
    return "model-structure:" + structure, tensors


def model_fingerprint(model: Any, structure: tuple[str, list[tuple[str, Any]]] | None = None) -> str:
    """The model's live identity: its structure (see :func:`model_structure`) and every tensor of its state.

    Raises:
        UnsupportedModelError: something on the forward path that cannot be named exactly.
    """
    name, tensors = structure if structure is not None else model_structure(model)
    return f"model:{name}:{digest_tensors('live', tensors)}"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """The tokenizer's live options, special and added tokens, and vocabulary (read on every call)."""
    return tokenizer_identity(tokenizer)


def ambient_fingerprint() -> str:
    """The ambient torch state that changes a forward's numbers (autocast, matmul precision...)."""
    return ambient_identity()


def cache_code_fingerprint() -> str:
    """The live code of the cache classes every attention layer calls into (``DynamicLayer.update``...)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer

    from ._buffers import reserved_layer_classes

    reserved = reserved_layer_classes()
    return classes_identity(DynamicCache, DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer,
                            *(reserved or {}).values())
