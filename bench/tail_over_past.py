"""Why an exact pass over stored KV can cost more than a full prefill on this CPU (ChunkCache's guard).

    python bench/tail_over_past.py [--prompts 4]

Per chat-set prompt of bench/chunk_quality.py (8 x 256 tokens): transformers' full prefill of the
whole prompt; transformers' forward of everything after the first passage over that prefix's KV
(what an exact ChunkCache pass computes); and ``ChunkCache(recompute=1.0).prefill`` with every
passage stored. Side by side, medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chunk_quality import build_prompts  # noqa: E402

from promptstore import PromptStore  # noqa: E402
from promptstore.llm import ChunkCache, load_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, tok = load_model("smollm2-135m-instruct")
    prompts = build_prompts(tok, "chat", args.prompts, 8, 256)
    exact = ChunkCache(model, tok, PromptStore(tempfile.mkdtemp(prefix="ps-tail-"), memory_bytes=0), recompute=1.0)
    for p in prompts:
        exact.prefill(p)  # every passage stored
    rows = []
    for p in prompts:
        ids = [t for seg in p for t in seg]
        head = len(p[0]) + len(p[1])  # the anchor and the first passage: where a moved passage's tail starts
        with torch.no_grad():
            t0 = time.perf_counter()
            model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
            full = time.perf_counter() - t0
            past = model(torch.tensor([ids[:head]]), use_cache=True).past_key_values
            t0 = time.perf_counter()
            model(torch.tensor([ids[head:]]), past_key_values=past, use_cache=True, logits_to_keep=1)
            tail = time.perf_counter() - t0
        t0 = time.perf_counter()
        exact.prefill(p)
        rows.append((full, tail, time.perf_counter() - t0))
        print(f"{len(ids)} tokens: full prefill {full:.2f} s; the last {len(ids) - head} over {head} stored "
              f"{tail:.2f} s; ChunkCache exact {rows[-1][2]:.2f} s", flush=True)
    full, tail, ex = (statistics.median(c) for c in zip(*rows, strict=True))
    print(f"medians: full prefill {full:.2f} s, tail over stored KV {tail:.2f} s ({tail / full:.2f}x), "
          f"ChunkCache exact {ex:.2f} s ({ex / full:.2f}x)")


if __name__ == "__main__":
    main()
