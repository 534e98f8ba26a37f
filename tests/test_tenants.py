"""Tenants apart in every operation, on every tier (issue #11).

Two stores share one folder (disk), one Redis (redis), or one process's memory tier (memory,
where the other tenant's entries are put into the tier directly, as a shared folder would
promote them). Every operation of ``north`` sees and touches only north's entries: get, ls,
stats, delete, export, import, verify, gc. The administrator's view is explicit.
"""

from __future__ import annotations

import numpy as np
import pytest

from promptstore import PromptStore
from promptstore.errors import BundleError

from conftest import FakeClock, make_entry

TIERS = ["memory", "disk", "redis", "redis cluster"]


@pytest.fixture(params=TIERS)
def tenants(request, tmp_path):
    clock = FakeClock()
    kw: dict = {"clock": clock}
    if request.param == "memory":
        kw.update(memory_bytes="16MiB", disk_bytes=0)
    elif request.param == "disk":
        kw.update(path=tmp_path / "shared", memory_bytes=0)
    else:  # one Redis server, or a 3-primary Redis Cluster (entries over 16 shards)
        url = request.getfixturevalue("redis_url" if request.param == "redis" else "cluster_url")
        kw.update(memory_bytes=0, disk_bytes=0, redis_url=url)
    north, south = PromptStore(namespace="north", **kw), PromptStore(namespace="south", **kw)
    keys = {}
    for store in (north, south):
        keys[store.namespace] = []
        for i in range(3):
            k = store.key("t", str(i))
            ttl = 10.0 if i == 2 else None  # one expiring entry each
            if request.param == "memory":  # one memory tier holds both tenants' entries
                north.tiers[0].put(make_entry(k, {"x": np.full(8, i, np.float32)}, kind="t", namespace=store.namespace,
                                              ttl_s=ttl))
            else:
                store.put(k, {"x": np.full(8, i, np.float32)}, kind="t", ttl_s=ttl)
            keys[store.namespace].append(k)
    yield north, south, keys, clock, request.param
    north.close()
    south.close()


def test_ls_stats_and_get_see_only_the_own_namespace(tenants):
    north, _, keys, _, _ = tenants
    assert {i.key for i in north.ls()} == set(keys["north"])
    assert {i.key for i in north.ls(all_namespaces=True)} == set(keys["north"]) | set(keys["south"])
    usage = next(iter(north.stats()["tiers"].values()))
    assert usage["entries"] == 3 and "lifetime" not in usage
    assert next(iter(north.stats(all_namespaces=True)["tiers"].values()))["entries"] == 6
    assert all(north.get(k) is None and k not in north for k in keys["south"])


def test_delete_never_touches_another_tenant(tenants):
    north, south, keys, _, tier = tenants
    victim = keys["south"][0]
    assert victim in {i.key for i in north.ls(all_namespaces=True)}  # seen in the administrator's view
    assert north.delete(victim) is False
    assert victim in {i.key for i in north.ls(all_namespaces=True)}
    if tier != "memory":
        assert south.get(victim) is not None
    assert north.delete(keys["north"][0]) is True


def test_verify_and_gc_act_on_the_own_namespace(tenants):
    north, _, keys, clock, _ = tenants
    assert north.verify()["checked"] == 3
    assert north.verify(all_namespaces=True)["checked"] == 6
    clock.advance(60)  # both tenants' expiring entries are now expired
    north.gc()
    remaining = {i.key for i in north.ls(all_namespaces=True)}
    assert keys["south"][2] in remaining  # south's expired entry is south's business
    assert keys["north"][2] not in remaining
    north.gc(all_namespaces=True)
    assert keys["south"][2] not in {i.key for i in north.ls(all_namespaces=True)}


def test_export_holds_only_the_own_namespace_and_imports_back(tenants, tmp_path):
    north, south, keys, _, tier = tenants
    if tier == "memory":
        pytest.skip("the memory tier's foreign entries have no other store to import into")
    bundle = tmp_path / "north.zip"
    assert north.export_bundle(bundle) == 3
    assert north.export_bundle(tmp_path / "none.zip", keys=[keys["south"][0]]) == 0
    with PromptStore(tmp_path / "elsewhere", namespace="north") as other:
        assert other.import_bundle(bundle) == 3
        assert {i.key for i in other.ls()} == set(keys["north"])
    assert north.import_bundle(bundle) == 3
    with pytest.raises(BundleError, match="namespace"):
        south.import_bundle(bundle)


def test_a_chain_never_crosses_tenants(tmp_path):
    with PromptStore(tmp_path / "s", memory_bytes=0, namespace="north") as north, \
            PromptStore(tmp_path / "s", memory_bytes=0, namespace="south") as south:
        root = south.key("llm.kv", "root")
        south.put(root, {"x": np.ones(4, np.float32)}, kind="llm.kv")
        child = north.key("llm.kv", "child")
        assert north.put(child, {"x": np.ones(4, np.float32)}, kind="llm.kv", parent=root) is False
        assert south.delete(root) and north.ls() == []
