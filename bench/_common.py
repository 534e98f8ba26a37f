"""Helpers shared by the benchmarks: describe the machine, draw plain bar charts."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path


def machine() -> dict:
    """Cores, CPU model, memory, Python and (if importable) torch versions."""
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
            "python": platform.python_version(), "platform": platform.platform()}
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


class RedisServer:
    """A throwaway redis-server on a free loopback port (for the Redis rows)."""

    def __init__(self) -> None:
        import shutil
        import socket
        import tempfile

        self.exe = shutil.which("redis-server")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.folder = tempfile.mkdtemp(prefix="ps-bench-redis-")
        self.proc = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def __enter__(self) -> RedisServer:
        import socket
        import time

        if self.exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.proc = subprocess.Popen([self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.folder,
                                      "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        for _ in range(200):
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.1):
                    return self
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
