"""Where a restarted vLLM engine's first request goes: the connector's own work, and vLLM's first use.

    python bench/vllm_restart_parts.py [--length 8000] [--dtype bfloat16] [--restarts 4]
                                       [--vllm-python PATH] [--out bench/results/vllm_restart_parts.json]

Runs with the main venv's Python; every engine runs in a fresh process of vLLM's venv (``make vllm-venv``;
default ``$PROMPTSTORE_VLLM_PYTHON``), SmolLM2-135M-Instruct, ``enforce_eager``, ``max_tokens=1``, greedy, as
``bench/vllm_bench.py`` runs them. One document plus a question is stored by an engine with the connector;
then, for each of vLLM's two engine layouts (its default, the engine core in a process of its own; and
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, everything in the caller's process):

  vLLM alone        a fresh engine without the connector: the document cold, then two other questions on
                    it (its own prefix cache): the first hit of the engine and the one after it
  restarted         ``--restarts`` fresh engines with the connector on the stored folder: another question
                    (served from the store: the first request of a restarted engine), then a third one
                    (vLLM's own prefix cache, in that engine)

In the in-process layout the connector's methods and the store's reads are timed inside the engine (the
connector's own work: loading the blocks into vLLM's pages, the check of the last served token, the
scheduler's lookup); in the default layout they run in the engine core's process, and only the requests
are timed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "tests"))
from _common import machine, save_results  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=8000)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--restarts", type=int, default=4, help="fresh engines with the connector, per layout")
    parser.add_argument("--vllm-python", default=os.environ.get("PROMPTSTORE_VLLM_PYTHON"))
    parser.add_argument("--out", default=str(BENCH / "results" / f"vllm_restart_parts_{time.strftime('%Y-%m-%d')}.json"))
    args = parser.parse_args()
    from vllm_bench import QUESTIONS, documents, prepare, run_engine, settle

    tokenizer, model, work, site = prepare(args, "vllm-parts-")
    stored, asked = documents(tokenizer, args.length, 1)[0]
    third = asked[: len(asked) - len(tokenizer(QUESTIONS[1])["input_ids"])] + tokenizer(
        "\nQuestion: What is parked in bay C?\nAnswer:")["input_ids"]
    folder = work / "store"
    rows: list[dict] = []
    try:
        run_engine(args, str(site), model, args.dtype, [stored], {"path": str(folder)})
        settle(folder)
        for in_process in (False, True):
            layout = "in-process" if in_process else "default"
            alone = run_engine(args, str(site), model, args.dtype, [stored, asked, third], None, in_process=in_process)
            rows.append({"layout": layout, "engine": "vLLM alone", "cold_s": alone[0]["s"], "first_s": alone[1]["s"],
                         "then_s": alone[2]["s"], "tokens": [r["token"] for r in alone[1:]]})
            for _ in range(args.restarts):
                got = run_engine(args, str(site), model, args.dtype, [asked, third], {"path": str(folder)},
                                 in_process=in_process)
                rows.append({"layout": layout, "engine": "restarted", "first_s": got[0]["s"], "then_s": got[1]["s"],
                             "served": got[0]["cached"], "parts": got[0].get("parts") or {},
                             "tokens": [r["token"] for r in got]})
            save_results(args.out, args.restarts, rows, machine())
            first = [r["first_s"] for r in rows if r["layout"] == layout and r["engine"] == "restarted"]
            print(f"{layout}: vLLM alone first hit {alone[1]['s']:.3f} s, then {alone[2]['s']:.3f} s; restarted first "
                  f"{statistics.median(first):.3f} s ({' / '.join(f'{x:.3f}' for x in sorted(first))})", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
