"""LlamaCppCache is never slower than no cache: create_completion with the cache against without it, by shared share.

    python bench/llamacpp_never_slower.py [--length 2000] [--fractions 0 5 15 30 50 90] [--repeats 3]
                                          [--out bench/results/llamacpp_never_slower_<date>.json]

SmolLM2-135M-Instruct's GGUF through llama-cpp-python, in one warm process, with ``logits_all``
off and on (on: every stored state carries every prompt token's scores, 196 KB a token, so a
state costs far more to read). Per setting, a store holds one state: a document of ``--length``
tokens and its answer (stored by an untimed request). Each timed prompt shares its first ``f%``
with that document, then goes on with text of its own; the context is reset before every
request, so only the store can serve. Timed: ``create_completion`` with 8 new tokens, without a
cache, with ``LlamaCppCache(reuse="auto")`` (the default) and with ``reuse="always"``, in
rotating order. A ratio is the median, over repeats, of a cached request's time over the plain
request's of the same repeat: this machine drifts by 20% over minutes, alike for every mode, and
one repeat's three requests run within half a minute (the ratios of medians are kept too). Greedy
texts are compared. A hit reads the whole stored state however little of it a prompt shares:
that is what ``auto`` weighs. Also recorded: the cache's own time inside each cached completion
(its lookup, with any restore, and the part of storing the completion waits for), medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from _common import save_results  # noqa: E402


def main() -> None:
    import llama_cpp
    import numpy as np

    from promptstore import PromptStore
    from promptstore.llm import LlamaCppCache
    from promptstore.llm._model import _gguf_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=2000)
    ap.add_argument("--fractions", type=int, nargs="+", default=[0, 5, 15, 30, 50, 90])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--out", default=str(BENCH / "results" / f"llamacpp_never_slower_{time.strftime('%Y-%m-%d')}.json"))
    args = ap.parse_args()

    gguf = str(_gguf_path("smollm2-135m-instruct"))
    rows: list[dict] = []
    rng = np.random.default_rng(0)
    words = ["forklift", "pallet", "aisle", "bay", "door", "shift", "crate", "ladder", "glove", "rack", "dock", "van"]

    def text(n_words: int) -> str:
        return " ".join(rng.choice(words, n_words)) + "."

    for logits_all in (False, True):
        llm = llama_cpp.Llama(gguf, n_ctx=args.length * 2 + 256, n_threads=2, verbose=False, seed=0,
                              logits_all=logits_all)
        document = llm.tokenize(text(args.length).encode())[: args.length]
        # llama.cpp counts a context's first evaluation as loading (not as a prefill the cache can measure)
        llm.create_completion(text(20), max_tokens=1, temperature=0.0)
        with tempfile.TemporaryDirectory() as folder:
            stores = {mode: PromptStore(Path(folder) / mode, memory_bytes=0) for mode in ("auto", "always")}
            caches = {mode: LlamaCppCache(llm, stores[mode], reuse=mode) for mode in stores}
            for mode, cache in caches.items():  # the stored state: the document and its answer (untimed)
                llm.set_cache(cache)
                llm.reset()
                llm.create_completion(document, max_tokens=args.new_tokens, temperature=0.0)
                caches[mode].flush()

            own = {"s": 0.0}  # the cache's own time inside a completion: its lookup and what storing waits for

            def timed(fn):
                def wrapper(*a, **kw):
                    t0 = time.perf_counter()
                    try:
                        return fn(*a, **kw)
                    finally:
                        own["s"] += time.perf_counter() - t0
                return wrapper

            for name in ("__getitem__", "__contains__", "_store"):
                setattr(LlamaCppCache, name, timed(getattr(LlamaCppCache, name)))

            def run(mode: str, prompt: list[int]) -> tuple[float, str]:
                llm.set_cache(None if mode == "plain" else caches[mode])
                llm.reset()
                t0 = time.perf_counter()
                out = llm.create_completion(prompt, max_tokens=args.new_tokens, temperature=0.0)
                seconds = time.perf_counter() - t0
                if mode != "plain":
                    caches[mode].flush()  # untimed: the next request must not wait on this one's writes
                return seconds, out["choices"][0]["text"]

            for f in args.fractions:
                shared = args.length * f // 100
                times: dict[str, list[float]] = {"plain": [], "auto": [], "always": []}
                owns: dict[str, list[float]] = {"auto": [], "always": []}
                hits = {"auto": 0, "always": 0}
                declined = 0
                same = True
                for r in range(args.repeats):
                    tail = llm.tokenize((" " + text(args.length)).encode(), add_bos=False)
                    prompt = document[:shared] + tail[: args.length - shared]
                    order = ["plain", "auto", "always"]
                    order = order[r % 3:] + order[: r % 3]
                    texts = {}
                    for mode in order:
                        before = dict(caches[mode].stats) if mode != "plain" else {}
                        own["s"] = 0.0
                        seconds, texts[mode] = run(mode, prompt)
                        times[mode].append(seconds)
                        if mode != "plain":
                            owns[mode].append(own["s"])
                        if mode != "plain":
                            hits[mode] += caches[mode].stats["hits"] - before["hits"]
                            if mode == "auto":
                                declined += caches[mode].stats["declined"] - before["declined"]
                    same = same and texts["plain"] == texts["auto"] == texts["always"]
                plain = statistics.median(times["plain"])

                def paired(mode: str) -> float:
                    return statistics.median(t / p for t, p in zip(times[mode], times["plain"], strict=True))
                row = {"logits_all": logits_all, "tokens": args.length, "shared_share": f, "greedy_text_equal": same,
                       "plain_s": plain, "auto_ratio": paired("auto"), "always_ratio": paired("always"),
                       "auto_ratio_of_medians": statistics.median(times["auto"]) / plain,
                       "always_ratio_of_medians": statistics.median(times["always"]) / plain,
                       "auto_hits": hits["auto"], "auto_declined": declined, "always_hits": hits["always"],
                       "spread_plain": (max(times["plain"]) - min(times["plain"])) / plain,
                       "times_s": {mode: [round(t, 4) for t in ts] for mode, ts in times.items()},
                       "auto_cache_own_s": statistics.median(owns["auto"]),
                       "always_cache_own_s": statistics.median(owns["always"]),
                       "restore_s_per_mb": statistics.median(caches["auto"].rates.samples["restore"]) * 1e6
                       if caches["auto"].rates.samples["restore"] else None}
                rows.append(row)
                save_results(args.out, args.repeats, rows)
                print(f"logits_all={logits_all} {args.length} tokens, {f}% shared: plain {plain:.2f} s | auto "
                      f"{row['auto_ratio']:.2f}x (hits {hits['auto']}, declined {declined}) | always "
                      f"{row['always_ratio']:.2f}x (hits {hits['always']}) | texts equal {same} | the cache's own "
                      f"time {row['auto_cache_own_s'] * 1000:.0f} / {row['always_cache_own_s'] * 1000:.0f} ms | plain "
                      f"spread {row['spread_plain']:.0%}", flush=True)
            for store in stores.values():
                store.close()
        llm.close()


if __name__ == "__main__":
    main()
