"""The disk tier: a folder of entry files plus an SQLite (WAL) index, shared by processes.

Layout::

    <root>/promptstore.json     {"format": "promptstore", "layout": 1}
    <root>/CACHEDIR.TAG         so backup tools skip the folder
    <root>/index.sqlite         size, cost, hits, times, parent links, GDSF priorities
    <root>/entries/ab/<key hex>.<pid>-<nonce>.safetensors

Protocol (after diskcache): an entry file is written under a temporary name in its final
folder and renamed into place, then its index row commits; the entry is visible only once
the row exists. Each write gets a fresh file name, so a reader holding a row never sees
another write's bytes, and a replaced or evicted file is unlinked only after the commit
that dropped its row. A reader whose file vanished under it (evicted meanwhile) misses.
The writer's pid in the name lets ``gc`` remove leftovers of killed writers at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
import secrets
import sqlite3
import threading
import time
import warnings
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from tqdm import tqdm

from .. import _policy
from .._codec import MAX_HEADER_BYTES, check_digest, decode, make_entry, parse_header
from .._entry import Entry, EntryInfo
from ..errors import CorruptEntryError, EntryVersionError, FormatVersionError, PromptStoreWarning, StorePathError
from .base import Clock, SizeOf, Tier

__all__ = ["DiskTier", "LAYOUT_VERSION", "DEFAULT_DISK_BYTES"]

LAYOUT_VERSION = 1
SCHEMA_VERSION = 1
DEFAULT_DISK_BYTES = 20 * 1024**3
VERSION_FILE = "promptstore.json"
INDEX_FILE = "index.sqlite"
ENTRIES_DIR = "entries"
SUFFIX = ".safetensors"
PARTIAL = ".partial"
# A leftover of a writer that is still alive may be a write in flight; only this old is it garbage.
STALE_AFTER_S = 600.0
# Entries at least this big are read by mapping their file: the page cache's pages are the
# tensors' bytes, with no fresh buffer to zero and copy into (a 92 MB read: 35-45 ms to 4 ms).
# Entry files are written aside and renamed, never rewritten in place, so a mapping always
# sees the bytes its checksum was verified over, even after the entry is evicted or replaced.
MAP_MIN_BYTES = 1 << 20
CACHEDIR_TAG = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This file is a cache directory tag created by promptstore.\n"
    "# For information about cache directory tags see https://bford.info/cachedir/\n"
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    key BLOB PRIMARY KEY NOT NULL,
    file TEXT NOT NULL,
    kind TEXT NOT NULL,
    namespace TEXT NOT NULL,
    parent BLOB,
    size INTEGER NOT NULL,
    cost REAL NOT NULL,
    hits INTEGER NOT NULL,
    created REAL NOT NULL,
    last_hit REAL NOT NULL,
    ttl REAL,
    expires REAL,
    priority REAL NOT NULL,
    children INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS entries_leaves ON entries(priority) WHERE children = 0;
CREATE INDEX IF NOT EXISTS entries_parent ON entries(parent) WHERE parent IS NOT NULL;
CREATE INDEX IF NOT EXISTS entries_expiry ON entries(expires) WHERE expires IS NOT NULL;
CREATE TABLE IF NOT EXISTS settings (name TEXT PRIMARY KEY NOT NULL, value) WITHOUT ROWID;
INSERT OR IGNORE INTO settings VALUES ('used', 0), ('count', 0), ('clock', 0.0),
    ('evictions', 0), ('expirations', 0);
CREATE TABLE IF NOT EXISTS counters (
    kind TEXT PRIMARY KEY NOT NULL,
    hits INTEGER NOT NULL DEFAULT 0,
    misses INTEGER NOT NULL DEFAULT 0,
    hit_bytes INTEGER NOT NULL DEFAULT 0,
    saved_s REAL NOT NULL DEFAULT 0
) WITHOUT ROWID;
-- Triggers keep the byte count and the children counts exact however rows come and go.
CREATE TRIGGER IF NOT EXISTS entries_insert AFTER INSERT ON entries BEGIN
    UPDATE settings SET value = value + NEW.size WHERE name = 'used';
    UPDATE settings SET value = value + 1 WHERE name = 'count';
    UPDATE entries SET children = children + 1 WHERE key = NEW.parent;
    UPDATE entries SET children = (SELECT count(*) FROM entries WHERE parent = NEW.key)
        WHERE key = NEW.key;
END;
CREATE TRIGGER IF NOT EXISTS entries_delete AFTER DELETE ON entries BEGIN
    UPDATE settings SET value = value - OLD.size WHERE name = 'used';
    UPDATE settings SET value = value - 1 WHERE name = 'count';
    UPDATE entries SET children = children - 1 WHERE key = OLD.parent;
END;
"""

_TREE = """
WITH RECURSIVE tree(k) AS (
    SELECT key FROM entries WHERE key = ?
    UNION
    SELECT e.key FROM entries e JOIN tree ON e.parent = tree.k
)
SELECT e.key, e.size, e.file FROM entries e JOIN tree ON e.key = tree.k
"""

