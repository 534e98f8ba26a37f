"""The end-to-end demo (`make demo`): every cached computation, then the same again in a fresh process.

Each part runs twice, each time in a new Python process: the first process computes what the
store lacks and stores it; the second (a fresh process: nothing in memory) finds it on disk.
Each part ends with a table: the full computation against the cached one, measured in the
same process, and whether the results are the same. The store lives in ./.demo-store and is
kept between runs, so a second `make demo` is warm from its first line (`make clean` or
`rm -rf .demo-store` starts cold again).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
STORE = ROOT / ".demo-store"
RESULT = "RESULT "  # a child's last line: its figures for the summary table


def _quiet() -> None:
    """Keep third-party progress bars and root-logger warnings out of the demo's own lines."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.getLogger().setLevel(logging.ERROR)  # open_clip: "No pretrained weights loaded"
    try:
        from transformers.utils import logging as tlog

        tlog.set_verbosity_error()
        tlog.disable_progress_bar()
    except ImportError:
        pass


def _report(rows: list[dict]) -> None:
    print(RESULT + json.dumps(rows), flush=True)


def _label(computed: int, total: int) -> str:
    return "computed" if computed == total else "from the store" if computed == 0 else "partly stored"


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
    computed, got = 0, []
    for text in texts:
        key = store.key("demo.embedding", text, fingerprints=["demo-embedding/v1"])
        entry = store.get(key, kind="demo.embedding")
        if entry is None:
            t1 = time.perf_counter()
            vec = _embedding(text)
            store.put(key, {"embedding": vec}, kind="demo.embedding", cost_s=time.perf_counter() - t1)
            computed += 1
        got.append(vec if entry is None else entry.tensors["embedding"])
    dt = time.perf_counter() - t0
    t1 = time.perf_counter()
    full = [_embedding(t) for t in texts]  # the computation without the store, for the table
    full_s = time.perf_counter() - t1
    same = all(np.array_equal(a, b) for a, b in zip(got, full, strict=True))
    print(f"  [{phase}] 40 embeddings in {dt * 1000:8.1f} ms: {computed} computed, {len(texts) - computed} from the store")
    store.close()
    _report([{"what": "40 embeddings", "full_s": full_s, "cached_s": dt, "computed": computed, "same": same}])


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
    import torch
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
    rows = []
    for question in QUESTIONS:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        first = FirstToken()
        t0 = time.perf_counter()
        out = pc.generate(messages, max_new_tokens=32, do_sample=False, streamer=first)
        ttft = first.at - t0
        s = pc.stats["last"]
        ids = out[:, : s["queried"]]
        # The same request without the store: a full prefill (timed), then generate.
        t1 = time.perf_counter()
        with torch.no_grad():
            model(ids, logits_to_keep=1)
        full_s = time.perf_counter() - t1
        plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)
        same = bool(torch.equal(plain, out))
        answer = tokenizer.decode(out[0, s["queried"]:], skip_special_tokens=True).strip()
        print(f"  [{phase}] {question:<38} {_label(s['computed'], s['queried']):<14} computed {s['computed']:>4} of "
              f"{s['queried']} prompt tokens, first token {ttft * 1000:6.0f} ms -> {answer}")
        rows.append({"what": question, "full_s": full_s, "cached_s": ttft, "computed": s["computed"], "same": same})
    store.close()
    _report(rows)


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
    if phase == "first process":
        print(f"  {what}")
    import copy

    import torch

    # Process-wide first-use costs (imports, kernel set-up) would land on whichever row runs first:
    # one encode on a throwaway copy pays them, so that both rows below build and run the encoder alike.
    warm = copy.copy(encoder)
    warm._model = None
    with torch.no_grad():
        warm.encode(VOCABULARY[:1])
    del warm
    store = PromptStore(STORE, memory_bytes="256MiB", disk_bytes="2GiB")
    t0 = time.perf_counter()
    report = set_classes(model, VOCABULARY, store=store, encoder=encoder)
    dt = time.perf_counter() - t0
    result = model.predict(str(ASSETS / "bus.jpg"), verbose=False, conf=0.25)[0]
    found = ", ".join(f"{result.names[int(b.cls)]} {float(b.conf):.2f}" for b in result.boxes) or "none"
    print(f"  [{phase}] set_classes({len(VOCABULARY)} names) {dt * 1000:8.1f} ms: {report.hits} from the store, "
          f"{report.misses} encoded, encoder loaded: {report.encoder_loaded}; boxes on bus.jpg: {found}")
    if phase != "first process" and not len(result.boxes):
        print("  (no boxes: the detector's weights are random here; put yoloe-11s-seg.pt and mobileclip_blt.ts in this "
              "folder and the same pipeline uses them)")

    # Without the store: what ultralytics does in a new process, build the text encoder, run it, then
    # the head (timed after the hit, on a fresh copy so that both rows pay for the build).
    plain = copy.copy(encoder)
    plain._model = None
    t1 = time.perf_counter()
    with torch.no_grad():
        feats = torch.from_numpy(plain.encode(VOCABULARY))[None]
        full = model.model.model[-1].get_tpe(feats)[0].numpy()
    full_s = time.perf_counter() - t1
    same = bool(np.abs(model.model.pe[0].numpy() - full).max() <= 1e-5)
    store.close()
    _report([{"what": f"set_classes, {len(VOCABULARY)} names", "full_s": full_s, "cached_s": dt,
              "computed": report.misses, "same": same}])


PARTS = {"store": part_store, "llm": part_llm, "vision": part_vision}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--part", choices=sorted(PARTS))
    parser.add_argument("--phase", default="cold")
    args = parser.parse_args()
    _quiet()
    if args.part:
        PARTS[args.part](args.phase)
        return
    warm = STORE.exists()
    print(f"store: {STORE.relative_to(ROOT)} " + ("(kept from an earlier run: expect it warm from the first process)"
                                                  if warm else "(new: the first process computes, the second reads)"))
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore"}
    for name in PARTS:
        print(f"\n== {name}")
        summary = []
        for phase in ("first process", "fresh process"):
            proc = subprocess.run([sys.executable, __file__, "--part", name, "--phase", phase], check=True,
                                  stdout=subprocess.PIPE, text=True, env=env)
            for line in proc.stdout.splitlines():
                if line.startswith(RESULT):
                    summary += [{**row, "phase": phase} for row in json.loads(line[len(RESULT):])]
                else:
                    print(line)
        print(f"  {'':<16}{'':<40}{'full compute':>13}{'with store':>12}{'faster':>9}  same result")
        for row in summary:
            ratio = row["full_s"] / max(row["cached_s"], 1e-9)
            print(f"  {row['phase']:<16}{row['what'][:38]:<40}{row['full_s'] * 1000:>10.0f} ms{row['cached_s'] * 1000:>9.0f} ms"
                  f"{ratio:>8.1f}x  {'yes' if row['same'] else 'NO'}")
        if name == "llm":
            print("  SmolLM2-135M is a small model and gets facts wrong (the dock numbers, for one); what matters here is\n"
                  "  that the answer with the store is token for token the one without it ('same result').")
    print(f"\nstore folder: {STORE}. Inspect it: .venv/bin/promptstore --dir {STORE.relative_to(ROOT)} stats "
          "(or `source .venv/bin/activate`, then promptstore ...)")


if __name__ == "__main__":
    main()
