"""What a torch module tree computes with, now: tensors, settings, hooks and code.

Per module, in tree order:
  - every tensor of its state: parameters, buffers, tensors held as plain attributes
    (transformers' ``original_inv_freq``), and what its ``state_dict`` holds beyond those
    (packed weights of quantized modules, read through the module's own ``_save_to_state_dict``);
  - every other attribute, ``training`` included, through :class:`~._walk.Walk` (plain
    settings, configs, functions stored on the instance such as a patched ``forward``);
  - its forward hooks and pre-hooks (in order, with their flags), and the global ones;
  - its class's code: ``forward`` (and any entry methods named by the caller), followed into
    every method and module-level function it names, as they are bound now.
"""

from __future__ import annotations

import enum
import types
from typing import Any

import xxhash

from ._walk import _MISSING, CODE_MEMO, Unidentifiable, Walk, register_describer

__all__ = ["walk_module", "walk_tree", "active_dropout", "IGNORED_ATTRIBUTES"]

# nn.Module's own bookkeeping, described separately (tensors, children, hooks) or not at all
# (hooks that run only on state_dict / load / backward, which never change a forward's output).
_INTERNAL = frozenset({
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_forward_hooks", "_forward_pre_hooks",
    "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs",
    "_backward_hooks", "_backward_pre_hooks", "_is_full_backward_hook", "_state_dict_hooks", "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_version",
})
# Attributes that record what happened (warnings shown, generation defaults) rather than what a
# forward computes; keying them would make every request after a warning miss.
IGNORED_ATTRIBUTES = frozenset({"warnings_issued", "generation_config", "_is_hf_initialized", "_keep_in_fp32_modules",
                                "_keep_in_fp32_modules_strict", "_initialize_weights", "_compiled_call_impl",
                                "_hf_peft_config_loaded", "_is_stateful", "name_or_path"})


_PLAIN_CLASS_VALUES = (bool, int, float, str, bytes, tuple, list, dict, frozenset, set, enum.Enum, type(None))


def _entry_methods(walk: Walk, cls: type, entries: tuple[str, ...]) -> list[tuple[str, str, Any]]:
    """What the class's code can reach on the class: ``(name, "method" | "value", attribute)``.

    From the entries, every name their code uses is looked up on the class. Each definition
    up the MRO counts (``super().forward()`` runs the parent's), not only the first; a plain
    class attribute the code reads (``self.FACTOR``) is a value. nn.Module's own machinery is
    named by torch's version.
    """
    out: dict[str, tuple[str, str, Any]] = {}
    todo = list(entries)
    looked: set[str] = set()
    while todo:
        name = todo.pop()
        if name in looked:
            continue
        looked.add(name)
        for klass in cls.__mro__:
            if klass.__module__ in ("builtins", "torch.nn.modules.module"):
                break
            got = klass.__dict__.get(name, _MISSING)
            walk.reads.item(klass.__dict__, name, got)  # a method patched onto a subclass later counts
            if got is _MISSING:
                continue
            key = f"{name}@{klass.__module__}.{klass.__qualname__}"
            if isinstance(got, (types.FunctionType, staticmethod, classmethod, property)):
                out[key] = (key, "method", got)
                fn: object = got.__func__ if isinstance(got, (staticmethod, classmethod)) else got
                fn = fn.fget if isinstance(fn, property) else fn
                while isinstance(fn, types.FunctionType):
                    # Names used as self.<name>(...) are looked up on the class: follow them too.
                    todo.extend(n for n in CODE_MEMO.get(fn.__code__)[1] if n not in looked)
                    wrapped = getattr(fn, "__wrapped__", None)
                    fn = wrapped if isinstance(wrapped, types.FunctionType) else None
            elif not (name.startswith("__") and name.endswith("__")) and isinstance(got, _PLAIN_CLASS_VALUES):
                out[key] = (key, "value", got)
    return sorted(out.values(), key=lambda item: item[0])


def _state_extra(module: Any, path: str, walk: Walk) -> None:
    """State a module saves beyond its parameters and buffers (packed quantized weights)."""
    torch = walk.torch
    save = type(module)._save_to_state_dict
    if save is torch.nn.Module._save_to_state_dict:
        return
    walk.reads.volatile = True  # the saved tensors are new objects on every call
    out: dict[str, Any] = {}
    save(module, out, "", True)
    known = set(module._parameters) | set(module._buffers)
    for k in sorted(out):
        if k in known:
            continue
        walk.emit(f"saved:{k}")
        walk.value(out[k], f"{path}:{k}")


