"""The tier interface: what the store needs from memory, disk and Redis alike."""

from __future__ import annotations

import dataclasses
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from .._entry import Entry, EntryInfo
from ..errors import PromptStoreWarning

__all__ = ["Tier", "Clock", "SizeOf"]

Clock = Callable[[], float]
SizeOf = Callable[[Entry], int]


class Tier(ABC):
    """One level of the store. Keys are 32 raw bytes, validated by the store.

    ``get`` counts a hit for the eviction policy; ``peek`` does not (bundles, verify).
    ``put`` takes an :class:`Entry` whose ``blob`` holds its encoded bytes and returns
    whether the tier kept it (an entry larger than the budget is refused, not stored
    by evicting everything). Faults raise; the store turns them into misses.
    """

    name: str = "tier"
    #: Whether entries outlive the process (disk, Redis). A persistent tier keeps only chains it
    #: can walk from the root in a later process, so the store copies missing ancestors into it.
    persistent: bool = True

    def __init__(self, budget: int, *, clock: Clock = time.time, sizeof: SizeOf | None = None) -> None:
        self.budget = int(budget)
        self.clock = clock
        self._sizeof = sizeof
        self.evictions = 0  # this process's, for stats()

    def sizeof(self, entry: Entry) -> int:
        """Bytes the entry counts against this tier's budget (injectable for tests)."""
        return self._sizeof(entry) if self._sizeof is not None else entry.size

    def fits(self, entry: Entry, size: int) -> bool:
        """Whether ``entry`` can fit at all; warns when it cannot (it is refused, nothing is evicted)."""
        if size <= self.budget:
            return True
        warnings.warn(
            f"{self.name} tier: entry {entry.hex[:16]}… ({size} bytes) exceeds the tier budget "
            f"({self.budget} bytes); not stored in this tier",
            PromptStoreWarning,
            stacklevel=4,
        )
        return False

    @abstractmethod
    def get(self, key: bytes, kind: str | None = None) -> Entry | None:
        """Return the entry and count a hit, or None (``kind`` names what a miss was for)."""

    def get_into(self, key: bytes, kind: str | None, namespace: str, into: Mapping[str, np.ndarray]) -> Entry | None:
        """``get``, with each tensor named in ``into`` written into that array when dtype and shape match.

        Such tensors come back as the given arrays; the others as usual. An entry of another
        namespace or kind is a miss and writes nothing. Tiers that read bytes override this
        to read them straight into the arrays (one copy); here, the entry is copied.
        """
        entry = self.get(key, kind)
        if entry is None or entry.namespace != namespace or (kind is not None and entry.kind != kind):
            return entry
        tensors = dict(entry.tensors)
        for name, dst in into.items():
            src = tensors.get(name)
            if src is not None and src.dtype == dst.dtype and src.shape == dst.shape:
                np.copyto(dst, src)
                tensors[name] = dst
        return dataclasses.replace(entry, tensors=tensors)

    @abstractmethod
    def peek(self, key: bytes) -> Entry | None:
        """Return the entry without counting a hit or refreshing its TTL."""

    @abstractmethod
    def put(self, entry: Entry) -> bool:
        """Store ``entry`` (replacing the same key), evicting as needed. False: refused."""

    @abstractmethod
    def delete(self, key: bytes) -> list[bytes]:
        """Remove ``key`` and every entry chained from it; return the keys that went."""

    @abstractmethod
    def contains(self, key: bytes) -> str | None:
        """The namespace ``key`` is stored under, if stored and not expired (no hit counted)."""

    @abstractmethod
    def infos(self, kind: str | None = None) -> Iterator[EntryInfo]:
        """Describe every stored entry (optionally of one kind) without reading tensors."""

    @abstractmethod
    def usage(self) -> dict[str, Any]:
        """``{"entries", "bytes", "budget", "evictions", ...}`` for stats()."""

    def verify(self, namespace: str | None = None) -> dict[str, Any]:
        """Check every entry of ``namespace`` (None: all, and the tier's own totals); drop what is broken."""
        return {"tier": self.name, "checked": 0, "problems": []}

    def gc(self, namespace: str | None = None) -> dict[str, Any]:
        """Drop expired entries of ``namespace``. None: of every namespace, and enforce the budget."""
        return {"tier": self.name}

    def close(self) -> None:
        """Release files and connections."""