_HIT = """
UPDATE entries SET hits = hits + :n, last_hit = :now,
    expires = CASE WHEN ttl IS NULL THEN NULL ELSE :now + ttl END,
    priority = gdsf((SELECT value FROM settings WHERE name = 'clock'), hits + :n, cost, size)
WHERE key = :key
"""
# Hits are written to the index in batches: one write transaction per get would cost more
# than reading a small entry. A batch goes out with the next write, or by a thread of its own
# when it is this big or this old (a read never writes: the first read after a pause would pay
# a transaction, or wait out another process's write lock); until then this process applies
# its own pending TTL refreshes.
FLUSH_HITS = 256
FLUSH_AFTER_S = 1.0
BUSY_TIMEOUT_MS = 60000  # how long a write waits for another connection's write lock
BUSY_RETRY_S = 1.0  # a background flush that found the index locked tries again this much later

_COUNT = """
INSERT INTO counters (kind, hits, misses, hit_bytes, saved_s) VALUES (?, ?, ?, ?, ?)
ON CONFLICT (kind) DO UPDATE SET hits = hits + excluded.hits, misses = misses + excluded.misses,
    hit_bytes = hit_bytes + excluded.hit_bytes, saved_s = saved_s + excluded.saved_s
"""


class _Orphan(Exception):
    """Raised inside a put's transaction to roll it back: the entry's parent is gone."""


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _writer_pid(name: str) -> int | None:
    # "<hex>.<pid>-<nonce>.safetensors" or ".<that>.partial"
    parts = name.lstrip(".").split(".")
    try:
        return int(parts[1].split("-")[0])
    except (IndexError, ValueError):
        return None


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def check_folder(root: Path) -> None:
    """Create ``root`` as a store folder, or check that it is one we can use.

    Raises:
        StorePathError: ``root`` is a file, or a non-empty folder that is not a store.
        FormatVersionError: the folder was made by a newer promptstore.
    """
    if root.exists() and not root.is_dir():
        raise StorePathError(f"store path {root} is a file, not a folder")
    root.mkdir(parents=True, exist_ok=True)
    version_file = root / VERSION_FILE
    if version_file.exists():
        try:
            info = json.loads(version_file.read_text())
            layout = int(info["layout"])
            fmt = info["format"]
        except (ValueError, KeyError, TypeError) as exc:
            raise StorePathError(f"{version_file} is not a promptstore version file: {exc}") from None
        if fmt != "promptstore":
            raise StorePathError(f"{root} is not a promptstore folder (format {fmt!r})")
        if layout > LAYOUT_VERSION:
            raise FormatVersionError(
                f"{root} was written by a newer promptstore (folder layout {layout}; this version reads "
                f"up to {LAYOUT_VERSION}). Upgrade promptstore, or point it at another folder."
            )
        # Layout 1 is the first; older layouts, when there are some, are migrated here.
        return
    foreign = [p.name for p in root.iterdir() if not p.name.startswith("." + VERSION_FILE)]
    if foreign:
        raise StorePathError(
            f"{root} is not empty and is not a promptstore folder (found {foreign[:3]}); "
            "refusing to write into it. Pick an empty or new folder."
        )
    tmp = root / f".{VERSION_FILE}.{os.getpid()}-{secrets.token_hex(4)}"
    tmp.write_text(json.dumps({"format": "promptstore", "layout": LAYOUT_VERSION}) + "\n")
    os.replace(tmp, version_file)
    (root / "CACHEDIR.TAG").write_text(CACHEDIR_TAG)


