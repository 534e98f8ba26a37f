"""vLLM with promptstore as its KV connector: the first request of a restarted engine, against vLLM alone.

    python bench/vllm_bench.py [--lengths 2000 8000] [--dtypes float32 bfloat16] [--repeats 3]
                               [--restarts 3] [--vllm-python PATH] [--out bench/results/vllm_bench.json]

Runs with the main venv's Python; every engine runs in a fresh process of vLLM's venv
(``make vllm-venv``; default ``$PROMPTSTORE_VLLM_PYTHON``), SmolLM2-135M-Instruct, ``enforce_eager``,
``max_tokens=1`` (time to the first token through ``LLM.generate``, after the engine is built), greedy, no
logprobs: vLLM compiles its logprob gather (torch.compile, about 2 s on this CPU) during the first request of
an engine that asks for them, with or without a connector, which would hide what a restart costs in every
first-request column (tests/test_vllm.py compares logprobs).
Per dtype, ``--repeats`` documents per length (each a document plus a question), one engine each:

  cold               vLLM alone, a document it has never seen
  vLLM hit           vLLM alone, the same document with another question right after (its own
                     in-process prefix cache: the floor for an engine); also apart, the first such hit of
                     the engine, which pays vLLM's own first use of its cached-prefix path, as a
                     restarted engine's first request does
  cold + store       an engine with the connector computing and storing a new document (what
                     storing costs a request)
  restarted (disk)   ``--restarts`` fresh engines on the same folder, each asking another question on
                     each document, starting at a different one: the median of their first requests,
                     and apart the median of the others
  other host (Redis) a fresh engine with an empty folder of its own and the same Redis: the same

Greedy first tokens are compared with vLLM alone; hits whose check failed are counted from the engines'
warnings (each is recomputed by vLLM; the model here is the one its keys name, so any is a false alarm).
Bytes per stored token: the store's bytes over the
tokens its blocks hold.

With ``--lmcache-python PATH`` (a Python that has vLLM and LMCache; this benchmark does not install
LMCache), two more rows per length: vLLM's ``LMCacheConnectorV1`` with LMCache's local CPU and disk
backends, cold with storing, then a restarted engine on the same disk folder (another question).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT / "tests"))
from _common import machine, save_results  # noqa: E402

TEXT = ("Manual {d}, section {i}: forklifts of fleet {d} are parked in bay C after each shift and charged overnight; "
        "pallets over 800 kg go to aisle 4 on the ground racks; hazardous goods stay behind the fence near door 9. ")
QUESTIONS = ["\nQuestion: Where do forklifts park?\nAnswer:", "\nQuestion: Which aisle takes heavy pallets?\nAnswer:"]


# The connector's methods timed in an in-process engine, and what each is ("save", the step's end, runs "check").
TIMED = {"start_load_kv": "load", "_check_loads": "check", "get_num_new_matched_tokens": "lookup",
         "build_connector_meta": "plan", "wait_for_save": "save"}


def connector_timers() -> dict[str, float]:
    """Time the connector's methods (``TIMED``) in this process from now on: seconds per part, summed."""
    import collections
    import functools

    import promptstore.vllm as connector

    spent: dict[str, float] = collections.defaultdict(float)

    def timed(name: str) -> None:
        fn = getattr(connector.PromptStoreConnector, name)

        @functools.wraps(fn)
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[TIMED[name]] += time.perf_counter() - t0

        setattr(connector.PromptStoreConnector, name, run)

    for name in TIMED:
        timed(name)
    return spent


def engine_child(spec: dict) -> None:
    """In vLLM's venv: build one engine, then time each prompt's first token (and with ``spec["timed"]``
    the connector's own parts of it)."""
    spent = connector_timers() if spec.get("timed") else None
    if spec.get("lmcache"):  # LMCache reads its settings from the environment
        os.environ.update({"LMCACHE_CHUNK_SIZE": "256", "LMCACHE_LOCAL_CPU": "True", "LMCACHE_MAX_LOCAL_CPU_SIZE": "4",
                           "LMCACHE_LOCAL_DISK": f"file://{spec['lmcache']}/", "LMCACHE_MAX_LOCAL_DISK_SIZE": "8"})
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs = {}
    if spec.get("lmcache"):
        kwargs["kv_transfer_config"] = KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both")
    elif spec["connector"] is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="PromptStoreConnector", kv_connector_module_path="promptstore.vllm", kv_role="kv_both",
            kv_connector_extra_config=spec["connector"])
    llm = LLM(spec["model"], dtype=spec["dtype"], enforce_eager=True, max_model_len=8192, seed=0, **kwargs)
    params = SamplingParams(max_tokens=1, temperature=0)
    rows = []
    for ids in spec["prompts"]:
        if spent is not None:
            spent.clear()
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - t0
        rows.append({"s": seconds, "token": out.outputs[0].token_ids[0], "cached": out.num_cached_tokens or 0,
                     **({"parts": dict(spent)} if spent is not None else {})})
    print("RESULTS " + json.dumps(rows), flush=True)


