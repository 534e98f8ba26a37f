"""Where loaded KV lives: host and GPU buffers with room to grow, reused across requests, and copies into them.

A load reads every stored block straight into its slice of one buffer per side (keys, values)
for all layers; the cache handed to the model is made of views of those buffers, written in
place as the prompt's tail and the generated tokens arrive.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
import threading
from typing import Any

import numpy as np

__all__ = ["CAPACITY_STEP", "RESERVE_TOKENS", "KVBuffers", "copy_block", "host_view", "kv_layers", "held_tokens", "make_cache", "reserved_layer_classes", "warm_allocator"]

RESERVE_TOKENS = 256  # room left after the prompt in loaded caches (more is allocated by doubling)
CAPACITY_STEP = 512  # load buffers hold a multiple of this many tokens


def kv_layers(cache: Any) -> list[tuple[Any, Any]]:
    """(keys, values) of every layer that keeps KV, across transformers' cache layouts.

    Linear-attention/SSM layers (a running state, no KV) and layers without a cache of their
    own (``DummyLayer``) are left out: see _states.py.
    """
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers
                if hasattr(layer, "keys") and type(layer).__name__ != "DummyLayer"]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))  # transformers < 4.56


class KVBuffers:
    """The buffers one PrefixCache loads KV into: host pairs reused across requests, pinned slots for a GPU."""

    def __init__(self) -> None:
        self._staging: list[tuple[Any, Any]] | None = None  # pinned host slots for copies to a GPU
        self._pool: list[tuple[np.ndarray, np.ndarray]] = []  # host KV buffers, reused once no tensor holds them

    def staging_slots(self, layout: tuple[int, int, int, int, Any], block_tokens: int, n: int) -> list[tuple[Any, Any]]:
        """Pinned host blocks that GPU loads are read into (allocated once: pinning is slow)."""
        import torch

        layers, heads, k_dim, v_dim, dtype = layout
        kshape, vshape = (layers, heads, block_tokens, k_dim), (layers, heads, block_tokens, v_dim)
        if self._staging is None or len(self._staging) < n or self._staging[0][0].shape != kshape \
                or self._staging[0][1].shape != vshape or self._staging[0][0].dtype != dtype:
            self._staging = [(torch.empty(kshape, dtype=dtype, pin_memory=True),
                              torch.empty(vshape, dtype=dtype, pin_memory=True)) for _ in range(n)]
        return self._staging[:n]

    def allocate(self, layout: tuple[int, int, int, int, Any], device: Any, capacity: int) -> tuple[Any, Any]:
        """A (keys, values) pair of shape (layers, 1, kv heads, capacity, key or value width) on ``device``.

        Always normal tensors, even when called under ``torch.inference_mode()``: a cache the
        caller continues outside it is written in place (an inference tensor refuses that).
        """
        import torch

        with torch.inference_mode(False):
            return self._allocate(layout, device, capacity)

    def _allocate(self, layout: tuple[int, int, int, int, Any], device: Any, capacity: int) -> tuple[Any, Any]:
        import torch

        layers, heads, k_dim, v_dim, dtype = layout
        shape = (layers, 1, heads, capacity, k_dim)
        vshape = (*shape[:4], v_dim)
        # One buffer per side for all layers; each block is copied once, straight into the
        # final per-layer tensors (views of these).
        if device.type == "cuda":
            # pragma: no mutate start (a GPU's buffers: no GPU here)
            return (torch.empty(shape, dtype=dtype, device=device),
                    torch.empty(vshape, dtype=dtype, device=device))
            # pragma: no mutate end
        # A pair whose every tensor is gone (the caller dropped that request's cache) is reused:
        # its pages are already faulted in, so a load costs the copy and little else.
        np_dtype = np.dtype(np.int16) if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype
        pair = None
        for i in range(len(self._pool)):
            held, held_v = self._pool[i]
            fits = (held.dtype == np_dtype and held.shape[:3] == shape[:3] and held.shape[3] >= capacity
                    and held.shape[4] == k_dim and held_v.shape[4] == v_dim)
            del held, held_v
            # Refcount 2 (the pool's tuple and the call's argument): no tensor of an earlier cache holds it.
            if fits and sys.getrefcount(self._pool[i][0]) == 2 and sys.getrefcount(self._pool[i][1]) == 2:
                pair = self._pool.pop(i)
                break
        if pair is None:
            pair = (_fresh_buffer(shape, np_dtype), _fresh_buffer(vshape, np_dtype))
        self._pool = [pair, *self._pool][:2]  # the last two requests' buffers: one may still be held
        out = tuple(torch.from_numpy(a) for a in pair)
        if dtype == torch.bfloat16:
            out = tuple(t.view(torch.bfloat16) for t in out)
        return out[0], out[1]


def make_cache(buffers: tuple[Any, Any], n: int, config: Any) -> Any:
    """A DynamicCache over the first ``n`` tokens of per-layer buffers, without copying them."""
    import torch

    with torch.inference_mode(False):  # normal views of normal buffers (see KVBuffers.allocate)
        return _make_cache(buffers, n, config)


def _make_cache(buffers: tuple[Any, Any], n: int, config: Any) -> Any:
    from transformers import DynamicCache

    full_k, full_v = buffers
    kv = [(full_k[i], full_v[i]) for i in range(full_k.shape[0])]
    cache = DynamicCache(config=config)
    layers = getattr(cache, "layers", None)
    classes = reserved_layer_classes()
    keeps_kv = [layer for layer in layers or [] if type(layer).__name__ in (classes or {})]
    if classes is not None and layers is not None and len(keeps_kv) == len(kv):
        made, next_kv = [], iter(kv)
        for layer in layers:
            kind = type(layer).__name__
            if kind in classes:
                made.append(classes[kind](*next(next_kv), n, layer))
            elif kind in ("LinearAttentionLayer", "DummyLayer"):
                made.append(layer)  # a state layer gets its state from the store (_states.py); a dummy keeps none
            else:
                break
        else:
            cache.layers = made
            return cache
    # Another cache layout (older transformers): hand over exactly the filled part.
    cache = DynamicCache()
    for i, (k, v) in enumerate(kv):
        cache.update(k[:, :, :n], v[:, :, :n], i)
    return cache


def held_tokens(cache: Any) -> set[int]:
    """How many tokens' keys each layer holds (one number when every layer holds the whole sequence)."""
    return {int(k.shape[-2]) if k is not None else -1 for k, _ in kv_layers(cache)}


