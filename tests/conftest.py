"""Shared fixtures: a fake clock, entry builders, and running code in fresh Python processes."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest

from promptstore._codec import decode, encode, prepare
from promptstore._entry import Entry

from redis_server import RedisClusterServers, RedisServer  # noqa: F401 - test_redis.py imports it from here

REPO = Path(__file__).resolve().parents[1]

# Temporary files of the suite, and of the processes it starts, go under one folder removed when the
# run ends: folders made with tempfile outside pytest's tmp_path would otherwise stay in /tmp after
# every run, and a machine that runs the suite often fills its disk.
_TMP = tempfile.mkdtemp(prefix="promptstore-tests-")
_TMP_OWNER = os.getpid()
tempfile.tempdir = _TMP
os.environ["TMPDIR"] = _TMP

# File digests are remembered across processes (#12); the suite keeps its own memo, shared by the
# fresh processes it starts, instead of the user's.
os.environ.setdefault("PROMPTSTORE_DIGESTS", str(Path(tempfile.mkdtemp(prefix="ps-digests-")) / "digests.sqlite3"))


@atexit.register
def _remove_tmp() -> None:
    """Remove the run's temporary folder as the process that made it exits (``make mutation`` runs many
    sessions in one process, and forks: the folder lives as long as that process)."""
    if os.getpid() == _TMP_OWNER:
        shutil.rmtree(_TMP, ignore_errors=True)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Every session starts with the library's memos empty.

    A no-op for a plain run. ``make mutation`` runs many sessions in processes forked from one
    that has already run the tests: without this, a mutant in identity or digest code would be
    answered from what the unmutated code remembered, and survive for that reason alone.
    """
    if os.environ.get("MUTANT_UNDER_TEST", "") in ("", "stats", "mutant_generation"):
        return
    from promptstore._live import reset_memos

    os.environ["PROMPTSTORE_DIGESTS"] = str(Path(tempfile.mkdtemp(prefix="ps-digests-")) / "digests.sqlite3")
    reset_memos()


@pytest.fixture
def store(tmp_path: Path):
    """A store in a fresh folder with a small memory tier (suites that need another size define their own)."""
    from promptstore import PromptStore

    with PromptStore(tmp_path / "store", memory_bytes="64MiB") as s:
        yield s


class FakeClock:
    """A wall clock the test moves by hand."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(autouse=True)
def _forget_refuted_keys():
    """A key refuted by one test's live change is not refuted in the next (a process would keep it)."""
    yield
    try:
        from promptstore.llm._verify import forget_refuted
    except ImportError:  # the llm extra is not installed
        return
    forget_refuted()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make_entry(
    key: bytes,
    tensors: dict | None = None,
    *,
    kind: str = "test",
    cost_s: float = 0.0,
    parent: bytes | None = None,
    ttl_s: float | None = None,
    meta: dict | None = None,
    namespace: str = "",
) -> Entry:
    """An entry exactly as the store hands it to a tier (encoded once, decoded as views)."""
    if tensors is None:
        tensors = {"x": np.arange(4, dtype=np.float32)}
    prepared = prepare(key, tensors, kind=kind, cost_s=cost_s, parent=parent, ttl_s=ttl_s, meta=meta,
                       namespace=namespace)
    return decode(encode(prepared), verify=False)


def key_of(i: int | str) -> bytes:
    from promptstore import make_key

    return make_key("test", str(i))


def run_forked(target, timeout: float = 60) -> int | None:
    """Run ``target`` in a child forked from this process (what it inherits is what a test checks): its exit
    code, or None if it still ran after ``timeout`` seconds (it is then killed)."""
    import multiprocessing

    proc = multiprocessing.get_context("fork").Process(target=target)
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        return None
    return proc.exitcode


def run_python(code: str, *args: str, env: dict | None = None, timeout: float = 300,
               check: bool = True) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (a real separate process).

    Under ``make mutation`` the child runs the code as shipped (MUTANT_UNDER_TEST cleared), so that a
    fresh-process test compares what the mutated process stored with what the original code reads."""
    full_env = {**os.environ, "MUTANT_UNDER_TEST": "", **(env or {})}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"child failed ({proc.returncode}):\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def assert_same_tensors(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        x, y = np.asarray(a[name]), np.asarray(b[name])
        assert x.shape == y.shape, name
        assert x.tobytes() == y.tobytes(), name


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A real 3-primary Redis Cluster on loopback, shared by the tests that only read and write it."""
    cluster = RedisClusterServers(3, folder=tmp_path_factory.mktemp("cluster")).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def cluster_url(redis_cluster):
    """The cluster, every primary emptied for each test; any node's URL names the whole cluster."""
    import redis

    for node in redis_cluster.nodes:
        if node.proc is not None:
            redis.Redis.from_url(node.url).flushall()
    return redis_cluster.url


@pytest.fixture
def redis_url(redis_server):
    """A clean database for each test."""
    import redis

    redis.Redis.from_url(redis_server.url).flushall()
    return redis_server.url
