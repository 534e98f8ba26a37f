"""A minimal io_uring through ctypes: fixed (pinned) buffers and one READ_FIXED, the kernel writing
them without going through this process's page tables. Linux only; :func:`ring` raises OSError
where io_uring is unavailable (old kernels, sandboxes that disable it)."""

from __future__ import annotations

import ctypes
import mmap
import os
import struct

_SETUP, _ENTER, _REGISTER = 425, 426, 427  # the same numbers on x86_64 and arm64
_REGISTER_BUFFERS = 0
_OP_READ_FIXED = 4
_ENTER_GETEVENTS = 1
_OFF_SQ_RING, _OFF_SQES = 0, 0x10000000


class _SqOffsets(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("head", "tail", "ring_mask", "ring_entries", "flags", "dropped",
                                                 "array", "resv1")] + [("user_addr", ctypes.c_uint64)]


class _CqOffsets(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("head", "tail", "ring_mask", "ring_entries", "overflow", "cqes",
                                                 "flags", "resv1")] + [("user_addr", ctypes.c_uint64)]


class _Params(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("sq_entries", "cq_entries", "flags", "sq_thread_cpu",
                                                 "sq_thread_idle", "features", "wq_fd")] + [
        ("resv", ctypes.c_uint32 * 3), ("sq_off", _SqOffsets), ("cq_off", _CqOffsets)]


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _call(*args: int | ctypes.c_void_p | None) -> int:
    r = _libc.syscall(*args)
    if r < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return r


class Ring:
    """One io_uring with a single submission slot; :meth:`close` releases it (and its pinned buffers)."""

    def __init__(self) -> None:
        self._params = _Params()
        self.fd = _call(_SETUP, 4, ctypes.byref(self._params))
        p = self._params
        # One mapping holds both rings (IORING_FEAT_SINGLE_MMAP, Linux 5.4).
        size = max(p.sq_off.array + p.sq_entries * 4, p.cq_off.cqes + p.cq_entries * 16)
        self._sq = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=_OFF_SQ_RING)
        self._sqes = mmap.mmap(self.fd, p.sq_entries * 64, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE,
                               offset=_OFF_SQES)

    def register(self, address: int, nbytes: int) -> None:
        """Pin ``[address, address + nbytes)`` as fixed buffer 0."""
        iov = _Iovec(address, nbytes)
        _call(_REGISTER, self.fd, _REGISTER_BUFFERS, ctypes.byref(iov), 1)

    def read_fixed(self, fd: int, address: int, nbytes: int) -> None:
        """Read ``nbytes`` of file ``fd`` into fixed buffer 0 at ``address``, and wait for it."""
        p = self._params
        sqe = struct.pack("<BBHiQQIIQH", _OP_READ_FIXED, 0, 0, fd, 0, address, nbytes, 0, 1, 0)
        self._sqes[0:64] = sqe.ljust(64, b"\0")
        tail = struct.unpack_from("<I", self._sq, p.sq_off.tail)[0]
        index = tail & struct.unpack_from("<I", self._sq, p.sq_off.ring_mask)[0]
        struct.pack_into("<I", self._sq, p.sq_off.array + 4 * index, 0)
        struct.pack_into("<I", self._sq, p.sq_off.tail, tail + 1)
        _call(_ENTER, self.fd, 1, 1, _ENTER_GETEVENTS, None, 0)
        head = struct.unpack_from("<I", self._sq, p.cq_off.head)[0]
        slot = head & struct.unpack_from("<I", self._sq, p.cq_off.ring_mask)[0]
        res = struct.unpack_from("<i", self._sq, p.cq_off.cqes + 16 * slot + 8)[0]
        struct.pack_into("<I", self._sq, p.cq_off.head, head + 1)
        if res < 0:
            raise OSError(-res, os.strerror(-res))
        if res != nbytes:
            raise OSError(f"read {res} of {nbytes} bytes")

    def close(self) -> None:
        self._sq.close()
        self._sqes.close()
        os.close(self.fd)


def ring() -> Ring:
    """A new io_uring (OSError where the kernel or a sandbox refuses one)."""
    return Ring()


def pin_without_a_file(address: int, nbytes: int) -> None:
    """Pin ``[address, address + nbytes)`` as a ring's fixed buffer, then register the ring's file with the
    ring itself and close it (liburing's ``io_uring_register_ring_fd`` and ``io_uring_close_ring_fd``): the
    pin stays, and no file of the process shows the ring. For a process that ends soon after."""
    params = _Params()
    fd = _call(_SETUP, 4, ctypes.byref(params))
    iov = _Iovec(address, nbytes)
    _call(_REGISTER, fd, _REGISTER_BUFFERS, ctypes.byref(iov), 1)

    class _Update(ctypes.Structure):
        _fields_ = [("offset", ctypes.c_uint32), ("resv", ctypes.c_uint32), ("data", ctypes.c_uint64)]

    update = _Update(0xFFFFFFFF, 0, fd)  # any free slot
    _call(_REGISTER, fd, 20, ctypes.byref(update), 1)  # IORING_REGISTER_RING_FDS
    os.close(fd)
