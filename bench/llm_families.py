"""PrefixCache across attention families, at SmolLM2-135M's size: full, sliding-window, latent (MLA), linear-attention hybrid.

    python bench/llm_families.py [--lengths 2000 8000] [--repeats 3] [--threads 2] [--out bench/out]

One model per family, built from a config at SmolLM2-135M's dimensions (30 layers, hidden 576,
vocabulary 49,152) with random weights (shapes and cost are real), saved once and loaded from
files as a user loads a model:

  llama      every layer full attention (SmolLM2's own architecture)
  mistral    every layer a 4,096-token sliding window
  gemma2     sliding (1,024 tokens) and full layers alternating
  minicpm3   multi-head latent attention: keys and values of different widths
  qwen3_next Gated DeltaNet (linear attention, a running state) with a full-attention layer in four

For each length, side by side in one run (medians):

  full prefill     the whole prompt in this process, the model warm
  miss + store     the document through a new PrefixCache on an empty store: the forward and storing
                   every block and state (what a miss costs over a plain prefill of the document)
  first request    a fresh process per repeat, after the model is loaded (not timed): build the
                   PrefixCache and ``generate(max_new_tokens=1)`` a document + a new question, after
                   another process prefilled the document alone and then the document + another
                   question. Fingerprints, lookup, KV load and forwards.
  floor            one forward over the question's tokens on the document's KV already in memory

Writes llm_families.json. Not a test: read the ratios, not the absolute times.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine  # noqa: E402

SMOL = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=16384, tie_word_embeddings=True)
QUESTION = 14


def build(family: str):
    """The family's model at SmolLM2's size (seed 0)."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    if family == "llama":
        cfg = tf.LlamaConfig(**SMOL, head_dim=64)
        return tf.LlamaForCausalLM(cfg)
    if family == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(**SMOL, head_dim=64, sliding_window=4096))
    if family == "gemma2":
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(**SMOL, head_dim=64, sliding_window=1024))
    if family == "qwen3_next":
        # Gated DeltaNet layers (a running state) with one full-attention layer in four, dense MLPs.
        cfg = tf.Qwen3NextConfig(**SMOL, head_dim=64, linear_num_key_heads=3, linear_num_value_heads=6,
                                 linear_key_head_dim=64, linear_value_head_dim=64, num_experts=0,
                                 layer_types=["linear_attention", "linear_attention", "linear_attention",
                                              "full_attention"] * 7 + ["linear_attention", "full_attention"])
        return tf.Qwen3NextForCausalLM(cfg)
    if family == "minicpm3":
        cfg = tf.MiniCPM3Config(**{**SMOL, "num_key_value_heads": 9}, q_lora_rank=192, kv_lora_rank=128,
                                qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=48)
        return tf.MiniCPM3ForCausalLM(cfg)
    raise SystemExit(f"unknown family {family}")


FAMILIES = ("llama", "mistral", "gemma2", "minicpm3", "qwen3_next")


def prompt(length: int, seed: int) -> tuple[list[int], int]:
    import numpy as np

    doc = np.random.default_rng(0).integers(10, 49000, length - QUESTION - 9).tolist()  # never block-aligned
    return doc + np.random.default_rng(100 + seed).integers(10, 49000, QUESTION).tolist(), len(doc)


def load(folder: Path):
    import torch
    from transformers import AutoModelForCausalLM

    from promptstore.llm._model import _make_resident, _warm_up

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    _make_resident(model)
    _warm_up(model)
    return model


def child(args: argparse.Namespace) -> None:
    """A fresh process: load the model (not timed), then one request, as a user makes it."""
    import torch

    torch.set_num_threads(args.threads)
    from promptstore import PromptStore
    from promptstore.llm import PrefixCache

    model = load(Path(args.model))
    ids, _ = prompt(args.length, args.index)
    t0 = time.perf_counter()
    with PromptStore(args.store) as store:
        pc = PrefixCache(model, None, store=store)
        out = pc.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
        seconds = time.perf_counter() - t0
        print(json.dumps({"seconds": seconds, "served": pc.stats["last"]["served"], "token": int(out[0, -1])}))


