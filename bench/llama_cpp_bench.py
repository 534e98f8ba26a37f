"""llama-cpp-python's prompt caches on the same GGUF and prompts as bench/llm_ttft.py.

    python bench/llama_cpp_bench.py [--lengths 512 2000 4000] [--repeats 3] [--install]

llama-cpp-python is not a dependency: `--install` runs `pip install llama-cpp-python`, which builds
llama.cpp from source (about 5 minutes on 2 cores). For each shared prefix plus a 14-token question:
cold prompt, LlamaRAMCache hit and LlamaDiskCache hit (in a fresh process), each time to the first
token. Writes llama_cpp.json for bench/report.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llm_ttft import QUESTIONS, prompt_ids  # noqa: E402

from _common import ttft_parser  # noqa: E402


def gguf_path() -> str:
    from promptstore.llm._model import _gguf_path

    return str(_gguf_path("smollm2-135m-instruct"))


def load(threads: int, length: int):
    """A context just big enough for the prompt: llama-cpp-python saves and loads the whole context's KV buffer
    as its cache state, so an oversized n_ctx would make every cache hit look worse than it is."""
    from llama_cpp import Llama

    return Llama(model_path=gguf_path(), n_ctx=min(8192, length + 256), n_threads=threads, n_batch=512, verbose=False)


def ttft(llm, ids: list[int]) -> float:
    """Seconds to the first token through create_completion, which is where llama-cpp-python consults its
    cache. The context is reset first, so only the cache object (not the previous call's context) can help;
    the time a miss spends saving its state into the cache afterwards is not counted."""
    llm.reset()
    t0 = time.perf_counter()
    first = None

    for _chunk in llm.create_completion(ids, max_tokens=1, temperature=0.0, stream=True):
        first = time.perf_counter() - t0 if first is None else first
    return first if first is not None else time.perf_counter() - t0


def child(args: argparse.Namespace) -> None:
    from llama_cpp import LlamaDiskCache

    from promptstore.llm import load_model

    _, tok = load_model()
    llm = load(args.threads, args.length)
    llm.set_cache(LlamaDiskCache(cache_dir=args.cache_dir))
    times = []
    for q in QUESTIONS[: args.repeats]:
        ids, _ = prompt_ids(tok, args.length, q)
        times.append(ttft(llm, ids))
    print(json.dumps({"disk": statistics.median(times)}))


def main() -> None:
    parser = ttft_parser(__doc__)
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
    from llama_cpp import LlamaRAMCache

    from promptstore.llm import load_model

    _, tok = load_model()
    import llama_cpp

    results = {"version": llama_cpp.__version__, "rows": {}}
    for length in args.lengths:
        llm = load(args.threads, length)
        ttft(llm, prompt_ids(tok, length, "warm-up")[0][:64])  # first call pays one-time setup
        row = {}
        cold = []
        for q in QUESTIONS[: args.repeats]:
            llm.set_cache(None)
            ids, n_prefix = prompt_ids(tok, length, q)
            cold.append(ttft(llm, ids))
        row["cold prompt"] = statistics.median(cold)
        # RAM cache: the prefix once, then each question finds it (longest-prefix match on tokens)
        llm.set_cache(LlamaRAMCache(capacity_bytes=8 << 30))
        ttft(llm, ids[:n_prefix])
        ram = []
        for q in QUESTIONS[args.repeats : 2 * args.repeats]:
            ids, _ = prompt_ids(tok, length, q)
            ram.append(ttft(llm, ids))
        row["RAM cache hit"] = statistics.median(ram)
        # Disk cache: fill it here, hit it from a fresh process
        cache_dir = tempfile.mkdtemp(prefix="ps-llamacpp-")
        from llama_cpp import LlamaDiskCache

        llm.set_cache(LlamaDiskCache(cache_dir=cache_dir))
        ttft(llm, ids[:n_prefix])
        proc = subprocess.run([sys.executable, __file__, "--child", "--cache-dir", cache_dir, "--length", str(length),
                               "--repeats", str(args.repeats), "--threads", str(args.threads)],
                              capture_output=True, text=True, check=True)
        row["disk cache hit (fresh process)"] = json.loads(proc.stdout.strip().splitlines()[-1])["disk"]
        results["rows"][str(length)] = row
        print(f"  llama.cpp {length:>5}: cold {row['cold prompt']:.3f}s | RAM hit {row['RAM cache hit']:.3f}s | "
              f"disk hit {row['disk cache hit (fresh process)']:.3f}s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "llama_cpp.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
