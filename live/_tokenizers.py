"""A tokenizer's live identity: every option and table that decides its token ids, read on every call.

Python-side tokenizers (transformers' classes, open_clip's SimpleTokenizer and HFTokenizer,
processors that hold one) are walked field by field like any object, so an option changed in
place (``context_length``, ``clean_fn``, ``strip_sep_token``, ``reduction_mask``,
``model_max_length``, ``padding_side``, a chat template) changes the identity at once.

A Rust ``tokenizers.Tokenizer`` (``backend_tokenizer``) is read through its parts: normaliser,
pre-tokeniser, post-processor, decoder, added tokens, truncation and padding, the model's
type and settings (BPE dropout included) are read every call (microseconds). The model's
vocabulary and merges cost ~20 ms to serialise (SmolLM2's 49k BPE), so their digest is
remembered per backend object. What the Python API can change in place without replacing the
model is all in the parts read every call; a replaced model is caught by its vocabulary size
and by the tokens a fixed probe text and 32 sampled ids give. Out of contract: replacing the
model by one of the same type, settings and size that agrees on that probe.
"""

from __future__ import annotations

import threading
from typing import Any

import xxhash

from ._walk import Unidentifiable, Walk

__all__ = ["describe_backend", "TOKENIZER_IGNORED"]

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


def _model_digest(backend: Any, stamp: str) -> str:
    key = id(backend)
    with _MEMO_LOCK:
        hit = _MEMO.get(key)
        if hit is not None and hit[0] is backend and hit[1] == stamp:
            return hit[2]
    digest = xxhash.xxh3_128_hexdigest(_state(backend.model).encode("utf-8", "surrogateescape"))
    with _MEMO_LOCK:
        if len(_MEMO) > 256:
            _MEMO.clear()
        _MEMO[key] = (backend, stamp, digest)  # a strong reference: the id is never another's
    return digest


def describe_backend(walk: Walk, v: Any, path: str, *, per_call: bool = False) -> None:
    """A ``tokenizers`` object: a whole Tokenizer by its parts, any other part by its serialised state.

    ``per_call``: the backend of a transformers fast tokenizer, which sets truncation, padding and
    special-token splitting before every encode; what they hold now is left out.
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
        walk.emit(f"model:{stamp}:{_model_digest(v, stamp)}")
        return
    # Every object has object.__getstate__ on Python 3.11+, which says nothing of a native one's
    # contents (tokenizers.Regex): only a class's own __getstate__ names its state.
    if getattr(type(v), "__getstate__", None) in (None, getattr(object, "__getstate__", None)):
        raise Unidentifiable(path, f"a tokenizers.{type(v).__name__} without a serialisable state")
    walk.emit(f"tokenizers.{type(v).__name__}:{_state(v)}")
