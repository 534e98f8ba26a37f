"""Scaling: store get latency against the number of entries in the index (1k to 1M), and YOLOE
set_classes time against vocabulary size.

    python bench/scaling_bench.py [--max-entries 1000000] [--out bench/out]

The store is filled by writing entry files into the disk tier's folder and letting the tier
index them (its own recovery path, one row per file), which is faster than a million puts;
every measurement then goes through the public ``get``. Writes scaling.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from promptstore import PromptStore  # noqa: E402
from promptstore._codec import encode, prepare  # noqa: E402

from _common import machine  # noqa: E402


def fill(folder: Path, start: int, stop: int) -> None:
    """Write entries start..stop as entry files, then have the disk tier index them."""
    probe = PromptStore(folder, memory_bytes=0, disk_bytes="64GiB")
    vec = np.random.default_rng(0).standard_normal(512).astype(np.float32)  # 2 KB, like a class embedding
    entries = folder / "entries"
    for i in range(start, stop):
        key = probe.key("scale", str(i))
        blob = encode(prepare(key, {"x": vec}, kind="scale", cost_s=0.01))
        shard = entries / key.hex()[:2]
        shard.mkdir(parents=True, exist_ok=True)
        (shard / f"{key.hex()}.0-{i:08x}.safetensors").write_bytes(memoryview(blob))
    disk = probe.tiers[0]
    with disk._lock:
        disk._adopt_files(disk._conn())
    probe.close()


def get_latency(folder: Path, n_entries: int, samples: int = 3000) -> dict:
    store = PromptStore(folder, memory_bytes=0)
    rng = np.random.default_rng(n_entries)
    keys = [store.key("scale", str(int(i))) for i in rng.integers(0, n_entries, samples)]
    misses = [store.key("scale", f"absent{i}") for i in range(samples)]
    for k in keys[:200]:
        store.get(k)  # warm the page cache a little, like a running service
    rounds = []
    for _ in range(3):
        t0 = time.perf_counter()
        for k in keys:
            assert store.get(k) is not None
        rounds.append((time.perf_counter() - t0) / samples)
    t0 = time.perf_counter()
    for k in misses:
        store.get(k)
    miss = (time.perf_counter() - t0) / samples
    store.close()
    return {"hit_us": statistics.median(rounds) * 1e6, "miss_us": miss * 1e6}


def vision_scaling(out: dict, repeats: int) -> None:
    import ultralytics
    import yaml

    names = list(yaml.safe_load((Path(ultralytics.__file__).parent / "cfg/datasets/lvis.yaml").read_text())["names"].values())
    sizes = [10, 80, 300, 1203]
    folder = Path(tempfile.mkdtemp(prefix="ps-vscale-"))
    code = r"""
import json, sys, time, statistics, torch
from ultralytics import YOLOE
from promptstore import PromptStore
from promptstore.vision import OpenCLIPTextEncoder, set_classes
folder, names, sizes, repeats, phase = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
torch.manual_seed(0)
model = YOLOE("yoloe-11s-seg.yaml")
if phase == "miss":  # the first call in a process also pays torch's and open_clip's warm-up: not a vocabulary cost
    set_classes(model, ["warm-up"], store=PromptStore(folder + "/warmup"), encoder=OpenCLIPTextEncoder("MobileCLIP2-B"))
res = {}
for n in sizes:
    vocab = names[:n]
    if phase == "miss":
        store = PromptStore(folder + f"/miss{n}")
        t0 = time.perf_counter(); set_classes(model, vocab, store=store, encoder=OpenCLIPTextEncoder("MobileCLIP2-B")); res[n] = {"miss": time.perf_counter() - t0}
        store.close()
    else:
        same, reordered = [], []
        for r in range(repeats):
            store = PromptStore(folder + f"/miss{n}", memory_bytes=0)
            enc = OpenCLIPTextEncoder("MobileCLIP2-B")  # made outside the timing, as a service makes it once
            t0 = time.perf_counter(); rep = set_classes(model, vocab, store=store, encoder=enc); same.append(time.perf_counter() - t0)
            assert rep.from_set and not rep.encoder_loaded
            rotated = vocab[r + 1:] + vocab[:r + 1]  # an order not seen before: per-name hits, not the whole-vocabulary entry
            t0 = time.perf_counter(); rep = set_classes(model, rotated, store=store, encoder=enc); reordered.append(time.perf_counter() - t0)
            assert rep.hits == n and not rep.from_set and not rep.encoder_loaded
            store.close()
        res[n] = {"warm_same": statistics.median(same), "warm_reordered": statistics.median(reordered)}
print(json.dumps(res))
"""
    result: dict[str, dict] = {}
    for phase in ("miss", "warm"):
        proc = subprocess.run([sys.executable, "-c", code, str(folder), json.dumps(names), json.dumps(sizes), str(repeats),
                               phase], capture_output=True, text=True, check=True)
        for n, v in json.loads(proc.stdout.strip().splitlines()[-1]).items():
            result.setdefault(n, {}).update(v)
    out["vision"] = result
    for n, v in result.items():
        print(f"  set_classes {n:>5} names: miss {v['miss']:.2f} s | warm (same vocabulary) {v['warm_same'] * 1e3:.1f} ms | "
              f"warm (reordered: per-name hits) {v['warm_reordered'] * 1e3:.1f} ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-entries", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    parser.add_argument("--vision-only", action="store_true", help="rerun set_classes scaling, keep the store rows")
    args = parser.parse_args()
    out: dict = {"machine": machine(), "store": {}}
    if args.vision_only:
        out = json.loads((args.out / "scaling.json").read_text())
        vision_scaling(out, args.repeats)
        (args.out / "scaling.json").write_text(json.dumps(out, indent=1))
        return
    folder = Path(tempfile.mkdtemp(prefix="ps-scale-"))
    have = 0
    for n in [c for c in (1_000, 10_000, 100_000, 1_000_000) if c <= args.max_entries]:
        t0 = time.perf_counter()
        fill(folder, have, n)
        have = n
        lat = get_latency(folder, n)
        lat["fill_s"] = time.perf_counter() - t0
        lat["folder_bytes"] = sum(f.stat().st_size for f in (folder / "index.sqlite",) if f.exists())
        out["store"][str(n)] = lat
        print(f"  {n:>9} entries: get hit {lat['hit_us']:.0f} us, miss {lat['miss_us']:.0f} us (filled in "
              f"{lat['fill_s']:.0f} s)", flush=True)
    vision_scaling(out, args.repeats)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scaling.json").write_text(json.dumps(out, indent=1))
    os.system(f"rm -rf {folder}")


if __name__ == "__main__":
    main()
