"""Describe live Python values exactly: the framing every live identity is made of.

A :class:`Walk` turns values into a canonical text (one line per value, framed by type),
collecting tensors to digest on the side. It is deterministic across processes: no ``id()``,
no addresses, no hook handle numbers, no dict order that depends on insertion history where
order does not matter to the computation. Anything it cannot name exactly raises
:class:`Unidentifiable`, which callers turn into ``UnsupportedModelError`` before anything is
stored: a value we cannot name could change the output without changing the key.

Two modes of describing an object:
  state  (module attributes, closures, hook objects): every field, recursively;
  global (names a function's code looks up in its module): functions by their code, plain
         values by value, registries (mappings) by their items, any other object by its type.
The second mode is what "live code" means: a module-level function replaced at run time, or
a registry entry registered again, changes the description; the internal state of an
unrelated library object a function happens to name (a logger) does not.
"""

from __future__ import annotations

import collections
import ctypes
import enum
import functools
import logging
import operator
import os
import random
import re
import sys
import threading
import types
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import xxhash

__all__ = ["Walk", "Unidentifiable", "SHALLOW_MODULES", "register_describer"]

# Functions from these packages are named by their own code, without following what they call:
# their behaviour is pinned by the library version that is part of every identity, and following
# torch's internals would cost more than the request. A user's replacement for one of them is
# a function from another module, and is followed.
SHALLOW_MODULES = ("torch", "builtins", "functools", "typing", "collections", "contextlib", "abc", "enum", "inspect",
                   "warnings", "logging", "numpy", "math", "copy", "dataclasses", "re", "os", "importlib", "threading",
                   "weakref", "types", "operator", "itertools", "packaging", "safetensors", "huggingface_hub",
                   "accelerate.utils", "tqdm", "json", "typing_extensions", "torchvision", "PIL")

# Plain config fields that name where a model came from, not what it computes.
CONFIG_PROVENANCE = frozenset({"_name_or_path", "transformers_version", "_commit_hash", "torch_dtype", "dtype",
                               "architectures", "_attn_implementation_autoset", "name_or_path"})

_PRIMITIVES = (bool, int, float, complex, str, bytes, type(None))
_LARGE = 4096  # containers this long are digested once per object and length (see Walk._large)


_MISSING: Any = object()


def _version_reader() -> Callable[[dict[Any, Any]], int] | None:
    """CPython 3.11's per-dict version tag (``ma_version_tag``, PEP 509), or None where it cannot be trusted.

    The interpreter sets it to a new process-wide value on every change to the dict (an entry added,
    replaced by another object, or removed; the dict cleared), so an unchanged tag means the same
    keys, in the same order, holding the same objects. Read at its place in the dict's header,
    after a self-test that the place holds a tag that moves with each kind of change; off on
    other interpreters and versions (from 3.12 the field is deprecated and shared with watchers).
    """
    if sys.implementation.name != "cpython" or sys.version_info[:2] != (3, 11) or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    offset = 3 * ctypes.sizeof(ctypes.c_void_p)  # after the refcount, the type and ma_used

    def read(d: dict[Any, Any]) -> int:
        return ctypes.c_uint64.from_address(id(d) + offset).value

    probe: dict[Any, Any] = {str(i): i for i in range(300)}
    used = ctypes.c_ssize_t.from_address(id(probe) + 2 * ctypes.sizeof(ctypes.c_void_p)).value
    seen = [read(probe)]
    for change in (lambda: probe.__setitem__("0", object()), lambda: probe.__setitem__("new", 1),
                   lambda: probe.pop("1"), lambda: probe.update({"2": object()}), lambda: probe.setdefault("x", 2),
                   lambda: probe.popitem(), probe.clear):
        change()
        seen.append(read(probe))
    if used != 300 or len(set(seen)) != len(seen):
        return None
    return read


_dict_version = _version_reader()


def dict_version(d: dict[Any, Any]) -> int | None:
    """``d``'s version tag (see :func:`_version_reader`), or None where it cannot be read."""
    return _dict_version(d) if _dict_version is not None else None
_VERSIONED_MIN = 8  # dicts this long are checked by their tag, where it can be read

# What other files of this package know how to describe, registered there when they are imported
# (the package imports them all): "module", a torch module held outside the tree being walked
# (_modules.walk_module); "entry-methods", what a class's code reaches on the class
# (_modules._entry_methods); "backend", a ``tokenizers`` object (_tokenizers.describe_backend);
# "origin", what a tokenizer's backend was built from (_tokenizers.tokenizer_origin). The visitor
# dispatches to them by the kind of value and imports none of them.
_DESCRIBERS: dict[str, Callable[..., Any]] = {}


