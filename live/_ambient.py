"""The ambient torch state that changes a forward's numbers without touching the model.

Autocast (enabled and its dtype, per device type), the float32 matmul precision and TF32
switches, reduced-precision reductions, the default dtype, and active torch function modes.
Grad mode and inference mode change nothing a forward computes, so they are not part of it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ambient_lines", "autocast_active"]


def _autocast(torch: Any, device: str) -> tuple[bool, str]:
    try:
        on = bool(torch.is_autocast_enabled(device))
        dtype = str(torch.get_autocast_dtype(device))
    except (TypeError, RuntimeError, AttributeError):  # older torch: per-device functions
        on = bool(torch.is_autocast_cpu_enabled() if device == "cpu" else torch.is_autocast_enabled())
        dtype = str(torch.get_autocast_cpu_dtype() if device == "cpu" else torch.get_autocast_gpu_dtype())
    return on, dtype


def autocast_active(torch: Any, device: str) -> str | None:
    """The autocast dtype in force for ``device`` ("cpu", "cuda"), or None."""
    on, dtype = _autocast(torch, device)
    return dtype if on else None


def ambient_lines(torch: Any) -> list[str]:
    """One line per ambient setting that changes numerics (see the module docstring)."""
    out = []
    for device in ("cpu", "cuda"):
        on, dtype = _autocast(torch, device)
        out.append(f"autocast:{device}:{dtype if on else 'off'}")
    out.append(f"matmul:{torch.get_float32_matmul_precision()}")
    backends = torch.backends
    cuda_matmul = getattr(getattr(backends, "cuda", None), "matmul", None)
    for name in ("allow_tf32", "allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction"):
        try:
            out.append(f"cuda.matmul.{name}:{getattr(cuda_matmul, name, None)}")
        except (RuntimeError, AttributeError):
            out.append(f"cuda.matmul.{name}:?")
    out.append(f"cudnn.allow_tf32:{getattr(getattr(backends, 'cudnn', None), 'allow_tf32', None)}")
    out.append(f"default_dtype:{torch.get_default_dtype()}")
    try:
        from torch.overrides import _get_current_function_mode_stack

        modes = [f"{type(m).__module__}.{type(m).__qualname__}" for m in _get_current_function_mode_stack()]
    except (ImportError, RuntimeError):
        modes = []
    out.append(f"function_modes:{modes}")
    return out
