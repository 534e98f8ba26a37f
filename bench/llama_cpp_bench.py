"""llama-cpp-python's prompt caches on the same GGUF and prompts as bench/llm_ttft.py, measured the same way.

    python bench/llama_cpp_bench.py [--lengths 2000 4000 8000] [--repeats 3] [--steady 3] [--install]

llama-cpp-python is the ``llamacpp`` extra (`make test` builds its wheel once); `--install` installs it
here. For each length, side by side: the cold prompt (its full prefill); the floor (what a hit
serves, the document and the question template's start, already in the context, and only the rest
evaluated: llama-cpp-python's own in-process reuse); then for each cache, llama-cpp-python's
``LlamaDiskCache`` and promptstore's ``LlamaCppCache`` on a disk folder, warmed with document + one question by this process, and per repeat a fresh process
that loads the model (not timed) and then times its first request through ``create_completion``
(opening the cache, finding and loading the state, evaluating the new tokens, to the first token)
and further steady-state requests (the context reset before each, so that only the cache can serve).
The warmed folder's size is each cache's entry size. Writes llama_cpp.json for bench/report.py.
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


def open_cache(kind: str, folder: str, llm, redis_url: str | None = None):
    """The cache a user would set: llama-cpp-python's disk cache, or promptstore's on a disk folder or on Redis
    (a store with no folder of its own: memory and Redis tiers only, as a second host would have)."""
    if kind == "disk cache":
        from llama_cpp import LlamaDiskCache

        return LlamaDiskCache(cache_dir=folder)
    from promptstore import PromptStore
    from promptstore.llm import LlamaCppCache

    if kind == "promptstore (redis)":
        return LlamaCppCache(llm, PromptStore(disk_bytes=0, redis_url=redis_url, redis_bytes="16GiB",
                                              redis_prefix=f"ps-bench-{Path(folder).name}:"))
    return LlamaCppCache(llm, PromptStore(folder))


CACHES = ("disk cache", "promptstore", "promptstore (redis)")


def folder_bytes(folder: str) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def child(args: argparse.Namespace) -> None:
    """A fresh process: load the model (not timed), then the first request, then steady state."""
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
            llm.set_cache(open_cache(args.cache, args.cache_dir, llm, args.redis_url))  # opening it is part of the request
        times.append(ttft(llm, ids, start=t0))
    print(json.dumps({"first": times[0], "steady": times[1:]}))


def main() -> None:
    parser = ttft_parser(__doc__)
    parser.set_defaults(lengths=[2000, 4000, 8000])
    parser.add_argument("--steady", type=int, default=3)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--install", action="store_true")
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    parser.add_argument("--cache", choices=CACHES, default="disk cache", help=argparse.SUPPRESS)
    parser.add_argument("--redis-url", help=argparse.SUPPRESS)
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
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "llama-cpp-python==0.3.36"], check=True)
    import llama_cpp

    from promptstore.llm import load_model

    from _common import RedisServer

    _, tok = load_model()
    results = {"version": llama_cpp.__version__, "rows": {}}
    server = RedisServer().start()  # a real redis-server on loopback, for LlamaCppCache's Redis tier
    redis_url = server.url
    try:
        measure_all(args, tok, results, redis_url)
    finally:
        server.stop()


def measure_all(args: argparse.Namespace, tok, results: dict, redis_url: str) -> None:
    """Every length; llama_cpp.json is written after each (an 8k length takes most of an hour on 2 cores)."""
    args.out.mkdir(parents=True, exist_ok=True)
    for length in args.lengths:
        llm = load(args.threads, length)
        ttft(llm, prompt_ids(tok, 64, "warm-up")[0][:8])  # first call pays one-time setup
        cold = []
        for q in QUESTIONS[: args.repeats]:
            llm.set_cache(None)
            cold.append(ttft(llm, prompt_ids(tok, length, q)[0]))
        row = {"cold prompt": statistics.median(cold)}
        # The floor: what a hit serves already in the context (llama-cpp-python keeps it between calls):
        # the document and the start of the question template that the warmed prompt shares.
        floor = []
        warm_ids = prompt_ids(tok, length, WARM_QUESTION)[0]
        for q in QUESTIONS[: args.repeats]:
            ids, _ = prompt_ids(tok, length, q)
            served = next(i for i, (a, b) in enumerate(zip(ids, warm_ids, strict=False)) if a != b)
            llm.reset()
            llm.eval(ids[:served])
            t0 = time.perf_counter()
            for _chunk in llm.create_completion(ids, max_tokens=1, temperature=0.0, stream=True):
                break
            floor.append(time.perf_counter() - t0)
        row["floor"] = statistics.median(floor)
        # llama-cpp-python's RAM cache lives in one process: it has a steady state only.
        from llama_cpp import LlamaRAMCache

        llm.set_cache(LlamaRAMCache(capacity_bytes=8 << 30))
        ttft(llm, prompt_ids(tok, length, WARM_QUESTION)[0])
        row["ram cache, steady state (in process)"] = statistics.median(
            ttft(llm, prompt_ids(tok, length, q)[0]) for q in QUESTIONS[args.repeats : args.repeats + args.steady])
        row["ram cache, state bytes"] = llm.cache.cache_size
        llm.set_cache(None)
        for cache in CACHES:
            first, steady, size = [], [], []
            for r in range(args.repeats):
                cache_dir = tempfile.mkdtemp(prefix="ps-llamacpp-")
                try:
                    llm.set_cache(open_cache(cache, cache_dir, llm, redis_url))
                    ttft(llm, prompt_ids(tok, length, WARM_QUESTION)[0])  # warm: document + one question, saved after
                    llm.set_cache(None)
                    size.append(folder_bytes(cache_dir))
                    proc = subprocess.run([sys.executable, __file__, "--child", "--cache-dir", cache_dir, "--length",
                                           str(length), "--repeats", str(args.repeats), "--steady", str(args.steady),
                                           "--index", str(r), "--threads", str(args.threads), "--cache", cache,
                                           "--redis-url", redis_url],
                                          capture_output=True, text=True)
                    if proc.returncode:
                        raise SystemExit(f"child failed:\n{proc.stderr[-3000:]}")
                    res = json.loads(proc.stdout.strip().splitlines()[-1])
                finally:
                    shutil.rmtree(cache_dir, ignore_errors=True)
                first.append(res["first"])
                steady.extend(res["steady"])
            row[f"{cache}, first request (fresh process)"] = statistics.median(first)
            row[f"{cache}, steady state"] = statistics.median(steady)
            row[f"{cache}, stored bytes"] = statistics.median(size)
        results["rows"][str(length)] = row
        print(f"  llama.cpp {length:>5}: cold {row['cold prompt']:.3f}s | floor {row['floor'] * 1e3:.0f} ms | "
              + " | ".join(f"{c} first {row[f'{c}, first request (fresh process)'] * 1e3:.0f} ms, steady "
                           f"{row[f'{c}, steady state'] * 1e3:.0f} ms, {row[f'{c}, stored bytes'] / 1e6:.1f} MB"
                           for c in CACHES)
              + f" | ram cache steady {row['ram cache, steady state (in process)'] * 1e3:.0f} ms", flush=True)
        (args.out / "llama_cpp.json").write_text(json.dumps(results, indent=1))
        del llm


if __name__ == "__main__":
    main()
