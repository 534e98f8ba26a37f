"""Digests that fingerprints are built from: files and named tensors.

Both adapters name weights with these, so a file or a tensor gets the same digest whichever
adapter looks at it. Names and tensors are framed with length prefixes, like keys: a name can
hold any character without colliding with the next field.

Tensor bytes are never trusted from a memo by themselves: torch's version counters miss
writes through ``param.data``. Two exceptions are proven by the kernel. Anonymous memory
(weights built or copied in the process) that the kernel shows unwritten since it was hashed
keeps its digest for the process (see ``_watch``). A
tensor that lies in a private mapping of a file (transformers and safetensors load weights
that way) and whose pages are all still the file's pages (a write would have copied the
page into anonymous memory, which ``/proc/self/pagemap`` shows) holds exactly the file's
bytes at that offset. Their digest is then memoised by the file's identity (device, inode,
size, mtime, ctime) in a small SQLite file shared by processes, so a fresh process names a
model loaded from files without reading its weights. The digest is the same
xxh3-128 either way: keys agree whether the bytes were hashed or their digest recalled.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import os
import re
import sqlite3
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import numpy as np
import xxhash

from . import _watch
from ._kernel import (
    PAGE_IS_FILE,
    PAGE_IS_PRESENT,
    PAGEMAP_SCAN,
    PROCMAP_QUERY,
    VMA_SHARED,
    PageRegion,
    PmScanArg,
    ProcmapQuery,
)

try:
    import fcntl
except ImportError:  # not on Windows, where no mapping is proven
    fcntl = None  # type: ignore[assignment]

__all__ = ["file_digest", "digest_tensors", "digest_memo_path", "derived_digest"]

# A file changed within this many seconds of its last stat may share its timestamps with the
# content we hashed (timestamps are coarse): such digests are used but never remembered.
_RACY_S = 2.0
_MAPPED_MIN_BYTES = 1 << 16  # smaller tensors are hashed: cheaper than looking at their pages
_WATCHED_MIN_BYTES = 1 << 20  # smaller anonymous tensors are hashed (65 us): cheaper than protecting their pages
_PROOF_MIN_TOTAL = 64 << 20  # below this many candidate bytes, hashing them (~4 ms) beats reading the maps
_SPAN_GAP_PAGES = 256  # ranges this close (1 MB) share one read of /proc/self/pagemap
_KNOWN: Any = ("known",)  # a todo item whose digest was recalled
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

Identity = tuple[int, int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns
_Mapping = tuple[int, int, int, int, int, str]  # start, end, file offset, device, inode, path


def digest_memo_path() -> Path | None:
    """Where file digests are remembered between processes.

    ``$PROMPTSTORE_DIGESTS`` (a file path; empty turns the memo off), else
    ``digests.sqlite3`` in the user cache folder ``promptstore-digests``.
    """
    env = os.environ.get("PROMPTSTORE_DIGESTS")
    if env is not None:
        return Path(env).expanduser() if env else None
    import platformdirs

    return Path(platformdirs.user_cache_dir("promptstore-digests", appauthor=False)) / "digests.sqlite3"


class _Memo:
    """(file identity, offset, length) -> xxh3-128 of those bytes: in process, and in SQLite across processes.

    The SQLite file is a cache: if it cannot be opened or written, digests are computed
    as if it were empty (never an error).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: dict[tuple[Identity, int, int], bytes] = {}
        self._loaded: set[Identity] = set()
        self._db: sqlite3.Connection | None = None
        self._db_path: Path | None = None
        self._broken = False

    def _conn(self) -> sqlite3.Connection | None:
        path = digest_memo_path()
        if path != self._db_path:
            if self._db is not None:
                self._db.close()
            self._db, self._db_path, self._broken, self._loaded = None, path, False, set()
        if self._db is None and path is not None and not self._broken:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                db = sqlite3.connect(path, timeout=5.0, isolation_level=None, check_same_thread=False)
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=NORMAL")  # a lost row is recomputed, never wrong
                db.execute("CREATE TABLE IF NOT EXISTS digests (dev INTEGER, ino INTEGER, size INTEGER, "
                           "mtime_ns INTEGER, ctime_ns INTEGER, offset INTEGER, length INTEGER, digest BLOB, "
                           "PRIMARY KEY (dev, ino, size, mtime_ns, ctime_ns, offset, length)) WITHOUT ROWID")
                db.execute("CREATE TABLE IF NOT EXISTS derived (name BLOB PRIMARY KEY, digest TEXT) WITHOUT ROWID")
                self._db = db
            except (sqlite3.Error, OSError):
                self._broken = True
        return self._db

    def get(self, ident: Identity, offset: int, length: int) -> bytes | None:
        with self._lock:
            if ident not in self._loaded:
                self._loaded.add(ident)
                db = self._conn()
                if db is not None:
                    try:
                        rows = db.execute("SELECT offset, length, digest FROM digests WHERE dev=? AND ino=? AND "
                                          "size=? AND mtime_ns=? AND ctime_ns=?", ident).fetchall()
                    except sqlite3.Error:
                        rows = []
                    for off, n, d in rows:
                        if isinstance(d, bytes) and len(d) == 16:
                            self._known[(ident, off, n)] = d
            return self._known.get((ident, offset, length))

    def put(self, rows: list[tuple[Identity, int, int, bytes]]) -> None:
        """Remember ``(identity, offset, length, digest)`` rows, in one transaction."""
        if not rows:
            return
        with self._lock:
            for ident, offset, length, digest in rows:
                self._known[(ident, offset, length)] = digest
            db = self._conn()
            if db is not None:
                try:
                    with db:
                        db.execute("BEGIN")
                        db.executemany("INSERT OR REPLACE INTO digests VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                                       [(*ident, off, n, d) for ident, off, n, d in rows])
                except sqlite3.Error:
                    pass


    def derived(self, name: bytes, digest: str | None = None) -> str | None:
        """The digest remembered under ``name`` (with ``digest``: remember it first)."""
        with self._lock:
            db = self._conn()
            if db is None:
                return digest
            try:
                if digest is not None:
                    db.execute("INSERT OR REPLACE INTO derived VALUES (?, ?)", (name, digest))
                    return digest
                row = db.execute("SELECT digest FROM derived WHERE name=?", (name,)).fetchone()
            except sqlite3.Error:
                return digest
            return row[0] if row is not None and isinstance(row[0], str) else None


_memo = _Memo()


def derived_digest(name: str, compute: Callable[[], str]) -> str:
    """``compute()``, remembered between processes under ``name`` (in :func:`digest_memo_path`).

    For a digest that is a pure function of files and versions but costly to derive (a Rust
    tokenizer's serialised vocabulary): ``name`` must hold everything the result depends on,
    the files by their :func:`file_digest`. Like file digests, the memo is a cache: when it
    cannot be read or written, ``compute()`` runs.
    """
    key = xxhash.xxh3_128_digest(name.encode("utf-8", "surrogatepass"))
    known = _memo.derived(key)
    if known is not None:
        return known
    out = compute()
    _memo.derived(key, out)
    return out


def _identity(st: os.stat_result) -> Identity:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns




def file_digest(path: str | os.PathLike[str]) -> str:
    """xxh3-128 of a file's bytes, read once per file version on this machine.

    Remembered by the file's device, inode, size, mtime and ctime (in this process and in
    :func:`digest_memo_path`), so a fresh process does not read it again. A file changed in
    the last two seconds is hashed every time until its timestamps settle.

    Raises:
        FileNotFoundError: no such file.
    """
    st = os.stat(path)
    ident = _identity(st)
    known = _memo.get(ident, 0, st.st_size)
    if known is not None:
        return known.hex()
    with open(path, "rb") as f:
        before = os.fstat(f.fileno())
        h = xxhash.xxh3_128()
        while chunk := f.read(1 << 22):
            h.update(chunk)
        digest = h.digest()
        after = os.fstat(f.fileno())
    if _identity(before) == _identity(after) == ident and _settled(ident):
        _memo.put([(ident, 0, st.st_size, digest)])
    return digest.hex()


# A private mapping of a file: "start-end perms offset major:minor inode path".
_MAPS_LINE = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) [r-][w-][x-]p ([0-9a-f]+) ([0-9a-f]+):([0-9a-f]+) ([1-9][0-9]*) +(/.*)$",
                        re.MULTILINE)
