"""Mutation testing (``make mutation``): plant one-line bugs where a wrong key or a wrong reuse would be silent.

mutmut 3 mutates each function, then runs only the tests that called that function during a
recording run. Each group below pairs the modules it mutates with the test files that are meant to
catch their bugs, so a mutant is never run against the whole suite (that would take hours here).

The package is assembled as it is installed (``llm/`` as ``promptstore/llm``, ``live/`` as
``promptstore/_live``...) in ``build/mutation/<group>``, because mutmut imports the mutated copy by
the file's path. Results are kept there per mutant, with a digest of the sources they were
found for: ``--survivors`` then retests only what earlier runs of the same sources left alive.

    python tools/mutation.py                 # every group, then the score
    python tools/mutation.py core llm        # some groups
    python tools/mutation.py --report        # the score of the last runs, and every survivor
    python tools/mutation.py --recheck-equivalent   # also run the mutants listed as equivalent
    python tools/mutation.py llm --survivors  # after adding tests: only the mutants left alive before

Survivors judged equivalent (no input can tell them apart from the original) are listed in
``tools/mutation_equivalent.txt`` with a reason each; they are left out of the score, and not run
(a survivor runs every test that reaches its function) unless ``--recheck-equivalent``.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "build" / "mutation"
EQUIVALENT = REPO / "tools" / "mutation_equivalent.txt"

# Where each source folder lives in the installed package (pyproject's package-dir).
LAYOUT = {"promptstore": "promptstore", "llm": "promptstore/llm", "vision": "promptstore/vision", "live": "promptstore/_live"}

# Lines whose mutants only change what a person reads (messages, warnings, docs) or how fast a
# thing runs, never a key, a byte served or a decision: not mutated.
SKIP_LINES = [
    r"^\s*raise\s",
    r"^\s*warnings\.warn\(",
    r"^\s*_warn\(",
    r"^\s*log\w*\.(debug|info|warning|error|exception)\(",
    r"^\s*__all__\s*=",
]


# Tests whose checks run in a fresh Python process, which imports the unmutated package. Most
# would only add their minutes to every survivor's run. Two stay in, as oracles: the digest and
# key tests compare what this (mutated) process computes with what the original code computes
# in the child, so they catch every mutant that changes a digest or a key consistently.
IN_A_CHILD = [
    "tests/test_llm.py::test_smollm2_fresh_process_hits_from_disk",
    "tests/test_chunks.py::test_a_fresh_process_serves_the_stored_passages",
    "tests/test_vision.py::test_warm_set_classes_in_a_fresh_process_never_builds_the_encoder",
    "tests/test_vision.py::test_warm_classes_cli",
    "tests/test_vision.py::test_an_interrupted_warm_classes_keeps_finished_batches_and_resumes",
    "tests/test_zeroshot.py::test_a_fresh_process_builds_the_classifier_from_the_store",
    "tests/test_live_vision.py::test_a_fresh_fp32_process_never_reads_what_an_autocast_process_stored",
    "tests/test_live_llm.py::test_a_fresh_process_without_the_hook_never_reads_the_hooked_entries",
]


@dataclass(frozen=True)
class Group:
    """Modules to mutate, the functions of each that count (``*``: all), and the tests meant to catch them."""

    name: str
    functions: dict[str, tuple[str, ...]]  # installed path -> functions ("f", "Class.method", or "*")
    tests: tuple[str, ...]
    select: str = ""  # a pytest -k expression: leaves out tests that are slow and catch nothing the others miss
    # Test one mutant in this many, chosen by a hash of its name (the same on every run). The
    # defaults are sized so that all five groups take about 45 minutes on 2 cores, from the mean
    # time a mutant of each group took in full runs (core 3.7 s, disk 1.6 s, llm 3.8 s, vision
    # 11 s, identity 15 s). Each is a multiple of the wider samples run before, so a default
    # sample is a subset of them and their kept results count. --sample N or --all widens it.
    sample: int = 1

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(self.functions)

    @property
    def patterns(self) -> tuple[str, ...]:
        """mutmut's mutant names for the functions (``module.x_f__mutmut_N``, ``module.xǁClassǁm__mutmut_N``)."""
        out = []
        for path, names in self.functions.items():
            module = path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            for name in names:
                if name == "*":
                    out.append(f"{module}.*")
                elif "." in name:
                    cls, method = name.split(".")
                    out.append(f"{module}.x\u01c1{cls}\u01c1{method}__mutmut_*")
                else:
                    out.append(f"{module}.x_{name}__mutmut_*")
        return tuple(out)


