"""The memory tier: decoded entries in this process, bounded in bytes."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

from .. import _policy
from .._entry import Entry, EntryInfo
from .base import Clock, SizeOf, Tier

__all__ = ["MemoryTier"]


class _Rec:
    __slots__ = ("entry", "size", "hits", "prio", "seq", "expires", "created", "last_hit")

    def __init__(self, entry: Entry, size: int, now: float, seq: int) -> None:
        self.entry = entry
        self.size = size
        self.hits = max(1, entry.hits)  # hits carried in (a promotion, a bundle) count here too
        self.prio = 0.0
        self.seq = seq
        self.created = now
        self.last_hit = now
        self.expires = None if entry.ttl_s is None else now + entry.ttl_s


class MemoryTier(Tier):
    """A byte-bounded map of decoded entries, evicted by the shared GDSF policy.

    Leaves sit in a lazy heap. A hit only raises the entry's priority (it never falls: the
    clock only rises), so a heap item is a lower bound; when the minimum is popped and its
    priority is stale it is pushed back with the current one. A hit is then O(1).
    """

    name = "memory"
    persistent = False

    def __init__(self, budget: int, *, clock: Clock = time.time, sizeof: SizeOf | None = None) -> None:
        super().__init__(budget, clock=clock, sizeof=sizeof)
        self._lock = threading.Lock()
        self._recs: dict[bytes, _Rec] = {}
        # parent -> children present here, whether or not the parent itself is present.
        self._kids: dict[bytes, set[bytes]] = {}
        # (priority, last hit, key, seq): _policy.victim_order, then a validity token.
        self._heap: list[tuple[float, float, bytes, int]] = []
        self._expiry: list[tuple[float, int, bytes]] = []
        self._seq = itertools.count()
        self._used = 0
        self._clock_value = 0.0

    # -- EvictionIndex -------------------------------------------------------------------
    def used_bytes(self) -> int:
        return self._used

    def clock_value(self) -> float:
        return self._clock_value

    def set_clock(self, value: float) -> None:
        self._clock_value = value

    def expired(self, now: float) -> list[bytes]:
        out: dict[bytes, None] = {}
        while self._expiry and self._expiry[0][0] <= now:
            _, _, key = heapq.heappop(self._expiry)
            rec = self._recs.get(key)
            # A hit pushes a fresh item with the new expiry, so an item whose entry has
            # since been refreshed is simply dropped.
            if rec is not None and rec.expires is not None and rec.expires <= now:
                out[key] = None
        return list(out)

    def lowest_leaf(self, exclude: bytes | None) -> tuple[bytes, float] | None:
        skipped = None
        while self._heap:
            item = heapq.heappop(self._heap)
            prio, last_hit, key, seq = item
            rec = self._recs.get(key)
            if rec is None or rec.seq != seq or self._kids.get(key):
                continue  # stale: removed, replaced, or no longer a leaf (pushed again if it becomes one)
            if (rec.prio, rec.last_hit) != (prio, last_hit):  # hit since: both only rise
                heapq.heappush(self._heap, (*_policy.victim_order(rec.prio, rec.last_hit, key), seq))
                continue
            if key == exclude:
                skipped = item
                continue
            heapq.heappush(self._heap, item)
            if skipped:
                heapq.heappush(self._heap, skipped)
            return key, prio
        if skipped:
            heapq.heappush(self._heap, skipped)
        return None

    def remove_tree(self, key: bytes, reason: str) -> list[_policy.Removed]:
        removed = []
        stack = [key]
        while stack:
            k = stack.pop()
            stack.extend(self._kids.get(k, ()))
            rec = self._recs.pop(k, None)
            if rec is None:
                continue
            self._used -= rec.size
            removed.append(_policy.Removed(k, rec.size, reason))
            parent = rec.entry.parent
            if parent is not None:
                kids = self._kids.get(parent)
                if kids is not None:
                    kids.discard(k)
                    if not kids:
                        del self._kids[parent]
                        self._push(parent)
        return removed

    # -- helpers ---------------------------------------------------------------------------
    def _push(self, key: bytes) -> None:
        rec = self._recs.get(key)
        if rec is None or self._kids.get(key):
            return
        rec.seq = next(self._seq)
        heapq.heappush(self._heap, (*_policy.victim_order(rec.prio, rec.last_hit, key), rec.seq))
        if len(self._heap) > 2 * len(self._recs) + 1024:
            self._heap = [(*_policy.victim_order(r.prio, r.last_hit, k), r.seq) for k, r in self._recs.items()
                          if not self._kids.get(k)]
            heapq.heapify(self._heap)

    def _touch(self, rec: _Rec, key: bytes, now: float) -> None:
        rec.hits += 1
        rec.last_hit = now
        rec.prio = _policy.priority(self._clock_value, rec.hits, rec.entry.cost_s, rec.size)
        if rec.entry.ttl_s is not None:
            rec.expires = now + rec.entry.ttl_s
            heapq.heappush(self._expiry, (rec.expires, rec.seq, key))
            if len(self._expiry) > 2 * len(self._recs) + 1024:
                self._expiry = [(r.expires, r.seq, k) for k, r in self._recs.items() if r.expires is not None]
                heapq.heapify(self._expiry)

    def _live(self, key: bytes, now: float) -> _Rec | None:
        rec = self._recs.get(key)
        if rec is not None and rec.expires is not None and rec.expires <= now:
            self.remove_tree(key, "expired")
            return None
        return rec

    # -- Tier --------------------------------------------------------------------------------
    def get(self, key: bytes, kind: str | None = None) -> Entry | None:
        with self._lock:
            rec = self._recs.get(key)
            if rec is None:
                return None
            now = self.clock()
            if rec.expires is not None and rec.expires <= now:
                self.remove_tree(key, "expired")
                return None
            self._touch(rec, key, now)
            entry = rec.entry
            entry.hits, entry.last_hit = rec.hits, now
            return entry

    def peek(self, key: bytes) -> Entry | None:
        with self._lock:
            rec = self._live(key, self.clock())
            return None if rec is None else rec.entry

    def put(self, entry: Entry) -> bool:
        size = self.sizeof(entry)
        if not self.fits(entry, size):
            return False
        with self._lock:
            if entry.parent is not None and entry.parent not in self._recs:
                return False  # its chain is not here: it could not be reached (checked under the lock)
            now = self.clock()
            key = entry.key
            old = self._recs.pop(key, None)
            if old is not None:
                self._used -= old.size
                if old.entry.parent is not None and old.entry.parent != entry.parent:
                    kids = self._kids.get(old.entry.parent)
                    if kids is not None:
                        kids.discard(key)
                        if not kids:
                            del self._kids[old.entry.parent]
                            self._push(old.entry.parent)
            rec = _Rec(entry, size, now, next(self._seq))
            entry.created = entry.last_hit = now
            rec.prio = _policy.priority(self._clock_value, rec.hits, entry.cost_s, size)
            self._recs[key] = rec
            self._used += size
            if entry.parent is not None:
                self._kids.setdefault(entry.parent, set()).add(key)
            if rec.expires is not None:
                heapq.heappush(self._expiry, (rec.expires, rec.seq, key))
            self._push(key)
            removed = _policy.make_room(self, self.budget, now=now, protect=key)
            self.evictions += sum(r.reason == "evicted" for r in removed)
            return key in self._recs

    def delete(self, key: bytes) -> list[bytes]:
        with self._lock:
            return [r.key for r in self.remove_tree(key, "deleted")]

    def contains(self, key: bytes) -> str | None:
        with self._lock:
            rec = self._live(key, self.clock())
            return None if rec is None else rec.entry.namespace

    def infos(self, kind: str | None = None) -> Iterator[EntryInfo]:
        with self._lock:
            recs = list(self._recs.items())
        for key, rec in recs:
            e = rec.entry
            if kind is None or e.kind == kind:
                yield EntryInfo(key, e.kind, rec.size, e.cost_s, rec.hits, rec.created, rec.last_hit,
                                e.parent, rec.expires, e.namespace, self.name)

    def usage(self) -> dict[str, Any]:
        with self._lock:
            return {"entries": len(self._recs), "bytes": self._used, "budget": self.budget,
                    "evictions": self.evictions}

    def gc(self, namespace: str | None = None) -> dict[str, Any]:
        with self._lock:
            now = self.clock()
            if namespace is None:
                removed = _policy.make_room(self, self.budget, now=now)
            else:
                removed = [r for key, rec in list(self._recs.items())
                           if rec.entry.namespace == namespace and rec.expires is not None and rec.expires <= now
                           for r in self.remove_tree(key, "expired")]
            return {"tier": self.name, "expired": sum(r.reason == "expired" for r in removed),
                    "evicted": sum(r.reason == "evicted" for r in removed)}

    def verify(self, namespace: str | None = None) -> dict[str, Any]:
        with self._lock:
            problems = []
            if namespace is None:
                used = sum(r.size for r in self._recs.values())
                if used != self._used:
                    problems.append(f"byte count {self._used} != {used}")
                    self._used = used
            checked = sum(namespace is None or r.entry.namespace == namespace for r in self._recs.values())
            return {"tier": self.name, "checked": checked, "problems": problems}

    def clear(self) -> None:
        """Drop everything (tests and benchmarks use it to force the next tier)."""
        with self._lock:
            self._recs.clear()
            self._kids.clear()
            self._heap.clear()
            self._expiry.clear()
            self._used = 0
