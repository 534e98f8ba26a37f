"""The promptstore command, run as a real subprocess through its console script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from promptstore import PromptStore


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    exe = shutil.which("promptstore", path=str(Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, "-m", "promptstore"]
    proc = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture
def folder(tmp_path):
    path = tmp_path / "store"
    with PromptStore(path, memory_bytes=0, disk_bytes="10MiB") as s:
        for i in range(5):
            s.put(s.key("vision.text", str(i)), {"e": np.ones(512, np.float32)}, kind="vision.text", cost_s=0.2)
        s.put(s.key("llm.kv", "b0"), {"k": np.ones(4096, np.float32)}, kind="llm.kv", cost_s=1.0)
        s.get(s.key("vision.text", "0"))
        s.get(s.key("vision.text", "missing"), kind="vision.text")
    return path


def test_stats(folder):
    out = cli("--dir", str(folder), "stats").stdout
    assert "6 entries" in out and "MiB" in out and "vision.text" not in out  # lifetime counters are everyone's
    assert "vision.text" in cli("--dir", str(folder), "stats", "--all-namespaces").stdout
    data = json.loads(cli("stats", "--dir", str(folder), "--json", "--all-namespaces").stdout)
    assert data["entries"] == 6 and data["budget"] == 10 * 1024**2
    assert data["lifetime"]["kinds"]["vision.text"] == {"hits": 1, "misses": 1, "hit_bytes": data["lifetime"]["kinds"]["vision.text"]["hit_bytes"], "seconds_saved": pytest.approx(0.2)}


def test_ls(folder):
    rows = json.loads(cli("--dir", str(folder), "--json", "ls").stdout)
    assert len(rows) == 6 and {r["kind"] for r in rows} == {"vision.text", "llm.kv"}
    assert len(json.loads(cli("--dir", str(folder), "--json", "ls", "--kind", "llm.kv").stdout)) == 1
    text = cli("--dir", str(folder), "ls", "--limit", "2").stdout.splitlines()
    assert len(text) == 3 and "KiB" in text[1]


def test_verify_and_gc(folder):
    assert "ok" in cli("--dir", str(folder), "verify").stdout
    victim = next((folder / "entries").rglob("*.safetensors"))
    victim.write_bytes(b"garbage")
    bad = cli("--dir", str(folder), "verify", check=False)
    assert bad.returncode == 1 and "PROBLEMS" in bad.stdout
    assert cli("--dir", str(folder), "verify").returncode == 0  # the bad entry was dropped
    report = json.loads(cli("--dir", str(folder), "--json", "gc").stdout)
    assert report["tiers"][0]["tier"] == "disk"


def test_export_import(folder, tmp_path):
    bundle = tmp_path / "b.psb"
    assert "wrote 5 entries" in cli("--dir", str(folder), "export", str(bundle), "--kind", "vision.text").stdout
    other = tmp_path / "other"
    assert "imported 5 entries" in cli("--dir", str(other), "import", str(bundle)).stdout
    assert len(json.loads(cli("--dir", str(other), "--json", "ls").stdout)) == 5


def test_errors_are_clear(tmp_path):
    proc = cli("--dir", str(tmp_path / "nothing"), "stats", check=False)
    assert proc.returncode == 2 and "no store at" in proc.stderr
    bad = tmp_path / "bad.psb"
    bad.write_bytes(b"nope")
    proc = cli("--dir", str(tmp_path / "s"), "import", str(bad), check=False)
    assert proc.returncode == 2 and "not a readable bundle" in proc.stderr
    proc = cli("frobnicate", check=False)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_export_takes_the_keys_ls_prints(folder, tmp_path):
    """Issue #13: ls prints 16-character keys; export --key needed all 64, and an unknown key 'wrote 0 entries'."""
    short = cli("--dir", str(folder), "ls", "--kind", "vision.text").stdout.splitlines()[1].split()[0]
    assert len(short) == 16
    out = cli("--dir", str(folder), "export", str(tmp_path / "one.psb"), "--key", short).stdout
    assert "wrote 1 entry " in out
    unknown = cli("--dir", str(folder), "export", str(tmp_path / "x.psb"), "--key", "ffffffffffffffff", check=False)
    assert unknown.returncode == 2 and "no entry" in unknown.stderr and not (tmp_path / "x.psb").exists()
    vague = cli("--dir", str(folder), "export", str(tmp_path / "y.psb"), "--key", "abc", check=False)
    assert vague.returncode == 2 and "8 hex characters" in vague.stderr


def test_warnings_are_one_line(tmp_path):
    """A corrupt entry's warning shows its message, not a line of promptstore's source."""
    from promptstore import PromptStore

    with PromptStore(tmp_path / "s", memory_bytes=0) as s:
        key = s.key("t", "x")
        s.put(key, {"x": np.ones(4, np.float32)}, kind="t")
    (f,) = (tmp_path / "s" / "entries").rglob("*.safetensors")
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    proc = cli("--dir", str(tmp_path / "s"), "verify", check=False)
    warning_lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert warning_lines and all(line.startswith("promptstore: warning: ") for line in warning_lines), proc.stderr