ALL = ("*",)
GROUPS = [
    # Key recipes, the tensor digest, and the entry format's read path.
    # The digest memo's SQLite plumbing (opening, schema) is left out: a fault there loses the
    # memo, never changes a digest, and each such mutant would run every digest test to no end.
    Group("core", {"promptstore/_keys.py": ALL,
                   "promptstore/_digest.py": ("digest_memo_path", "_Memo.get", "_Memo.put", "_identity", "file_digest",
                                              "_Pages.__init__", "_Pages._known", "_Pages._add", "_Pages._query",
                                              "_Pages._read_maps", "_Pages._mapping", "_Pages._scan", "_Pages._file_pages", "_Pages.file_ranges",
                                              "_Pages.file_range", "_frame",
                                              "_Host.__init__", "_Host.buffer", "_raw", "_multipliers", "device_word_digest", "_device_sums",
                                              "_hash_bytes", "digest_tensors", "_settled", "_still", "_framed",
                                              "_Memo.derived", "derived_digest"),
                   "promptstore/_codec.py": ("parse_header", "check_digest", "make_entry", "decode")},
          ("tests/test_keys.py", "tests/test_digest.py", "tests/test_codec.py", "tests/test_weight_edits.py"),
          sample=4),
    # The write watch: when a remembered digest of anonymous memory is served instead of hashing it again.
    # (Its tests that run in a child process import the unmutated package: left out.)
    Group("watch", {"promptstore/_watch.py": (
              "_Known.valid_despite", "WriteWatch.recall", "WriteWatch._bad", "WriteWatch.protect",
              "WriteWatch._protect_written", "WriteWatch.remember", "WriteWatch._private_anonymous", "write_watch",
              "_dma_possible", "_after_fork_in_child")},
          ("tests/test_watch.py",), select="not kernel_writes_by_dma and not more_files_than", sample=4),
    # The disk tier's read paths: what a get serves, or drops as corrupt.
    Group("disk", {"promptstore/_tiers/disk.py": (
              "check_folder", "_read_into", "_pread_all", "_runs", "_other_version", "DiskTier._read", "DiskTier.get",
              "DiskTier.get_into", "DiskTier._counted", "DiskTier.peek", "DiskTier.contains", "DiskTier._drop_corrupt",
              "_file_bytes", "_mapped")},
          ("tests/test_disk_reads.py", "tests/test_tiers.py", "tests/test_store.py", "tests/test_versions.py"),
          sample=2),
    # The Redis tier's shards on a real Redis Cluster: where a key lives, scripts run, chains across
    # shards, follow-ups, a shard down. (The Lua inside the scripts' strings is not mutated.)
    Group("cluster", {"promptstore/_tiers/redis.py": (
              "RedisTier._shard", "RedisTier._sp", "RedisTier._k", "RedisTier._run", "RedisTier._pattern",
              "RedisTier._shard_of_key", "RedisTier._unshard", "RedisTier._scan", "RedisTier._follow",
              "RedisTier._across", "RedisTier._went_down", "RedisTier._call", "RedisTier.put", "RedisTier.delete",
              "RedisTier.fits", "RedisTier.gc", "RedisTier._relink", "RedisTier.usage")},
          ("tests/test_redis_cluster.py", "tests/test_redis.py"),
          sample=4),
    # LLM reuse: block and tail keys, what a lookup serves, passages placed, moved and chosen,
    # running states stored and restored.
    Group("llm", {
        "promptstore/llm/_engine.py": tuple(f"Engine.{m}" for m in (
            "fingerprints", "root_key", "fits", "shared", "copy_tail", "read_blocks", "miss_cache")),
        "promptstore/llm/_request.py": tuple(f"Request.{m}" for m in (
            "block_keys", "lookup", "lookup_into", "tail_key", "store_blocks", "store_kv", "store_tail", "state_key",
            "state_point", "store_state", "run")),
        "promptstore/llm/_states.py": ("state_layers", "read_states", "state_signature", "states_fit", "restore_states"),
        "promptstore/llm/_chunks.py": ("ChunkCache._chunk_key", "ChunkCache._place", "ChunkCache._choose", "_rotate",
                                       "ChunkCache._query_ranking", "ChunkCache._repair", "_kl"),
        "promptstore/llm/_buffers.py": ("KVBuffers._allocate", "copy_block")},
          ("tests/test_llm.py", "tests/test_chunks.py", "tests/test_llm_sliding.py", "tests/test_llm_states.py",
           "tests/test_decide.py"),
          # SmolLM2 (real weights), the architecture zoo and the flash-kernel refusal take a minute
          # between them: a survivor would run them all, and they test no reuse path the tiny models miss.
          select="(not across_architectures or stablelm) and not smol and not flash_style and not seed_example"
                 " and not current_tokenizers_return and not another_tokenizer_gets",
          sample=6),
    # llama.cpp's prompt cache: what its keys hold, what a lookup finds and restores, what is stored.
    Group("llamacpp", {"promptstore/llm/_llamacpp.py": (
              "_plain", "_settings", "LlamaCppCache._fingerprints", "LlamaCppCache._usable", "LlamaCppCache._head_key",
              "LlamaCppCache._state_key", "LlamaCppCache._tokens", "LlamaCppCache._pointer", "LlamaCppCache._find",
              "LlamaCppCache.__contains__", "LlamaCppCache.__getitem__", "LlamaCppCache._restore",
              "LlamaCppCache._store")},
          ("tests/test_llamacpp.py",),
          # Each test loads the real GGUF in llama.cpp (and some in child processes): a few seconds a mutant.
          sample=4),
    # Vision reuse: class-prompt, zero-shot and OWL keys and what a hit returns.
    Group("vision", {
        "promptstore/vision/_classes.py": ("vocabulary_payload", "_names_from_payload", "npz_source", "_source_key",
                                           "_read_source", "Recipes.text", "Recipes.pe", "Recipes.vocabulary",
                                           "encode_and_store", "detector_fingerprint", "_classes_from_source"),
        "promptstore/vision/_zeroshot.py": ("tower_fingerprint", "_render", "_feature_dtype", "_storable", "_tensor",
                                            "_features"),
        "promptstore/vision/_owl.py": ("owl_query_fingerprint", "_query_embeddings"),
        "promptstore/vision/_encoders.py": ("_BatchedEncoder.fingerprint", "_BatchedEncoder._live_identity",
                                            "_BatchedEncoder._record_built", "OpenCLIPTextEncoder._source_fingerprint",
                                            "UltralyticsTextEncoder._source_fingerprint")},
          ("tests/test_vision.py", "tests/test_zeroshot.py", "tests/test_owl.py", "tests/test_live_vision.py"),
          # Half and double precision run open_clip's tower for a minute and a half on one thread and
          # reach no line bfloat16 and float32 miss; the NPZ fuzz and the 77-token context repeat
          # checks that faster tests make on the same functions.
          select="not (dtype_gets_open_clips_dtype and ([torch.float16] or [torch.float64])) and not fuzz_npz"
                 " and not trimmed_context_equals",
          # Its tests run open_clip towers on one thread: a survivor costs minutes.
          sample=12),
    # Verified hits: which positions are recomputed, the comparison and its bound, what a refuted
    # key stops, and the vision side's one re-encoded prompt.
    Group("verify", {
        "promptstore/llm/_verify.py": ("tolerance", "check_positions", "refuted", "refute", "confirm", "_layer_plan",
                                       "verifiable", "verify_served", "_relative", "works_on", "_self_test"),
        "promptstore/llm/_request.py": ("Request.verified",),
        "promptstore/vision/_verify.py": ("feature_error", "check_feature", "check_draws"),
        "promptstore/_live/_random.py": ("Generators.moved", "Generators.undo", "Generators.restore")},
          ("tests/test_verify.py", "tests/test_vision_verify.py"),
          sample=4),
    # transformers' zero-shot pipelines, OmDet-Turbo's caches and SAM 3's prompts: the text side's key, which rows
    # are served, in what order.
    Group("pipelines", {"promptstore/vision/_pipelines.py": ("_TextSide.fingerprint", "_TextSide.pooled", "_row_name",
                                                             "_read"),
                        "promptstore/vision/_omdet.py": ("_Backbone.fingerprint", "_StoredCache.has", "_StoredCache.put",
                                                         "_StoredCache._confirmed", "_StoredCache._read", "_payload"),
                        "promptstore/vision/_sam3.py": ("_Sam3Text.fingerprint", "_Sam3Text.set_classes", "_read")},
          ("tests/test_pipelines.py", "tests/test_omdet.py", "tests/test_sam3.py"), sample=4),
    # What a live model, tower or tokenizer is, as it runs now.
    Group("identity", {"promptstore/_live/__init__.py": ALL, "promptstore/_live/_walk.py": ALL,
                       "promptstore/_live/_modules.py": ALL, "promptstore/_live/_ambient.py": ALL,
                       "promptstore/_live/_tokenizers.py": ALL, "promptstore/llm/_fingerprint.py": ALL},
          ("tests/test_live_llm.py", "tests/test_live_vision.py", "tests/test_weight_edits.py"),
          # 2,077 mutants, each reached by nearly every live test (15 s a mutant on average).
          sample=36),
]
BY_NAME = {g.name: g for g in GROUPS}


