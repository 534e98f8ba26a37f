"""Write-behind: puts that finish after the call that made them returns.

One writer thread per store runs them in the order they were made, so a chained entry is
written after its parent, as a synchronous put would be. A read of a key whose write is still
queued waits for that write, so a process always finds what it stored. The thread is a
normal (non-daemon) one: at a normal interpreter exit every queued write completes before the
store's files close. A killed process loses the writes still queued; each tier's writes are
atomic, so what it leaves is a miss, never a partial entry. At most ``MAX_QUEUED_BYTES`` wait in
the queue: past that a put waits for it to drain. A job may itself read and write the store: on
the writer thread every earlier job has run, so its reads wait for nothing and its puts are written
at once, in order.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["OwnFuture", "Writer", "background_priority"]


# Queued bytes past which a put waits for the queue to drain first: a writer slower than the requests
# (a slow disk, a busy Redis) holds requests back, as synchronous puts did, instead of growing memory.
MAX_QUEUED_BYTES = 1 << 30


def background_priority() -> None:
    """Lower the calling thread's CPU priority to the least (nice 19), on Linux; elsewhere nothing.

    Background writes then run on what the caller's own work leaves idle. At equal priority a write
    competing with a forward that keeps every core busy slows it by more than the write's own time
    (the forward's threads wait for the one that was preempted).
    """
    if sys.platform.startswith("linux"):  # per thread there; elsewhere it would lower the whole process
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass


class OwnFuture(Future[None]):
    """The future of a job queued on a process's writer, which a process forked after it never waits for.

    The job runs on the thread of the process that queued it; a forked child has no such thread,
    so waiting there would never end. In the child, :meth:`result` returns at once (the job is its
    parent's to run) and :meth:`done` stays False.
    """

    def __init__(self) -> None:
        super().__init__()
        self._pid = os.getpid()

    def result(self, timeout: float | None = None) -> None:
        """Wait for the job, in the process that queued it; elsewhere return at once."""
        if os.getpid() != self._pid:
            return None
        return super().result(timeout)

    def finish(self) -> None:
        """Mark the job over (run, or dropped by a broken executor: then a miss), once."""
        with self._condition:
            if not self.done():
                self.set_result(None)


class Writer:
    """Runs write jobs on one background thread, in order, keyed so that a read can wait for one."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._thread: int | None = None  # the writer thread's ident, once it runs
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[bytes, Future[None]] = {}
        self._queued_bytes = 0

    def _forked(self) -> None:
        # A forked child inherits the parent's executor without its thread: its queue would never run.
        # The child starts a writer of its own; what the parent queued is the parent's to write.
        if os.getpid() != self._pid:
            self._reset()

    def __bool__(self) -> bool:
        self._forked()
        return bool(self._pending)

    def on_writer(self) -> bool:
        """Whether the calling thread is the writer's own (a job running): everything queued before it has run."""
        return self._thread == threading.get_ident()

    def _started(self) -> None:
        self._thread = threading.get_ident()
        background_priority()

    def submit(self, key: bytes, job: Callable[[], None], nbytes: int = 0) -> Future[None] | None:
        """Queue ``job`` (which must not raise) as the write of ``key``: its future, or None if it cannot be queued.

        It cannot at interpreter shutdown, nor from a job (on the writer thread, where the caller's
        write is already in order): the caller then writes synchronously.
        """
        self._forked()
        if self.on_writer():
            return None
        if self._queued_bytes + nbytes > MAX_QUEUED_BYTES and self._pending:
            self.flush()
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="promptstore-writer",
                                                initializer=self._started)
            try:
                future = self._pool.submit(job)
            except RuntimeError:  # interpreter shutdown, or no thread to be had ("can't start new thread")
                # The executor queues a job before it starts a thread for it: drop the pool with what it
                # queued, or the job the caller now runs itself would run a second time, later, over
                # whatever its buffers hold by then.
                pool, self._pool = self._pool, None
                pool.shutdown(wait=False, cancel_futures=True)
                return None
            self._pending[key] = future
            self._queued_bytes += nbytes
        future.add_done_callback(functools.partial(self._done, key, nbytes))
        return future

    def _done(self, key: bytes, nbytes: int, future: Future[None]) -> None:
        with self._lock:
            self._queued_bytes -= nbytes
            if self._pending.get(key) is future:
                del self._pending[key]

    def wait(self, key: bytes) -> None:
        """Return once the queued write of ``key`` (and so every write queued before it) has run."""
        self._forked()
        if self.on_writer():
            return  # a job: what was queued before it has run, and what comes after must not be waited for
        future = self._pending.get(key)
        if future is not None:
            future.result()

    def flush(self) -> None:
        """Return once every write queued so far has run."""
        self._forked()
        if self.on_writer():
            return
        with self._lock:
            futures = list(self._pending.values())
        for future in futures:
            future.result()

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        self.flush()
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
