"""Weight digests: any change to any element changes them, on the host and on a device (issue #10)."""

from __future__ import annotations

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
        digest._hash_bytes = lambda data: (hashed.append(data.size), real(data))[1]
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


def test_pages_not_read_in_are_hashed_not_trusted(weights_file, monkeypatch):
    """A page not present proves nothing (a /proc that reported nothing would look the same): its bytes are hashed."""
    t = _mapped(weights_file)
    known = digest_tensors("w", [("w", t)])  # remembered
    fresh = _mapped(weights_file, touch=False)
    hashed = []
    real = digest._hash_bytes
    monkeypatch.setattr(digest, "_hash_bytes", lambda data: (hashed.append(data.size), real(data))[1])
    assert digest_tensors("w", [("w", fresh)]) == known
    assert N * 4 in hashed


@pytest.mark.parametrize("span", [(0, N), (1000, N - 333)], ids=["whole-mapping", "unaligned-slice"])
@pytest.mark.parametrize("how", ["torch.from_file", "np.memmap"])
def test_a_mapped_weight_written_only_in_its_last_page_gets_a_fresh_digest(weights_file, how, span):
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