def _mutmut() -> str:
    exe = Path(sys.executable).with_name("mutmut")
    if not exe.exists():
        sys.exit("mutmut is not installed in this environment: pip install 'promptstore[mutation]'")
    return str(exe)


def _toml_list(items: list[str] | tuple[str, ...]) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def stage(group: Group) -> Path:
    """The package as installed, the tests, and mutmut's settings, in ``build/mutation/<group>``."""
    root = OUT / group.name
    root.mkdir(parents=True, exist_ok=True)
    src = root / "promptstore"
    if src.exists():
        shutil.rmtree(src)
    for folder, target in LAYOUT.items():
        shutil.copytree(REPO / folder, root / target, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", *(f for f in LAYOUT if f != "promptstore")))
    if (root / "tests").exists():
        shutil.rmtree(root / "tests")
    shutil.copytree(REPO / "tests", root / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    pytest_opts = ["-p", "no:cacheprovider", "-m", "not slow", "-W", "ignore"]
    for test in IN_A_CHILD:
        pytest_opts += ["--deselect", test]
    if group.select:
        pytest_opts += ["-k", group.select]
    (root / "pyproject.toml").write_text(
        "[tool.mutmut]\n"
        'source_paths = ["promptstore"]\n'
        f"only_mutate = {_toml_list(group.files)}\n"
        f"do_not_mutate_patterns = {_toml_list(SKIP_LINES)}\n"
        f"pytest_add_cli_args = {_toml_list(pytest_opts)}\n"
        f"pytest_add_cli_args_test_selection = {_toml_list(group.tests)}\n"
        "use_git_change_detection = false\n"
        "timeout_multiplier = 4.0\n"
        "timeout_constant = 30.0\n"
        "\n[tool.pytest.ini_options]\n"
        'testpaths = ["tests"]\n'
        'markers = ["slow: long versions of the reliability suites"]\n'
    )
    return root


# Generates the mutants as ``mutmut run`` does first (about ten seconds), without its test runs,
# and prints every mutant's name: the run is then given the names to test.
_GENERATE = """
import json, os
from pathlib import Path
from mutmut.__main__ import create_mutants
from mutmut.mutation.trampoline import set_mutant_under_test
from mutmut.utils.file_utils import copy_also_copy_files, copy_src_dir, setup_source_paths
set_mutant_under_test("mutant_generation")
os.makedirs("mutants", exist_ok=True)
copy_src_dir(); copy_also_copy_files(); setup_source_paths()
create_mutants(2)
names = []
for meta in Path("mutants").rglob("*.py.meta"):
    names += list(json.loads(meta.read_text()).get("exit_code_by_key", {}))
print(json.dumps(names))
"""


# mutmut's command line, less its "clean" run: before testing mutants it runs every selected test
# once more on the unmutated code (five minutes a group here), which `make test` already does.
# Its forced-fail check, which proves that mutants are switched on, still runs.
_MUTMUT = """
import sys
from mutmut.workers import isolation
from mutmut.__main__ import cli
isolation.ForkRunner.run_clean_tests = lambda self, tests: 0
sys.argv[0] = "mutmut"
cli()
"""


def mutant_names(group: Group, root: Path, env: dict[str, str], recheck: bool) -> list[str]:
    """The group's mutants to test: all of them, less those listed as equivalent unless ``recheck``.

    An equivalent mutant survives by definition, so it runs every test that reaches its function:
    the costliest kind. Listed ones keep their reason in the report either way.
    """
    out = subprocess.run([sys.executable, "-c", _GENERATE], cwd=root, env=env, capture_output=True, text=True,
                         check=True)
    names = json.loads(out.stdout.strip().splitlines()[-1])
    ours = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in group.patterns) and in_sample(group, n)]
    skip = set() if recheck else set(equivalent_now(group))
    return sorted(n for n in ours if n not in skip)


