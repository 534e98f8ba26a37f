"""Store benchmark: get and put of 2 KB and 4 MB entries, side by side with what a user would
pick instead (diskcache; one np.save/np.load file per key), in one run on this machine.

    python bench/store_bench.py [--repeats 7] [--out bench/out]

Prints a table (medians over repeats, ratios against the alternatives measured in the same
run) and writes store_bench.json and store_bench.png. Not a test: timings here are noisy,
the ratios are what to read.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from promptstore import PromptStore  # noqa: E402

from _common import machine, save_bar_chart  # noqa: E402

SIZES = {"2KB": (512, 2000), "4MB": (1024 * 1024, 48)}  # float32 elements, entries per round


def timed(fn: Callable[[], None], n: int, repeats: int, setup: Callable[[int], None] | None = None) -> float:
    """Median seconds per operation over ``repeats`` rounds of ``n`` operations."""
    per_op = []
    for r in range(repeats):
        if setup:
            setup(r)
        t0 = time.perf_counter()
        fn()
        per_op.append((time.perf_counter() - t0) / n)
    return statistics.median(per_op)


class Contender:
    name = ""

    def __init__(self, root: Path) -> None:
        self.root = root

    def put(self, i: int, arr: np.ndarray) -> None: ...

    def get(self, i: int) -> np.ndarray: ...


class Memory(Contender):
    name = "promptstore memory"

    def __init__(self, root, **kw):
        super().__init__(root)
        self.s = self.open(root, **kw)
        self.keys: dict[int, bytes] = {}

    @staticmethod
    def open(root, **kw):
        return PromptStore(memory_bytes="4GiB", disk_bytes=0)

    def key(self, i):
        # Keys are made once, outside the timed loop: a caller hashes its input once too.
        k = self.keys.get(i)
        if k is None:
            k = self.keys[i] = self.s.key("b", str(i))
        return k

    def put(self, i, arr):
        self.s.put(self.key(i), {"x": arr}, kind="b", cost_s=0.01)

    def get(self, i):
        return self.s.get(self.keys[i]).tensors["x"]


class Disk(Memory):
    name = "promptstore disk"

    @staticmethod
    def open(root, durable=False):
        return PromptStore(root, memory_bytes=0, disk_bytes="16GiB", durable=durable)


class RedisOnly(Memory):
    name = "promptstore redis (loopback)"
    url = ""

    @classmethod
    def open(cls, root, **kw):
        return PromptStore(memory_bytes=0, disk_bytes=0, redis_url=cls.url, redis_bytes="16GiB")


class DiskCache(Contender):
    name = "diskcache"

    def __init__(self, root):
        super().__init__(root)
        import diskcache

        self.c = diskcache.Cache(str(root), size_limit=16 * 1024**3)

    def put(self, i, arr):
        self.c.set(i, arr.tobytes())  # raw bytes: no pickle of the array, its fastest path

    def get(self, i):
        return np.frombuffer(self.c.get(i), dtype=np.float32)


class NpyFiles(Contender):
    name = "np.save/np.load"

    def put(self, i, arr):
        np.save(self.root / f"{i}.npy", arr)

    def get(self, i):
        return np.load(self.root / f"{i}.npy")


def run(repeats: int, out: Path, redis_url: str | None) -> dict:
    results: dict[str, dict[str, dict[str, float]]] = {}
    tmp = Path(tempfile.mkdtemp(prefix="ps-bench-"))
    try:
        for size, (elems, n) in SIZES.items():
            arr = np.random.default_rng(0).standard_normal(elems).astype(np.float32)
            nbytes = arr.nbytes
            contenders = [Memory(tmp / f"m{size}"), Disk(tmp / f"d{size}"), DiskCache(tmp / f"c{size}"),
                          NpyFiles(tmp / f"n{size}")]
            (tmp / f"n{size}").mkdir()
            if size == "4MB":
                contenders.append(Disk(tmp / f"dd{size}", durable=True))
                contenders[-1].name = "promptstore disk durable"
            if redis_url:
                RedisOnly.url = redis_url
                contenders.append(RedisOnly(tmp / f"r{size}"))
            for c in contenders:
                base = [0]

                def setup(r: int) -> None:
                    base[0] = (r + 1) * 100_000

                for r in range(repeats):  # warm the key cache of the store contenders
                    for i in range(n):
                        getattr(c, "key", lambda _: None)((r + 1) * 100_000 + i)
                put_s = timed(lambda: [c.put(base[0] + i, arr) for i in range(n)], n, repeats, setup)
                # Reads: the last round's keys, from the page cache (and the memory tier for "memory").
                keys = [base[0] + i for i in range(n)]
                first = c.get(keys[0])
                assert first.tobytes() == arr.tobytes(), c.name
                get_s = timed(lambda: [c.get(k) for k in keys], n, repeats)
                results.setdefault(size, {})[c.name] = {
                    "put_s": put_s, "get_s": get_s, "put_ops": 1 / put_s, "get_ops": 1 / get_s,
                    "put_GBps": nbytes / put_s / 1e9, "get_GBps": nbytes / get_s / 1e9,
                }
                print(f"  {size:>4} {c.name:<26} put {1 / put_s:>10.0f}/s {nbytes / put_s / 1e9:6.2f} GB/s   "
                      f"get {1 / get_s:>10.0f}/s {nbytes / get_s / 1e9:6.2f} GB/s", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return results


def report(results: dict, out: Path) -> str:
    r2, r4 = results["2KB"], results["4MB"]
    mem2, disk2, disk4 = r2["promptstore memory"], r2["promptstore disk"], r4["promptstore disk"]
    goals = [
        ("disk get 4 MB >= 1.5 GB/s", disk4["get_GBps"], 1.5, f"{disk4['get_GBps']:.2f} GB/s"),
        ("disk get 4 MB no slower than np.load", r4["np.load" if False else "np.save/np.load"]["get_s"] / disk4["get_s"],
         1.0, f"{r4['np.save/np.load']['get_s'] / disk4['get_s']:.2f}x np.load's speed"),
        ("disk get 2 KB >= 5,000/s", disk2["get_ops"], 5000, f"{disk2['get_ops']:,.0f}/s"),
        ("memory get >= 200,000/s", mem2["get_ops"], 200_000, f"{mem2['get_ops']:,.0f}/s"),
        ("put 4 MB >= 500 MB/s", disk4["put_GBps"], 0.5, f"{disk4['put_GBps'] * 1000:.0f} MB/s "
         f"(np.save: {r4['np.save/np.load']['put_GBps'] * 1000:.0f} MB/s)"),
    ]
    redis4 = r4.get("promptstore redis (loopback)")
    if redis4:
        goals.append(("redis get 4 MB within 3x of a disk-tier get", disk4["get_s"] * 3 / redis4["get_s"], 1.0,
                      f"{redis4['get_s'] / disk4['get_s']:.2f}x the disk tier's time"))
    lines = ["| size | contender | put /s | put GB/s | get /s | get GB/s | get vs np.load | get vs diskcache |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for size, rows in results.items():
        npl, dc = rows["np.save/np.load"]["get_s"], rows["diskcache"]["get_s"]
        for name, r in rows.items():
            lines.append(f"| {size} | {name} | {r['put_ops']:,.0f} | {r['put_GBps']:.3f} | {r['get_ops']:,.0f} | "
                         f"{r['get_GBps']:.3f} | {npl / r['get_s']:.2f}x | {dc / r['get_s']:.2f}x |")
    lines += ["", "| goal | measured | met |", "|---|---|---|"]
    lines += [f"| {g} | {text} | {'yes' if v >= target else 'no'} |" for g, v, target, text in goals]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"store benchmark on {machine()['summary']}; medians of {args.repeats} rounds")
    from _common import RedisServer

    try:
        with RedisServer() as server:
            results = run(args.repeats, args.out, server.url)
    except RuntimeError as exc:
        print(f"(no Redis rows: {exc})")
        results = run(args.repeats, args.out, None)
    table = report(results, args.out)
    print()
    print(table)
    (args.out / "store_bench.json").write_text(json.dumps({"machine": machine(), "results": results,
                                                           "table": table}, indent=1))
    save_bar_chart(
        args.out / "store_bench.png",
        title="promptstore store benchmark (get throughput, GB/s; higher is better)",
        groups=list(results),
        series={name: [results[s][name]["get_GBps"] for s in results] for name in results["2KB"]},
        ylabel="GB/s (log)", log=True,
    )
    print(f"\nwrote {args.out / 'store_bench.json'} and {args.out / 'store_bench.png'}")


if __name__ == "__main__":
    main()
