"""Real processes on one folder: writers killed mid-write, and concurrent readers and writers."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from promptstore import PromptStore

# Entry i holds rng(i) data, so any process can check any entry's exact content.
WRITER = """
import os, sys, numpy as np
from promptstore import PromptStore
path, log, start = sys.argv[1], sys.argv[2], int(sys.argv[3])
store = PromptStore(path, memory_bytes=0, disk_bytes="24MiB")
with open(log, "a", buffering=1) as out:
    for i in range(start, start + 100000):
        n = 64 if i % 3 else 200_000  # mix of 256 B and 800 KB entries; evictions happen
        x = np.random.default_rng(i).standard_normal(n).astype(np.float32)
        store.put(store.key("crash", str(i)), {"x": x}, kind="crash", cost_s=0.001 * (i % 7),
                  parent=store.key("crash", str(i - 1)) if i % 5 else None)
        if i % 50 == 0:
            store.gc()
        out.write(f"{i}\\n")  # written only after put returned
"""


def expected(i: int) -> np.ndarray:
    n = 64 if i % 3 else 200_000
    return np.random.default_rng(i).standard_normal(n).astype(np.float32)


def check_after_kill(path: Path, log: Path) -> int:
    done = [int(x) for x in log.read_text().split()]
    with PromptStore(path, memory_bytes=0, disk_bytes="24MiB") as s:
        alive = 0
        for i in done:
            e = s.get(s.key("crash", str(i)))
            if e is not None:  # it may have been evicted since, never damaged
                assert e.tensors["x"].tobytes() == expected(i).tobytes(), i
                alive += 1
        report = s.verify()
        assert report["ok"], report["problems"]
        s.gc()
        leftovers = [p for p in path.rglob("*.partial")]
        assert leftovers == []
        assert s.stats()["tiers"]["disk"]["bytes"] <= 24 * 1024**2
    return alive


def kill_writer_repeatedly(tmp_path: Path, rounds: int, seed: int) -> int:
    rng = random.Random(seed)
    path, log = tmp_path / "store", tmp_path / "done.log"
    start, kills = 0, 0
    for _ in range(rounds):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(log), str(start)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        # Let it get going (imports take ~0.3 s), then kill at a random moment.
        time.sleep(0.5 + rng.random() * 1.0)
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate()
        assert proc.returncode == -signal.SIGKILL, err.decode()
        kills += 1
        check_after_kill(path, log)
        start += 100000
    return kills


def test_sigkill_mid_write_leaves_no_partial_entry(tmp_path):
    assert kill_writer_repeatedly(tmp_path, rounds=4, seed=1) == 4


@pytest.mark.slow
def test_sigkill_many_times(tmp_path):
    assert kill_writer_repeatedly(tmp_path, rounds=40, seed=2) == 40


WORKER = """
import sys, numpy as np
from promptstore import PromptStore
path, wid, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = PromptStore(path, memory_bytes="256KiB", disk_bytes="2MiB")
rng = np.random.default_rng(wid)
hits = 0
for step in range(n):
    i = int(rng.integers(0, 300))
    k = s.key("conc", str(i))
    op = rng.random()
    if op < 0.45:
        x = np.random.default_rng(i).standard_normal(16 + 40 * (i % 50)).astype(np.float32)
        s.put(k, {"x": x}, kind="conc", cost_s=float(i % 4))
    elif op < 0.9:
        e = s.get(k)
        if e is not None:
            want = np.random.default_rng(i).standard_normal(16 + 40 * (i % 50)).astype(np.float32)
            assert e.tensors["x"].tobytes() == want.tobytes(), (wid, step, i)
            hits += 1
    elif op < 0.97:
        s.delete(k)
    else:
        s.gc()
print(hits)
"""


def test_processes_share_one_folder(tmp_path):
    path = tmp_path / "store"
    PromptStore(path, memory_bytes=0, disk_bytes="2MiB").close()
    procs = [subprocess.Popen([sys.executable, "-W", "error::promptstore.errors.PromptStoreWarning", "-c", WORKER,
                               str(path), str(w), "1500"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for w in range(4)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    assert sum(int(o.strip()) for o, _ in outs) > 100  # they did read each other's entries
    with PromptStore(path, memory_bytes=0) as s:
        assert s.verify()["ok"]
        assert s.stats()["tiers"]["disk"]["bytes"] <= 2 * 1024**2


def test_threads_share_one_store(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    with PromptStore(tmp_path / "s", memory_bytes="64KiB", disk_bytes="512KiB") as s:
        def work(wid: int) -> int:
            rng = np.random.default_rng(wid)
            hits = 0
            for _ in range(400):
                i = int(rng.integers(0, 100))
                k = s.key("th", str(i))
                x = np.full(10 + i, i, np.float32)
                if rng.random() < 0.5:
                    s.put(k, {"x": x}, kind="th")
                else:
                    e = s.get(k)
                    if e is not None:
                        assert e.tensors["x"].tobytes() == x.tobytes()
                        hits += 1
            return hits

        with ThreadPoolExecutor(4) as ex:
            assert sum(ex.map(work, range(4))) > 0
        assert s.verify()["ok"]
