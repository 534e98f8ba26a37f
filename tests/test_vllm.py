"""promptstore as vLLM's KV connector (promptstore.vllm), against a real vLLM on this CPU, SmolLM2 in float32.

vLLM lives in a virtual environment of its own (it pins another torch): ``make test`` builds it once
per machine and names its Python in ``PROMPTSTORE_VLLM_PYTHON``; each engine runs in a fresh process
of that Python (tests/vllm_engine.py). Without it these tests skip, unless
``PROMPTSTORE_REQUIRE_VLLM=1`` (as ``make test`` sets), when they fail.

Greedy text equals vLLM's without the connector, and first-token logprobs agree within float32
rounding, for: a restarted engine reading the folder, another question after the same document,
a corrupt entry (a miss: recomputed). Another ``cache_salt`` and another dtype never get a hit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from promptstore import PromptStore

PYTHON = os.environ.get("PROMPTSTORE_VLLM_PYTHON")
if not PYTHON or not Path(PYTHON).exists():
    if os.environ.get("PROMPTSTORE_REQUIRE_VLLM") == "1":
        raise RuntimeError("PROMPTSTORE_REQUIRE_VLLM=1 but PROMPTSTORE_VLLM_PYTHON names no Python with vLLM")
    pytest.skip("vLLM's venv is not built (make test builds it)", allow_module_level=True)

ENGINE = Path(__file__).with_name("vllm_engine.py")
ROOT = Path(__file__).resolve().parents[1]
DOC = " ".join(f"Section {i}: forklifts are parked in bay C after each shift; pallets over 800 kg go to aisle 4; "
               "hazardous goods stay behind the fence near door 9." for i in range(40))
QUESTIONS = ["Where do forklifts park?", "Which aisle takes heavy pallets?"]
LOGPROB_ATOL = 1e-4  # float32 rounding between a prefill over loaded pages and one computed in place


def prompt(question: str, **extra) -> dict:
    return {"text": f"{DOC}\nQuestion: {question}\nAnswer:", **extra}


SITE: list[str] = []  # where the engines import promptstore from (the package fixture)


@pytest.fixture(scope="module")
def model_dir(package) -> str:
    SITE[:] = [package]
    from promptstore.llm import load_model, models_dir

    load_model()  # converts the GGUF once into a transformers folder, which vLLM loads
    found = sorted(Path(models_dir()).glob("smollm2-135m-instruct*"))
    assert found, "no converted SmolLM2 folder"
    return str(found[0])


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> str:
    """This checkout's promptstore laid out as installed (vllm_connector/ as promptstore.vllm), for vLLM's venv."""
    site = tmp_path_factory.mktemp("site")
    shutil.copytree(ROOT / "promptstore", site / "promptstore")
    shutil.copytree(ROOT / "vllm_connector", site / "promptstore" / "vllm")
    return str(site)


def engine(model_dir: str, prompts: list[dict], connector: dict | None, dtype: str = "float32") -> list[dict]:
    """One engine, in a fresh process: the results of ``prompts`` asked one after another."""
    env = {**os.environ, "PYTHONPATH": SITE[0]}
    spec = {"model": model_dir, "connector": connector, "dtype": dtype, "prompts": prompts}
    proc = subprocess.run([PYTHON, str(ENGINE), json.dumps(spec)], capture_output=True, text=True, timeout=900,
                          env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"engine failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULTS "):])


def same_answer(got: dict, want: dict) -> None:
    assert got["text"] == want["text"]
    assert max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True)) <= LOGPROB_ATOL


def test_a_restarted_engine_starts_warm_and_answers_as_vllm_alone(model_dir, tmp_path):
    store = {"path": str(tmp_path / "store")}
    plain = engine(model_dir, [prompt(q) for q in QUESTIONS], None)
    cold = engine(model_dir, [prompt(QUESTIONS[0])], store)  # stores every full block of the prompt
    warm = engine(model_dir, [prompt(q) for q in QUESTIONS], store)  # a restarted engine: a fresh process
    same_answer(cold[0], plain[0])
    assert cold[0]["cached"] == 0
    block = 128  # the CPU backend's block size
    for got, want in zip(warm, plain, strict=True):
        same_answer(got, want)
    # The first question: every full block but the one holding the last token; the second question
    # after the same document: the document's blocks (vLLM's own cache or the store's).
    assert warm[0]["cached"] == (warm[0]["prompt_tokens"] - 1) // block * block > 0
    assert warm[1]["cached"] >= len(DOC) // 8 // block * block
    with PromptStore(tmp_path / "store") as s:
        entries = s.ls(kind="vllm.kv")
        assert entries and all(e.size > 0 for e in entries)


def test_another_salt_or_dtype_never_reads_these_blocks_and_a_corrupt_entry_is_recomputed(model_dir, tmp_path):
    folder = tmp_path / "store"
    store = {"path": str(folder)}
    plain = engine(model_dir, [prompt(QUESTIONS[0])], None)[0]
    engine(model_dir, [prompt(QUESTIONS[0], cache_salt="tenant-a")], store)
    salted = engine(model_dir, [prompt(QUESTIONS[0], cache_salt="tenant-b"), prompt(QUESTIONS[0])], store)
    assert [r["cached"] for r in salted] == [0, 0]  # another salt, and no salt: never tenant-a's blocks
    same_answer(salted[1], plain)
    other_dtype = engine(model_dir, [prompt(QUESTIONS[0], cache_salt="tenant-a")], store, dtype="bfloat16")[0]
    assert other_dtype["cached"] == 0
    # Every stored block's file damaged in its tensor bytes: each read is a miss, the blocks are recomputed.
    for path in (folder / "entries").rglob("*.safetensors"):
        data = bytearray(path.read_bytes())
        data[-64] ^= 0xFF
        path.write_bytes(bytes(data))
    damaged = engine(model_dir, [prompt(QUESTIONS[0], cache_salt="tenant-a")], store)[0]
    same_answer(damaged, plain)
