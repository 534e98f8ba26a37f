"""The write watch: anonymous weights the kernel shows unwritten are not hashed again, and every
way of writing them (from Python, native code, the kernel, another thread, a forked process,
discarded pages, memory reused by another allocation) gives the digest of the new bytes."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import promptstore._digest as digest_module
import promptstore._watch as watch_module
from promptstore import digest_tensors
from promptstore._watch import WriteWatch, write_watch

pytestmark = pytest.mark.skipif(write_watch() is None, reason="no asynchronous write protection on this kernel")

PAGE = mmap.PAGESIZE
LIBC = ctypes.CDLL(None, use_errno=True)  # mmap and munmap, typed for addresses
LIBC.mmap.restype = ctypes.c_void_p
LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


@pytest.fixture
def hashed(monkeypatch):
    """The byte counts hashed, per call of the digest's hash (the identity is untouched)."""
    sizes: list[int] = []
    real = digest_module._hash_bytes

    def counting(data, *rest):
        sizes.append(data.size)
        return real(data, *rest)

    monkeypatch.setattr(digest_module, "_hash_bytes", counting)
    return sizes


def digest(*tensors: torch.Tensor) -> str:
    return digest_tensors("w", [(f"t{i}", t) for i, t in enumerate(tensors)])


def fresh(*tensors: torch.Tensor) -> str:
    """The digest of the same bytes in memory never digested: hashed, whatever the watch knows."""
    return digest(*(t.clone() for t in tensors))


def plain(*tensors: torch.Tensor) -> str:
    """The digest with no write watch: every byte hashed in place, in one pass."""
    saved = watch_module.write_watch
    digest_module._watch.write_watch = lambda: None
    try:
        return digest(*tensors)
    finally:
        digest_module._watch.write_watch = saved


def weights(n: int = 3, rows: int = 1024) -> list[torch.Tensor]:
    return [torch.randn(rows, 1024) for _ in range(n)]


def test_unwritten_weights_are_not_hashed_again(hashed):
    ws = weights()
    first = digest(*ws)
    assert sum(hashed) == sum(w.nbytes for w in ws)
    hashed.clear()
    assert digest(*ws) == first
    assert hashed == []  # all three recalled
    assert first == fresh(*ws)


def _write_numpy(t: torch.Tensor) -> None:
    t.numpy()[500, 7] += 1.0


def _write_data(t: torch.Tensor) -> None:
    with torch.no_grad():
        t.data[3, 1000] = 42.0


def _write_memmove(t: torch.Tensor) -> None:
    ctypes.memmove(t.data_ptr() + 300 * PAGE + 8, b"\x01\x02\x03\x04", 4)


def _write_by_kernel(t: torch.Tensor, tmp_path) -> None:
    src = tmp_path / "bytes"
    src.write_bytes(b"\x7f" * (2 * PAGE))
    with open(src, "rb") as f:
        f.readinto(memoryview(t.numpy()).cast("B")[100 * PAGE + 5:102 * PAGE + 5])


def _write_from_thread(t: torch.Tensor) -> None:
    th = threading.Thread(target=lambda: t.numpy().__setitem__((900, 900), -3.0))
    th.start()
    th.join()


def _write_proc_mem(t: torch.Tensor) -> None:
    with open("/proc/self/mem", "r+b", buffering=0) as mem:
        mem.seek(t.data_ptr() + 77 * PAGE)
        mem.write(b"\xff" * 16)


