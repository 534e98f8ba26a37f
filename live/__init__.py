"""promptstore._live: what a torch model, tower or tokenizer computes *now*, for both adapters.

A key must change whenever the output would. Files name what was loaded; this names what
runs: every tensor of a module tree's state, every module's settings and ``training`` flag,
its hooks (with what they capture), the live code its forward reaches (methods, module
functions and registries such as transformers' attention functions, as bound now), the
ambient torch state that changes numerics, and a tokenizer's options and tables.

What is keyed, refused and out of contract is listed in the README ("Guarantees"). In short:
  keyed:   the above;
  refused: values on the path that cannot be named (opaque extension objects, random
           generators, sets of tensors), and active dropout or batch norm in training mode;
  out of contract: code reached only through objects' methods named indirectly (``getattr``
           with a computed name), library internals edited in place (torch is named by its
           version), and C extensions' hidden state.

Used only by ``promptstore.vision`` and ``promptstore.llm``; the core never imports it.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import xxhash

from promptstore import digest_tensors
from promptstore.errors import UnsupportedModelError

from ._ambient import ambient_lines, autocast_active
from ._modules import active_dropout, forward_intercepted, walk_tree
from ._random import Generators
from ._tokenizers import TOKENIZER_FILES, TOKENIZER_IGNORED, record_tokenizer, tokenizer_files
from ._walk import Unidentifiable, Walk

__all__ = ["Generators", "reset_memos", "Identity", "classes_identity", "functions_identity", "module_identity", "module_structure", "ambient_identity", "tokenizer_identity", "refuse_random", "autocast_active", "forward_intercepted",
           "load_tokenizer"]


# module -> {(entries, skip): (class, reads, structure digest, tensors)}: the last full description
# and the reads it rests on. Weak keys: a model that goes away takes its memo with it.
class _ByObject:
    """A memo keyed by object identity (never by ``__eq__``), dropped when the object goes away."""

    def __init__(self) -> None:
        self._d: dict[int, tuple[Any, Any]] = {}

    def get(self, obj: Any) -> Any:
        hit = self._d.get(id(obj))
        return hit[1] if hit is not None and hit[0]() is obj else None

    def set(self, obj: Any, value: Any) -> None:
        key = id(obj)
        try:
            # cast: mypy cannot infer a lambda with default arguments against weakref.ref's callback type
            ref = weakref.ref(obj, cast("Callable[[weakref.ref[Any]], object]", lambda _, k=key, d=self._d: d.pop(k, None)))
        except TypeError:
            return  # not weak-referenceable: described in full every call
        self._d[key] = (ref, value)


_MEMO = _ByObject()
_TOKENIZERS = _ByObject()


class Identity(NamedTuple):
    """A module tree's identity, in two parts: ``structure`` (all but the tensor bytes) and ``weights``."""

    structure: str
    weights: str

    def __str__(self) -> str:
        return f"{self.structure}:{self.weights}"


def _torch() -> Any:
    import torch

    return torch


def module_identity(module: Any, *, entries: tuple[str, ...] = ("forward",), skip: str | tuple[str, ...] = "",
                    ignore: tuple[str, ...] = (), what: str = "", random: bool = False) -> Identity:
    """What ``module`` computes with, now: :func:`module_structure` and the digest of every tensor of its state.

    Raises:
        UnsupportedModelError: something on the path cannot be named exactly (or, unless
            ``random``, dropout or batch norm active in training mode).
    """
    structure, tensors = module_structure(module, entries=entries, skip=skip, ignore=ignore, what=what, random=random)
    # Tensor bytes are read on every call (digest_tensors proves file-mapped pages unchanged instead).
    return Identity(structure, digest_tensors("live", tensors))


