"""Shared fixtures: a fake clock, entry builders, and running code in fresh Python processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from promptstore._codec import decode, encode, prepare
from promptstore._entry import Entry

REPO = Path(__file__).resolve().parents[1]


class FakeClock:
    """A wall clock the test moves by hand."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


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


def run_python(code: str, *args: str, env: dict | None = None, timeout: float = 300,
               check: bool = True) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (a real separate process)."""
    full_env = {**os.environ, **(env or {})}
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


class RedisServer:
    """A real redis-server on a free loopback port, in its own temporary folder."""

    def __init__(self, folder: Path, password: str | None = None) -> None:
        import shutil

        self.exe = shutil.which("redis-server")
        if self.exe is None:
            raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server; .ci/run does it)")
        self.folder = folder
        self.password = password
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        import time

        self.folder.mkdir(parents=True, exist_ok=True)
        args = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder), "--save", "",
                "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import socket

        for _ in range(200):
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.1):
                    return self
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
            self.proc = None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server):
    """A clean database for each test."""
    import redis

    redis.Redis.from_url(redis_server.url).flushall()
    return redis_server.url