def register_describer(kind: str, describer: Callable[..., Any]) -> None:
    """``describer`` describes values of ``kind`` for every :class:`Walk` (see ``_DESCRIBERS``)."""
    _DESCRIBERS[kind] = describer


def _describer(kind: str) -> Callable[..., Any]:
    try:
        return _DESCRIBERS[kind]
    except KeyError:  # only if a file of this package was imported without the package
        raise RuntimeError(f"no describer registered for {kind!r}: import promptstore._live") from None


class Reads:
    """The reads one description rests on; ``same()`` says whether each still gives the same object.

    Everything a walk describes it reached by reading a dict entry, a list slot, a closure
    cell or an attribute, starting from the module. If every such read returns the very same
    object (``is``) as before, and immutable values cannot change, the description is the same:
    so a request re-checks these reads (~0.2 us each) instead of describing everything again.
    Tensor bytes are not covered: they are digested on every call. ``volatile`` marks a walk
    that read state outside Python objects (a Rust tokenizer, packed weights): always walked again.
    """

    __slots__ = ("empty", "dicts", "versioned", "items", "attrs", "cells", "seqs", "sizes", "sets", "calls", "volatile")

    def __init__(self) -> None:
        self.empty: list[dict[Any, Any]] = []
        self.versioned: list[tuple[dict[Any, Any], int]] = []  # large plain dicts, by CPython's version tag
        self.dicts: list[tuple[dict[Any, Any], tuple[Any, ...], tuple[Any, ...]]] = []
        self.items: list[tuple[Any, Any, Any]] = []
        self.attrs: list[tuple[Any, str, Any]] = []
        self.cells: list[tuple[Any, Any]] = []
        self.seqs: list[tuple[list[Any], tuple[Any, ...]]] = []
        self.sizes: list[tuple[Any, int]] = []
        self.sets: list[tuple[Any, frozenset[Any]]] = []
        self.calls: list[tuple[Any, Any]] = []
        self.volatile = False

    def item(self, d: Any, key: Any, got: Any) -> None:
        self.items.append((d, key, got))

    def mapping(self, d: Any) -> list[tuple[Any, Any]]:
        """All of a mapping's items, recorded (a dict by entry; another mapping by its item list)."""
        if isinstance(d, dict) and type(d).items is dict.items or type(d).items is collections.OrderedDict.items:
            # A whole dict: its keys and values as they are now, compared in C on the next call.
            # The tag is read before the items: a change from another thread between the two reads then
            # moves the tag away from the one recorded, and the next check walks again.
            version = _dict_version(d) if type(d) is dict and _dict_version is not None else None
            keys, values = tuple(d), tuple(dict.values(d))
            if len(keys) >= _VERSIONED_MIN and version is not None:
                # (A tokenizer's 49k merges: 1.4 ms a call entry by entry, 0.4 us by the tag.)
                self.versioned.append((d, version))
            elif keys:
                self.dicts.append((d, keys, values))
            else:
                self.empty.append(d)  # most hook dicts: checked together, in C
            return list(zip(keys, values, strict=True))
        items = list(d.items())
        if isinstance(d, types.MappingProxyType):
            self.sizes.append((d, len(items)))
            self.items.extend((d, k, x) for k, x in items)
        else:
            self.calls.append((lambda m=d: tuple(m.items()), tuple(items)))
        return items

    def attr(self, obj: Any, name: str, got: Any) -> None:
        self.attrs.append((obj, name, got))

    def cell(self, cell: Any, got: Any) -> None:
        self.cells.append((cell, got))

    def seq(self, v: list[Any]) -> None:
        self.seqs.append((v, tuple(v)))

    def size(self, v: Any) -> None:
        self.sizes.append((v, len(v)))

    def frozen(self, v: Any) -> None:
        if isinstance(v, set):
            self.sets.append((v, frozenset(v)))

    def call(self, fn: Any, got: Any) -> None:
        self.calls.append((fn, got))

    def same(self) -> bool:
        """Whether every recorded read still returns the same object."""
        if self.volatile:
            return False
        m = _MISSING
        is_ = operator.is_
        if any(map(len, self.empty)):
            return False
        for d, version in self.versioned:
            if _dict_version(d) != version:  # type: ignore[misc]
                return False
        for d, keys, values in self.dicts:
            if len(d) != len(keys) or tuple(d) != keys or not all(map(is_, dict.values(d), values)):
                return False
        for d, k, x in self.items:
            if d.get(k, m) is not x:
                return False
        for o, n, x in self.attrs:
            if getattr(o, n, m) is not x:
                return False
        for c, x in self.cells:
            try:
                if c.cell_contents is not x:
                    return False
            except ValueError:
                if x is not m:
                    return False
        for v, size in self.sizes:
            if len(v) != size:
                return False
        for lst, was in self.seqs:
            if len(lst) != len(was) or any(a is not b for a, b in zip(lst, was, strict=True)):
                return False
        for st, was_set in self.sets:
            if st != was_set:
                return False
        for fn, was in self.calls:
            now = fn()
            if isinstance(was, tuple) and was and isinstance(was[0], str):
                if now != was:
                    return False
            elif isinstance(was, tuple):
                if len(now) != len(was) or any(a[0] != b[0] or a[1] is not b[1] for a, b in zip(now, was, strict=True)):
                    return False
            elif now is not was:
                return False
        return True


