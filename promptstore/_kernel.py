"""Linux's interfaces for asking which pages of this process hold what: ``/proc/self/maps`` queries,
``PAGEMAP_SCAN`` and userfaultfd's write protection, as ctypes structures and ioctl numbers.

Every caller treats an error from these (an older kernel, another platform, a sandbox) as "not
proven": the bytes are hashed instead.
"""

from __future__ import annotations

import ctypes


def _iowr(kind: int, number: int, size: int) -> int:
    """``_IOWR(kind, number, size)``: an ioctl that reads and writes a structure of ``size`` bytes."""
    return (3 << 30) | (size << 16) | (kind << 8) | number


class ProcmapQuery(ctypes.Structure):
    """``struct procmap_query`` (linux/fs.h): the mapping that covers one address."""

    _fields_ = [("size", ctypes.c_uint64), ("query_flags", ctypes.c_uint64), ("query_addr", ctypes.c_uint64),
                ("vma_start", ctypes.c_uint64), ("vma_end", ctypes.c_uint64), ("vma_flags", ctypes.c_uint64),
                ("vma_page_size", ctypes.c_uint64), ("vma_offset", ctypes.c_uint64), ("inode", ctypes.c_uint64),
                ("dev_major", ctypes.c_uint32), ("dev_minor", ctypes.c_uint32), ("vma_name_size", ctypes.c_uint32),
                ("build_id_size", ctypes.c_uint32), ("vma_name_addr", ctypes.c_uint64), ("build_id_addr", ctypes.c_uint64)]


# Linux 6.11 and later answer it on /proc/self/maps.
PROCMAP_QUERY = _iowr(ord("f"), 17, ctypes.sizeof(ProcmapQuery))
VMA_SHARED = 0x08  # PROCMAP_QUERY_VMA_SHARED


class PmScanArg(ctypes.Structure):
    """``struct pm_scan_arg`` (linux/fs.h): which pages of a range have which categories."""

    _fields_ = [(name, ctypes.c_uint64) for name in (
        "size", "flags", "start", "end", "walk_end", "vec", "vec_len", "max_pages", "category_inverted",
        "category_mask", "category_anyof_mask", "return_mask")]


class PageRegion(ctypes.Structure):
    """``struct page_region``: pages ``start`` to ``end`` (addresses) that share ``categories``."""

    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64), ("categories", ctypes.c_uint64)]


# Linux 6.7 and later answer it on /proc/self/pagemap.
PAGEMAP_SCAN = _iowr(ord("f"), 16, ctypes.sizeof(PmScanArg))
PM_SCAN_WP_MATCHING = 1 << 0  # write-protect the pages that match, in the same walk
PM_SCAN_CHECK_WPASYNC = 1 << 1  # fail unless every mapping walked is registered for asynchronous protection
# Page categories of PAGEMAP_SCAN.
PAGE_IS_WPALLOWED = 1 << 0  # in a mapping registered for asynchronous write protection
PAGE_IS_WRITTEN = 1 << 1  # not write-protected: written since it was protected, or never protected
PAGE_IS_FILE = 1 << 2
PAGE_IS_PRESENT = 1 << 3
PAGE_IS_SWAPPED = 1 << 4


class UffdioApi(ctypes.Structure):
    """``struct uffdio_api`` (linux/userfaultfd.h): the features asked of a userfaultfd."""

    _fields_ = [("api", ctypes.c_uint64), ("features", ctypes.c_uint64), ("ioctls", ctypes.c_uint64)]


class UffdioRange(ctypes.Structure):
    """``struct uffdio_range``."""

    _fields_ = [("start", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class UffdioRegister(ctypes.Structure):
    """``struct uffdio_register``: a range registered with a userfaultfd, and how."""

    _fields_ = [("range", UffdioRange), ("mode", ctypes.c_uint64), ("ioctls", ctypes.c_uint64)]


UFFD_API = 0xAA
UFFDIO_API = _iowr(0xAA, 0x3F, ctypes.sizeof(UffdioApi))
UFFDIO_REGISTER = _iowr(0xAA, 0x00, ctypes.sizeof(UffdioRegister))
UFFDIO_REGISTER_MODE_WP = 1 << 1
# Linux 6.7: a write to a protected page is resolved in the kernel (no thread waits on the fd), and
# leaves the page unprotected, which PAGEMAP_SCAN reports as written. Anonymous memory needs
# WP_UNPOPULATED for its mappings to count as write-protect-allowed.
UFFD_FEATURE_WP_UNPOPULATED = 1 << 13
UFFD_FEATURE_WP_ASYNC = 1 << 15
# The userfaultfd system call's number, per machine (Linux's asm-generic table serves the newer ones).
SYS_USERFAULTFD = {"x86_64": 323, "aarch64": 282, "riscv64": 282, "loongarch64": 282, "ppc64le": 364,
                   "s390x": 355}
