"""What a verified hit costs: the first request of a fresh process with the check on and off, side by side.

    python bench/verify_cost.py [--lengths 2000 4000] [--repeats 3] [--out bench/results/verify_cost.json]

A warming process prefills the document plus one question; then, per repeat, two fresh
processes (check on, check off, in alternating order, each on its own copy of the warmed store)
each load SmolLM2 (not timed), build a
PrefixCache and call ``generate(max_new_tokens=1)`` on the document plus a new question (the
first request), then two more questions (steady state). Medians over repeats; the greedy token
of both must agree. The check adds VERIFY_POSITIONS query tokens in one forward of its own.
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
from _common import save_results  # noqa: E402
from llm_ttft import QUESTIONS, WARM_QUESTION, prompt_ids  # noqa: E402


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from promptstore import PromptStore
    from promptstore.llm import PrefixCache, load_model

    model, tok = load_model()
    with PromptStore(args.store) as store:
        if args.warm:
            PrefixCache(model, tok, store=store).prefill(prompt_ids(tok, args.length, WARM_QUESTION)[0])
            print(json.dumps({}))
            return
        qs = [QUESTIONS[args.index], *QUESTIONS[-2:]]
        prompts = [prompt_ids(tok, args.length, q)[0] for q in qs]
        times, tokens = [], []
        t0 = time.perf_counter()
        pc = PrefixCache(model, tok, store=store, verify=args.verify == "on")
        for i, ids in enumerate(prompts):
            if i:
                t0 = time.perf_counter()
            out = pc.generate(ids, max_new_tokens=1, do_sample=False)
            times.append(time.perf_counter() - t0)
            tokens.append(int(out[0, -1]))
        print(json.dumps({"first": times[0], "steady": times[1:], "tokens": tokens,
                          "served": pc.stats["last"]["served"], "verified": pc.stats["total"]["verified"],
                          "refuted": pc.stats["total"]["refuted"]}))


def run(args: argparse.Namespace, folder: Path, length: int, verify: str, index: int = 0, warm: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--child", "--store", str(folder), "--length", str(length), "--index", str(index),
           "--verify", verify, "--threads", str(args.threads)] + (["--warm"] if warm else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2000, 4000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench/results/verify_cost.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--verify", choices=("on", "off"), default="on", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    rows = []
    for length in args.lengths:
        folder = Path(tempfile.mkdtemp(prefix="verify-cost-"))
        try:
            run(args, folder / "warm", length, "on", warm=True)
            got: dict[str, list[dict]] = {"on": [], "off": []}
            for r in range(args.repeats):
                for verify in (("on", "off") if r % 2 == 0 else ("off", "on")):
                    # Each child starts from the same warmed store: what one child stores (its questions'
                    # blocks) must not serve the next one more than the first.
                    child_store = folder / f"{verify}-{r}"
                    shutil.copytree(folder / "warm", child_store)
                    got[verify].append(run(args, child_store, length, verify, index=r))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        first = {v: statistics.median(x["first"] for x in got[v]) for v in got}
        steady = {v: statistics.median(s for x in got[v] for s in x["steady"]) for v in got}
        same = all(a["tokens"] == b["tokens"] for a, b in zip(got["on"], got["off"], strict=True))
        row = {"length": length, "first_on_s": first["on"], "first_off_s": first["off"],
               "first_ratio": first["on"] / first["off"], "steady_on_s": steady["on"], "steady_off_s": steady["off"],
               "steady_ratio": steady["on"] / steady["off"], "same_tokens": same,
               "refuted": sum(x["refuted"] for x in got["on"]), "verified": sum(x["verified"] for x in got["on"]),
               "served": got["on"][0]["served"]}
        rows.append(row)
        print(f"{length:>6} tokens  first request {first['on'] * 1e3:7.1f} ms checked vs {first['off'] * 1e3:7.1f} ms "
              f"unchecked ({row['first_ratio']:.3f}x)  steady {steady['on'] * 1e3:7.1f} vs {steady['off'] * 1e3:7.1f} ms "
              f"({row['steady_ratio']:.3f}x)  same tokens: {same}  refuted {row['refuted']}/{row['verified']}", flush=True)
    save_results(args.out, args.repeats, rows)


if __name__ == "__main__":
    main()
