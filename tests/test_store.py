"""PromptStore: tiers together, stats, namespaces, bad input, and faults that become misses."""

from __future__ import annotations

import json
import os
import sqlite3
import warnings
from pathlib import Path

import numpy as np
import pytest

from promptstore import PromptStore, format_size, parse_size
from promptstore.errors import (
    FormatVersionError,
    InvalidEntryError,
    InvalidKeyError,
    InvalidSizeError,
    PromptStoreWarning,
    StorePathError,
    UnsupportedDtypeError,
)

from conftest import assert_same_tensors, run_forked, run_python


@pytest.fixture
def store(tmp_path):
    with PromptStore(tmp_path / "store", memory_bytes="16MiB", disk_bytes="64MiB") as s:
        yield s


def arr(i: int, n: int = 16) -> np.ndarray:
    return np.random.default_rng(i).standard_normal(n).astype(np.float32)


def entry_file(store: PromptStore, key: bytes) -> Path:
    files = list((store.path / "entries" / key.hex()[:2]).glob(f"{key.hex()}.*.safetensors"))
    assert len(files) == 1
    return files[0]


# -- sizes and paths -----------------------------------------------------------------------
@pytest.mark.parametrize(("text", "n"), [(0, 0), (512, 512), ("512", 512), ("64KiB", 65536), ("2GiB", 2 * 1024**3),
                                         ("1.5 GB", 1_500_000_000), ("3M", 3 * 1024**2), ("1kb", 1000), ("10B", 10)])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("bad", [-1, "-5MiB", "lots", "5 parsecs", "", None, True, float("inf"), 1.5, "1.5", "0.1KiB"])
def test_parse_size_rejects(bad):
    with pytest.raises(InvalidSizeError):
        parse_size(bad)


def test_a_fractional_budget_is_refused_not_rounded(tmp_path):
    """Issue #13: PromptStore(memory_bytes=1.5) was accepted as a 1-byte tier."""
    with pytest.raises(InvalidSizeError, match="whole number of bytes"):
        PromptStore(tmp_path / "s", memory_bytes=1.5)
    assert parse_size(2048.0) == 2048 and parse_size("0.5KiB") == 512


def test_format_size():
    assert format_size(512) == "512 B"
    assert format_size(1536) == "1.5 KiB"
    assert format_size(3 * 1024**3) == "3.0 GiB"


def test_default_path_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMPTSTORE_DIR", str(tmp_path / "from-env"))
    with PromptStore() as s:
        assert s.path == tmp_path / "from-env"
        assert (tmp_path / "from-env" / "promptstore.json").exists()
        assert (tmp_path / "from-env" / "CACHEDIR.TAG").read_text().startswith("Signature: 8a477f597d28d172789f06886806bc55")


def test_default_path_is_user_cache_dir(tmp_path):
    out = run_python("from promptstore._store import default_path; print(default_path())",
                     env={"PROMPTSTORE_DIR": "", "XDG_CACHE_HOME": str(tmp_path / "xdg")})
    assert out.stdout.strip() == str(tmp_path / "xdg" / "promptstore")


# -- tiers together ------------------------------------------------------------------------
def test_write_through_and_promotion(store):
    mem, disk = store.tiers
    k = store.key("t", "a")
    assert store.put(k, {"x": arr(1)}, kind="t", cost_s=0.25)
    assert mem.contains(k) == "" and disk.contains(k) == ""
    mem.clear()
    e = store.get(k)
    assert_same_tensors(e.tensors, {"x": arr(1)})
    assert mem.contains(k) == ""  # promoted
    s = store.stats()
    assert s["kinds"]["t"]["tiers"]["disk"]["hits"] == 1
    assert s["kinds"]["t"]["tiers"]["memory"]["hits"] == 0
    store.get(k)
    s = store.stats()
    assert s["kinds"]["t"]["tiers"]["memory"]["hits"] == 1
    assert s["hits"] == 2 and s["seconds_saved"] == pytest.approx(0.5)
    assert s["hit_bytes"] == 2 * e.size