def module_structure(module: Any, *, entries: tuple[str, ...] = ("forward",), skip: str | tuple[str, ...] = "",
                     ignore: tuple[str, ...] = (), what: str = "", random: bool = False) -> tuple[str, list[tuple[str, Any]]]:
    """Everything ``module`` (and every submodule outside ``skip``) computes with but tensor bytes, now.

    Returns ``(structure digest, the named tensors to digest)``: what the identity rests on
    apart from the weights' bytes, and the tensors themselves (read, not yet hashed).

    Args:
        module: a ``torch.nn.Module``.
        entries: the methods a cached call enters through (``forward``; ``encode_text``...).
        skip: submodule paths left out (an image tower that never sees text).
        ignore: attributes of the root module the entry code provably never reads (YOLOE's
            ``nc``, which set_classes itself sets; get_tpe does not read it).
        what: how errors name the module.
        random: accept active dropout or batch norm in training mode (the caller makes sure
            nothing random is stored, e.g. because the computation runs in eval mode anyway).

    Raises:
        UnsupportedModelError: something on the path cannot be named exactly; unless
            ``random``, dropout or batch norm active in training mode (see :func:`refuse_random`).
    """
    torch = _torch()
    memos = _MEMO.get(module)
    if memos is None:
        memos = {}
        _MEMO.set(module, memos)
    memo = memos.get((entries, skip, ignore))
    if memo is not None and memo[0] is type(module) and memo[1].same():
        structure, tensors, noisy = memo[2], memo[3], memo[4]
    else:
        walk = Walk(torch)
        walk.root_ignore = frozenset(ignore)
        walk.emit(f"torch={torch.__version__.split('+')[0]}")
        try:
            walk_tree(walk, module, entries=entries, skip=skip)
        except Unidentifiable as exc:
            raise UnsupportedModelError(f"{what or type(module).__name__}: cannot identify {exc.path} ({exc.what}); "
                                        "a cached result could differ from a recompute") from None
        structure = xxhash.xxh3_128_hexdigest("\n".join(walk.lines).encode("utf-8", "surrogatepass"))
        tensors = walk.tensors
        # Training flags and dropout rates live in the modules' dicts the reads cover: the
        # verdict holds as long as they do.
        noisy = active_dropout(module, skip=skip)
        memos[(entries, skip, ignore)] = (type(module), walk.reads, structure, tensors, noisy)
    if noisy is not None and not random:
        raise UnsupportedModelError(f"{what or type(module).__name__} is in training mode with {noisy}: its outputs "
                                    "are random, and a cache would freeze one draw; call .eval() first")
    return structure, tensors


_CLASSES: dict[tuple[type, ...], tuple[Any, str]] = {}


def classes_identity(*classes: type) -> str:
    """The live code of whole classes a computation runs outside the module tree (transformers'
    cache classes, whose ``update`` every attention layer calls): every method and plain class
    value up each MRO, as bound now.

    Raises:
        UnsupportedModelError: something in them cannot be named.
    """
    def describe(walk: Walk) -> None:
        for cls in classes:
            for klass in cls.__mro__:
                if klass.__module__ == "builtins":
                    break
                walk.emit(f"class:{klass.__module__}.{klass.__qualname__}")
                for name, attr in sorted(walk.reads.mapping(klass.__dict__), key=lambda kv: kv[0]):
                    if name.startswith("__") and name.endswith("__") and name not in ("__init__", "__call__"):
                        continue
                    if callable(attr) or isinstance(attr, (staticmethod, classmethod, property)):
                        walk.emit(f"method:{name}")
                        walk.callable(attr, f"{klass.__qualname__}.{name}")

    return _code_identity(_CLASSES, classes, "classes", describe)


def functions_identity(*functions: Any) -> str:
    """The live code of functions a computation calls outside the module tree (a model's helper that
    makes its text side's masks from the ids): each one's code, and what it reads, as bound now.

    Raises:
        UnsupportedModelError: something in them cannot be named.
    """
    def describe(walk: Walk) -> None:
        for i, fn in enumerate(functions):
            walk.emit(f"function:{i}")
            walk.callable(fn, getattr(fn, "__qualname__", repr(fn)))

    if len(_FUNCTIONS) > 256:  # keyed by the functions themselves: a process that patches many keeps few
        _FUNCTIONS.clear()
    return _code_identity(_FUNCTIONS, functions, "functions", describe)


_FUNCTIONS: dict[tuple[Any, ...], tuple[Any, str]] = {}


