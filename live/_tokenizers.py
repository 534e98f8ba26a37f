"""A tokenizer's live identity: every option and table that decides its token ids, read on every call.

Python-side tokenizers (transformers' classes, open_clip's SimpleTokenizer and HFTokenizer,
processors that hold one) are walked field by field like any object, so an option changed in
place (``context_length``, ``clean_fn``, ``strip_sep_token``, ``reduction_mask``,
``model_max_length``, ``padding_side``, a chat template) changes the identity at once.

A Rust ``tokenizers.Tokenizer`` (``backend_tokenizer``) is read through its parts: normaliser,
pre-tokeniser, post-processor, decoder, added tokens, truncation and padding, the model's
type and settings (BPE dropout included) are read every call (microseconds). The model's
vocabulary and merges cost ~20-35 ms to serialise (SmolLM2's 49k BPE), so their digest is
remembered per backend object, and between processes for a tokenizer whose loader recorded
where it came from (``load_model`` does; see :func:`record_tokenizer`): under the digests of the
files it was loaded from (taken before and after the load), the tokenizer's class, its init
arguments and the library versions, so a fresh process serialises nothing. A tokenizer loaded
any other way serialises its vocabulary once per process. What the Python API can change in place without replacing the model is all in the
parts read every call; a replaced model (or backend) is caught by its vocabulary size and by the
tokens a fixed probe text and 32 sampled ids give. Out of contract: replacing the model or the
backend by one of the same type, settings and size that agrees on that probe.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, cast

import xxhash

from ._walk import Unidentifiable, Walk, register_describer

__all__ = ["describe_backend", "tokenizer_files", "record_tokenizer", "tokenizer_origin", "TOKENIZER_IGNORED",
           "TOKENIZER_FILES"]

# Fields that record where a tokenizer came from or what it has done, not what it computes.
TOKENIZER_IGNORED = frozenset({"name_or_path", "init_kwargs", "init_inputs", "files_loaded", "deprecation_warnings",
                               "verbose", "cache", "_processor_class", "vocab_file", "merges_file"})
_PROBE = "The quick brown fox, 0123456789; ÄÖÜ ß 日本語 <|im_start|> \n\t  Hello!? tokenizer's"
_MEMO_LOCK = threading.Lock()
_MEMO: dict[int, tuple[Any, str, str]] = {}  # id(backend) -> (backend, stamp, model digest)


def _state(part: Any) -> str:
    if part is None:
        return "none"
    state = part.__getstate__()
    return state.decode("utf-8", "surrogateescape") if isinstance(state, bytes) else repr(state)


def _model_stamp(model: Any, backend: Any) -> str:
    settings = []
    for name in ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk", "byte_fallback",
                 "ignore_merges", "max_input_chars_per_word"):
        if hasattr(model, name):
            settings.append(f"{name}={getattr(model, name)!r}")
    size = backend.get_vocab_size(with_added_tokens=False)
    probe = [(t.id, t.value) for t in model.tokenize(_PROBE)] if hasattr(model, "tokenize") else []
    sample = [backend.id_to_token(i) for i in range(0, max(size, 1), max(size // 32, 1))]
    return repr([type(model).__name__, settings, size, probe, sample])


# What from_pretrained may read from a tokenizer folder: a class's vocab_files_names must be among them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "tekken.json", "vocab.model", "tiktoken.model")
# id(backend) -> (weak reference to its owner, the backend, origin): what a tokenizer was loaded from,
# recorded at load time by whoever loaded it (tokenizer_files, then record_tokenizer).
_ORIGINS: dict[int, tuple[Any, Any, str]] = {}


def tokenizer_files(folder: str | os.PathLike[str]) -> list[tuple[str, str]] | None:
    """The files of ``TOKENIZER_FILES`` in ``folder``, by digest (None: none, or one unreadable)."""
    from promptstore import file_digest

    files = []
    for name in TOKENIZER_FILES:
        path = os.path.join(os.fspath(folder), name)
        if os.path.isfile(path):
            try:
                files.append((name, file_digest(path)))
            except OSError:
                return None
    return files or None


def record_tokenizer(owner: Any, files: list[tuple[str, str]] | None, after: list[tuple[str, str]] | None) -> None:
    """Record that ``owner`` (a transformers tokenizer) was just loaded from ``files`` (digests taken before
    the load; ``after``: the same taken after it). Its backend's vocabulary digest is then remembered
    between processes under them (see the module docstring); files that changed during the load: nothing."""
    backend = getattr(owner, "_tokenizer", None)
    if files is None or files != after or backend is None:
        return
    import tokenizers
    import transformers

    kwargs = getattr(owner, "init_kwargs", None)
    origin = repr([f"tokenizers={tokenizers.__version__}", f"transformers={transformers.__version__}",
                   f"{type(owner).__module__}.{type(owner).__qualname__}", files,
                   sorted((str(k), repr(v)) for k, v in kwargs.items()) if isinstance(kwargs, dict) else None])
    key = id(backend)
    with _MEMO_LOCK:
        # cast: mypy cannot infer a lambda with default arguments against weakref.ref's callback type
        _ORIGINS[key] = (weakref.ref(owner, cast("Callable[[weakref.ref[Any]], object]", lambda _, k=key: _ORIGINS.pop(k, None))),
                         backend, origin)


def tokenizer_origin(owner: Any, backend: Any) -> str | None:
    """What ``backend`` was built from, if ``owner`` recorded it at load time and still holds that very backend."""
    hit = _ORIGINS.get(id(backend))
    if hit is None or hit[0]() is not owner or hit[1] is not backend:
        return None
    return str(hit[2])


def _model_digest(backend: Any, stamp: str, origin: str | None) -> str:
    key = id(backend)
    with _MEMO_LOCK:
        hit = _MEMO.get(key)
        if hit is not None and hit[0] is backend and hit[1] == stamp:
            return hit[2]

    def serialised() -> str:
        return xxhash.xxh3_128_hexdigest(_state(backend.model).encode("utf-8", "surrogateescape"))

    if origin is None:
        digest = serialised()
    else:
        from promptstore import derived_digest

        digest = derived_digest(f"tokenizers-model\0{origin}\0{stamp}", serialised)
    with _MEMO_LOCK:
        if len(_MEMO) > 256:
            _MEMO.clear()
        _MEMO[key] = (backend, stamp, digest)  # a strong reference: the id is never another's
    return digest


def describe_backend(walk: Walk, v: Any, path: str, *, per_call: bool = False, origin: str | None = None) -> None:
    """A ``tokenizers`` object: a whole Tokenizer by its parts, any other part by its serialised state.

    ``per_call``: the backend of a transformers fast tokenizer, which sets truncation, padding and
    special-token splitting before every encode; what they hold now is left out.
    ``origin``: what that tokenizer was built from (:func:`tokenizer_origin`).
    """
    import tokenizers

    if isinstance(v, tokenizers.Tokenizer):
        model = v.model
        stamp = _model_stamp(model, v)
        added = sorted((i, repr(t.__getstate__())) for i, t in v.get_added_tokens_decoder().items())
        walk.emit("tokenizers.Tokenizer")
        for name in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
            walk.emit(f"{name}:{_state(getattr(v, name))}")
        walk.emit(f"added:{added!r}")
        if not per_call:
            walk.emit(f"truncation:{v.truncation!r}:padding:{v.padding!r}:encode_special_tokens:"
                      f"{getattr(v, 'encode_special_tokens', None)!r}")
        walk.emit(f"model:{stamp}:{_model_digest(v, stamp, origin)}")
        return
    # Every object has object.__getstate__ on Python 3.11+, which says nothing of a native one's
    # contents (tokenizers.Regex): only a class's own __getstate__ names its state.
    if getattr(type(v), "__getstate__", None) in (None, getattr(object, "__getstate__", None)):
        raise Unidentifiable(path, f"a tokenizers.{type(v).__name__} without a serialisable state")
    walk.emit(f"tokenizers.{type(v).__name__}:{_state(v)}")


register_describer("origin", tokenizer_origin)
register_describer("backend", describe_backend)