def test_stats_report_misses_per_kind_and_tier(store):
    store.get(store.key("vision.text", "cat"), kind="vision.text")
    store.get(store.key("llm.kv", "x"), kind="llm.kv")
    store.get(store.key("llm.kv", "y"), kind="llm.kv")
    s = store.stats()
    assert s["kinds"]["llm.kv"]["misses"] == 2
    assert s["kinds"]["llm.kv"]["tiers"] == {"disk": {"hits": 0, "misses": 2}, "memory": {"hits": 0, "misses": 2}}
    assert s["misses"] == 3
    assert set(s["tiers"]) == {"memory", "disk"}
    assert s["tiers"]["disk"]["budget"] == 64 * 1024**2
    store.close()
    with PromptStore(store.path, memory_bytes=0) as again:
        assert "lifetime" not in again.stats()["tiers"]["disk"]  # every tenant's counts: the administrator's view
        life = again.stats(all_namespaces=True)["tiers"]["disk"]["lifetime"]["kinds"]
        assert life["llm.kv"]["misses"] == 2  # persisted in the folder's index


def test_stats_count_bytes_and_evictions(tmp_path):
    with PromptStore(tmp_path / "s", memory_bytes=20_000, disk_bytes=40_000) as s:
        for i in range(40):
            s.put(s.key("t", str(i)), {"x": arr(i, 400)}, kind="t")
        st = s.stats()
        assert st["tiers"]["memory"]["bytes"] <= 20_000 and st["tiers"]["disk"]["bytes"] <= 40_000
        assert st["tiers"]["memory"]["evictions"] > 0 and st["tiers"]["disk"]["evictions"] > 0
        assert st["evictions"] == st["tiers"]["memory"]["evictions"] + st["tiers"]["disk"]["evictions"]


def test_kind_mismatch_is_a_miss(store):
    k = store.key("t", "a")
    store.put(k, {"x": arr(1)}, kind="vision.text")
    assert store.get(k, kind="llm.kv") is None
    assert store.get(k, kind="vision.text") is not None


def test_namespaces_never_share(tmp_path):
    path = tmp_path / "shared"
    with PromptStore(path, namespace="alice") as a, PromptStore(path, namespace="bob") as b:
        ka, kb = a.key("t", "same input"), b.key("t", "same input")
        assert ka != kb
        a.put(ka, {"x": arr(1)}, kind="t")
        assert b.get(kb) is None
        # Even with a raw key copied across, the entry's namespace does not match.
        assert b.get(ka) is None and ka not in b
        assert a.get(ka) is not None and ka in a


def test_budget_recorded_in_folder(tmp_path):
    with PromptStore(tmp_path / "s", disk_bytes="3MiB"):
        pass
    with PromptStore(tmp_path / "s") as s:
        assert s.tiers[-1].budget == 3 * 1024**2
    with PromptStore(tmp_path / "s", disk_bytes="5MiB") as s:
        assert s.tiers[-1].budget == 5 * 1024**2


def test_memory_only_and_disk_only(tmp_path):
    with PromptStore(memory_bytes="1MiB", disk_bytes=0) as m:
        assert [t.name for t in m.tiers] == ["memory"] and m.path is None
        m.put(m.key("t"), {"x": arr(0)}, kind="t")
        assert m.get(m.key("t")) is not None
    with PromptStore(tmp_path / "d", memory_bytes=0) as d:
        assert [t.name for t in d.tiers] == ["disk"]


def test_delete_and_contains(store):
    k = store.key("t", "a")
    store.put(k, {"x": arr(1)}, kind="t")
    assert k in store and k.hex() in store
    assert store.delete(k)
    assert k not in store and store.get(k) is None
    assert not store.delete(k)


def test_ls_lists_every_tier(store):
    for i in range(3):
        store.put(store.key("t", str(i)), {"x": arr(i)}, kind="t" if i else "other")
    infos = store.ls()
    assert len(infos) == 3 and all(i.tier == "memory+disk" for i in infos)
    assert [i.kind for i in store.ls(kind="other")] == ["other"]


# -- bad input: typed errors, nothing stored -------------------------------------------------
@pytest.mark.parametrize(
    ("key", "tensors", "kw", "error"),
    [
        (b"short", {"x": np.zeros(2)}, {}, InvalidKeyError),
        (12345, {"x": np.zeros(2)}, {}, InvalidKeyError),
        ("g" * 64, {"x": np.zeros(2)}, {}, InvalidKeyError),
        (None, {"x": np.zeros(2)}, {"parent": b"x"}, InvalidKeyError),
        (None, {"x": np.array(["a"])}, {}, UnsupportedDtypeError),
        (None, {"x": np.array([{}], dtype=object)}, {}, UnsupportedDtypeError),
        (None, {"x": np.zeros(2, np.complex64)}, {}, UnsupportedDtypeError),
        (None, {"x": "not an array"}, {}, InvalidEntryError),
        (None, {"x": np.zeros(2)}, {"cost_s": -1}, InvalidEntryError),
        (None, {"x": np.zeros(2)}, {"meta": {"k": 3}}, InvalidEntryError),
    ],
)
def test_bad_put_is_typed_and_stores_nothing(store, key, tensors, kw, error):
    good = store.key("t", "kept")
    store.put(good, {"x": arr(0)}, kind="t")
    before = store.stats()["tiers"]
    with pytest.raises(error):
        store.put(key if key is not None else store.key("t", "bad"), tensors, kind="t", **kw)
    assert store.stats()["tiers"] == before
    assert_same_tensors(store.get(good).tensors, {"x": arr(0)})


