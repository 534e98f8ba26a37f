"""Run every benchmark in one go into bench/out/, then rebuild BENCHMARKS.md (what `make bench` does).

    python bench/run_all.py [--llama-cpp] [--quick]

BENCHMARKS.md is built from the committed results in bench/results/ only: this run's files reach it once
moved there under dated names and named in bench/report.py's RESULTS (docs/benchmarks.md, "Adding a run").
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent


def run(*args: str) -> None:
    print(f"\n$ python {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, *args], check=True, cwd=BENCH.parent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--llama-cpp", action="store_true", help="install and measure llama-cpp-python (~5 min build)")
    parser.add_argument("--quick", action="store_true", help="fewer repeats and sizes (a smoke run)")
    args = parser.parse_args()
    q = args.quick
    run("bench/store_bench.py", "--repeats", "3" if q else "7")
    run("bench/identity_cost.py", "--repeats", "10" if q else "40")
    run("bench/llm_ttft.py", "--lengths", *(["512", "2000"] if q else ["512", "2000", "4000", "8000"]))
    run("bench/llm_families.py", "--lengths", *(["2000"] if q else ["2000", "8000"]), "--repeats", "1" if q else "3")
    run("bench/state_every.py", "--repeats", "1" if q else "3")
    if args.llama_cpp:
        run("bench/llama_cpp_bench.py", "--install", "--lengths", *(["512", "2000"] if q else ["512", "2000", "4000", "8000"]))
    run("bench/vision_bench.py", *(["--only", "COCO", "--repeats", "3"] if q else []))
    run("bench/scaling_bench.py", "--max-entries", "10000" if q else "1000000")
    run("bench/report.py")
    out = sorted((BENCH / "out").glob("*.json"))
    print("\nThis run's results, not yet in BENCHMARKS.md (copy them into bench/results/ under dated names and point "
          "bench/report.py's RESULTS at them; docs/benchmarks.md, \"Adding a run\"):")
    print("\n".join(f"  {p.relative_to(BENCH.parent)}" for p in out) or "  (none)")


if __name__ == "__main__":
    main()
