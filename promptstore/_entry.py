"""The entry: named tensors plus what the store needs to keep, verify and evict them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Entry", "EntryInfo"]


@dataclass(eq=False)
class Entry:
    """One stored item, as :meth:`PromptStore.get` returns it.

    ``tensors`` are read-only numpy arrays. Tensors of dtypes numpy lacks (``BF16``,
    ``F8_E4M3``, ``F8_E5M2``) come back as unsigned integers holding the raw bits;
    ``dtypes`` gives each tensor's safetensors dtype name so nothing is lost.
    """

    key: bytes
    kind: str
    tensors: dict[str, np.ndarray]
    dtypes: dict[str, str]
    meta: dict[str, str] = field(default_factory=dict)
    parent: bytes | None = None
    cost_s: float = 0.0
    size: int = 0
    namespace: str = ""
    ttl_s: float | None = None
    created: float = 0.0
    last_hit: float = 0.0
    hits: int = 0
    # The encoded bytes (any buffer: bytes, a uint8 array) the arrays are views of; kept so
    # a promotion or a write-through to another tier does not encode again.
    blob: Any = field(default=None, repr=False)

    @property
    def hex(self) -> str:
        """The key as 64 hex characters."""
        return self.key.hex()

    def __repr__(self) -> str:
        shapes = {n: f"{self.dtypes[n]}{list(t.shape)}" for n, t in self.tensors.items()}
        return f"Entry({self.hex[:16]}…, kind={self.kind!r}, size={self.size}, tensors={shapes})"


@dataclass(frozen=True)
class EntryInfo:
    """What a tier knows about an entry without reading its tensors (for ``ls`` and bundles)."""

    key: bytes
    kind: str
    size: int
    cost_s: float
    hits: int
    created: float
    last_hit: float
    parent: bytes | None
    expires: float | None
    namespace: str
    tier: str

    @property
    def hex(self) -> str:
        """The key as 64 hex characters."""
        return self.key.hex()

    def __repr__(self) -> str:
        return f"EntryInfo({self.hex[:16]}…, kind={self.kind!r}, size={self.size}, hits={self.hits}, tier={self.tier!r})"
