"""Running states of linear-attention and SSM layers (Gated DeltaNet, Mamba-style mixers in hybrids).

Such a layer keeps no per-token KV: after token *n* it holds a fixed set of tensors, a
convolution window and a recurrent state per sub-state (transformers' ``LinearAttentionLayer``).
A prefix can only be restored where its state was saved, so states are stored where a prefix
can end: every ``state_every`` blocks while a miss is computed, and at each request's end. An
entry holds every state layer's tensors, named ``"{layer}.conv{i}"`` and ``"{layer}.rec{i}"``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["STATE_KIND", "read_states", "restore_states", "state_layers", "states_fit", "state_signature"]

STATE_KIND = "llm.state"
_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}


def state_layers(cache: Any) -> list[int]:
    """Indices of the cache's layers that keep a running state (alone, or beside KV in one layer)."""
    return [i for i, layer in enumerate(getattr(cache, "layers", None) or []) if isinstance(layer, _state_class())]


def _state_class() -> Any:
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    return LinearAttentionCacheLayerMixin


def _tensors(layer: Any) -> list[tuple[str, Any]]:
    out = []
    for i in range(layer.number_of_states):
        if layer.is_conv_states_initialized[i]:
            out.append((f"conv{i}", layer.conv_states[i]))
        if layer.is_recurrent_states_initialized[i]:
            out.append((f"rec{i}", layer.recurrent_states[i]))
    return out


def read_states(cache: Any) -> dict[str, Any]:
    """Every state layer's tensors as the store takes them (bfloat16 as raw bits with its dtype name)."""
    import torch

    out: dict[str, Any] = {}
    for idx in state_layers(cache):
        for name, t in _tensors(cache.layers[idx]):
            t = t.detach().to("cpu").contiguous().clone()
            out[f"{idx}.{name}"] = ((t.view(torch.int16).numpy().view(np.uint16), "BF16") if t.dtype == torch.bfloat16
                                    else t.numpy())
    return out


def state_signature(cache: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, stored dtype) of every state tensor: what a stored state must hold to fit."""
    return {f"{idx}.{name}": (tuple(int(d) for d in t.shape), _DTYPES.get(str(t.dtype).replace("torch.", ""), "?"))
            for idx in state_layers(cache) for name, t in _tensors(cache.layers[idx])}


def states_fit(entry: Any, signature: dict[str, tuple[tuple[int, ...], str]]) -> bool:
    """Whether a stored entry holds exactly the state tensors of ``signature`` (names, shapes, dtypes)."""
    tensors = {n: t for n, t in entry.tensors.items() if n[:1].isdigit()}
    return bool(signature) and set(tensors) == set(signature) and all(
        tuple(tensors[n].shape) == shape and entry.dtypes[n] == dtype for n, (shape, dtype) in signature.items())


def restore_states(cache: Any, entry: Any, device: Any, n_tokens: int) -> None:
    """Put a stored state of ``n_tokens`` tokens into the cache's state layers, as if the model had just run them.

    Always normal tensors, even under ``torch.inference_mode()``: the model updates them in place,
    and a caller may continue the cache outside it (as for the KV buffers, see KVBuffers.allocate).
    """
    import torch

    with torch.inference_mode(False):
        _restore(cache, entry, device)
        for idx in state_layers(cache):
            # A layer that counts the tokens it has run (transformers' cumulative_length_linear) answers
            # the cache's get_seq_length, from which the model takes the next positions and masks.
            count = getattr(cache.layers[idx], "cumulative_length_linear", None)
            if count is not None:
                cache.layers[idx].cumulative_length_linear = torch.tensor(n_tokens, dtype=count.dtype, device=device)


def _restore(cache: Any, entry: Any, device: Any) -> None:
    import torch

    for name, arr in entry.tensors.items():
        if not name[:1].isdigit():
            continue
        idx, _, part = name.partition(".")
        layer = cache.layers[int(idx)]
        t = torch.from_numpy(np.array(arr))  # a writable copy: the stored array may be a read-only view
        if entry.dtypes[name] == "BF16":
            t = t.view(torch.bfloat16)
        t = t.to(device)
        i = int(part.removeprefix("conv").removeprefix("rec"))
        if part.startswith("conv"):
            layer.lazy_initialization(conv_states=t, state_idx=i, conv_kernel_size=t.shape[-1])
            layer.conv_states[i].copy_(t)
            # The model then continues from this state (concatenating its window) instead of
            # padding a fresh one.
            layer.has_previous_state[i] = True
        else:
            layer.lazy_initialization(recurrent_states=t, state_idx=i)
            layer.recurrent_states[i].copy_(t)
            layer.has_previous_state[i] = True