class Unidentifiable(TypeError):
    """A value on the computation's path that cannot be named exactly."""

    def __init__(self, path: str, what: str) -> None:
        super().__init__(f"{path}: {what}")
        self.path, self.what = path, what


def _shallow(module_name: str | None) -> bool:
    name = module_name or ""
    return any(name == m or name.startswith(m + ".") for m in SHALLOW_MODULES)


class _CodeMemo:
    """Digest and looked-up names of each code object, once per process (code objects are immutable).

    Held by strong reference, so an ``id`` is never reused for another code object while remembered.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: dict[int, tuple[types.CodeType, str, tuple[str, ...], tuple[str, ...]]] = {}

    def get(self, code: types.CodeType) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
        """(digest, names looked up, string constants) of a code object and the code nested in it."""
        hit = self._known.get(id(code))
        if hit is not None and hit[0] is code:
            return hit[1], hit[2], hit[3]
        body: list[str] = []
        consts: list[str] = []
        names: list[str] = []
        self._describe(code, body, consts, names)
        source = _source_digest(code.co_filename)
        if source is not None:
            # Code compiled from a file is named by that file's contents (as first seen in this
            # process), its place in it (line and columns: two lambdas on one line with the same
            # names and constants differ by them), and the names and constants it uses: the same
            # across Python versions, whose bytecode differs.
            body = [source, str(code.co_firstlineno), _extent(code)]
        strings = tuple(dict.fromkeys(c for c in code_strings(code)))
        out = (xxhash.xxh3_128_hexdigest("\x00".join(body + consts + names).encode("utf-8", "surrogatepass")),
               tuple(dict.fromkeys(names)), strings)
        with self._lock:
            if len(self._known) > 65536:
                self._known.clear()
            self._known[id(code)] = (code, *out)
        return out

    def _describe(self, code: types.CodeType, body: list[str], consts: list[str], names: list[str]) -> None:
        body += [code.co_code.hex(), repr(code.co_varnames), repr(code.co_freevars), repr(code.co_cellvars),
                 str(code.co_argcount), str(code.co_kwonlyargcount), str(code.co_flags)]
        consts.append(code.co_qualname if hasattr(code, "co_qualname") else code.co_name)
        names += code.co_names
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                self._describe(const, body, consts, names)
            else:
                consts.append(f"{type(const).__name__}:{_const_repr(const)}")


def _const_repr(const: Any) -> str:
    """A code constant's repr, the same in every process: a frozenset (``x in {"a", "b"}`` compiles
    to one) is iterated in an order string hashing, randomised per process, decides."""
    if isinstance(const, frozenset):
        return "frozenset({" + ", ".join(sorted(_const_repr(c) for c in const)) + "})"
    if isinstance(const, tuple):
        return "(" + ", ".join(_const_repr(c) for c in const) + ("," if len(const) == 1 else "") + ")"
    return repr(const)


def _extent(code: types.CodeType) -> str:
    """Where a code object's instructions lie in its source: first and last (line, column)."""
    positions = getattr(code, "co_positions", None)
    if positions is None:  # Python 3.10: no columns, so the bytecode tells such code apart
        return code.co_code.hex()
    spans = [p for p in positions() if None not in p]
    if not spans:
        return ""
    first = min((line, col) for line, _, col, _ in spans)
    last = max((end_line, end_col) for _, end_line, _, end_col in spans)
    return f"{first}-{last}"


