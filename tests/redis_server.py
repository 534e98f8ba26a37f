"""A real redis-server on a free loopback port, in its own folder: for the tests and the benchmarks.

Standard library only, so ``bench/`` can import it from a checkout without pytest.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    for _ in range(1000):
        port = free_port()
        if port + 10000 > 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisServer:
    """``start()``/``stop()``/``kill()``, or ``with RedisServer() as server: server.url``."""

    def __init__(self, folder: Path | None = None, password: str | None = None) -> None:
        self.exe = shutil.which("redis-server")
        if self.exe is None:
            raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server; .ci/run does it)")
        self.folder = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="ps-redis-"))
        self.password = password
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.extra: list[str] = []  # more redis-server arguments (a cluster node's)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.folder.mkdir(parents=True, exist_ok=True)
        args = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder), "--save", "",
                "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"]
        if self.password:
            args += ["--requirepass", self.password]
        args += self.extra
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisClusterServers:
    """A real Redis Cluster on loopback: ``masters`` primaries (and ``replicas`` per primary), each a
    redis-server with ``--cluster-enabled yes`` in its own folder, joined by ``redis-cli --cluster create``.

    ``full_coverage=False`` lets the live nodes answer for their own slots while a primary is down (Redis's
    ``cluster-require-full-coverage no``), which is what a store spread over many nodes wants.
    """

    def __init__(self, masters: int = 3, replicas: int = 0, folder: Path | None = None,
                 full_coverage: bool = False, node_timeout_ms: int = 1000) -> None:
        self.cli = shutil.which("redis-cli")
        if self.cli is None:
            raise RuntimeError("redis-cli is not installed (Debian: apt-get install redis-tools)")
        self.folder = Path(folder) if folder is not None else Path(tempfile.mkdtemp(prefix="ps-cluster-"))
        self.masters, self.replicas = masters, replicas
        self.full_coverage, self.node_timeout_ms = full_coverage, node_timeout_ms
        self.nodes: list[RedisServer] = []

    @property
    def url(self) -> str:
        """Any node names the cluster: the tier finds the others."""
        return self.nodes[0].url

    def start(self) -> RedisClusterServers:
        for i in range(self.masters * (1 + self.replicas)):
            node = RedisServer(self.folder / f"node{i}")
            node.port = free_cluster_port()
            node.extra = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                          "--cluster-node-timeout", str(self.node_timeout_ms),
                          "--cluster-require-full-coverage", "yes" if self.full_coverage else "no"]
            self.nodes.append(node.start())
        addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run([self.cli, "--cluster", "create", *addrs, "--cluster-replicas", str(self.replicas),
                        "--cluster-yes"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.wait_ok()
        return self

    def info(self, node: RedisServer, *args: str) -> str:
        return subprocess.run([self.cli, "-p", str(node.port), *args], capture_output=True, text=True,
                              timeout=10).stdout

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every live node sees the cluster as ok, with each slot served."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            live = [n for n in self.nodes if n.proc is not None]
            if all("cluster_state:ok" in self.info(n, "cluster", "info") for n in live):
                return
            time.sleep(0.1)
        raise RuntimeError("the cluster did not come up")

    def node_of_slot(self, slot: int) -> RedisServer:
        for n in self.nodes:
            if n.proc is None:
                continue
            for line in self.info(n, "cluster", "nodes").splitlines():
                parts = line.split()
                if "myself" in parts[2] and "master" in parts[2]:
                    for rng in parts[8:]:
                        lo, _, hi = rng.partition("-")
                        if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                            return n
        raise LookupError(f"no live primary serves slot {slot}")

    def node_id(self, node: RedisServer) -> str:
        return self.info(node, "cluster", "myid").strip()

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    def __enter__(self) -> RedisClusterServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
