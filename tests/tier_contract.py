"""The contract every tier passes: memory, disk, and Redis run this same suite.

A subclass provides ``make_tier(budget, clock, sizeof=None)``. Sizes can be injected
(``sizeof`` reads a fake size from the entry's metadata), so eviction cases with "4 MB"
entries run on a few bytes.
"""

from __future__ import annotations

import numpy as np
import pytest

from promptstore._tiers.base import Tier

from conftest import FakeClock, assert_same_tensors, key_of, make_entry

MB = 1024 * 1024


def fake_size(entry) -> int:
    return int(entry.meta.get("fake_size", entry.size))


class TierContract:
    """Behaviour shared by every tier."""

    def make_tier(self, budget: int, clock: FakeClock, sizeof=None) -> Tier:  # pragma: no cover
        raise NotImplementedError

    @pytest.fixture
    def tier(self, clock):
        t = self.make_tier(64 * MB, clock)
        yield t
        t.close()

    # -- basics ----------------------------------------------------------------------------
    def test_put_get_roundtrip(self, tier):
        tensors = {"a": np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32),
                   "b": np.arange(7, dtype=np.int64), "c": np.array(True)}
        e = make_entry(key_of(1), tensors, kind="k", cost_s=1.5, meta={"m": "v"})
        assert tier.put(e)
        got = tier.get(key_of(1))
        assert got is not None
        assert_same_tensors(got.tensors, tensors)
        assert (got.kind, got.cost_s, got.meta, got.parent) == ("k", 1.5, {"m": "v"}, None)
        assert got.size == e.size

    def test_get_into_writes_matching_tensors_into_strided_arrays(self, tier):
        rng = np.random.default_rng(1)
        k = rng.standard_normal((3, 2, 4, 5)).astype(np.float32)
        tensors = {"k": k, "ids": np.arange(4, dtype=np.int32), "h": k.astype(np.float16)}
        tier.put(make_entry(key_of(1), tensors, kind="kv", namespace="t"))
        big = np.zeros((3, 1, 2, 9, 5), np.float32)
        wrong = np.zeros((3, 2, 4, 5), np.float32)  # "h" is float16: not written, returned as usual
        got = tier.get_into(key_of(1), "kv", "t", {"k": big[:, 0, :, 2:6, :], "h": wrong})
        assert got is not None and np.array_equal(big[:, 0, :, 2:6, :], k)
        assert not big[:, :, :, :2].any() and not big[:, :, :, 6:].any() and not wrong.any()
        assert got.tensors["k"].base is not None and np.shares_memory(got.tensors["k"], big)
        assert_same_tensors({n: got.tensors[n] for n in ("ids", "h")}, {n: tensors[n] for n in ("ids", "h")})
        # Another namespace or kind is a miss that writes nothing.
        for kind, ns in (("kv", "other"), ("other", "t")):
            dst = np.zeros((3, 2, 4, 5), np.float32)
            got = tier.get_into(key_of(1), kind, ns, {"k": dst})
            assert (got is None or got.namespace != ns or got.kind != kind) and not dst.any()

    def test_missing_key_is_none(self, tier):
        assert tier.get(key_of("absent")) is None
        assert tier.peek(key_of("absent")) is None
        assert tier.contains(key_of("absent")) is None
        assert tier.delete(key_of("absent")) == []

    def test_returned_arrays_are_read_only(self, tier):
        tier.put(make_entry(key_of(1)))
        arr = tier.get(key_of(1)).tensors["x"]
        with pytest.raises(ValueError):
            arr[0] = 42.0

    def test_overwrite_replaces(self, tier):
        tier.put(make_entry(key_of(1), {"x": np.zeros(3, np.float32)}))
        tier.put(make_entry(key_of(1), {"x": np.ones(5, np.float32)}))
        assert tier.get(key_of(1)).tensors["x"].tolist() == [1.0] * 5
        assert tier.usage()["entries"] == 1
        assert tier.usage()["bytes"] == make_entry(key_of(1), {"x": np.ones(5, np.float32)}).size

    def test_contains_and_namespace(self, tier):
        tier.put(make_entry(key_of(1), namespace="tenant-a"))
        assert tier.contains(key_of(1)) == "tenant-a"
        assert tier.get(key_of(1)).namespace == "tenant-a"

    def test_peek_counts_no_hit(self, tier):
        tier.put(make_entry(key_of(1)))
        tier.peek(key_of(1))
        tier.peek(key_of(1))
        assert tier.get(key_of(1)).hits == 2  # the put counts as the first use

    def test_hits_count(self, tier):
        tier.put(make_entry(key_of(1)))
        for _ in range(4):
            e = tier.get(key_of(1))
        assert e.hits == 5
        info = {i.key: i for i in tier.infos()}[key_of(1)]
        assert info.hits == 5

    def test_delete_cascades_to_chained_entries(self, tier):
        a, b, c, other = key_of("a"), key_of("b"), key_of("c"), key_of("other")
        tier.put(make_entry(a))
        tier.put(make_entry(b, parent=a))
        tier.put(make_entry(c, parent=b))
        tier.put(make_entry(other))
        assert sorted(tier.delete(a)) == sorted([a, b, c])
        assert all(tier.get(k) is None for k in (a, b, c))
        assert tier.get(other) is not None
        assert tier.usage()["entries"] == 1

    def test_infos_filter_by_kind(self, tier):
        tier.put(make_entry(key_of(1), kind="vision.text"))
        tier.put(make_entry(key_of(2), kind="llm.kv"))
        assert [i.key for i in tier.infos("llm.kv")] == [key_of(2)]
        assert {i.kind for i in tier.infos()} == {"vision.text", "llm.kv"}

    def test_usage_counts_bytes(self, tier):
        es = [make_entry(key_of(i), {"x": np.zeros(i + 1, np.float32)}) for i in range(5)]
        for e in es:
            tier.put(e)
        u = tier.usage()
        assert u["entries"] == 5
        assert u["bytes"] == sum(e.size for e in es)

    # -- budget and eviction -----------------------------------------------------------------
    def test_budget_is_respected(self, clock):
        tier = self.make_tier(10_000, clock)
        for i in range(60):
            tier.put(make_entry(key_of(i), {"x": np.full(200, i, np.float32)}))
            assert tier.usage()["bytes"] <= 10_000
        assert tier.usage()["evictions"] > 0
        tier.close()

    def test_entry_larger_than_budget_is_refused_without_evicting(self, clock):
        from promptstore.errors import PromptStoreWarning

        tier = self.make_tier(5_000, clock)
        tier.put(make_entry(key_of("small")))
        with pytest.warns(PromptStoreWarning, match="exceeds the tier budget"):
            assert not tier.put(make_entry(key_of("huge"), {"x": np.zeros(10_000, np.float32)}))
        assert tier.get(key_of("small")) is not None
        assert tier.get(key_of("huge")) is None
        tier.close()

    def test_costly_small_entry_survives_flood_of_cheap_large_ones(self, clock):
        """GDSF: 8 KB that cost 2 s outlives 4 MB entries that cost 0.01 s (LRU would not)."""
        tier = self.make_tier(64 * MB, clock, sizeof=fake_size)
        precious = key_of("precious")
        tier.put(make_entry(precious, cost_s=2.0, meta={"fake_size": str(8 * 1024)}))
        for i in range(200):  # 800 MB of flood through a 64 MB tier
            clock.advance(1.0)
            tier.put(make_entry(key_of(f"flood{i}"), cost_s=0.01, meta={"fake_size": str(4 * MB)}))
            assert tier.usage()["bytes"] <= 64 * MB
        assert tier.get(precious) is not None
        assert tier.get(key_of("flood0")) is None  # the flood itself churned
        assert tier.get(key_of("flood199")) is not None
        tier.close()

    def test_lru_order_among_equal_value_entries(self, clock):
        """With equal cost and size, a hit entry outlives one never hit again."""
        tier = self.make_tier(10 * MB, clock, sizeof=fake_size)
        for i in range(10):
            tier.put(make_entry(key_of(i), cost_s=0.1, meta={"fake_size": str(MB)}))
        for _ in range(3):
            tier.get(key_of(0))
        tier.put(make_entry(key_of("new"), cost_s=0.1, meta={"fake_size": str(MB)}))
        assert tier.get(key_of(0)) is not None
        assert sum(tier.get(key_of(i)) is None for i in range(1, 10)) == 1
        tier.close()

    def test_parent_never_evicted_before_children(self, clock):
        tier = self.make_tier(10 * MB, clock, sizeof=fake_size)
        chain = [key_of(f"block{i}") for i in range(5)]
        # Cheap blocks (cost 0) that would be the first victims if they were leaves.
        for i, k in enumerate(chain):
            tier.put(make_entry(k, cost_s=0.0, parent=chain[i - 1] if i else None, meta={"fake_size": str(MB)}))
        for i in range(30):
            tier.put(make_entry(key_of(f"costly{i}"), cost_s=5.0, meta={"fake_size": str(MB)}))
            present = [tier.contains(k) is not None for k in chain]
            # What is left of the chain is always a prefix: leaves went first.
            assert present == sorted(present, reverse=True), present
        assert not any(tier.contains(k) is not None for k in chain)
        tier.close()

    def test_inserting_a_child_never_evicts_its_parent(self, clock):
        tier = self.make_tier(2 * MB, clock, sizeof=fake_size)
        tier.put(make_entry(key_of("p"), meta={"fake_size": str(MB)}))
        tier.put(make_entry(key_of("c"), parent=key_of("p"), meta={"fake_size": str(MB)}))
        tier.put(make_entry(key_of("x"), cost_s=100.0, meta={"fake_size": str(MB // 2)}))
        # Room for x had to come from the chain's leaf, and the chain stays a prefix.
        assert tier.contains(key_of("p")) is not None
        assert tier.contains(key_of("c")) is None
        assert tier.get(key_of("x")) is not None
        tier.close()

    def test_budget_holds_when_only_a_chain_is_left(self, clock):
        tier = self.make_tier(3 * MB, clock, sizeof=fake_size)
        tier.put(make_entry(key_of("p"), cost_s=9.0, meta={"fake_size": str(2 * MB)}))
        # The child cannot make room by evicting its own parent, so it goes itself.
        assert not tier.put(make_entry(key_of("c"), parent=key_of("p"), meta={"fake_size": str(2 * MB)}))
        assert tier.usage()["bytes"] <= 3 * MB
        assert tier.contains(key_of("p")) is not None
        tier.close()

    # -- TTL -----------------------------------------------------------------------------------
    def test_ttl_expires(self, clock):
        tier = self.make_tier(MB, clock)
        tier.put(make_entry(key_of(1), ttl_s=10.0))
        tier.put(make_entry(key_of(2)))
        clock.advance(9.0)
        assert tier.contains(key_of(1)) is not None
        clock.advance(2.0)
        assert tier.get(key_of(1)) is None
        assert tier.contains(key_of(1)) is None
        assert tier.get(key_of(2)) is not None
        tier.close()

    def test_ttl_refreshed_on_hit(self, clock):
        tier = self.make_tier(MB, clock)
        tier.put(make_entry(key_of(1), ttl_s=10.0))
        for _ in range(5):
            clock.advance(8.0)
            assert tier.get(key_of(1)) is not None  # 40 s in, alive: each hit refreshed it
        clock.advance(10.5)
        assert tier.get(key_of(1)) is None
        tier.close()

    def test_expired_entries_go_first_and_gc_drops_them(self, clock):
        tier = self.make_tier(MB, clock)
        tier.put(make_entry(key_of("short"), ttl_s=1.0))
        tier.put(make_entry(key_of("long")))
        clock.advance(5.0)
        tier.gc()
        assert tier.usage()["entries"] == 1
        assert tier.get(key_of("long")) is not None
        tier.close()

    def test_misses_are_counted_under_the_askers_kind_an_expired_entry_too(self, clock):
        tier = self.make_tier(MB, clock)
        if "lifetime" not in tier.usage():
            tier.close()
            pytest.skip("this tier keeps no lifetime counts (the store counts its process's misses)")
        tier.put(make_entry(key_of("short"), ttl_s=1.0, kind="k"))
        assert tier.get(key_of("nope"), kind="k") is None
        assert tier.get(key_of("nope")) is None
        clock.advance(5.0)
        assert tier.get(key_of("short"), kind="other") is None  # expired: a miss of the kind asked for
        tier.put(make_entry(key_of("flush")))  # the disk tier writes its counts with a write
        kinds = tier.usage()["lifetime"]["kinds"]
        assert kinds["k"]["misses"] == 1 and kinds["unknown"]["misses"] == 1 and kinds["other"]["misses"] == 1
        assert sum(k.get("hits", 0) for k in kinds.values()) == 0
        tier.close()
