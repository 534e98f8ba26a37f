"""Helpers shared by the benchmarks: describe the machine, draw plain bar charts."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from pathlib import Path

# The same throwaway redis-server the tests start (tests/redis_server.py, standard library only).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from redis_server import RedisServer  # noqa: E402,F401 - re-exported for store_bench

LIBRARY_FOLDERS = ("promptstore", "llm", "vision", "live", "vllm_connector")


def compile_library() -> bool:
    """Compile the library's modules to bytecode where it is missing or stale; whether all compiled.

    The benchmarks time fresh processes, which should run what an installed package runs: pip compiles
    a package's modules when it installs them, and an editable install writes their bytecode on first
    import, except where PYTHONDONTWRITEBYTECODE is set (as on the machines this project is measured on).
    Without it a process compiles every module it imports from source, inside whichever call first
    imports it (promptstore's live-identity modules: 13-15 ms of a CLIP pipeline's first call).
    """
    import compileall

    root = Path(__file__).resolve().parent.parent
    return all(compileall.compile_dir(str(root / name), quiet=1) for name in LIBRARY_FOLDERS if (root / name).is_dir())


BYTECODE = compile_library()


def ttft_parser(doc: str | None) -> argparse.ArgumentParser:
    """The options both TTFT benchmarks take; each runs its fresh-process measurement as ``--child --length N``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2000, 4000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    return parser


def commit() -> str | None:
    """The checkout's commit, "+changes" appended where tracked files differ from it (None outside a git
    checkout): bench/report.py stamps each section with it."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                 capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+changes" if changed else "")


def machine() -> dict:
    """Cores, CPU model, memory, Python and (if importable) torch versions, and the checkout's commit."""
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    except (ValueError, OSError):
        mem_gib = float("nan")
    info = {"cores": os.cpu_count(), "cpu": cpu, "memory_gib": round(mem_gib, 1),
            "python": platform.python_version(), "platform": platform.platform(), "commit": commit(),
            "bytecode_compiled": BYTECODE}
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    info["summary"] = f"{info['cores']} cores ({cpu}), {info['memory_gib']} GiB, Python {info['python']}" + (
        f", torch {info['torch']}" if "torch" in info else "")
    return info


def save_bar_chart(path: Path, title: str, groups: list[str], series: dict[str, list[float]], ylabel: str,
                   log: bool = False) -> None:
    """Grouped bars: one group per x label, one bar per series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(len(series), 1)
    x = np.arange(len(groups))
    for i, (name, values) in enumerate(series.items()):
        bars = ax.bar(x + i * width - 0.4 + width / 2, values, width, label=name)
        ax.bar_label(bars, fmt="%.2g", fontsize=7)
    ax.set_xticks(x, groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save_results(out: str | Path, repeats: int, rows: list[dict], info: dict | None = None) -> None:
    """A benchmark's rows as JSON, stamped with the machine and the date (written again after each row
    by the benchmarks that can be interrupted)."""
    import json
    import time

    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": info or machine(), "date": time.strftime("%Y-%m-%d"), "repeats": repeats,
                                "rows": rows}, indent=2))