def code_strings(code: types.CodeType) -> list[str]:
    """Every string constant of a code object and the code nested in it."""
    out = []
    for const in code.co_consts:
        if isinstance(const, str):
            out.append(const)
        elif isinstance(const, types.CodeType):
            out += code_strings(const)
        elif isinstance(const, (tuple, frozenset)):
            out += [c for c in const if isinstance(c, str)]
    return out


def _source_digest(filename: str) -> str | None:
    if not filename.endswith(".py") or not os.path.isfile(filename):
        return None  # typed in, exec'd, or frozen: named by its bytecode
    from promptstore import file_digest

    try:
        return file_digest(filename)
    except OSError:
        return None


CODE_MEMO = _CodeMemo()


class Walk:
    """One identity under construction: ``lines`` of canonical text and ``tensors`` to digest."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        self.lines: list[str] = []
        self.tensors: list[tuple[str, Any]] = []
        self._refs: dict[int, int] = {}  # id -> index of the object's first description (cycles, sharing)
        self._hold: list[Any] = []  # keeps described objects alive so no id is reused during the walk
        self.modules: dict[int, str] = {}  # id(module) -> its path in the tree being walked
        self.ignore: frozenset[str] = frozenset()  # object fields that record history, not state
        self.root = 0  # id of the object the walk describes
        self.root_ignore: frozenset[str] = frozenset()  # attributes of the root module left out
        self.strings: set[str] = set()  # every string in the state (the keys registries are read with)
        self._registries: list[tuple[Any, str, int]] = []
        self._per_call: set[int] = set()  # ids of backends whose owner sets truncation and padding each call
        self._origins: dict[int, str | None] = {}  # id(backend) -> what its owner was loaded from
        # Every read the description rests on, to re-check cheaply on the next call (Reads).
        self.reads = Reads()

    # -- plumbing ---------------------------------------------------------------------------
    def emit(self, line: str) -> None:
        self.lines.append(line)

    def _seen(self, obj: Any) -> bool:
        """True (and a back-reference emitted) if ``obj`` was described already in this walk."""
        i = self._refs.get(id(obj))
        if i is not None:
            self.emit(f"ref:{i}")
            return True
        self._refs[id(obj)] = len(self._refs)
        self._hold.append(obj)
        return False

    def tensor(self, path: str, t: Any) -> None:
        """A tensor held anywhere: its name, dtype, shape and bytes go into the digest."""
        torch = self.torch
        if t.is_quantized:
            # Quantized tensors: integer values plus the quantisation parameters (new tensors each time).
            self.reads.volatile = True
            self.tensors.append((path + "#int", t.int_repr()))
            if t.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
                self.emit(f"q:{t.qscheme()}:{t.q_scale()!r}:{t.q_zero_point()}")
            else:
                self.emit(f"q:{t.qscheme()}:axis={t.q_per_channel_axis()}")
                self.tensors.append((path + "#scales", t.q_per_channel_scales()))
                self.tensors.append((path + "#zeros", t.q_per_channel_zero_points()))
            return
        if t.layout != torch.strided:
            raise Unidentifiable(path, f"a {t.layout} tensor")
        self.emit(f"tensor:{len(self.tensors)}:{type(t).__module__}.{type(t).__qualname__}")
        self.tensors.append((path, t))
        extra = getattr(t, "__dict__", None)
        if extra:  # Python attributes on a tensor (a Parameter's gain, bitsandbytes' quant_state)
            self.emit("tensor-attrs")
            for k, x in sorted(self.reads.mapping(extra)):
                self.emit(f"field:{k}")
                self.value(x, f"{path}.{k}")  # the object itself: .data may be replaced, so detached when digested

    def finish(self) -> None:
        """Describe the registries the code named, once every string of state and code is known."""
        done = 0
        while done < len(self._registries):
            v, path, depth = self._registries[done]
            done += 1
            self.emit(f"registry-entries:{done - 1}")
            self._mapping(v, path, depth, state=False)

    # -- values -----------------------------------------------------------------------------
    def value(self, v: Any, path: str, depth: int = 0) -> None:
        """Describe a value in state mode: everything that could change what uses it."""
        torch = self.torch
        if depth > 40:
            raise Unidentifiable(path, "nested too deeply to describe")
        if isinstance(v, _PRIMITIVES):
            if isinstance(v, str):
                self.strings.add(v)
            self.emit(f"{type(v).__name__}:{v!r}")
        elif isinstance(v, enum.Enum):
            self.emit(f"enum:{type(v).__module__}.{type(v).__qualname__}.{v.name}")
        elif isinstance(v, (torch.dtype, torch.device, torch.Size, torch.layout, torch.memory_format)):
            self.emit(f"{type(v).__name__}:{v}")
        elif isinstance(v, torch.Tensor):
            self.tensor(path, v)
        elif isinstance(v, torch.nn.Module):
            where = self.modules.get(id(v))
            if where is not None:
                self.emit(f"module@{where}")
            elif not self._seen(v):
                # A module held outside the tree (not registered): walked like a child.
                _describer("module")(self, v, f"{path}~", shallow_code=False)
        elif isinstance(v, (list, tuple, set, frozenset, dict, Mapping)) and self._large(v, path):
            pass
        elif isinstance(v, (list, tuple)):
            if isinstance(v, list):
                self.reads.seq(v)
            self.emit(f"{type(v).__name__}[{len(v)}")
            for i, x in enumerate(v):
                self.value(x, f"{path}[{i}]", depth + 1)
            self.emit("]")
        elif isinstance(v, (set, frozenset)):
            self.reads.frozen(v)
            sub = []
            for x in v:
                w = Walk(torch)
                w.value(x, path, depth + 1)
                if w.tensors:
                    raise Unidentifiable(path, "a set holding tensors (no order to digest them in)")
                sub.append("\n".join(w.lines))
            self.emit(f"set[{len(sub)}:" + repr(sorted(sub)) + "]")
        elif isinstance(v, (dict, Mapping)):
            self._mapping(v, path, depth, state=True)
        elif isinstance(v, (types.FunctionType, types.MethodType, functools.partial, types.BuiltinFunctionType,
                            types.BuiltinMethodType, staticmethod, classmethod, property)) or _torchscript(v):
            self.callable(v, path, depth)
        elif isinstance(v, type):
            self.emit(f"class:{v.__module__}.{v.__qualname__}")
        elif isinstance(v, types.ModuleType):
            self.emit(f"pymodule:{v.__name__}")
        elif isinstance(v, logging.Logger):
            self.emit(f"logger:{v.name}")
        elif isinstance(v, re.Pattern):
            self.emit(f"regex:{v.pattern!r}:{v.flags}")
        elif isinstance(v, weakref.ReferenceType):
            self.reads.call(v, v())
            self.value(v(), path + "()", depth + 1)
        elif type(v).__module__ == "tokenizers" or type(v).__module__.startswith("tokenizers."):
            describe_backend = _describer("backend")
            # Rust state, invisible to the reads: described again on every check, compared as text.
            per_call = id(v) in self._per_call
            origin = self._origins.get(id(v))
            start = len(self.lines)
            describe_backend(self, v, path, per_call=per_call, origin=origin)
            text = tuple(self.lines[start:])
            self.reads.calls.append((lambda b=v, p=path, c=per_call, o=origin: _backend_text(b, p, c, o), text))
        elif isinstance(v, (torch.Generator, random.Random)) or _numpy_random(v):
            raise Unidentifiable(path, "a random generator (its output is random)")
        else:
            self.obj(v, path, depth)

    def _large(self, v: Any, path: str) -> bool:
        """Long tables (a tokenizer's vocabulary, merges) of plain entries, digested in one go.

        Their text is joined in C and hashed, rather than one line per entry: ~50x faster.
        Returns False for containers that are short or hold anything but plain values.
        """
        if len(v) < _LARGE:
            return False
        items = v.items() if isinstance(v, Mapping) else v
        plain = (*_PRIMITIVES, tuple)
        if not all(isinstance(x, plain) and (not isinstance(x, tuple) or all(isinstance(y, _PRIMITIVES) for y in x))
                   for x in items):
            return False  # tensors or objects: repr() summarises them, so they are described one by one
        try:
            text = repr(sorted(items, key=repr) if isinstance(v, (set, frozenset)) else list(items))
        except Exception:  # noqa: BLE001 - unorderable: described entry by entry
            return False
        if "<" in text and " at 0x" in text:  # an object's default repr: not plain values
            return False
        self.reads.size(v)  # between full walks, checked by identity and length (README: out of contract)
        self.emit(f"table:{type(v).__name__}:{len(v)}:{xxhash.xxh3_128_hexdigest(text.encode('utf-8', 'surrogatepass'))}")
        return True

    def _mapping(self, v: Any, path: str, depth: int, state: bool) -> None:
        try:
            items = self.reads.mapping(v)
        except Exception as exc:  # noqa: BLE001
            raise Unidentifiable(path, f"a {type(v).__name__} whose items cannot be read: {exc}") from None
        keyed = []
        for k, x in items:
            if not isinstance(k, (str, int, float, bool, type(None), tuple, enum.Enum)):
                if not state:
                    continue  # a registry keyed by functions or classes (torchvision's kernels): not readable by a name
                raise Unidentifiable(path, f"a mapping keyed by {type(k).__name__}")
            keyed.append((repr(k), x))
        if not state:
            # A registry is read under keys that come from the state (config._attn_implementation,
            # config.layer_types, config.hidden_act): only those entries are described. Others, which
            # other models or libraries register as they are imported (deepseek's cache layer types),
            # would make the key depend on import history. Keys only the code spells out are out of
            # contract (README).
            plain_keys = [raw for raw, _ in items if isinstance(raw, (str, int, float, bool, type(None), tuple, enum.Enum))]
            keyed = [(k, x) for (k, x), raw in zip(keyed, plain_keys, strict=True)
                     if not isinstance(raw, str) or raw in self.strings]
        keyed.sort(key=lambda kx: kx[0])
        self.emit(f"map:{type(v).__module__}.{type(v).__qualname__}[{len(keyed)}")
        for k, x in keyed:
            self.emit(f"key:{k}")
            if state:
                self.value(x, f"{path}[{k}]", depth + 1)
            else:
                self.global_value(x, f"{path}[{k}]", depth + 1)
        self.emit("]")

    def obj(self, v: Any, path: str, depth: int) -> None:
        """An object of some class: its type and every field (``__dict__`` and ``__slots__``)."""
        if self._seen(v):
            return
        cls = type(v)
        fields: dict[str, Any] = {}
        if id(v) != self.root:  # the root's class is checked by the caller (a read would keep it alive)
            self.reads.attr(v, "__class__", cls)
        d = getattr(v, "__dict__", None)
        if isinstance(d, dict):
            if id(v) != self.root:  # (as its class: a read of the root would keep it alive)
                self.reads.attr(v, "__dict__", d)  # a new dict assigned to ``obj.__dict__`` leaves the old one as it was
            fields.update(self.reads.mapping(d))
        for klass in cls.__mro__:
            slots = klass.__dict__.get("__slots__", ())
            for slot in (slots,) if isinstance(slots, str) else slots:
                if slot not in ("__dict__", "__weakref__"):
                    got = getattr(v, slot, _MISSING)
                    self.reads.attr(v, slot, got)
                    if got is not _MISSING:
                        fields[slot] = got
        if d is None and not fields and not _plain_class(cls):
            raise Unidentifiable(path, f"a {cls.__module__}.{cls.__qualname__} holds state that cannot be read")
        self.emit(f"obj:{cls.__module__}.{cls.__qualname__}{{{len(fields)}")
        config = _is_config(v)
        if callable(v) and not isinstance(v, type):
            # A callable object (a tokenizer, a hook object): its class's __call__ and every
            # method or class value that code reaches on the class (self.encode, self.bpe...).
            for key, kind, attr in _describer("entry-methods")(self, cls, ("__call__",)):
                self.emit(f"{kind}:{key}")
                if kind == "method":
                    self.callable(attr, f"{path}.{key}", depth + 1)
                else:
                    self.value(attr, f"{path}.{key}", depth + 1)
        per_call_owner = _sets_backend_each_call(cls)
        for k in sorted(fields):
            if (config and k in CONFIG_PROVENANCE) or k in self.ignore:
                continue
            if per_call_owner and k == "_tokenizer":
                self._per_call.add(id(fields[k]))
                self._origins[id(fields[k])] = _describer("origin")(v, fields[k])
            self.emit(f"field:{k}")
            self.value(fields[k], f"{path}.{k}", depth + 1)
        self.emit("}")

    # -- code -------------------------------------------------------------------------------
    def callable(self, fn: Any, path: str, depth: int = 0, shallow: bool = False) -> None:
        """A function as it runs now: its code, defaults, closure and the globals it reads."""
        if depth > 60:
            raise Unidentifiable(path, "calls nested too deeply to describe")
        if isinstance(fn, (staticmethod, classmethod)):
            self.emit(type(fn).__name__)
            self.callable(fn.__func__, path, depth + 1, shallow)
        elif isinstance(fn, property):
            self.emit("property")
            for part in (fn.fget, fn.fset):
                if part is not None:
                    self.callable(part, path, depth + 1, shallow)
        elif isinstance(fn, types.MethodType):
            self.emit("method")
            self.callable(fn.__func__, f"{path}.__func__", depth + 1, shallow)
            self.value(fn.__self__, f"{path}.__self__", depth + 1)
        elif isinstance(fn, functools.partial):
            self.emit("partial")
            self.callable(fn.func, f"{path}.func", depth + 1, shallow)
            self.value(fn.args, f"{path}.args", depth + 1)
            self.value(fn.keywords, f"{path}.keywords", depth + 1)
        elif isinstance(fn, (types.BuiltinFunctionType, types.BuiltinMethodType)):
            owner = getattr(fn, "__self__", None)
            where = owner.__name__ if isinstance(owner, types.ModuleType) else type(owner).__qualname__
            self.emit(f"builtin:{getattr(fn, '__module__', None) or where}.{fn.__qualname__}")
            if owner is not None and not isinstance(owner, (types.ModuleType, type)):
                # Bound to an instance (``t.mul``, ``Random().random``): what it computes is that
                # instance's too, so it is described (or refused) as a bound Python method's is.
                self.value(owner, f"{path}.__self__", depth + 1)
        elif isinstance(fn, types.FunctionType):
            self._function(fn, path, depth, shallow)
        elif isinstance(fn, type):
            self.emit(f"class:{fn.__module__}.{fn.__qualname__}")
        elif type(fn).__name__ == "ScriptFunction":  # (a scripted module is walked as a module, below)
            code = getattr(fn, "code", None)
            if not isinstance(code, str):
                raise Unidentifiable(path, f"a TorchScript {type(fn).__name__} without code")
            self.emit(f"script:{xxhash.xxh3_128_hexdigest(code.encode())}")
        elif type(fn).__name__ == "ScriptMethod":
            # Its code runs on its module's tensors, which live in C++ out of reach from the method (a
            # loaded module's method has no Python field at all): hold the scripted module instead.
            raise Unidentifiable(path, "a TorchScript method (its module's state cannot be read through it)")
        elif callable(fn):
            self.value(fn, path, depth + 1)  # a callable object: its class's __call__ and its fields
        else:
            raise Unidentifiable(path, f"{type(fn).__name__} is not callable")

    def _function(self, fn: types.FunctionType, path: str, depth: int, shallow: bool) -> None:
        digest, names, _ = CODE_MEMO.get(fn.__code__)
        self.emit(f"fn:{fn.__module__}.{fn.__qualname__}:{digest}")
        if self._seen(fn):
            return
        self.reads.attr(fn, "__code__", fn.__code__)
        self.reads.attr(fn, "__defaults__", fn.__defaults__)
        self.reads.attr(fn, "__kwdefaults__", fn.__kwdefaults__)
        if fn.__defaults__:
            self.value(fn.__defaults__, f"{path}.__defaults__", depth + 1)
        if fn.__kwdefaults__:
            self.value(fn.__kwdefaults__, f"{path}.__kwdefaults__", depth + 1)
        # Closures are followed even for torch's own functions: its decorators (no_grad...) keep the
        # user's function there.
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=False):
            self.emit(f"cell:{name}")
            try:
                contents = cell.cell_contents
            except ValueError:  # not yet bound
                self.reads.cell(cell, _MISSING)
                self.emit("unbound")
                continue
            self.reads.cell(cell, contents)
            self.value(contents, f"{path}<{name}>", depth + 1)
        wrapped = getattr(fn, "__wrapped__", None)
        if wrapped is not None:
            self.reads.attr(fn, "__wrapped__", wrapped)
            self.emit("wrapped")
            self.callable(wrapped, f"{path}.__wrapped__", depth + 1)
        # Where the code was defined, from its globals: functools.wraps copies __module__ from
        # whatever it wraps, so a user's wrapper of a torch function would pass for torch's.
        if shallow or _shallow(fn.__globals__.get("__name__")):
            return
        g = fn.__globals__
        for name in names:
            got = g.get(name, _MISSING)
            self.reads.item(g, name, got)
            if got is not _MISSING:
                self.emit(f"global:{name}")
                self.global_value(got, f"{fn.__module__}.{name}", depth + 1, attrs=names)

    def global_value(self, v: Any, path: str, depth: int, attrs: tuple[str, ...] = ()) -> None:
        """A name a function looks up in its module, described in global mode (see the module docstring)."""
        if isinstance(v, _PRIMITIVES) or isinstance(v, enum.Enum):
            self.value(v, path, depth)
        elif isinstance(v, (types.FunctionType, functools.partial, types.MethodType, types.BuiltinFunctionType,
                            staticmethod, classmethod)) or _torchscript(v):
            self.callable(v, path, depth)
        elif isinstance(v, types.ModuleType):
            self.emit(f"pymodule:{v.__name__}")
            # A lazy module (transformers' own) fills its namespace as submodules are imported, so
            # what its __dict__ holds depends on import history, not on what runs: not followed.
            if not _shallow(v.__name__) and type(v).__name__ != "_LazyModule":
                # Attribute lookups through a module (``masking_utils.create_causal_mask``): the
                # functions found under any name the code uses.
                for name in attrs:
                    f = v.__dict__.get(name, _MISSING)
                    if f is not _MISSING:
                        self.reads.item(v.__dict__, name, f)
                    if isinstance(f, types.FunctionType):
                        self.emit(f"attr:{name}")
                        self.callable(f, f"{path}.{name}", depth + 1)
        elif isinstance(v, type):
            self.emit(f"class:{v.__module__}.{v.__qualname__}")
        elif isinstance(v, (tuple, list, frozenset)) and len(v) < _LARGE and all(isinstance(x, _PRIMITIVES) for x in v):
            self.value(v, path, depth)
        elif isinstance(v, Mapping) and not isinstance(v, types.MappingProxyType):
            if self._seen(v):
                return
            # A registry (ALL_ATTENTION_FUNCTIONS, ACT2FN, ROPE_INIT_FUNCTIONS): described at the end
            # (finish), under the keys that can be looked up in it.
            self.emit(f"registry:{type(v).__module__}.{type(v).__qualname__}:{len(self._registries)}")
            self._registries.append((v, path, depth))
        else:
            self.emit(f"object:{type(v).__module__}.{type(v).__qualname__}")


def _backend_text(backend: Any, path: str, per_call: bool, origin: str | None) -> tuple[str, ...]:
    walk = Walk(None)
    _describer("backend")(walk, backend, path, per_call=per_call, origin=origin)
    return tuple(walk.lines)


_FAST_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _sets_backend_each_call(cls: type) -> bool:
    """A transformers fast tokenizer: every encode sets its backend's truncation, padding and
    special-token splitting from its own options first (``set_truncation_and_padding``), so
    what the backend holds between calls (the last call's settings) never reaches an output.
    Only while the encode path is transformers' own: a subclass that overrides it may not."""
    for name in ("_encode_plus", "_batch_encode_plus", "set_truncation_and_padding"):
        owner = next((k for k in cls.__mro__ if name in k.__dict__), None)
        if owner is not None and not (owner.__module__.startswith("transformers.") and owner.__name__ in _FAST_TOKENIZERS):
            return False
    return any(k.__module__.startswith("transformers.") and k.__name__ in _FAST_TOKENIZERS for k in cls.__mro__)


def _numpy_random(v: Any) -> bool:
    """A numpy random generator, subclasses included (a subclass has a __dict__, and would be keyed by it)."""
    r = sys.modules.get("numpy.random")  # none can exist before numpy.random is imported
    return r is not None and isinstance(v, (r.Generator, r.RandomState, r.BitGenerator))


def _torchscript(v: Any) -> bool:
    """TorchScript code: a scripted function (named by its compiled code, which may have no Python function
    behind it) or a scripted module's method (refused): see ``Walk.callable``."""
    return type(v).__name__ in ("ScriptFunction", "ScriptMethod")


def _plain_class(cls: type) -> bool:
    # Any: mypy flags reading __init__ off a class as unsound (as if off an instance), and these `is` tests as never true
    c: Any = cls
    return c.__init__ is object.__init__ and c.__new__ is object.__new__


def _is_config(v: Any) -> bool:
    return any(k.__name__ == "PretrainedConfig" for k in type(v).__mro__)


def loaded(module: str) -> Any:
    """A module already imported by the caller's objects (the identity never imports one itself)."""
    return sys.modules.get(module)
