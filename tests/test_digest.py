"""Weight digests: any change to any element changes them, on the host and on a device (issue #10)."""

from __future__ import annotations

import os
import sqlite3
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import promptstore._digest as digest
from promptstore import digest_tensors

from conftest import run_python


@pytest.fixture(autouse=True)
def _page_proof_for_small_files(monkeypatch):
    """These tests' files are small: the page proof applies to them as to a real model's weights."""
    monkeypatch.setattr(digest, "_PROOF_MIN_TOTAL", 0)



@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 5000), where=st.data(), dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16,
                                                                       torch.int8, torch.float64]))

def test_one_element_changed_anywhere_changes_both_digests(n, where, dtype):
    t = (torch.randn(n) * 10).to(dtype)
    i = where.draw(st.integers(0, n - 1))
    u = t.clone()
    u.view(torch.uint8)[i * t.element_size()] ^= 1  # flip one bit of element i
    host = digest_tensors("w", [("w", t)])
    assert host == digest_tensors("w", [("w", t.clone())]) != digest_tensors("w", [("w", u)])
    dev = digest.device_word_digest(torch, t).tobytes()
    assert dev == digest.device_word_digest(torch, t.clone()).tobytes() != digest.device_word_digest(torch, u).tobytes()


def test_device_digest_sees_chunks_moved_or_swapped(monkeypatch):
    monkeypatch.setattr(digest, "_CHUNK_WORDS", 1000)
    monkeypatch.setattr(digest, "_MULTIPLIERS", {})
    t = torch.randn(4000)
    whole = digest.device_word_digest(torch, t).tobytes()
    assert digest.device_word_digest(torch, t.clone()).tobytes() == whole
    swapped = torch.cat([t[1000:2000], t[:1000], t[2000:]])  # the same words, two chunks swapped
    assert digest.device_word_digest(torch, swapped).tobytes() != whole
    shifted = torch.cat([t[1:], t[:1]])
    assert digest.device_word_digest(torch, shifted).tobytes() != whole


def test_names_dtypes_shapes_and_ties_are_part_of_the_digest():
    w = torch.ones(4, 4)
    base = digest_tensors("m", [("a", w), ("b", w)])  # b tied to a
    assert base != digest_tensors("m", [("a", w), ("b", w.clone())])  # same bytes, no longer tied
    assert base != digest_tensors("m", [("a", w.reshape(16)), ("b", w.reshape(16))])
    assert base != digest_tensors("m", [("a", w.double()), ("b", w.double())])
    assert base != digest_tensors("m", [("x", w), ("b", w)])
    assert digest_tensors("m", [("s", torch.tensor(2.0))]) != digest_tensors("m", [("s", torch.tensor(3.0))])  # 0-dim
    assert digest_tensors("m", [("a", np.ones(3, np.float32))]) == digest_tensors("m", [("a", np.ones(3, np.float32))])
    with pytest.raises(TypeError):
        digest_tensors("m", [("a", [1, 2, 3])])


# -- issue #12: weights mapped from files are named by the files, proven by their pages ---------------
N = 1 << 18  # 1 MB of float32: above the size where pages are looked at instead of hashing


@pytest.fixture
def weights_file(tmp_path, monkeypatch):
    monkeypatch.setattr(digest, "_RACY_S", 0.0)  # written just now: let its digests be remembered
    monkeypatch.setenv("PROMPTSTORE_DIGESTS", str(tmp_path / "digests.sqlite3"))
    path = tmp_path / "w.bin"
    path.write_bytes(np.random.default_rng(0).standard_normal(N).astype(np.float32).tobytes())
    return path


def _mapped(path, touch=True):
    t = torch.from_file(str(path), shared=False, size=N, dtype=torch.float32)  # a private mapping, like safetensors
    if not touch:
        return t
    t.sum()  # its pages read in, as a loaded model's are
    pages = digest._Pages()
    assert pages.file_range(t.data_ptr(), N * 4) is not None
    pages.close()
    return t