# A page present (bit 63) and still the file's (bit 61) in /proc/self/pagemap.
_FILE_PAGE = np.uint64((1 << 63) | (1 << 61))


_procmap_query_works: bool | None = None  # learnt on first use: older kernels answer ENOTTY
_SCAN_REGIONS = 64  # regions of pages not the file's that one scan reports; more: read every page's entry
_pagemap_scan_works: bool | None = None  # learnt on first use: older kernels answer ENOTTY


class _Pages:
    """Which private file mappings of this process still hold only the file's own pages (Linux).

    A mapping is looked up by address: one ``PROCMAP_QUERY`` ioctl per mapping where the kernel
    has it (a process holding torch has hundreds of mappings: reading and parsing all of
    ``/proc/self/maps`` costs milliseconds), else ``/proc/self/maps`` read once. A range's pages
    are asked of ``/proc/self/pagemap``: only those not the file's (``PAGEMAP_SCAN``) where the
    kernel has it, else every page's entry (8 bytes per 4 KB page), the range's own pages only.
    """

    def __init__(self) -> None:
        self.maps: list[_Mapping] = []  # start, end, offset, dev, inode, path
        self.starts: list[int] = []
        self.pagemap: int | None = None
        self.stats: dict[str, os.stat_result | None] = {}
        self._maps_fd: int | None = None
        self._read_all = False
        try:
            self.pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)
            self._maps_fd = os.open("/proc/self/maps", os.O_RDONLY)
        except OSError:
            self.close()

    def close(self) -> None:
        for fd in (self.pagemap, self._maps_fd):
            if fd is not None:
                os.close(fd)
        self.pagemap = self._maps_fd = None

    def _known(self, addr: int) -> _Mapping | None:
        i = bisect.bisect_right(self.starts, addr) - 1
        return self.maps[i] if i >= 0 and addr < self.maps[i][1] else None

    def _add(self, mapping: _Mapping) -> None:
        i = bisect.bisect_right(self.starts, mapping[0])
        self.maps.insert(i, mapping)
        self.starts.insert(i, mapping[0])

    def _query(self, addr: int) -> _Mapping | None | Literal[False]:
        """The private file mapping covering ``addr`` from the kernel, None if none; False: not answerable."""
        global _procmap_query_works
        if _procmap_query_works is False or self._maps_fd is None or fcntl is None:
            return False
        name = ctypes.create_string_buffer(4096)
        q = ProcmapQuery(size=ctypes.sizeof(ProcmapQuery), query_addr=addr, vma_name_size=len(name),
                          vma_name_addr=ctypes.addressof(name))
        try:
            fcntl.ioctl(self._maps_fd, PROCMAP_QUERY, q)
        except OSError as exc:
            if exc.errno == errno.ENOENT:  # nothing mapped there
                _procmap_query_works = True
                return None
            _procmap_query_works = False  # ENOTTY, EINVAL: a kernel without it
            return False
        _procmap_query_works = True
        path = name.value.decode("utf-8", "surrogateescape") if q.vma_name_size else ""
        if q.vma_flags & VMA_SHARED or not q.inode or not path.startswith("/"):
            return None
        return (q.vma_start, q.vma_end, q.vma_offset, os.makedev(q.dev_major, q.dev_minor), q.inode, path)

    def _read_maps(self) -> None:
        self._read_all = True
        try:
            with open("/proc/self/maps") as f:
                text = f.read()
            for m in _MAPS_LINE.finditer(text):
                start, end, offset, major, minor = (int(m.group(i), 16) for i in range(1, 6))
                if self._known(start) is None:
                    self._add((start, end, offset, os.makedev(major, minor), int(m.group(6)), m.group(7)))
        except (OSError, ValueError):
            pass

    def _mapping(self, addr: int) -> _Mapping | None:
        found = self._known(addr)
        if found is not None or self._read_all:
            return found
        asked = self._query(addr)
        if asked is False:
            self._read_maps()
            return self._known(addr)
        if asked is None:
            return None
        self._add(asked)
        return asked

    def _file_pages(self, first: int, last: int) -> np.ndarray | None:
        """Per page from ``first`` to ``last`` (page numbers): present and still the file's.

        A write copies the page into anonymous memory (no longer a file page; swapped out
        later). A page not present is hashed rather than trusted: a /proc that reports nothing
        must never read as clean.
        """
        assert self.pagemap is not None
        scanned = self._scan(first, last)
        if scanned is not None:
            return scanned
        try:
            raw = os.pread(self.pagemap, (last - first + 1) * 8, first * 8)
        except OSError:
            return None
        if len(raw) != (last - first + 1) * 8:
            return None
        good: np.ndarray = (np.frombuffer(raw, "<u8") & _FILE_PAGE) == _FILE_PAGE
        return good

    def _scan(self, first: int, last: int) -> np.ndarray | None:
        """:meth:`_file_pages` from the kernel's ``PAGEMAP_SCAN``, which reports only the pages that are
        not present or not the file's (a 440 MB tower: 0.02 ms, against 0.4-1.4 ms for reading an
        entry per page); None where it cannot answer (an older kernel, or too many such regions)."""
        global _pagemap_scan_works
        if _pagemap_scan_works is False or fcntl is None or self.pagemap is None:
            return None
        wanted = PAGE_IS_FILE | PAGE_IS_PRESENT
        regions = (PageRegion * _SCAN_REGIONS)()
        # A page matches where either category, inverted, is set: not the file's, or not present.
        arg = PmScanArg(size=ctypes.sizeof(PmScanArg), start=first * _PAGE, end=(last + 1) * _PAGE,
                         vec=ctypes.addressof(regions), vec_len=_SCAN_REGIONS, category_inverted=wanted,
                         category_anyof_mask=wanted, return_mask=wanted)
        try:
            found = fcntl.ioctl(self.pagemap, PAGEMAP_SCAN, arg)
        except OSError:
            _pagemap_scan_works = False  # ENOTTY, EINVAL: a kernel without it
            return None
        _pagemap_scan_works = True
        if found >= _SCAN_REGIONS or arg.walk_end != (last + 1) * _PAGE:
            return None  # more regions than reported, or the walk stopped early
        good = np.ones(last - first + 1, dtype=bool)
        for region in regions[:found]:
            good[region.start // _PAGE - first:region.end // _PAGE - first] = False
        return good

    def file_ranges(self, ranges: list[tuple[int, int]]) -> list[tuple[Identity, int] | None]:
        """Per ``(address, length)``: (identity of the file, offset) whose bytes these are, if every
        page is still the file's; else None.

        Ranges in one mapping close to each other share one read of their pages (a model's tensors
        lie one after another in its file: one read instead of one per tensor).
        """
        out: list[tuple[Identity, int] | None] = [None] * len(ranges)
        if self.pagemap is None:
            return out
        spans: list[tuple[int, int, list[int]]] = []  # first page, last page, indices of the ranges in it
        for i in sorted(range(len(ranges)), key=lambda j: ranges[j][0]):
            addr, nbytes = ranges[i]
            mapping = self._mapping(addr) if nbytes > 0 else None
            if mapping is None or addr + nbytes > mapping[1]:
                continue
            start, _end, offset, dev, ino, path = mapping
            if path not in self.stats:
                try:
                    self.stats[path] = os.stat(path)
                except OSError:
                    self.stats[path] = None
            st = self.stats[path]
            if st is None or st.st_ino != ino or st.st_dev != dev or not stat.S_ISREG(st.st_mode):
                continue  # replaced or deleted since it was mapped; or a device's memory, not a file's bytes
            out[i] = (_identity(st), offset + (addr - start))
            first, last = addr // _PAGE, (addr + nbytes - 1) // _PAGE
            if spans and spans[-1][1] + _SPAN_GAP_PAGES >= first:  # holes between mappings read as not present
                spans[-1] = (spans[-1][0], max(spans[-1][1], last), [*spans[-1][2], i])
            else:
                spans.append((first, last, [i]))
        for first, last, members in spans:
            good = self._file_pages(first, last)
            for i in members:
                addr, nbytes = ranges[i]
                lo, hi = addr // _PAGE - first, (addr + nbytes - 1) // _PAGE - first
                if good is None or not good[lo:hi + 1].all():
                    out[i] = None
        return out

    def file_range(self, addr: int, nbytes: int) -> tuple[Identity, int] | None:
        """(identity of the file, offset) whose bytes these are, if every page is still the file's."""
        return self.file_ranges([(addr, nbytes)])[0]


def _frame(h: xxhash.xxh3_128, data: bytes) -> None:
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)


