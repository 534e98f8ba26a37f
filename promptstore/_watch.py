"""Anonymous memory that the kernel proves unwritten since its digest was taken (Linux 6.11 and later).

A tensor that no file backs (weights built in the process, or copied out of a checkpoint by
``load_state_dict``, as ultralytics and open_clip load theirs) would be hashed on every
fingerprint. Instead its pages are registered with a userfaultfd in asynchronous write-protect
mode and write-protected before they are hashed. The first write to such a page afterwards, by
any path through this process's page tables (a store from Python or native code, ``read()``
into the buffer, another thread, ``/proc/self/mem``, a write after ``fork()`` while the pages
are shared), is resolved by the kernel itself, which leaves the page unprotected; no thread
waits on the userfaultfd. ``PAGEMAP_SCAN`` then reports the page as written. The digest stays
valid while a scan finds every page of the range present, in a mapping still registered, and
still protected. Pages are protected whole: a write by a neighbouring allocation into a page
the tensor shares counts as a write (the tensor is hashed again, never trusted).

Protecting a range resets what the kernel knows of earlier writes to its pages, so every
remembered digest whose pages overlap a newly protected range is forgotten.

Outside the proof, and hashed every time as before: shared mappings (another process writes
through page tables of its own), file mappings (a file can change under a private mapping;
``_digest`` proves those its own way), memory that a device may write by DMA (nothing is
proven once a CUDA context exists), a child after ``fork()`` until it hashes again (its
mappings are not registered), and kernels or sandboxes without userfaultfd.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from typing import NamedTuple

from ._kernel import (
    PAGE_IS_FILE,
    PAGE_IS_PRESENT,
    PAGE_IS_WPALLOWED,
    PAGE_IS_WRITTEN,
    PAGEMAP_SCAN,
    PROCMAP_QUERY,
    SYS_USERFAULTFD,
    UFFD_API,
    UFFD_FEATURE_WP_ASYNC,
    UFFD_FEATURE_WP_UNPOPULATED,
    UFFDIO_API,
    UFFDIO_REGISTER,
    UFFDIO_REGISTER_MODE_WP,
    UFFDIO_WRITEPROTECT,
    UFFDIO_WRITEPROTECT_MODE_WP,
    VMA_SHARED,
    PageRegion,
    PmScanArg,
    ProcmapQuery,
    UffdioApi,
    UffdioRange,
    UffdioRegister,
    UffdioWriteprotect,
)

try:
    import fcntl
except ImportError:  # not on Windows, where nothing is proven
    fcntl = None  # type: ignore[assignment]

__all__ = ["WriteWatch", "Protected", "write_watch"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_SPAN_GAP = 1 << 20  # remembered ranges this close share one scan
_UFFD_USER_MODE_ONLY = 1  # lets an unprivileged process open one; the kernel still resolves its own writes
# A page that breaks the proof: not in a registered mapping, not present (a hole reads as zeros
# later; a swapped page is hashed again rather than trusted), written, or a file's page.
_INVERTED = PAGE_IS_WPALLOWED | PAGE_IS_PRESENT
_ANY_BAD = PAGE_IS_WPALLOWED | PAGE_IS_PRESENT | PAGE_IS_WRITTEN | PAGE_IS_FILE


class Protected(NamedTuple):
    """A range write-protected before it was hashed: what :meth:`WriteWatch.remember` needs."""

    address: int
    nbytes: int
    lo: int  # first byte of the first page
    hi: int  # end of the last page
    serial: int  # this protection's place among the watch's protections


class _Known(NamedTuple):
    digest: bytes
    lo: int
    hi: int


class WriteWatch:
    """The digests of anonymous ranges whose pages the kernel shows unwritten since they were hashed.

    One per process (see :func:`write_watch`). Thread-safe.
    """

    def __init__(self, uffd: int, pagemap: int, maps: int) -> None:
        self._uffd = uffd
        self._pagemap = pagemap
        self._maps = maps
        self._lock = threading.Lock()
        self._known: dict[tuple[int, int], _Known] = {}
        self._serial = 0
        # Recent protections (serial, lo, hi): a digest hashed under an older protection is not
        # remembered if a newer one overlapping it reset the kernel's record of writes meanwhile.
        self._recent: list[tuple[int, int, int]] = []

    def recall(self, ranges: list[tuple[int, int]]) -> list[bytes | None]:
        """Per ``(address, nbytes)``: its remembered digest where the kernel shows no page written since, else None."""
        out: list[bytes | None] = [None] * len(ranges)
        with self._lock:
            asked = sorted((i for i, r in enumerate(ranges) if r in self._known), key=lambda i: self._known[ranges[i]].lo)
            spans: list[tuple[int, int, list[int]]] = []
            for i in asked:
                lo, hi = self._known[ranges[i]].lo, self._known[ranges[i]].hi
                if spans and spans[-1][1] + _SPAN_GAP >= lo:
                    spans[-1] = (spans[-1][0], max(spans[-1][1], hi), [*spans[-1][2], i])
                else:
                    spans.append((lo, hi, [i]))
            for lo, hi, members in spans:
                bad = self._bad(lo, hi, 2 * len(members) + 16)
                for i in members:
                    found = self._known.get(ranges[i])
                    if found is None:
                        continue  # the same range asked twice, found written the first time
                    if bad is None:  # more regions than one scan reports: ask of this range alone
                        clean = self._bad(found.lo, found.hi, 1) == []
                    else:
                        clean = not any(start < found.hi and found.lo < end for start, end in bad)
                    if clean:
                        out[i] = found.digest
                    else:
                        del self._known[ranges[i]]
        return out

    def _bad(self, lo: int, hi: int, regions: int) -> list[tuple[int, int]] | None:
        """The regions of ``[lo, hi)`` whose pages break the proof; None if the kernel reported more than asked for."""
        if fcntl is None:
            return None
        vec = (PageRegion * regions)()
        arg = PmScanArg(size=ctypes.sizeof(PmScanArg), start=lo, end=hi, vec=ctypes.addressof(vec), vec_len=regions,
                        category_inverted=_INVERTED, category_anyof_mask=_ANY_BAD, return_mask=_ANY_BAD)
        if regions == 1:
            arg.max_pages = 1  # one bad page is enough to know
        try:
            found = fcntl.ioctl(self._pagemap, PAGEMAP_SCAN, arg)
        except OSError:
            return None
        if arg.walk_end != hi and not (regions == 1 and found == 1):
            return None  # the walk stopped with the vector full: there may be more
        return [(r.start, r.end) for r in vec[:found]]

    def protect(self, address: int, nbytes: int) -> Protected | None:
        """Register and write-protect the pages of a private anonymous range, before it is hashed.

        None where the range is not provable (a file's or a shared mapping, one another
        userfaultfd owns, a hole); the caller hashes it every time, as without the watch.
        """
        if nbytes <= 0 or fcntl is None:
            return None
        lo, hi = address // _PAGE * _PAGE, -(-(address + nbytes) // _PAGE) * _PAGE
        if not self._private_anonymous(lo, hi):
            return None
        rng = UffdioRange(start=lo, len=hi - lo)
        with self._lock:
            try:
                fcntl.ioctl(self._uffd, UFFDIO_REGISTER, UffdioRegister(range=rng, mode=UFFDIO_REGISTER_MODE_WP))
                fcntl.ioctl(self._uffd, UFFDIO_WRITEPROTECT, UffdioWriteprotect(range=rng, mode=UFFDIO_WRITEPROTECT_MODE_WP))
            except OSError:
                return None  # EBUSY (another userfaultfd's), EINVAL, ENOMEM (unmapped meanwhile)
            self._serial += 1
            for key in [k for k, known in self._known.items() if known.lo < hi and lo < known.hi]:
                del self._known[key]  # their record of writes was just reset
            self._recent.append((self._serial, lo, hi))
            if len(self._recent) > 4096:
                del self._recent[:2048]
            return Protected(address, nbytes, lo, hi, self._serial)

    def remember(self, protected: Protected, digest: bytes) -> None:
        """Remember the digest of a range hashed after :meth:`protect`."""
        with self._lock:
            oldest = self._recent[0][0] if self._recent else self._serial + 1
            if protected.serial < oldest:
                return  # its later protections are no longer listed
            for serial, lo, hi in self._recent:
                if serial > protected.serial and lo < protected.hi and protected.lo < hi:
                    return
            self._known[(protected.address, protected.nbytes)] = _Known(digest, protected.lo, protected.hi)

    def _private_anonymous(self, lo: int, hi: int) -> bool:
        """Whether ``[lo, hi)`` lies in private anonymous mappings only, with no hole."""
        at = lo
        while at < hi:
            q = ProcmapQuery(size=ctypes.sizeof(ProcmapQuery), query_addr=at)
            try:
                fcntl.ioctl(self._maps, PROCMAP_QUERY, q)
            except OSError:
                return False
            if q.vma_start > at or q.vma_flags & VMA_SHARED or q.inode or q.dev_major or q.dev_minor:
                return False
            at = q.vma_end
        return True


_libc: ctypes.CDLL | None = None
_watch: tuple[int, WriteWatch | None] | None = None  # (pid, its watch): a child after fork opens its own
_watch_lock = threading.Lock()


def _open() -> WriteWatch | None:
    """The kernel's userfaultfd in asynchronous write-protect mode, with what scanning needs; None if unavailable."""
    global _libc
    number = SYS_USERFAULTFD.get(os.uname().machine) if sys.platform.startswith("linux") else None
    if number is None or fcntl is None:
        return None
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    uffd = _libc.syscall(number, os.O_CLOEXEC | os.O_NONBLOCK | _UFFD_USER_MODE_ONLY)
    if uffd < 0:
        return None  # ENOSYS, EPERM (a sandbox's seccomp, vm.unprivileged_userfaultfd)
    fds = [uffd]
    try:
        fcntl.ioctl(uffd, UFFDIO_API, UffdioApi(api=UFFD_API, features=UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED))
        fds.append(os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC))
        fds.append(os.open("/proc/self/maps", os.O_RDONLY | os.O_CLOEXEC))
        probe = ProcmapQuery(size=ctypes.sizeof(ProcmapQuery), query_addr=id(fds))
        fcntl.ioctl(fds[2], PROCMAP_QUERY, probe)
    except OSError:  # EINVAL: a kernel without these features; ENOTTY: without PROCMAP_QUERY
        for fd in fds:
            os.close(fd)
        return None
    return WriteWatch(fds[0], fds[1], fds[2])


def write_watch() -> WriteWatch | None:
    """This process's :class:`WriteWatch`, or None where nothing can be proven this way.

    None on kernels or platforms without asynchronous write protection (Linux 6.7) and
    ``PROCMAP_QUERY`` (6.11), and once a CUDA context exists: a device writing host memory by
    DMA does not go through the page tables.
    """
    global _watch
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return None
    pid = os.getpid()
    current = _watch
    if current is not None and current[0] == pid:
        return current[1]
    with _watch_lock:
        if _watch is None or _watch[0] != pid:
            _watch = (pid, _open())
        return _watch[1]
