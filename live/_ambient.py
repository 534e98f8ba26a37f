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
    for name in ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled", "cudnn_sdp_enabled"):
        fn = getattr(getattr(backends, "cuda", None), name, None)
        out.append(f"sdp.{name}:{fn() if callable(fn) else None}")  # which attention kernel runs
    out += _modes(torch)
    return out


def _modes(torch: Any) -> list[str]:
    """Active torch function and dispatch modes, each described with its fields and code (a mode
    that rounds matmuls to bfloat16 with a strength field is keyed by that field)."""
    from ._walk import Unidentifiable, Walk

    stacks = []
    try:
        from torch.overrides import _get_current_function_mode_stack

        stacks.append(("function_modes", _get_current_function_mode_stack()))
    except (ImportError, RuntimeError):
        pass
    try:
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        stacks.append(("dispatch_modes", _get_current_dispatch_mode_stack()))
    except (ImportError, RuntimeError):
        pass
    out = []
    for label, modes in stacks:
        walk = Walk(torch)
        for i, mode in enumerate(modes):
            walk.emit(f"{label}[{i}]")
            try:
                walk.value(mode, f"{label}[{i}]")
                for name in ("__torch_function__", "__torch_dispatch__"):
                    fn = type(mode).__dict__.get(name)
                    if fn is not None:
                        walk.callable(fn, f"{label}[{i}].{name}")
            except Unidentifiable as exc:
                from promptstore.errors import UnsupportedModelError

                raise UnsupportedModelError(f"an active torch mode ({type(mode).__qualname__}) holds state that "
                                            f"cannot be named: {exc}") from None
        out.append(f"{label}:{chr(10).join(walk.lines)}")
    return out