def _discard_page(t: torch.Tensor) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = -(-t.data_ptr() // PAGE) * PAGE + 40 * PAGE
    assert libc.madvise(start, PAGE, 4) == 0  # MADV_DONTNEED: the page reads as zeros


def _write_first_byte(t: torch.Tensor) -> None:
    t.view(-1)[0] = 1e9  # the first page, shared with whatever lies before the tensor


def _write_last_byte(t: torch.Tensor) -> None:
    t.view(-1)[-1] = -1e9


WRITES = {"numpy": _write_numpy, "data": _write_data, "memmove": _write_memmove, "thread": _write_from_thread,
          "proc_mem": _write_proc_mem, "discarded page": _discard_page, "first byte": _write_first_byte,
          "last byte": _write_last_byte}


@pytest.mark.parametrize("how", [*WRITES, "kernel read"])
def test_every_write_changes_the_digest(how, tmp_path):
    ws = weights()
    before = digest(*ws)
    digest(*ws)  # recalled
    if how == "kernel read":
        _write_by_kernel(ws[1], tmp_path)
    else:
        WRITES[how](ws[1])
    after = digest(*ws)
    assert after != before
    assert after == fresh(*ws)
    assert digest(*ws) == after  # and remembered again


def test_a_neighbour_writing_a_shared_page_is_compared_not_trusted(hashed):
    """A page shared with a neighbour: the neighbour's writes leave the digest (its own bytes there are
    compared, nothing hashed), and a write to its own bytes there, in a page already written, is seen."""
    block = torch.randn(3 * 1024 * 1024 + 7)  # one allocation, two tensors sharing a page
    a, b = block[:2 * 1024 * 1024 + 3], block[2 * 1024 * 1024 + 3:]
    other = torch.randn(3 * 1024 * 1024)
    c, d = other[:5], other[5:2 * 1024 * 1024]  # one that shares its first page with c
    first, first_d = digest(a), digest(d)
    hashed.clear()
    b[0] = 5.0  # in a's last page
    c[0] = 5.0  # in d's first page
    assert digest(a) == first and digest(d) == first_d
    assert hashed == []
    a[-1] = 7.0  # its own bytes in that page
    d[0] = 7.0
    assert digest(a) == fresh(a) == plain(a) != first
    assert digest(d) == fresh(d) == plain(d) != first_d


def test_neighbours_sharing_a_page_are_both_recalled(hashed):
    """Protecting one tensor protects again the page it shares with its neighbour: unwritten, so the
    neighbour's digest stays valid (else each call would hash one of them again)."""
    block = torch.randn(3 * 1024 * 1024 + 7)
    a, b = block[:2 * 1024 * 1024 + 3], block[2 * 1024 * 1024 + 3:]
    first = digest(a, b)
    assert first == plain(a, b)  # the shared pages' copies hashed with the rest: the same digest as one pass
    hashed.clear()
    assert digest(a, b) == first and digest(a, b) == first
    assert hashed == []


def test_memory_mapped_again_under_a_tensor_is_hashed():
    """The same addresses, new pages (a mapping replaced, as an allocator frees and maps again)."""
    libc = LIBC
    n, rw, private_anonymous, fixed = 8 << 20, 3, 0x22, 0x10
    address = libc.mmap(None, n, rw, private_anonymous, -1, 0)
    try:
        t = torch.frombuffer((ctypes.c_char * n).from_address(address), dtype=torch.float32)
        t.fill_(1.5)
        before = digest(t)
        assert digest(t) == before
        assert libc.mmap(address, n, rw, private_anonymous | fixed, -1, 0) == address  # zero pages, unregistered
        assert digest(t) == fresh(t) != before
        t.fill_(1.5)
        assert digest(t) == before
    finally:
        libc.munmap(address, n)


def test_a_file_mapped_under_a_tensor_is_hashed_not_recalled(tmp_path):
    """A file's private mapping put where remembered anonymous memory was (the scan asks for no file pages:
    the mapping itself must break the proof), with other bytes than those remembered."""
    libc = LIBC
    n, rw, private, private_anonymous, fixed = 8 << 20, 3, 0x02, 0x22, 0x10
    path = tmp_path / "other.bin"
    path.write_bytes(np.full(n // 4, 2.5, np.float32).tobytes())
    address = libc.mmap(None, n, rw, private_anonymous, -1, 0)
    try:
        t = torch.frombuffer((ctypes.c_char * n).from_address(address), dtype=torch.float32)
        t.fill_(1.5)
        before = digest(t)
        assert digest(t) == before
        with open(path, "rb") as f:
            assert libc.mmap(address, n, rw, private | fixed, f.fileno(), 0) == address
        assert float(t[0]) == 2.5
        assert digest(t) == fresh(t) != before
    finally:
        libc.munmap(address, n)


def test_protecting_an_overlapping_view_forgets_the_whole():
    """Protecting a view resets the kernel's record of writes to its pages: a remembered digest of the
    tensor around it must not survive on that record."""
    w = torch.randn(4096, 1024)
    before = digest(w)
    w[2000, 0] = 123.0  # written: the whole tensor's pages show it...
    view = w[1500:2500]  # (4 MB: large enough to be watched)
    digest(view)  # ...until the view's protection resets them
    after = digest(w)
    assert after != before
    assert after == fresh(w)


def test_a_protection_after_the_hash_started_keeps_it_from_being_remembered():
    watch = write_watch()
    w = torch.randn(2048, 1024)
    key = (w.data_ptr(), w.nbytes)
    first = watch.protect(*key)
    w[66, 0] = 1.0  # a write while the first protection's bytes are hashed...
    second = watch.protect(w.data_ptr() + 64 * PAGE, 8 * PAGE)  # ...and a newer protection that resets it
    watch.remember(first, b"stale")
    assert watch.recall([key]) == [None]
    watch.remember(second, b"view")
    assert watch.recall([(w.data_ptr() + 64 * PAGE, 8 * PAGE)]) == [b"view"]


def test_a_forked_child_writes_its_own_copy_and_digests_it_right():
    w = torch.randn(2048, 1024)
    before = digest(w)
    digest(w)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            torch.set_num_threads(1)  # OpenMP's thread team does not survive fork
            ok = write_watch() is not None and digest(w) == before
            w[7, 7] = 99.0
            ok = ok and digest(w) != before and digest(w) == fresh(w)
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.waitpid(pid, 0)
    assert answer == b"1"
    assert digest(w) == before == fresh(w)  # the child's writes were to its own copy
    w[7, 7] = 99.0  # the parent's write after fork (pages shared copy-on-write) is seen too
    assert digest(w) == fresh(w) != before


def test_shared_memory_is_never_trusted(hashed):
    w = torch.randn(2048, 1024).share_memory_()
    before = digest(w)
    hashed.clear()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child writes through its own mapping
        w[5, 5] = 7.0
        os._exit(0)
    os.waitpid(pid, 0)
    assert digest(w) == fresh(w) != before
    assert hashed and hashed[0] == w.nbytes  # hashed every time, never recalled


def test_a_numpy_array_and_a_strided_copy():
    a = np.random.rand(512, 1024)
    before = digest_tensors("a", [("a", a), ("t", a.T)])
    a[3, 3] = 0.5
    assert digest_tensors("a", [("a", a), ("t", a.T)]) == digest_tensors("a", [("a", a.copy()), ("t", a.T.copy())]) != before


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 2 * 1024 * 1024 - 1), st.booleans()), max_size=12))
def test_random_writes_and_digests_agree_with_hashing(steps):
    """Writes anywhere (an edge, the middle, one of several tensors), each followed or not by a digest."""
    block = torch.zeros(5 * 2 * 1024 * 1024 + 3)
    ws = [block[i * 2 * 1024 * 1024 + 1:(i + 1) * 2 * 1024 * 1024 + 1] for i in range(5)]
    digest(*ws)
    for k, (which, at, check) in enumerate(steps):
        ws[which][at] = k + 1.0
        if check:
            assert digest(*ws) == fresh(*ws)
    assert digest(*ws) == fresh(*ws)


