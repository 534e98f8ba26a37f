"""Fingerprints of what produces KV tensors: config, weights, tokenizer, KV dtype and layout.

A fingerprint names the exact computation, so any change that could change a KV tensor
changes it too: the weights are hashed in full (xxh3 runs at memory speed: ~30 ms for
SmolLM2's 540 MB, far less than loading them), and the hash is redone when torch's
in-place version counter of any parameter moves.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

import numpy as np
import xxhash

__all__ = ["model_fingerprint", "tokenizer_fingerprint"]

# Config fields that name where a model came from, not what it computes.
_IRRELEVANT = {"_name_or_path", "transformers_version", "_commit_hash", "quantization_config", "torch_dtype", "dtype",
               "architectures", "_attn_implementation_autoset", "use_cache", "output_attentions",
               "output_hidden_states", "return_dict"}

_memo: weakref.WeakKeyDictionary[Any, tuple[tuple[int, ...], str]] = weakref.WeakKeyDictionary()


def _tensor_bytes(t: Any) -> np.ndarray:
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    return t.view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)


def model_fingerprint(model: Any) -> str:
    """A digest of the model's config, attention implementation and every weight and buffer."""
    params = list(model.parameters()) + list(model.buffers())
    versions = tuple(p._version for p in params)
    cached = _memo.get(model)
    if cached is not None and cached[0] == versions:
        return cached[1]
    h = xxhash.xxh3_128()
    config = {k: v for k, v in model.config.to_dict().items() if k not in _IRRELEVANT}
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    h.update(str(getattr(model.config, "_attn_implementation", "")).encode())
    h.update(type(model).__name__.encode())
    seen: set[int] = set()
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, t in sorted(named, key=lambda kv: kv[0]):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        if id(t) in seen:  # tied weights: hash the bytes once, the name twice
            continue
        seen.add(id(t))
        h.update(_tensor_bytes(t))
    fp = f"model:{h.hexdigest()}"
    _memo[model] = (versions, fp)
    return fp


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A digest of the tokenizer's full definition (vocabulary, merges, special tokens)."""
    if tokenizer is None:
        return "tokenizer:none"
    h = xxhash.xxh3_128()
    h.update(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())
    h.update(json.dumps(getattr(tokenizer, "all_special_tokens", []), sort_keys=True).encode())
    return f"tokenizer:{h.hexdigest()}"
