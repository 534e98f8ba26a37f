"""Fingerprints of what produces KV tensors: config, weights, tokenizer, KV dtype and layout.

A fingerprint names the exact computation, so any change that could change a KV tensor
changes it too. The weights are hashed in full on every request, never memoised: torch's
version counters miss edits made through ``param.data`` (assignment, in-place writes on
it, ``.half()`` then ``.float()``), which then served the old weights' KV (issue #10).
xxh3 runs at ~15 GB/s, so SmolLM2's 540 MB cost ~37 ms (measured, one core).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
from typing import Any

import numpy as np

from promptstore import digest_tensors, file_digest

__all__ = ["model_fingerprint", "tokenizer_fingerprint", "architecture"]

# Config fields that name where a model came from, not what it computes.
_IRRELEVANT = {"_name_or_path", "transformers_version", "_commit_hash", "quantization_config", "torch_dtype", "dtype",
               "architectures", "_attn_implementation_autoset", "use_cache", "output_attentions",
               "output_hidden_states", "return_dict"}


def code(model: Any) -> list[str]:
    """The code that computes: transformers' version and the source file of every module class in the model.

    A class of the same name from another file (a subclass, remote code, a patched
    attention module) or a transformers upgrade that edits a modeling file computes other KV.
    """
    import transformers

    out = [f"transformers={transformers.__version__}"]
    for cls in sorted({type(m) for m in model.modules()}, key=lambda c: (c.__module__, c.__qualname__)):
        source = _source_file(cls)
        digest = file_digest(source) if source and os.path.isfile(source) else "builtin"
        out.append(f"{cls.__module__}.{cls.__qualname__}:{digest}")
    return out


@functools.lru_cache(maxsize=4096)
def _source_file(cls: type) -> str | None:
    """Where a class is defined (its file's contents are digested on every call, memoised by file identity)."""
    try:
        return inspect.getsourcefile(cls)
    except TypeError:  # a built-in class
        return None


def architecture(model: Any) -> str:
    """The model's class, attention implementation, config and code (what computes, not its weights)."""
    config = {k: v for k, v in model.config.to_dict().items() if k not in _IRRELEVANT}
    return json.dumps([type(model).__name__, str(getattr(model.config, "_attn_implementation", "")), config,
                       code(model)], sort_keys=True, default=str)


def model_fingerprint(model: Any) -> str:
    """A digest of the model's class, config, attention implementation and every weight and buffer."""
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    return "model:" + digest_tensors(architecture(model), sorted(named, key=lambda kv: kv[0]))


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A digest of the tokenizer's full definition (vocabulary, merges, special tokens)."""
    if tokenizer is None:
        return "tokenizer:none"
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    special = json.dumps(getattr(tokenizer, "all_special_tokens", []), sort_keys=True)
    return "tokenizer:" + digest_tensors(type(tokenizer).__name__, [
        ("definition", np.frombuffer(definition.encode(), np.uint8)), ("special", np.frombuffer(special.encode(), np.uint8))])
