"""Mamba served stepwise: a long document's state from the store, a short question one token per forward.

    python bench/mamba_stepwise.py [--doc 2000] [--repeats 3] [--out bench/results/mamba_stepwise_<date>.json]

Mamba-130M's width (transformers' MambaConfig defaults) with ``--layers`` of its 32 layers, random
weights seeded (real shapes and cost; transformers' reference PyTorch kernels on this CPU). At
the full depth the random model is refused: its one-token forwards drift from one pass by
1.2e-3 of the largest score (0.015), over the admission bound of 1e-3; 16 layers drift 5.7e-5. Every run is a fresh process, the
model built before the clock starts: a warming process prefills the document through
PrefixCache (untimed); then per repeat a plain full forward over document + a new question, and
a PrefixCache.prefill of the same prompt (reuse="auto": the decision included) over the store.
Medians; each hit's scores are compared with the plain ones. Also: one-token forward and full
prefill seconds per token, whose ratio puts the crossover (the share of a prompt the store must
hold for stepping the rest to beat one pass).
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

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from _common import save_results  # noqa: E402

CHILD = r"""
import json, sys, time, numpy as np, torch
from transformers import MambaConfig, MambaForCausalLM
from promptstore import PromptStore
from promptstore.llm import PrefixCache
mode, folder, doc_len, q, layers = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.manual_seed(0)
model = MambaForCausalLM(MambaConfig(num_hidden_layers=layers)).eval()
rng = np.random.default_rng(0)
doc = rng.integers(10, 50000, doc_len).tolist()
ids = doc + np.random.default_rng(100 + q).integers(10, 50000, 16).tolist() if q >= 0 else doc
with torch.no_grad():
    model(torch.tensor([[1, 2, 3]]))
def plain():
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]
out = {}
if mode == "plain":
    t = time.perf_counter(); plain(); out["seconds"] = time.perf_counter() - t
else:
    t = time.perf_counter()
    store = PromptStore(folder)
    pc = PrefixCache(model, None, store=store)
    _, got = pc.prefill(ids)
    out["seconds"] = time.perf_counter() - t
    out["stats"] = pc.stats["last"]
    if mode == "hit":
        out["diff"] = float((got - plain()).abs().max())
    rates = pc.engine.rates()
    out["full_s_per_token"] = statistics.median(rates.samples["full"]) * rates.work(0, 1) if rates.samples["full"] else None
    out["step_s"] = statistics.median(rates.samples["step"]) if rates.samples["step"] else None
    store.close()
print(json.dumps(out))
""".replace("import json, sys", "import json, statistics, sys")


def child(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--doc", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--out", default=str(BENCH / "results" / f"mamba_stepwise_{time.strftime('%Y-%m-%d')}.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        warm = child("warm", folder, str(args.doc), "-1", str(args.layers))
        plains, hits = [], []
        for r in range(args.repeats):
            plains.append(child("plain", folder, str(args.doc), str(r), str(args.layers)))
            hits.append(child("hit", folder, str(args.doc), str(r), str(args.layers)))
            print(f"repeat {r}: plain {plains[-1]['seconds']:.2f} s, hit {hits[-1]['seconds']:.2f} s "
                  f"(served {hits[-1]['stats']['served']}, diff {hits[-1]['diff']:.2g})", flush=True)
    plain_s = statistics.median(p["seconds"] for p in plains)
    hit_s = statistics.median(h["seconds"] for h in hits)
    full_tok, step_s = hits[-1]["full_s_per_token"], hits[-1]["step_s"]
    row = {"layers": args.layers, "doc_tokens": args.doc, "question_tokens": 16, "warm_prefill_s": warm["seconds"],
           "plain_first_request_s": plain_s, "hit_first_request_s": hit_s, "speedup": plain_s / hit_s,
           "served": [h["stats"]["served"] for h in hits], "max_score_diff": max(h["diff"] for h in hits),
           "full_prefill_s_per_token": full_tok, "one_token_forward_s": step_s,
           "step_costs_prefill_tokens": step_s / full_tok if full_tok and step_s else None,
           "crossover_served_share": 1 - full_tok / step_s if full_tok and step_s else None}
    save_results(args.out, args.repeats, [row])
    print(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