class _SqlIndex:
    """The policy's view of the index, inside one open transaction."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def _setting(self, name: str) -> Any:
        return self.db.execute("SELECT value FROM settings WHERE name = ?", (name,)).fetchone()[0]

    def used_bytes(self) -> int:
        return int(self._setting("used"))

    def clock_value(self) -> float:
        return float(self._setting("clock"))

    def set_clock(self, value: float) -> None:
        self.db.execute("UPDATE settings SET value = ? WHERE name = 'clock'", (value,))

    def expired(self, now: float) -> list[bytes]:
        return [r[0] for r in self.db.execute("SELECT key FROM entries WHERE expires <= ?", (now,))]

    def lowest_leaf(self, exclude: bytes | None) -> tuple[bytes, float] | None:
        row = self.db.execute(  # _policy.victim_order
            "SELECT key, priority FROM entries WHERE children = 0 AND key != ? ORDER BY priority, last_hit, key LIMIT 1",
            (exclude or b"",),
        ).fetchone()
        return None if row is None else (row[0], row[1])

    def remove_tree(self, key: bytes, reason: str) -> list[_policy.Removed]:
        rows = self.db.execute(_TREE, (key,)).fetchall()
        self.db.executemany("DELETE FROM entries WHERE key = ?", [(r[0],) for r in rows])
        return [_policy.Removed(r[0], r[1], reason, r[2]) for r in rows]


class DiskTier(Tier):
    """Entry files in sharded folders plus an SQLite index; safe for many processes."""

    name = "disk"

    def __init__(
        self,
        root: str | os.PathLike[str],
        budget: int | None = None,
        *,
        clock: Clock = time.time,
        sizeof: SizeOf | None = None,
        durable: bool = False,
    ) -> None:
        self.root = Path(root).expanduser()
        check_folder(self.root)
        self.entries_dir = self.root / ENTRIES_DIR
        self.entries_dir.mkdir(exist_ok=True)
        self._entries_prefix = os.path.join(self.entries_dir, "")  # a read joins strings (pathlib's join: ~10 us)
        self.durable = durable
        self._lock = threading.RLock()  # the write connection, and every transaction
        self._db: sqlite3.Connection | None = None
        self._pid = -1
        # Reads have a connection and lock of their own: a write holds _lock while it waits for
        # another process's write lock on the index (up to BUSY_TIMEOUT_MS), and a read must not.
        self._read_lock = threading.Lock()
        self._rdb: sqlite3.Connection | None = None
        self._rpid = -1
        self._abandoned: list[sqlite3.Connection] = []
        self._count_lock = threading.Lock()  # the three below (taken inside _lock, never around it)
        self._pending: dict[str, int] = {}  # misses per kind, flushed with the next write
        self._hits: dict[bytes, list[Any]] = {}  # key -> [hits, last hit, kind, size, cost]
        self._flush_queued = False  # handed to the flusher thread
        self._retry_at = 0.0  # (monotonic) the flusher found the index locked: not before this
        self._closed = False
        super().__init__(DEFAULT_DISK_BYTES, clock=clock, sizeof=sizeof)
        with self._txn() as db:
            if budget is not None:
                db.execute("INSERT OR REPLACE INTO settings VALUES ('budget', ?)", (int(budget),))
            row = db.execute("SELECT value FROM settings WHERE name = 'budget'").fetchone()
        self.budget = int(budget) if budget is not None else int(row[0]) if row else DEFAULT_DISK_BYTES
        with self._read_lock:
            # Opened now, with its files (the write-ahead log's): not on the first read's time.
            self._reader().execute("SELECT 1 FROM entries LIMIT 1").fetchall()
        _TIERS.add(self)

    # -- connection and transactions -----------------------------------------------------
    def _connect(self) -> sqlite3.Connection:
        path = self.root / INDEX_FILE
        try:
            return self._open_index(path)
        except sqlite3.DatabaseError as exc:
            if isinstance(exc, sqlite3.OperationalError):
                raise
            # "file is not a database" and kin: the entry files describe themselves, so
            # the index is rebuilt from them instead of losing the cache (or failing).
            aside = path.with_name(f"{INDEX_FILE}.corrupt-{int(time.time())}-{os.getpid()}")
            warnings.warn(f"disk tier: index {path} is unreadable ({exc}); moved to {aside.name}, rebuilding "
                          "it from the entry files", PromptStoreWarning, stacklevel=4)
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.replace(f"{path}{suffix}", f"{aside}{suffix}")
            db = self._open_index(path)
            self._adopt_files(db)
            return db

    def _open_index(self, path: Path) -> sqlite3.Connection:
        db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False)
        try:
            db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            for attempt in range(100):
                try:
                    if db.execute("PRAGMA journal_mode = WAL").fetchone()[0].lower() == "wal":
                        break
                except sqlite3.OperationalError:
                    pass  # another process holds the lock while switching; try again
                time.sleep(0.01 * (attempt + 1))
            db.execute(f"PRAGMA synchronous = {'FULL' if self.durable else 'NORMAL'}")
            db.create_function("gdsf", 4, _policy.priority, deterministic=True)
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise FormatVersionError(
                    f"{path} has index schema {version}; this promptstore reads up to {SCHEMA_VERSION}"
                )
            if version < SCHEMA_VERSION:
                try:
                    db.executescript(
                        f"BEGIN IMMEDIATE; {_SCHEMA} PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;"
                    )
                except BaseException:
                    with contextlib.suppress(sqlite3.Error):
                        db.execute("ROLLBACK")
                    raise
            # The victim order's index. Created on open, without a schema bump: a reader of
            # schema 1 that lacks it still opens the folder (an extra index changes no row).
            db.execute("CREATE INDEX IF NOT EXISTS entries_victims ON entries(priority, last_hit, key) WHERE children = 0")
        except BaseException:
            db.close()
            raise
        return db

    def _conn(self) -> sqlite3.Connection:
        if self._db is None or self._pid != os.getpid():
            if self._db is not None:
                # Inherited over fork: never use or close the parent's connection here.
                self._abandoned.append(self._db)
            self._db = self._connect()
            self._pid = os.getpid()
        return self._db

    def _reader(self) -> sqlite3.Connection:
        """The reads' connection (used under _read_lock)."""
        if self._rdb is None or self._rpid != os.getpid():
            if self._rdb is not None:
                self._abandoned.append(self._rdb)  # inherited over fork, as in _conn
            with self._lock:
                self._conn()  # the index exists, at this schema (rebuilt if it was unreadable)
            self._rdb = sqlite3.connect(self.root / INDEX_FILE, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                                        check_same_thread=False)
            self._rpid = os.getpid()
        return self._rdb

    @contextlib.contextmanager
    def _txn(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            db = self._conn()
            db.execute("BEGIN IMMEDIATE")
            try:
                # Pending hits first, so an eviction in this transaction sees them.
                self._write_counters(db)
                yield db
                db.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
                raise

    def _write_counters(self, db: sqlite3.Connection) -> None:
        with self._count_lock:
            hits, self._hits = self._hits, {}
            pending, self._pending = self._pending, {}
        if hits:
            db.executemany(_HIT, [{"n": h[0], "now": h[1], "key": k} for k, h in hits.items()])
            per_kind: dict[str, list[Any]] = {}
            for n, _, kind, size, cost in hits.values():
                c = per_kind.setdefault(kind, [0, 0, 0.0])
                c[0] += n
                c[1] += n * size
                c[2] += n * cost
            db.executemany(_COUNT, [(k, c[0], 0, c[1], c[2]) for k, c in per_kind.items()])
        if pending:
            db.executemany(_COUNT, [(k, 0, n, 0, 0.0) for k, n in pending.items()])

    def _forked(self) -> None:
        """In a child after fork (one thread): fresh locks, and no batch of the parent's."""
        self._lock = threading.RLock()
        self._read_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._hits, self._pending = {}, {}
        self._flush_queued, self._retry_at = False, 0.0

    def _background_flush(self) -> None:
        """The flusher thread's flush of a due batch. It never waits for another process's write lock on
        the index: the batch then stays pending, for the next write, flush or try."""
        with self._count_lock:
            self._flush_queued = False
            if not (self._hits or self._pending):
                return
        with self._lock:
            if self._closed:
                return
            db = self._conn()
            db.execute("PRAGMA busy_timeout = 0")
            try:
                with self._txn():
                    pass
            except sqlite3.OperationalError:  # SQLITE_BUSY: another connection is writing
                self._retry_at = time.monotonic() + BUSY_RETRY_S
                queued = _FLUSHER.add(self, FLUSH_AFTER_S)
                with self._count_lock:
                    self._flush_queued = queued
            finally:
                db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")

    def flush(self) -> None:
        """Write this process's pending hit and miss counts to the index."""
        with self._lock:
            if self._hits or self._pending:
                with self._txn():
                    pass

    def _read(self, key: bytes, into: Mapping[str, np.ndarray] | None = None, kind: str | None = None,
              namespace: str | None = None) -> tuple[Entry, tuple[int, float]] | None:
        """Read and verify the entry file of ``key``; None if it has no row or file.

        With ``into``, see :meth:`get_into`: the header is checked first (an entry of another
        namespace or kind writes nothing), then matching tensors are read straight into the arrays.
        """
        with self._read_lock:
            row = self._reader().execute(
                "SELECT file, expires, ttl, hits, created FROM entries WHERE key = ?", (key,)
            ).fetchone()
        with self._count_lock:
            counted = self._hits.get(key)
            pending = None if counted is None else (counted[0], counted[1])  # (the list changes under the lock)
        if row is None:
            return None
        file, expires, ttl, hits, created = row
        if pending is not None and ttl is not None:
            expires = pending[1] + ttl
        if expires is not None and expires <= self.clock():
            with self._txn() as db:
                # Again on the write connection, after this process's pending hits were written: the read may
                # have raced a batch's write (its hits no longer pending, the row not yet refreshed).
                now = db.execute("SELECT expires FROM entries WHERE key = ?", (key,)).fetchone()
                expired = now is not None and now[0] is not None and now[0] <= self.clock()
                removed = _SqlIndex(db).remove_tree(key, "expired") if expired else []
                self._count_removed(db, removed)
            self._unlink_removed(removed)
            if expired:
                return None
        try:
            fd = os.open(self._entries_prefix + file, os.O_RDONLY | getattr(os, "O_BINARY", 0))  # (not inherited: PEP 446)
            try:
                if into is not None:
                    entry = _read_into(fd, key, into, kind, namespace)
                else:
                    entry = decode(_file_bytes(fd), expect_key=key)
            finally:
                os.close(fd)
        except FileNotFoundError:
            return None  # evicted or replaced by another process since the row was read
        except EntryVersionError:
            return None  # another release's entry: a miss, and left for that release
        except CorruptEntryError as exc:
            self._drop_corrupt(key, file, str(exc))
            return None
        return None if entry is None else (entry, (hits + (pending[0] if pending else 0), created))

    def _drop_corrupt(self, key: bytes, file: str, reason: str) -> None:
        warnings.warn(f"disk tier: dropped corrupt entry {key.hex()[:16]}… ({reason})", PromptStoreWarning,
                      stacklevel=5)
        with self._txn() as db:
            still = db.execute("SELECT 1 FROM entries WHERE key = ? AND file = ?", (key, file)).fetchone()
            removed = _SqlIndex(db).remove_tree(key, "corrupt") if still else []
        self._unlink_removed(removed)
        _unlink(self.entries_dir / file)

    def _count_removed(self, db: sqlite3.Connection, removed: list[_policy.Removed]) -> None:
        evicted = sum(r.reason == "evicted" for r in removed)
        expired = sum(r.reason == "expired" for r in removed)
        if evicted:
            db.execute("UPDATE settings SET value = value + ? WHERE name = 'evictions'", (evicted,))
            self.evictions += evicted
        if expired:
            db.execute("UPDATE settings SET value = value + ? WHERE name = 'expirations'", (expired,))

    def _unlink_removed(self, removed: list[_policy.Removed]) -> None:
        for r in removed:
            if r.file:
                _unlink(self.entries_dir / r.file)

    # -- Tier ----------------------------------------------------------------------------
    def get(self, key: bytes, kind: str | None = None) -> Entry | None:
        return self._counted(key, kind, self._read(key))

    def get_into(self, key: bytes, kind: str | None, namespace: str, into: Mapping[str, np.ndarray]) -> Entry | None:
        return self._counted(key, kind, self._read(key, into, kind, namespace))

    def _counted(self, key: bytes, kind: str | None, found: tuple[Entry, tuple[int, float]] | None) -> Entry | None:
        """Count a read's hit (or miss) for the policy; the entry with its hit count, or None."""
        if found is None:
            with self._count_lock:
                self._pending[kind or "unknown"] = self._pending.get(kind or "unknown", 0) + 1
            return None
        entry, (hits, created) = found
        now = self.clock()
        with self._count_lock:
            pending = self._hits.get(key)
            if pending is None:
                self._hits[key] = [1, now, entry.kind, entry.size, entry.cost_s]
            else:
                pending[0] += 1
                pending[1] = now
            # The flusher writes the batch once it is due (now, if it is this big already).
            hand = not self._flush_queued
            self._flush_queued = True
            urgent = len(self._hits) >= FLUSH_HITS
        if (hand or urgent) and not _FLUSHER.add(self, 0.0 if urgent else FLUSH_AFTER_S):
            with self._count_lock:
                self._flush_queued = False  # no thread: the next hit tries again
        entry.hits, entry.created, entry.last_hit = hits + 1, created, now
        return entry

    def peek(self, key: bytes) -> Entry | None:
        found = self._read(key)
        return None if found is None else found[0]

    def put(self, entry: Entry) -> bool:
        size = self.sizeof(entry)
        if not self.fits(entry, size):
            return False
        key, hexkey = entry.key, entry.hex
        file = f"{hexkey[:2]}/{hexkey}.{os.getpid()}-{secrets.token_hex(4)}{SUFFIX}"
        final = self.entries_dir / file
        tmp = final.with_name(f".{final.name}{PARTIAL}")
        final.parent.mkdir(exist_ok=True)
        try:
            with open(tmp, "xb") as f:
                f.write(memoryview(entry.blob))
                if self.durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, final)
            if self.durable:
                _fsync_dir(final.parent)
        except BaseException:
            _unlink(tmp)
            raise
        committed = False
        try:
            now = self.clock()
            with self._txn() as db:
                if entry.parent is not None and db.execute(
                        "SELECT 1 FROM entries WHERE key = ?", (entry.parent,)).fetchone() is None:
                    # The parent was evicted (by another process) since the store looked: the
                    # block would be unreachable, so it is not stored. Checked inside the
                    # write transaction, so no orphan can be committed.
                    raise _Orphan
                old = db.execute("SELECT file FROM entries WHERE key = ?", (key,)).fetchone()
                if old is not None:
                    db.execute("DELETE FROM entries WHERE key = ?", (key,))
                ttl = entry.ttl_s
                hits = max(1, entry.hits)  # hits carried in (a promotion, a bundle) count here too
                db.execute(
                    "INSERT INTO entries (key, file, kind, namespace, parent, size, cost, hits, created, "
                    "last_hit, ttl, expires, priority) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, "
                    "gdsf((SELECT value FROM settings WHERE name = 'clock'), ?, ?, ?))",
                    (key, file, entry.kind, entry.namespace, entry.parent, size, entry.cost_s, hits, now, now,
                     ttl, None if ttl is None else now + ttl, hits, entry.cost_s, size),
                )
                removed = _policy.make_room(_SqlIndex(db), self.budget, now=now, protect=key)
                self._count_removed(db, removed)
            committed = True
        except _Orphan:
            return False
        finally:
            if not committed:
                _unlink(final)
        if old is not None and old[0] != file:
            _unlink(self.entries_dir / old[0])
        self._unlink_removed(removed)
        return all(r.key != key for r in removed)

    def delete(self, key: bytes) -> list[bytes]:
        with self._txn() as db:
            removed = _SqlIndex(db).remove_tree(key, "deleted")
        self._unlink_removed(removed)
        return [r.key for r in removed]

    def contains(self, key: bytes) -> str | None:
        with self._lock:
            row = self._conn().execute("SELECT expires, namespace FROM entries WHERE key = ?", (key,)).fetchone()
        return row[1] if row is not None and (row[0] is None or row[0] > self.clock()) else None

    def infos(self, kind: str | None = None) -> Iterator[EntryInfo]:
        sql = "SELECT key, kind, size, cost, hits, created, last_hit, parent, expires, namespace FROM entries"
        self.flush()
        with self._lock:
            rows = self._conn().execute(sql + (" WHERE kind = ?" if kind else ""), (kind,) if kind else ()).fetchall()
        for r in rows:
            yield EntryInfo(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9], self.name)

    def usage(self) -> dict[str, Any]:
        self.flush()
        with self._lock:
            db = self._conn()
            settings = dict(db.execute("SELECT name, value FROM settings").fetchall())
            counters = {
                r[0]: {"hits": r[1], "misses": r[2], "hit_bytes": r[3], "seconds_saved": r[4]}
                for r in db.execute("SELECT kind, hits, misses, hit_bytes, saved_s FROM counters")
            }
        return {
            "entries": int(settings["count"]), "bytes": int(settings["used"]), "budget": self.budget,
            "evictions": self.evictions, "path": str(self.root),
            "lifetime": {"evictions": int(settings["evictions"]), "expirations": int(settings["expirations"]),
                         "kinds": counters},
        }

    # -- maintenance ---------------------------------------------------------------------
    def _scan_files(self) -> Iterator[tuple[Path, str]]:
        """Every file under entries/, as (path, name relative to entries/)."""
        if not self.entries_dir.is_dir():
            return
        for shard in os.scandir(self.entries_dir):
            if not shard.is_dir(follow_symlinks=False):
                continue
            for f in os.scandir(shard.path):
                yield Path(f.path), f"{shard.name}/{f.name}"

    def _adopt_files(self, db: sqlite3.Connection) -> int:
        """Index every valid entry file that has no row (rebuilding a lost index)."""
        known = {r[0] for r in db.execute("SELECT file FROM entries")}
        files = [(p, rel) for p, rel in self._scan_files() if rel.endswith(SUFFIX) and rel not in known]
        adopted = 0
        now = self.clock()
        for path, rel in tqdm(files, desc="promptstore: re-indexing", unit="entry", disable=None, leave=False):
            try:
                entry = decode(np.fromfile(path, dtype=np.uint8))
            except EntryVersionError:
                continue  # another release's entry: not ours to index, not ours to delete
            except (OSError, CorruptEntryError, ValueError):
                _unlink(path)
                continue
            if not path.name.startswith(entry.hex):
                _unlink(path)
                continue
            db.execute("BEGIN IMMEDIATE")
            try:
                prev = db.execute("SELECT file FROM entries WHERE key = ?", (entry.key,)).fetchone()
                if prev is None:
                    db.execute(
                        "INSERT INTO entries (key, file, kind, namespace, parent, size, cost, hits, created, "
                        "last_hit, ttl, expires, priority) VALUES (?, ?, ?, ?, ?, ?, ?, 1, ?, ?, ?, ?, "
                        "gdsf((SELECT value FROM settings WHERE name = 'clock'), 1, ?, ?))",
                        (entry.key, rel, entry.kind, entry.namespace, entry.parent, entry.size, entry.cost_s,
                         now, now, entry.ttl_s, None if entry.ttl_s is None else now + entry.ttl_s,
                         entry.cost_s, entry.size),
                    )
                    adopted += 1
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            if prev is not None:
                _unlink(path)
        return adopted

    def verify(self, namespace: str | None = None) -> dict[str, Any]:
        self.flush()
        where, args = ("", ()) if namespace is None else (" WHERE namespace = ?", (namespace,))
        with self._lock:
            rows = self._conn().execute("SELECT key, file, kind, parent, size FROM entries" + where, args).fetchall()
        problems: list[str] = []
        versions = {"newer": 0, "older": 0}
        for key, file, kind, parent, size in tqdm(rows, desc="promptstore: verifying", unit="entry",
                                                  disable=None, leave=False):
            try:
                entry = decode(np.fromfile(self.entries_dir / file, dtype=np.uint8), expect_key=key)
                if (entry.kind, entry.parent) != (kind, parent) or (self._sizeof is None and entry.size != size):
                    raise CorruptEntryError("file and index disagree on kind, parent or size")
            except EntryVersionError as exc:
                versions["newer" if exc.newer else "older"] += 1  # reported apart, never dropped
            except FileNotFoundError:
                if self.contains(key) is not None:  # not merely evicted since the listing
                    problems.append(f"{key.hex()}: file {file} is missing")
                    self.delete(key)
            except (OSError, CorruptEntryError) as exc:
                problems.append(f"{key.hex()}: {exc}")
                self._drop_corrupt(key, file, str(exc))
        if namespace is not None:  # the folder's totals are everyone's: only the administrator's view fixes them
            return {"tier": self.name, "checked": len(rows), "problems": problems, "other_versions": versions}
        with self._txn() as db:
            bad_children = db.execute(
                "SELECT count(*) FROM entries p WHERE children != (SELECT count(*) FROM entries c WHERE c.parent = p.key)"
            ).fetchone()[0]
            if bad_children:
                problems.append(f"{bad_children} entries had a wrong child count (fixed)")
                db.execute("UPDATE entries SET children = (SELECT count(*) FROM entries c WHERE c.parent = entries.key)")
            used, count = db.execute("SELECT coalesce(sum(size), 0), count(*) FROM entries").fetchone()
            settings = dict(db.execute("SELECT name, value FROM settings WHERE name IN ('used', 'count')").fetchall())
            if (settings["used"], settings["count"]) != (used, count):
                problems.append(f"byte/entry totals {settings['used']}/{settings['count']} != {used}/{count} (fixed)")
                db.execute("UPDATE settings SET value = ? WHERE name = 'used'", (used,))
                db.execute("UPDATE settings SET value = ? WHERE name = 'count'", (count,))
            over = used > self.budget
        if over:
            problems.append(f"{used} bytes stored over the {self.budget}-byte budget")
        return {"tier": self.name, "checked": len(rows), "problems": problems, "other_versions": versions}

    def gc(self, namespace: str | None = None) -> dict[str, Any]:
        now = self.clock()
        with self._txn() as db:
            if namespace is None:
                removed = _policy.make_room(_SqlIndex(db), self.budget, now=now)
            else:  # a tenant's gc drops its own expired entries; the budget is everyone's
                index = _SqlIndex(db)
                keys = [r[0] for r in db.execute("SELECT key FROM entries WHERE namespace = ? AND expires <= ?",
                                                 (namespace, now))]
                removed = [r for k in keys for r in index.remove_tree(k, "expired")]
            self._count_removed(db, removed)
            known = {r[0] for r in db.execute("SELECT file FROM entries")}
        self._unlink_removed(removed)
        temp_files = orphan_files = freed = 0
        for path, rel in self._scan_files():
            pid = _writer_pid(path.name)
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            old = now - st.st_mtime > STALE_AFTER_S
            dead = pid is None or not _pid_alive(pid)
            if path.name.endswith(PARTIAL):
                if dead or old:
                    _unlink(path)
                    temp_files += 1
                    freed += st.st_size
            elif rel not in known and (dead or old) and not _other_version(path):
                # Renamed into place but its row never committed: the writer died in between.
                # Check again under the lock, since a live writer may have committed since.
                with self._lock:
                    hit = self._conn().execute("SELECT 1 FROM entries WHERE file = ?", (rel,)).fetchone()
                if hit is None:
                    _unlink(path)
                    orphan_files += 1
                    freed += st.st_size
        missing = 0
        with self._lock:
            rows = self._conn().execute("SELECT key, file FROM entries").fetchall()
        for key, file in rows:
            if not (self.entries_dir / file).exists():
                with self._txn() as db:
                    if db.execute("SELECT 1 FROM entries WHERE key = ? AND file = ?", (key, file)).fetchone():
                        missing += len(_SqlIndex(db).remove_tree(key, "corrupt"))
        with self._lock, contextlib.suppress(sqlite3.Error):
            self._conn().execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return {
            "tier": self.name,
            "expired": sum(r.reason == "expired" for r in removed),
            "evicted": sum(r.reason == "evicted" for r in removed),
            "temp_files": temp_files,
            "orphan_files": orphan_files,
            "missing_files": missing,
            "freed_bytes": freed + sum(r.size for r in removed),
        }

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._db is not None and self._pid == os.getpid():
                with contextlib.suppress(sqlite3.Error):
                    self.flush()
                    self._db.close()
            self._db = None
        with self._read_lock:
            if self._rdb is not None and self._rpid == os.getpid():
                with contextlib.suppress(sqlite3.Error):
                    self._rdb.close()
            self._rdb = None


