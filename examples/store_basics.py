"""The store on its own: keys, put/get, tiers, stats, a bundle. Run: python examples/store_basics.py"""

from __future__ import annotations

import hashlib
import tempfile
import time
from pathlib import Path

import numpy as np

from promptstore import PromptStore


def expensive_embedding(text: str) -> np.ndarray:
    """Stand-in for a model: a few real matrix products seeded by the text."""
    # A stable seed: Python's hash() differs per process, and a cache needs the same answer.
    rng = np.random.default_rng(int.from_bytes(hashlib.blake2b(text.encode()).digest()[:8], "little"))
    x = rng.standard_normal((64, 512)).astype(np.float32)
    for _ in range(20):
        x = np.tanh(x @ rng.standard_normal((512, 512)).astype(np.float32) / 22.0)
    v = x.mean(0)
    return v / np.linalg.norm(v)


def main() -> None:
    folder = Path(tempfile.mkdtemp(prefix="promptstore-basics-"))
    store = PromptStore(folder, memory_bytes="64MiB", disk_bytes="1GiB")
    words = ["pallet", "forklift", "safety vest", "hard hat", "cardboard box"]

    for word in words:
        key = store.key("demo.embedding", word, fingerprints=["expensive_embedding/v1"])
        if store.get(key, kind="demo.embedding") is None:
            t0 = time.perf_counter()
            vec = expensive_embedding(word)
            store.put(key, {"embedding": vec}, kind="demo.embedding", cost_s=time.perf_counter() - t0,
                      meta={"text": word})

    again = [store.get(store.key("demo.embedding", w, fingerprints=["expensive_embedding/v1"])) for w in words]
    print("second pass hits:", sum(e is not None for e in again), "of", len(words))
    s = store.stats()
    print(f"seconds saved by hits: {s['seconds_saved']:.3f}; disk tier holds {s['tiers']['disk']['entries']} entries")

    bundle = folder / "embeddings.psb"
    print("exported", store.export_bundle(bundle, kind="demo.embedding"), "entries to", bundle.name)
    other = PromptStore(folder / "elsewhere", memory_bytes=0)
    print("imported", other.import_bundle(bundle), "entries; verify:", other.verify()["ok"])


if __name__ == "__main__":
    main()
