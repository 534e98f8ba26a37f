"""Compose BENCHMARKS.md and its plots from the JSON the benchmarks wrote into bench/out/.

    python bench/report.py      (make bench runs every benchmark, then this)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

BENCH = Path(__file__).resolve().parent
OUT, PLOTS, ROOT = BENCH / "out", BENCH / "plots", BENCH.parent


def load(name: str) -> dict | None:
    path = OUT / name
    return json.loads(path.read_text()) if path.exists() else None


def finish(fig, ax, path: Path, title: str, xlabel: str, ylabel: str, xticks: list[int] | None = None,
           logy: bool = True, legend_loc: str = "best") -> None:
    """Log x (and y) axes, labels, grid and legend, then write the PNG: every line plot here looks alike."""
    ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    if xticks:
        ax.set_xticks(xticks, [str(x) for x in xticks])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7 if legend_loc == "upper left" else 8, loc=legend_loc)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def ttft_plot(llm: dict, llama: dict | None, path: Path = PLOTS / "llm_ttft.png") -> str:
    """TTFT against prefix length, log-log: every contender of llm_ttft.py (and llama.cpp's when measured)."""
    res = llm["results"]
    blocks = sorted({r["block_tokens"] for r in res.values()})
    xs = sorted({int(k.split("/")[0]) for k in res})
    fig, ax = plt.subplots(figsize=(8, 4.8))
    first = [res[f"{x}/{blocks[0]}"] for x in xs]
    ax.plot(xs, [r["full prefill"] for r in first], "o-", label="full prefill (transformers)")
    ax.plot(xs, [r["deepcopy (seed, in process)"] for r in first], "s-", label="deepcopy of a DynamicCache (in process)")
    for b, style in zip(blocks, ["-", "--", "-.", (0, (5, 1))], strict=False):
        rows = [res[f"{x}/{b}"] for x in xs]
        ax.plot(xs, [r["promptstore memory"] for r in rows], style, marker="D", label=f"promptstore memory tier, blocks of {b}")
        ax.plot(xs, [r["promptstore disk (fresh process)"] for r in rows], style, marker="^",
                label=f"promptstore disk tier, fresh process, blocks of {b}")
    if llama:
        lx = sorted(int(k) for k in llama["rows"])
        for name, marker in (("cold prompt", "x"), ("RAM cache hit", "v"), ("disk cache hit (fresh process)", "P")):
            ax.plot(lx, [llama["rows"][str(x)][name] for x in lx], ":", marker=marker, label=f"llama.cpp {name}")
    finish(fig, ax, path, "SmolLM2-135M on 2 CPU cores: TTFT against prefix length",
           "shared prefix length (tokens), plus a 14-token question", "time to first token (s)", xticks=xs,
           legend_loc="upper left")
    return "bench/plots/llm_ttft.png"


def scaling_plots(sc: dict) -> tuple[str, str]:
    st = sc["store"]
    ns = sorted(int(n) for n in st)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(ns, [st[str(n)]["hit_us"] for n in ns], "o-", label="get, hit (2 KB entry)")
    ax.plot(ns, [st[str(n)]["miss_us"] for n in ns], "s-", label="get, miss")
    ax.set_ylim(bottom=0)
    finish(fig, ax, PLOTS / "store_scaling.png", "Disk-tier get latency against store size", "entries in the disk tier",
           "latency per get (µs)", logy=False)
    vi = sc["vision"]
    vs = sorted(int(n) for n in vi)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(vs, [vi[str(n)]["miss"] for n in vs], "o-", label="miss: build encoder, encode, store")
    ax.plot(vs, [vi[str(n)]["warm_reordered"] for n in vs], "s-", label="warm, per-name hits (new order), fresh process")
    ax.plot(vs, [vi[str(n)]["warm_same"] for n in vs], "D-", label="warm, same vocabulary (one entry), fresh process")
    finish(fig, ax, PLOTS / "vision_scaling.png", "YOLOE set_classes against vocabulary size", "class names",
           "set_classes (s)", xticks=vs)
    return "bench/plots/store_scaling.png", "bench/plots/vision_scaling.png"


DISK = "promptstore disk (fresh process)"


def best_disk(llm: dict, length: int | str) -> dict | None:
    """The row of the block size whose fresh-process disk hit was fastest at this prefix length."""
    rows = [r for k, r in llm["results"].items() if k.split("/")[0] == str(length)]
    return min(rows, key=lambda r: r[DISK]) if rows else None


def headline(llm: dict | None, llama: dict | None, vision: dict | None, store: dict | None) -> list[str]:
    """The issue's goals against this run's figures: one row each, met or not, nothing hidden."""
    rows: list[tuple[str, str, bool | None]] = []
    if llm:
        for length, target in ((2000, 30.0),):
            best = best_disk(llm, length)
            if best:
                ratio = best["full prefill"] / best[DISK]
                dc = best["full prefill"] / best["deepcopy (seed, in process)"]
                rows.append((f"promptstore disk hit (fresh process) >= {target:.0f}x faster than full prefill at {length} "
                             "tokens", f"{ratio:.1f}x (blocks of {best['block_tokens']}; the in-process deepcopy pattern: "
                             f"{dc:.1f}x)", ratio >= target))
        if llama:
            for length, row in llama["rows"].items():
                ours = best_disk(llm, length)
                if ours:
                    ratio = row["disk cache hit (fresh process)"] / ours[DISK]
                    rows.append((f"promptstore disk hit >= 3x faster than llama-cpp-python's disk-cache hit, {length} "
                                 "tokens", f"{ratio:.2f}x", ratio >= 3.0))
    if vision:
        for name, r in vision["results"].items():
            warm = r["promptstore warm hit (fresh process, disk)"]
            rows.append((f"{name}: warm set_classes vs ultralytics' encoder path",
                         f"{r['ultralytics-style cold path'] / warm:,.0f}x faster; "
                         f"{r['ultralytics NPZ load'] / warm:.1f}x faster than loading ultralytics' NPZ", None))
    if store:
        four = store["results"]["4MB"]
        disk, npl = four["promptstore disk"]["get_s"], four["np.save/np.load"]["get_s"]
        rows.append(("store: 4 MB disk-tier get vs np.load (checksum verified)", f"{npl / disk:.2f}x np.load's speed", None))
        if "promptstore redis (loopback)" in four:
            rows.append(("store: 4 MB Redis get within 3x of a disk-tier get",
                         f"{four['promptstore redis (loopback)']['get_s'] / disk:.2f}x the disk tier's time",
                         four["promptstore redis (loopback)"]["get_s"] <= 3 * disk))
    if not rows:
        return []
    out = ["## Headline", "", "| goal or comparison | this run | met |", "|---|---|---|"]
    out += [f"| {g} | {m} | {'-' if ok is None else 'yes' if ok else '**no**'} |" for g, m, ok in rows]
    out += ["", "What bounds the LLM rows: after a hit, the time to first token is the KV load plus one forward pass over "
            "the tokens not cached (the question, and the prefix's last partial block). The deepcopy pattern loads nothing "
            "and computes only the question, so its speed-up is the ceiling any cache reaches with transformers here; "
            "promptstore's disk hit comes within the KV load of it. llama.cpp's disk-cache hit is bound the same way, so "
            "the two land near parity rather than 3x apart.", ""]
    return out


def main() -> None:
    PLOTS.mkdir(parents=True, exist_ok=True)
    store, llm, llama, vision, scaling = (load(n) for n in ("store_bench.json", "llm_ttft.json", "llama_cpp.json",
                                                            "vision_bench.json", "scaling.json"))
    m = (store or llm or vision or {}).get("machine", {})
    lines = ["# Benchmarks", "",
             "Generated by `make bench` (bench/run_all.py, then bench/report.py). Every figure is a median over repeats or "
             "a ratio measured side by side in the same run, on this machine:", "",
             f"- {m.get('cores')} cores ({m.get('cpu')}), {m.get('memory_gib')} GiB, Python {m.get('python')}, "
             f"torch {m.get('torch', '?')} ({m.get('torch_threads', '?')} threads), {m.get('platform')}", "",
             "Timings on these shared VMs are noisy: read the ratios, not the absolute times.", ""]
    lines += headline(llm, llama, vision, store)
    if llm:
        lines += ["## LLM prefix reuse (SmolLM2-135M-Instruct, fp32, transformers)", "",
                  "Shared prefix (a long document) plus a 14-token question; TTFT = the call that returns the first "
                  "token's scores. promptstore's disk row runs in a fresh process with the memory tier off.", "",
                  llm["table"], ""]
        if llama:
            lines += [f"llama-cpp-python {llama['version']} on the same GGUF file (its Q4_1 weights as they are; "
                      "transformers dequantizes them to fp32) and the same prompts; its caches are consulted by "
                      "create_completion, and its disk-cache hit runs in a fresh process like ours:", "",
                      "| prefix tokens | llama.cpp cold | RAM cache hit | disk cache hit (fresh process) | "
                      "promptstore disk hit (fresh process, best block size) | promptstore speed / llama.cpp's |",
                      "|---:|---:|---:|---:|---:|---:|"]
            for length, row in llama["rows"].items():
                ours = best_disk(llm, length)
                if not ours:
                    lines.append(f"| {length} | {row['cold prompt'] * 1000:.0f} ms | - | - | - | - |")
                    continue
                ratio = row["disk cache hit (fresh process)"] / ours[DISK]
                lines.append(f"| {length} | {row['cold prompt'] * 1000:.0f} ms | {row['RAM cache hit'] * 1000:.0f} ms | "
                             f"{row['disk cache hit (fresh process)'] * 1000:.0f} ms | "
                             f"{ours[DISK] * 1000:.0f} ms ({ours['block_tokens']}) | "
                             f"{ratio:.2f}x |")
            lines.append("")
        else:
            lines += ["llama-cpp-python was not measured in this run (`make bench LLAMA_CPP=1` installs it: it builds "
                      "llama.cpp from source, about 5 minutes).", ""]
        lines += [f"![TTFT against prefix length]({ttft_plot(llm, llama)})", ""]
    if vision:
        shutil.copy(OUT / "vision_bench.png", PLOTS / "vision_bench.png")
        lines += ["## Vision class prompts (YOLOE-11s-seg, MobileCLIP2-B text tower)", "", vision["table"], "",
                  "![set_classes](bench/plots/vision_bench.png)", ""]
    if store:
        shutil.copy(OUT / "store_bench.png", PLOTS / "store_bench.png")
        lines += ["## Store", "", "get and put of 2 KB and 4 MB entries against diskcache, one np.save/np.load file per "
                  "key, and Redis on loopback:", "", store["table"], "", "![store](bench/plots/store_bench.png)", ""]
    if scaling:
        sp, vp = scaling_plots(scaling)
        lines += ["## Scaling", "", "| entries in the disk tier | get hit | get miss |", "|---:|---:|---:|"]
        for n, r in sorted(scaling["store"].items(), key=lambda kv: int(kv[0])):
            lines.append(f"| {int(n):,} | {r['hit_us']:.0f} µs | {r['miss_us']:.0f} µs |")
        lines += ["", f"![store scaling]({sp})", "", "| class names | miss | warm, per-name hits | warm, same vocabulary |",
                  "|---:|---:|---:|---:|"]
        for n, r in sorted(scaling["vision"].items(), key=lambda kv: int(kv[0])):
            lines.append(f"| {n} | {r['miss']:.2f} s | {r['warm_reordered'] * 1000:.1f} ms | {r['warm_same'] * 1000:.1f} ms |")
        lines += ["", f"![vision scaling]({vp})", ""]
    (ROOT / "BENCHMARKS.md").write_text("\n".join(lines))
    print(f"wrote {ROOT / 'BENCHMARKS.md'} and {PLOTS}/")


if __name__ == "__main__":
    main()
