"""LLM prefix reuse: time to first token (TTFT) with SmolLM2-135M-Instruct on this machine.

    python bench/llm_ttft.py [--lengths 512 2000 4000] [--repeats 3] [--out bench/out]

For each shared prefix (a long document) plus a short question, side by side in one run:
  full prefill           transformers, the whole prompt every time
  deepcopy (seed)        prefill the prefix once in process, deepcopy its DynamicCache per question
  promptstore memory     PrefixCache hit from the memory tier (this process)
  promptstore disk       PrefixCache hit from the disk tier, in a fresh process (memory tier off)
Every TTFT is a median over questions not seen before; each cached run's next-token scores
are checked against the full prefill. Also reports KV load throughput (GB/s). Writes
llm_ttft.json and llm_ttft.png. Not a test: read the ratios, not the absolute times.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, ttft_parser  # noqa: E402

DOC = (
    "Warehouse operations manual. Section {i}. Forklifts are parked in bay C after each shift and are charged "
    "overnight. Pallets heavier than 800 kilograms are stored in aisle 4 on the ground racks only. Hazardous "
    "materials are kept in the fenced area near door 9, with the safety data sheets in the red binder. Incoming "
    "trucks are unloaded at docks 1 to 6 between 6 am and 2 pm; outgoing orders leave from docks 7 to 12. "
    "Every pick is scanned twice: once at the shelf and once at the packing table. "
)
QUESTIONS = ["Where are forklifts parked?", "Where do heavy pallets go?", "Which docks are for outgoing orders?",
             "Where are hazardous materials kept?", "How often is each pick scanned?", "When are trucks unloaded?",
             "Where is the red binder?", "What happens to forklifts overnight?", "Which aisle takes heavy pallets?",
             "Where are the safety data sheets?", "Which docks unload trucks?", "Where do orders leave from?"]


def prompt_ids(tokenizer, n_prefix: int, question: str) -> tuple[list[int], int]:
    text = "".join(DOC.format(i=i) for i in range(1, 200))
    prefix = tokenizer(text)["input_ids"][:n_prefix]
    return prefix + tokenizer(f"\n\nQuestion: {question}\nAnswer:")["input_ids"], len(prefix)


def ttft_prefix_cache(pc, ids) -> tuple[float, object]:
    t0 = time.perf_counter()
    _, logits = pc.prefill(ids)
    return time.perf_counter() - t0, logits


def child(args: argparse.Namespace) -> None:
    """A fresh process: load the model, then serve each question from the disk tier."""
    import torch

    from promptstore import PromptStore
    from promptstore.llm import PrefixCache, load_model

    torch.set_num_threads(args.threads)
    model, tok = load_model()
    pc = PrefixCache(model, tok, store=PromptStore(args.store, memory_bytes=0), block_tokens=args.block_tokens[0])
    pc.fingerprint  # computed once per model at start-up, like loading it  # noqa: B018
    times, loads, served = [], [], []
    for q in QUESTIONS[-args.repeats:]:
        ids, _ = prompt_ids(tok, args.length, q)
        t0 = time.perf_counter()
        cache, n = pc.lookup(ids)
        loads.append((time.perf_counter() - t0, n))
        dt, _ = ttft_prefix_cache(pc, ids)
        times.append(dt)
        served.append(pc.stats["last"]["served"])
    print(json.dumps({"ttft": times, "loads": loads, "served": served}))


def main() -> None:
    parser = ttft_parser(__doc__)
    parser.add_argument("--block-tokens", type=int, nargs="+", default=[64, 16])
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    import torch

    from promptstore import PromptStore
    from promptstore.llm import PrefixCache, load_model

    torch.set_num_threads(args.threads)
    model, tok = load_model()
    info = machine()
    print(f"LLM TTFT on {info['summary']}; SmolLM2-135M-Instruct fp32, {args.threads} threads, "
          f"block_tokens={args.block_tokens}, medians of {args.repeats}")
    results = {}
    for length in args.lengths:
        row: dict[str, float] = {}
        # full prefill (only the last position's scores are computed, as generate does)
        full, refs = [], {}
        for q in QUESTIONS[: args.repeats]:
            ids, n_prefix = prompt_ids(tok, length, q)
            t0 = time.perf_counter()
            with torch.no_grad():
                refs[q] = model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1]
            full.append(time.perf_counter() - t0)
        row["full prefill"] = statistics.median(full)
        row["tokens"] = len(ids)
        # the seed's deepcopy pattern: one prefix cache in process, copied per question
        with torch.no_grad():
            base = model(torch.tensor([ids[:n_prefix]]), use_cache=True, logits_to_keep=1)
        base_cache = base.cache if getattr(base, "cache", None) is not None else base.past_key_values
        arg = "cache" if "cache" in __import__("inspect").signature(model.forward).parameters else "past_key_values"
        dc = []
        for q in QUESTIONS[: args.repeats]:
            ids, _ = prompt_ids(tok, length, q)
            t0 = time.perf_counter()
            c = copy.deepcopy(base_cache)
            with torch.no_grad():
                logits = model(torch.tensor([ids[n_prefix:]]), use_cache=True, logits_to_keep=1, **{arg: c}).logits[0, -1]
            dc.append(time.perf_counter() - t0)
            assert (logits - refs[q]).abs().max().item() < 1e-3
        row["deepcopy (seed, in process)"] = statistics.median(dc)
        del base, base_cache
        for block in args.block_tokens:
            folder = Path(tempfile.mkdtemp(prefix="ps-llm-"))
            store = PromptStore(folder, memory_bytes="4GiB", disk_bytes="20GiB")
            pc = PrefixCache(model, tok, store=store, block_tokens=block)
            pc.fingerprint  # noqa: B018 - once per model, at start-up
            pc.prefill(ids[:n_prefix])  # cold: store the shared prefix
            mem, errs = [], []
            for q in QUESTIONS[: args.repeats]:  # the same questions as the full prefill: compare scores
                ids, _ = prompt_ids(tok, length, q)
                dt, logits = ttft_prefix_cache(pc, ids)
                mem.append(dt)
                errs.append((logits - refs[q]).abs().max().item())
            r = dict(row)
            r["promptstore memory"] = statistics.median(mem)
            r["served"] = pc.stats["last"]["served"]
            r["max |score diff|"] = max(errs)
            store.close()
            proc = subprocess.run([sys.executable, __file__, "--child", "--store", str(folder), "--length", str(length),
                                   "--repeats", str(args.repeats), "--threads", str(args.threads),
                                   "--block-tokens", str(block)], capture_output=True, text=True, check=True)
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            r["promptstore disk (fresh process)"] = statistics.median(res["ttft"])
            load_s, n = sorted(res["loads"])[len(res["loads"]) // 2]
            layers, heads, head_dim, _ = pc._get_layout()
            r["kv load GB/s"] = n * layers * heads * head_dim * 2 * 4 / load_s / 1e9
            r["block_tokens"] = block
            results[f"{length}/{block}"] = r
            print(f"  {length:>5} tokens, blocks of {block:>3}: full {r['full prefill']:.3f}s | deepcopy "
                  f"{r['deepcopy (seed, in process)']:.3f}s | memory {r['promptstore memory']:.3f}s | disk "
                  f"{r['promptstore disk (fresh process)']:.3f}s | KV load {r['kv load GB/s']:.2f} GB/s | served "
                  f"{r['served']} | max diff {r['max |score diff|']:.1e}", flush=True)
            shutil.rmtree(folder, ignore_errors=True)
    write(results, info, args)


def write(results: dict, info: dict, args: argparse.Namespace) -> None:
    cols = ["full prefill", "deepcopy (seed, in process)", "promptstore memory", "promptstore disk (fresh process)"]
    lines = ["| prefix tokens | block | prompt tokens | served | " + " | ".join(f"{c} TTFT" for c in cols)
             + " | disk speed-up vs full | KV load GB/s | max score diff |",
             "|---:|---:|---:|---:|" + "---:|" * len(cols) + "---:|---:|---:|"]
    for key, r in results.items():
        length = key.split("/")[0]
        lines.append(f"| {length} | {r['block_tokens']} | {r['tokens']} | {r['served']} | "
                     + " | ".join(f"{r[c] * 1000:.0f} ms" for c in cols)
                     + f" | {r['full prefill'] / r['promptstore disk (fresh process)']:.1f}x | {r['kv load GB/s']:.2f} | "
                     f"{r['max |score diff|']:.1e} |")
    table = "\n".join(lines)
    print()
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "llm_ttft.json").write_text(json.dumps({"machine": info, "args": {k: str(v) for k, v in vars(args).items()},
                                                        "results": results, "table": table}, indent=1))
    from report import ttft_plot

    ttft_plot({"results": results}, None, args.out / "llm_ttft.png")
    print(f"\nwrote {args.out / 'llm_ttft.json'} and {args.out / 'llm_ttft.png'}")


if __name__ == "__main__":
    main()