def test_path_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("hello")
    with pytest.raises(StorePathError):
        PromptStore(f)
    assert f.read_text() == "hello"


def test_foreign_folder_is_refused(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("precious")
    with pytest.raises(StorePathError, match="not a promptstore folder"):
        PromptStore(tmp_path / "mine")
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["thesis.tex"]


def test_newer_folder_layout_is_refused(tmp_path):
    with PromptStore(tmp_path / "s"):
        pass
    (tmp_path / "s" / "promptstore.json").write_text(json.dumps({"format": "promptstore", "layout": 99}))
    with pytest.raises(FormatVersionError, match="newer promptstore"):
        PromptStore(tmp_path / "s")


def test_newer_index_schema_is_refused(tmp_path):
    with PromptStore(tmp_path / "s"):
        pass
    db = sqlite3.connect(tmp_path / "s" / "index.sqlite")
    db.execute("PRAGMA user_version = 42")
    db.commit()
    db.close()
    with pytest.raises(FormatVersionError):
        PromptStore(tmp_path / "s")


# -- corrupt entries and failing writes are misses -------------------------------------------
@pytest.mark.parametrize("into", [False, True], ids=["get", "get_into"])
@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "garbage"])
def test_corrupt_entry_file_is_a_dropped_miss(tmp_path, damage, into):
    with PromptStore(tmp_path / "s", memory_bytes=0) as s:
        bad, good = s.key("t", "bad"), s.key("t", "good")
        s.put(bad, {"x": arr(1, 1000)}, kind="t")
        s.put(good, {"x": arr(2)}, kind="t")
        f = entry_file(s, bad)
        data = bytearray(f.read_bytes())
        if damage == "truncate":
            data = data[: len(data) // 2]
        elif damage == "flip":
            data[-100] ^= 0x01
        elif damage == "empty":
            data = bytearray()
        else:
            data = bytearray(os.urandom(len(data)))
        f.write_bytes(data)
        with pytest.warns(PromptStoreWarning, match="corrupt"):
            assert s.get(bad, into={"x": np.zeros(1000, np.float32)} if into else None) is None
        assert not f.exists() and bad not in s  # dropped
        assert_same_tensors(s.get(good).tensors, {"x": arr(2)})
        assert s.verify()["ok"]
        assert s.put(bad, {"x": arr(1, 1000)}, kind="t")  # and it can be stored again
        assert_same_tensors(s.get(bad).tensors, {"x": arr(1, 1000)})


def test_entry_file_deleted_behind_the_store(tmp_path):
    with PromptStore(tmp_path / "s", memory_bytes=0) as s:
        k = s.key("t", "a")
        s.put(k, {"x": arr(1)}, kind="t")
        entry_file(s, k).unlink()
        assert s.get(k) is None
        report = s.verify()
        assert not report["ok"] and "missing" in report["problems"][0]
        assert s.verify()["ok"]  # the first verify dropped the dangling row


def test_failing_write_is_a_warning_and_the_store_keeps_working(tmp_path):
    with PromptStore(tmp_path / "s") as s:
        k = s.key("t", "a")
        # Block this key's shard folder with a plain file: the disk write fails (ENOTDIR).
        (s.path / "entries" / k.hex()[:2]).write_text("in the way")
        with pytest.warns(PromptStoreWarning, match="disk tier failed during put"):
            assert s.put(k, {"x": arr(1)}, kind="t")  # kept by the memory tier
        assert_same_tensors(s.get(k).tensors, {"x": arr(1)})
        assert s.tiers[1].contains(k) is None
        other = next(s.key("t", str(i)) for i in range(1000) if s.key("t", str(i)).hex()[:2] != k.hex()[:2])
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the disk tier works for other keys, silently
            assert s.put(other, {"x": arr(2)}, kind="t")
        assert s.tiers[1].contains(other) == ""


def test_disk_full_is_a_warning_not_a_failure(tmp_path):
    """RLIMIT_FSIZE makes every write past 64 KiB fail with EFBIG, like a full disk."""
    out = run_python(
        f"""
        import resource, signal, warnings, numpy as np
        from promptstore import PromptStore
        from promptstore.errors import PromptStoreWarning
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        s = PromptStore({str(tmp_path / 's')!r})
        small = s.key("t", "small"); big = s.key("t", "big")
        s.put(small, {{"x": np.ones(16, np.float32)}}, kind="t")
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            ok = s.put(big, {{"x": np.ones(200_000, np.float32)}}, kind="t")
        print(ok, [str(x.message)[:40] for x in w if issubclass(x.category, PromptStoreWarning)])
        print(s.get(big) is not None, s.tiers[1].contains(big) is None, s.get(small) is not None)
        print(s.verify()["ok"])
        """
    )
    lines = out.stdout.splitlines()
    assert lines[0].startswith("True ['disk tier failed during put")
    assert lines[1:] == ["True True True", "True"]


def test_unusable_folder_disables_the_disk_tier_with_a_warning(tmp_path):
    # /proc is never writable, even for root.
    with pytest.warns(PromptStoreWarning, match="disk tier disabled"):
        s = PromptStore("/proc/promptstore-test")
    assert [t.name for t in s.tiers] == ["memory"]
    s.put(s.key("t"), {"x": arr(0)}, kind="t")
    assert s.get(s.key("t")) is not None


def test_corrupt_index_is_rebuilt_from_entry_files(tmp_path):
    with PromptStore(tmp_path / "s", memory_bytes=0) as s:
        keys = [s.key("t", str(i)) for i in range(5)]
        for i, k in enumerate(keys):
            s.put(k, {"x": arr(i)}, kind="t", cost_s=1.0, parent=keys[i - 1] if i else None)
    index = tmp_path / "s" / "index.sqlite"
    for suffix in ("-wal", "-shm"):
        Path(f"{index}{suffix}").unlink(missing_ok=True)
    index.write_bytes(b"this is not a database" * 100)
    with pytest.warns(PromptStoreWarning, match="rebuilding"):
        s = PromptStore(tmp_path / "s", memory_bytes=0)
    with s:
        for i, k in enumerate(keys):
            assert_same_tensors(s.get(k).tensors, {"x": arr(i)})
        assert s.stats()["tiers"]["disk"]["entries"] == 5
        assert s.verify()["ok"]
        # The chain came back too: deleting the root takes the rest.
        s.delete(keys[0])
        assert s.stats()["tiers"]["disk"]["entries"] == 0


def test_gc_removes_leftovers_of_dead_writers(tmp_path):
    with PromptStore(tmp_path / "s") as s:
        k = s.key("t", "a")
        s.put(k, {"x": arr(1)}, kind="t")
        shard = s.path / "entries" / "ab"
        shard.mkdir(exist_ok=True)
        dead_pid = 2**22 + 12345  # above pid_max: never a live process
        (shard / f".{'ab' * 32}.{dead_pid}-0000.safetensors.partial").write_bytes(b"half")
        (shard / f"{'ab' * 32}.{dead_pid}-0001.safetensors").write_bytes(b"renamed, never indexed")
        live_tmp = shard / f".{'ab' * 32}.{os.getpid()}-0002.safetensors.partial"
        live_tmp.write_bytes(b"a write in flight")
        report = s.gc()["tiers"][1]
        assert (report["temp_files"], report["orphan_files"]) == (1, 1)
        assert live_tmp.exists()  # its writer (us) is alive and the file is fresh
        assert s.get(k) is not None and s.verify()["ok"]


def test_disk_gets_the_ancestors_it_lacks(tmp_path):
    """A chain whose root was evicted from disk but is still in memory is written back whole."""
    with PromptStore(tmp_path / "s", memory_bytes="1MiB", disk_bytes="1MiB") as s:
        root, child = s.key("llm.kv", "root"), s.key("llm.kv", "child")
        s.put(root, {"x": arr(1)}, kind="llm.kv")
        s.tiers[1].delete(root)  # as if evicted from disk only
        s.put(child, {"x": arr(2)}, kind="llm.kv", parent=root)
        disk = {i.key: i.parent for i in s.tiers[1].infos()}
        assert disk == {root: None, child: root}


def test_a_tier_that_refuses_a_new_value_drops_the_old_one(tmp_path):
    with PromptStore(tmp_path / "s", memory_bytes=4096, disk_bytes="1MiB") as s:
        k = s.key("t", "a")
        s.put(k, {"x": arr(1, 10)}, kind="t")
        with pytest.warns(PromptStoreWarning, match="exceeds the tier budget"):
            s.put(k, {"x": arr(2, 5000)}, kind="t")  # too big for memory, fine for disk
        assert_same_tensors(s.get(k).tensors, {"x": arr(2, 5000)})


@pytest.mark.parametrize("wrong", [(4, 3), (2, 3), (5, 4), (12,)], ids=["same-size", "smaller", "bigger", "flat"])
@pytest.mark.parametrize("fresh", [False, True], ids=["disk-only", "fresh-store"])
def test_get_into_an_array_of_another_shape_from_disk_leaves_it_and_the_entry_alone(tmp_path, wrong, fresh):
    """The disk tier reads a tensor into a caller's array only if dtype and shape match.

    An array of the right dtype but another shape (even one of the same size) must never be
    filled with the tensor's bytes, nor read past or short of the tensor (which fails the
    checksum and would drop a valid entry as corrupt): the tensor comes back in a fresh array.
    """
    x = np.arange(12, dtype=np.float32).reshape(3, 4) + 0.5
    y = np.arange(7, dtype=np.float32) * -3.0  # stored after "x": a read past "x" would land in it
    with PromptStore(tmp_path / "s", memory_bytes="1MiB" if fresh else 0) as writer:
        k = writer.key("t", "wrong shape")
        assert writer.put(k, {"x": x, "y": y}, kind="t")
    with PromptStore(tmp_path / "s", memory_bytes="1MiB" if fresh else 0) as s:
        assert all(t.contains(k) is None for t in s.tiers if t.name == "memory")  # only the disk can answer
        dst = np.zeros(wrong, np.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("error", PromptStoreWarning)  # no "dropped corrupt entry"
            got = s.get(k, kind="t", into={"x": dst})
            assert s.stats()["kinds"]["t"]["tiers"]["disk"]["hits"] == 1
            assert got is not None
            assert got.tensors["x"].shape == (3, 4) and not np.shares_memory(got.tensors["x"], dst)
            assert_same_tensors(got.tensors, {"x": x, "y": y})
            assert not dst.any()  # the caller's array of another shape is untouched
            assert k in s and entry_file(s, k).exists()  # still stored
            assert_same_tensors(s.get(k, kind="t").tensors, {"x": x, "y": y})
        assert s.verify()["ok"]


def test_a_read_never_waits_for_the_index_write_lock_and_its_hit_counts_are_written_behind(tmp_path, monkeypatch):
    """Hits reach the disk tier's index in batches, written by a thread of their own, never by the
    read that made a batch due. A read while another process holds the index's write lock is served at
    once (in the call, it waited out the lock's 60 s timeout and then missed), and its hits land
    once the lock is free."""
    import time

    from promptstore._tiers import disk

    monkeypatch.setattr(disk, "FLUSH_AFTER_S", 0.0)  # every read makes its batch due
    store = PromptStore(tmp_path / "s", memory_bytes=0)
    key = store.key("t", "a")
    store.put(key, {"x": np.arange(4.0)}, kind="t")
    stored = store.ls("t")[0].hits  # (an entry starts with one)
    other = sqlite3.connect(tmp_path / "s" / "index.sqlite", isolation_level=None)  # as another process's
    other.execute("BEGIN IMMEDIATE")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a tier fault would warn: none may happen
            t0 = time.monotonic()
            served = [store.get(key, kind="t") for _ in range(3)]
            took = time.monotonic() - t0
        assert all(e is not None and np.array_equal(e.tensors["x"], np.arange(4.0)) for e in served)
        assert took < 5.0, f"three reads took {took:.1f} s behind another writer's lock"
    finally:
        other.execute("COMMIT")
        other.close()
    assert store.stats()["kinds"]["t"]["hits"] == 3
    store.close()  # writes what is still pending
    view = PromptStore(tmp_path / "s", memory_bytes=0)  # what another process reads from the index
    assert [i.hits for i in view.ls("t")] == [stored + 3]
    view.close()


def _slow_batches(monkeypatch, seconds: float):
    """Make the flusher's batch writes take ``seconds`` inside their transaction (a large batch, a slow disk),
    so that what races them lands inside one; returns an event set when one starts."""
    import threading
    import time

    from promptstore._tiers import disk

    started = threading.Event()
    original = disk.DiskTier._write_counters

    def slow(self, db):
        original(self, db)
        if threading.current_thread().name == "promptstore-flusher":
            started.set()
            time.sleep(seconds)

    monkeypatch.setattr(disk.DiskTier, "_write_counters", slow)
    return started


def test_a_process_forked_while_hit_counts_are_written_uses_the_store_and_counts_its_own_hits(tmp_path, monkeypatch):
    """A child forked while the flusher thread holds the tier's locks (mid-write) would inherit them held, with no
    thread to release them: its first read hung. Fork waits for the write; the child starts with fresh locks,
    none of the parent's pending hits (both would write them), and a flusher of its own, which writes its hits."""
    import os
    import time

    from promptstore._tiers import disk

    monkeypatch.setattr(disk, "FLUSH_AFTER_S", 0.2)
    writing = _slow_batches(monkeypatch, 0.5)
    store = PromptStore(tmp_path / "s", memory_bytes=0)
    key = store.key("t", "a")
    store.put(key, {"x": np.arange(4.0)}, kind="t")
    stored = store.ls("t")[0].hits
    assert store.get(key, kind="t") is not None  # the parent's hit, written by its flusher
    assert writing.wait(10)

    def child() -> None:
        ok = all(store.get(key, kind="t") is not None for _ in range(3))
        store.put(store.key("t", "child"), {"x": np.ones(2)}, kind="t")
        time.sleep(1.5)  # the child's flusher writes its three hits
        os._exit(0 if ok else 3)  # as a worker process ends: no close, no exit handlers

    assert run_forked(child, 30) == 0  # (None: it hung)
    store.close()
    view = PromptStore(tmp_path / "s", memory_bytes=0)
    assert {i.key: i.hits for i in view.ls("t")}[bytes(key)] == stored + 1 + 3
    view.close()


def test_an_entry_refreshed_by_a_hit_is_not_dropped_as_expired_by_a_read_racing_the_hits_write(tmp_path, monkeypatch):
    """A sliding TTL: a read that lands while the flusher writes the batch holding the entry's last hit saw the row's
    old expiry and no pending hit, and dropped the live entry. The expiry is checked again before anything goes."""
    import time

    from promptstore._tiers import disk

    monkeypatch.setattr(disk, "FLUSH_AFTER_S", 0.0)
    writing = _slow_batches(monkeypatch, 0.5)
    now = [0.0]
    store = PromptStore(tmp_path / "s", memory_bytes=0, clock=lambda: now[0])
    key = store.key("t", "a")
    store.put(key, {"x": np.arange(4.0)}, kind="t", ttl_s=10)  # expires at 10 unless hit
    now[0] = 5.0
    assert store.get(key, kind="t") is not None  # now expires at 15
    assert writing.wait(10)
    now[0] = 12.0
    entry = store.get(key, kind="t")
    time.sleep(0.6)
    assert entry is not None and key in store
    store.close()


def test_a_process_forked_with_hits_pending_writes_its_own_and_not_its_parents(tmp_path, monkeypatch):
    """A child forked before the parent's batch was written inherits it: writing it would count the parent's hits
    twice, and a batch marked as handed to a flusher (the parent's, absent in the child) kept the child's own hits
    from ever being handed to one."""
    import os
    import time

    from promptstore._tiers import disk

    monkeypatch.setattr(disk, "FLUSH_AFTER_S", 0.5)
    store = PromptStore(tmp_path / "s", memory_bytes=0)
    key = store.key("t", "a")
    store.put(key, {"x": np.arange(4.0)}, kind="t")
    stored = store.ls("t")[0].hits
    assert store.get(key, kind="t") is not None  # pending: written in half a second

    def child() -> None:
        ok = all(store.get(key, kind="t") is not None for _ in range(3))
        time.sleep(2.0)  # the child's flusher writes what it holds
        os._exit(0 if ok else 3)  # as a worker process ends: no close, no exit handlers

    assert run_forked(child, 30) == 0
    store.close()
    view = PromptStore(tmp_path / "s", memory_bytes=0)
    assert {i.key: i.hits for i in view.ls("t")}[bytes(key)] == stored + 1 + 3
    view.close()