def test_a_mapped_tensor_has_the_digest_of_its_bytes_and_a_write_changes_it(weights_file):
    t = _mapped(weights_file)
    hashed = digest_tensors("w", [("w", t.clone())])  # the same bytes in anonymous memory: hashed
    assert digest_tensors("w", [("w", t)]) == hashed  # from the file's pages, then remembered
    assert digest_tensors("w", [("w", t)]) == hashed  # recalled
    t.data[12345] += 1.0  # the written page becomes the process's own copy: no longer the file's
    assert digest_tensors("w", [("w", t)]) == digest_tensors("w", [("w", t.clone())]) != hashed


def test_a_remembered_digest_of_the_wrong_length_is_not_used(weights_file, monkeypatch):
    """A damaged memo row (not a 16-byte digest) is ignored: the pages' bytes are hashed again."""
    t = _mapped(weights_file)
    truth = digest_tensors("w", [("w", t)])  # remembered in the memo file
    with sqlite3.connect(os.environ["PROMPTSTORE_DIGESTS"]) as db:
        assert db.execute("UPDATE digests SET digest = ?", (b"\x01" * 15,)).rowcount == 1
    monkeypatch.setattr(digest, "_memo", digest._Memo())  # a fresh process: only the file remembers
    assert digest_tensors("w", [("w", t)]) == truth == digest_tensors("w", [("w", t.clone())])


def test_a_file_rewritten_in_place_changes_the_digest_of_its_mapped_pages(weights_file):
    t = _mapped(weights_file)
    before = digest_tensors("w", [("w", t)])
    with open(weights_file, "r+b") as f:  # another process rewrites the file: pages not copied follow it
        f.seek(4 * 777)
        f.write(np.float32(42.0).tobytes())
    assert float(t[777]) == 42.0
    assert digest_tensors("w", [("w", t)]) == digest_tensors("w", [("w", t.clone())]) != before


def test_a_fresh_process_names_mapped_weights_without_hashing_them(weights_file):
    t = _mapped(weights_file)
    parent = digest_tensors("w", [("w", t)])
    code = f"""
        import numpy as np, torch
        import promptstore._digest as digest
        digest._PROOF_MIN_TOTAL = 0  # a small file: use the page proof anyway
        hashed = []
        real = digest._hash_bytes
        digest._hash_bytes = lambda data, *rest: (hashed.append(data.size), real(data, *rest))[1]
        t = torch.from_file({str(weights_file)!r}, shared=False, size={N}, dtype=torch.float32)
        t.sum()  # pages read in, as load_model leaves a model's
        child = digest.digest_tensors("w", [("w", t)])
        assert child == {parent!r}, child
        assert {N * 4} not in hashed, hashed  # recalled from the memo, not read
        t.data[3] = 7.0
        assert digest.digest_tensors("w", [("w", t)]) != {parent!r}
        print("ok")
    """
    assert run_python(code).stdout.strip() == "ok"