class _Host:
    """A host tensor's bytes: where they lie and how many, read in place only when hashed (a
    tensor the page proof names is never read; a numpy view per tensor cost CLIP's text tower ~1 ms a call)."""

    __slots__ = ("address", "size", "_source", "watchable")

    def __init__(self, address: int, size: int, source: Any, in_place: bool) -> None:
        self.address, self.size = address, size
        self._source = source  # keeps the memory alive while this names it
        # The tensor's own memory, large enough for the write watch to beat hashing (a copy made
        # to be hashed is freed after the call: nothing to watch).
        self.watchable = in_place and size >= _WATCHED_MIN_BYTES

    def buffer(self) -> Any:
        """The bytes, without a copy: a flat uint8 array, or the memory at ``address`` (a CPU tensor)."""
        if isinstance(self._source, np.ndarray):
            return self._source.data
        return (ctypes.c_char * self.size).from_address(self.address) if self.size else b""


_DTYPE_NAMES: dict[Any, str] = {}  # str(torch.dtype), made once per dtype


def _raw(t: Any) -> tuple[str, tuple[int, ...], Any, _Host | _DeviceSums]:
    """(dtype name, shape, identity, bytes) of a numpy array or a torch tensor."""
    if isinstance(t, np.ndarray):
        arr = np.ascontiguousarray(t).reshape(-1).view(np.uint8)
        ident = (t.__array_interface__["data"][0], t.dtype.str, t.shape, t.strides)
        return t.dtype.str, tuple(t.shape), ident, _Host(arr.__array_interface__["data"][0], arr.size, arr, t.flags.c_contiguous)
    torch = sys.modules.get("torch")  # a tensor means torch is loaded: the core never imports it
    if torch is None or not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a numpy array or a torch tensor, got {type(t).__name__}")
    shape, dtype = tuple(t.shape), t.dtype
    ident = (t.data_ptr(), dtype, shape, t.stride())
    strided = t.layout == torch.strided
    dense = strided and t.is_contiguous()
    storage = None
    if strided and t.numel():
        # A view past its storage's end (the storage freed or shrunk under it, as sharded training frees
        # parameters) has no bytes to read: reading them would read freed memory. (A dense view's extent
        # is its size: the sum over strides, 1.5 us a tensor, only for the others.)
        size = t.element_size()
        extent = t.nbytes if dense else (sum((n - 1) * step for n, step in zip(shape, ident[3], strict=True)) + 1) * size
        storage = t.untyped_storage()
        if storage.nbytes() < t.storage_offset() * size + extent:
            raise ValueError("a tensor whose storage does not hold its elements (freed or shrunk) cannot be digested")
    # Read in place only a plain dense view; a conjugate or negative view's memory is not its value: it is
    # resolved below, and digested as the values it stands for.
    if dense and storage is not None and t.is_cpu and not t.is_conj() and not t.is_neg() and ident[0]:
        # The storage object holds the memory: swapping the tensor's .data (``.half()``, ``load_state_dict(assign=
        # True)``) before the bytes are hashed leaves them alive.
        name = _DTYPE_NAMES.get(dtype)
        if name is None:
            name = _DTYPE_NAMES.setdefault(dtype, str(dtype))
        return name, shape, ident, _Host(ident[0], extent, storage, True)
    flat = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    if flat.device.type != "cpu":
        # Copying every weight to the host on every request would cost more than the hit saves
        # (16 GB for an 8B fp16 model): reduce on the device, bring 16 bytes back.
        return f"{t.dtype}@device", shape, ident, _DeviceSums(_device_sums(torch, flat))
    data = flat.view(torch.uint8).numpy() if flat.numel() else np.zeros(0, np.uint8)
    return str(t.dtype), shape, ident, _Host(data.__array_interface__["data"][0], data.size, data, False)


