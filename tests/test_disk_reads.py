"""The disk tier's read paths, in this process: what a get serves, reads into, or drops (issue #21).

Each case answers from the disk tier alone (no memory tier in front), so that a planted bug
in ``get``, ``get(into=)``, ``peek``, ``contains``, the corrupt-entry path or the other-version
check is seen by this process (tests/test_versions.py plays the other release in a child).
"""

from __future__ import annotations

import shutil
import warnings

import numpy as np
import pytest

import promptstore._codec as codec
from promptstore import PromptStore
from promptstore._tiers.disk import SUFFIX, DiskTier
from promptstore.errors import PromptStoreWarning

from conftest import FakeClock, key_of, make_entry

RNG = np.random.default_rng(21)


def tier(path, **kw) -> DiskTier:
    return DiskTier(path / "store", budget=1 << 30, **kw)


def stored(t: DiskTier, i, tensors, **kw):
    e = make_entry(key_of(i), tensors, **kw)
    assert t.put(e)
    return e


def kv_layout_views(n_rows: int, width: int):
    """Destinations laid out as the LLM side reads KV into them: slices of a larger buffer (strided)."""
    full = np.full((3, 1, 2, n_rows + 10, width), -7.0, np.float32)
    return full, full[:, 0, :, 5 : 5 + n_rows, :]


@pytest.mark.parametrize(("n_rows", "width"), [(4, 16), (700, 8), (1500, 4), (3000, 64)])
def test_reading_into_strided_views_fills_exactly_them(tmp_path, n_rows, width):
    """Many rows (more than one preadv holds), runs over a megabyte, and the bytes around the views untouched."""
    t = tier(tmp_path)
    k = RNG.standard_normal((3, 2, n_rows, width)).astype(np.float32)
    v = RNG.standard_normal((3, 2, n_rows, width)).astype(np.float32)
    big = RNG.standard_normal(300_000).astype(np.float32)  # read fresh, in runs of over a megabyte
    stored(t, "kv", {"k": k, "v": v, "tokens": np.arange(n_rows, dtype=np.int32), "big": big})
    full_k, into_k = kv_layout_views(n_rows, width)
    full_v, into_v = kv_layout_views(n_rows, width)
    got = t.get_into(key_of("kv"), "test", "", {"k": into_k, "v": into_v})
    assert got is not None and got.tensors["k"] is into_k and got.tensors["v"] is into_v
    assert np.array_equal(into_k, k) and np.array_equal(into_v, v)
    outside = np.ones(full_k.shape, bool)
    outside[:, 0, :, 5 : 5 + n_rows, :] = False
    assert (full_k[outside] == -7.0).all() and (full_v[outside] == -7.0).all()
    assert np.array_equal(got.tensors["tokens"], np.arange(n_rows)) and not got.tensors["tokens"].flags.writeable
    assert np.array_equal(got.tensors["big"], big) and not got.tensors["big"].flags.writeable


@pytest.mark.parametrize("make", [
    lambda a: a,  # contiguous
    lambda a: np.zeros((a.shape[0], 1, a.shape[1]), a.dtype)[:, 0, :],  # a size-1 dimension between
    lambda a: np.zeros((a.shape[1], a.shape[0]), a.dtype).T,  # transposed: no two elements adjacent
    lambda a: np.zeros((a.shape[0] * 2, a.shape[1] * 3), a.dtype)[::2, ::3],  # strided both ways
    lambda a: np.zeros((4, a.shape[0], a.shape[1] + 1), a.dtype)[1, :, 1:],  # rows that do not merge
    # The left columns of a square buffer: the row stride is the row count times the item size.
    lambda a: np.zeros((a.shape[0], a.shape[0]), a.dtype)[:, : a.shape[1]],
], ids=["contiguous", "unit-dim", "transposed", "strided", "offset-rows", "square-buffer-columns"])
def test_reading_into_any_layout_equals_a_plain_read(tmp_path, make):
    t = tier(tmp_path)
    a = RNG.standard_normal((37, 9)).astype(np.float32)
    stored(t, "a", {"a": a, "b": np.arange(5, dtype=np.int64)})
    dst = make(np.zeros_like(a))
    assert dst.shape == a.shape
    got = t.get_into(key_of("a"), "test", "", {"a": dst})
    assert got is not None and got.tensors["a"] is dst and np.array_equal(dst, a)
    assert np.array_equal(t.get(key_of("a")).tensors["a"], a)