def documents(tokenizer, length: int, repeats: int) -> list[list[list[int]]]:
    """Per repeat: [document + question 0, document + question 1], each ``length`` tokens or so."""
    out = []
    for d in range(repeats):
        text = "".join(TEXT.format(d=d + 1, i=i) for i in range(1, 400))
        doc = tokenizer(text)["input_ids"][: length - 16]
        out.append([doc + tokenizer(q)["input_ids"] for q in QUESTIONS])
    return out


def run_engine(args: argparse.Namespace, site: str, model: str, dtype: str, prompts: list[list[int]],
               connector: dict | None, lmcache: str | None = None, in_process: bool = False) -> list[dict]:
    """One engine in a fresh process of vLLM's venv; ``in_process``: vLLM's engine core in that same process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where the connector's methods are timed (each row's "parts")."""
    spec = Path(site).parent / "spec.json"  # token ids: too long for a command line
    spec.write_text(json.dumps({"model": model, "dtype": dtype, "prompts": prompts, "connector": connector,
                                "lmcache": lmcache, "timed": in_process and connector is not None}))
    python = args.lmcache_python if lmcache else args.vllm_python
    env = {**os.environ, "PYTHONPATH": site, **({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if in_process else {})}
    proc = subprocess.run([python, __file__, "--engine", str(spec)], capture_output=True, text=True,
                          env=env, timeout=3600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    if proc.returncode or not lines:
        raise SystemExit(f"engine failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    rows = json.loads(lines[-1][len("RESULTS "):])
    # A hit whose check failed (a false alarm here: the engine runs the model its key names) is recomputed.
    rows[0]["refuted"] = proc.stderr.count("differs from what this engine computes")
    return rows


def prepare(args: argparse.Namespace, prefix: str) -> tuple[Any, str, Path, Path]:
    """SmolLM2's tokenizer and model folder, a scratch folder, and in it the site vLLM's venv imports
    promptstore from (the core, with the connector as ``promptstore.vllm``)."""
    if not args.vllm_python:
        raise SystemExit("name vLLM's venv Python: --vllm-python or PROMPTSTORE_VLLM_PYTHON (make vllm-venv builds it)")
    from promptstore.llm import load_model, models_dir

    _, tokenizer = load_model()
    model = str(sorted(Path(models_dir()).glob("smollm2-135m-instruct*"))[0])
    work = Path(tempfile.mkdtemp(prefix=prefix))
    site = work / "site"
    shutil.copytree(ROOT / "promptstore", site / "promptstore")
    shutil.copytree(ROOT / "vllm_connector", site / "promptstore" / "vllm")
    return tokenizer, model, work, site


def settle(folder: Path, quiet_s: float = 3.0) -> None:
    from vllm_engine import settle as wait

    wait(str(folder), quiet_s=quiet_s, limit_s=600)


def save(args: argparse.Namespace, rows: list[dict]) -> None:
    info = machine()
    info["vllm"] = subprocess.run([args.vllm_python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                                  text=True).stdout.strip()
    save_results(args.out, args.repeats, rows, info)


def median(values: list[float]) -> float:
    return statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2000, 8000])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--restarts", type=int, default=3, help="fresh engines on the stored folder")
    parser.add_argument("--vllm-python", default=os.environ.get("PROMPTSTORE_VLLM_PYTHON"))
    parser.add_argument("--out", default=str(BENCH / "results" / f"vllm_bench_{time.strftime('%Y-%m-%d')}.json"))
    parser.add_argument("--lmcache-python", help="a Python with vLLM and LMCache: adds LMCache's rows")
    parser.add_argument("--skip-promptstore", action="store_true", help="only the LMCache rows (and vLLM alone)")
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        engine_child(json.loads(Path(args.engine).read_text()))
        return
    import redis as redis_py
    from redis_server import RedisServer

    from promptstore import PromptStore

    tokenizer, model, work, site = prepare(args, "vllm-bench-")
    redis = RedisServer(work / "redis").start()
    rows = []
    try:
        for dtype in args.dtypes:
            for length in args.lengths:
                docs = documents(tokenizer, length, args.repeats)
                folder, host = work / f"{dtype}-{length}", work / f"{dtype}-{length}-host"
                redis_py.Redis.from_url(redis.url).flushall()
                alone = run_engine(args, str(site), model, dtype, [p for pair in docs for p in pair], None)
                cold, hit = alone[0::2], alone[1::2]
                if args.lmcache_python:
                    lm_folder = work / f"lmcache-{dtype}-{length}"
                    lm_folder.mkdir()
                    lm_cold = run_engine(args, str(site), model, dtype, [pair[0] for pair in docs], None, str(lm_folder))
                    lm_warm = run_engine(args, str(site), model, dtype, [pair[1] for pair in docs], None, str(lm_folder))
                    lm_row = {"dtype": dtype, "length": len(docs[0][1]), "connector": "LMCache",
                              "cold_s": median([r["s"] for r in cold]), "vllm_hit_s": median([r["s"] for r in hit]),
                              "cold_store_s": median([r["s"] for r in lm_cold]),
                              "restart_disk_first_s": lm_warm[0]["s"], "restart_disk_s": median([r["s"] for r in lm_warm]),
                              "served_tokens": lm_warm[0]["cached"],
                              "same_first_token": all(a["token"] == b["token"] for a, b in zip(hit, lm_warm, strict=True))}
                    rows.append(lm_row)
                    save(args, rows)
                    print(f"LMCache {dtype:>9} {lm_row['length']:>5} tokens  cold {lm_row['cold_s']:.3f} s  cold+store "
                          f"{lm_row['cold_store_s']:.3f}  restarted first {lm_row['restart_disk_first_s']:.3f} median "
                          f"{lm_row['restart_disk_s']:.3f}  served {lm_row['served_tokens']}  same tokens: "
                          f"{lm_row['same_first_token']}", flush=True)
                if args.skip_promptstore:
                    continue
                stored = run_engine(args, str(site), model, dtype, [pair[0] for pair in docs],
                                    {"path": str(folder), "redis_url": redis.url})
                settle(folder)
                disks = [run_engine(args, str(site), model, dtype, [pair[1] for pair in docs[r:] + docs[:r]],
                                    {"path": str(folder)}) for r in range(args.restarts)]
                disk = [d for engine in disks for d in engine]
                other = run_engine(args, str(site), model, dtype, [pair[1] for pair in docs],
                                   {"path": str(host), "redis_url": redis.url})
                with PromptStore(folder) as s:
                    entries = s.ls(kind="vllm.kv")
                    per_token = sum(e.size for e in entries) / max(1, 128 * len(entries))
                row = {
                    "dtype": dtype, "length": len(docs[0][1]),
                    "cold_s": median([r["s"] for r in cold]), "vllm_hit_s": median([r["s"] for r in hit]),
                    "vllm_first_hit_s": hit[0]["s"], "cold_all_s": [r["s"] for r in cold],
                    "cold_store_all_s": [r["s"] for r in stored], "restart_first_all_s": [e[0]["s"] for e in disks],
                    "cold_store_s": median([r["s"] for r in stored]),
                    "restart_disk_first_s": median([e[0]["s"] for e in disks]),
                    "restart_disk_s": median([r["s"] for e in disks for r in e[1:]]),
                    "redis_first_s": other[0]["s"], "redis_s": median([r["s"] for r in other]),
                    "served_tokens": disk[0]["cached"], "bytes_per_token": per_token,
                    "refuted_hits": sum(e[0]["refuted"] for e in disks) + other[0]["refuted"],
                    "same_first_token": all(a["token"] == b["token"] == c["token"]
                                            for a, b, c in zip(hit, disks[0], other, strict=True))
                    and all(e[i]["token"] == hit[(i + r) % len(hit)]["token"]  # engine r started at document r
                            for r, e in enumerate(disks) for i in range(len(e)))
                    and all(a["token"] == b["token"] for a, b in zip(cold, stored, strict=True)),
                }
                rows.append(row)
                save(args, rows)
                print(f"{dtype:>9} {row['length']:>5} tokens  cold {row['cold_s']:.3f} s  vLLM hit "
                      f"{row['vllm_hit_s']:.3f} (first {row['vllm_first_hit_s']:.3f})  cold+store {row['cold_store_s']:.3f}  "
                      f"restarted (disk) first "
                      f"{row['restart_disk_first_s']:.3f} median {row['restart_disk_s']:.3f}  other host (Redis) "
                      f"first {row['redis_first_s']:.3f} median {row['redis_s']:.3f}  served {row['served_tokens']}  "
                      f"{per_token / 1024:.1f} KiB/token  refuted hits {row['refuted_hits']}  "
                      f"same tokens: {row['same_first_token']}", flush=True)
    finally:
        redis.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
