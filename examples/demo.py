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


SYSTEM = (
    "You are the assistant of a logistics warehouse. Answer in one short sentence. "
    "Forklifts park in bay C and are charged overnight. Pallets heavier than 800 kg go to aisle 4, ground racks only. "
    "Hazardous goods are kept in the fenced area near door 9; their safety data sheets are in the red binder. "
    "Trucks are unloaded at docks 1 to 6 between 6 am and 2 pm; outgoing orders leave from docks 7 to 12. "
    "Every pick is scanned twice, at the shelf and at the packing table. Lost items are reported to the shift lead. "
) * 6
QUESTIONS = ["Where do forklifts park?", "Where do heavy pallets go?", "Which docks are for outgoing orders?"]


def part_llm(phase: str) -> None:
    """SmolLM2 with a long shared system prompt: the prefix is prefilled once, ever."""
    from transformers.generation.streamers import BaseStreamer

    from promptstore import PromptStore
    from promptstore.llm import PrefixCache, load_model

    class FirstToken(BaseStreamer):
        """Notes when generate emits its first new token (its first put is the prompt)."""

        def __init__(self) -> None:
            self.puts, self.at = 0, 0.0

        def put(self, value) -> None:
            self.puts += 1
            if self.puts == 2:
                self.at = time.perf_counter()

        def end(self) -> None:
            pass

    model, tokenizer = load_model("smollm2-135m-instruct")
    store = PromptStore(STORE, memory_bytes="1GiB", disk_bytes="2GiB")
    pc = PrefixCache(model, tokenizer, store=store)
    pc.fingerprint  # noqa: B018 - hashed once per model, like loading it
    for question in QUESTIONS:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        first = FirstToken()
        t0 = time.perf_counter()
        out = pc.generate(messages, max_new_tokens=32, do_sample=False, streamer=first)
        s = pc.stats["last"]
        answer = tokenizer.decode(out[0, s["queried"]:], skip_special_tokens=True).strip()
        print(f"  [{phase}] {question:<38} computed {s['computed']:>4} / served {s['served']:>4} of {s['queried']} "
              f"prompt tokens, TTFT {(first.at - t0) * 1000:6.0f} ms -> {answer}")
    store.close()


VOCABULARY = ["forklift", "pallet", "cardboard box", "safety vest", "hard hat", "person", "pallet jack", "shelf",
              "ladder", "truck", "bus", "fire extinguisher"]


def part_vision(phase: str) -> None:
    """YOLOE with a warehouse vocabulary: class embeddings from the store, then detection."""
    sys.path.insert(0, str(ROOT / "examples"))
    from detection_pipeline import build_detector
    from ultralytics.utils import ASSETS

    from promptstore import PromptStore
    from promptstore.vision import set_classes

    model, encoder, what = build_detector()
    if phase == "cold":
        print(f"  {what}")
    store = PromptStore(STORE, memory_bytes="256MiB", disk_bytes="2GiB")
    t0 = time.perf_counter()
    report = set_classes(model, VOCABULARY, store=store, encoder=encoder)
    dt = time.perf_counter() - t0
    result = model.predict(str(ASSETS / "bus.jpg"), verbose=False, conf=0.25)[0]
    found = ", ".join(f"{result.names[int(b.cls)]} {float(b.conf):.2f}" for b in result.boxes) or "none"
    print(f"  [{phase}] set_classes({len(VOCABULARY)} names) {dt * 1000:8.1f} ms: {report.hits} hits, "
          f"{report.misses} encoded, encoder loaded: {report.encoder_loaded}; boxes on bus.jpg: {found}")
    if phase == "warm" and not len(result.boxes):
        print("  (no boxes: the detector's weights are random here; put yoloe-11s-seg.pt and mobileclip_blt.ts in this "
              "folder and the same pipeline uses them)")
    store.close()


PARTS = {"store": part_store, "llm": part_llm, "vision": part_vision}


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