@pytest.mark.parametrize(("shape", "make"), [
    ((1, 9), lambda: np.zeros((1, 27), np.float32)[:, ::3]),  # one row, its elements apart
    ((3, 5, 5), lambda: np.zeros((3, 9, 5), np.float32)[:, ::2, :]),  # rows whose outer dims do not merge
    ((2, 1, 6), lambda: np.zeros((2, 3, 6), np.float32)[:, 1:2, :]),  # a size-1 dim that is not contiguous
], ids=["one-strided-row", "unmergeable-rows", "unit-dim-gap"])
def test_reading_into_rows_that_do_not_merge(tmp_path, shape, make):
    t = tier(tmp_path)
    a = RNG.standard_normal(shape).astype(np.float32)
    stored(t, "a", {"a": a})
    dst = make()
    assert dst.shape == shape
    assert t.get_into(key_of("a"), "test", "", {"a": dst}) is not None and np.array_equal(dst, a)


def test_reading_into_0d_and_empty_arrays(tmp_path):
    t = tier(tmp_path)
    stored(t, "s", {"s": np.array(3.5, np.float64), "e": np.zeros((0, 4), np.float32), "x": np.ones(3, np.int8)})
    s, e = np.zeros((), np.float64), np.zeros((0, 4), np.float32)
    got = t.get_into(key_of("s"), "test", "", {"s": s, "e": e})
    assert float(s) == 3.5 and got.tensors["e"].shape == (0, 4) and got.tensors["x"].tolist() == [1, 1, 1]


def test_an_entry_with_a_header_over_64_kb_is_read_into_and_read(tmp_path):
    """The header is read in two steps when it is longer than the first read."""
    t = tier(tmp_path)
    meta = {f"m{i}": "x" * 1000 for i in range(100)}  # ~100 KB of header
    a = RNG.standard_normal((8, 8)).astype(np.float32)
    stored(t, "big", {"a": a}, meta=meta)
    dst = np.zeros_like(a)
    got = t.get_into(key_of("big"), "test", "", {"a": dst})
    assert got is not None and got.meta == meta and np.array_equal(dst, a)
    assert t.get(key_of("big")).meta == meta


def test_an_entry_that_is_all_header_is_read_into(tmp_path):
    """Only empty tensors and over 64 KB of metadata: the header ends where the file does."""
    t = tier(tmp_path)
    meta = {f"m{i}": "y" * 1000 for i in range(80)}
    stored(t, "h", {"e": np.zeros((0, 3), np.float32)}, meta=meta)
    got = t.get_into(key_of("h"), "test", "", {"e": np.zeros((0, 3), np.float32)})
    assert got is not None and got.meta == meta


def test_a_file_holding_another_keys_entry_is_never_served(tmp_path):
    """An entry file swapped for another's (a copy, a bad restore): corrupt, dropped, and a miss for both reads."""
    t = tier(tmp_path)
    stored(t, "one", {"a": np.ones(4, np.float32)})
    stored(t, "two", {"a": np.zeros(4, np.float32)})
    files = {p.name.split(".")[0]: p for p in (tmp_path / "store" / "entries").rglob("*" + SUFFIX)}
    one, two = files[key_of("one").hex()], files[key_of("two").hex()]
    for read in ("into", "plain"):
        shutil.copyfile(one, two)
        with pytest.warns(PromptStoreWarning, match="corrupt"):
            if read == "into":
                got = t.get_into(key_of("two"), "test", "", {"a": np.full(4, 5.0, np.float32)})
            else:
                got = t.get(key_of("two"))
        assert got is None and t.contains(key_of("two")) is None and not two.exists()
        assert t.get(key_of("one")) is not None  # the other entry is untouched
        stored(t, "two", {"a": np.zeros(4, np.float32)})
        two = next((tmp_path / "store" / "entries").rglob(key_of("two").hex() + "*"))


def test_into_another_kind_or_namespace_writes_nothing(tmp_path):
    t = tier(tmp_path)
    stored(t, "a", {"a": np.ones(4, np.float32)}, kind="x", namespace="ns")
    dst = np.zeros(4, np.float32)
    assert t.get_into(key_of("a"), "y", "ns", {"a": dst}) is None
    assert t.get_into(key_of("a"), "x", "other", {"a": dst}) is None
    assert (dst == 0).all()
    assert t.get_into(key_of("a"), "x", "ns", {"a": dst}) is not None and (dst == 1).all()


def test_hits_and_misses_of_reads_into_are_counted_per_kind(tmp_path):
    t = tier(tmp_path)
    stored(t, "a", {"a": np.ones(4, np.float32)}, kind="x")
    dst = np.zeros(4, np.float32)
    first = t.get_into(key_of("a"), "x", "", {"a": dst})
    second = t.get_into(key_of("a"), "x", "", {"a": dst})
    assert second.hits == first.hits + 1
    assert t.get_into(key_of("nope"), "x", "", {"a": dst}) is None
    assert t.get(key_of("nope"), kind="x") is None
    kinds = t.usage()["lifetime"]["kinds"]
    assert kinds["x"]["misses"] == 2
    t.close()
    again = tier(tmp_path)
    assert again.get(key_of("a")).hits == second.hits + 1  # the counted hits were written for that key


