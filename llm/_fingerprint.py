"""Fingerprints of what produces KV tensors: config, weights, tokenizer, KV dtype and layout.

A fingerprint names the exact computation, so any change that could change a KV tensor
changes it too. The weights are hashed in full on every request, never memoised: torch's
version counters miss edits made through ``param.data`` (assignment, in-place writes on
it, ``.half()`` then ``.float()``), which then served the old weights' KV (issue #10).
xxh3 runs at ~15 GB/s, so SmolLM2's 540 MB cost ~37 ms (measured, one core).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np

from promptstore import digest_arrays

__all__ = ["model_fingerprint", "tokenizer_fingerprint", "tensor_arrays"]

# Config fields that name where a model came from, not what it computes.
_IRRELEVANT = {"_name_or_path", "transformers_version", "_commit_hash", "quantization_config", "torch_dtype", "dtype",
               "architectures", "_attn_implementation_autoset", "use_cache", "output_attentions",
               "output_hidden_states", "return_dict"}


def tensor_arrays(named: list[tuple[str, Any]]) -> Iterator[tuple[str, str, tuple[int, ...], np.ndarray]]:
    """``(name, dtype, shape, bytes)`` of torch tensors for :func:`promptstore.digest_arrays`.

    A tensor shared under several names (tied weights) has its bytes hashed once.
    """
    import torch

    seen: dict[tuple[int, Any, tuple[int, ...], tuple[int, ...]], str] = {}
    for name, t in named:
        t = t.detach()
        ident = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
        if t.numel() and ident in seen:
            yield name, f"tied:{seen[ident]}", tuple(t.shape), np.zeros(0, np.uint8)
            continue
        seen[ident] = name
        flat = t.cpu().contiguous().reshape(-1)  # reshape: 0-dim buffers (Gemma's embed_scale) too
        yield name, str(t.dtype), tuple(t.shape), flat.view(torch.uint8).numpy() if flat.numel() else np.zeros(0, np.uint8)


def model_fingerprint(model: Any) -> str:
    """A digest of the model's class, config, attention implementation and every weight and buffer."""
    config = {k: v for k, v in model.config.to_dict().items() if k not in _IRRELEVANT}
    label = json.dumps([type(model).__name__, str(getattr(model.config, "_attn_implementation", "")), config],
                       sort_keys=True, default=str)
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    return "model:" + digest_arrays(label, tensor_arrays(sorted(named, key=lambda kv: kv[0])))


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A digest of the tokenizer's full definition (vocabulary, merges, special tokens)."""
    if tokenizer is None:
        return "tokenizer:none"
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    special = json.dumps(getattr(tokenizer, "all_special_tokens", []), sort_keys=True)
    return "tokenizer:" + digest_arrays(type(tokenizer).__name__, [
        ("definition", "utf8", (), np.frombuffer(definition.encode(), np.uint8)),
        ("special", "utf8", (), np.frombuffer(special.encode(), np.uint8))])
