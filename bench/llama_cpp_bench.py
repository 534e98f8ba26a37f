"""llama-cpp-python's disk prompt cache on the same GGUF and prompts as bench/llm_ttft.py, measured the same way.

    python bench/llama_cpp_bench.py [--lengths 2000 4000 8000] [--repeats 3] [--steady 3] [--install]

llama-cpp-python is not a dependency: `--install` runs `pip install llama-cpp-python`, which builds
llama.cpp from source (about 5 minutes on 2 cores). For each length: the cold prompt (its full
prefill), then, as for promptstore, a LlamaDiskCache warmed with document + one question, and per
repeat a fresh process that loads the model (not timed) and then times its first request (opening
the cache, loading the state, evaluating the new tokens, to the first token) and further steady-
state requests. Writes llama_cpp.json for bench/report.py.
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
from llm_ttft import QUESTIONS, WARM_QUESTION, prompt_ids  # noqa: E402

from _common import ttft_parser  # noqa: E402


def gguf_path() -> str:
    from promptstore.llm._model import _gguf_path

    return str(_gguf_path("smollm2-135m-instruct"))


def load(threads: int, length: int):
    """A context just big enough for the prompt: llama-cpp-python saves and loads the whole context's KV buffer
    as its cache state, so an oversized n_ctx would make every cache hit look worse than it is."""
    from llama_cpp import Llama

    return Llama(model_path=gguf_path(), n_ctx=min(8192, length + 256), n_threads=threads, n_batch=512, verbose=False)


def ttft(llm, ids: list[int], start: float | None = None) -> float:
    """Seconds to the first token through create_completion, which is where llama-cpp-python consults its
    cache, counted from ``start`` (default: the call). The context is reset first, so only the cache object
    (not the previous call's context) can help; the time a miss spends saving its state into the cache
    afterwards is not counted."""
    llm.reset()
    t0 = time.perf_counter() if start is None else start
    first = None

    for _chunk in llm.create_completion(ids, max_tokens=1, temperature=0.0, stream=True):
        first = time.perf_counter() - t0 if first is None else first
    return first if first is not None else time.perf_counter() - t0


def child(args: argparse.Namespace) -> None:
    """A fresh process: load the model (not timed), then the first request, then steady state."""
    from llama_cpp import LlamaDiskCache

    from promptstore.llm import load_model

    _, tok = load_model()
    llm = load(args.threads, args.length)
    ttft(llm, prompt_ids(tok, 64, "warm-up")[0][:8])  # one-time set-up belongs to loading, as for promptstore
    llm.set_cache(None)
    qs = QUESTIONS[: args.repeats + args.steady]
    order = [qs[args.index]] + qs[args.repeats :]
    times = []
    for i, q in enumerate(order):
        ids, _ = prompt_ids(tok, args.length, q)
        t0 = time.perf_counter()
        if i == 0:
            llm.set_cache(LlamaDiskCache(cache_dir=args.cache_dir))  # opening the cache is part of the request
        times.append(ttft(llm, ids, start=t0))
    print(json.dumps({"first": times[0], "steady": times[1:]}))


def main() -> None:
    parser = ttft_parser(__doc__)
    parser.set_defaults(lengths=[2000, 4000, 8000])
    parser.add_argument("--steady", type=int, default=3)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--install", action="store_true")
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        if not args.install:
            print("llama-cpp-python is not installed; run with --install (builds llama.cpp from source, ~5 min)")
            return
        print("installing llama-cpp-python (builds llama.cpp from source: about 5 minutes on 2 cores)...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "llama-cpp-python"], check=True)
    import llama_cpp
    from llama_cpp import LlamaDiskCache

    from promptstore.llm import load_model

    _, tok = load_model()
    results = {"version": llama_cpp.__version__, "rows": {}}
    for length in args.lengths:
        llm = load(args.threads, length)
        ttft(llm, prompt_ids(tok, 64, "warm-up")[0][:8])  # first call pays one-time setup
        cold = []
        for q in QUESTIONS[: args.repeats]:
            llm.set_cache(None)
            cold.append(ttft(llm, prompt_ids(tok, length, q)[0]))
        row = {"cold prompt": statistics.median(cold)}
        first, steady = [], []
        for r in range(args.repeats):
            cache_dir = tempfile.mkdtemp(prefix="ps-llamacpp-")
            try:
                llm.set_cache(LlamaDiskCache(cache_dir=cache_dir))
                ttft(llm, prompt_ids(tok, length, WARM_QUESTION)[0])  # warm: document + one question, saved after
                llm.set_cache(None)
                proc = subprocess.run([sys.executable, __file__, "--child", "--cache-dir", cache_dir, "--length",
                                       str(length), "--repeats", str(args.repeats), "--steady", str(args.steady),
                                       "--index", str(r), "--threads", str(args.threads)],
                                      capture_output=True, text=True)
                if proc.returncode:
                    raise SystemExit(f"child failed:\n{proc.stderr[-3000:]}")
                res = json.loads(proc.stdout.strip().splitlines()[-1])
            finally:
                shutil.rmtree(cache_dir, ignore_errors=True)
            first.append(res["first"])
            steady.extend(res["steady"])
        row["disk cache, first request (fresh process)"] = statistics.median(first)
        row["disk cache, steady state"] = statistics.median(steady)
        results["rows"][str(length)] = row
        print(f"  llama.cpp {length:>5}: cold {row['cold prompt']:.3f}s | disk cache first request "
              f"{row['disk cache, first request (fresh process)']:.3f}s | steady {row['disk cache, steady state']:.3f}s",
              flush=True)
        del llm
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "llama_cpp.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
