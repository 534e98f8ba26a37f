"""Per-process request counters: hits and misses per kind and tier, bytes and seconds saved."""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["Stats"]


class Stats:
    """Thread-safe counters. A tier miss that a lower tier then serves is a miss of that tier."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (kind, tier) -> [hits, misses, hit_bytes, seconds_saved]
        self._cells: dict[tuple[str, str], list[float]] = {}
        self._store_misses: dict[str, int] = {}

    def _cell(self, kind: str, tier: str) -> list[float]:
        cell = self._cells.get((kind, tier))
        if cell is None:
            cell = self._cells[(kind, tier)] = [0, 0, 0, 0.0]
        return cell

    def hit(self, kind: str, tier: str, nbytes: int, cost_s: float) -> None:
        with self._lock:
            cell = self._cells.get((kind, tier)) or self._cell(kind, tier)
            cell[0] += 1
            cell[2] += nbytes
            cell[3] += cost_s

    def miss(self, kind: str, tier: str) -> None:
        with self._lock:
            self._cell(kind, tier)[1] += 1

    def store_miss(self, kind: str) -> None:
        with self._lock:
            self._store_misses[kind] = self._store_misses.get(kind, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        """``{"kinds": {kind: {...}}, "hits", "misses", "hit_bytes", "seconds_saved"}``."""
        with self._lock:
            kinds: dict[str, dict[str, Any]] = {}
            for (kind, tier), (hits, misses, nbytes, saved) in sorted(self._cells.items()):
                k = kinds.setdefault(kind, {"hits": 0, "misses": 0, "hit_bytes": 0, "seconds_saved": 0.0, "tiers": {}})
                k["tiers"][tier] = {"hits": int(hits), "misses": int(misses)}
                k["hits"] += int(hits)
                k["hit_bytes"] += int(nbytes)
                k["seconds_saved"] += saved
            for kind, n in self._store_misses.items():
                kinds.setdefault(kind, {"hits": 0, "misses": 0, "hit_bytes": 0, "seconds_saved": 0.0, "tiers": {}})
                kinds[kind]["misses"] = n
            return {
                "kinds": kinds,
                "hits": sum(k["hits"] for k in kinds.values()),
                "misses": sum(k["misses"] for k in kinds.values()),
                "hit_bytes": sum(k["hit_bytes"] for k in kinds.values()),
                "seconds_saved": sum(k["seconds_saved"] for k in kinds.values()),
            }