def test_a_protection_that_fails_part_way_forgets_what_it_may_have_reset(monkeypatch):
    """A walk that fails after protecting some pages again may have erased the kernel's record of a write
    to a remembered range: that range is forgotten, and the failed one is not remembered."""
    w = torch.randn(2048, 1024)
    before = digest(w)
    w[10, 10] = 5.0
    real = WriteWatch._protect_written
    monkeypatch.setattr(WriteWatch, "_protect_written", lambda self, lo, hi: (real(self, lo, hi), None)[1])
    view = w[:512]  # (2 MB: watched) its walk protects the written page again, then fails
    assert digest(view) == plain(view)
    monkeypatch.undo()
    assert digest(w) == plain(w) != before


def test_a_hole_in_a_remembered_range_is_not_trusted():
    """The kernel's scan reports nothing for unmapped addresses: the proof needs the whole range mapped."""
    watch = write_watch()
    libc = LIBC
    n = 4 << 20
    address = libc.mmap(None, n, 3, 0x22, -1, 0)  # private anonymous, read-write
    try:
        ctypes.memset(address, 1, n)
        protected = watch.protect(address, n)
        watch.remember(protected, b"digest")
        assert watch.recall([(address, n)]) == [b"digest"]
        assert libc.munmap(address + n // 2, PAGE) == 0
        assert watch.recall([(address, n)]) == [None]
    finally:
        libc.munmap(address, n)


def test_the_watch_can_be_turned_off_and_writes_meanwhile_are_seen(monkeypatch, hashed):
    w = torch.randn(2048, 1024)
    before = digest(w)
    monkeypatch.setenv("PROMPTSTORE_WRITE_WATCH", "0")
    assert write_watch() is None
    hashed.clear()
    assert digest(w) == before
    assert hashed == [w.nbytes]  # hashed again: nothing recalled
    w[3, 3] = 2.0
    monkeypatch.delenv("PROMPTSTORE_WRITE_WATCH")
    assert write_watch() is not None
    assert digest(w) == plain(w) != before


_PINNED = """
import os, sys
import torch
import uring
import promptstore._watch as watch_module
from promptstore import digest_tensors

try:
    ring = uring.ring()
except OSError as e:
    print("no io_uring:", e)
    sys.exit(0)
page = os.sysconf("SC_PAGE_SIZE")
w = torch.randn(1024, 1024)
ring.register(w.data_ptr(), w.nbytes)  # pinned before the first digest, as a server pins its buffers at start
before = digest_tensors("w", [("w", w)])
print("watch", watch_module.write_watch() is not None)
with open(sys.argv[1], "wb") as f:
    f.write(b"\x55" * page)
fd = os.open(sys.argv[1], os.O_RDONLY)
at = -(-w.data_ptr() // page) * page + 10 * page
ring.read_fixed(fd, at, page)  # the kernel writes the page without this process's page tables
assert w.view(-1).view(torch.uint8)[at - w.data_ptr()].item() == 0x55
after = digest_tensors("w", [("w", w)])
print("changed", after != before, after == digest_tensors("w", [("w", w.clone())]))
ring.close()
print("watch after close", watch_module.write_watch() is not None)
"""


def test_memory_the_kernel_writes_by_dma_turns_the_watch_off(tmp_path):
    """io_uring's fixed buffers, like a device's pinned memory, are written through the physical page and
    read as unwritten: while such a file is open the watch is off (for good: what it knew may be stale)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    run = subprocess.run([sys.executable, "-c", _PINNED, str(tmp_path / "page")], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    if run.stdout.startswith("no io_uring"):
        pytest.skip(run.stdout.strip())
    assert run.stdout.split("\n")[:3] == ["watch False", "changed True True", "watch after close False"]


def test_a_child_forked_while_the_watch_is_busy_starts_its_own():
    """A fork while another thread holds the watch's lock: the child does not wait on that lock forever,
    and it does not use its parent's userfaultfd."""
    parent = write_watch()
    with watch_module._watch_lock, parent._lock:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                torch.set_num_threads(1)
                child = write_watch()
                os._exit(0 if child is not None and child is not parent else 1)
            finally:
                os._exit(2)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0


def test_a_process_holding_more_files_than_are_checked_hashes():
    """Too many files to check on every fingerprint: the watch is off, and stays off."""
    script = ("import os; import promptstore._watch as w\n"
              "on = w.write_watch() is not None\n"
              "fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(w._MAX_FILES_CHECKED + 1)]\n"
              "many = w.write_watch() is not None\n"
              "[os.close(fd) for fd in fds]\n"
              "print(on, many, w.write_watch() is not None)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.stdout.split() == ["True", "False", "False"], run.stderr


@pytest.mark.parametrize("value", ["0", "off", "false", "no", " OFF "])
def test_every_spelling_of_off_turns_the_watch_off(monkeypatch, value):
    monkeypatch.setenv("PROMPTSTORE_WRITE_WATCH", value)
    assert write_watch() is None


def test_device_files_are_found_in_the_process_files():
    """What turns the watch off, asked directly (asking write_watch would turn it off for the whole suite)."""
    from uring import ring

    assert not watch_module._dma_possible()
    try:
        r = ring()
    except OSError as e:
        pytest.skip(f"no io_uring: {e}")
    try:
        assert watch_module._dma_possible()
    finally:
        r.close()
    assert not watch_module._dma_possible()
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(watch_module._MAX_FILES_CHECKED + 1)]
    try:
        assert watch_module._dma_possible()  # too many to check: as if one were a device's
    finally:
        for fd in fds:
            os.close(fd)


def _page_aligned(n: int):
    libc = LIBC
    address = libc.mmap(None, n, 3, 0x22, -1, 0)
    return address, torch.frombuffer((ctypes.c_char * n).from_address(address), dtype=torch.float32), libc


@pytest.mark.parametrize("where", ["first", "last"])
def test_a_page_aligned_range_sees_writes_to_its_edge_pages(where):
    """A range that starts and ends on page boundaries keeps no edge bytes: a write to its first or last page
    is a write to a page it fills alone."""
    n = 4 << 20
    address, t, libc = _page_aligned(n)
    try:
        t.normal_()
        before = digest(t)
        assert digest(t) == before
        t[0 if where == "first" else -1] = 12345.0
        assert digest(t) == plain(t) != before
    finally:
        del t
        libc.munmap(address, n)


def test_a_span_with_many_written_regions_still_recalls_its_clean_members(hashed):
    """Two ranges close enough to be scanned together; one written in many separate places, more than the
    scan's vector holds: each is then scanned alone, and the clean one is still recalled."""
    block = torch.randn(2 * 1024 * 1024 + 2 * 1024 * 1024)
    a, b = block[:2 * 1024 * 1024], block[2 * 1024 * 1024:]
    first = digest(a, b)
    b.view(-1, PAGE // 4)[::2, 0] += 1.0  # every other page of b: hundreds of separate regions
    hashed.clear()
    after = digest(a, b)
    assert hashed == [b.nbytes]  # a recalled
    assert after == plain(a, b) != first


def test_a_protection_after_many_writes_is_still_remembered():
    """Past the record of recent writes (4,096 regions) the oldest are dropped: protections older than what
    was dropped are not remembered, newer ones are."""
    watch = write_watch()
    old = torch.randn(1024, 1024)
    stale = watch.protect(old.data_ptr(), old.nbytes)
    flood = torch.randn(4096, 1024)  # 4,096 pages
    for _ in range(10):
        digest(flood)
        flood.view(-1, PAGE // 4)[::2, 0] += 1.0  # 2,048 separate written regions, found by the next protection
    digest(flood)
    watch.remember(stale, b"old")
    assert watch.recall([(old.data_ptr(), old.nbytes)]) == [None]
    w = torch.randn(1024, 1024)
    assert digest(w) == plain(w)
    assert watch.recall([(w.data_ptr(), w.nbytes)]) != [None]


def test_memory_pinned_by_a_ring_without_a_file_turns_the_watch_off():
    """A ring registered with itself and its file closed pins the weights with no file to show it: the
    kernel's count of pinned memory does."""
    script = ("import sys, torch, uring\n"
              "import promptstore._watch as w\n"
              "t = torch.randn(1024, 1024)\n"
              "before = w._dma_possible()\n"
              "try:\n"
              "    uring.pin_without_a_file(t.data_ptr(), t.nbytes)\n"
              "except OSError as e:\n"
              "    print('no io_uring:', e); sys.exit(0)\n"
              "print(before, w._dma_possible(), w.write_watch() is not None)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    if run.stdout.startswith("no io_uring"):
        pytest.skip(run.stdout.strip())
    assert run.stdout.split() == ["False", "True", "False"]


def test_a_half_imported_torch_does_not_break_the_check(monkeypatch):
    """Another thread importing torch: sys.modules holds a module without its ``cuda`` yet."""
    import types

    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    assert watch_module._dma_possible() is False


def test_another_process_writing_through_the_kernel_is_seen():
    """process_vm_writev (a debugger's, or a profiler's, write) from another process into the weights."""

    class Iovec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    w = torch.randn(2048, 1024)
    ready, go, answer = os.pipe(), os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child, whose weights the parent writes
        try:
            torch.set_num_threads(1)
            before = digest(w)
            ok = digest(w) == before
            os.write(ready[1], b"1")
            os.read(go[0], 1)
            after = digest(w)
            os.write(answer[1], b"1" if ok and after != before and after == plain(w) else b"0")
        finally:
            os._exit(0)
    try:
        assert os.read(ready[0], 1) == b"1"
        data = ctypes.create_string_buffer(b"\x5a" * 64)
        at = w.data_ptr() + 1000 * 4096 + 12
        libc = ctypes.CDLL(None, use_errno=True)
        libc.process_vm_writev.restype = ctypes.c_ssize_t
        wrote = libc.process_vm_writev(pid, ctypes.byref(Iovec(ctypes.addressof(data), 64)), 1,
                                       ctypes.byref(Iovec(at, 64)), 1, 0)
        os.write(go[1], b"1")
        if wrote != 64:
            pytest.skip(f"process_vm_writev refused here (errno {ctypes.get_errno()})")
        assert os.read(answer[0], 1) == b"1"
    finally:
        os.waitpid(pid, 0)
