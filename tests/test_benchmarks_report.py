"""BENCHMARKS.md says it is generated: it is exactly what bench/report.py writes from bench/results/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_benchmarks_md_is_what_report_py_writes_from_the_committed_results(tmp_path: Path) -> None:
    out = tmp_path / "BENCHMARKS.md"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "report.py"), "--no-plots", "--out", str(out)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert out.read_text() == (REPO / "BENCHMARKS.md").read_text(), (
        "BENCHMARKS.md differs from what bench/report.py writes: change bench/report.py or bench/results/, "
        "then run `python bench/report.py`")