_CHUNK_WORDS = 1 << 24  # 16M words per step: temporaries of 64 MB at most
_MULTIPLIERS: dict[Any, tuple[Any, Any]] = {}  # device -> two int32 vectors of odd per-position multipliers


def _multipliers(torch: Any, device: Any) -> tuple[Any, Any]:
    """Odd, pseudo-random int32 multipliers for the positions of a chunk (made once per device)."""
    key = str(device)
    if key not in _MULTIPLIERS:
        i = torch.arange(_CHUNK_WORDS, dtype=torch.int64, device=device)
        a = (i * -7046029254386353131 + 7256917087563474969) >> 32  # 0x9E3779B97F4A7C15, 0x64B5F4F1A1E03E19
        b = (i * -4658895280553007687 + 1442695040888963407) >> 32  # 0xBF58476D1CE4E5B9, Knuth's LCG increment
        _MULTIPLIERS[key] = ((a | 1).to(torch.int32), (b | 1).to(torch.int32))
    return _MULTIPLIERS[key]


class _DeviceSums:
    """A device tensor's two sums, still on the device: every tensor's come back in one copy."""

    size = 16  # bytes, as the digest frames them

    def __init__(self, sums: Any) -> None:
        self.sums = sums


def device_word_digest(torch: Any, flat: Any) -> np.ndarray:
    """:func:`_device_sums` brought back to the host: 16 bytes."""
    out: np.ndarray = _device_sums(torch, flat).cpu().numpy().view(np.uint8)
    return out