def test_peek_reads_without_counting_and_misses_cleanly(tmp_path):
    t = tier(tmp_path)
    e = stored(t, "a", {"a": np.arange(3, dtype=np.float32)}, kind="x")
    got = t.peek(key_of("a"))
    assert got is not None and got.key == e.key and got.tensors["a"].tolist() == [0, 1, 2]
    assert t.peek(key_of("missing")) is None
    hits = t.get(key_of("a")).hits
    t.peek(key_of("a"))
    assert t.get(key_of("a")).hits == hits + 1  # the peek in between was no hit


def test_an_entry_is_gone_the_moment_it_expires(tmp_path):
    clock = FakeClock()
    t = tier(tmp_path, clock=clock)
    stored(t, "a", {"a": np.ones(2, np.float32)}, ttl_s=10.0, namespace="ns")
    clock.advance(9.999)
    assert t.contains(key_of("a")) == "ns" and t.get(key_of("a")) is not None
    t.flush()
    clock.now = t.get(key_of("a")).last_hit + 10.0  # exactly when its TTL (sliding) runs out
    assert t.contains(key_of("a")) is None and t.get(key_of("a")) is None
    usage = t.usage()
    assert usage["entries"] == 0 and usage["lifetime"]["expirations"] == 1  # removed on that read, and counted


def test_a_dropped_corrupt_entry_is_gone_from_index_and_folder(tmp_path):
    t = tier(tmp_path)
    stored(t, "a", {"a": np.ones(1000, np.float32)})
    path = next((tmp_path / "store" / "entries").rglob("*" + SUFFIX))
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.warns(PromptStoreWarning):
        assert t.get(key_of("a")) is None
    assert not path.exists() and t.contains(key_of("a")) is None and t.usage()["entries"] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert t.get(key_of("a")) is None  # now a plain miss


def test_gc_keeps_an_orphan_file_of_another_release_and_removes_a_broken_one(tmp_path, monkeypatch):
    mine, theirs = tier(tmp_path / "mine"), tier(tmp_path / "theirs")
    monkeypatch.setattr(codec, "ENTRY_VERSION", codec.ENTRY_VERSION + 1)
    stored(theirs, "t", {"a": np.ones(4, np.float32)})
    monkeypatch.undo()
    src = next((tmp_path / "theirs" / "store" / "entries").rglob("*" + SUFFIX))
    hexkey = key_of("t").hex()
    shard = tmp_path / "mine" / "store" / "entries" / hexkey[:2]
    shard.mkdir(exist_ok=True)
    other = shard / f"{hexkey}.999999-aaaa{SUFFIX}"  # a writer that is gone
    shutil.copyfile(src, other)
    broken = shard / f"{key_of('b').hex()}.999999-bbbb{SUFFIX}"
    broken.write_bytes(b"not an entry at all" * 10)
    stored(theirs, "c", {"a": np.ones(4, np.float32)})  # and an orphan of this release (written above by theirs)
    ours = next(p for p in (tmp_path / "theirs" / "store" / "entries").rglob("*" + SUFFIX) if key_of("c").hex() in p.name)
    (tmp_path / "mine" / "store" / "entries" / key_of("c").hex()[:2]).mkdir(exist_ok=True)
    orphan = tmp_path / "mine" / "store" / "entries" / key_of("c").hex()[:2] / f"{key_of('c').hex()}.999999-cccc{SUFFIX}"
    shutil.copyfile(ours, orphan)
    mine.gc()
    assert other.exists() and not broken.exists()
    assert not orphan.exists() or mine.contains(key_of("c")) is not None  # removed or adopted, never left behind


def test_misses_without_a_kind_are_counted_together(tmp_path):
    t = tier(tmp_path)
    assert t.get(key_of("x")) is None and t.get(key_of("y")) is None
    stored(t, "z", {"a": np.ones(2, np.float32)})  # a write flushes the counts
    assert t.usage()["lifetime"]["kinds"]["unknown"]["misses"] == 2


@pytest.mark.parametrize("step", [7, 1], ids=["7-bytes", "1-byte"])
def test_short_reads_resume_where_they_stopped(tmp_path, monkeypatch, step):
    """The kernel may return fewer bytes than asked (signals, network file systems): reads go on from there.

    Only a read of no bytes at all is the end of the file: one byte is a short read like any other.
    """
    import os

    t = tier(tmp_path)
    k = RNG.standard_normal((3, 2, 50, 8)).astype(np.float32)
    stored(t, "kv", {"k": k, "x": np.arange(1000, dtype=np.int64)})
    real = os.preadv

    def short(fd, buffers, offset):  # at most `step` bytes per call, wherever in a buffer that ends
        left, out = step, []
        for b in buffers:
            m = memoryview(b).cast("B")
            out.append(m[:left])
            left -= len(out[-1])
            if not left:
                break
        return real(fd, out, offset)

    monkeypatch.setattr(os, "preadv", short)
    full, into = kv_layout_views(50, 8)
    got = t.get_into(key_of("kv"), "test", "", {"k": into})
    assert got is not None and np.array_equal(into, k) and got.tensors["x"].tolist() == list(range(1000))
    assert t.get(key_of("kv")).tensors["x"].tolist() == list(range(1000))