def in_sample(group: Group, name: str) -> bool:
    """Whether a mutant is in the group's sample: a hash of its name, so every run tests the same ones."""
    import hashlib

    return group.sample == 1 or int(hashlib.sha256(name.encode()).hexdigest(), 16) % group.sample == 0


def run(group: Group, recheck: bool = False, survivors: bool = False, resume: bool = False) -> int:
    """Test the group's mutants (``survivors``: only those no earlier run of these sources caught;
    ``resume``: only those no earlier run of these sources tested, as after an interrupted run)."""
    root = stage(group)
    # One thread each: mutants run in processes forked from one that has run torch, and an
    # OpenMP pool does not survive a fork (the child waits on threads it no longer has).
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    names = mutant_names(group, root, env, recheck)
    kept = _snapshot(group)  # after generation: kept only where the function is still the code tested
    if survivors:  # and those no run of their function's code has tested yet
        names = [n for n in names if kept.get(n, "not checked") not in ("killed", "timeout")]
    if resume:
        names = [n for n in names if kept.get(n, "not checked") == "not checked"]
    if not names:
        print(f"== {group.name}: nothing to test", flush=True)
        return 0
    print(f"== {group.name}: {', '.join(group.files)}: {len(names)} mutants", flush=True)
    started = time.monotonic()
    _mutmut()  # installed, or a clear message
    proc = subprocess.run([sys.executable, "-c", _MUTMUT, "run", "--max-children", str(os.cpu_count() or 2), *names],
                          cwd=root, env=env)
    print(f"== {group.name}: {time.monotonic() - started:.0f} s, mutmut exit {proc.returncode}", flush=True)
    save_results(group)
    return proc.returncode