def _device_sums(torch: Any, flat: Any) -> Any:
    """Two position-weighted sums of a tensor's 32-bit words, computed where it lives (16 bytes come back).

    Within a chunk of 16M words, word ``i`` is multiplied by odd int32 multipliers (products
    wrap mod 2**32) and summed; each chunk's sums are weighted by an odd function of the chunk's
    index, mod 2**64. Changing any single word changes both sums; unrelated edits collide with
    probability about 2**-64 per sum. int32 passes over the weights, not int64 ones: a few
    reads of each weight on the device instead of a host copy of all of them.
    """
    raw = flat.view(torch.uint8)
    if raw.numel() % 4:
        raw = torch.cat([raw, raw.new_zeros(4 - raw.numel() % 4)])
    words = raw.view(torch.int32)
    ma, mb = _multipliers(torch, flat.device)
    sums = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for c, lo in enumerate(range(0, words.numel(), _CHUNK_WORDS)):
        x = words[lo : lo + _CHUNK_WORDS]
        n = x.numel()
        s0 = (x * ma[:n]).sum(dtype=torch.int64)
        s1 = ((x ^ (x << 13)) * mb[:n]).sum(dtype=torch.int64)
        sums[0] += s0 * ((c * 2654435761 + 1) | 1)  # int64 arithmetic wraps: mod 2**64
        sums[1] += s1 * ((c * 40503 + 7) | 1)
    return sums


