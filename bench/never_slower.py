"""A hit is never slower than no cache: PrefixCache.generate against model.generate, by served share.

    python bench/never_slower.py [--lengths 2000 8000] [--fractions 0 5 15 30 50 90] [--repeats 3]
                                 [--modes auto always] [--out bench/results/never_slower_<date>.json]

SmolLM2-135M-Instruct (real weights, float32), in one warm process. For each prompt length and
served share ``f``: a store holding the prompt's first ``f%`` of tokens (stored by an untimed
request), then the prompt itself through ``model.generate`` (no cache), ``PrefixCache.generate``
with ``reuse="auto"`` (the default) and with ``reuse="always"``, each ``--repeats`` times in
rotating order, on a fresh suffix each repeat. Timed: to the first token (a logits processor's
first call) and to return, 8 new tokens. After each cached request the store's background
writes are flushed, untimed, and their time is reported beside ("storing after return"). Ratios
are medians of the cached times over medians of the plain ones; the greedy tokens are compared.
Rates start unmeasured (an empty store): the first requests at each length measure them.

Paired, per repeat (the plain request and the cached ones on the same prompt, one after the
other): the ratio of the cached return time over the plain one (median, least and most), and
the cached request's own work besides ``model.generate``, timed inside the call: the lookup
(the model's identity, the block keys, the index reads and the decision) and the stacking of
new blocks for the store before returning. A request the default declines runs what the plain
one runs plus these two: they are what it can cost, a number that the forward's spread from one
request to the next (several percent here) hides in the ratios.
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


class FirstToken:
    """A logits processor noting when the first token's scores exist."""

    def __init__(self) -> None:
        self.at: float | None = None

    def __call__(self, input_ids, scores):
        if self.at is None:
            self.at = time.perf_counter()
        return scores


