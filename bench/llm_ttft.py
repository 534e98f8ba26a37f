"""LLM prefix reuse: time to first token (TTFT) with SmolLM2-135M-Instruct, as a user sees it.

    python bench/llm_ttft.py [--lengths 2000 4000 8000] [--repeats 3] [--steady 3] [--out bench/out]

Prompts are a document plus a question: the document is cut to ``length - 23`` tokens (never a
multiple of the block size) and the questions differ in length. For each length, side by side:

  full prefill        transformers over the whole prompt (the model warm, in this process)
  floor               one forward over the tokens a hit leaves uncached, on a cache of the others
                      already in memory (this process): the least any hit can cost
  deepcopy (seed)     the document prefilled once in process, its DynamicCache deep-copied per question
  first request       a fresh process per repeat: after the model is loaded (not timed), open the
                      store, build the PrefixCache and call it on document + a new question, once
                      through ``generate(max_new_tokens=1)`` and once (another process) through
                      ``prefill``. Everything the user waits for after model load is timed:
                      fingerprint, lookup, KV load, forward.
  steady state        further new questions in that same process, through the same call

The store was warmed beforehand by another process that prefilled document + one question, so
each request reuses the document's KV (token-granular: full blocks and the stored tail). Every
TTFT is a median; each cached run's next-token scores (prefill) or token (generate) are compared
with the full prefill's. KV load GB/s is the KV bytes served over the time spent reading blocks
into the request's buffers (files to final buffers, checksums included; the fingerprint is not).
Peak memory is the first request's growth of the process's peak RSS over the loaded model's,
against the KV's own size. Writes llm_ttft.json and llm_ttft.png. Not a test: read the ratios,
not the absolute times.
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
QUESTIONS = ["Where are forklifts parked?", "Where do heavy pallets go, and which racks take them?",
             "Which docks are for outgoing orders?", "Where are hazardous materials kept?",
             "How often is each pick scanned, and where?", "When are trucks unloaded?", "Where is the red binder?",
             "What happens to forklifts overnight?", "Which aisle takes heavy pallets?",
             "Where are the safety data sheets?", "Which docks unload trucks?", "Where do orders leave from?"]
WARM_QUESTION = "Summarise the manual in one sentence."
# Where a request's time goes, in the order a request runs them (see child's Timed).
PHASES = ("identity", "buffers", "KV load", "lookup", "forward", "storing")


def prompt_ids(tokenizer, length: int, question: str) -> tuple[list[int], int]:
    """Document cut to ``length - 23`` tokens, then the question: (ids, document tokens)."""
    text = "".join(DOC.format(i=i) for i in range(1, 400))
    doc = tokenizer(text)["input_ids"][: length - 23]
    return doc + tokenizer(f"\n\nQuestion: {question}\nAnswer:")["input_ids"], len(doc)


def questions(args: argparse.Namespace) -> list[str]:
    return QUESTIONS[: args.repeats + args.steady]


def child(args: argparse.Namespace) -> None:
    """A fresh process: load the model (not timed), then the first request, then steady state."""
    import torch

    torch.set_num_threads(args.threads)
    from promptstore import PromptStore
    from promptstore.llm import PrefixCache, load_model

    phases: dict[str, float] = {}
    stack: list[list] = []

    def timed(name: str, fn):
        """``fn``, its seconds added to ``phases[name]``, less the time of timed calls inside it."""

        def wrapper(*a, **k):
            stack.append([0.0])
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent = time.perf_counter() - t0
                inner = stack.pop()[0]
                phases[name] = phases.get(name, 0.0) + spent - inner
                if stack:
                    stack[-1][0] += spent
        return wrapper

    class Timed(PrefixCache):
        """Records, per request, the seconds spent reading KV blocks and the tokens served (for GB/s),
        and where the request's time goes (``phases``)."""

        loads: list[tuple[float, int]] = []
        reading = 0.0

        def _lookup(self, ids):
            self.reading = 0.0
            out = timed("lookup", super()._lookup)(ids)
            self.loads.append((self.reading, out[1]))
            return out

        def _read_blocks(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return timed("KV load", super()._read_blocks)(*args, **kwargs)
            finally:
                self.reading += time.perf_counter() - t0

        def _refresh_layout(self):
            return timed("identity", super()._refresh_layout)()

        def _root_key(self):
            return timed("identity", super()._root_key)()

        def _allocate(self, capacity):
            return timed("buffers", super()._allocate)(capacity)

        def _store_blocks(self, *args, **kwargs):
            return timed("storing", super()._store_blocks)(*args, **kwargs)

        def _run(self, *args, **kwargs):
            return timed("forward", super()._run)(*args, **kwargs)

    model, tok = load_model()
    # model.generate is not wrapped: a patched model is another live identity (its keys would differ from
    # the warming process's), so a request's forward is what the timed phases leave.
    # The peak since here (Linux: writing 5 to clear_refs resets VmHWM to the current RSS), so that
    # the model's own loading peak does not hide the request's.
    Path("/proc/self/clear_refs").write_text("5")
    loaded_rss = _status_kib("VmRSS") * 1024
    qs = questions(args)
    order = [qs[args.index]] + [q for q in qs[args.repeats :]]  # this repeat's first question, then steady ones
    prompts = [prompt_ids(tok, args.length, q)[0] for q in order]
    if args.warm:
        with PromptStore(args.store) as store:
            Timed(model, tok, store=store).prefill(prompt_ids(tok, args.length, WARM_QUESTION)[0])
        print(json.dumps({}))
        return
    times, logits = [], []
    t0 = time.perf_counter()
    store = PromptStore(args.store)
    pc = Timed(model, tok, store=store)
    for i, ids in enumerate(prompts):
        if i:
            t0 = time.perf_counter()
        if args.call == "generate":
            out = pc.generate(ids, max_new_tokens=1, do_sample=False)
            times.append(time.perf_counter() - t0)
            logits.append(int(out[0, -1]))
        else:
            _, scores = pc.prefill(ids)
            times.append(time.perf_counter() - t0)
            logits.append(scores.tolist())
        if i == 0:
            first_rss = _status_kib("VmHWM") * 1024
            served = pc.stats["last"]["served"]
            first_phases = dict(phases)
            first_phases["forward"] = first_phases.get("forward", 0.0) + times[0] - sum(phases.values())
    layers, heads, k_dim, v_dim, _ = pc.engine.layout()
    per_token = layers * heads * (k_dim + v_dim) * 4
    store.close()
    print(json.dumps({"first": times[0], "steady": times[1:], "questions": order, "logits": logits,
                      "served": pc.stats["last"]["served"], "computed": pc.stats["last"]["computed"],
                      "loads": [(s, n * per_token) for s, n in pc.loads],
                      "peak growth": first_rss - loaded_rss, "kv bytes": served * per_token,
                      "phases": first_phases}))


def _status_kib(field: str) -> int:
    """A field of /proc/self/status, in KiB (VmRSS: resident now, VmHWM: the peak)."""
    import re

    return int(re.search(rf"^{field}:\s+(\d+)", Path("/proc/self/status").read_text(), re.M).group(1))


def run_child(args: argparse.Namespace, folder: Path, length: int, index: int = 0, warm: bool = False,
              call: str = "prefill") -> dict:
    cmd = [sys.executable, __file__, "--child", "--store", str(folder), "--length", str(length), "--index", str(index),
           "--repeats", str(args.repeats), "--steady", str(args.steady), "--threads", str(args.threads), "--call", call]
    proc = subprocess.run(cmd + (["--warm"] if warm else []), capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = ttft_parser(__doc__)
    parser.set_defaults(lengths=[2000, 4000, 8000])
    parser.add_argument("--steady", type=int, default=3, help="steady-state questions per fresh process")
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--call", choices=("prefill", "generate"), default="prefill", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    import torch

    from promptstore.llm import load_model

    torch.set_num_threads(args.threads)
    model, tok = load_model()
    arg = "cache" if "cache" in __import__("inspect").signature(model.forward).parameters else "past_key_values"
    info = machine()
    print(f"LLM TTFT on {info['summary']}; SmolLM2-135M-Instruct fp32, {args.threads} threads, "
          f"{args.repeats} fresh processes x (1 first request + {args.steady} steady)", flush=True)
    results = {}
    for length in args.lengths:
        row: dict = {}
        qs = questions(args)
        full, refs = [], {}
        for q in qs:
            ids, n_doc = prompt_ids(tok, length, q)
            t0 = time.perf_counter()
            with torch.no_grad():
                refs[q] = model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1]
            full.append(time.perf_counter() - t0)
        row["full prefill"] = statistics.median(full)
        row["tokens"] = len(ids)
        row["document tokens"] = n_doc
        # The seed's pattern: the document prefilled once in process, deep-copied per question.
        with torch.no_grad():
            base = model(torch.tensor([ids[:n_doc]]), use_cache=True, logits_to_keep=1)
        base_cache = base.cache if getattr(base, "cache", None) is not None else base.past_key_values
        dc = []
        for q in qs:
            ids, _ = prompt_ids(tok, length, q)
            t0 = time.perf_counter()
            c = copy.deepcopy(base_cache)
            with torch.no_grad():
                out = model(torch.tensor([ids[n_doc:]]), use_cache=True, logits_to_keep=1, **{arg: c}).logits[0, -1]
            dc.append(time.perf_counter() - t0)
            assert (out - refs[q]).abs().max().item() < 1e-3
        row["deepcopy (seed, in process)"] = statistics.median(dc)
        del c
        # One warm store per length (another process prefilled document + one question); each
        # fresh process gets its own copy, so that what one stores never serves the next.
        warm = Path(tempfile.mkdtemp(prefix="ps-llm-warm-"))
        run_child(args, warm, length, warm=True)
        for call in ("generate", "prefill"):
            first, steady, loads_first, loads_steady, diffs, growth, phases = [], [], [], [], [], [], []
            for r in range(args.repeats):
                folder = Path(tempfile.mkdtemp(prefix="ps-llm-")) / "store"
                try:
                    shutil.copytree(warm, folder)
                    res = run_child(args, folder, length, index=r, call=call)
                finally:
                    shutil.rmtree(folder.parent, ignore_errors=True)
                first.append(res["first"])
                steady.extend(res["steady"])
                loads_first.append(res["loads"][0])
                loads_steady.extend(res["loads"][1:])
                growth.append((res["peak growth"], res["kv bytes"]))
                phases.append(res["phases"])
                for q, got in zip(res["questions"], res["logits"], strict=True):
                    if call == "generate":
                        assert got == int(refs[q].argmax()), (length, q, "first token differs from a full prefill's")
                    else:
                        diffs.append((torch.tensor(got) - refs[q]).abs().max().item())
                row["served"], row["computed"] = res["served"], res["computed"]
            row[f"first request (fresh process, {call})"] = statistics.median(first)
            row[f"steady state ({call})"] = statistics.median(steady)
            row[f"kv load GB/s, first ({call})"] = statistics.median(b / s / 1e9 for s, b in loads_first)
            row[f"kv load GB/s, steady ({call})"] = statistics.median(b / s / 1e9 for s, b in loads_steady)
            row[f"peak RSS growth / KV bytes ({call})"] = statistics.median(g / max(b, 1) for g, b in growth)
            # Where the first request's time went: each phase's median over the fresh processes.
            row[f"phases, first ({call})"] = {name: statistics.median(p.get(name, 0.0) for p in phases)
                                              for name in PHASES}
            if diffs:
                row["max |score diff|"] = max(diffs)
        shutil.rmtree(warm, ignore_errors=True)
        # The floor: one forward over what a hit leaves uncached, on a cache of what it serves already in
        # memory (the document and the start of the question template both prompts share), cropped back
        # after each question instead of copied.
        served = row["served"]
        ids, _ = prompt_ids(tok, length, qs[0])
        print(f"  {length:>5} tokens: a hit served {served} (document {n_doc})", flush=True)
        if served > n_doc:
            with torch.no_grad():
                model(torch.tensor([ids[n_doc:served]]), use_cache=True, logits_to_keep=1, **{arg: base_cache})
        elif served < n_doc:
            base_cache.crop(served)
        floor = []
        for q in qs:
            ids, _ = prompt_ids(tok, length, q)
            t0 = time.perf_counter()
            with torch.no_grad():
                model(torch.tensor([ids[served:]]), use_cache=True, logits_to_keep=1, **{arg: base_cache})
            floor.append(time.perf_counter() - t0)
            base_cache.crop(served - base_cache.get_seq_length())  # a negative count: the tokens to remove
        row["floor"] = statistics.median(floor)
        del base, base_cache
        # Compatibility with report.py's headline and plot (prefill's figures, as before).
        row["first request (fresh process)"] = row["first request (fresh process, prefill)"]
        row["steady state"] = row["steady state (prefill)"]
        row["kv load GB/s, first"] = row["kv load GB/s, first (prefill)"]
        row["kv load GB/s, steady"] = row["kv load GB/s, steady (prefill)"]
        results[str(length)] = row
        g, pf = row["first request (fresh process, generate)"], row["first request (fresh process, prefill)"]
        print(f"  {length:>5} tokens: full {row['full prefill']:.3f}s | floor {row['floor'] * 1e3:.0f} ms | first request "
              f"generate {g * 1e3:.0f} ms ({g / row['floor']:.2f}x the floor, {row['full prefill'] / g:.1f}x faster than "
              f"full), prefill {pf * 1e3:.0f} ms ({pf / row['floor']:.2f}x) | steady generate "
              f"{row['steady state (generate)'] * 1e3:.0f} ms ({row['steady state (generate)'] / row['floor']:.2f}x) | "
              f"KV load {row['kv load GB/s, first (generate)']:.2f} / {row['kv load GB/s, steady (generate)']:.2f} GB/s | "
              f"peak RSS {row['peak RSS growth / KV bytes (generate)']:.2f}x the KV | computed {row['computed']} | "
              f"max diff {row['max |score diff|']:.1e}", flush=True)
    write(results, info, args)


def write(results: dict, info: dict, args: argparse.Namespace) -> None:
    lines = ["| prompt tokens | computed | full prefill | floor | **first request, fresh process: generate** | prefill "
             "| steady state: generate | prefill | first request (generate) / floor | steady (generate) / floor "
             "| first request vs full | KV load GB/s first / steady | peak RSS growth / KV | max score diff |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results.values():
        f, fl = r["full prefill"], r["floor"]
        g, p = r["first request (fresh process, generate)"], r["first request (fresh process, prefill)"]
        sg, sp = r["steady state (generate)"], r["steady state (prefill)"]
        lines.append(f"| {r['tokens']:,} | {r['computed']} | {f * 1000:,.0f} ms | {fl * 1000:.0f} ms | **{g * 1000:.0f} ms** "
                     f"| {p * 1000:.0f} ms | {sg * 1000:.0f} ms | {sp * 1000:.0f} ms | **{g / fl:.2f}x** | {sg / fl:.2f}x "
                     f"| {f / g:.1f}x | {r['kv load GB/s, first (generate)']:.2f} / {r['kv load GB/s, steady (generate)']:.2f} "
                     f"| {r['peak RSS growth / KV bytes (generate)']:.2f}x | {r['max |score diff|']:.1e} |")
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
