"""PromptStore: the tiers behind one get/put API."""

from __future__ import annotations

import itertools
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

from ._codec import build, prepare
from ._entry import Entry, EntryInfo
from ._keys import Key, coerce_key, make_key
from ._sizes import parse_size
from ._stats import Stats
from ._tiers import DiskTier, MemoryTier, Tier
from ._writer import OwnFuture, Writer
from .errors import ConfigError, InvalidEntryError, InvalidInputError, PromptStoreWarning, StorePathError

_LATER = itertools.count()  # names each later() job in the writer's queue

__all__ = ["PromptStore", "default_path"]


def default_path() -> Path:
    """``$PROMPTSTORE_DIR`` if set, else the platform's user cache folder for promptstore."""
    env = os.environ.get("PROMPTSTORE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("promptstore", appauthor=False))


def _close_tiers(tiers: list[Tier]) -> None:
    for tier in tiers:
        try:
            tier.close()
        except Exception:  # noqa: BLE001 - closing at exit must never raise
            pass


class PromptStore:
    """A content-addressed store of named tensors in tiers: memory, disk, (Redis).

    Reads go memory -> disk -> redis and promote a hit into the tiers above it; writes go
    through to every tier. A tier that fails (disk full, unreadable folder, Redis gone)
    turns into a miss with one :class:`~promptstore.errors.PromptStoreWarning`; the
    caller's work never fails because of the cache.

    Args:
        path: the disk tier's folder. ``None``: ``$PROMPTSTORE_DIR``, else the user cache
            folder (``platformdirs.user_cache_dir("promptstore")``).
        memory_bytes: budget of the in-process tier (int or ``"1GiB"``); 0 disables it.
        disk_bytes: budget of the disk tier; 0 disables it. ``None``: the budget last
            given for this folder, else 20 GiB. A given budget is recorded in the folder.
        redis_url: ``redis://[user:password@]host:port/db`` or ``rediss://`` (TLS) URL of a
            Redis shared by many hosts, or None. Unreachable at start or later: one warning,
            the local tiers keep serving, and Redis is used again once it answers.
        namespace: tenant salt. Keys made with :meth:`key` include it, and an entry
            written under one namespace is never returned under another.
        redis_bytes: budget of the Redis tier (every client evicts against its own).
        redis_prefix: prefix of every Redis key, so several stores can share one Redis.
        clock: wall-clock source for TTLs and timestamps (tests inject a fake one).
        durable: fsync each entry file and its folder before the index commits (survives
            power loss, not only process crashes), at a measured cost per put.

    Raises:
        StorePathError: ``path`` is a file or a foreign non-empty folder.
        FormatVersionError: ``path`` was written by a newer promptstore.
        InvalidSizeError: a budget could not be parsed.
        ConfigError: a bad namespace or option, or a malformed Redis URL.
        TierUnavailableError: Redis refused the credentials.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        memory_bytes: int | str = "1GiB",
        disk_bytes: int | str | None = None,
        redis_url: str | None = None,
        namespace: str = "",
        *,
        redis_bytes: int | str = "8GiB",
        redis_prefix: str = "promptstore:",
        clock: Any = time.time,
        durable: bool = False,
    ) -> None:
        if not isinstance(namespace, str):
            raise ConfigError(f"namespace must be a str, got {type(namespace).__name__}")
        self.namespace = namespace
        self._stats = Stats()
        self._warned: set[tuple[str, str]] = set()
        self._warn_lock = threading.Lock()
        self._tiers: list[Tier] = []
        mem = parse_size(memory_bytes)
        if mem:
            self._tiers.append(MemoryTier(mem, clock=clock))
        disk = None if disk_bytes is None else parse_size(disk_bytes)
        self.path: Path | None = None
        if disk != 0:
            self.path = Path(path).expanduser() if path is not None else default_path()
            try:
                self._tiers.append(DiskTier(self.path, disk, clock=clock, durable=durable))
            except (StorePathError, ConfigError):
                raise
            except OSError as exc:
                # An unwritable folder costs the disk tier, not the caller's program.
                if not isinstance(exc, (NotADirectoryError, FileExistsError)):
                    warnings.warn(f"disk tier disabled: cannot use {self.path} ({exc})", PromptStoreWarning,
                                  stacklevel=2)
                else:
                    raise StorePathError(f"store path {self.path} is not usable: {exc}") from exc
        if redis_url is not None:
            from ._tiers.redis import RedisTier

            if not isinstance(redis_prefix, str) or not redis_prefix:
                raise ConfigError("redis_prefix must be a non-empty str")
            self._tiers.append(RedisTier(redis_url, parse_size(redis_bytes), prefix=redis_prefix, clock=clock))
        self._writer = Writer()
        self._finalizer = weakref.finalize(self, _close_tiers, list(self._tiers))

    # -- plumbing ------------------------------------------------------------------------
    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The configured tiers, fastest first."""
        return tuple(self._tiers)

    def _guard(self, tier: Tier, op: str, fn: Any, *args: Any, default: Any = None) -> Any:
        try:
            result = fn(*args)
        except Exception as exc:  # noqa: BLE001 - a cache fault must never fail the caller
            self._fault(tier, op, exc)
            return default
        if self._warned:
            self._recovered(tier, op)
        return result

    def _fault(self, tier: Tier, op: str, exc: Exception) -> None:
        with self._warn_lock:
            first = (tier.name, op) not in self._warned
            self._warned.add((tier.name, op))
        if first:
            warnings.warn(
                f"{tier.name} tier failed during {op} ({type(exc).__name__}: {exc}); treated as a "
                "miss, further failures of this kind are silent until it works again",
                PromptStoreWarning,
                stacklevel=4,
            )

    def _recovered(self, tier: Tier, op: str) -> None:
        with self._warn_lock:
            self._warned.discard((tier.name, op))

    # -- keys ----------------------------------------------------------------------------
    def key(self, kind: str, payload: bytes | str = b"", *, fingerprints: Iterable[bytes | str] = ()) -> Key:
        """Make the key of an entry in this store's namespace (see :func:`promptstore.make_key`)."""
        return make_key(kind, payload, namespace=self.namespace, fingerprints=fingerprints)

    # -- the API -------------------------------------------------------------------------
    def put(
        self,
        key: Key | str,
        tensors: Mapping[str, Any],
        *,
        kind: str,
        cost_s: float = 0.0,
        meta: Mapping[str, str] | None = None,
        parent: Key | str | None = None,
        ttl_s: float | None = None,
        background: bool = False,
    ) -> bool:
        """Store named tensors under ``key`` in every tier (replacing what was there).

        Args:
            key: 32 bytes or 64 hex characters, usually from :meth:`key`.
            tensors: name -> numpy array. Arrays of a dtype numpy lacks may be given as raw
                bits with their safetensors dtype name: ``(uint16_array, "BF16")``.
            kind: what the entry is, e.g. ``"vision.text"``, ``"llm.kv"``.
            cost_s: seconds it took to compute (the eviction policy keeps costly bytes).
            meta: str -> str annotations stored with the entry.
            parent: the key this entry chains from (KV blocks); the parent is never evicted
                while this entry is kept, and deleting it deletes this entry too. Store the
                parent first: a persistent tier only takes entries whose chain it can walk
                from the root, copying ancestors it lacks from the other tiers.
            ttl_s: drop the entry this many seconds after its last hit.
            background: validate now, write after returning (on the store's writer thread, in
                the order puts were made). Reads in this process wait for a queued key, a normal
                exit and :meth:`close` complete every queued write (:meth:`flush` waits for them);
                a killed process loses what was still queued. The arrays must not change after
                the call.

        Returns:
            True if at least one tier kept the entry (``background``: True once queued).

        Raises:
            InvalidKeyError: bad key or parent.
            InvalidEntryError: bad tensors, kind, meta, cost or TTL (UnsupportedDtypeError
                for object, string or complex arrays). Nothing is stored then.
        """
        prepared = prepare(key, tensors, kind=kind, cost_s=cost_s, meta=meta, parent=parent, ttl_s=ttl_s,
                           namespace=self.namespace)
        nbytes = sum(arr.nbytes for _, _, arr in prepared["tensors"])
        if background and self._writer.submit(prepared["key"], lambda: self._write_queued(prepared), nbytes) is not None:
            return True
        if self._writer:
            # A queued value of this key must not land after this one, nor its parent after it.
            self._writer.wait(prepared["key"])
            if prepared["parent"] is not None:
                self._writer.wait(prepared["parent"])
        return self._put_entry(build(prepared))

    def _write_queued(self, prepared: dict[str, Any]) -> None:
        try:
            self._put_entry(build(prepared))
        except Exception as exc:  # noqa: BLE001 - a cache fault must never fail the caller, nor the writer
            try:
                warnings.warn(f"a background put failed ({type(exc).__name__}: {exc}); the entry is a miss",
                              PromptStoreWarning, stacklevel=1)
            except Exception:  # noqa: BLE001 - warnings turned into errors must not reach a later read
                pass

    def later(self, job: Callable[[], Any], *, nbytes: int = 0) -> Future[None]:
        """Run ``job`` on the store's writer thread, after every background put made so far.

        For work that only feeds the store (copying what a request computed into entries) and
        need not delay the caller: ``job`` may read the store and put into it (its puts are
        written within it, in order). :meth:`flush` and :meth:`close` wait for it, as does a
        normal interpreter exit; a killed process loses it, as it loses queued puts. What ``job``
        reads must not change until it has run. A job that raises stores what it had stored
        and is reported as a :class:`~promptstore.errors.PromptStoreWarning`: it never fails the
        caller. Where nothing can be queued (interpreter shutdown, or called from a job) it runs
        now. A process forked after queuing it does not run it, and its wait on the future
        returns at once.

        Args:
            job: a callable of no arguments; its return value is ignored.
            nbytes: about how many bytes ``job`` holds until it runs (counted against the
                writer's queue bound, as a background put's tensors are).

        Returns:
            A future that is done once ``job`` has run (or could not run: a miss). In a process
            forked after the call, its ``result()`` returns at once and ``done()`` stays False.
        """
        if not callable(job):
            raise InvalidInputError(f"later() takes a callable, got {type(job).__name__}")

        future = OwnFuture()
        claim = threading.Lock()  # never released: the job runs once at most

        def run() -> None:
            if not claim.acquire(blocking=False):
                return
            try:
                job()
            except Exception as exc:  # noqa: BLE001 - a cache fault must never fail the caller, nor the writer
                try:
                    warnings.warn(f"a deferred store job failed ({type(exc).__name__}: {exc}); what it had not "
                                  "stored is a miss", PromptStoreWarning, stacklevel=1)
                except Exception:  # noqa: BLE001 - warnings turned into errors must not reach a later read
                    pass
            finally:
                future.finish()

        queued = self._writer.submit(b"later:%d" % next(_LATER), run, nbytes)
        if queued is None:
            run()
        else:  # an executor that breaks fails its queued jobs without running them: waiters must not wait forever
            queued.add_done_callback(lambda _: future.finish())
        return future

    def flush(self) -> None:
        """Wait until every put made with ``background=True`` (and every :meth:`later` job) so far is written."""
        self._writer.flush()

    def _put_entry(self, entry: Entry, tiers: Iterable[Tier] | None = None) -> bool:
        stored = False
        for tier in self._tiers if tiers is None else tiers:
            ready = entry.parent is None or self._chain_ready(tier, entry.parent)
            if ready and self._guard(tier, "put", tier.put, entry, default=False):
                stored = True
            else:
                # A tier that does not take the new value must not keep serving the old one.
                self._guard(tier, "delete", tier.delete, entry.key)
        return stored

    def _chain_ready(self, tier: Tier, parent: bytes) -> bool:
        """Whether ``tier`` holds (or, if persistent, now holds) the chain above an entry.

        Every tier keeps whole chains only, so what it holds is reachable by walking from
        the root, and deleting a root takes everything below it. The memory tier just
        skips an entry whose parent it lacks; a persistent tier copies the ancestors.
        """
        if not tier.persistent:
            return bool(self._guard(tier, "contains", tier.contains, parent) == self.namespace)
        return self._complete_chain(tier, parent)

    def _complete_chain(self, tier: Tier, parent: bytes) -> bool:
        """Copy into ``tier`` the ancestors it lacks (e.g. evicted there, still in memory).

        A persistent tier never takes a chained entry it could not reach by walking its
        chain from the root, in this process or the next: if an ancestor is gone from every
        tier, the chain is broken and the entry is kept in memory only (returns False).
        """
        missing: list[Entry] = []
        key: bytes | None = parent
        while key is not None and (held := self._guard(tier, "contains", tier.contains, key)) is None:
            ancestor = next((e for t in self._tiers if t is not tier
                             for e in [self._guard(t, "peek", t.peek, key)] if e is not None), None)
            if ancestor is None or ancestor.namespace != self.namespace:
                return False
            missing.append(ancestor)
            key = ancestor.parent
        if key is not None and held != self.namespace:
            return False  # a chain never crosses tenants: another namespace's entry is no parent
        return all(self._guard(tier, "put", tier.put, a, default=False) for a in reversed(missing))

    def get(self, key: Key | str, *, kind: str | None = None,
            into: Mapping[str, np.ndarray] | None = None) -> Entry | None:
        """Return the entry stored under ``key``, or None.

        Args:
            key: 32 bytes or 64 hex characters.
            kind: if given, an entry of another kind is a miss, and misses are counted
                under this kind in :meth:`stats`.
            into: writable arrays to read tensors straight into, by name (any strides). A
                stored tensor of the same dtype (numpy's view of its bits) and shape is
                written there, read from the file without an intermediate copy and checked
                against the entry's checksum, and comes back as that array; others come
                back as usual. Such a hit is not promoted to the tiers above. On a miss the
                arrays may hold partial data.

        Raises:
            InvalidKeyError: ``key`` is not a key.
        """
        k = key if type(key) is bytes and len(key) == 32 else coerce_key(key)
        if self._writer:
            self._writer.wait(k)
        missed: list[str] = []
        for i, tier in enumerate(self._tiers):
            # Inlined _guard: this is the hot path of every memory hit.
            try:
                entry = tier.get(k, kind) if into is None else tier.get_into(k, kind, self.namespace, into)
            except Exception as exc:  # noqa: BLE001 - a cache fault must never fail the caller
                self._fault(tier, "get", exc)
                entry = None
            else:
                if self._warned:
                    self._recovered(tier, "get")
            if entry is None or entry.namespace != self.namespace or (kind is not None and entry.kind != kind):
                missed.append(tier.name)
                continue
            # Misses in the tiers above are counted once the kind is known.
            for name in missed:
                self._stats.miss(entry.kind, name)
            self._stats.hit(entry.kind, tier.name, entry.size, entry.cost_s)
            for upper in self._tiers[:i] if into is None else ():
                # Promote quietly: an entry too big for a tier above just stays where it is.
                if upper.sizeof(entry) <= upper.budget and (
                        entry.parent is None or self._guard(upper, "contains", upper.contains, entry.parent) is not None):
                    self._guard(upper, "put", upper.put, entry)
            return entry
        label = kind or "unknown"
        for name in missed:
            self._stats.miss(label, name)
        self._stats.store_miss(label)
        return None

    def __contains__(self, key: object) -> bool:
        k = coerce_key(key)
        if self._writer:
            self._writer.wait(k)
        return any(self._guard(t, "contains", t.contains, k) == self.namespace for t in self._tiers)

    def delete(self, key: Key | str) -> bool:
        """Remove ``key`` from every tier, with every entry chained from it. True if anything went.

        Only an entry of this store's namespace is removed: a key of another tenant, even one
        seen in a folder-wide listing, is left alone (False).
        """
        # A tier only knows the chain links of what it holds (a child may have been promoted
        # into memory without its parent), so what any tier removes is removed from all.
        # Chains never cross namespaces (see _chain_ready), so neither does the cascade.
        self._writer.flush()  # a queued child of this key must be written before the cascade
        todo, gone = [coerce_key(key)], set()
        while todo:
            k = todo.pop()
            for tier in self._tiers:
                if self._guard(tier, "contains", tier.contains, k) != self.namespace:
                    continue
                for removed in self._guard(tier, "delete", tier.delete, k, default=[]):
                    if removed not in gone:
                        gone.add(removed)
                        todo.append(removed)
        return bool(gone)

    def ls(self, kind: str | None = None, *, all_namespaces: bool = False) -> list[EntryInfo]:
        """Describe this namespace's entries in any tier (newest hit first), without reading tensors.

        Args:
            kind: only entries of this kind.
            all_namespaces: the administrator's view: every tenant's entries in these tiers.
        """
        self._writer.flush()
        seen: dict[bytes, EntryInfo] = {}
        for tier in self._tiers:
            for info in self._guard(tier, "ls", lambda t=tier: list(t.infos(kind)), default=[]):
                if not all_namespaces and info.namespace != self.namespace:
                    continue
                prev = seen.get(info.key)
                if prev is None:
                    seen[info.key] = info
                else:
                    seen[info.key] = EntryInfo(**{**prev.__dict__, "tier": f"{prev.tier}+{info.tier}",
                                                  "hits": max(prev.hits, info.hits)})
        return sorted(seen.values(), key=lambda i: i.last_hit, reverse=True)

    def peek(self, key: Key | str) -> Entry | None:
        """The entry stored under ``key`` in this namespace, without counting a hit or promoting it.

        Raises:
            InvalidKeyError: ``key`` is not a key.
        """
        entry = self._peek(coerce_key(key))
        return entry if entry is not None and entry.namespace == self.namespace else None

    def put_entry(self, entry: Entry, *, persistent_only: bool = False) -> bool:
        """Store an already-encoded :class:`Entry` (one read from a bundle or another store).

        Args:
            entry: it must belong to this store's namespace; its ``hits`` carry over.
            persistent_only: store it in the disk and Redis tiers only (imports do: nothing is
                read yet, so it need not take memory).

        Returns:
            True if at least one tier kept it.

        Raises:
            InvalidEntryError: the entry belongs to another namespace or has no encoded bytes.
        """
        if entry.namespace != self.namespace:
            raise InvalidEntryError(f"an entry of namespace {entry.namespace!r} cannot go into namespace "
                                    f"{self.namespace!r}")
        if entry.blob is None:
            raise InvalidEntryError("the entry has no encoded bytes (entries come from get, peek or a bundle)")
        tiers = [t for t in self._tiers if t.persistent] if persistent_only else None
        if self._writer:
            self._writer.wait(entry.key)
        return self._put_entry(entry, tiers or None)

    def _peek(self, key: bytes) -> Entry | None:
        if self._writer:
            self._writer.wait(key)
        for tier in self._tiers:
            entry: Entry | None = self._guard(tier, "peek", tier.peek, key)
            if entry is not None:
                return entry
        return None

    def stats(self, *, all_namespaces: bool = False) -> dict[str, Any]:
        """Counters of this process, and each tier's usage by this namespace.

        A tier's ``entries`` and ``bytes`` count this namespace's entries; its ``budget`` is
        shared by all. ``all_namespaces=True`` (the administrator's view) reports the tiers'
        totals and lifetime counters instead, which include every tenant's.

        Returns:
            ``{"namespace", "hits", "misses", "hit_bytes", "seconds_saved", "evictions",
            "kinds": {kind: {"hits", "misses", "hit_bytes", "seconds_saved",
            "tiers": {tier: {"hits", "misses"}}}}, "tiers": {tier: {"entries", "bytes",
            "budget", "evictions", ...}}}``. ``seconds_saved`` sums the recorded cost of
            every hit. The disk tier adds ``lifetime`` counters kept in its folder.
        """
        self._writer.flush()
        snap = self._stats.snapshot()
        tiers = {t.name: self._guard(t, "stats", t.usage, default={"error": "unavailable"}) for t in self._tiers}
        if not all_namespaces:
            for tier in self._tiers:
                usage = tiers[tier.name]
                usage.pop("lifetime", None)  # counts every tenant's hits
                if "entries" in usage:
                    mine = [i for i in self._guard(tier, "ls", lambda t=tier: list(t.infos()), default=[])
                            if i.namespace == self.namespace]
                    usage["entries"], usage["bytes"] = len(mine), sum(i.size for i in mine)
        return {"namespace": self.namespace, **snap,
                "evictions": sum(t.get("evictions", 0) for t in tiers.values()), "tiers": tiers}

    def verify(self, *, all_namespaces: bool = False) -> dict[str, Any]:
        """Read and checksum this namespace's entries in every tier; drop broken ones.

        ``all_namespaces=True`` (the administrator's view) checks every tenant's entries and
        fixes the tiers' shared counters too.

        Entries written by another entry format version (a newer or older promptstore sharing
        the folder) are counted in ``other_versions``, never treated as problems or dropped.

        Returns:
            ``{"ok": bool, "checked": int, "other_versions": {"newer", "older"}, "problems": [str],
            "tiers": [per-tier reports]}``. ``checked`` counts entries, each once however many
            tiers hold it (each tier's report has its own count); ``ok`` is True when nothing was wrong.
        """
        self._writer.flush()
        ns = None if all_namespaces else self.namespace
        entries = {i.key for i in self.ls(all_namespaces=all_namespaces)}
        reports = [self._guard(t, "verify", t.verify, ns, default={"tier": t.name, "checked": 0,
                                                                    "problems": ["tier unavailable"]})
                   for t in self._tiers]
        problems = [f"{r['tier']}: {p}" for r in reports for p in r["problems"]]
        other = {w: max((r.get("other_versions", {}).get(w, 0) for r in reports), default=0) for w in ("newer", "older")}
        return {"ok": not problems, "checked": len(entries), "other_versions": other, "problems": problems,
                "tiers": reports}

    def gc(self, *, all_namespaces: bool = False) -> dict[str, Any]:
        """Drop this namespace's expired entries and leftovers of interrupted writes.

        ``all_namespaces=True`` (the administrator's view) drops every tenant's expired
        entries and enforces the budgets, which are shared.

        Returns:
            ``{"tiers": [per-tier reports]}`` with what each tier removed.
        """
        self._writer.flush()
        ns = None if all_namespaces else self.namespace
        return {"tiers": [self._guard(t, "gc", t.gc, ns, default={"tier": t.name}) for t in self._tiers]}

    def export_bundle(
        self, path: str | os.PathLike[str], keys: Iterable[Key | str] | None = None, kind: str | None = None
    ) -> int:
        """Write entries into one bundle file (a zip of entry files plus a manifest).

        Args:
            path: the bundle file to write (replaced atomically).
            keys: which entries; None: all. Ancestors of chained entries come along.
            kind: only entries of this kind.

        Returns:
            How many entries were written.

        Raises:
            InvalidInputError: ``path`` names no file (empty, a folder, ``..``).
            InvalidKeyError: a key that is not a key.
        """
        from ._bundle import export_bundle

        self._writer.flush()

        return export_bundle(self, path, keys=keys, kind=kind)

    def import_bundle(self, path: str | os.PathLike[str]) -> int:
        """Verify a bundle completely, then store its entries. A bad bundle changes nothing.

        Returns:
            How many entries were imported.

        Raises:
            BundleError: malformed, truncated or failing a checksum (nothing imported).
            FormatVersionError: written by a newer promptstore.
        """
        from ._bundle import import_bundle

        return import_bundle(self, path)

    def close(self) -> None:
        """Complete queued writes, flush counters and close files and connections. The store is unusable after."""
        self._writer.close()
        self._finalizer()

    def __enter__(self) -> PromptStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        tiers = ", ".join(f"{t.name}={t.budget}" for t in self._tiers)
        return f"PromptStore(path={str(self.path)!r}, namespace={self.namespace!r}, {tiers})"


