"""promptstore.llm: exact prefix KV reuse for transformers causal LMs.

>>> from promptstore.llm import PrefixCache, load_model
>>> model, tokenizer = load_model("smollm2-135m-instruct")      # doctest: +SKIP
>>> pc = PrefixCache(model, tokenizer)                          # doctest: +SKIP
>>> out = pc.generate([{"role": "user", "content": "Hi"}], max_new_tokens=16)  # doctest: +SKIP

Needs the ``llm`` extra: ``pip install "promptstore[llm]"``. ``LlamaCppCache``, llama-cpp-python's
prompt cache backed by the store, needs the ``llamacpp`` extra instead and is imported on first use.
"""

from typing import Any

from ._chunks import ChunkCache
from ._model import load_model, models_dir
from ._prefix import PrefixCache

__all__ = ["ChunkCache", "LlamaCppCache", "PrefixCache", "load_model", "models_dir"]


def __getattr__(name: str) -> Any:
    # llama-cpp-python is imported only by who uses it: the transformers side never needs it.
    if name == "LlamaCppCache":
        from ._llamacpp import LlamaCppCache

        return LlamaCppCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