class _Flusher:
    """One daemon thread per process, started by the first hit, that writes disk tiers' due batches of hit
    counts at the lowest CPU priority: between requests as a rule, and never at the start of one."""

    def __init__(self) -> None:
        self._reset()
        # Held while a batch is written, and by fork() (see forking): a child never inherits a tier's
        # lock held by this thread, which does not exist in the child to release it.
        self.writing = threading.Lock()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._queue: weakref.WeakKeyDictionary[DiskTier, float] = weakref.WeakKeyDictionary()  # tier -> due at
        self._pid = -1

    def add(self, tier: DiskTier, delay: float) -> bool:
        """Write ``tier``'s batch in ``delay`` seconds (or sooner, if it is already due sooner; never before
        ``tier``'s retry time). False if no thread can be had: batches then go out with the next write or close."""
        with self._lock:
            if self._pid != os.getpid():
                try:
                    threading.Thread(target=self._run, name="promptstore-flusher", daemon=True).start()
                except RuntimeError:
                    return False
                self._pid = os.getpid()
            due = max(time.monotonic() + delay, tier._retry_at)
            held = self._queue.get(tier)
            if held is not None and held <= due:
                return True
            self._queue[tier] = due
        self._wake.set()  # the thread may be waiting for a later one
        return True

    def _run(self) -> None:
        from .._writer import background_priority

        background_priority()
        while True:
            with self._lock:
                now = time.monotonic()
                ready = [tier for tier, due in self._queue.items() if due <= now]
                for tier in ready:
                    del self._queue[tier]
                wait = min(self._queue.values(), default=now + 60.0) - now
            self._write(ready)
            del ready  # a closed tier is not kept alive by this thread
            self._wake.wait(wait)
            self._wake.clear()

    def _write(self, tiers: list[DiskTier]) -> None:
        for tier in tiers:
            try:
                with self.writing:
                    tier._background_flush()
            except Exception:  # noqa: BLE001 - counts are bookkeeping: the next write or close tries again
                pass

    def forking(self) -> None:
        self.writing.acquire()

    def forked_parent(self) -> None:
        self.writing.release()

    def forked_child(self) -> None:
        """In a child after fork: no thread yet, nothing queued; every tier's locks fresh and its batch empty
        (the parent's hits are the parent's to write: written by both, they would count twice)."""
        self.writing = threading.Lock()
        self._reset()
        for tier in list(_TIERS):
            tier._forked()


