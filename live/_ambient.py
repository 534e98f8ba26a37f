"""The ambient torch state that changes a forward's numbers without touching the model.

Autocast (enabled and its dtype, per device type), the float32 matmul precision and TF32
switches, reduced-precision reductions, the default dtype, and active torch function modes.
Grad mode and inference mode change nothing a forward computes, so they are not part of it.
"""

from __future__ import annotations

import functools
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
    backends = torch.backends
    # torch's legacy precision switches raise once a user set the new per-backend API
    # (torch.backends.*.fp32_precision): every switch is read through _read, and the new API
    # is read beside them, so either way of setting precision is named and neither raises.
    out.append(f"matmul:{_read(torch.get_float32_matmul_precision)}")
    cuda_matmul = getattr(getattr(backends, "cuda", None), "matmul", None)
    for name in ("allow_tf32", "allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction"):
        out.append(f"cuda.matmul.{name}:{_read(lambda n=name: getattr(cuda_matmul, n, None))}")
    out.append(f"cudnn.allow_tf32:{_read(lambda: getattr(getattr(backends, 'cudnn', None), 'allow_tf32', None))}")
    for path in _PRECISION_PATHS:
        out.append(f"{path}.fp32_precision:{_read(lambda p=path: _precision(backends, p))}")
    out.append(f"default_dtype:{torch.get_default_dtype()}")
    for name in ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled", "cudnn_sdp_enabled"):
        fn = getattr(getattr(backends, "cuda", None), name, None)
        out.append(f"sdp.{name}:{_read(fn) if callable(fn) else None}")  # which attention kernel runs
    out += _modes(torch)
    out += _replaced_functions(torch)
    return out


# Where torch's per-backend precision API lives (torch.backends.<path>.fp32_precision).
_PRECISION_PATHS = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn", "mkldnn.matmul", "mkldnn.conv",
                    "mkldnn.rnn")


def _precision(backends: Any, path: str) -> Any:
    """The precision in force at ``path``: "none" defers to the backend above it, and at the top means "ieee"
    (so a switch set and put back through the legacy flags names the same state as one never touched)."""
    parts = [p for p in path.split(".") if p]
    for depth in range(len(parts), -1, -1):
        obj = backends
        for part in parts[:depth]:
            obj = getattr(obj, part, None)
        value = getattr(obj, "fp32_precision", None)
        if value not in ("none", None):
            return value
    return "ieee"


def _read(fn: Any) -> str:
    """A switch's value, or why it cannot be read (never raising: an ambient read must not fail the caller)."""
    try:
        return str(fn())
    except (RuntimeError, AttributeError, TypeError) as exc:
        return f"unreadable:{type(exc).__name__}"


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


def _function_tables(torch: Any) -> list[tuple[str, Any, Any]]:
    """The namespaces a forward calls functions through by name, and which of their names are computations:
    ``torch``'s operators (its ``_VariableFunctions``: ``torch.save``, which ultralytics patches on import, is
    no computation), ``torch.nn.functional`` and ``torch.Tensor`` whole."""
    return [("torch", torch, _operator_names(torch)),
            ("torch.nn.functional", torch.nn.functional, None), ("torch.Tensor", torch.Tensor, None)]


@functools.lru_cache(maxsize=2)
def _operator_names(torch: Any) -> frozenset[str] | None:
    ops = getattr(torch._C, "_VariableFunctions", None)
    return frozenset(dir(ops)) if ops is not None else None


def _pristine(fn: Any, torch_dir: str, depth: int = 0) -> bool:
    """Whether a namespace entry is torch's own: code in torch's files, a builtin of torch's, a wrapper
    (deprecation, lru_cache) of one of those, typing's forms, or no function at all."""
    import types

    if isinstance(fn, (types.ModuleType, type)) or not callable(fn):
        return True
    wrapped = getattr(fn, "__wrapped__", None)
    if isinstance(fn, types.FunctionType):
        if fn.__code__.co_filename.startswith(torch_dir):
            return True
        # A decorator from the standard library or typing_extensions around torch's own function.
        return wrapped is not None and depth < 4 and fn.__module__.startswith("torch") \
            and _library(fn.__code__.co_filename) and _pristine(wrapped, torch_dir, depth + 1)
    if isinstance(fn, (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType,
                       types.BuiltinMethodType, types.GetSetDescriptorType)):
        module = getattr(fn, "__module__", None)
        return module is None or module == "builtins" or module.startswith("torch")
    module = getattr(type(fn), "__module__", "") or ""
    if module in ("typing", "typing_extensions"):
        return True
    if wrapped is not None and module == "functools" and depth < 4:
        return _pristine(wrapped, torch_dir, depth + 1)
    # torch's own callable objects (ops namespaces, _VariableFunctions...) come from its files.
    return module.startswith("torch")


def _library(filename: str) -> bool:
    import sysconfig

    return filename.startswith(sysconfig.get_paths()["stdlib"]) or "typing_extensions" in filename


# label -> {name: the entry found to be torch's own}: a later call only checks that it is still there.
_PRISTINE: dict[str, dict[str, Any]] = {}
_CLEAN: dict[str, int] = {}  # label -> its namespace's version tag when no entry of it was found replaced


def _replaced_functions(torch: Any) -> list[str]:
    """Entries of torch's function tables that are not torch's own (a swapped attention kernel, a patched
    activation), each described with its code and what it captures; nothing when none is replaced.

    The torch version names torch's own functions; a replacement is named by what it is.
    """
    import os

    from ._walk import Unidentifiable, Walk

    from ._walk import dict_version

    torch_dir = os.path.dirname(torch.__file__)
    walk = None
    for label, table, names in _function_tables(torch):
        seen = _PRISTINE.setdefault(label, {})
        namespace = vars(table)
        # A module's namespace whose version tag has not moved since every entry was found torch's own
        # holds the same objects: nothing to check (torch's 1,517 names, ~0.15 ms a call otherwise).
        version = dict_version(namespace) if type(namespace) is dict else None
        if version is not None and _CLEAN.get(label) == version:
            continue
        lines = len(walk.lines) if walk is not None else 0
        for name, fn in list(namespace.items()):
            # Private names are torch's internals, out of contract like its code edited in place.
            if seen.get(name) is fn or name.startswith("_") or (names is not None and name not in names):
                continue
            if _pristine(fn, torch_dir):
                seen[name] = fn  # checked once per object: later calls compare identities only
                continue
            walk = walk or Walk(torch)
            walk.emit(f"{label}.{name}")
            try:
                walk.callable(fn, f"{label}.{name}")
            except Unidentifiable as exc:
                from promptstore.errors import UnsupportedModelError

                raise UnsupportedModelError(f"{label}.{name} is replaced by something that cannot be named: {exc}") from None
        if version is not None and (walk is None or len(walk.lines) == lines):
            _CLEAN[label] = version
    return [] if walk is None else ["replaced:" + "\n".join(walk.lines)]
