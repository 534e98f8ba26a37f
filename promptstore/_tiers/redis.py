"""The Redis tier: one store shared by many machines through a real Redis server.

Entries travel as the same encoded bytes as on disk (checksummed, verified on read). The
policy's bookkeeping lives beside them in Redis, and every change that the eviction policy
decides is one Lua script, so clients evicting at once never leave half an entry or a
broken chain. Keys, all under ``prefix``:

    m:<hex>          hash: size, cost, hits, times, ttl, parent, kind, namespace, blob, prio
    b:<hex>:<nonce>  the entry's bytes (immutable: a rewrite gets a new nonce)
    k:<hex>          set of the entries chained from <hex>
    leaves           zset: entries nothing chains from, by GDSF priority
    expiry           zset: entries with a TTL, by expiry time (also mapped onto Redis expiry)
    s                hash: used bytes, count, clock, evictions, expirations
    c:<kind>         hash: lifetime hits, misses, hit bytes, seconds saved

Writes go to a staging key in pipelined 1 MiB appends, then the commit script renames it
into place: a reader sees a whole entry or none, and a large entry is never copied whole
on its way. A standalone Redis (or a primary) is assumed, not Redis Cluster.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar
from urllib.parse import urlparse

import numpy as np

from .. import _policy
from .._codec import decode
from .._entry import Entry, EntryInfo
from ..errors import ConfigError, CorruptEntryError, EntryVersionError, PromptStoreWarning, TierUnavailableError
from .base import Clock, SizeOf, Tier

__all__ = ["RedisTier"]

_T = TypeVar("_T")

log = logging.getLogger("promptstore")
CHUNK = 1 << 20
INLINE_MAX = 1 << 20  # entries up to this size come back inside the hit script's reply
STAGING_TTL_MS = 120_000
EXPIRY_GRACE_S = 3600  # Redis drops a TTL'd entry this long after its expiry, should no client sweep it first
BACKOFF = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)

# Shared by every script. The priority formula is _policy.priority; the victim loop is
# _policy.make_room, here run inside Redis so that it is atomic across clients.
_PRELUDE = r"""
local COST_FLOOR = """ + repr(_policy.COST_FLOOR_S) + r"""
local P = ARGV[1]
local S = P .. "s"
local function num(x) return tonumber(x) or 0 end
local function fmt(x) return string.format("%.17g", x) end
local function prio(hits, cost, size)
  return num(redis.call("HGET", S, "clock")) + hits * math.max(cost, COST_FLOOR) / math.max(size, 1)
end
-- _policy.victim_order breaks priority ties by last hit, then key: among equal scores a
-- sorted set orders members by their bytes, so a leaf's member is "<last hit>:<hex key>".
local function leaf_del(hex)
  local m = P .. "m:" .. hex
  local leaf = redis.call("HGET", m, "leaf")
  redis.call("ZREM", P .. "leaves", leaf or hex)
  if leaf then redis.call("HDEL", m, "leaf") end
end
local function leaf_add(hex)
  local m = P .. "m:" .. hex
  local f = redis.call("HMGET", m, "prio", "last_hit")
  if not f[1] then return end
  leaf_del(hex)
  local member = string.format("%020.6f", num(f[2])) .. ":" .. hex
  redis.call("ZADD", P .. "leaves", f[1], member)
  redis.call("HSET", m, "leaf", member)
end
local function leaf_hex(member)
  local at = string.find(member, ":", 1, true)
  if at then return string.sub(member, at + 1) end
  return member
end
local function remove_tree(hex, removed)
  local stack = {hex}
  while #stack > 0 do
    local h = table.remove(stack)
    for _, c in ipairs(redis.call("SMEMBERS", P .. "k:" .. h)) do table.insert(stack, c) end
    local m = P .. "m:" .. h
    local f = redis.call("HMGET", m, "size", "blob", "parent")
    redis.call("DEL", P .. "k:" .. h)
    if f[1] then
      leaf_del(h)
      redis.call("DEL", m, f[2])
      redis.call("ZREM", P .. "expiry", h)
      redis.call("HINCRBY", S, "used", -num(f[1]))
      redis.call("HINCRBY", S, "count", -1)
      local parent = f[3]
      if parent and parent ~= "" then
        redis.call("SREM", P .. "k:" .. parent, h)
        if redis.call("SCARD", P .. "k:" .. parent) == 0 then leaf_add(parent) end
      end
      table.insert(removed, h)
    end
  end
