"""A wheel built from this checkout installs into a fresh venv and imports everywhere."""

from __future__ import annotations

import subprocess
import sys
import venv
import zipfile

from conftest import REPO


def test_wheel_installs_into_a_fresh_venv(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(REPO)],
                   check=True, capture_output=True, timeout=600)
    wheel = next(dist.glob("promptstore-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"promptstore/py.typed", "promptstore/vision/__init__.py", "promptstore/llm/__init__.py",
            "promptstore/_store.py", "promptstore/_tiers/disk.py", "promptstore/vllm/__init__.py"} <= names
    # no generic top-level packages (a folder named vllm/ would shadow vLLM itself)
    assert not any(n.startswith(("vision/", "llm/", "tests/", "vllm/", "vllm_connector/")) for n in names)

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    install = subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheel)], capture_output=True, text=True,
                             timeout=900)
    assert install.returncode == 0, install.stderr
    code = (
        "import promptstore, promptstore.vision, promptstore.llm, numpy as np, pathlib, sys\n"
        "assert 'site-packages' in promptstore.__file__, promptstore.__file__\n"
        "assert pathlib.Path(promptstore.__file__).with_name('py.typed').exists()\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
        "s = promptstore.PromptStore(sys.argv[1])\n"
        "s.put(s.key('t'), {'x': np.ones(3, np.float32)}, kind='t')\n"
        "print(s.get(s.key('t')).tensors['x'].sum())\n"
    )
    out = subprocess.run([str(py), "-c", code, str(tmp_path / "store")], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3.0"
    cli = subprocess.run([str(env_dir / "bin" / "promptstore"), "--dir", str(tmp_path / "store"), "--json", "ls"],
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0 and '"kind": "t"' in cli.stdout