_RESERVED: Any = False


def reserved_layer_classes() -> Any:
    """Cache layers that write new tokens into spare capacity instead of concatenating, by the class they replace.

    transformers' DynamicLayer copies the whole cached prefix on every forward (torch.cat),
    the prompt's tail and then each generated token: O(prefix) per step. Loaded caches already
    live in buffers we allocated, so they are allocated with room to grow and written in place;
    when the room runs out the buffer doubles. Anything that replaces ``keys`` behind our back
    (beam reordering) sends the layer back to plain concatenation. None if DynamicLayer is absent.

    The sliding-window layer keeps every token's KV (so that blocks can be stored from it, as
    transformers' own layer does when it records its past) and hands attention exactly what
    ``DynamicSlidingWindowLayer.update`` hands it: the last ``sliding_window - 1`` cached tokens
    and the new ones, with the same ``cumulative_length`` for the mask.
    """
    global _RESERVED
    if _RESERVED is not False:
        return _RESERVED
    try:
        from transformers.cache_utils import (
            DynamicLayer,
            DynamicSlidingWindowLayer,
            LinearAttentionAndFullAttentionLayer,
            LinearAttentionAndSlidingWindowAttentionLayer,
        )
    except ImportError:
        _RESERVED = None
        return None

    import torch

    class _InPlace:
        _kbuf: Any
        _vbuf: Any
        _n: int
        keys: Any
        values: Any

        def _reserve(self, kbuf: Any, vbuf: Any, n: int) -> None:
            self.lazy_initialization(kbuf, vbuf)  # type: ignore[attr-defined]
            self._kbuf, self._vbuf, self._n = kbuf, vbuf, n
            self.keys, self.values = kbuf[:, :, :n], vbuf[:, :, :n]

        def _in_place(self) -> bool:
            k = self.keys
            if k is not None and k.ndim == 4 and k.shape[-2] == 0 and k.shape[:-2] == self._kbuf.shape[:-2]:
                self._n = 0  # empty: its data_ptr is 0, not the buffer's
                return True
            if k is None or k.data_ptr() != self._kbuf.data_ptr() or k.stride() != self._kbuf.stride():
                return False
            self._n = k.shape[-2]  # e.g. after crop(): still a prefix of our buffer
            return True

        def _write(self, key_states: Any, value_states: Any) -> tuple[Any, Any]:
            n, m = self._n, key_states.shape[-2]
            if n + m > self._kbuf.shape[-2]:
                cap = max(n + m, 2 * self._kbuf.shape[-2])
                for name in ("_kbuf", "_vbuf"):
                    old = getattr(self, name)
                    new = torch.empty((*old.shape[:-2], cap, old.shape[-1]), dtype=old.dtype, device=old.device)
                    new[:, :, :n] = old[:, :, :n]
                    setattr(self, name, new)
            self._kbuf[:, :, n : n + m] = key_states
            self._vbuf[:, :, n : n + m] = value_states
            self._n = n + m
            self.keys, self.values = self._kbuf[:, :, : self._n], self._vbuf[:, :, : self._n]
            return self.keys, self.values

    class _Full(_InPlace):
        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            if not self.is_initialized or not self._in_place():  # type: ignore[attr-defined]
                return super().update(key_states, value_states, *args, **kwargs)  # type: ignore[misc, no-any-return]
            with torch.inference_mode(False):  # our buffers stay normal tensors, whatever mode the caller is in
                return self._write(key_states, value_states)

    class _Sliding(_InPlace):
        sliding_window: int
        cumulative_length: int

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            if not self.is_initialized or not self._in_place() or self._n != self.cumulative_length:  # type: ignore[attr-defined]
                # Back to transformers' own layer, holding what it would hold (the window): the
                # cache then holds fewer tokens than the sequence, so nothing is stored from it.
                if self.keys is not None and self.keys.shape[-2] > self.sliding_window - 1:
                    self.keys = self.keys[:, :, -self.sliding_window + 1 :]
                    self.values = self.values[:, :, -self.sliding_window + 1 :]
                return super().update(key_states, value_states, *args, **kwargs)  # type: ignore[misc, no-any-return]
            with torch.inference_mode(False):
                keys, values = self._write(key_states, value_states)
            self.cumulative_length = self._n
            visible = self.sliding_window - 1 + key_states.shape[-2]  # as DynamicSlidingWindowLayer hands them
            return keys[:, :, -visible:], values[:, :, -visible:]

    # Each takes (keys buffer, values buffer, tokens held, the layer transformers built for this place).
    class _ReservedLayer(_Full, DynamicLayer):
        def __init__(self, kbuf: Any, vbuf: Any, n: int, like: Any = None) -> None:
            DynamicLayer.__init__(self)
            self._reserve(kbuf, vbuf, n)

    class _ReservedSlidingLayer(_Sliding, DynamicSlidingWindowLayer):
        def __init__(self, kbuf: Any, vbuf: Any, n: int, like: Any) -> None:
            DynamicSlidingWindowLayer.__init__(self, like.sliding_window)
            self._reserve(kbuf, vbuf, n)
            self.cumulative_length = n

    # Layers that keep a running state and KV in one (Falcon-H1, Zaya): KV as above, the state
    # from the store (_states.py).
    # ignore[misc]: transformers' own bases of these two disagree on `device` (and on activate_past_recording).
    class _ReservedStateLayer(_Full, LinearAttentionAndFullAttentionLayer):  # type: ignore[misc]
        def __init__(self, kbuf: Any, vbuf: Any, n: int, like: Any) -> None:
            LinearAttentionAndFullAttentionLayer.__init__(self, number_of_states=like.number_of_states)
            self._reserve(kbuf, vbuf, n)

    class _ReservedStateSlidingLayer(_Sliding, LinearAttentionAndSlidingWindowAttentionLayer):  # type: ignore[misc]
        def __init__(self, kbuf: Any, vbuf: Any, n: int, like: Any) -> None:
            LinearAttentionAndSlidingWindowAttentionLayer.__init__(self, like.sliding_window,
                                                                   number_of_states=like.number_of_states)
            self._reserve(kbuf, vbuf, n)
            self.cumulative_length = n

    _RESERVED = {"DynamicLayer": _ReservedLayer, "DynamicSlidingWindowLayer": _ReservedSlidingLayer,
                 "LinearAttentionAndFullAttentionLayer": _ReservedStateLayer,
                 "LinearAttentionAndSlidingWindowAttentionLayer": _ReservedStateSlidingLayer}
    return _RESERVED


