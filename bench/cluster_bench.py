"""Redis tier throughput: one redis-server against a 3-primary Redis Cluster, side by side in one run.

    python bench/cluster_bench.py [--repeats 3] [--clients 1 8] [--out bench/out]

For 2 KB and 4 MB entries, ``N`` client processes (each a PromptStore with only the Redis tier, as
a host of its own would have) start together, each puts its own entries, then each gets them
back; throughput is all clients' operations (and bytes) over the wall time from the common start
to the last client's end. Medians over repeats. Both Redis setups run on this machine's loopback,
so the cluster's three servers share its cores with the clients: read the ratio, not the figures,
and on a machine with more cores than processes the cluster's primaries would each have their own.
Writes cluster_bench.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine  # noqa: E402
from redis_server import RedisClusterServers, RedisServer  # noqa: E402

SIZES = {"2KB": (512, 1000), "4MB": (1024 * 1024, 16)}  # float32 elements, entries per client


def child(url: str, size: str, client: int, start_at: float) -> None:
    from promptstore import PromptStore

    n_float, count = SIZES[size]
    store = PromptStore(memory_bytes=0, disk_bytes=0, redis_url=url, redis_bytes="32GiB",
                        redis_prefix="bench:")
    keys = [store.key("bench", f"{size}-{client}-{i}") for i in range(count)]
    arrs = [np.full(n_float, client * 1000 + i, np.float32) for i in range(count)]
    time.sleep(max(0.0, start_at - time.time()))
    t0 = time.time()
    for k, a in zip(keys, arrs, strict=True):
        if not store.put(k, {"x": a}, kind="bench"):
            raise SystemExit("put refused")
    t1 = time.time()
    for k in keys:
        if store.get(k, kind="bench") is None:
            raise SystemExit("get missed")
    t2 = time.time()
    print(json.dumps({"put": [t0, t1], "get": [t1, t2], "ops": count, "bytes": count * n_float * 4}))


def round_(url: str, size: str, clients: int) -> dict:
    start_at = time.time() + 2.0 + 0.6 * clients  # every client loaded and waiting (2 cores)
    procs = [subprocess.Popen([sys.executable, __file__, "--child", url, size, str(c), repr(start_at)],
                              stdout=subprocess.PIPE, text=True) for c in range(clients)]
    res = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        if p.returncode:
            raise SystemExit(f"client failed: {out}")
        res.append(json.loads(out.strip().splitlines()[-1]))
    row = {}
    for op in ("put", "get"):
        # Gets start when each client's puts end: the wall time is the first start to the last end.
        wall = max(r[op][1] for r in res) - min(r[op][0] for r in res)
        row[f"{op}_ops_s"] = sum(r["ops"] for r in res) / wall
        row[f"{op}_MB_s"] = sum(r["bytes"] for r in res) / wall / 1e6
    return row


def flush(urls: list[str]) -> None:
    import redis

    for u in urls:
        redis.Redis.from_url(u).flushall()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        url, size, client, start_at = args.child
        child(url, size, int(client), float(start_at))
        return
    results: dict = {"machine": machine(), "rows": []}
    server = RedisServer().start()
    cluster = RedisClusterServers(3).start()
    setups = {"one redis-server": (server.url, [server.url]),
              "3-primary cluster": (cluster.url, [n.url for n in cluster.nodes])}
    try:
        for size in SIZES:
            for clients in args.clients:
                for name, (url, nodes) in setups.items():
                    rows = []
                    for _ in range(args.repeats):
                        flush(nodes)
                        rows.append(round_(url, size, clients))
                    row = {"size": size, "clients": clients, "setup": name,
                           **{k: statistics.median(r[k] for r in rows) for k in rows[0]}}
                    results["rows"].append(row)
                    print(f"{size:>4} x{clients} {name:<18} put {row['put_ops_s']:8.0f} ops/s {row['put_MB_s']:7.1f} MB/s"
                          f" | get {row['get_ops_s']:8.0f} ops/s {row['get_MB_s']:7.1f} MB/s", flush=True)
    finally:
        server.stop()
        cluster.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cluster_bench.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
