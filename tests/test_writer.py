"""Puts written after the call returns (``put(background=True)``): what a process, its exit and a kill leave."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from promptstore import PromptStore
from promptstore.errors import InvalidEntryError

from conftest import run_forked


def _block_disk_puts(store: PromptStore) -> threading.Event:
    """Make the store's disk tier wait for the returned event before each put (the write, not a stand-in)."""
    disk = next(t for t in store.tiers if t.persistent)
    release = threading.Event()
    real = disk.put

    def put(entry):
        release.wait(30)
        return real(entry)

    disk.put = put  # type: ignore[method-assign]
    return release


def test_a_background_put_returns_before_it_is_written_and_reads_wait_for_it(tmp_path):
    with PromptStore(tmp_path / "s", memory_bytes=0) as store:
        release = _block_disk_puts(store)
        key = store.key("t", "a")
        x = np.arange(10, dtype=np.float32)
        t0 = time.perf_counter()
        assert store.put(key, {"x": x}, kind="t", background=True)
        assert time.perf_counter() - t0 < 5  # the disk put is blocked: the call did not wait for it
        threading.Timer(0.3, release.set).start()
        got = store.get(key)  # waits for the queued write
        assert got is not None and np.array_equal(got.tensors["x"], x)


def test_background_puts_keep_their_order_so_a_child_follows_its_parent(tmp_path):
    with PromptStore(tmp_path / "s", memory_bytes=0) as store:
        keys = [store.key("t", str(i)) for i in range(20)]
        for i, key in enumerate(keys):
            store.put(key, {"x": np.full(4, i, np.int32)}, kind="t", parent=keys[i - 1] if i else None, background=True)
        store.flush()
        assert {e.key for e in store.ls("t")} == set(keys)
        assert all(store.peek(k).parent == (keys[i - 1] if i else None) for i, k in enumerate(keys))


def test_a_later_put_of_a_key_lands_after_a_queued_one(tmp_path):
    with PromptStore(tmp_path / "s", memory_bytes=0) as store:
        release = _block_disk_puts(store)
        key = store.key("t", "a")
        store.put(key, {"x": np.zeros(3, np.float32)}, kind="t", background=True)
        threading.Timer(0.3, release.set).start()
        store.put(key, {"x": np.ones(3, np.float32)}, kind="t")
        assert np.array_equal(store.get(key).tensors["x"], np.ones(3, np.float32))


def test_bad_input_is_refused_at_the_call_not_in_the_background(tmp_path):
    with PromptStore(tmp_path / "s") as store:
        with pytest.raises(InvalidEntryError):
            store.put(store.key("t", "a"), {"x": np.zeros(3, dtype=object)}, kind="t", background=True)
        with pytest.raises(InvalidEntryError):
            store.put(store.key("t", "a"), {"x": np.zeros(3)}, kind="t", cost_s=-1, background=True)
        assert store.ls() == []


EXIT_RIGHT_AFTER = """
import sys, numpy as np
from promptstore import PromptStore
store = PromptStore(sys.argv[1], memory_bytes=0)
for i in range(40):
    x = np.random.default_rng(i).standard_normal(250_000).astype(np.float32)  # 1 MB each
    store.put(store.key("t", str(i)), {"x": x}, kind="t", background=True)
print("queued", flush=True)
"""  # and exits without closing the store


def test_a_normal_exit_right_after_background_puts_writes_them_all(tmp_path):
    path = tmp_path / "s"
    out = subprocess.run([sys.executable, "-c", EXIT_RIGHT_AFTER, str(path)], capture_output=True, text=True,
                         timeout=300, check=True)
    assert out.stdout.strip() == "queued"
    with PromptStore(path, memory_bytes=0) as store:
        for i in range(40):
            got = store.get(store.key("t", str(i)))
            assert got is not None, i
            assert np.array_equal(got.tensors["x"], np.random.default_rng(i).standard_normal(250_000).astype(np.float32))
        assert store.verify()["ok"]


KILLED_WHILE_QUEUED = EXIT_RIGHT_AFTER.replace('print("queued", flush=True)',
                                               'print("queued", flush=True)\nimport time; time.sleep(60)')


def test_a_process_killed_with_puts_queued_leaves_whole_entries_or_none(tmp_path):
    path = tmp_path / "s"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WHILE_QUEUED, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "queued"
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    with PromptStore(path, memory_bytes=0) as store:
        assert store.verify()["ok"]
        for i in range(40):
            got = store.get(store.key("t", str(i)))
            if got is not None:  # written before the kill: whole
                assert np.array_equal(got.tensors["x"],
                                      np.random.default_rng(i).standard_normal(250_000).astype(np.float32))


def test_a_forked_child_writes_with_a_writer_of_its_own(tmp_path):
    """A child forked after the parent's writer started inherits its executor without its thread; it must start
    its own, or its background puts would never be written and its reads of them would wait forever."""
    import os

    with PromptStore(tmp_path / "s", memory_bytes=0) as store:
        store.put(store.key("t", "parent"), {"x": np.zeros(3, np.float32)}, kind="t", background=True)
        store.flush()

        def child() -> None:
            key = store.key("t", "child")
            store.put(key, {"x": np.ones(3, np.float32)}, kind="t", background=True)
            ok = store.get(key) is not None
            store.flush()
            os._exit(0 if ok else 3)

        assert run_forked(child, 60) == 0
        assert np.array_equal(store.get(store.key("t", "child")).tensors["x"], np.ones(3, np.float32))


