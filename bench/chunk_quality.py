"""Passages anywhere (ChunkCache): quality against full prefill, and TTFT, per recompute setting.

    python bench/chunk_quality.py [--set chat|plain] [--prompts 100] [--passages 8] [--tokens 256] [--out bench/out]
                                  [--own-stores] [--learn N]

SmolLM2-135M-Instruct (fp32, real weights), RAG prompts of real English text: k passages drawn
from the READMEs and licenses that ship inside installed packages and from long Python
standard-library docstrings, in a new random order per prompt, and one of four kinds of
question. Two prompt sets that differ in form, so that a default is chosen on both:
  chat   SmolLM2's chat template: a system line (the anchor), the passages back to back, the
         question and the assistant's turn
  plain  plain text, no template: an instruction line (the anchor), each passage ending in a
         blank line, other questions, "Answer:"; passages cut at other offsets of the texts
Every passage's KV is stored once beforehand (each after the anchor, in another process's
order), so every request below is a warm one.

Per setting, against transformers' full prefill of the same ids:
  top-1        next-token agreement, on decisive prompts (full prefill's top two scores at
               least 0.5 nats apart) and on near-ties, reported apart
  KL           KL(full || cached) of the next-token distribution (nats), mean and p90
  greedy       32 greedy tokens: the share of prompts whose 32 tokens all agree, and the mean
               number of leading tokens that agree
  TTFT         ChunkCache.prefill (fingerprint, lookups, KV load from files, rotation,
               selection, the forward) against the full prefill, medians, side by side; what
               a request stores is written after it returns (the store's writer thread): each
               setting's writes are finished, untimed, before the next setting runs (store_s)
  guard        for settings with max_kl: the request's own estimate against its true KL (Spearman
               correlation, share of requests whose true KL exceeds the bound) and the fraction used
--own-stores gives each setting a copy of the warmed folder, so that what one setting stores (a guarded
request's exact prefill stores the whole prompt's blocks) is never served to another. --learn N: each
guarded setting first runs N other prompts (not measured), then is made again on a new PromptStore over
the same folder, as a restarted process finds the guard's history in the store.
Writes chunk_quality_{k}x{tokens}.json (chunk_quality_plain_{k}x{tokens}.json for the plain set).
Not a test: the figures are the product of one run.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from promptstore import PromptStore  # noqa: E402
from promptstore.llm import ChunkCache, load_model  # noqa: E402

from _common import machine  # noqa: E402

ANCHOR = ("<|im_start|>system\nYou are a helpful assistant. Answer the question using the passages the user gives."
          "<|im_end|>\n<|im_start|>user\n")
QUESTIONS = [
    "Question: What is the main topic of the passages above?",
    "Question: Which software project is mentioned first above, and what does it do?",
    "Question: Summarize the last passage in one sentence.",
    "Question: Does any passage above mention a license? Quote the relevant words.",
]
END = "<|im_end|>\n<|im_start|>assistant\n"
PLAIN_ANCHOR = "Read the following passages carefully, then answer the question after them.\n\n"
PLAIN_QUESTIONS = [
    "Question: Which passage above talks about installing or using a tool, and how?\nAnswer:",
    "Question: Name two terms that appear in more than one of the passages above.\nAnswer:",
    "Question: What does the first passage say? Give its main point.\nAnswer:",
    "Question: Is there anything about copyright or warranty in the passages? If so, what?\nAnswer:",
]
SETTINGS = [  # (label, recompute, select, max_kl); EPIC's token counts are per passage, made a fraction in main()
    ("no recompute", 0.0, "recent", None),
    ("EPIC first 16/passage", 16, "first", None),
    ("CacheBlend 15%", 0.15, "blend", None),
    ("CacheBlend 30%", 0.30, "blend", None),
    ("recent 10%", 0.10, "recent", None),
    ("recent 15%", 0.15, "recent", None),
    ("query 10%", 0.10, "query", None),
    ("query 15%", 0.15, "query", None),
    ("query 30%", 0.30, "query", None),
    ("guard 0.05 (query 10%+)", 0.10, "query", 0.05),
    ("guard 0.02 (query 10%+)", 0.10, "query", 0.02),
]


def english_texts() -> list[str]:
    """Real English prose shipped on this machine: package READMEs and licenses, stdlib docstrings."""
    site = Path(sysconfig.get_paths()["purelib"])
    texts = []
    for meta in sorted(site.glob("*.dist-info/METADATA")) + sorted(site.glob("*.dist-info/licenses/*")) \
            + sorted(site.glob("*.dist-info/LICENSE*")):
        try:
            body = meta.read_text(errors="ignore")
        except OSError:
            continue
        if meta.name == "METADATA":
            body = body.split("\n\n", 1)[1] if "\n\n" in body else ""
        texts.append(body)
    import importlib
    # The standard library only: importing arbitrary modules on sys.path would run them.
    for mod in sorted(n for n in sys.stdlib_module_names if not n.startswith("_")):
        if mod in {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo"}:
            continue
        try:
            doc = importlib.import_module(mod).__doc__ or ""
        except Exception:  # noqa: BLE001 - any module that fails to import is just skipped
            continue
        texts.append(doc)
    keep = []
    for t in texts:
        t = re.sub(r"[ \t]+", " ", t)
        t = re.sub(r"\n{3,}", "\n\n", t).strip()
        letters = sum(c.isalpha() or c.isspace() for c in t)
        if len(t) > 1500 and letters / len(t) > 0.85 and t.isascii():
            keep.append(t)
    return keep


def passage_pool(tokenizer, tokens: int, want: int, rng: np.random.Generator, offset: int = 0,
                 tail: list[int] | None = None) -> list[list[int]]:
    """``want`` passages of ``tokens`` tokens (``tail`` appended to each), cut from ``offset`` on in each text."""
    pool = []
    body = tokens - len(tail or [])
    for text in english_texts():
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for lo in range(offset, len(ids) - body, body):
            pool.append(ids[lo : lo + body] + list(tail or []))
    order = rng.permutation(len(pool))
    return [pool[i] for i in order[:want]]


def greedy(model, cache, logits, n: int) -> list[int]:
    out = []
    with torch.no_grad():
        for _ in range(n):
            tok = int(logits.argmax())
            out.append(tok)
            logits = model(torch.tensor([[tok]]), cache=cache, use_cache=True).logits[0, -1]
    return out


def build_prompts(tok, prompt_set: str, n: int, k: int, tokens: int) -> list[list[list[int]]]:
    """``n`` prompts of the set, each [anchor, k passages of ``tokens`` tokens, question] as token ids."""
    rng = np.random.default_rng(0)
    want = max(3 * k, min(4 * n, 400))
    if prompt_set == "chat":
        pool = passage_pool(tok, tokens, want, rng)
        anchor = tok(ANCHOR, add_special_tokens=False)["input_ids"]
        questions = [tok(q + END, add_special_tokens=False)["input_ids"] for q in QUESTIONS]
    else:
        pool = passage_pool(tok, tokens, want, rng, offset=tokens // 3,
                            tail=tok("\n\n", add_special_tokens=False)["input_ids"])
        anchor = tok(PLAIN_ANCHOR, add_special_tokens=False)["input_ids"]
        questions = [tok(q, add_special_tokens=False)["input_ids"] for q in PLAIN_QUESTIONS]
    prompts = []
    for i in range(n):
        chosen = rng.choice(len(pool), size=k, replace=False)
        prompts.append([anchor] + [pool[j] for j in chosen] + [questions[i % len(questions)]])
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--set", choices=("chat", "plain"), default="chat", help="the prompt set (see above)")
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--passages", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--greedy", type=int, default=32)
    parser.add_argument("--settings", nargs="*", help="labels to run (default: all)")
    parser.add_argument("--store", help="a store folder to reuse (passages already stored there are not recomputed)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    parser.add_argument("--own-stores", action="store_true", help="a copy of the warmed store per setting")
    parser.add_argument("--learn", type=int, default=0, help="prompts each guarded setting runs before it is measured")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, tok = load_model("smollm2-135m-instruct")
    k = args.passages
    prompts = build_prompts(tok, args.set, args.prompts + args.learn, k, args.tokens)
    prompts, learning = prompts[:args.prompts], prompts[args.prompts:]
    folder = args.store or tempfile.mkdtemp(prefix="ps-chunks-")
    settings = [(label, r / args.tokens if r >= 1 else r, sel, bound) for label, r, sel, bound in SETTINGS
                if not args.settings or label in args.settings]
    caches = {label: ChunkCache(model, tok, PromptStore(folder, memory_bytes=0), recompute=r, select=sel, max_kl=bound)
              for label, r, sel, bound in settings}
    # Warm: every passage stored once, after the anchor (the first cache computes what is missing).
    warm = caches[settings[0][0]]
    t0 = time.perf_counter()
    for p in prompts + learning:
        warm.prefill(p)
    warm.store.flush()  # before the folder is copied
    print(f"warmed {len({tuple(x) for p in prompts + learning for x in p[1:-1]})} passages in {time.perf_counter() - t0:.0f} s",
          flush=True)
    for i, (label, r, sel, bound) in enumerate(settings):
        where = folder
        if args.own_stores:
            where = f"{folder}-{i}"
            shutil.copytree(folder, where)
        if bound is not None and learning:
            learner = ChunkCache(model, tok, PromptStore(where, memory_bytes=0), recompute=r, select=sel, max_kl=bound)
            for p in learning:
                learner.prefill(p)
            learner.store.close()
            print(f"{label}: learned on {len(learning)} prompts", flush=True)
        if where != folder or (bound is not None and learning):  # made again: only the store carries over
            caches[label] = ChunkCache(model, tok, PromptStore(where, memory_bytes=0), recompute=r, select=sel,
                                       max_kl=bound)
    rows: dict[str, dict[str, list[float]]] = {label: {"kl": [], "top1": [], "decisive": [], "greedy_all": [],
                                                       "greedy_lead": [], "ttft": [], "full": [], "estimate": [],
                                                       "fraction": [], "store": []} for label, *_ in settings}
    for n, p in enumerate(prompts):
        ids = [t for seg in p for t in seg]
        with torch.no_grad():
            t0 = time.perf_counter()
            out = model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
            full_s = time.perf_counter() - t0
        ref = out.logits[0, -1].float()
        ref_lp = torch.log_softmax(ref, -1)
        top2 = torch.topk(ref, 2).values
        decisive = float(top2[0] - top2[1]) >= 0.5
        ref_greedy = greedy(model, out.cache, out.logits[0, -1], args.greedy) if args.greedy else []
        for label, *_ in settings:
            cc = caches[label]
            t0 = time.perf_counter()
            cache, logits = cc.prefill(p)
            seconds = time.perf_counter() - t0
            # What the request stores is written after it returns, in the store's writer thread: finished here,
            # untimed, so that it is not charged to the next setting's request (timed apart as store_s).
            t1 = time.perf_counter()
            cc.store.flush()
            rows[label]["store"].append(time.perf_counter() - t1)
            lp = torch.log_softmax(logits.float(), -1)
            r = rows[label]
            r["kl"].append(float((ref_lp.exp() * (ref_lp - lp)).sum()))
            r["top1"].append(float(int(logits.argmax()) == int(ref.argmax())))
            r["decisive"].append(float(decisive))
            g = greedy(model, cache, logits, args.greedy) if args.greedy else []
            lead = next((i for i, (a, b) in enumerate(zip(g, ref_greedy, strict=True)) if a != b), len(g))
            r["greedy_all"].append(float(lead == len(g)))
            r["greedy_lead"].append(float(lead))
            r["ttft"].append(seconds)
            r["full"].append(full_s)
            last = cc.stats["last"]
            r["estimate"].append(last.get("estimate", float("nan")))
            r["fraction"].append(last.get("fraction", float("nan")))
        if (n + 1) % 10 == 0 or n + 1 == len(prompts):
            print(f"{n + 1}/{len(prompts)} prompts", flush=True)
            summarise(rows, settings, n + 1, args)  # written as it goes: a stopped run keeps what it measured


def summarise(rows: dict, settings: list, done: int, args: argparse.Namespace) -> None:
    """Per-setting figures over the prompts done so far, printed and written to chunk_quality_{k}x{tokens}.json."""
    k = args.passages
    results = {}
    for label, recompute, select, bound in settings:
        r = {key: np.array(v, dtype=float) for key, v in rows[label].items()}
        dec = r["decisive"] == 1
        results[label] = {
            "recompute": recompute, "select": select, "prompts": done, "decisive": int(dec.sum()),
            "top1_decisive": float(r["top1"][dec].mean()) if dec.any() else None,
            "top1_near_tie": float(r["top1"][~dec].mean()) if (~dec).any() else None,
            "top1_all": float(r["top1"].mean()),
            "kl_mean": float(r["kl"].mean()), "kl_p90": float(np.percentile(r["kl"], 90)),
            "greedy_all": float(r["greedy_all"].mean()), "greedy_lead": float(r["greedy_lead"].mean()),
            "ttft_s": statistics.median(r["ttft"]), "full_s": statistics.median(r["full"]),
            "speedup": statistics.median(np.array(r["full"]) / np.array(r["ttft"])),
            "ttft_all": r["ttft"].tolist(), "store_s": statistics.median(r["store"]), "max_kl": bound, "fraction_mean": float(np.nanmean(r["fraction"])) if np.isfinite(r["fraction"]).any() else None,
        }
        if bound is not None:
            est = r["estimate"]
            ok = np.isfinite(est)
            results[label]["guard"] = {
                "violations": float((r["kl"][ok] > bound).mean()) if ok.any() else None,
                "spearman": _spearman(est[ok], r["kl"][ok]) if ok.sum() > 2 else None,
                "estimate_mean": float(est[ok].mean()) if ok.any() else None,
                "exact": float((r["fraction"] >= 1.0).mean()),
                "per_prompt": {"kl": r["kl"].tolist(), "estimate": [float(e) for e in est],
                               "fraction": r["fraction"].tolist()},
            }
        x = results[label]
        print(f"{label:24s} TTFT {x['ttft_s'] * 1000:6.0f} ms  full {x['full_s']:.2f} s  {x['speedup']:5.1f}x  "
              f"top-1 decisive {x['top1_decisive'] or 0:.1%} ({x['decisive']})  near-tie {x['top1_near_tie'] or 0:.1%}  "
              f"KL {x['kl_mean']:.4f} (p90 {x['kl_p90']:.4f})  greedy {args.greedy} all {x['greedy_all']:.0%} "
              f"lead {x['greedy_lead']:.1f}" + (f"  fraction {x['fraction_mean']:.2f}" if x["fraction_mean"] else "")
              + (f"  guard: true KL > {bound} in {x['guard']['violations']:.0%}, spearman {x['guard']['spearman']:.2f}"
                 if bound is not None and x["guard"]["violations"] is not None and x["guard"]["spearman"] is not None
                 else ""), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "chunk_quality" if args.set == "chat" else f"chunk_quality_{args.set}"
    path = args.out / f"{name}_{k}x{args.tokens}.json"
    path.write_text(json.dumps({"machine": machine(), "set": args.set, "passages": k, "tokens": args.tokens,
                                "greedy": args.greedy, "prompts": done, "results": results}, indent=1))
    print(f"wrote {path}")


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


if __name__ == "__main__":
    main()