_TIERS: weakref.WeakSet[DiskTier] = weakref.WeakSet()
_FLUSHER = _Flusher()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_FLUSHER.forking, after_in_parent=_FLUSHER.forked_parent,
                        after_in_child=_FLUSHER.forked_child)

_IOV_MAX = 1024
_HASH_RUN = 1 << 20  # hash what was just read while it is still in the CPU's cache


def _pread_all(fd: int, views: list[memoryview], offset: int) -> int:
    """preadv every view in order from ``offset``, resuming short reads; returns the bytes read."""
    got = 0
    i = 0
    while i < len(views):
        batch = views[i : i + _IOV_MAX]
        want = sum(v.nbytes for v in batch)
        n = os.preadv(fd, batch, offset + got)
        got += n
        if n == want:
            i += len(batch)
            continue
        if n == 0:
            return got
        # A short read: resume inside the view it stopped in (n counts bytes: slice a byte view,
        # not the caller's, whose items may be wider).
        for j, v in enumerate(batch):
            if n < v.nbytes:
                views = [v.cast("B")[n:]] + batch[j + 1 :] + views[i + len(batch) :]
                i = 0
                break
            n -= v.nbytes
    return got


def _libc() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int64]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None  # no mmap in this C library: entries are read


_LIBC = _libc() if os.name == "posix" else None
_MAP_FAILED = ctypes.c_void_p(-1).value


