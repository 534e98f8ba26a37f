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
``_digest`` proves those its own way), a child after ``fork()`` until it hashes again (its
mappings are not registered), and kernels or sandboxes without userfaultfd.

What the proof cannot see: a write that does not go through the page tables. Memory pinned for
a device or for the kernel's asynchronous I/O (a CUDA or ROCm context's pinned buffers, RDMA
registrations, VFIO, io_uring's fixed buffers, an ``O_DIRECT`` read in flight) is written by
DMA into the physical page, and the page still reads as unwritten. So the watch is off for
good in a process once it holds a file that can do that (``/dev/nvidia*``, ``/dev/kfd``,
``/dev/dri/*``, ``/dev/accel/*``, ``/dev/infiniband/*``, ``/dev/vfio/*``, ``/dev/iommu``, an
io_uring) or once torch has a CUDA context: checked at every fingerprint, before anything is
recalled (a process holding more than 512 files is not checked, and the watch is off in it).
It is also off once the kernel counts memory of the process as pinned for DMA (``VmPin``), which
finds an io_uring whose file was closed after its registration or lives in a thread's own file
table. A device opened, used to write the weights and closed between two fingerprints, an AF_XDP
socket's memory, or an ``O_DIRECT`` read racing the first hash are not detected: a process
that does such things sets ``PROMPTSTORE_WRITE_WATCH=0``, and every fingerprint hashes again.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from typing import NamedTuple

from ._kernel import (
    PAGE_IS_PRESENT,
    PAGE_IS_WPALLOWED,
    PAGE_IS_WRITTEN,
    PAGEMAP_SCAN,
    PM_SCAN_CHECK_WPASYNC,
    PM_SCAN_WP_MATCHING,
    PROCMAP_QUERY,
    SYS_USERFAULTFD,
    UFFD_API,
    UFFD_FEATURE_WP_ASYNC,
    UFFD_FEATURE_WP_UNPOPULATED,
    UFFDIO_API,
    UFFDIO_REGISTER,
    UFFDIO_REGISTER_MODE_WP,
    VMA_SHARED,
    PageRegion,
    PmScanArg,
    ProcmapQuery,
    UffdioApi,
    UffdioRange,
    UffdioRegister,
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
# later; a swapped page is hashed again rather than trusted), or written. A file's page is excluded
# by the mapping, not the page: the scan is bracketed by checks that the range lies in private
# anonymous mappings, which hold no file pages, and a mapping put there meanwhile is not registered.
# (Asking the scan for file pages reads every page's struct page: 6 ms of SAM 3's 7 for 1.4 GB.)
_INVERTED = PAGE_IS_WPALLOWED | PAGE_IS_PRESENT
_ANY_BAD = PAGE_IS_WPALLOWED | PAGE_IS_PRESENT | PAGE_IS_WRITTEN
_MAPPED_KINDS = PAGE_IS_WPALLOWED | PAGE_IS_PRESENT
_MAX_FILES_CHECKED = 512  # each costs a readlink on every fingerprint (about 2 us)
# Files through which a device (or the kernel, asynchronously) may write this process's memory by DMA.
_DMA_FILES = ("/dev/nvidia", "/dev/kfd", "/dev/dri/", "/dev/accel/", "/dev/infiniband/", "/dev/vfio/",
              "/dev/iommu", "/dev/vhost-vdpa", "/dev/davinci", "/dev/neuron", "/dev/hl", "anon_inode:[io_uring]",
              "anon_inode:[vfio-device]")


class Protected(NamedTuple):
    """A range write-protected before it was hashed: what :meth:`WriteWatch.remember` needs."""

    address: int
    nbytes: int
    lo: int  # first byte of the first page
    hi: int  # end of the last page
    serial: int  # this protection's place among the watch's protections
    # The range's own bytes in its first and last pages, copied after the protection, where it shares
    # those pages with other memory (None where it fills the page): hash these copies, not the memory
    # there, so that the digest is of exactly the bytes a later recall compares.
    head: bytes | None
    tail: bytes | None


class _Known(NamedTuple):
    """A remembered digest, and the range's own bytes in its first and last pages where it shares them."""

    digest: bytes
    address: int
    nbytes: int
    lo: int
    hi: int
    head: bytes | None  # the range's bytes in its first page, if that page holds other bytes too
    tail: bytes | None  # the same in its last page

    def valid_despite(self, regions: list[tuple[int, int, int]], compare: bool) -> bool:
        """Whether the digest still holds though these regions (start, end, page categories) broke the proof.

        It does where they touch none of the range's pages; or, with ``compare`` (only for a range whose
        memory is alive: its pages stay mapped), where they touch only pages the range shares with its
        neighbours, mapped and present, and its own bytes there are as they were hashed.
        """
        touched = [(start, end, kind) for start, end, kind in regions if start < self.hi and self.lo < end]
        if not touched:
            return True
        if not compare:
            return False
        first_end, last_start = self.lo + _PAGE, self.hi - _PAGE
        for start, end, kind in touched:
            if kind & _MAPPED_KINDS != PAGE_IS_WPALLOWED | PAGE_IS_PRESENT:
                return False  # unmapped, not present, or a file's page: nothing there to compare
            if start < last_start and first_end < end:
                return False  # a page the range fills alone
            if start < first_end and self.head is None or end > last_start and self.tail is None:
                return False  # a shared page whose bytes were not kept
        if self.head is not None and ctypes.string_at(self.address, len(self.head)) != self.head:
            return False
        end = self.address + self.nbytes
        return self.tail is None or ctypes.string_at(end - len(self.tail), len(self.tail)) == self.tail


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
        # The written pages recent protections found (serial, start, end): a digest hashed under an older
        # protection is not remembered if a newer one found and protected again a write to its pages.
        self._recent: list[tuple[int, int, int]] = []
        self._forgotten = 0  # the newest serial whose writes may have been dropped from that list
        self._closed = False

    def close(self, locked: bool = True) -> None:
        """Stop proving: forget every digest and close the files (the kernel unregisters the ranges)."""
        if locked:
            with self._lock:
                self.close(locked=False)
            return
        if not self._closed:
            self._closed = True
            self._known.clear()
            for fd in (self._uffd, self._pagemap, self._maps):
                try:
                    os.close(fd)
                except OSError:
                    pass

    def recall(self, ranges: list[tuple[int, int]]) -> list[bytes | None]:
        """Per ``(address, nbytes)``: its remembered digest where the kernel shows no page written since, else None."""
        out: list[bytes | None] = [None] * len(ranges)
        with self._lock:
            if self._closed:
                return out
            asked = sorted((i for i, r in enumerate(ranges) if r in self._known), key=lambda i: self._known[ranges[i]].lo)
            spans: list[tuple[int, int, list[int]]] = []
            for i in asked:
                lo, hi = self._known[ranges[i]].lo, self._known[ranges[i]].hi
                if spans and spans[-1][1] + _SPAN_GAP >= lo:
                    spans[-1] = (spans[-1][0], max(spans[-1][1], hi), [*spans[-1][2], i])
                else:
                    spans.append((lo, hi, [i]))
            for lo, hi, members in spans:
                # The scan walks mapped memory only: a hole, or a mapping it skips (VM_PFNMAP), reports nothing.
                mapped = self._private_anonymous(lo, hi)
                bad = self._bad(lo, hi, 2 * len(members) + 16) if mapped else None
                if bad is not None and not self._private_anonymous(lo, hi):
                    bad = [(lo, hi, 0)]  # the mappings changed during the scan: no page of them is proven
                for i in members:
                    found = self._known.get(ranges[i])
                    if found is None:
                        continue  # the same range asked twice, found written the first time
                    mine: list[tuple[int, int, int]] | None = bad
                    if mine is None and (mapped or self._private_anonymous(found.lo, found.hi)):
                        mine = self._bad(found.lo, found.hi, 8)  # too many regions in the span: alone
                        if mine is not None and not self._private_anonymous(found.lo, found.hi):
                            mine = None
                    if mine is not None and found.valid_despite(mine, compare=True):
                        out[i] = found.digest
                    else:
                        del self._known[ranges[i]]
        return out

    def _bad(self, lo: int, hi: int, regions: int) -> list[tuple[int, int, int]] | None:
        """The regions of ``[lo, hi)`` whose pages break the proof (start, end, categories); None if the kernel
        reported more than asked for."""
        if fcntl is None:
            return None
        vec = (PageRegion * regions)()
        arg = PmScanArg(size=ctypes.sizeof(PmScanArg), start=lo, end=hi, vec=ctypes.addressof(vec), vec_len=regions,
                        category_inverted=_INVERTED, category_anyof_mask=_ANY_BAD, return_mask=_ANY_BAD)
        try:
            found = fcntl.ioctl(self._pagemap, PAGEMAP_SCAN, arg)
        except OSError:
            return None
        if arg.walk_end != hi:
            return None  # the walk stopped with the vector full: there may be more
        return [(r.start, r.end, r.categories) for r in vec[:found]]

    def protect(self, address: int, nbytes: int) -> Protected | None:
        """Register and write-protect the pages of a private anonymous range, before it is hashed.

        None where the range is not provable (a file's or a shared mapping, one another
        userfaultfd owns, a hole); the caller hashes it every time, as without the watch.
        """
        if nbytes <= 0 or fcntl is None:
            return None
        lo, hi = address // _PAGE * _PAGE, -(-(address + nbytes) // _PAGE) * _PAGE
        rng = UffdioRange(start=lo, len=hi - lo)
        with self._lock:
            if self._closed or not self._private_anonymous(lo, hi):
                return None
            try:
                fcntl.ioctl(self._uffd, UFFDIO_REGISTER, UffdioRegister(range=rng, mode=UFFDIO_REGISTER_MODE_WP))
            except OSError:
                return None  # EBUSY (another userfaultfd's), EINVAL, ENOMEM (unmapped meanwhile)
            written = self._protect_written(lo, hi)
            self._serial += 1
            # A remembered range sharing pages with this one (a neighbour's edge page, a view's whole) stays
            # valid where those pages were still protected: protecting them again changed nothing. Where
            # they had been written, it is no longer valid, and the kernel's record of that write is gone.
            # A walk that failed part-way may have protected written pages it did not report: all are.
            lost = written is None
            if written is None:
                written = [(lo, hi, PAGE_IS_WRITTEN)]
            for key in [k for k, known in self._known.items() if not known.valid_despite(written, compare=False)]:
                del self._known[key]
            self._recent.extend((self._serial, start, end) for start, end, _ in written)
            if len(self._recent) > 4096:
                self._forgotten = self._recent[-2049][0]
                del self._recent[:-2048]
            if lost:
                return None
            end = address + nbytes
            head = tail = None
            if hi - lo > 2 * _PAGE:  # (a range of two pages or fewer is proven by its pages alone)
                if address != lo:
                    head = ctypes.string_at(address, lo + _PAGE - address)
                if end != hi:
                    tail = ctypes.string_at(hi - _PAGE, end - (hi - _PAGE))
            return Protected(address, nbytes, lo, hi, self._serial, head, tail)

    def _protect_written(self, lo: int, hi: int) -> list[tuple[int, int, int]] | None:
        """Write-protect the written pages of ``[lo, hi)`` and say which they were, in one walk of the kernel's
        (a page is reported and protected under its page table's lock: a write is either reported here or
        seen by the next scan). None if the range could not be protected."""
        written: list[tuple[int, int, int]] = []
        vec = (PageRegion * 64)()
        start = lo
        while start < hi:
            arg = PmScanArg(size=ctypes.sizeof(PmScanArg), flags=PM_SCAN_WP_MATCHING | PM_SCAN_CHECK_WPASYNC,
                            start=start, end=hi, vec=ctypes.addressof(vec), vec_len=len(vec),
                            category_mask=PAGE_IS_WRITTEN, return_mask=PAGE_IS_WRITTEN)
            try:
                found = fcntl.ioctl(self._pagemap, PAGEMAP_SCAN, arg)
            except OSError:
                return None
            written.extend((r.start, r.end, r.categories) for r in vec[:found])
            if arg.walk_end <= start:
                return None
            start = arg.walk_end
        return written

    def remember(self, protected: Protected, digest: bytes) -> None:
        """Remember the digest of a range hashed after :meth:`protect`."""
        with self._lock:
            if self._closed or protected.serial < self._forgotten:
                return  # writes that later protections found are no longer all listed
            for serial, lo, hi in self._recent:
                if serial > protected.serial and lo < protected.hi and protected.lo < hi:
                    return
            self._known[(protected.address, protected.nbytes)] = _Known(
                digest, protected.address, protected.nbytes, protected.lo, protected.hi, protected.head, protected.tail)

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


def _pinned() -> bool:
    """Whether the kernel counts memory of this process pinned for DMA (``VmPin``: io_uring's fixed buffers,
    RDMA and iommufd registrations; ``mlock`` is not counted), whatever holds it: a ring registered and its
    file closed, or a thread's own file table, shows no file in ``/proc/self/fd``."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmPin:"):
                    return int(line.split()[1]) != 0
    except (OSError, ValueError, IndexError):
        return True  # cannot tell
    return True  # no VmPin line: cannot tell


def _dma_possible() -> bool:
    """Whether this process holds a file through which memory can be written by DMA, or memory pinned for it
    (see the module's notes)."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None) if torch is not None else None  # (torch may be half imported by a thread)
    if cuda is not None and getattr(cuda, "is_initialized", lambda: False)():
        return True
    if _pinned():
        return True
    try:
        fd = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return True  # cannot tell
    try:
        try:
            names = os.listdir(fd)
        except OSError:
            return True  # cannot tell (out of file descriptors: the listing opens one)
        if len(names) > _MAX_FILES_CHECKED:
            return True  # cannot tell cheaply: hashing is the safe side
        for name in names:
            try:
                if os.readlink(name, dir_fd=fd).startswith(_DMA_FILES):
                    return True
            except OSError:
                continue  # closed since the listing (the listing's own descriptor among them)
    finally:
        os.close(fd)
    return False


def write_watch() -> WriteWatch | None:
    """This process's :class:`WriteWatch`, or None where nothing can be proven this way.

    None on kernels or platforms without asynchronous write protection (Linux 6.7) and
    ``PROCMAP_QUERY`` (6.11), where ``$PROMPTSTORE_WRITE_WATCH`` is ``0``, and for the rest of
    the process once it could write memory by DMA (a CUDA context, a device or io_uring
    file open): such writes do not go through the page tables.
    """
    global _watch
    pid = os.getpid()
    if os.environ.get("PROMPTSTORE_WRITE_WATCH", "").strip().lower() in ("0", "off", "false", "no"):
        return None
    current = _watch
    if current is not None and current[0] == pid and current[1] is None:
        return None
    if _dma_possible():
        with _watch_lock:
            if _watch is not None and _watch[0] == pid and _watch[1] is not None:
                _watch[1].close()
            _watch = (pid, None)
        return None
    if current is not None and current[0] == pid:
        return current[1]
    with _watch_lock:
        if _watch is None or _watch[0] != pid:
            _watch = (pid, _open())
        return _watch[1]


def _after_fork_in_child() -> None:
    """A child starts without the parent's watch: its files closed, its lock new (it may have been held)."""
    global _watch, _watch_lock
    inherited, _watch, _watch_lock = _watch, None, threading.Lock()
    if inherited is not None and inherited[1] is not None:
        inherited[1].close(locked=False)  # the only thread now: the parent's may have held the lock


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
