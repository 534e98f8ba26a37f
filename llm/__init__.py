"""promptstore.llm: exact prefix KV reuse for transformers causal LMs.

>>> from promptstore.llm import PrefixCache, load_model
>>> model, tokenizer = load_model("smollm2-135m-instruct")      # doctest: +SKIP
>>> pc = PrefixCache(model, tokenizer)                          # doctest: +SKIP
>>> out = pc.generate([{"role": "user", "content": "Hi"}], max_new_tokens=16)  # doctest: +SKIP

Needs the ``llm`` extra: ``pip install "promptstore[llm]"``.
"""

from ._chunks import ChunkCache
from ._model import load_model, models_dir
from ._prefix import PrefixCache

__all__ = ["ChunkCache", "PrefixCache", "load_model", "models_dir"]