def main() -> None:
    import numpy as np
    import torch
    from transformers import LogitsProcessorList

    from promptstore import PromptStore
    from promptstore.llm import PrefixCache, load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2000, 8000])
    ap.add_argument("--fractions", type=int, nargs="+", default=[0, 5, 15, 30, 50, 90])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--modes", nargs="+", choices=["auto", "always"], default=["auto", "always"],
                    help="the PrefixCache settings timed against model.generate")
    ap.add_argument("--out", default=str(BENCH / "results" / f"never_slower_{time.strftime('%Y-%m-%d')}.json"))
    args = ap.parse_args()

    from promptstore.llm import _request

    # The cached request's own work, timed where it runs (outermost calls only; nested ones count once).
    own: dict[str, float] = {"lookup": 0.0, "store_blocks": 0.0}

    def timed(name: str):
        inner = getattr(_request.Request, name)

        def wrapper(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return inner(self, *a, **k)
            finally:
                own[name] += time.perf_counter() - t0
        setattr(_request.Request, name, wrapper)

    for name in own:
        timed(name)
    model, _ = load_model()
    model = model.float().eval()
    vocab = model.config.vocab_size
    rows: list[dict] = []

    def run(call, ids):
        first = FirstToken()
        t0 = time.perf_counter()
        out = call(ids, first)
        t1 = time.perf_counter()
        return (first.at - t0), (t1 - t0), out[0, len(ids):].tolist()

    def plain(ids, first):
        x = torch.tensor([ids])
        with torch.no_grad():
            return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.new_tokens,
                                  min_new_tokens=args.new_tokens, do_sample=False,
                                  logits_processor=LogitsProcessorList([first]))

    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))  # warm the model's first call
    for length in args.lengths:
        # A store per mode: each timed request finds only the shared prefix (and earlier repeats' prompts,
        # which share only it).
        with tempfile.TemporaryDirectory() as folder:
            stores = {mode: PromptStore(Path(folder) / mode, memory_bytes="4GiB") for mode in args.modes}
            caches = {mode: PrefixCache(model, None, store=stores[mode], reuse=mode) for mode in stores}

            def cached(mode):
                def call(ids, first):
                    return caches[mode].generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                                 do_sample=False, logits_processor=[first])
                return call

            rng = np.random.default_rng(length)
            for f in args.fractions:
                shared = length * f // 100
                prefix = rng.integers(100, vocab - 100, shared).tolist()
                if shared:
                    for mode, cache in caches.items():
                        cache.prefill(prefix + [7])
                        stores[mode].flush()
                times: dict[str, list[tuple[float, float]]] = {name: [] for name in ["plain", *args.modes]}
                storing: dict[str, list[float]] = {mode: [] for mode in args.modes}
                served: dict[str, list[int]] = {mode: [] for mode in args.modes}
                parts: dict[str, dict[str, list[float]]] = {mode: {name: [] for name in own} for mode in args.modes}
                declined: dict[str, list[int]] = {mode: [] for mode in args.modes}
                same = True
                for r in range(args.repeats):
                    ids = prefix + rng.integers(100, vocab - 100, length - shared).tolist()
                    order = ["plain", *args.modes]
                    order = order[r % len(order):] + order[: r % len(order)]
                    tokens = {}
                    for name in order:
                        call = plain if name == "plain" else cached(name)
                        own.update(dict.fromkeys(own, 0.0))
                        ttft, total, tokens[name] = run(call, ids)
                        times[name].append((ttft, total))
                        if name != "plain":
                            for part, seconds in own.items():
                                parts[name][part].append(seconds)
                            served[name].append(caches[name].stats["last"]["served"])
                            declined[name].append(caches[name].stats["last"]["declined"])
                            t = time.perf_counter()
                            stores[name].flush()
                            storing[name].append(time.perf_counter() - t)
                    same = same and all(tokens[mode] == tokens["plain"] for mode in args.modes)

                def med(name, i):
                    return statistics.median(t[i] for t in times[name])

                row = {"tokens": length, "served_share": f, "greedy_tokens_equal": same,
                       "plain_first_s": med("plain", 0), "plain_return_s": med("plain", 1)}
                for mode in args.modes:
                    paired = [c[1] / p[1] for c, p in zip(times[mode], times["plain"], strict=True)]
                    row |= {f"{mode}_paired_return_ratio": statistics.median(paired),
                            f"{mode}_paired_return_ratios": paired,
                            f"{mode}_lookup_s": statistics.median(parts[mode]["lookup"]),
                            f"{mode}_stacking_s": statistics.median(parts[mode]["store_blocks"])}
                    row |= {f"{mode}_first_s": med(mode, 0), f"{mode}_return_s": med(mode, 1),
                            f"{mode}_first_ratio": med(mode, 0) / med("plain", 0),
                            f"{mode}_return_ratio": med(mode, 1) / med("plain", 1),
                            f"{mode}_served": statistics.median(served[mode]),
                            f"{mode}_declined": statistics.median(declined[mode]),
                            f"{mode}_storing_after_s": statistics.median(storing[mode])}
                row["spread_plain_return"] = (max(t[1] for t in times["plain"]) - min(t[1] for t in times["plain"])) \
                    / row["plain_return_s"]
                if "auto" in caches:
                    row["rho_measured"] = caches["auto"].engine.rates().rho()
                rows.append(row)
                save_results(args.out, args.repeats, rows)
                print(f"{length} tokens, {f}% stored: plain {row['plain_return_s']:.2f} s | " + " | ".join(
                    f"{mode} {row[f'{mode}_return_ratio']:.2f}x, paired {row[f'{mode}_paired_return_ratio']:.3f}x "
                    f"({min(row[f'{mode}_paired_return_ratios']):.3f}-{max(row[f'{mode}_paired_return_ratios']):.3f}), "
                    f"served {row[f'{mode}_served']:.0f}, declined {row[f'{mode}_declined']:.0f}, first token "
                    f"{row[f'{mode}_first_ratio']:.2f}x, lookup {1e3 * row[f'{mode}_lookup_s']:.1f} ms, stacking "
                    f"{1e3 * row[f'{mode}_stacking_s']:.1f} ms, storing after {row[f'{mode}_storing_after_s']:.2f} s"
                    for mode in args.modes) + f" | tokens equal {same}", flush=True)
            for store in stores.values():
                store.close()


if __name__ == "__main__":
    main()