def _hash_bytes(data: np.ndarray | _Host, protected: _watch.Protected | None = None) -> bytes:
    if isinstance(data, _Host):
        if protected is not None and (protected.head is not None or protected.tail is not None):
            # The copies of the bytes the range shares pages with, and its own pages in place: the same xxh3
            # as one pass over the memory (streaming and one-shot agree), of the bytes a recall compares.
            head, tail = protected.head or b"", protected.tail or b""
            h = xxhash.xxh3_128(head)
            h.update((ctypes.c_char * (data.size - len(head) - len(tail))).from_address(data.address + len(head)))
            h.update(tail)
            return h.digest()
        return xxhash.xxh3_128_digest(data.buffer())
    return xxhash.xxh3_128_digest(data.data) if data.size else xxhash.xxh3_128_digest(b"")


def digest_tensors(label: str, named: Iterable[tuple[str, Any]]) -> str:
    """xxh3-128 over the name, dtype, shape and the xxh3-128 of the raw bytes of each tensor, in order.

    The bytes are hashed on every call (about 15 GB/s on one core), never memoised on
    version counters: an in-place write that no version counter sees (``param.data[...] += x``)
    still changes the digest. The shortcuts are proven by the kernel: a CPU tensor whose
    pages are all still the pages of the file it was mapped from holds that file's bytes, and
    their digest is recalled by the file's identity; one in anonymous memory that no write
    has reached since it was hashed keeps that digest (see the module docstring). A tensor
    shared under several names (tied weights) is hashed once, its other names recorded as ties.

    Args:
        label: what the tensors are (framed first).
        named: ``(name, tensor)`` pairs; numpy arrays or torch tensors on any device.
    """
    h = xxhash.xxh3_128()
    _frame(h, label.encode())
    seen: dict[Any, str] = {}
    alive: list[Any] = []
    todo: list[tuple[int, Any, Any]] = []  # (field slot, bytes, file range or None)
    fields: list[bytes] = []
    on_device: list[tuple[int, Any]] = []
    pages: _Pages | None = None
    try:
        for name, t in named:
            alive.append(t)  # a tensor freed mid-call (a generator's temporary) could pass its address on: a false tie
            dtype, shape, ident, data = _raw(t)
            if not ident[0]:  # no address (torch's lazy device: data_ptr() is 0): only the same object again is a tie
                ident = id(t)  # alive, so its id is not reused within the call; an int is never a tuple ident
            if data.size and ident in seen:
                fields.append(_framed(name.encode("utf-8", "surrogatepass")))
                fields.append(_framed(f"tied:{seen[ident]}".encode()))
                continue
            seen[ident] = name
            fields.append(_header(name, dtype, shape, data.size))
            if isinstance(data, _DeviceSums):
                on_device.append((len(fields), data.sums))
                fields.append(b"")  # filled in below, after one copy of every tensor's sums
                continue
            todo.append((len(fields), data, None))
            fields.append(b"")  # its digest, filled in below
        # Anonymous memory the kernel shows unwritten since it was last hashed (see _watch).
        watch = _watch.write_watch() if any(data.watchable for _, data, _ in todo) else None
        if watch is not None:
            asked = [i for i, (_, data, _) in enumerate(todo) if data.watchable]
            for i, known in zip(asked, watch.recall([(todo[i][1].address, todo[i][1].size) for i in asked]), strict=True):
                if known is not None:
                    fields[todo[i][0]] = known
                    todo[i] = (todo[i][0], todo[i][1], _KNOWN)
            todo = [item for item in todo if item[2] is not _KNOWN]
        # The page proof may read all of /proc/self/maps (~3 ms in a process holding torch, on kernels
        # without PROCMAP_QUERY): worth it only when it spares hashing more bytes than that costs
        # (a YOLOE head's 1 MB is hashed).
        mapped = [i for i, (_, data, _) in enumerate(todo) if data.size >= _MAPPED_MIN_BYTES]
        if sys.platform.startswith("linux") and sum(todo[i][1].size for i in mapped) >= _PROOF_MIN_TOTAL:
            pages = _Pages()
            found = pages.file_ranges([(todo[i][1].address, todo[i][1].size) for i in mapped])
            for i, where in zip(mapped, found, strict=True):
                slot, data, _ = todo[i]
                known = _memo.get(where[0], where[1], data.size) if where is not None else None
                if known is not None:
                    fields[slot] = known
                    todo[i] = (slot, data, _KNOWN)
                else:
                    todo[i] = (slot, data, where)
            todo = [item for item in todo if item[2] is not _KNOWN]
    finally:
        if pages is not None:
            pages.close()
    if on_device:
        # One synchronising copy for the whole model, not one per tensor (272 for SmolLM2).
        torch = sys.modules["torch"]
        host = torch.stack([sums.to(on_device[0][1].device) for _, sums in on_device]).cpu().numpy()
        for (slot, _), row in zip(on_device, host, strict=True):
            fields[slot] = _hash_bytes(np.ascontiguousarray(row).view(np.uint8))
    # Protected before hashing: a write while it is hashed shows at the next recall.
    protected = {slot: watch.protect(data.address, data.size) for slot, data, where in todo
                 if where is None and data.watchable} if watch is not None else {}
    # xxh3 releases the GIL: large tensors are hashed on several cores, each to its own digest
    # (SmolLM2's 540 MB: 37 ms -> 25 ms on 2 cores).
    big = [item for item in todo if item[1].size >= _PARALLEL_BYTES]
    for slot, data, _ in todo:
        if data.size < _PARALLEL_BYTES:
            fields[slot] = _hash_bytes(data, protected.get(slot))
    if big:
        with ThreadPoolExecutor(max_workers=min(len(big), os.cpu_count() or 1, 8)) as pool:
            hashed = pool.map(lambda item: _hash_bytes(item[1], protected.get(item[0])), big)
            for (slot, _, _), digest in zip(big, hashed, strict=True):
                fields[slot] = digest
    # Remembered only if the file is still the version whose pages were checked, and settled.
    files: dict[Identity, bool] = {}
    rows = []
    for slot, data, where in todo:
        if where is not None and _settled(where[0]):
            if where[0] not in files:
                files[where[0]] = _still(where[0], pages.stats if pages is not None else {})
            if files[where[0]]:
                rows.append((where[0], where[1], data.size, fields[slot]))
    _memo.put(rows)
    for slot, protection in protected.items():
        if protection is not None:
            watch.remember(protection, fields[slot])  # type: ignore[union-attr]
    for f in fields:
        h.update(f)
    return h.hexdigest()


def _settled(ident: Identity) -> bool:
    """Whether a digest of this file version may be remembered (its timestamps have settled)."""
    return time.time() - max(ident[3], ident[4]) / 1e9 > _RACY_S


def _still(ident: Identity, stats: dict[str, os.stat_result | None]) -> bool:
    for path, st in stats.items():
        if st is not None and _identity(st) == ident:
            try:
                return _identity(os.stat(path)) == ident
            except OSError:
                return False
    return False


_PARALLEL_BYTES = 1 << 20


def _framed(data: bytes) -> bytes:
    return len(data).to_bytes(8, "little") + data


_HEADERS: dict[tuple[str, str, tuple[int, ...], int], bytes] = {}


def _header(name: str, dtype: str, shape: tuple[int, ...], size: int) -> bytes:
    """A tensor's framed name, dtype, shape and byte count (the same few hundred per model: made once each)."""
    key = (name, dtype, shape, size)
    out = _HEADERS.get(key)
    if out is None:
        out = (_framed(name.encode("utf-8", "surrogatepass")) + _framed(f"{dtype}{shape}".encode())
               + size.to_bytes(8, "little"))
        if len(_HEADERS) < 1 << 16:
            _HEADERS[key] = out
    return out
