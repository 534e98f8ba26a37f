"""What ChunkCache's quality guard can know: per prompt, the next-token distribution at every budget it may try.

    python bench/guard_probe.py [--set chat|plain] [--prompts 60] [--out bench/out]

For each prompt of bench/chunk_quality.py's set (warm: every passage stored once beforehand), the
question-aware selection at the budgets the guard doubles through (0 = the stale KV, 0.1, 0.2, 0.4,
0.8; then 1.0 = exact) and transformers' full prefill. Writes guard_probe_{set}.json: per prompt,
the true KL of each budget from the full prefill and the KL between neighbouring budgets (what the
guard sees), so that estimators of the true KL can be compared on the same requests without
running the guard for each (bench/report.py guard_estimators).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

# torch, the model and the library are imported where a probe runs: bench/report.py imports simulate()
# and tail() to build its tables from the recorded JSON without them.

BUDGETS = (0.0, 0.1, 0.2, 0.4, 0.8)


def kl(p_lp: torch.Tensor, q_lp: torch.Tensor) -> float:
    return float((p_lp.exp() * (p_lp - q_lp)).sum())


def simulate(rows: list[dict], bound: float, estimator, exact_above: float = 1.0, fall: float | None = None) -> dict:
    """The guard's doubling run on the recorded budgets, with ``estimator(steps)`` read at each one: the
    share of requests whose accepted budget is farther than ``bound`` from the full prefill, the fraction
    recomputed (1.0 for a request that went to the exact prefill) and the work (the moved tokens of every
    pass, the exact prefill counted as 1). ``exact_above``: a budget over it is the exact prefill instead
    (GUARD_EXACT_ABOVE); ``fall``: an estimate over ``bound * fall ** (budgets left)`` goes exact at once
    (GUARD_FALL)."""
    tried = [b for b in BUDGETS[1:] if b <= exact_above]
    over, fractions, work = [], [], []
    for r in rows:
        spent, accepted = 0.0, None
        for i, budget in enumerate(tried):
            spent += budget
            estimate = estimator(r["step"][:i + 1])
            if estimate <= bound:
                accepted = budget
                over.append(r["true"][i + 1] > bound)
                break
            if fall is not None and estimate > bound * fall ** (len(tried) - 1 - i):
                break
        if accepted is None:
            accepted, spent = 1.0, spent + 1.0
            over.append(False)
        fractions.append(accepted)
        work.append(spent)
    return {"violations": float(np.mean(over)), "fraction": float(np.mean(fractions)),
            "exact": float(np.mean([f == 1.0 for f in fractions])), "work": float(np.mean(work)),
            "work_max": float(np.max(work))}


def neighbour(steps: list[float]) -> float:
    """Today's estimate: the KL between the last two budgets."""
    return steps[-1]


def tail(steps: list[float], first_ratio: float = 1.0) -> float:
    """A geometric tail: sqrt(KL) taken as a distance, each doubling shrinking the step by the ratio of the
    last two (``first_ratio`` before there are two), so the distance left is step * q / (1 - q); no
    shrinking (q >= 1) is no convergence: infinite."""
    d = [np.sqrt(max(x, 0.0)) for x in steps]
    q = d[-1] / d[-2] if len(d) > 1 and d[-2] > 0 else first_ratio
    return float("inf") if q >= 1 else float((d[-1] * q / (1 - q)) ** 2)


def report(paths: list[Path]) -> None:
    from promptstore.llm._chunks import GUARD_EXACT_ABOVE, GUARD_FALL, GUARD_SAFETY

    for path in paths:
        data = json.loads(path.read_text())
        rows = data["prompts"]
        true = np.array([r["true"] for r in rows])
        print(f"{data['set']}: {len(rows)} prompts; mean true KL by budget "
              + ", ".join(f"{b:g}: {m:.4f}" for b, m in zip(BUDGETS, true.mean(0), strict=True))
              + "; share within 0.025 " + ", ".join(f"{b:g}: {m:.0%}" for b, m in
                                                       zip(BUDGETS, (true <= 0.025).mean(0), strict=True)))
        for bound in (0.05, 0.025, 0.02):
            for name, est in (("neighbour", neighbour), ("tail q0=1", tail),
                              ("tail q0=0.5", lambda s: tail(s, 0.5)),
                              ("neighbour x2", lambda s: 2 * s[-1]), ("neighbour x4", lambda s: 4 * s[-1]),
                              ("neighbour x6", lambda s: 6 * s[-1]), ("neighbour x10", lambda s: 10 * s[-1])):
                show(f"  bound {bound:<5} {name:14s}", simulate(rows, bound, est))
            six = lambda s: GUARD_SAFETY * s[-1]  # noqa: E731
            show(f"  bound {bound:<5} x6, exact>{GUARD_EXACT_ABOVE:g}", simulate(rows, bound, six, GUARD_EXACT_ABOVE))
            for fall in (8.0, GUARD_FALL, 3.0, 2.0):
                show(f"  bound {bound:<5} x6, exact>{GUARD_EXACT_ABOVE:g}, fall {fall:g}",
                     simulate(rows, bound, six, GUARD_EXACT_ABOVE, fall))


def show(label: str, res: dict) -> None:
    print(f"{label:34s} violations {res['violations']:5.1%}  fraction {res['fraction']:.2f}  exact {res['exact']:.0%}"
          f"  work {res['work']:.2f} (max {res['work_max']:.2f})")


def main() -> None:
    if sys.argv[1:2] == ["--report"]:
        report([Path(p) for p in sys.argv[2:]])
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--set", choices=("chat", "plain"), default="chat")
    parser.add_argument("--prompts", type=int, default=60)
    parser.add_argument("--passages", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = parser.parse_args()
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from chunk_quality import build_prompts

    from promptstore import PromptStore
    from promptstore.llm import ChunkCache, load_model

    torch.set_num_threads(2)
    model, tok = load_model("smollm2-135m-instruct")
    prompts = build_prompts(tok, args.set, args.prompts, args.passages, args.tokens)
    folder = tempfile.mkdtemp(prefix="ps-guard-")
    caches = [ChunkCache(model, tok, PromptStore(folder, memory_bytes=0), recompute=b, select="query")
              for b in BUDGETS]
    for p in prompts:
        caches[0].prefill(p)  # warm
    rows = []
    for n, p in enumerate(prompts):
        ids = [t for seg in p for t in seg]
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1].double(), -1)
        lps = [torch.log_softmax(cc.prefill(p)[1].double(), -1) for cc in caches]
        rows.append({"true": [kl(ref, lp) for lp in lps],
                     "step": [kl(lps[i], lps[i - 1]) for i in range(1, len(lps))]
                     + [kl(ref, lps[-1])]})  # the last step: 0.8 -> exact
        if (n + 1) % 5 == 0 or n + 1 == len(prompts):  # written as it goes: a stopped run keeps what it measured
            args.out.mkdir(parents=True, exist_ok=True)
            path = args.out / f"guard_probe_{args.set}.json"
            path.write_text(json.dumps({"set": args.set, "budgets": BUDGETS, "prompts": rows}, indent=1))
            print(f"{n + 1}/{len(prompts)}: wrote {path}", flush=True)


if __name__ == "__main__":
    main()