def _mapped(fd: int, size: int) -> np.ndarray | None:
    """The file's bytes as a private mapping, unmapped when the last array viewing it goes.

    Through libc rather than Python's ``mmap``, which keeps a duplicate of the file descriptor
    for each mapping: a memory tier holding a thousand mapped entries would hold a thousand
    descriptors. Private and writable: a caller who makes a tensor writable again writes its
    own copy of the page, never the file.
    """
    if _LIBC is None:
        return None
    addr = _LIBC.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        return None
    region = (ctypes.c_uint8 * size).from_address(addr)
    weakref.finalize(region, _LIBC.munmap, addr, size)
    return np.frombuffer(memoryview(region).cast("B"), dtype=np.uint8)


def _file_bytes(fd: int) -> np.ndarray:
    """An entry file's bytes: mapped when big (see MAP_MIN_BYTES), else read into a buffer."""
    size = os.fstat(fd).st_size
    if size >= MAP_MIN_BYTES and (mapped := _mapped(fd, size)) is not None:
        return mapped  # a file system that cannot map it is read instead
    # np.empty skips the zero-fill a bytearray would do: one pass less over the bytes.
    buf = np.empty(size, dtype=np.uint8)
    if _pread_all(fd, [buf.data], 0) != size:
        raise CorruptEntryError(f"short read of {size} bytes")
    return buf


