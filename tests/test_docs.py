"""Every Python block in README.md and docs/ runs, so the documentation cannot drift from the code.

How a page runs: its Python blocks run in order, in one fresh Python process per page, sharing one
namespace as a session would (a later block uses the model an earlier one loaded), in a temporary
working folder of its own, with no model hub (``HF_HUB_OFFLINE=1``). ``PROMPTSTORE_DIR`` (where
``PromptStore()`` writes) names one temporary store folder for the whole run, as a reader's machine has
one: a page finds what earlier pages stored, among it the model checks and measured rates that a
store keeps, which keeps the run within a few minutes; an example's results are the same either way
(a hit equals a recompute), only its counts of served tokens are not, so the docs print them "on an
empty store". A failing block's traceback names the page and line.
Pages are found with sybil's Markdown lexers:

- ```` ```python ```` fences are run. Fences of other languages (``bash``, ``sh``, ``console``, ``json``,
  ``text``) are not; a Python block under another name fails ``test_every_fence_names_a_known_language``.
- ``<!-- invisible-code-block: python ... -->`` (sybil's convention, hidden on GitHub and on the site)
  runs too: setup a reader does not need, such as a throwaway Redis URL or the small random
  models of tests/docs_setup.py standing in for ``from_pretrained`` downloads.
- ``<!-- docs-test: needs MODULE -->`` before a block runs it only where MODULE imports (``llama_cpp``:
  the ``llamacpp`` extra); without it the block is left out with a warning, or fails under
  ``PROMPTSTORE_REQUIRE_LLAMACPP=1``, as ``make test`` sets.
- ``<!-- docs-test: vllm -->`` anywhere in a page runs the whole page with vLLM's Python, the venv that
  ``PROMPTSTORE_VLLM_PYTHON`` names (``make test`` builds it: vLLM pins another torch), this checkout laid
  out there as installed, and ``DOCS_MODEL_DIR`` naming SmolLM2 converted for transformers. Without that
  venv the page skips, or fails under ``PROMPTSTORE_REQUIRE_VLLM=1``. docs/vllm.md's ``LLM(...)`` block runs
  this way; README.md shows the ``vllm serve`` form as a shell block instead, which is not run.
- ``<!-- docs-test: skip REASON -->`` before a block leaves it out, always. One block does this:
  docs/vision.md's SAM 3 example, because SAM 3's weights (``sam3.pt``) are not available offline and its
  model at the real size with random weights (848M parameters) takes longer to build than this whole test's
  budget; tests/test_sam3.py runs ``serve_sam3`` on that model instead.

``DOCS_REDIS_URL`` and ``DOCS_REDIS_CLUSTER_URL`` name a redis-server and a 3-primary Redis Cluster on
loopback, started only for pages whose text names them.

torch runs one thread per page (``OMP_NUM_THREADS=1`` unless set): the examples are small, and on a machine
shared with other jobs two threads per process spin against each other. Measured on this 2-core machine
under a load of 8: every page in 87 s with one thread, 285 s with two.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("sybil", reason='needs the docs extra: pip install "promptstore[docs]" (make test installs it)')
from sybil import Document  # noqa: E402
from sybil.parsers.markdown.lexers import DirectiveInHTMLCommentLexer, FencedCodeBlockLexer  # noqa: E402

from redis_server import RedisClusterServers, RedisServer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
NOT_RUN = {"bash", "sh", "console", "json", "text", "toml", "yaml"}
REQUIRE = {"llama_cpp": "PROMPTSTORE_REQUIRE_LLAMACPP"}
PAGE_TIMEOUT_S = 600

RUNNER = '''
import json, sys, time

def main():
    namespace = {"__name__": "__docs__"}
    start = time.perf_counter()
    for block in json.loads(open(sys.argv[1]).read()):
        print(f"--- {block['path']}:{block['line']} (at {time.perf_counter() - start:.1f} s)", flush=True)
        # padded so that a traceback's line numbers are the page's
        exec(compile("\\n" * (block["line"] - 1) + block["source"], block["path"], "exec"), namespace)

if __name__ == "__main__":  # vLLM starts its engine in processes that import this file again
    main()
'''


@dataclass
class Block:
    path: str  # relative to the repository
    line: int  # of the block's first line of code
    source: str
    needs: str | None = None
    skip: str | None = None


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def read_page(page: Path) -> tuple[list[Block], set[str], list[tuple[int, str]]]:
    """(Python blocks in order, page-level directives, (line, language) of every fence)."""
    text = page.read_text()
    document = Document(text, str(page))
    rel = str(page.relative_to(REPO))
    fences = list(FencedCodeBlockLexer(language=r"[^\n]*")(document))
    invisible = list(DirectiveInHTMLCommentLexer(directive="invisible-code-block", arguments="python")(document))
    directives = list(DirectiveInHTMLCommentLexer(directive="docs-test", arguments=r"[^\n]+?")(document))
    languages = [(_line(text, r.start), str(r.lexemes["language"]).strip()) for r in fences]
    code = [r for r in fences if str(r.lexemes["language"]).strip() == "python"] + invisible
    events = sorted([(r.start, "code", r) for r in code] + [(r.start, "directive", r) for r in directives],
                    key=lambda e: e[0])
    blocks: list[Block] = []
    page_level: set[str] = set()
    pending: dict[str, str] = {}
    for start, what, region in events:
        if what == "directive":
            word, _, rest = str(region.lexemes["arguments"]).strip().partition(" ")
            if word == "vllm":
                page_level.add("vllm")
            elif word in ("needs", "skip"):
                pending[word] = rest.strip()
            else:
                raise AssertionError(f"{rel}:{_line(text, start)}: unknown docs-test directive {word!r}")
            continue
        blocks.append(Block(rel, _line(text, start) + 1, str(region.lexemes["source"]),
                            needs=pending.pop("needs", None), skip=pending.pop("skip", None)))
    assert not pending, f"{rel}: a docs-test directive {pending} before no Python block"
    return blocks, page_level, languages


def test_every_fence_names_a_known_language():
    """A Python block fenced as ``py`` or ``python3`` would silently never run: only known names pass."""
    for page in PAGES:
        for line, language in read_page(page)[2]:
            assert language == "python" or language in NOT_RUN, \
                f"{page.relative_to(REPO)}:{line}: a fence named {language!r} (python runs; {sorted(NOT_RUN)} do not)"


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("docs-store")


@pytest.fixture(scope="module")
def redis_urls(tmp_path_factory):
    """name -> URL, servers started on first use and stopped after the module."""
    started: list = []
    urls: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in urls:
            server = (RedisServer(tmp_path_factory.mktemp("redis")) if name == "DOCS_REDIS_URL"
                      else RedisClusterServers(folder=tmp_path_factory.mktemp("cluster"))).start()
            started.append(server)
            urls[name] = server.url
        return urls[name]

    yield get
    for server in started:
        server.stop()


def _vllm_python() -> str:
    python = os.environ.get("PROMPTSTORE_VLLM_PYTHON")
    if python and Path(python).exists():
        return python
    if os.environ.get("PROMPTSTORE_REQUIRE_VLLM") == "1":
        raise RuntimeError("PROMPTSTORE_REQUIRE_VLLM=1 but PROMPTSTORE_VLLM_PYTHON names no Python with vLLM")
    pytest.skip("vLLM's venv is not built (make test builds it)")


def _vllm_env(tmp_path: Path) -> dict[str, str]:
    """This checkout laid out as installed (vllm_connector/ as promptstore.vllm) and a model folder vLLM loads."""
    from promptstore.llm import load_model, models_dir

    site = tmp_path / "site"
    shutil.copytree(REPO / "promptstore", site / "promptstore")
    shutil.copytree(REPO / "vllm_connector", site / "promptstore" / "vllm")
    found = sorted(Path(models_dir()).glob("smollm2-135m-instruct*"))
    if not found:
        load_model()  # converts the GGUF once into a transformers folder
        found = sorted(Path(models_dir()).glob("smollm2-135m-instruct*"))
    model_dir = found[0]
    return {"PYTHONPATH": str(site), "DOCS_MODEL_DIR": str(model_dir), "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def _available(module: str) -> bool:
    if importlib.util.find_spec(module) is not None:
        return True
    if os.environ.get(REQUIRE.get(module, "")):
        raise RuntimeError(f"{REQUIRE[module]} is set but {module} is not installed")
    return False


@pytest.mark.parametrize("page", [p for p in PAGES if read_page(p)[0]], ids=lambda p: str(p.relative_to(REPO)))
def test_the_python_blocks_of_a_page_run(page, tmp_path, store_dir, redis_urls):
    blocks, page_level, _ = read_page(page)
    left_out = [b for b in blocks if b.skip is not None or (b.needs and not _available(b.needs))]
    for b in left_out:
        if b.skip is None:
            warnings.warn(f"{b.path}:{b.line} not run: needs {b.needs}", stacklevel=1)
    run = [b for b in blocks if b not in left_out]
    work = tmp_path / "work"
    work.mkdir()
    (tmp_path / "blocks.json").write_text(json.dumps([b.__dict__ for b in run]))
    (tmp_path / "run_blocks.py").write_text(RUNNER)
    env = {**os.environ, "PROMPTSTORE_DIR": str(store_dir), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error", "PYTHONPATH": str(REPO / "tests"),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    text = page.read_text()
    for name in ("DOCS_REDIS_URL", "DOCS_REDIS_CLUSTER_URL"):
        if name in text:
            env[name] = redis_urls(name)
    python = sys.executable
    if "vllm" in page_level:
        python = _vllm_python()
        extra = _vllm_env(tmp_path)
        env.update(extra, PYTHONPATH=os.pathsep.join([extra["PYTHONPATH"], env["PYTHONPATH"]]))
    proc = subprocess.run([python, str(tmp_path / "run_blocks.py"), str(tmp_path / "blocks.json")], cwd=work,
                          env=env, capture_output=True, text=True, timeout=PAGE_TIMEOUT_S)
    ran = re.findall(r"^--- (\S+)", proc.stdout, re.MULTILINE)
    assert proc.returncode == 0, (f"{page.relative_to(REPO)}: the block at {ran[-1] if ran else '?'} failed\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    assert len(ran) == len(run)