end
local function make_room(budget, now, protect)
  local expired, evicted = {}, {}
  for _, h in ipairs(redis.call("ZRANGEBYSCORE", P .. "expiry", "-inf", fmt(now))) do remove_tree(h, expired) end
  for pass = 1, 2 do
    local exclude = protect
    if pass == 2 then exclude = nil end
    while num(redis.call("HGET", S, "used")) > budget do
      local cand = redis.call("ZRANGE", P .. "leaves", 0, 1, "WITHSCORES")
      local victim, vp = nil, nil
      for i = 1, #cand, 2 do
        local h = leaf_hex(cand[i])
        if h ~= exclude then victim = h; vp = tonumber(cand[i + 1]); break end
      end
      if not victim then break end
      if vp > num(redis.call("HGET", S, "clock")) then redis.call("HSET", S, "clock", fmt(vp)) end
      remove_tree(victim, evicted)
    end
  end
  redis.call("HINCRBY", S, "evictions", #evicted)
  redis.call("HINCRBY", S, "expirations", #expired)
  return expired, evicted
end
"""

# ARGV: prefix, hex, blob_key, staging_key, size, cost, kind, namespace, parent, ttl, now, budget, grace, length, hits
_COMMIT = _PRELUDE + r"""
local hex, blob, staging = ARGV[2], ARGV[3], ARGV[4]
local size, cost, now, budget = num(ARGV[5]), num(ARGV[6]), num(ARGV[11]), num(ARGV[12])
local kind, ns, parent, ttl = ARGV[7], ARGV[8], ARGV[9], ARGV[10]
if redis.call("EXISTS", staging) == 0 then return {-1, 0, 0} end
if parent ~= "" and redis.call("EXISTS", P .. "m:" .. parent) == 0 then
  -- Its parent was evicted by another client since this one looked: storing the block
  -- now would leave it unreachable. Atomic here, so no orphan can ever be committed.
  redis.call("DEL", staging)
  return {0, 0, 0}
end
local m = P .. "m:" .. hex
local old = redis.call("HMGET", m, "blob", "size", "parent")
if old[2] then
  redis.call("DEL", old[1])
  redis.call("HINCRBY", S, "used", -num(old[2]))
  redis.call("HINCRBY", S, "count", -1)
  if old[3] and old[3] ~= "" and old[3] ~= parent then
    redis.call("SREM", P .. "k:" .. old[3], hex)
    if redis.call("SCARD", P .. "k:" .. old[3]) == 0 then leaf_add(old[3]) end
  end
end
redis.call("RENAME", staging, blob)
redis.call("PERSIST", blob)
local hits = math.max(1, num(ARGV[15]))  -- hits carried in (a promotion, a bundle) count here too
local p = prio(hits, cost, size)
local expires = ""
if ttl ~= "" then expires = fmt(now + num(ttl)) end
redis.call("HSET", m, "size", size, "cost", fmt(cost), "hits", hits, "created", fmt(now), "last_hit", fmt(now),
  "ttl", ttl, "expires", expires, "parent", parent, "kind", kind, "ns", ns, "blob", blob, "prio", fmt(p),
  "len", ARGV[14])
redis.call("HINCRBY", S, "used", size)
redis.call("HINCRBY", S, "count", 1)
if parent ~= "" then
  redis.call("SADD", P .. "k:" .. parent, hex)
  leaf_del(parent)
end
if redis.call("SCARD", P .. "k:" .. hex) == 0 then leaf_add(hex) else leaf_del(hex) end
if expires ~= "" then
  redis.call("ZADD", P .. "expiry", expires, hex)
  -- Relative to Redis's own clock: hosts' clocks may disagree, Redis's is the one that expires.
  local ms = math.floor((num(ttl) + num(ARGV[13])) * 1000)
  redis.call("PEXPIRE", m, ms)
  redis.call("PEXPIRE", blob, ms)
else
  redis.call("ZREM", P .. "expiry", hex)
  redis.call("PERSIST", m)
end
local expired, evicted = make_room(budget, now, hex)
local kept = redis.call("EXISTS", m)
return {kept, #evicted, #expired}
"""

# ARGV: prefix, hex, now, inline_max, grace. Returns nil, or {bytes_or_blob_key, inline(0/1), size, hits, created}
_HIT = _PRELUDE + r"""
local hex, now = ARGV[2], num(ARGV[3])
local m = P .. "m:" .. hex
local f = redis.call("HMGET", m, "blob", "size", "ttl", "expires", "hits", "cost", "created", "kind", "len")
if not f[1] then return nil end
if f[4] and f[4] ~= "" and num(f[4]) <= now then
  local removed = {}
  remove_tree(hex, removed)
  redis.call("HINCRBY", S, "expirations", #removed)
  return nil
end
local size, hits, cost = num(f[2]), num(f[5]) + 1, num(f[6])
local p = prio(hits, cost, size)
redis.call("HSET", m, "hits", hits, "last_hit", fmt(now), "prio", fmt(p))
if redis.call("SCARD", P .. "k:" .. hex) == 0 then leaf_add(hex) end
if f[3] and f[3] ~= "" then
  local expires = now + num(f[3])
  redis.call("HSET", m, "expires", fmt(expires))
  redis.call("ZADD", P .. "expiry", fmt(expires), hex)
  local ms = math.floor((num(f[3]) + num(ARGV[5])) * 1000)
  redis.call("PEXPIRE", m, ms)
  redis.call("PEXPIRE", f[1], ms)
end
local c = P .. "c:" .. f[8]
redis.call("HINCRBY", c, "hits", 1)
redis.call("HINCRBY", c, "hit_bytes", size)
redis.call("HINCRBYFLOAT", c, "saved_s", fmt(cost))
local length = num(f[9])
if length <= num(ARGV[4]) then
  return {redis.call("GET", f[1]) or "", 1, length, hits, f[7]}
end
return {f[1], 0, length, hits, f[7]}
"""

# ARGV: prefix, hex
_DELETE = _PRELUDE + r"""
local removed = {}
remove_tree(ARGV[2], removed)
return removed
"""

# ARGV: prefix, now, budget
_GC = _PRELUDE + r"""
local expired, evicted = make_room(num(ARGV[3]), num(ARGV[2]), nil)
return {#expired, #evicted}
"""

# ARGV: prefix, hex (a corrupt entry: drop it only if it still holds the blob we read)
_DROP = _PRELUDE + r"""
if redis.call("HGET", P .. "m:" .. ARGV[2], "blob") ~= ARGV[3] then return 0 end
local removed = {}
remove_tree(ARGV[2], removed)
return #removed
"""


def _redis_module() -> Any:
    try:
        import redis
    except ImportError:
        raise ConfigError('the Redis tier needs redis-py: pip install "promptstore[redis]"') from None
    return redis


class RedisTier(Tier):
    """Entries in a Redis server, shared by every host that points at it.

    Args:
        url: ``redis://[user:password@]host:port/db`` or ``rediss://...`` (TLS). Query
            parameters go to redis-py (e.g. ``?socket_timeout=5``); the connect and socket
            timeouts default to 2 s.
        budget: bytes this tier may hold in Redis.
        prefix: key prefix, so several stores can share one Redis.

    Raises:
        ConfigError: a malformed URL, or redis-py missing.
        TierUnavailableError: Redis refused the credentials.

    An unreachable server is not an error: the tier warns once, answers misses, retries with
    backoff in the background of later calls, and resumes when the server is back.
    """

    name = "redis"

    def __init__(self, url: str, budget: int, *, prefix: str = "promptstore:", clock: Clock = time.time,
                 sizeof: SizeOf | None = None) -> None:
        super().__init__(budget, clock=clock, sizeof=sizeof)
        redis = _redis_module()
        parsed = urlparse(url) if isinstance(url, str) else None
        if parsed is None or parsed.scheme not in ("redis", "rediss", "unix") or (parsed.scheme != "unix" and not parsed.hostname):
            raise ConfigError(f"not a Redis URL: {url!r} (expected redis://host:port/db or rediss://...)")
        try:
            options = {"socket_connect_timeout": 2.0, "socket_timeout": 2.0}
            query = parsed.query or ""
            for name in list(options):
                if name in query:
                    del options[name]
            self._r = redis.Redis.from_url(url, **options)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"not a usable Redis URL: {url!r} ({exc})") from None
        self.url_display = f"{parsed.scheme}://{parsed.hostname}:{parsed.port or 6379}{parsed.path or ''}"
        self.prefix = prefix
        self._errors = (redis.ConnectionError, redis.TimeoutError, OSError)
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._failures = 0
        self._scripts = {name: self._r.register_script(src) for name, src in
                         (("commit", _COMMIT), ("hit", _HIT), ("delete", _DELETE), ("gc", _GC), ("drop", _DROP))}
        try:
            self._r.ping()
        except redis.AuthenticationError as exc:
            raise TierUnavailableError(f"Redis at {self.url_display} refused the credentials: {exc}") from None
        except redis.ResponseError as exc:
            if "WRONGPASS" in str(exc) or "NOAUTH" in str(exc):
                raise TierUnavailableError(f"Redis at {self.url_display} refused the credentials: {exc}") from None
            raise
        except self._errors as exc:
            self._went_down(exc)

    # -- availability ----------------------------------------------------------------------
    def _went_down(self, exc: BaseException) -> None:
        with self._lock:
            first = self._failures == 0
            delay = BACKOFF[min(self._failures, len(BACKOFF) - 1)]
            self._failures += 1
            self._down_until = time.monotonic() + delay
        if first:
            warnings.warn(f"redis tier at {self.url_display} is unreachable ({type(exc).__name__}: {exc}); serving from "
                          "the local tiers and retrying with backoff", PromptStoreWarning, stacklevel=4)

    def _call(self, fn: Callable[[], _T], default: _T) -> _T:
        """Run ``fn`` unless the server is known down; a connection fault is a miss, not an error."""
        if self._down_until and time.monotonic() < self._down_until:
            return default
        try:
            result = fn()
        except self._errors as exc:
            self._went_down(exc)
            return default
        if self._failures:
            with self._lock:
                self._failures, self._down_until = 0, 0.0
            log.warning("promptstore: redis tier at %s is reachable again", self.url_display)
        return result

    @property
    def available(self) -> bool:
        """Whether the last call reached the server."""
        return self._failures == 0

    # -- Tier ------------------------------------------------------------------------------
    def _k(self, *parts: str) -> str:
        return self.prefix + "".join(parts)

    def get(self, key: bytes, kind: str | None = None) -> Entry | None:
        hexkey = key.hex()
        now = self.clock()

        def run() -> Entry | None:
            reply = self._scripts["hit"](args=[self.prefix, hexkey, repr(now), INLINE_MAX, EXPIRY_GRACE_S])
            if reply is None:
                self._r.hincrby(self._k("c:", kind or "unknown"), "misses", 1)
                return None
            payload, inline, size, hits, created = reply
            blob = payload if int(inline) else self._read_chunks(payload, int(size))
            if blob is None or len(blob) != int(size):
                return None  # evicted between the script and the read
            try:
                entry = decode(blob, expect_key=key)
            except EntryVersionError:
                return None  # another release's entry: a miss, and left for that release
            except CorruptEntryError as exc:
                warnings.warn(f"redis tier: dropped corrupt entry {hexkey[:16]}… ({exc})", PromptStoreWarning, stacklevel=5)
                blob_key = payload if not int(inline) else self._r.hget(self._k("m:", hexkey), "blob")
                self._scripts["drop"](args=[self.prefix, hexkey, blob_key or b""])
                return None
            entry.hits, entry.created, entry.last_hit = int(hits), float(created), now
            return entry

        return self._call(run, None)

    def _read_chunks(self, blob_key: bytes, size: int) -> np.ndarray | None:
        buf = np.empty(size, dtype=np.uint8)
        pipe = self._r.pipeline(transaction=False)
        for start in range(0, size, CHUNK):
            pipe.getrange(blob_key, start, min(start + CHUNK, size) - 1)
        offset = 0
        for part in pipe.execute():
            if offset + len(part) > size:
                return None
            buf[offset : offset + len(part)] = np.frombuffer(part, dtype=np.uint8)
            offset += len(part)
        return buf if offset == size else None

    def peek(self, key: bytes) -> Entry | None:
        def run() -> Entry | None:
            f = self._r.hmget(self._k("m:", key.hex()), "blob", "len")
            if f[0] is None:
                return None
            blob = self._read_chunks(f[0], int(f[1]))
            if blob is None:
                return None
            try:
                return decode(blob, expect_key=key)
            except (CorruptEntryError, EntryVersionError):
                return None

        return self._call(run, None)

    def _version_of(self, key: bytes) -> EntryVersionError | None:
        """The version error of a stored entry of another format version, else None."""
        def run() -> EntryVersionError | None:
            f = self._r.hmget(self._k("m:", key.hex()), "blob", "len")
            blob = self._read_chunks(f[0], int(f[1])) if f[0] is not None else None
            try:
                if blob is not None:
                    decode(blob, expect_key=key, verify=False)
            except EntryVersionError as exc:
                return exc
            except CorruptEntryError:
                return None
            return None

        return self._call(run, None)

    def put(self, entry: Entry) -> bool:
        size = self.sizeof(entry)
        if not self.fits(entry, size):
            return False
        hexkey = entry.hex
        nonce = secrets.token_hex(6)
        staging, blob_key = self._k("t:", hexkey, ":", nonce), self._k("b:", hexkey, ":", nonce)
        data = memoryview(entry.blob).cast("B")

        def run() -> bool:
            pipe = self._r.pipeline(transaction=False)
            pipe.delete(staging)
            for start in range(0, max(data.nbytes, 1), CHUNK):
                pipe.append(staging, data[start : start + CHUNK])
            pipe.pexpire(staging, STAGING_TTL_MS)
            pipe.execute()
            ttl = "" if entry.ttl_s is None else repr(entry.ttl_s)
            kept, evicted, _ = self._scripts["commit"](args=[
                self.prefix, hexkey, blob_key, staging, size, repr(entry.cost_s), entry.kind, entry.namespace,
                entry.parent.hex() if entry.parent else "", ttl, repr(self.clock()), self.budget, EXPIRY_GRACE_S,
                data.nbytes, max(1, entry.hits)])
            self.evictions += int(evicted)
            return int(kept) == 1

        return bool(self._call(run, False))

    def delete(self, key: bytes) -> list[bytes]:
        empty: list[bytes] = []
        removed = self._call(lambda: self._scripts["delete"](args=[self.prefix, key.hex()]), empty)
        return [bytes.fromhex(h.decode()) for h in removed]

    def contains(self, key: bytes) -> str | None:
        f = self._call(lambda: self._r.hmget(self._k("m:", key.hex()), "expires", "ns"), [None, None])
        if f[1] is None or (f[0] and float(f[0]) <= self.clock()):
            return None
        return f[1].decode()

    def infos(self, kind: str | None = None) -> Iterator[EntryInfo]:
        def run() -> list[EntryInfo]:
            keys = list(self._r.scan_iter(match=self._k("m:*"), count=1000))
            pipe = self._r.pipeline(transaction=False)
            for k in keys:
                pipe.hgetall(k)
            out = []
            for k, m in zip(keys, pipe.execute(), strict=True):
                if not m or (kind is not None and m[b"kind"].decode() != kind):
                    continue
                parent = m[b"parent"].decode()
                out.append(EntryInfo(bytes.fromhex(k.decode()[len(self.prefix) + 2:]), m[b"kind"].decode(),
                                     int(m[b"size"]), float(m[b"cost"]), int(m[b"hits"]), float(m[b"created"]),
                                     float(m[b"last_hit"]), bytes.fromhex(parent) if parent else None,
                                     float(m[b"expires"]) if m[b"expires"] else None, m[b"ns"].decode(), self.name))
            return out

        none: list[EntryInfo] = []
        yield from self._call(run, none)

    def usage(self) -> dict[str, Any]:
        def run() -> dict[str, Any]:
            s = {k.decode(): v.decode() for k, v in self._r.hgetall(self._k("s")).items()}
            kinds = {}
            for ck in self._r.scan_iter(match=self._k("c:*"), count=1000):
                c = {k.decode(): float(v) for k, v in self._r.hgetall(ck).items()}
                kinds[ck.decode()[len(self.prefix) + 2:]] = {
                    "hits": int(c.get("hits", 0)), "misses": int(c.get("misses", 0)),
                    "hit_bytes": int(c.get("hit_bytes", 0)), "seconds_saved": c.get("saved_s", 0.0)}
            return {"entries": int(s.get("count", 0)), "bytes": int(s.get("used", 0)), "budget": self.budget,
                    "evictions": self.evictions, "url": self.url_display, "prefix": self.prefix, "available": True,
                    "lifetime": {"evictions": int(s.get("evictions", 0)), "expirations": int(s.get("expirations", 0)),
                                 "kinds": kinds}}

        return self._call(run, {"entries": 0, "bytes": 0, "budget": self.budget, "evictions": self.evictions,
                                "url": self.url_display, "prefix": self.prefix, "available": False})

    def verify(self, namespace: str | None = None) -> dict[str, Any]:
        problems: list[str] = []
        infos = list(self.infos())
        if not self.available:
            return {"tier": self.name, "checked": 0, "problems": ["unreachable"]}
        present = {i.key for i in infos}
        mine = [i for i in infos if namespace is None or i.namespace == namespace]
        versions = {"newer": 0, "older": 0}
        for info in mine:
            if info.parent is not None and info.parent not in present:
                problems.append(f"{info.hex}: its parent is gone (orphaned chain block)")
            e = self.peek(info.key)
            if e is None and (other := self._version_of(info.key)) is not None:
                versions["newer" if other.newer else "older"] += 1  # reported apart, never dropped
            elif e is None and self.contains(info.key) is not None:
                problems.append(f"{info.hex}: unreadable or corrupt")
                self.delete(info.key)
        if namespace is None:  # the tier's totals are everyone's: only the administrator's view checks them
            used = sum(i.size for i in infos)
            stats = self.usage()
            if stats["bytes"] != used:
                problems.append(f"byte count {stats['bytes']} != {used}")
            if used > self.budget:
                problems.append(f"{used} bytes stored over the {self.budget}-byte budget")
        return {"tier": self.name, "checked": len(mine), "problems": problems, "other_versions": versions}

    def gc(self, namespace: str | None = None) -> dict[str, Any]:
        if namespace is None:
            res = self._call(lambda: self._scripts["gc"](args=[self.prefix, repr(self.clock()), self.budget]), [0, 0])
            return {"tier": self.name, "expired": int(res[0]), "evicted": int(res[1])}
        now = self.clock()
        expired = [i.key for i in self.infos() if i.namespace == namespace and i.expires is not None and i.expires <= now]
        gone = {k for key in expired for k in self.delete(key)}
        return {"tier": self.name, "expired": len(gone), "evicted": 0}

    def close(self) -> None:
        try:
            self._r.close()
        except Exception:  # noqa: BLE001 - closing must not raise
            pass
