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
on its way.

**Shards.** On a Redis Cluster the tier spreads entries over ``CLUSTER_SHARDS`` virtual shards,
by their key: every key of shard ``n`` carries the hash tag ``{<prefix><n>}``, so each shard
lives in one hash slot and every script touches one slot only, atomic there as on one server.
Each shard holds its entries, its part of the index (``leaves``, ``expiry``, ``k:``), its
counters and its share of the budget. GDSF orders the entries of a shard as one server orders
all of its own; across shards there is no single order: each evicts its least valuable leaf
when it is full, so the entries the whole cluster evicts are each shard's, not the cluster's,
least valuable. A chain may cross shards: a child in another shard than its parent is linked
(``k:<parent>``, in the parent's shard) by a second script right after its commit, which
refuses, and the client deletes the child, if the parent is gone by then; removals that reach
another shard (a cascade to a child there, a parent's ``k:`` there) are done by the client,
shard by shard, after the script. A client that dies in between leaves at worst a child whose
parent is gone (a leaf, evicted in its turn) or a parent that waits for a child already gone
(``gc`` repairs it). A standalone server has one shard and no hash tag: the layout of earlier
releases, unchanged.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from functools import partial
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
CLUSTER_SHARDS = 16  # virtual shards of a store on a Redis Cluster (hash slots, spread over its primaries)

# Shared by every script. The priority formula is _policy.priority; the victim loop is
# _policy.make_room, here run inside Redis so that it is atomic across clients.
_PRELUDE = r"""
local COST_FLOOR = """ + repr(_policy.COST_FLOOR_S) + r"""
local P = ARGV[1]
local S = P .. "s"
local function num(x) return tonumber(x) or 0 end
-- The last two arguments of every script: the number of shards and this script's shard.
local SHARDS, ME = num(ARGV[#ARGV - 1]), num(ARGV[#ARGV])
local function here(hex) return SHARDS <= 1 or tonumber(string.sub(hex, 1, 8), 16) % SHARDS == ME end
-- What the client must do in other shards after this script: "d:<hex>" delete (a cascade),
-- "u:<parent>:<child>" drop a child from its parent's k: set.
local XS = {}
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
    for _, c in ipairs(redis.call("SMEMBERS", P .. "k:" .. h)) do
      if here(c) then table.insert(stack, c) else table.insert(XS, "d:" .. c) end
    end
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
        if here(parent) then
          redis.call("SREM", P .. "k:" .. parent, h)
          if redis.call("SCARD", P .. "k:" .. parent) == 0 then leaf_add(parent) end
        else
          table.insert(XS, "u:" .. parent .. ":" .. h)
        end
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

# Every script's ARGV ends with: shards, this shard (see _PRELUDE).
# ARGV: prefix, hex, blob_key, staging_key, size, cost, kind, namespace, parent, ttl, now, budget, grace, length, hits
_COMMIT = _PRELUDE + r"""
local hex, blob, staging = ARGV[2], ARGV[3], ARGV[4]
local size, cost, now, budget = num(ARGV[5]), num(ARGV[6]), num(ARGV[11]), num(ARGV[12])
local kind, ns, parent, ttl = ARGV[7], ARGV[8], ARGV[9], ARGV[10]
if redis.call("EXISTS", staging) == 0 then return {-1, 0, 0, XS} end
if parent ~= "" and here(parent) and redis.call("EXISTS", P .. "m:" .. parent) == 0 then
  -- Its parent was evicted by another client since this one looked: storing the block
  -- now would leave it unreachable. Atomic here, so no orphan can ever be committed.
  -- (A parent in another shard is checked when the child is linked to it, just after.)
  redis.call("DEL", staging)
  return {0, 0, 0, XS}
end
local m = P .. "m:" .. hex
local old = redis.call("HMGET", m, "blob", "size", "parent")
if old[2] then
  redis.call("DEL", old[1])
  redis.call("HINCRBY", S, "used", -num(old[2]))
  redis.call("HINCRBY", S, "count", -1)
  if old[3] and old[3] ~= "" and old[3] ~= parent then
    if here(old[3]) then
      redis.call("SREM", P .. "k:" .. old[3], hex)
      if redis.call("SCARD", P .. "k:" .. old[3]) == 0 then leaf_add(old[3]) end
    else
      table.insert(XS, "u:" .. old[3] .. ":" .. hex)
    end
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
if parent ~= "" and here(parent) then
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
return {kept, #evicted, #expired, XS}
"""

# ARGV: prefix, parent, child. In the parent's shard: chain a child committed in another shard,
# unless the parent is gone (then the client deletes the child: it could never be reached).
_LINK = _PRELUDE + r"""
local parent = ARGV[2]
if redis.call("EXISTS", P .. "m:" .. parent) == 0 then return 0 end
redis.call("SADD", P .. "k:" .. parent, ARGV[3])
leaf_del(parent)
return 1
"""

# ARGV: prefix, parent, child. In the parent's shard: a child in another shard is gone.
_UNLINK = _PRELUDE + r"""
local parent = ARGV[2]
redis.call("SREM", P .. "k:" .. parent, ARGV[3])
if redis.call("SCARD", P .. "k:" .. parent) == 0 then leaf_add(parent) end
return 1
"""

# ARGV: prefix, hex, now, inline_max, grace, the asker's kind (a miss is counted under it). Returns nil, or
# {bytes_or_blob_key, inline(0/1; 2: expired), size, hits, created, XS}
_HIT = _PRELUDE + r"""
local hex, now = ARGV[2], num(ARGV[3])
local m = P .. "m:" .. hex
local f = redis.call("HMGET", m, "blob", "size", "ttl", "expires", "hits", "cost", "created", "kind", "len")
if not f[1] then
  redis.call("HINCRBY", P .. "c:" .. ARGV[6], "misses", 1)
  return nil
end
if f[4] and f[4] ~= "" and num(f[4]) <= now then
  local removed = {}
  remove_tree(hex, removed)
  redis.call("HINCRBY", S, "expirations", #removed)
  redis.call("HINCRBY", P .. "c:" .. ARGV[6], "misses", 1)
  return {"", 2, 0, 0, 0, XS}
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
  return {redis.call("GET", f[1]) or "", 1, length, hits, f[7], XS}
end
return {f[1], 0, length, hits, f[7], XS}
"""

# ARGV: prefix, hex
_DELETE = _PRELUDE + r"""
local removed = {}
remove_tree(ARGV[2], removed)
return {removed, XS}
"""

# ARGV: prefix, now, budget
_GC = _PRELUDE + r"""
local expired, evicted = make_room(num(ARGV[3]), num(ARGV[2]), nil)
return {#expired, #evicted, XS}
"""

# ARGV: prefix, hex (a corrupt entry: drop it only if it still holds the blob we read)
_DROP = _PRELUDE + r"""
if redis.call("HGET", P .. "m:" .. ARGV[2], "blob") ~= ARGV[3] then return {0, XS} end
local removed = {}
remove_tree(ARGV[2], removed)
return {#removed, XS}
"""


def _redis_module() -> Any:
    try:
        import redis
    except ImportError:
        raise ConfigError('the Redis tier needs redis-py: pip install "promptstore[redis]"') from None
    return redis


_SCRIPTS = (("commit", _COMMIT), ("hit", _HIT), ("delete", _DELETE), ("gc", _GC), ("drop", _DROP),
            ("link", _LINK), ("unlink", _UNLINK))


class RedisTier(Tier):
    """Entries in a Redis server or a Redis Cluster, shared by every host that points at it.

    Args:
        url: ``redis://[user:password@]host:port/db`` or ``rediss://...`` (TLS). Query
            parameters go to redis-py (e.g. ``?socket_timeout=5``); the connect and socket
            timeouts default to 2 s. A node of a Redis Cluster is found to be one, and the
            tier then spreads its entries over the cluster (see the module's notes on shards);
            ``redis+cluster://`` / ``rediss+cluster://`` name a cluster explicitly, so that a
            node that is down when the tier starts is not taken for a standalone server.
        budget: bytes this tier may hold in Redis (on a cluster: in all, each shard holding
            an equal share; an entry larger than a share is not stored there).
        prefix: key prefix, so several stores can share one Redis.
        shards: virtual shards (default: 1 on a standalone server, ``CLUSTER_SHARDS`` on a
            cluster). Part of the layout: every client of one prefix must use the same.

    Raises:
        ConfigError: a malformed URL, or redis-py missing.
        TierUnavailableError: Redis refused the credentials.

    An unreachable server is not an error: the tier warns once, answers misses, retries with
    backoff in the background of later calls, and resumes when the server is back. On a
    cluster this holds per shard: a node that is down makes its shards' entries misses (one
    warning), while the other shards go on.
    """

    name = "redis"

    def __init__(self, url: str, budget: int, *, prefix: str = "promptstore:", clock: Clock = time.time,
                 sizeof: SizeOf | None = None, shards: int | None = None) -> None:
        super().__init__(budget, clock=clock, sizeof=sizeof)
        redis = _redis_module()
        from redis.exceptions import ClusterError, RedisClusterException, TryAgainError

        parsed = urlparse(url) if isinstance(url, str) else None
        schemes = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
        if parsed is None or parsed.scheme not in schemes or (parsed.scheme != "unix" and not parsed.hostname):
            raise ConfigError(f"not a Redis URL: {url!r} (expected redis://host:port/db, rediss://... or "
                              "redis+cluster://host:port)")
        options = {"socket_connect_timeout": 2.0, "socket_timeout": 2.0}
        for name in list(options):
            if name in (parsed.query or ""):
                del options[name]
        cluster = parsed.scheme.endswith("+cluster")
        plain_url = url.replace("+cluster://", "://", 1) if cluster else url
        self._errors: tuple[type[BaseException], ...] = (redis.ConnectionError, redis.TimeoutError, OSError,
                                                         ClusterError, RedisClusterException, TryAgainError)
        self.url_display = f"{parsed.scheme}://{parsed.hostname}:{parsed.port or 6379}{parsed.path or ''}"
        self.prefix = prefix
        self._lock = threading.Lock()
        try:
            self._r = redis.Redis.from_url(plain_url, **options)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"not a usable Redis URL: {url!r} ({exc})") from None
        down: BaseException | None = None
        try:
            self._r.ping()
            cluster = cluster or self._is_cluster_node()
        except redis.AuthenticationError as exc:
            raise TierUnavailableError(f"Redis at {self.url_display} refused the credentials: {exc}") from None
        except redis.ResponseError as exc:
            if "WRONGPASS" in str(exc) or "NOAUTH" in str(exc):
                raise TierUnavailableError(f"Redis at {self.url_display} refused the credentials: {exc}") from None
            raise
        except self._errors as exc:
            down = exc
        if cluster:
            from redis.backoff import ExponentialBackoff
            from redis.cluster import RedisCluster
            from redis.retry import Retry

            self._r.close()
            try:
                # Few retries inside redis-py: a shard whose node is down is this tier's to back off from.
                retry = Retry(ExponentialBackoff(cap=0.5, base=0.05), 2)
                self._r = RedisCluster.from_url(plain_url, retry=retry, **options)
                down = None
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"not a usable Redis Cluster URL: {url!r} ({exc})") from None
            except self._errors as exc:
                # No node answered: nothing to shard over yet. A cluster must be up when the tier starts.
                raise TierUnavailableError(f"no node of the Redis Cluster at {self.url_display} answered: "
                                           f"{type(exc).__name__}: {exc}") from None
        self.cluster = cluster
        if shards is not None and (isinstance(shards, bool) or not isinstance(shards, int) or shards < 1):
            raise ConfigError(f"shards must be a positive int, got {shards!r}")
        # Every client of one prefix must use the same number: it is part of the layout.
        self.shards = shards if shards is not None else CLUSTER_SHARDS if cluster else 1
        # Hash tags on a cluster even for one shard: a script's keys must share a slot.
        self._tagged = cluster or self.shards > 1
        self._down_until = [0.0] * self.shards  # per shard: backing off until (monotonic)
        self._failures = [0] * self.shards
        self._scripts = {name: (hashlib.sha1(src.encode()).hexdigest(), src) for name, src in _SCRIPTS}
        self._no_script = redis.exceptions.NoScriptError
        if down is not None:
            self._went_down(down, 0)

    def _is_cluster_node(self) -> bool:
        """Whether the server is a Redis Cluster node (a user whose ACL forbids INFO: taken as not)."""
        redis = _redis_module()
        try:
            return bool(int(self._r.info("cluster").get("cluster_enabled", 0)))
        except redis.ResponseError:
            return False

    # -- shards ----------------------------------------------------------------------------
    def _shard(self, hexkey: str) -> int:
        return int(hexkey[:8], 16) % self.shards if self.shards > 1 else 0

    def _sp(self, shard: int) -> str:
        """Shard ``shard``'s key prefix: its hash tag puts all its keys in one slot."""
        return f"{self.prefix}{{{self.prefix}{shard}}}" if self._tagged else self.prefix

    def _k(self, shard: int, *parts: str) -> str:
        return self._sp(shard) + "".join(parts)

    def _run(self, script: str, shard: int, *args: Any) -> Any:
        """A script, in the shard's slot. Loaded on its node by EVAL when that node lacks it: redis-py's
        Script would load it on every primary, and one primary down would then fail every shard."""
        sha, src = self._scripts[script]
        argv = (self._k(shard, "s"), self._sp(shard), *args, self.shards, shard)
        try:
            return self._r.evalsha(sha, 1, *argv)
        except self._no_script:
            return self._r.eval(src, 1, *argv)

    def _pattern(self, part: str) -> str:
        return f"{self.prefix}{{{self.prefix}*}}{part}" if self._tagged else self._k(0, part)

    def _split(self, key: str) -> tuple[int, str]:
        """A key of this tier as (its shard, what follows the shard's prefix)."""
        rest = key[len(self.prefix):]
        if not self._tagged:
            return 0, rest
        tag, _, after = rest[1 + len(self.prefix):].partition("}")
        return int(tag), after

    def _shard_of_key(self, key: bytes) -> int:
        """The shard a key of this tier lives in (from its hash tag)."""
        return self._split(key.decode())[0]

    def _unshard(self, key: str) -> str:
        """What follows a key's shard prefix."""
        return self._split(key)[1]

    def _scan(self, part: str) -> list[bytes]:
        """Keys matching ``part`` in every shard that answers (on a cluster, node by node: one down
        hides only its own shards' keys)."""
        if not self.cluster:
            return list(self._r.scan_iter(match=self._pattern(part), count=1000))
        found: list[bytes] = []
        for node in self._r.get_primaries():
            try:
                found.extend(self._r.scan_iter(match=self._pattern(part), count=1000, target_nodes=node))
            except self._errors:
                continue
        return found

    def _follow(self, todo: list[Any], removed: list[bytes] | None = None) -> None:
        """Do in their shards what scripts left to the client (see XS in _PRELUDE)."""
        queue = [t.decode() if isinstance(t, bytes) else t for t in todo]
        while queue:
            item = queue.pop()
            if item.startswith("d:"):
                hexkey = item[2:]
                shard = self._shard(hexkey)
                res = self._call(partial(self._run, "delete", shard, hexkey), None, shard)
                if res is not None:
                    if removed is not None:
                        removed.extend(bytes.fromhex(h.decode()) for h in res[0])
                    queue.extend(t.decode() for t in res[1])
            else:
                parent, child = item[2:].split(":")
                shard = self._shard(parent)
                self._call(partial(self._run, "unlink", shard, parent, child), None, shard)

    def _across(self, fn: Callable[[], _T], default: _T) -> _T:
        """Run ``fn``, which reads every shard: on a cluster a node that is down only hides its own
        shards (``_scan`` skips it), and a fault midway is the default, with no shard marked down."""
        if not self.cluster:
            return self._call(fn, default)
        try:
            return fn()
        except self._errors:
            return default

    # -- availability ----------------------------------------------------------------------
    def _went_down(self, exc: BaseException, shard: int) -> None:
        with self._lock:
            first = not any(self._failures)
            self._down_until[shard] = time.monotonic() + BACKOFF[min(self._failures[shard], len(BACKOFF) - 1)]
            self._failures[shard] += 1
        if first:
            what = ("a node of the cluster is unreachable", "its shards' entries are misses, the others' go on") \
                if self.cluster else ("is unreachable", "serving from the local tiers")
            warnings.warn(f"redis tier at {self.url_display} {what[0]} ({type(exc).__name__}: {exc}); {what[1]}, "
                          "retrying with backoff", PromptStoreWarning, stacklevel=4)

    def _call(self, fn: Callable[[], _T], default: _T, shard: int = 0) -> _T:
        """Run ``fn`` unless its shard is known down; a connection fault is a miss, not an error."""
        until = self._down_until[shard]
        if until and time.monotonic() < until:
            return default
        try:
            result = fn()
        except self._errors as exc:
            self._went_down(exc, shard)
            return default
        if self._failures[shard]:
            with self._lock:
                self._down_until[shard], self._failures[shard] = 0.0, 0
                back = not any(self._failures)
            if back:
                log.warning("promptstore: redis tier at %s is reachable again", self.url_display)
        return result

    @property
    def available(self) -> bool:
        """Whether the last call to every shard reached it."""
        return not any(self._failures)

    # -- Tier ------------------------------------------------------------------------------
    def get(self, key: bytes, kind: str | None = None) -> Entry | None:
        hexkey = key.hex()
        shard = self._shard(hexkey)
        now = self.clock()

        def run() -> Entry | None:
            # A miss is counted by the script, in the same round trip.
            reply = self._run("hit", shard, hexkey, repr(now), INLINE_MAX, EXPIRY_GRACE_S, kind or "unknown")
            if reply is not None and int(reply[1]) == 2:  # expired just now
                self._follow(reply[5])
                reply = None
            if reply is None:
                return None
            payload, inline, size, hits, created, _ = reply
            blob = payload if int(inline) else self._read_chunks(payload, int(size))
            if blob is None or len(blob) != int(size):
                return None  # evicted between the script and the read
            try:
                entry = decode(blob, expect_key=key)
            except EntryVersionError:
                return None  # another release's entry: a miss, and left for that release
            except CorruptEntryError as exc:
                warnings.warn(f"redis tier: dropped corrupt entry {hexkey[:16]}… ({exc})", PromptStoreWarning, stacklevel=5)
                blob_key = payload if not int(inline) else self._r.hget(self._k(shard, "m:", hexkey), "blob")
                self._follow(self._run("drop", shard, hexkey, blob_key or b"")[1])
                return None
            entry.hits, entry.created, entry.last_hit = int(hits), float(created), now
            return entry

        return self._call(run, None, shard)

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

    def _stored_blob(self, key: bytes) -> np.ndarray | None:
        hexkey = key.hex()
        f = self._r.hmget(self._k(self._shard(hexkey), "m:", hexkey), "blob", "len")
        return self._read_chunks(f[0], int(f[1])) if f[0] is not None else None

    def peek(self, key: bytes) -> Entry | None:
        def run() -> Entry | None:
            blob = self._stored_blob(key)
            if blob is None:
                return None
            try:
                return decode(blob, expect_key=key)
            except (CorruptEntryError, EntryVersionError):
                return None

        return self._call(run, None, self._shard(key.hex()))

    def _version_of(self, key: bytes) -> EntryVersionError | None:
        """The version error of a stored entry of another format version, else None."""
        def run() -> EntryVersionError | None:
            blob = self._stored_blob(key)
            try:
                if blob is not None:
                    decode(blob, expect_key=key, verify=False)
            except EntryVersionError as exc:
                return exc
            except CorruptEntryError:
                return None
            return None

        return self._call(run, None, self._shard(key.hex()))

    @property
    def shard_budget(self) -> int:
        """Bytes each shard may hold: the budget's equal share."""
        return self.budget // self.shards

    def fits(self, entry: Entry, size: int) -> bool:
        if not super().fits(entry, size):
            return False
        if size <= self.shard_budget:
            return True
        warnings.warn(f"redis tier: entry {entry.hex[:16]}… ({size} bytes) exceeds the tier budget's share of one "
                      f"shard ({self.shard_budget} of {self.budget} bytes over {self.shards} shards); not stored in "
                      "this tier", PromptStoreWarning, stacklevel=4)
        return False

    def put(self, entry: Entry) -> bool:
        size = self.sizeof(entry)
        if not self.fits(entry, size):
            return False
        hexkey = entry.hex
        shard = self._shard(hexkey)
        parent = entry.parent.hex() if entry.parent else ""
        nonce = secrets.token_hex(6)
        staging, blob_key = self._k(shard, "t:", hexkey, ":", nonce), self._k(shard, "b:", hexkey, ":", nonce)
        data = memoryview(entry.blob).cast("B")

        def run() -> bool:
            pipe = self._r.pipeline(transaction=False)
            pipe.delete(staging)
            for start in range(0, max(data.nbytes, 1), CHUNK):
                pipe.append(staging, data[start : start + CHUNK])
            pipe.pexpire(staging, STAGING_TTL_MS)
            pipe.execute()
            ttl = "" if entry.ttl_s is None else repr(entry.ttl_s)
            kept, evicted, _, todo = self._run(
                "commit", shard, hexkey, blob_key, staging, size, repr(entry.cost_s), entry.kind, entry.namespace,
                parent, ttl, repr(self.clock()), self.shard_budget, EXPIRY_GRACE_S, data.nbytes, max(1, entry.hits))
            self.evictions += int(evicted)
            self._follow(todo)
            return int(kept) == 1

        if not self._call(run, False, shard):
            return False
        if parent and self._shard(parent) != shard:
            pshard = self._shard(parent)
            if not self._call(lambda: self._run("link", pshard, parent, hexkey), 0, pshard):
                self.delete(entry.key)  # its parent is gone (or unreachable): it could never be reached
                return False
        return True

    def delete(self, key: bytes) -> list[bytes]:
        hexkey = key.hex()
        removed: list[bytes] = []
        self._follow(["d:" + hexkey], removed)
        return removed

    def contains(self, key: bytes) -> str | None:
        hexkey = key.hex()
        shard = self._shard(hexkey)
        f = self._call(lambda: self._r.hmget(self._k(shard, "m:", hexkey), "expires", "ns"), [None, None], shard)
        if f[1] is None or (f[0] and float(f[0]) <= self.clock()):
            return None
        return f[1].decode()

    def infos(self, kind: str | None = None) -> Iterator[EntryInfo]:
        def run() -> list[EntryInfo]:
            keys = self._scan("m:*")
            pipe = self._r.pipeline(transaction=False)
            for k in keys:
                pipe.hgetall(k)
            out = []
            for k, m in zip(keys, pipe.execute(), strict=True):
                if not m or (kind is not None and m[b"kind"].decode() != kind):
                    continue
                parent = m[b"parent"].decode()
                out.append(EntryInfo(bytes.fromhex(k.decode()[-64:]), m[b"kind"].decode(),
                                     int(m[b"size"]), float(m[b"cost"]), int(m[b"hits"]), float(m[b"created"]),
                                     float(m[b"last_hit"]), bytes.fromhex(parent) if parent else None,
                                     float(m[b"expires"]) if m[b"expires"] else None, m[b"ns"].decode(), self.name))
            return out

        none: list[EntryInfo] = []
        yield from self._across(run, none)

    def _hash(self, key: str | bytes) -> dict[bytes, bytes]:
        return dict(self._r.hgetall(key))

    def usage(self) -> dict[str, Any]:
        def run() -> dict[str, Any]:
            totals: dict[str, float] = {}
            none: dict[bytes, bytes] = {}
            for shard in range(self.shards):
                for k, v in self._call(partial(self._hash, self._k(shard, "s")), none, shard).items():
                    totals[k.decode()] = totals.get(k.decode(), 0.0) + float(v)
            kinds: dict[str, dict[str, Any]] = {}
            for ck in self._scan("c:*"):
                c = {k.decode(): float(v)
                     for k, v in self._call(partial(self._hash, ck), none, self._shard_of_key(ck)).items()}
                row = kinds.setdefault(self._unshard(ck.decode())[2:],
                                       {"hits": 0, "misses": 0, "hit_bytes": 0, "seconds_saved": 0.0})
                row["hits"] += int(c.get("hits", 0))
                row["misses"] += int(c.get("misses", 0))
                row["hit_bytes"] += int(c.get("hit_bytes", 0))
                row["seconds_saved"] += c.get("saved_s", 0.0)
            return {"entries": int(totals.get("count", 0)), "bytes": int(totals.get("used", 0)),
                    "budget": self.budget, "evictions": self.evictions, "url": self.url_display,
                    "prefix": self.prefix, "available": self.available, "shards": self.shards,
                    "lifetime": {"evictions": int(totals.get("evictions", 0)),
                                 "expirations": int(totals.get("expirations", 0)), "kinds": kinds}}

        down = {"entries": 0, "bytes": 0, "budget": self.budget, "evictions": self.evictions,
                "url": self.url_display, "prefix": self.prefix, "available": False, "shards": self.shards}
        return run() if self.cluster else self._call(run, down)

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
            expired = evicted = 0
            for shard in range(self.shards):
                res = self._call(partial(self._run, "gc", shard, repr(self.clock()), self.shard_budget), None, shard)
                if res is not None:
                    expired, evicted = expired + int(res[0]), evicted + int(res[1])
                    self._follow(res[2])
            if self.shards > 1:
                self._across(self._relink, None)
            return {"tier": self.name, "expired": expired, "evicted": evicted}
        now = self.clock()
        expired_keys = [i.key for i in self.infos()
                        if i.namespace == namespace and i.expires is not None and i.expires <= now]
        gone = {k for key in expired_keys for k in self.delete(key)}
        return {"tier": self.name, "expired": len(gone), "evicted": 0}

    def _relink(self) -> None:
        """Drop from parents' k: sets the children in other shards that are gone: what a client that
        died between a removal and its follow-up left behind (the parent would never become a leaf)."""
        for kids_key in self._scan("k:*"):
            parent = kids_key.decode()[-64:]
            for child in self._r.smembers(kids_key):
                hexkey = child.decode()
                if self._shard(hexkey) != self._shard(parent) and not self._r.exists(self._k(self._shard(hexkey),
                                                                                            "m:", hexkey)):
                    self._follow([f"u:{parent}:{hexkey}"])

    def close(self) -> None:
        try:
            self._r.close()
        except Exception:  # noqa: BLE001 - closing must not raise
            pass