@pytest.fixture(params=["scan", "read"])
def pagemap(request, monkeypatch):
    """Pages asked of the kernel by PAGEMAP_SCAN (Linux 6.7+: only those not the file's), or each page's entry read."""
    if request.param == "read":
        monkeypatch.setattr(digest, "_pagemap_scan_works", False)
    else:
        monkeypatch.setattr(digest, "_pagemap_scan_works", None)  # asked of the kernel again, whatever came before
        probe = digest._Pages()
        answered = probe._scan(id(probe) // digest._PAGE, id(probe) // digest._PAGE)
        probe.close()
        if answered is None and digest._pagemap_scan_works is False:  # the ioctl itself refused
            pytest.skip("this kernel has no PAGEMAP_SCAN")
    return request.param


def test_the_scan_and_the_per_page_entries_agree_page_by_page(weights_file, monkeypatch):
    """Whatever pages a write made the process's own (a huge page of the file may be split, its other pages
    unmapped), and whatever pages were never read in, both ways of asking report the same pages."""
    whole = np.memmap(weights_file, dtype=np.float32, mode="c", shape=(N,))
    whole[: N // 2].sum()  # the first half read in, the second not
    for element in (0, 70_000, N // 2 - 1, N - 1):
        whole[element] += 1.0
        addr = whole.ctypes.data
        first, last = addr // digest._PAGE, (addr + N * 4 - 1) // digest._PAGE
        pages = digest._Pages()
        scanned = pages._scan(first, last)
        if scanned is None:
            pytest.skip("this kernel has no PAGEMAP_SCAN")
        monkeypatch.setattr(digest, "_pagemap_scan_works", False)
        read = pages._file_pages(first, last)
        monkeypatch.setattr(digest, "_pagemap_scan_works", True)
        pages.close()
        assert read is not None and np.array_equal(scanned, read)
        assert not scanned[(addr + element * 4) // digest._PAGE - first]  # the written page: never the file's
    del whole


def test_where_the_kernel_scans_no_page_entry_is_read(weights_file, monkeypatch, pagemap):
    """With PAGEMAP_SCAN the proof costs one ioctl per span, never a read of 8 bytes per page, call after call."""
    t = _mapped(weights_file)
    if pagemap == "read":
        pytest.skip("the per-page read is what the other branch does")

    def no_reads(*args):
        raise AssertionError("read the pagemap page by page")

    monkeypatch.setattr(digest.os, "pread", no_reads)
    for _ in range(2):
        pages = digest._Pages()
        assert pages.file_range(t.data_ptr(), N * 4) is not None
        pages.close()


def test_pages_not_read_in_are_hashed_not_trusted(weights_file, monkeypatch, pagemap):
    """A page not present proves nothing (a /proc that reported nothing would look the same): its bytes are hashed."""
    t = _mapped(weights_file)
    known = digest_tensors("w", [("w", t)])  # remembered
    fresh = _mapped(weights_file, touch=False)
    hashed = []
    real = digest._hash_bytes
    monkeypatch.setattr(digest, "_hash_bytes", lambda data, *rest: (hashed.append(data.size), real(data, *rest))[1])
    assert digest_tensors("w", [("w", fresh)]) == known
    assert N * 4 in hashed


@pytest.mark.parametrize("span", [(0, N), (1000, N - 333)], ids=["whole-mapping", "unaligned-slice"])
@pytest.mark.parametrize("how", ["torch.from_file", "np.memmap"])
def test_a_mapped_weight_written_only_in_its_last_page_gets_a_fresh_digest(weights_file, how, span, pagemap):
    """Every page a tensor lies in is checked, the last one included (its final element may be all that changed)."""
    lo, hi = span
    if how == "np.memmap":
        whole = np.memmap(weights_file, dtype=np.float32, mode="c", shape=(N,))  # copy-on-write: a private mapping
        w = whole[lo:hi]
        w.sum()  # pages read in
    else:
        w = _mapped(weights_file)[lo:hi]
    addr = w.ctypes.data if how == "np.memmap" else w.data_ptr()
    nbytes = (hi - lo) * 4
    pages = digest._Pages()
    assert pages.file_range(addr, nbytes) is not None  # the page proof applies: its digest is remembered
    pages.close()
    copy = w.copy() if how == "np.memmap" else w.clone()
    remembered = digest_tensors("w", [("w", w)])
    assert remembered == digest_tensors("w", [("w", copy)])  # hashed in anonymous memory: the same bytes
    assert digest_tensors("w", [("w", w)]) == remembered  # recalled by the file's identity
    last_page = (addr + nbytes - 1) // digest._PAGE
    assert (addr + nbytes - 4) // digest._PAGE == last_page  # the last element lies in the last page only
    w[-1] += 1.0  # only the last page is now the process's own copy
    assert digest_tensors("w", [("w", w)]) != remembered
    changed = w.copy() if how == "np.memmap" else w.clone()
    assert digest_tensors("w", [("w", w)]) == digest_tensors("w", [("w", changed)])
    if how == "np.memmap":
        del w, whole


@pytest.fixture(params=["query", "maps"])
def lookup(request, monkeypatch):
    """Mappings found by the kernel's PROCMAP_QUERY (Linux 6.11+), or by reading /proc/self/maps whole."""
    if request.param == "maps":
        monkeypatch.setattr(digest, "_procmap_query_works", False)
    else:
        probe = digest._Pages()
        probe._mapping(id(probe))  # an address in this process's heap
        probe.close()
        if digest._procmap_query_works is False:
            pytest.skip("this kernel has no PROCMAP_QUERY")
    return request.param


def test_both_lookups_find_the_same_mapping_and_offset(weights_file, lookup):
    t = _mapped(weights_file)
    pages = digest._Pages()
    try:
        whole = pages.file_range(t.data_ptr(), N * 4)
        inner = pages.file_range(t.data_ptr() + 3 * digest._PAGE + 8, 5000)
        assert whole is not None and inner is not None and whole[0] == inner[0]
        assert whole[1] == 0 and inner[1] == 3 * digest._PAGE + 8
        assert pages.file_range(t.data_ptr() + 4, N * 4) is None  # runs past the mapping's end
        anon = torch.zeros(N)
        assert pages.file_range(anon.data_ptr(), N * 4) is None
    finally:
        pages.close()
    assert digest._procmap_query_works is (lookup == "query")


@pytest.mark.parametrize("written", [0, 1, 2, 3])
def test_many_tensors_of_one_file_in_any_order_each_see_their_own_writes(weights_file, written):
    """A model's tensors lie one after another in its file and are listed in another order: the
    pages of neighbouring ones are read together, and each is still proven by its own pages only."""
    t = _mapped(weights_file)
    page = digest._PAGE // 4  # floats per page
    parts = [("far", t[200 * page:260 * page]), ("a", t[0:20 * page + 7]), ("c", t[40 * page:60 * page]),
             ("b", t[20 * page + 7:30 * page])]  # b starts inside a's last page; c lies 10 pages on
    before = digest_tensors("w", parts)
    assert digest_tensors("w", parts) == before == digest_tensors("w", [(n, x.clone()) for n, x in parts])
    name, part = parts[written]
    part.data[-1] += 1.0  # the last element of one tensor: its last page only
    after = digest_tensors("w", parts)
    assert after == digest_tensors("w", [(n, x.clone()) for n, x in parts]) != before, name


def test_a_shared_mapping_is_never_proven(weights_file, lookup):
    """A shared mapping's writes land in the file's own pages (still file pages): only private ones prove bytes."""
    t = torch.from_file(str(weights_file), shared=True, size=N, dtype=torch.float32)
    t.sum()
    pages = digest._Pages()
    try:
        assert pages.file_range(t.data_ptr(), N * 4) is None
    finally:
        pages.close()
    before = digest_tensors("w", [("w", t)])
    t[12345] += 1.0
    assert digest_tensors("w", [("w", t)]) == digest_tensors("w", [("w", t.clone())]) != before


def test_a_write_is_seen_whichever_lookup_found_the_mapping(weights_file, lookup):
    t = _mapped(weights_file)
    remembered = digest_tensors("w", [("w", t)])
    assert digest_tensors("w", [("w", t)]) == remembered == digest_tensors("w", [("w", t.clone())])
    t.data[N // 2] += 1.0
    assert digest_tensors("w", [("w", t)]) == digest_tensors("w", [("w", t.clone())]) != remembered


@pytest.mark.parametrize("lib", ["torch", "numpy"])
@pytest.mark.parametrize("shape", [(4, 4), (3, 5)], ids=["square", "oblong"])
def test_a_tensor_listed_with_its_transpose_is_not_tied_to_it(lib, shape):
    """Ties are recognised by the whole view (pointer, dtype, shape, strides): a transpose shares the pointer only."""
    w = torch.randn(*shape) if lib == "torch" else np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    wt = w.t() if lib == "torch" else w.T
    wt_copy = wt.contiguous() if lib == "torch" else np.ascontiguousarray(wt)
    ptr = (lambda t: t.data_ptr()) if lib == "torch" else (lambda t: t.__array_interface__["data"][0])
    assert ptr(wt) == ptr(w)
    with_transpose = digest_tensors("m", [("a", w), ("b", wt)])
    assert with_transpose != digest_tensors("m", [("a", w), ("b", w)])  # not a tied pair
    assert with_transpose == digest_tensors("m", [("a", w), ("b", wt_copy)])  # the same as an untied copy
    # The transpose listed twice is a tie, like any tensor listed twice.
    assert digest_tensors("m", [("a", wt), ("b", wt)]) == digest_tensors("m", [("a", wt_copy), ("b", wt_copy)])


@pytest.mark.parametrize("lib", ["torch", "numpy"])
def test_distinct_tensors_of_one_dtype_and_shape_are_never_tied(lib):
    """Only the same memory is a tie: a second array like the first is digested by its own bytes."""
    rng = np.random.default_rng(7)
    a, b, c = (rng.standard_normal((8, 8)).astype(np.float32) for _ in range(3))
    if lib == "torch":
        a, b, c = (torch.from_numpy(x) for x in (a, b, c))
    assert digest_tensors("m", [("a", a), ("b", b)]) != digest_tensors("m", [("a", a), ("b", c)])
    assert digest_tensors("m", [("a", a), ("b", b)]) == digest_tensors("m", [("a", a), ("b", b.copy() if lib == "numpy" else b.clone())])
    # The same memory through another view object is a tie, as the same object listed twice is.
    assert digest_tensors("m", [("a", a), ("b", a[:])]) == digest_tensors("m", [("a", a), ("b", a)])
    if lib == "numpy":  # read-only arrays (np.load(mmap_mode="r"), frombuffer over bytes) alike
        for x in (a, b, c):
            x.flags.writeable = False
        assert digest_tensors("m", [("a", a), ("b", b)]) != digest_tensors("m", [("a", a), ("b", c)])


def test_a_weight_swapped_while_its_model_is_digested_is_digested_as_it_was():
    """``p.data = ...`` (``.half()``, ``load_state_dict(assign=True)``) between reading a parameter and hashing
    it: the bytes read are the ones it held, never freed memory."""
    p = torch.nn.Parameter(torch.randn(1 << 22), requires_grad=False)  # 16 MB: freed at once when dropped
    before = p.detach().clone()

    def named():
        yield "w", p
        p.data = torch.zeros(4)
        yield "b", torch.ones(3)

    assert digest_tensors("m", named()) == digest_tensors("m", [("w", before), ("b", torch.ones(3))])


def test_conjugate_and_negative_views_are_digested_as_their_values():
    x = torch.tensor([1 + 2j, 3 - 4j])
    assert digest_tensors("m", [("x", x.conj())]) == digest_tensors("m", [("x", x.conj().resolve_conj())])
    assert digest_tensors("m", [("x", x.conj())]) != digest_tensors("m", [("x", x)])
    t = torch.randn(5)
    neg = torch._neg_view(t)
    assert digest_tensors("m", [("t", neg)]) == digest_tensors("m", [("t", -t)]) != digest_tensors("m", [("t", t)])


@pytest.mark.parametrize("lib", ["torch", "numpy"])
def test_tensors_made_on_the_fly_are_never_tied_by_a_reused_address(lib):
    """A generator of temporaries (``(n, p.t() * 1) for ...``): each is freed once the next is drawn.

    Its address is then free for a later temporary of the same dtype, shape and strides, which
    must not be taken for a tie of the first (its bytes would be left out of the digest: two
    models differing in that weight would share a digest).
    """
    rng = np.random.default_rng(5)
    ws = [rng.standard_normal((64, 64)).astype(np.float32) for _ in range(12)]
    if lib == "torch":
        ws = [torch.from_numpy(w) for w in ws]
    on_the_fly = (lambda ws: ((f"w{i}", w.t().mul(1.0)) for i, w in enumerate(ws))) if lib == "torch" else \
        (lambda ws: ((f"w{i}", (w * 1.0).T) for i, w in enumerate(ws)))
    truth = digest_tensors("m", list(on_the_fly(ws)))  # all alive at once: no address is reused
    other = [w.clone() if lib == "torch" else w.copy() for w in ws]
    other[6] += 1.0
    truth_other = digest_tensors("m", list(on_the_fly(other)))
    assert truth != truth_other
    for _ in range(40):
        assert digest_tensors("m", on_the_fly(ws)) == truth
        assert digest_tensors("m", on_the_fly(other)) == truth_other


def test_the_memo_lives_where_the_environment_says(monkeypatch, tmp_path):
    monkeypatch.setenv("PROMPTSTORE_DIGESTS", str(tmp_path / "m.sqlite3"))
    assert digest.digest_memo_path() == tmp_path / "m.sqlite3"
    monkeypatch.setenv("PROMPTSTORE_DIGESTS", "")
    assert digest.digest_memo_path() is None  # empty turns the memo off
    monkeypatch.setenv("PROMPTSTORE_DIGESTS", "~/x.sqlite3")
    assert digest.digest_memo_path() == Path("~/x.sqlite3").expanduser()
    monkeypatch.delenv("PROMPTSTORE_DIGESTS")
    import platformdirs

    assert digest.digest_memo_path() == Path(platformdirs.user_cache_dir("promptstore-digests", appauthor=False)) / "digests.sqlite3"


def _halves(t) -> tuple[bytes, bytes]:
    out = digest.device_word_digest(torch, t).tobytes()
    assert len(out) == 16
    return out[:8], out[8:]


def _both_change(a, b) -> bool:
    x, y = _halves(a), _halves(b)
    return x[0] != y[0] and x[1] != y[1]


def test_each_device_sum_sees_every_bit_of_every_word(monkeypatch):
    """Both 8-byte sums change for a flip of any bit (the top one too) at any position, and for swapped words."""
    monkeypatch.setattr(digest, "_CHUNK_WORDS", 64)
    monkeypatch.setattr(digest, "_MULTIPLIERS", {})
    t = torch.randint(-2**31, 2**31 - 1, (200,), dtype=torch.int32)
    for i in range(200):
        for bit in (0, 17, 31):
            u = t.clone()
            u[i] ^= torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32) if bit < 31 else torch.tensor(-2**31, dtype=torch.int32)
            assert _both_change(t, u), (i, bit)
    for i, j in ((0, 1), (3, 60), (10, 130), (64, 128)):
        u = t.clone()
        u[i], u[j] = t[j], t[i]
        assert _both_change(t, u), (i, j)
    # Only the first chunk changed: a sum that kept only the last chunk's part would not see it.
    u = t.clone()
    u[5] += 1
    assert _both_change(t, u)
    assert _halves(t) == _halves(t.clone())


def test_device_sums_see_a_change_in_a_trailing_partial_word():
    t = torch.arange(4001, dtype=torch.int64).to(torch.uint8)  # 4001 bytes: the last word is padded
    u = t.clone()
    u[-1] ^= 1
    assert _both_change(t, u)
    assert _halves(t) == _halves(t.clone())


def test_a_deleted_mapped_file_next_to_a_live_one_is_digested_from_its_bytes(tmp_path, monkeypatch):
    """The page proof stats every mapped file; one deleted since it was mapped must not break the others."""
    monkeypatch.setattr(digest, "_RACY_S", 0.0)  # written just now: let b's digest be remembered
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    n = 1 << 15  # 128 KB each: above the size whose pages are looked at
    np.arange(n, dtype=np.float32).tofile(a)
    np.arange(n, dtype=np.float32)[::-1].copy().tofile(b)
    ma = torch.from_file(str(a), shared=False, size=n, dtype=torch.float32)
    a.unlink()
    mb = torch.from_file(str(b), shared=False, size=n, dtype=torch.float32)
    ma.sum(), mb.sum()  # fault the pages in: a page not present is hashed, never trusted
    got = digest_tensors("m", [("a", ma), ("b", mb)])
    assert got == digest_tensors("m", [("a", ma.clone()), ("b", mb.clone())])
    assert got == digest_tensors("m", [("a", ma), ("b", mb)])  # and again, with b remembered


def test_file_digest_is_the_files_bytes_and_follows_an_edit(tmp_path, monkeypatch):
    import os

    import xxhash

    monkeypatch.setattr(digest, "_RACY_S", 0.0)
    path = tmp_path / "w.bin"
    data = np.random.default_rng(0).integers(0, 255, (1 << 22) + 123, dtype=np.uint8).tobytes()  # over one read
    path.write_bytes(data)
    assert digest.file_digest(path) == xxhash.xxh3_128_hexdigest(data)
    assert digest.file_digest(str(path)) == xxhash.xxh3_128_hexdigest(data)  # remembered: the same
    st = os.stat(path)
    with open(path, "r+b") as f:  # one byte, size kept, timestamps restored: only ctime moves
        f.seek(10)
        f.write(bytes([data[10] ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    edited = data[:10] + bytes([data[10] ^ 1]) + data[11:]
    assert digest.file_digest(path) == xxhash.xxh3_128_hexdigest(edited)


def test_a_memo_row_that_is_not_a_16_byte_digest_is_ignored(tmp_path, monkeypatch):
    import os
    import sqlite3

    import xxhash

    monkeypatch.setattr(digest, "_RACY_S", 0.0)
    monkeypatch.setenv("PROMPTSTORE_DIGESTS", str(tmp_path / "memo.sqlite3"))
    monkeypatch.setattr(digest, "_memo", digest._Memo())
    path = tmp_path / "w.bin"
    path.write_bytes(b"weights" * 1000)
    want = digest.file_digest(path)  # creates the memo and its row
    ident = digest._identity(os.stat(path))
    with sqlite3.connect(tmp_path / "memo.sqlite3") as db:
        db.execute("UPDATE digests SET digest = ? WHERE ino = ?", ("0123456789abcdef", ident[1]))  # text, 16 long
    monkeypatch.setattr(digest, "_memo", digest._Memo())  # a fresh process reads the memo
    assert digest.file_digest(path) == want == xxhash.xxh3_128_hexdigest(b"weights" * 1000)


def test_a_file_is_settled_only_once_both_its_timestamps_are_old_enough():
    import time

    now = time.time_ns()
    old, recent, future = now - 3 * 10**9, now - 10**9, now + 100 * 10**9
    assert digest._settled((0, 0, 0, old, old))
    assert not digest._settled((0, 0, 0, recent, recent))  # inside the racy window (2 s)
    assert not digest._settled((0, 0, 0, future, old))  # an mtime set in the future
    assert not digest._settled((0, 0, 0, old, recent))


def test_a_memo_whose_table_went_away_is_a_miss_not_an_error(tmp_path, monkeypatch):
    import sqlite3

    import xxhash

    monkeypatch.setattr(digest, "_RACY_S", 0.0)
    monkeypatch.setenv("PROMPTSTORE_DIGESTS", str(tmp_path / "memo.sqlite3"))
    monkeypatch.setattr(digest, "_memo", digest._Memo())
    one, two = tmp_path / "one.bin", tmp_path / "two.bin"
    one.write_bytes(b"1" * 5000)
    two.write_bytes(b"2" * 5000)
    digest.file_digest(one)  # opens the memo
    with sqlite3.connect(tmp_path / "memo.sqlite3") as db:
        db.execute("DROP TABLE digests")  # another process, or a user, removed it
    assert digest.file_digest(two) == xxhash.xxh3_128_hexdigest(b"2" * 5000)


def test_empty_tensors_digest_by_dtype_and_shape():
    e = digest_tensors("m", [("e", torch.zeros(0))])
    assert e == digest_tensors("m", [("e", torch.zeros(0))]) != digest_tensors("m", [("e", torch.zeros(0, 3))])
    assert digest_tensors("m", [("e", np.zeros(0, np.float32))]) != digest_tensors("m", [("e", np.zeros((0, 2), np.float32))])


def test_the_same_bytes_in_another_dtype_digest_apart():
    z = torch.zeros(4, dtype=torch.float32)
    assert digest_tensors("m", [("w", z)]) != digest_tensors("m", [("w", z.view(torch.int32))])


def test_a_name_with_a_lone_surrogate_is_digested():
    assert digest_tensors("m", [("w\ud800", torch.ones(2))]) != digest_tensors("m", [("w\ud801", torch.ones(2))])


def test_tensors_after_a_tie_are_digested_and_ties_name_their_partner():
    w, x, y = torch.ones(3), torch.zeros(3), torch.full((3,), 2.0)
    assert digest_tensors("m", [("a", w), ("b", w), ("c", x)]) != digest_tensors("m", [("a", w), ("b", w), ("c", y)])
    # c tied to a, or c tied to b: other models
    assert digest_tensors("m", [("a", w), ("b", x), ("c", w)]) != digest_tensors("m", [("a", w), ("b", x), ("c", x)])


def test_a_write_to_a_tensors_last_byte_alone_on_its_page_gets_a_fresh_digest(tmp_path, monkeypatch):
    """The tensor's last byte is the first byte of a page: that page is the tensor's too."""
    monkeypatch.setattr(digest, "_RACY_S", 0.0)
    path = tmp_path / "w.bin"
    page = 4096
    (np.arange(40 * page) % 251).astype(np.uint8).tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="c")
    w = mapped[: 20 * page + 1]  # 80 KB (pages are looked at), ending one byte into page 20
    before = digest_tensors("m", [("w", w)])
    assert digest_tensors("m", [("w", w)]) == before  # remembered now
    w[20 * page] ^= 1  # only page 20 is written
    assert digest_tensors("m", [("w", w)]) == digest_tensors("m", [("w", np.array(w))]) != before


@pytest.fixture(scope="module")
def lazy_device():
    """torch's lazy device (TorchScript backend): a device other than the CPU that runs on this machine's CPU.

    Its tensors take the device path (sums reduced where the tensor lives, one copy back for all),
    as a GPU's do, so that path is exercised on machines without one.
    """
    lazy = pytest.importorskip("torch._lazy.ts_backend")
    try:
        lazy.init()
    except RuntimeError as exc:  # registered once per process: a second init refuses
        if "multiple backend fallbacks" not in str(exc):
            raise
    return torch.device("lazy")


def test_tensors_on_a_device_are_digested_there_and_an_edit_changes_the_digest(lazy_device, monkeypatch):
    monkeypatch.setattr(digest, "_CHUNK_WORDS", 256)  # several chunks, small multiplier tables
    monkeypatch.setattr(digest, "_MULTIPLIERS", {})
    rng = np.random.default_rng(11)
    a, b = (torch.from_numpy(rng.standard_normal(1000).astype(np.float32)) for _ in range(2))
    host = torch.arange(6, dtype=torch.int64)

    def on_device(x, y):
        return [("a", x.to(lazy_device)), ("h", host), ("b", y.to(lazy_device))]

    # Multipliers are made per device (a model split over two GPUs): the CPU's, made first, are not the lazy one's.
    on_cpu = digest.device_word_digest(torch, a).tobytes()
    assert digest.device_word_digest(torch, a.to(lazy_device)).tobytes() == on_cpu  # the same sums on either device
    base = digest_tensors("m", on_device(a, b))
    assert base == digest_tensors("m", on_device(a.clone(), b.clone()))  # the same bytes, fresh device copies
    edited = b.clone()
    edited[999] += 1.0  # the last element of the second device tensor
    assert digest_tensors("m", on_device(a, edited)) != base
    assert digest_tensors("m", on_device(b, a)) != base  # each tensor's sums belong to its own name
    assert digest_tensors("m", [("a", a), ("h", host), ("b", b)]) != base  # on the host: another digest


def test_distinct_tensors_on_a_device_without_addresses_are_never_tied(lazy_device):
    """The lazy device reports address 0 for every tensor: two weights of one shape must not read as a tie."""
    a, b = torch.zeros(8), torch.ones(8)
    x, y = a.to(lazy_device), b.to(lazy_device)
    assert x.data_ptr() == y.data_ptr() == 0
    assert digest_tensors("m", [("a", x), ("b", y)]) != digest_tensors("m", [("a", x), ("b", x.clone())])
    assert digest_tensors("m", [("a", x), ("b", x)]) != digest_tensors("m", [("a", x), ("b", x.clone())])  # a tie


def test_a_large_view_that_is_not_contiguous_digests_as_its_values():
    """Large enough for the page proof to look at it (64 MB): resolved into a copy, digested as its values."""
    w = torch.randn(4096, 4096)
    assert digest_tensors("m", [("t", w.t())]) == digest_tensors("m", [("t", w.t().contiguous())])
    assert digest_tensors("m", [("t", w.t())]) != digest_tensors("m", [("t", w)])


def test_a_tensor_whose_storage_was_freed_under_it_is_refused_not_read():
    """A view past its storage's end (freed, as sharded training frees parameters) is a ValueError, never a read of
    freed memory (a crash or a digest of garbage): checked in a child process, which a crash would kill."""
    code = textwrap.dedent("""
        import torch
        from promptstore import digest_tensors
        base = torch.arange(1 << 16, dtype=torch.float32)
        views = [base[30000:40000], base[100:200].view(10, 10).t()]
        base.untyped_storage().resize_(0)
        short = torch.arange(100, dtype=torch.float32)
        views.append(short[10:20])
        short.untyped_storage().resize_(19 * 4)  # one element short of the view's end
        stepped = torch.arange(40, dtype=torch.float32)
        views.append(stepped[::2][:10])  # 10 elements over 19: past a storage of 15, though its bytes would fit
        stepped.untyped_storage().resize_(15 * 4)
        for view in views:
            try:
                digest_tensors("m", [("t", view)])
                print("read")
            except ValueError:
                print("refused")
        """)
    assert run_python(code).stdout.split() == ["refused"] * 4
