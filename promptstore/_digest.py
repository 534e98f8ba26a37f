"""Digests that fingerprints are built from: files (memoised) and named tensors (never memoised).

Both adapters name weights with these, so a file or a tensor gets the same digest whichever
adapter looks at it. Names and tensors are framed with length prefixes, like keys: a name can
hold any character without colliding with the next field.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

__all__ = ["file_digest", "digest_tensors"]

_files: dict[tuple[str, int, int], str] = {}


def file_digest(path: str | os.PathLike[str]) -> str:
    """xxh3-128 of a file's bytes, memoised by (resolved path, size, mtime): read once per process.

    Raises:
        FileNotFoundError: no such file.
    """
    p = Path(path).resolve()
    st = p.stat()
    memo = (str(p), st.st_size, st.st_mtime_ns)
    if memo not in _files:
        h = xxhash.xxh3_128()
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        _files[memo] = h.hexdigest()
    return _files[memo]


def _frame(h: xxhash.xxh3_128, data: bytes) -> None:
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)


def _raw(t: Any) -> tuple[str, tuple[int, ...], Any, np.ndarray]:
    """(dtype name, shape, identity, bytes) of a numpy array or a torch tensor."""
    if isinstance(t, np.ndarray):
        arr = np.ascontiguousarray(t)
        ident = (t.__array_interface__["data"][0], t.dtype.str, t.shape, t.strides)
        return t.dtype.str, tuple(t.shape), ident, arr.reshape(-1).view(np.uint8)
    torch = sys.modules.get("torch")  # a tensor means torch is loaded: the core never imports it
    if torch is None or not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a numpy array or a torch tensor, got {type(t).__name__}")
    t = t.detach()
    ident = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
    flat = t.cpu().contiguous().reshape(-1)  # reshape: 0-dim tensors too (Gemma's embed_scale)
    data = flat.view(torch.uint8).numpy() if flat.numel() else np.zeros(0, np.uint8)
    return str(t.dtype), tuple(t.shape), ident, data


def digest_tensors(label: str, named: Iterable[tuple[str, Any]]) -> str:
    """xxh3-128 over the name, dtype, shape and raw bytes of each tensor, in the order given.

    The bytes are hashed on every call (about 15 GB/s on one core), never memoised: an
    in-place write that no version counter sees (``param.data[...] += x``) still changes the
    digest. A tensor shared under several names (tied weights) is hashed once, its other
    names recorded as ties.

    Args:
        label: what the tensors are (framed first).
        named: ``(name, tensor)`` pairs; numpy arrays or torch tensors on any device.
    """
    h = xxhash.xxh3_128()
    _frame(h, label.encode())
    seen: dict[Any, str] = {}
    for name, t in named:
        dtype, shape, ident, data = _raw(t)
        _frame(h, name.encode("utf-8", "surrogatepass"))
        if data.size and ident in seen:
            _frame(h, f"tied:{seen[ident]}".encode())
            continue
        seen[ident] = name
        _frame(h, f"{dtype}{shape}".encode())
        h.update(data.size.to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()
