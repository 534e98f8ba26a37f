"""Digests that fingerprints are built from: files (memoised) and named tensors (never memoised).

Both adapters name weights with these, so a file or a tensor gets the same digest whichever
adapter looks at it. Names and tensors are framed with length prefixes, like keys: a name can
hold any character without colliding with the next field.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
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
    flat = t.contiguous().reshape(-1)  # reshape: 0-dim tensors too (Gemma's embed_scale)
    if flat.device.type != "cpu":
        # Copying every weight to the host on every request would cost more than the hit saves
        # (16 GB for an 8B fp16 model): reduce on the device, bring 16 bytes back.
        return f"{t.dtype}@device", tuple(t.shape), ident, device_word_digest(torch, flat)
    data = flat.view(torch.uint8).numpy() if flat.numel() else np.zeros(0, np.uint8)
    return str(t.dtype), tuple(t.shape), ident, data


_CHUNK_WORDS = 1 << 24  # 16M words: temporaries of 128 MB at most


def device_word_digest(torch: Any, flat: Any) -> np.ndarray:
    """Two position-weighted sums of a tensor's 32-bit words, mod 2**64, computed where it lives.

    Every weight is odd, so changing any single word changes both sums; unrelated edits
    collide with probability about 2**-128. Used for tensors on accelerators (and tested on
    the CPU): 16 bytes cross to the host instead of the tensor.
    """
    raw = flat.view(torch.uint8)
    if raw.numel() % 4:
        raw = torch.cat([raw, raw.new_zeros(4 - raw.numel() % 4)])
    words = raw.view(torch.int32)
    sums = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for lo in range(0, words.numel(), _CHUNK_WORDS):
        x = words[lo : lo + _CHUNK_WORDS].to(torch.int64) & 0xFFFFFFFF
        i = torch.arange(lo, lo + x.numel(), dtype=torch.int64, device=flat.device)
        a = i * -7046029254386353131 + 7256917087563474969  # 0x9E3779B97F4A7C15, 0x64B5F4F1A1E03E19
        b = i * -4658895280553007687 + 1442695040888963407  # 0xBF58476D1CE4E5B9, Knuth's LCG increment
        sums[0] += (x * (a | 1)).sum()  # int64 products and sums wrap: arithmetic mod 2**64
        sums[1] += ((x ^ (x << 17)) * (b | 1)).sum()
    out: np.ndarray = sums.cpu().numpy().view(np.uint8)
    return out


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
    big: list[tuple[int, np.ndarray]] = []
    fields: list[bytes | np.ndarray] = []
    for name, t in named:
        dtype, shape, ident, data = _raw(t)
        fields.append(_framed(name.encode("utf-8", "surrogatepass")))
        if data.size and ident in seen:
            fields.append(_framed(f"tied:{seen[ident]}".encode()))
            continue
        seen[ident] = name
        fields.append(_framed(f"{dtype}{shape}".encode()) + data.size.to_bytes(8, "little"))
        if data.size >= _PARALLEL_BYTES:
            big.append((len(fields), data))
            fields.append(b"")  # its digest, filled in below
        else:
            fields.append(data)
    # xxh3 releases the GIL: large tensors are hashed on several cores, each to its own digest,
    # and the digests go into the outer hash in order (SmolLM2's 540 MB: 37 ms -> 25 ms on 2 cores).
    if big:
        with ThreadPoolExecutor(max_workers=min(len(big), os.cpu_count() or 1, 8)) as pool:
            for (slot, _), digest in zip(big, pool.map(lambda item: xxhash.xxh3_128_digest(item[1].data), big),
                                         strict=True):
                fields[slot] = digest
    for f in fields:
        h.update(f if isinstance(f, bytes) else f.data)
    return h.hexdigest()


_PARALLEL_BYTES = 1 << 20


def _framed(data: bytes) -> bytes:
    return len(data).to_bytes(8, "little") + data