def _hooks(module: Any, path: str, walk: Walk) -> None:
    reads = walk.reads
    pre = reads.mapping(module._forward_pre_hooks)
    pre_kwargs = dict(reads.mapping(getattr(module, "_forward_pre_hooks_with_kwargs", {})))
    for i, (key, hook) in enumerate(pre):
        walk.emit(f"pre-hook:{i}:{key in pre_kwargs}")
        walk.callable(hook, f"{path}.pre-hook[{i}]")
    post = reads.mapping(module._forward_hooks)
    with_kwargs = dict(reads.mapping(getattr(module, "_forward_hooks_with_kwargs", {})))
    always = dict(reads.mapping(getattr(module, "_forward_hooks_always_called", {})))
    for i, (key, hook) in enumerate(post):
        walk.emit(f"hook:{i}:{key in with_kwargs}:{key in always}")
        walk.callable(hook, f"{path}.hook[{i}]")


def global_hooks(walk: Walk) -> None:
    """Forward hooks registered for every module (``register_module_forward_hook``)."""
    mod = walk.torch.nn.modules.module
    for name in ("_global_forward_pre_hooks", "_global_forward_hooks"):
        hooks = walk.reads.mapping(getattr(mod, name, {}))
        for i, (_, hook) in enumerate(hooks):
            walk.emit(f"{name}:{i}")
            walk.callable(hook, f"torch.{name}[{i}]")


def skipped(name: str, skip: str | tuple[str, ...]) -> bool:
    """Whether submodule ``name`` lies under one of the ``skip`` paths."""
    for path in (skip,) if isinstance(skip, str) else skip:
        if path and (name == path or name.startswith(path + ".")):
            return True
    return False


def _tree(walk: Walk, module: Any, skip: str | tuple[str, ...]) -> list[tuple[str, Any]]:
    """Every module in the tree (shared ones once per place), with every read of the tree recorded."""
    out: list[tuple[str, Any]] = []
    todo = [("", module)]
    while todo:
        name, sub = todo.pop()
        if skipped(name, skip):
            continue
        out.append((name, sub))
        children = walk.reads.mapping(sub.__dict__["_modules"])
        walk.reads.item(sub.__dict__, "_modules", sub.__dict__["_modules"])
        for child_name, child in reversed(children):
            if child is not None:
                todo.append((f"{name}.{child_name}" if name else child_name, child))
    return out


def _script_module(walk: Walk, sub: Any, where: str) -> None:
    """A TorchScript module: its compiled code and its own tensors (its state lives in C++)."""
    walk.reads.volatile = True  # nothing Python-side to re-check: described again every call
    code = getattr(sub, "code", "")
    walk.emit(f"script:{where}:{sub.original_name}:training={sub.training}:"
              f"{xxhash.xxh3_128_hexdigest(code.encode()) if isinstance(code, str) else '?'}")
    for pname, p in sub.named_parameters(recurse=False):
        walk.emit(f"param:{pname}")
        walk.tensor(f"{where}.{pname}", p)
    for bname, b in sub.named_buffers(recurse=False):
        walk.emit(f"buffer:{bname}")
        walk.tensor(f"{where}.{bname}", b)