def _code_identity(memo: dict[Any, tuple[Any, str]], key: tuple[Any, ...], label: str,
                   describe: Callable[[Walk], None]) -> str:
    """The digest of what ``describe`` emits, memoised on ``key`` while every read it rests on is unchanged."""
    known = memo.get(key)
    if known is not None and known[0].same():
        return known[1]
    walk = Walk(_torch())
    try:
        describe(walk)
        walk.finish()
    except Unidentifiable as exc:
        raise UnsupportedModelError(f"cannot identify {exc.path} ({exc.what})") from None
    out = f"{label}:" + xxhash.xxh3_128_hexdigest("\n".join(walk.lines).encode("utf-8", "surrogatepass"))
    memo[key] = (walk.reads, out)
    return out


def describe_lines(module: Any, entries: tuple[str, ...] = ("forward",), skip: str | tuple[str, ...] = "") -> list[str]:
    """The text ``module_identity`` digests (for finding what changed between two calls)."""
    walk = Walk(_torch())
    walk_tree(walk, module, entries=entries, skip=skip)
    return walk.lines


def ambient_identity() -> str:
    """The ambient torch state that changes numerics (autocast, matmul precision, default dtype...)."""
    return "ambient:" + xxhash.xxh3_128_hexdigest("\n".join(ambient_lines(_torch())).encode())


def tokenizer_identity(tokenizer: Any, what: str = "tokenizer", ignore: tuple[str, ...] = ()) -> str:
    """A tokenizer's live options and tables (see ``_tokenizers``), read on every call.

    ``ignore``: attributes left out, at any depth (a processor's ``image_processor``, which a
    text-only call never runs).

    Raises:
        UnsupportedModelError: a tokenizer holding state that cannot be named.
    """
    if tokenizer is None:
        return "tokenizer:none"
    memos = _TOKENIZERS.get(tokenizer) or {}
    memo = memos.get(ignore)
    if memo is not None and memo[0] is type(tokenizer) and memo[1].same():
        return str(memo[2])
    walk = Walk(_torch())
    walk.ignore = TOKENIZER_IGNORED | frozenset(ignore)
    walk.root = id(tokenizer)
    try:
        walk.value(tokenizer, what)
        walk.finish()
    except Unidentifiable as exc:
        raise UnsupportedModelError(f"cannot identify the {what} ({exc.path}: {exc.what})") from None
    out = "tokenizer:" + xxhash.xxh3_128_hexdigest("\n".join(walk.lines).encode("utf-8", "surrogatepass"))
    _TOKENIZERS.set(tokenizer, {**memos, ignore: (type(tokenizer), walk.reads, out)})
    return out


def load_tokenizer(folder: Any, **kwargs: Any) -> Any:
    """``AutoTokenizer.from_pretrained(folder, **kwargs)``, recording the files it was built from, so that
    fresh processes name its vocabulary from those files' digests instead of serialising it (~30 ms)."""
    from transformers import AutoTokenizer

    before = tokenizer_files(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    names = getattr(type(tokenizer), "vocab_files_names", {}).values()
    # Other arguments may pick other files (subfolder=, tokenizer_file=, gguf_file=); a class may read a
    # file the list does not name: then nothing is recorded.
    if not kwargs and os.path.isdir(folder) and all(n in TOKENIZER_FILES for n in names if isinstance(n, str)):
        record_tokenizer(tokenizer, before, tokenizer_files(folder))
    return tokenizer


def refuse_random(module: Any, skip: str | tuple[str, ...] = "", what: str = "") -> None:
    """Refuse a module in training mode whose output is random or batch-dependent (dropout, batch norm).

    Such outputs must never be frozen into a cache: a later call would get one draw forever.

    Raises:
        UnsupportedModelError: naming the first such module; call ``model.eval()``.
    """
    module_structure(module, skip=skip, what=what)


def reset_memos(digests: bool = True) -> None:
    """Forget everything this process remembers about identities: module structures, tokenizers, classes,
    tokenizer backends, code, and (``digests``) file digests, whose memo is then opened again where
    ``$PROMPTSTORE_DIGESTS`` names. For test sessions and benchmarks that must start as a fresh process."""
    from promptstore import _digest

    from . import _tokenizers, _walk

    if digests:
        _digest._memo = _digest._Memo()
    for memo in (_MEMO, _TOKENIZERS):
        memo._d.clear()
    _CLASSES.clear()
    _FUNCTIONS.clear()
    with _tokenizers._MEMO_LOCK:
        _tokenizers._MEMO.clear()
    _walk.CODE_MEMO._known.clear()