def run_child(args: argparse.Namespace, model: Path, store: Path, length: int, index: int) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", str(model), "--store", str(store), "--length", str(length),
           "--index", str(index), "--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(args: argparse.Namespace, family: str, folder: Path) -> dict:
    import torch

    from promptstore import PromptStore
    from promptstore.llm import PrefixCache

    model = load(folder)
    arg = "cache" if "cache" in __import__("inspect").signature(model.forward).parameters else "past_key_values"
    rows = {}
    for length in args.lengths:
        full, miss, floor, first, diffs, plain_doc = [], [], [], [], [], []
        for r in range(args.repeats):
            ids, n_doc = prompt(length, r)
            t0 = time.perf_counter()
            with torch.no_grad():
                want = model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1]
            full.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with torch.no_grad():
                model(torch.tensor([ids[:n_doc]]), logits_to_keep=1)
            plain_doc.append(time.perf_counter() - t0)
            store_dir = Path(tempfile.mkdtemp(prefix="ps-fam-"))
            try:
                with PromptStore(store_dir) as store:
                    pc = PrefixCache(model, None, store=store)
                    t0 = time.perf_counter()
                    pc.prefill(ids[:n_doc])  # the document alone (a state model stores its state where it ends)
                    miss.append(time.perf_counter() - t0)
                    pc.prefill(ids[:n_doc] + prompt(length, 99)[0][n_doc:])  # then another question after it
                    cache, n = pc.lookup(ids)
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        got = model(torch.tensor([ids[n:]]), use_cache=True, logits_to_keep=1, **{arg: cache})
                    floor.append(time.perf_counter() - t0)
                    diffs.append(float((got.logits[0, -1] - want).abs().max()))
                    del cache, got, pc
                res = run_child(args, folder, store_dir, length, r)
                first.append(res["seconds"])
                assert res["token"] == int(want.argmax()), (family, length, "first token differs")
                assert res["served"] >= n_doc - 64, res
            finally:
                shutil.rmtree(store_dir, ignore_errors=True)
        row = {"tokens": length, "full prefill": statistics.median(full), "miss + store": statistics.median(miss),
               "first request (fresh process, generate)": statistics.median(first), "floor": statistics.median(floor),
               "max |score diff| (in process)": max(diffs)}
        row["speed-up, first request"] = row["full prefill"] / row["first request (fresh process, generate)"]
        row["first request / floor"] = row["first request (fresh process, generate)"] / row["floor"]
        row["document prefill"] = statistics.median(plain_doc)
        row["miss + store / document prefill"] = row["miss + store"] / row["document prefill"]
        rows[str(length)] = row
        print(f"  {family:<9} {length:>5} tokens: full {row['full prefill']:.2f}s | miss+store {row['miss + store']:.2f}s "
              f"({row['miss + store / document prefill']:.2f}x the plain prefill) | first request {row['first request (fresh process, generate)']:.3f}s "
              f"({row['speed-up, first request']:.1f}x faster, {row['first request / floor']:.2f}x the floor "
              f"{row['floor']:.3f}s) | diff {row['max |score diff| (in process)']:.1e}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2000, 8000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    import torch

    torch.set_num_threads(args.threads)
    info = machine()
    print(f"PrefixCache across families on {info['summary']}; SmolLM2-135M dimensions, random weights, fp32, "
          f"{args.threads} threads, {args.repeats} repeats", flush=True)
    # Rows are added to what earlier runs wrote (one family or length at a time fits a session), each
    # with the repeats it was measured with, and written as soon as a family is done.
    path = args.out / "llm_families.json"
    results = json.loads(path.read_text()) if path.exists() else {"machine": info, "families": {}}
    root = Path(tempfile.mkdtemp(prefix="ps-fam-models-"))
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        for family in args.families:
            folder = root / family
            build(family).save_pretrained(folder)
            rows = measure(args, family, folder)
            for row in rows.values():
                row["repeats"] = args.repeats
            results["families"].setdefault(family, {}).update(rows)
            path.write_text(json.dumps(results, indent=2))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
