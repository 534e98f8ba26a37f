"""mkdocs hooks for the documentation site (mkdocs.yml names this file).

Two things the site needs that live outside docs/:

- The adapters are folders mapped into the package (pyproject's package-dir: llm/ is promptstore.llm,
  vision/ promptstore.vision, ...). mkdocstrings reads sources statically (griffe), and griffe knows no
  package-dir, so it would find promptstore/ without its adapters. Before each build this hook lays
  the package out as installed, copied under build/docs-api/ (git-ignored), which mkdocs.yml gives
  mkdocstrings as its search path. Copies, not symlinks: griffe resolves a symlinked file to its
  real folder and would find promptstore/ alone again. Rebuilt every time, so a new module needs
  nothing here.
- BENCHMARKS.md stays where ``bench/report.py`` writes it, at the repository root; the site shows it
  as the page benchmark-tables.md, with the plots it links to (bench/plots/).

And one for the docstrings: they cross-reference in Sphinx's roles (:class:`~promptstore.PromptStore`),
which mkdocstrings' Markdown leaves as text before the code span; the API pages show the code span alone,
shortened after a ``~`` as Sphinx shows it.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
API_SRC = ROOT / "build" / "docs-api"

if sys.version_info >= (3, 11):
    import tomllib
else:  # the docs extra installs tomli on Python 3.10
    import tomli as tomllib


def _package_dirs() -> dict[str, Path]:
    """Package name -> folder, as pyproject's [tool.setuptools.package-dir] maps them."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / folder for name, folder in setuptools["package-dir"].items()}


def _lay_out_package() -> None:
    dirs = _package_dirs()
    shutil.rmtree(API_SRC, ignore_errors=True)
    top = API_SRC / "promptstore"
    def skip(folder: str, names: list[str]) -> set[str]:  # sources only: no caches (a .mypy_cache is 100+ MB)
        return {n for n in names if n.startswith((".", "__pycache__"))
                or (not n.endswith((".py", ".pyi")) and not (Path(folder) / n).is_dir())}

    shutil.copytree(dirs.pop("promptstore"), top, ignore=skip)
    for name, folder in dirs.items():
        shutil.copytree(folder, top / name.split(".", 1)[1], ignore=skip)


# Laid out when mkdocs loads this file, before any plugin reads its configuration: mkdocstrings looks
# its search paths up when its own on_config runs, which comes before this hook's, and a path that does
# not exist yet is passed over (a fresh checkout then documented promptstore/ without its adapters).
_lay_out_package()


def on_config(config: Any) -> Any:
    _lay_out_package()  # again for `mkdocs serve`, which rebuilds without importing this file again
    return config


def on_files(files: Files, config: Any) -> Files:
    files.append(File.generated(config, "benchmark-tables.md", content=(ROOT / "BENCHMARKS.md").read_text()))
    for plot in sorted((ROOT / "bench" / "plots").glob("*.png")):
        files.append(File.generated(config, f"bench/plots/{plot.name}", abs_src_path=str(plot)))
    return files


_ROLE = re.compile(r":(?:class|func|meth|attr|mod|data|exc|obj):<code>(~?)([^<]*)</code>")


def on_page_content(html: str, page: Any, config: Any, files: Files) -> str:
    return _ROLE.sub(lambda m: f"<code>{m[2].rsplit('.', 1)[-1] if m[1] else m[2]}</code>", html)
