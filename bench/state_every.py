"""How often a miss should store a running state: ``STATE_EVERY_TOKENS``, measured on two workloads and two models.

    python bench/state_every.py [--every 128 256 512 1024 4096] [--repeats 3] [--threads 2] [--out bench/out]

A model with linear-attention or SSM layers has a state only where a forward ends. A miss is run
in pieces ending every ``STATE_EVERY_TOKENS`` tokens, storing the state at each end (and at the
request's end), so that a later prompt sharing only part of it resumes from the last such point.
Closer points cost every miss more pieces (a pass over the weights each) and more stored bytes;
farther ones make a hit recompute more of the shared prefix. The balance depends on how often a
prefix is shared and where prompts part, so two workloads of another form are measured:

  documents  RAG: documents of 1,000 to 2,000 tokens (lengths vary), each asked 4 different
             questions. The first request of a document is a miss; the others share the
             document and part at a point that is rarely a multiple of anything.
  system     one 3,000-token system prompt with few-shot examples, shared by 16 requests that each
             append 200 to 600 tokens of their own: one miss, then hits that part at one fixed point.

and two models of another kind, at SmolLM2-135M's width (8 layers, random weights, fp32):

  qwen3_next Gated DeltaNet layers with one full-attention layer in four
  falcon_h1  Mamba2 SSM heads beside attention heads in every layer

Per setting: the mean time of a request (the miss and the hits, each a ``PrefixCache.prefill``
in one warm process), and the state bytes stored. A setting's regret is its cost over the
best setting's on that model and workload; the default is the one whose worst regret is least.
Writes state_every.json. Not a test: read the ratios, not the absolute times.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine  # noqa: E402

WIDTH = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=9,
             num_key_value_heads=3, max_position_embeddings=16384, tie_word_embeddings=True)


def build(family: str):
    import torch
    import transformers as tf

    torch.manual_seed(0)
    if family == "qwen3_next":
        cfg = tf.Qwen3NextConfig(**WIDTH, head_dim=64, linear_num_key_heads=3, linear_num_value_heads=6,
                                 linear_key_head_dim=64, linear_value_head_dim=64, num_experts=0,
                                 layer_types=["linear_attention", "linear_attention", "linear_attention",
                                              "full_attention"] * 2)
        return tf.Qwen3NextForCausalLM(cfg).eval()
    if family == "falcon_h1":
        cfg = tf.FalconH1Config(**WIDTH, head_dim=64, mamba_n_heads=12, mamba_d_head=64, mamba_d_ssm=768,
                                mamba_n_groups=1, mamba_d_state=64)
        return tf.FalconH1ForCausalLM(cfg).eval()
    raise SystemExit(f"unknown family {family}")


def workload(name: str, seed: int) -> list[list[int]]:
    """The requests of one workload, in order (token ids)."""
    rng = np.random.default_rng(seed)

    def tokens(n: int) -> list[int]:
        return rng.integers(10, 49000, n).tolist()

    if name == "documents":
        out = []
        for _ in range(2):
            doc = tokens(int(rng.integers(1000, 2000)))
            out += [doc + tokens(int(rng.integers(12, 40))) for _ in range(4)]
        return out
    if name == "system":
        system = tokens(3000)
        return [system + tokens(int(rng.integers(200, 600))) for _ in range(16)]
    raise SystemExit(f"unknown workload {name}")


def run(model, requests: list[list[int]], every: int) -> tuple[float, int]:
    """Mean seconds per request through a new PrefixCache on an empty store, and the state bytes stored."""
    from promptstore import PromptStore
    from promptstore.llm import PrefixCache, _prefix

    _prefix.STATE_EVERY_TOKENS = every
    folder = Path(tempfile.mkdtemp(prefix="ps-every-"))
    try:
        with PromptStore(folder, memory_bytes=0) as store:
            pc = PrefixCache(model, None, store=store)
            seconds = []
            for ids in requests:
                t0 = time.perf_counter()
                pc.prefill(ids)
                seconds.append(time.perf_counter() - t0)
            state_bytes = sum(i.size for i in store.ls() if i.kind == "llm.state")
        return statistics.mean(seconds), state_bytes
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", type=int, nargs="+", default=[128, 256, 512, 1024, 4096])
    parser.add_argument("--families", nargs="+", default=["qwen3_next", "falcon_h1"])
    parser.add_argument("--workloads", nargs="+", default=["documents", "system"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    info = machine()
    print(f"STATE_EVERY_TOKENS on {info['summary']}; {args.threads} threads, medians of {args.repeats}", flush=True)
    results: dict = {"machine": info, "every": args.every, "runs": {}}
    worst = dict.fromkeys(args.every, 0.0)
    for family in args.families:
        model = build(family)
        run(model, workload("documents", 99)[:2], 512)  # warm: first shapes, allocator
        for name in args.workloads:
            requests = workload(name, 0)
            rows = {}
            for _ in range(args.repeats):
                # Interleaved, so that drift in the machine's speed falls on every setting alike.
                for every in args.every:
                    seconds, state_bytes = run(model, requests, every)
                    rows.setdefault(every, {"seconds": [], "state MB": state_bytes / 1e6})["seconds"].append(seconds)
            best = min(statistics.median(v["seconds"]) for v in rows.values())
            out = {}
            for every, v in rows.items():
                median = statistics.median(v["seconds"])
                out[str(every)] = {"mean seconds per request": median, "regret": median / best - 1,
                                   "state MB": v["state MB"]}
                worst[every] = max(worst[every], median / best - 1)
                print(f"  {family:<10} {name:<9} every {every:>5}: {median * 1e3:7.1f} ms a request "
                      f"(+{100 * (median / best - 1):4.1f}% over the best), states {v['state MB']:.1f} MB", flush=True)
            results["runs"].setdefault(family, {})[name] = out
    choice = min(worst, key=lambda e: worst[e])
    results["worst regret"] = {str(e): w for e, w in worst.items()}
    results["least worst regret"] = choice
    print("worst regret per setting: " + ", ".join(f"{e}: +{100 * w:.1f}%" for e, w in worst.items())
          + f"; least: {choice}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "state_every.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