def _runs(arr: np.ndarray) -> list[memoryview]:
    """The array's bytes as writable contiguous runs in C order (one per row of its contiguous inner block)."""
    if arr.size == 0:
        return []
    inner, expected = arr.ndim, arr.itemsize
    while inner > 0 and (arr.shape[inner - 1] == 1 or arr.strides[inner - 1] == expected):
        expected *= arr.shape[inner - 1]
        inner -= 1
    if inner == 0:
        return [arr.reshape(-1).data]
    rows = arr.view()
    try:
        rows.shape = (-1, expected // arr.itemsize)  # the outer dims merged, when their strides allow (no copy)
    except AttributeError:
        # idx + (...,): a view even when idx names one element (arr[idx] alone is a copied scalar,
        # and the bytes read into it would never reach arr).
        return [arr[idx + (...,)].reshape(-1).data for idx in np.ndindex(*arr.shape[:inner])]
    return [r.data for r in rows]


def _read_into(fd: int, key: bytes, into: Mapping[str, np.ndarray], kind: str | None,
               namespace: str | None) -> Entry | None:
    """One entry file, its matching tensors read straight into ``into`` and the checksum verified on the way."""
    size = os.fstat(fd).st_size
    head_bytes = os.pread(fd, min(size, 1 << 16), 0)
    if len(head_bytes) >= 8:
        need = 8 + int.from_bytes(head_bytes[:8], "little")
        if len(head_bytes) < need <= min(size, MAX_HEADER_BYTES + 8):
            head_bytes += os.pread(fd, need - len(head_bytes), len(head_bytes))
    head = parse_header(memoryview(head_bytes), size, expect_key=key)
    if (namespace is not None and head.namespace != namespace) or (kind is not None and head.kind != kind):
        return None
    digest = xxhash.xxh3_128()
    tensors: dict[str, np.ndarray] = {}
    for b, _end, name, _, dtype, shape in head.spans:
        dst = into.get(name)
        if dst is not None and dst.dtype == dtype and dst.shape == tuple(shape) and dst.flags.writeable:
            views, out = _runs(dst), dst
        else:
            out = np.empty(tuple(shape), dtype)
            views = [out.reshape(-1).view(np.uint8).data] if out.size else []
        offset = head.start + b
        # Read about a megabyte of runs at a time and hash it while it is still in cache.
        i = 0
        while i < len(views):
            j, run = i, 0
            while j < len(views) and (j == i or run + views[j].nbytes <= _HASH_RUN) and j - i < _IOV_MAX:
                run += views[j].nbytes
                j += 1
            if _pread_all(fd, views[i:j], offset) != run:
                raise CorruptEntryError(f"short read in tensor {name!r}")
            for v in views[i:j]:
                digest.update(v)
            offset += run
            i = j
        if out is not dst:
            out.flags.writeable = False
        tensors[name] = out
    check_digest(head, digest)
    return make_entry(head, tensors, None)


def _other_version(path: Path) -> bool:
    """Whether a file is a well-formed entry of another format version (another release's, kept)."""
    try:
        decode(np.fromfile(path, dtype=np.uint8), verify=False)
    except EntryVersionError:
        return True
    except (OSError, CorruptEntryError, ValueError):
        return False
    return False


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