def test_more_views_than_one_preadv_holds_are_each_filled_in_order(tmp_path):
    """The read helper batches views by the kernel's IOV_MAX: every batch, the last partial one too, is read."""
    from promptstore._tiers.disk import _IOV_MAX, _pread_all

    data = RNG.integers(0, 256, 20 * _IOV_MAX, dtype=np.uint8).tobytes()
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    views = [memoryview(bytearray(5)) for _ in range(2 * _IOV_MAX + 100)]  # three batches
    with open(path, "rb", buffering=0) as f:
        assert _pread_all(f.fileno(), views, 11) == 5 * len(views)
    assert b"".join(bytes(v) for v in views) == data[11 : 11 + 5 * len(views)]


def test_a_folder_holding_only_a_crashed_version_files_temp_is_a_new_store(tmp_path):
    from promptstore._tiers.disk import VERSION_FILE

    root = tmp_path / "store"
    root.mkdir()
    (root / f".{VERSION_FILE}.12345-abcd").write_text("half written")  # a first start that died mid-way
    t = DiskTier(root, budget=1 << 20)
    stored(t, "a", {"a": np.ones(2, np.float32)})
    assert t.get(key_of("a")) is not None


def test_a_store_reading_through_the_disk_tier_serves_the_bytes_written(tmp_path):
    """End to end, as a user calls it: a fresh store object (empty memory tier) on the same folder."""
    a = RNG.standard_normal((64, 33)).astype(np.float32)
    with PromptStore(tmp_path / "s") as s:
        s.put(s.key("t", "a"), {"a": a, "i": np.arange(7)}, kind="t")
    with PromptStore(tmp_path / "s", memory_bytes=0) as s:
        dst = np.zeros((33, 64), np.float32).T
        got = s.get(s.key("t", "a"), kind="t", into={"a": dst})
        assert got is not None and np.array_equal(dst, a) and got.tensors["i"].tolist() == list(range(7))


def _mapped_files(tmp_path) -> int:
    with open("/proc/self/maps") as maps:
        return sum(str(tmp_path) in line and SUFFIX in line for line in maps)  # not the index's own maps


def test_a_big_entry_is_read_by_mapping_its_file_and_stays_right_after_it_is_replaced(tmp_path):
    """Entries of MAP_MIN_BYTES and more are served from a mapping of their file: the bytes written,
    read-only, still right after the entry is replaced or evicted (files are renamed, never rewritten),
    with no file descriptor held, and unmapped once the last array viewing them is gone."""
    import gc
    import os

    from promptstore._tiers.disk import MAP_MIN_BYTES

    t = tier(tmp_path)
    big = RNG.standard_normal(MAP_MIN_BYTES // 4 + 10).astype(np.float32)
    stored(t, "big", {"big": big, "small": np.arange(3)})
    fds = len(os.listdir("/proc/self/fd"))
    got = [t.get(key_of("big"), "test") for _ in range(20)]
    assert _mapped_files(tmp_path) == 20  # mapped, not read: one mapping per get
    assert len(os.listdir("/proc/self/fd")) == fds
    first = got[0].tensors["big"]
    assert np.array_equal(first, big) and not first.flags.writeable
    stored(t, "big", {"big": big * 2, "small": np.arange(3)})  # replaced
    assert np.array_equal(first, big)
    assert np.array_equal(t.get(key_of("big"), "test").tensors["big"], big * 2)
    assert t.delete(key_of("big"))
    assert np.array_equal(first, big)
    first.flags.writeable = True  # a private mapping: writing it never reaches the file
    first[0] = 123.0
    del got, first
    gc.collect()
    assert _mapped_files(tmp_path) == 0


def test_a_flipped_byte_in_a_mapped_entry_is_a_warned_miss(tmp_path):
    """The checksum is verified over the mapped bytes as over read ones."""
    from promptstore._tiers.disk import MAP_MIN_BYTES

    t = tier(tmp_path)
    stored(t, "big", {"big": RNG.standard_normal(MAP_MIN_BYTES // 4 + 10).astype(np.float32)})
    (path,) = (t.entries_dir).rglob("*" + SUFFIX)
    raw = bytearray(path.read_bytes())
    raw[-1000] ^= 0x40
    path.write_bytes(bytes(raw))
    with pytest.warns(PromptStoreWarning, match="corrupt"):
        assert t.get(key_of("big"), "test") is None
    assert not path.exists()