def walk_module(walk: Walk, module: Any, path: str, shallow_code: bool = False,
                entries: tuple[str, ...] = ("forward",), skip: str | tuple[str, ...] = "") -> None:
    """Describe ``module`` and every submodule (outside ``skip``) into ``walk``."""
    torch = walk.torch
    reads = walk.reads
    named = _tree(walk, module, skip)
    for name, sub in named:
        walk.modules.setdefault(id(sub), f"{path}{name}")
    classes: dict[type, None] = {}
    for name, sub in named:
        where = f"{path}{name}"
        cls = type(sub)
        if name:  # the root's class is checked by the caller (a read here would keep the root alive)
            reads.attr(sub, "__class__", cls)
        classes.setdefault(cls)
        if isinstance(sub, torch.jit.ScriptModule):
            _script_module(walk, sub, where)
            continue
        fields = dict(reads.mapping(sub.__dict__))
        if fields.get("_compiled_call_impl") is not None:
            # torch.compile's backend and options change numerics and are not in the module.
            raise Unidentifiable(where or type(sub).__name__, "compiled with torch.compile (its backend computes the output)")
        walk.emit(f"module:{where}:{cls.__module__}.{cls.__qualname__}:training={fields.get('training')}")
        persistent = fields.get("_non_persistent_buffers_set", set())
        reads.frozen(persistent)
        for kind, table in (("param", fields["_parameters"]), ("buffer", fields["_buffers"])):
            for tname, t in reads.mapping(table):
                walk.emit(f"{kind}:{tname}:{tname in persistent}" if kind == "buffer" else f"{kind}:{tname}")
                if t is None:
                    walk.emit("None")
                else:
                    walk.tensor(f"{where}.{tname}", t)
        walk.emit("children:" + ",".join(fields["_modules"]))
        _state_extra(sub, where, walk)
        _hooks(sub, where, walk)
        for k in sorted(fields):
            if k in _INTERNAL or k in IGNORED_ATTRIBUTES or k == "training" or (not path and not name and k in walk.root_ignore):
                continue
            v = fields[k]
            if isinstance(v, torch._C.ScriptObject):
                if type(sub)._save_to_state_dict is torch.nn.Module._save_to_state_dict:
                    raise Unidentifiable(f"{where}.{k}", "an opaque TorchScript object its state_dict does not save")
                continue  # covered by _state_extra
            walk.emit(f"attr:{k}")
            walk.value(v, f"{where}.{k}")
    for cls in classes:
        walk.emit(f"class-code:{cls.__module__}.{cls.__qualname__}")
        # Every module runs through __call__ (a class between it and nn.Module may override it)
        # and its forward; the root may be entered elsewhere too (encode_text).
        for key, kind, attr in _entry_methods(walk, cls, tuple(dict.fromkeys(("__call__", "forward", *entries)))):
            walk.emit(f"{kind}:{key}")
            if kind == "method":
                walk.callable(attr, f"{cls.__qualname__}.{key}", shallow=shallow_code)
            else:
                walk.value(attr, f"{cls.__qualname__}.{key}")


def walk_tree(walk: Walk, module: Any, entries: tuple[str, ...] = ("forward",), skip: str | tuple[str, ...] = "") -> None:
    """The whole identity of a module tree (see the module docstring)."""
    walk_module(walk, module, "", entries=entries, skip=skip)
    global_hooks(walk)
    walk.finish()


def _capturing(hook: Any) -> bool:
    # transformers' own output capture (installed for good by a first output_hidden_states or
    # output_attentions call): it appends the layer's output to the call's collector, nothing else.
    return (getattr(hook, "__module__", None) == "transformers.utils.output_capturing"
            and getattr(hook, "__qualname__", "").endswith(".output_capturing_hook"))


def forward_intercepted(module: Any) -> bool:
    """Whether anything besides the modules' own code is handed what a module tree takes and returns.

    A forward hook or pre-hook on any module or for every module (``register_module_forward_hook``),
    other than transformers' output capture; or a ``forward`` (or ``generate``) set on an instance,
    as wrappers and accelerate's hooks do. Such code sees a model's KV cache, and may keep it.
    """
    import torch

    mod = torch.nn.modules.module
    if getattr(mod, "_global_forward_pre_hooks", None) or getattr(mod, "_global_forward_hooks", None):
        return True
    if "generate" in vars(module):
        return True
    for sub in module.modules():
        if sub._forward_pre_hooks or "forward" in vars(sub):
            return True
        if sub._forward_hooks and not all(_capturing(h) for h in sub._forward_hooks.values()):
            return True
    return False


def active_dropout(module: Any, skip: str | tuple[str, ...] = "") -> str | None:
    """Where a module in training mode would make the output random or batch-dependent, or None.

    Dropout layers with ``p > 0``, attention modules whose dropout rate is an attribute
    (transformers' ``attention_dropout``), and batch norm in training mode.
    """
    import torch

    for name, sub in module.named_modules():
        if not sub.training or skipped(name, skip):
            continue
        if isinstance(sub, torch.nn.modules.dropout._DropoutNd) and sub.p > 0:
            return f"{name or type(sub).__name__} (dropout p={sub.p})"
        if isinstance(sub, torch.nn.modules.batchnorm._BatchNorm):
            return f"{name or type(sub).__name__} (batch norm in training mode)"
        for k, v in vars(sub).items():
            if isinstance(v, float) and v > 0 and ("dropout" in k or k in ("drop_prob", "attn_drop", "proj_drop")):
                return f"{name or type(sub).__name__} ({k}={v})"
    return None


register_describer("entry-methods", _entry_methods)
register_describer("module", walk_module)
