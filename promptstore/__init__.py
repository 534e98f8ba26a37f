"""promptstore: one content-addressed cache for what models compute from prompts.

Open-vocabulary class embeddings (YOLOE ``set_classes``) and LLM prefix KV tensors share
one key scheme, one entry format (a safetensors file per entry) and one cost-aware
eviction policy, in tiers: process memory, a disk folder, and Redis.

>>> from promptstore import PromptStore
>>> store = PromptStore("/tmp/ps-doctest", memory_bytes="64MiB", disk_bytes="1GiB")
>>> import numpy as np
>>> key = store.key("demo", "hello")
>>> store.put(key, {"x": np.arange(3, dtype=np.float32)}, kind="demo", cost_s=0.5)
True
>>> store.get(key).tensors["x"].tolist()
[0.0, 1.0, 2.0]
"""

from __future__ import annotations

from . import errors
from ._digest import derived_digest, digest_memo_path, digest_tensors, file_digest
from ._entry import Entry, EntryInfo
from ._keys import chain_keys, make_key
from ._sizes import format_size, parse_size
from ._store import PromptStore, default_path
from ._tolerance import KV_TOLERANCE, kv_tolerance
from ._writer import background_priority

__version__ = "0.1.0"

__all__ = [
    "PromptStore",
    "default_path",
    "Entry",
    "EntryInfo",
    "make_key",
    "chain_keys",
    "parse_size",
    "format_size",
    "file_digest",
    "digest_tensors",
    "digest_memo_path",
    "derived_digest",
    "background_priority",
    "KV_TOLERANCE",
    "kv_tolerance",
    "errors",
    "__version__",
]