def _fresh_buffer(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Anonymous memory whose pages a background thread faults in while the request fingerprints the model.

    New memory costs a page fault and a zero-fill per page on first write (~1.5 GB/s on the
    2-core VM, more than the copy itself). Started here, that work overlaps the fingerprint
    and the first block reads instead of stalling them. Plain pages, not transparent huge
    pages: on a fragmented machine their compaction stalled the first write for ~0.5 s (measured).
    """
    size = max(1, int(np.prod(shape)) * dtype.itemsize)
    area = mmap.mmap(-1, size)
    out = np.frombuffer(area, dtype=dtype, count=int(np.prod(shape))).reshape(shape)
    madvise = _libc_madvise()
    if madvise is not None:
        address = out.ctypes.data

        def populate(keep: mmap.mmap = area) -> None:  # holds the mapping until done: never another's pages
            madvise(address, size, 23)  # MADV_POPULATE_WRITE (Linux >= 5.14); fails harmlessly elsewhere

        # Through ctypes, which lets go of the GIL for the call (mmap.madvise holds it throughout).
        threading.Thread(target=populate, name="promptstore-kv-populate", daemon=True).start()
    return out


@functools.lru_cache(maxsize=1)
def _libc_madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


# glibc's most an allocation raises its mmap threshold to (DEFAULT_MMAP_THRESHOLD_MAX on 64 bits).
_GLIBC_THRESHOLD_MAX = 32 << 20


@functools.lru_cache(maxsize=1)
def warm_allocator() -> None:
    """Raise glibc's mmap threshold to its dynamic maximum, once per process.

    A forward over a long cached prefix allocates temporaries the size of a layer's whole KV
    (sdpa with a mask repeats grouped KV heads: 9 MB per tensor at 4k tokens for SmolLM2). A
    fresh process's threshold (128 KiB) maps each of them anew and unmaps it on free, so every
    layer of every request faults its pages in again (~1.5 GB/s here: a 4k request ran at 2x its
    floor). glibc raises the threshold itself once a mapped chunk under 32 MiB is freed, as after
    any long prefill; one such malloc and free here (no page touched) puts a fresh process in that
    state, so the temporaries come from the heap and stay faulted. Nothing else changes.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        malloc, free = libc.malloc, libc.free
        if not hasattr(libc, "gnu_get_libc_version"):
            return  # another C library: its allocator has no such threshold
    except (OSError, AttributeError):
        return
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    free.argtypes = [ctypes.c_void_p]
    block = malloc(_GLIBC_THRESHOLD_MAX - (64 << 10))
    if block:
        free(block)


def host_view(t: Any) -> np.ndarray:
    """A numpy view of a CPU tensor (bfloat16 as its raw uint16 bits)."""
    import torch

    view: np.ndarray = t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()
    return view


def copy_block(dst: np.ndarray, src: np.ndarray, stored: str, dtype: Any) -> None:
    """Copy one stored block into its slice of the final buffer, converting the dtype."""
    import torch

    if dtype == torch.bfloat16:
        if stored == "BF16":
            np.copyto(dst, src)
        else:
            as_torch = torch.from_numpy(np.array(src, dtype=np.float32 if stored == "F32" else np.float16))
            np.copyto(dst, as_torch.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
    elif stored == "BF16":
        # bfloat16 is the top half of a float32: widening is a shift, exact and fast.
        np.copyto(dst, (src.astype(np.uint32) << 16).view(np.float32), casting="unsafe")
    else:
        np.copyto(dst, src, casting="unsafe")