LOCK = REPO / "tools" / "mutation_equivalent.lock"


def _function_hashes(group: Group) -> dict[str, str]:
    """mutmut's hash of each function's code, as the group's last run (or generation) saw it."""
    out: dict[str, str] = {}
    root = OUT / group.name / "mutants"
    for meta in root.rglob("*.py.meta"):
        module = str(meta.relative_to(root)).removesuffix(".py.meta").removesuffix("/__init__").replace("/", ".")
        try:
            data = json.loads(meta.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        out.update({f"{module}.{fn}": h for fn, h in data.get("hash_by_function_name", {}).items()})
    return out


def _locked() -> dict[str, str]:
    try:
        return dict(json.loads(LOCK.read_text()))
    except (OSError, ValueError):
        return {}


def lock_equivalents(groups: list[Group]) -> int:
    """Record, for every listed equivalent mutant, the code of its function as it is now (after triage).

    A listing holds only for that code: once the function changes, mutant numbers move and the
    mutant is run and judged again. Returns how many functions were locked.
    """
    equivalent, locked = _equivalent(), _locked()
    killed = []
    for group in groups:
        hashes = _function_hashes(group)
        kept = {**_snapshot(group), **_meta_results(dataclasses.replace(group, sample=1))}
        for name in equivalent:
            fn = name.split("__mutmut_")[0]
            if fn in hashes and any(fnmatch.fnmatchcase(name, p) for p in group.patterns):
                if kept.get(name) in ("killed", "timeout"):
                    # Judged on older code, under a number that now names another mutant, which a test catches.
                    killed.append(name)
                    continue
                locked[fn] = hashes[fn]
    if killed:
        keep = [line for line in EQUIVALENT.read_text().splitlines() if line.partition(" ")[0] not in killed]
        EQUIVALENT.write_text("\n".join(keep) + "\n")
        print(f"{len(killed)} listings dropped from {EQUIVALENT.name}: a test catches the mutant of that number now")
    LOCK.write_text(json.dumps(dict(sorted(locked.items())), indent=0, ensure_ascii=False) + "\n")
    return len(locked)


def equivalent_now(group: Group) -> dict[str, str]:
    """The listed equivalent mutants of this group whose function is still the code they were judged on."""
    hashes, locked = _function_hashes(group), _locked()
    return {n: r for n, r in _equivalent().items()
            if locked.get(n.split("__mutmut_")[0]) is not None and locked[n.split("__mutmut_")[0]] == hashes.get(n.split("__mutmut_")[0])}


def _equivalent() -> dict[str, str]:
    out: dict[str, str] = {}
    if EQUIVALENT.exists():
        for line in EQUIVALENT.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                name, _, reason = line.partition(" ")
                out[name] = reason.strip()
    return out


STATUS = {0: "survived", 1: "killed", 3: "killed", 5: "no tests", 33: "no tests", 34: "skipped", 36: "timeout",
          37: "killed", 24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout", None: "not checked"}


def _repo_path(installed: str) -> Path:
    """Where an installed path (``promptstore/llm/_prefix.py``) lives in the repository (``llm/_prefix.py``)."""
    for folder, target in LAYOUT.items():
        if target != "promptstore" and installed.startswith(target + "/"):
            return REPO / folder / installed[len(target) + 1 :]
    return REPO / installed


def sources_changed(group: Group) -> bool:
    """Whether the sources changed since the group's last run (its scores are then of older code)."""
    return any(not (OUT / group.name / path).exists() or (OUT / group.name / path).read_bytes() != _repo_path(path).read_bytes()
               for path in group.functions)


def _snapshot_path(group: Group) -> Path:
    return OUT / group.name / "results.json"


def _snapshot(group: Group) -> dict[str, str]:
    """Statuses kept from earlier runs, of the group's mutants whose function is still the code they were tested on.

    The code is mutmut's hash of each function as the group's mutants were last generated (a
    run generates them from the sources first), so a changed function's results are dropped and
    the others keep theirs.
    """
    try:
        data = json.loads(_snapshot_path(group).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    hashes = _function_hashes(group)
    return {name: kept[0] for name, kept in data.get("results", {}).items()
            if isinstance(kept, list) and len(kept) == 2 and hashes.get(name.split("__mutmut_")[0]) == kept[1]
            and any(fnmatch.fnmatchcase(name, p) for p in group.patterns)}  # a function moved to another group: not ours


def save_results(group: Group) -> None:
    """Merge this run's statuses over the kept ones, so that a run of some mutants keeps the others' results."""
    hashes = _function_hashes(group)
    merged = {**_snapshot(group), **{n: st for n, st in _meta_results(group).items() if st != "not checked"}}
    data = {n: [st, hashes.get(n.split("__mutmut_")[0])] for n, st in merged.items()}
    _snapshot_path(group).write_text(json.dumps({"results": data}, indent=0, ensure_ascii=False))


def results(group: Group) -> dict[str, str]:
    """Each mutant of the group, by name, with its status: the last run's, else the one kept from earlier runs."""
    out = {**_meta_results(group)}
    for name, status in _snapshot(group).items():
        if in_sample(group, name) and out.get(name, "not checked") == "not checked":
            out[name] = status
    if all(st == "not checked" for st in out.values()):
        return {}  # generated, never run: not a score of zero
    return out


def _meta_results(group: Group) -> dict[str, str]:
    out: dict[str, str] = {}
    for meta in (OUT / group.name / "mutants").rglob("*.py.meta"):
        for _ in range(5):  # mutmut rewrites the file after each mutant: read a whole version
            try:
                data = json.loads(meta.read_text())
                break
            except json.JSONDecodeError:
                time.sleep(0.2)
        else:
            continue
        for name, code in data.get("exit_code_by_key", {}).items():
            if not any(fnmatch.fnmatchcase(name, p) for p in group.patterns) or not in_sample(group, name):
                continue
            out[name] = STATUS.get(code, "suspicious")
    return out


@dataclass
class Tally:
    """One group's results: what counts (equivalents left out), what was caught, what is left."""

    results: dict[str, str]
    equivalent: list[str]  # listed in mutation_equivalent.txt
    tested: dict[str, str]  # the others that a run reached
    untested: int  # the others no run has reached yet (an interrupted or partial run)

    @property
    def caught(self) -> int:
        # A mutant that makes the tests hang is caught (a user would notice); one no test reaches is not.
        return sum(s in ("killed", "timeout") for s in self.tested.values())

    @property
    def left(self) -> list[str]:
        return sorted(n for n, s in self.tested.items() if s not in ("killed", "timeout"))

    @property
    def score(self) -> float:
        return 100 * self.caught / max(len(self.tested), 1)


def tally(group: Group, equivalent: dict[str, str]) -> Tally | None:
    res = results(group)
    if not res:
        return None
    others = {n: s for n, s in res.items() if n not in equivalent}
    tested = {n: s for n, s in others.items() if s != "not checked"}
    return Tally(res, sorted(n for n in res if n in equivalent), tested, len(others) - len(tested))


def wilson(caught: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% interval of a sampled score, in percent (Wilson's, which holds near 100% too)."""
    if n == 0:
        return 0.0, 100.0
    p = caught / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return 100 * max(0.0, centre - half), 100 * min(1.0, centre + half)


def _interval(group: Group, t: Tally) -> str:
    if group.sample == 1:
        return ""
    lo, hi = wilson(t.caught, len(t.tested))
    return f" [{lo:.0f}-{hi:.0f}%]"


def _everything(group: Group) -> tuple[int, int]:
    """Caught and tested over every mutant any kept run tested on this code, in the sample or not."""
    equivalent = equivalent_now(group)
    kept = {n: st for n, st in {**_snapshot(group), **_meta_results(dataclasses.replace(group, sample=1))}.items()
            if n not in equivalent and st != "not checked"}
    return sum(s in ("killed", "timeout") for s in kept.values()), len(kept)


def _sampled(group: Group) -> str:
    return f" (1 in {group.sample})" if group.sample > 1 else ""


def report(groups: list[Group]) -> float:
    """Print the score per group and over all, and each survivor; returns the overall score in percent."""
    caught = total = 0
    for group in groups:
        t = tally(group, equivalent_now(group))
        if t is None:
            print(f"{group.name}: not run")
            continue
        caught += t.caught
        total += len(t.tested)
        for name in t.equivalent:
            if t.results[name] in ("killed", "timeout"):
                print(f"    listed as equivalent but killed (remove it from {EQUIVALENT.name}): {name}")
        if sources_changed(group):
            print(f"{group.name}: the sources changed since this run; its results are of older code")
        wide_caught, wide = _everything(group)
        print(f"{group.name}{_sampled(group)}: {t.caught}/{len(t.tested)} caught ({t.score:.1f}%{_interval(group, t)}), "
              f"{len(t.equivalent)} equivalent left out, {t.untested} not tested yet; "
              f"every mutant tested on this code: {wide_caught}/{wide}")
        for name in t.left:
            print(f"    {t.tested[name]:<11} {name}")
    score = 100 * caught / max(total, 1)
    print(f"mutation score: {caught}/{total} = {score:.1f}%")
    return score


# The results block lives in the documentation (docs/development.md, "Mutation testing").
RESULTS_PAGE = REPO / "docs" / "development.md"
MARKERS = ("<!-- mutation-results -->", "<!-- /mutation-results -->")


def _kept_lines(page: str, group: Group) -> tuple[list[str], list[str], list[str]]:
    """The group's table row, untriaged survivors and equivalent mutants as ``page`` shows them (a run elsewhere)."""
    row = [line for line in page.splitlines() if line.startswith(f"| `{group.name}`")]
    ours = [line for line in page.splitlines() if line.startswith("- `")
            and any(fnmatch.fnmatchcase(line[3:line.index("`", 3)], p) for p in group.patterns)]
    survivor = [line[line.index("`", 3) + 1:].startswith(" (") for line in ours]  # equivalents: "- `name`: why"
    return (row, [line for line, s in zip(ours, survivor, strict=True) if s],
            [line for line, s in zip(ours, survivor, strict=True) if not s])


def markdown(groups: list[Group], page: str = "") -> str:
    """The results block of docs/development.md: scores, then every equivalent mutant with its reason.

    A group with no results on this machine keeps what ``page`` (the block as it was) shows for it."""
    rows, listed, left = [], [], []
    for group in groups:
        equivalent = equivalent_now(group)
        t = tally(group, equivalent)
        if t is None:
            row, kept_left, kept_listed = _kept_lines(page, group)
            rows += row or [f"| `{group.name}`{_sampled(group)} | not run | | | | | |"]
            left += kept_left
            listed += kept_listed
            continue
        older = " (older sources)" if sources_changed(group) else ""
        wide_caught, wide = _everything(group)
        rows.append(f"| `{group.name}`{_sampled(group)}{older} | {len(t.results)} | {len(t.equivalent)} | {t.untested} | "
                    f"{t.caught} / {len(t.tested)} | {t.score:.1f}%{_interval(group, t)} | "
                    f"{wide_caught} / {wide} ({100 * wide_caught / max(wide, 1):.1f}%) |")
        listed += [f"- `{n}`: {equivalent[n]}" for n in t.equivalent]
        left += [f"- `{n}` ({t.tested[n]})" for n in t.left]
    out = [MARKERS[0], "", "| group (sample) | mutants | equivalent | not tested yet | caught | score [95% interval] "
           "| every mutant tested on this code |", "|---|---|---|---|---|---|---|", *rows, ""]
    # markdown="1": mkdocs renders the lists inside (md_in_html); GitHub ignores the attribute
    out += [f"<details markdown=\"1\"><summary>Surviving mutants not yet triaged ({len(left)})</summary>", "", *left, "", "</details>", ""]
    out += [f"<details markdown=\"1\"><summary>Equivalent mutants and why ({len(listed)})</summary>", "", *listed, "", "</details>", "",
            MARKERS[1]]
    return "\n".join(out)


def update_docs(groups: list[Group]) -> None:
    text = RESULTS_PAGE.read_text()
    start, end = text.index(MARKERS[0]), text.index(MARKERS[1]) + len(MARKERS[1])
    RESULTS_PAGE.write_text(text[:start] + markdown(groups, text[start:end]) + text[end:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("groups", nargs="*", help=f"groups to run (default: all): {', '.join(BY_NAME)}")
    parser.add_argument("--report", action="store_true", help="only print the last runs' results")
    parser.add_argument("--docs", "--readme", dest="docs", action="store_true",
                        help="write the results into docs/development.md (Mutation testing); alone, runs nothing")
    parser.add_argument("--recheck-equivalent", action="store_true",
                        help=f"also run the mutants listed in {EQUIVALENT.name} (skipped by default: they survive)")
    parser.add_argument("--all", action="store_true", help="every mutant, not a sample")
    parser.add_argument("--sample", type=int, metavar="N",
                        help="one mutant in N of every group (a divisor of the default keeps its results)")
    parser.add_argument("--lock", action="store_true",
                        help=f"after triage: bind each mutant listed in {EQUIVALENT.name} to its function's code now")
    parser.add_argument("--resume", action="store_true", help="only the mutants no earlier run of the same sources tested")
    parser.add_argument("--survivors", action="store_true",
                        help="only the mutants that earlier runs of the same sources left alive (after adding tests)")
    args = parser.parse_args()
    unknown = [g for g in args.groups if g not in BY_NAME]
    if unknown:
        parser.error(f"unknown group(s) {unknown}; groups: {', '.join(BY_NAME)}")
    groups = [BY_NAME[g] for g in args.groups] or GROUPS
    if args.all or args.sample:
        groups = [dataclasses.replace(g, sample=1 if args.all else args.sample) for g in groups]
    if args.lock:
        print(f"{lock_equivalents(groups)} functions locked in {LOCK.name}")
        return
    if not args.report and not (args.docs and not args.groups):  # --docs alone writes what earlier runs found
        for group in groups:
            if run(group, args.recheck_equivalent, args.survivors, args.resume) not in (0,):
                print(f"mutmut did not finish group {group.name}", file=sys.stderr)
    report(groups)
    if args.docs:
        update_docs(GROUPS)


if __name__ == "__main__":
    main()
