"""The end-to-end demo (`make demo`): every cached computation, cold and then warm in a fresh process.

Each part runs twice in a new Python process: first against an empty store (everything is
computed and stored), then again (a fresh process: nothing in memory, everything from the
disk tier). The store lives in ./.demo-store, emptied at the start.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
STORE = ROOT / ".demo-store"


def _embedding(text: str) -> np.ndarray:
    """A deterministic stand-in workload: real matrix products seeded by the text."""
    rng = np.random.default_rng(int.from_bytes(hashlib.blake2b(text.encode()).digest()[:8], "little"))
    x = rng.standard_normal((64, 512)).astype(np.float32)
    for _ in range(12):
        x = np.tanh(x @ rng.standard_normal((512, 512)).astype(np.float32) / 22.0)
    v = x.mean(0)
    return v / np.linalg.norm(v)


def part_store(phase: str) -> None:
    """The core store: 40 'embeddings' computed once, then read back in a fresh process."""
    from promptstore import PromptStore

    store = PromptStore(STORE, memory_bytes="256MiB", disk_bytes="2GiB")
    texts = [f"warehouse item {i}" for i in range(40)]
    t0 = time.perf_counter()
    computed, first = 0, None
    for text in texts:
        key = store.key("demo.embedding", text, fingerprints=["demo-embedding/v1"])
        entry = store.get(key, kind="demo.embedding")
        if entry is None:
            t1 = time.perf_counter()
            vec = _embedding(text)
            store.put(key, {"embedding": vec}, kind="demo.embedding", cost_s=time.perf_counter() - t1)
            computed += 1
        first = first if first is not None else (vec if entry is None else entry.tensors["embedding"])
    dt = time.perf_counter() - t0
    s = store.stats()
    print(f"  [{phase}] {len(texts)} embeddings in {dt * 1000:8.1f} ms: computed {computed}, "
          f"from cache {s['hits']} (disk tier: {s['tiers']['disk']['entries']} entries); "
          f"equal to a recompute: {np.array_equal(first, _embedding(texts[0]))}")
    store.close()


PARTS = {"store": part_store}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--part", choices=sorted(PARTS))
    parser.add_argument("--phase", default="cold")
    args = parser.parse_args()
    if args.part:
        PARTS[args.part](args.phase)
        return
    shutil.rmtree(STORE, ignore_errors=True)
    for name in PARTS:
        print(f"== {name}")
        for phase in ("cold", "warm"):
            subprocess.run([sys.executable, __file__, "--part", name, "--phase", phase], check=True)
    print(f"\nstore folder: {STORE}  (inspect it: promptstore --dir {STORE.relative_to(ROOT)} stats)")


if __name__ == "__main__":
    main()
