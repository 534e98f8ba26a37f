"""The one eviction policy: cost-aware GreedyDual-Size-Frequency, prefix-aware, with TTL.

priority = clock + hits * max(cost_s, COST_FLOOR_S) / size. The victim is the lowest-priority
*leaf* (an entry no other entry chains from), so a KV prefix block is never evicted while a
longer block built on it is kept; the clock then rises to the victim's priority, which ages
everything that has not been hit since. Expired entries go first, whatever their priority.

Two rules make every tier decide alike (tests/test_policy_differential.py):
- a cost floor, so hits count even for entries stored with cost 0 (``import_npz`` stores
  such), and every hit strictly raises an entry's priority;
- one victim order, :func:`victim_order`: lowest priority, then least recently hit, then
  key bytes.

Every tier decides with this module: each keeps its entries in its own structure (a heap,
an SQLite index, a Redis sorted set) behind :class:`EvictionIndex`, and this code picks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

__all__ = ["priority", "victim_order", "COST_FLOOR_S", "Removed", "EvictionIndex", "make_room"]

COST_FLOOR_S = 1e-6  # 1 µs: below any real recompute, above zero


def priority(clock: float, hits: int, cost_s: float, size: int) -> float:
    """GDSF priority: the clock plus the seconds of work saved per byte, times the hits."""
    return clock + hits * max(cost_s, COST_FLOOR_S) / max(size, 1)


def victim_order(prio: float, last_hit: float, key: bytes) -> tuple[float, float, bytes]:
    """The order leaves are evicted in: priority, then least recently hit, then key bytes."""
    return prio, last_hit, key


@dataclass(frozen=True)
class Removed:
    """An entry a tier dropped: evicted, expired, deleted or found corrupt."""

    key: bytes
    size: int
    reason: str  # "evicted" | "expired" | "deleted" | "corrupt"
    file: str | None = None


class EvictionIndex(Protocol):
    """What a tier exposes to the policy. Calls happen inside one tier-level transaction."""

    def used_bytes(self) -> int: ...

    def clock_value(self) -> float: ...

    def set_clock(self, value: float) -> None: ...

    def expired(self, now: float) -> list[bytes]: ...

    def lowest_leaf(self, exclude: bytes | None) -> tuple[bytes, float] | None: ...

    def remove_tree(self, key: bytes, reason: str) -> list[Removed]: ...


def make_room(
    index: EvictionIndex,
    budget: int,
    *,
    now: float,
    protect: bytes | None = None,
    on_remove: Callable[[Removed], None] | None = None,
) -> list[Removed]:
    """Drop expired entries, then evict lowest-priority leaves until ``budget`` holds.

    Args:
        index: the tier's entries.
        budget: bytes the tier may hold.
        now: the current time (for TTL).
        protect: a key never to evict (the entry being inserted: room is made *for* it).
        on_remove: called for each removed entry.

    Returns:
        Everything removed, expired entries (and what chained from them) included.
    """
    removed: list[Removed] = []
    for key in index.expired(now):
        removed.extend(index.remove_tree(key, "expired"))
    # Room is made for the protected entry first; if only its own chain is left to evict
    # (its ancestors are not leaves while it is stored), it goes itself: the budget holds.
    for exclude in (protect, None):
        while index.used_bytes() > budget:
            victim = index.lowest_leaf(exclude)
            if victim is None:
                break
            key, prio = victim
            index.set_clock(max(index.clock_value(), prio))
            removed.extend(index.remove_tree(key, "evicted"))
    if on_remove is not None:
        for r in removed:
            on_remove(r)
    return removed