def test_a_later_job_runs_after_the_puts_before_it_and_flush_waits_for_it_and_its_puts(tmp_path):
    """``later``: the job runs on the writer after what was queued before it, sees those entries, writes its own
    puts within it (background or not), and flush() returns only once all of it is in the store."""
    with PromptStore(tmp_path / "s", memory_bytes=0) as store:
        release = _block_disk_puts(store)
        first, second = store.key("t", "first"), store.key("t", "second")
        store.put(first, {"x": np.zeros(3, np.float32)}, kind="t", background=True)
        seen: list[bool] = []

        def job() -> None:
            seen.append(store.get(first) is not None)  # queued before: written by now (waits for nothing)
            store.put(second, {"x": np.ones(3, np.float32)}, kind="t", parent=first, background=True)
            store.put(store.key("t", "third"), {"x": np.ones(2, np.float32)}, kind="t")

        done = store.later(job, nbytes=12)
        assert not done.done()  # the disk's writes are held back: the call did not wait for the job
        threading.Timer(0.3, release.set).start()
        store.flush()
        assert done.done() and seen == [True]
        assert np.array_equal(store.get(second).tensors["x"], np.ones(3, np.float32))
        assert store.peek(second).parent == first and store.get(store.key("t", "third")) is not None


def test_a_later_job_that_fails_is_a_warning_and_a_miss_never_the_callers_error(tmp_path):
    from promptstore.errors import InvalidInputError, PromptStoreWarning

    with PromptStore(tmp_path / "s") as store:
        kept = store.key("t", "kept")

        def job() -> None:
            store.put(kept, {"x": np.zeros(3, np.float32)}, kind="t")
            raise RuntimeError("a fault")

        with pytest.warns(PromptStoreWarning, match="deferred store job failed"):
            store.later(job).result()
        assert store.get(kept) is not None  # what it stored before the fault stays
        with pytest.raises(InvalidInputError):
            store.later("not a job")  # type: ignore[arg-type]


def test_a_later_job_queued_from_a_job_runs_at_once(tmp_path):
    """On the writer thread a job cannot wait for one queued behind it: a nested job runs within it."""
    with PromptStore(tmp_path / "s") as store:
        order: list[str] = []

        def outer() -> None:
            inner = store.later(lambda: order.append("inner"))
            assert inner.done()
            order.append("outer")

        store.later(outer).result(30)
        assert order == ["inner", "outer"]


def test_a_process_forked_while_a_later_job_waits_does_not_wait_for_it_and_runs_its_own(tmp_path):
    """The parent's job runs on the parent's writer: a child forked before it ran returns from waiting on its
    future at once (waiting would never end there), and its own jobs and puts run and land."""
    import os

    with PromptStore(tmp_path / "s", memory_bytes=0) as store:
        gate = threading.Event()
        parent_job = store.later(lambda: gate.wait(60))

        def child() -> None:
            parent_job.result()  # at once
            ran: list[int] = []
            store.later(lambda: ran.append(1)).result()
            store.put(store.key("t", "child"), {"x": np.ones(2, np.float32)}, kind="t", background=True)
            store.flush()
            os._exit(0 if ran == [1] and store.get(store.key("t", "child")) is not None else 3)

        code = run_forked(child, 60)
        gate.set()
        assert code == 0  # (None: it hung)
        assert parent_job.result(10) is None and parent_job.done()


def test_a_later_job_runs_once_when_the_writer_thread_cannot_start_and_never_leaves_a_waiter_hanging(tmp_path, monkeypatch):
    """No thread to be had: the job runs in the caller, and the copy the executor had queued is dropped (it would
    run again later over a buffer holding the next job's data). An executor that breaks (its thread's set-up
    fails) fails its jobs: their futures still end (a miss), never a wait forever."""
    import promptstore._writer as writer_module

    start = threading.Thread.start
    failed: list[bool] = []

    def start_once_failing(self: threading.Thread) -> None:
        if not failed and self.name.startswith("promptstore-writer"):
            failed.append(True)
            raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", start_once_failing)
    with PromptStore(tmp_path / "s", memory_bytes=0) as store:
        buffer, runs = np.zeros(4, np.float32), []

        def write(name: str) -> None:
            runs.append((name, buffer.tolist()))
            store.put(store.key("t", name), {"x": buffer}, kind="t")

        buffer[:] = 1
        first = store.later(lambda: write("A"))
        assert failed and first.done()  # ran in the caller
        buffer[:] = 2
        store.later(lambda: write("B")).result()
        store.flush()
        assert runs == [("A", [1.0] * 4), ("B", [2.0] * 4)]
        assert store.get(store.key("t", "A")).tensors["x"].tolist() == [1.0] * 4
    monkeypatch.undo()

    def broken() -> None:
        raise ValueError("set-up failed")

    monkeypatch.setattr(writer_module, "background_priority", broken)
    with PromptStore(tmp_path / "b", memory_bytes=0) as store:
        assert store.later(lambda: None).result(timeout=30) is None
