"""The Redis tier, against a real redis-server started by the tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
import warnings

import numpy as np
import pytest
from test_stateful import StoreVsDict

from promptstore import PromptStore
from promptstore._tiers.redis import RedisTier
from promptstore.errors import ConfigError, PromptStoreWarning, TierUnavailableError

from conftest import RedisServer, assert_same_tensors, key_of, make_entry, run_python
from tier_contract import TierContract


class TestRedisTier(TierContract):
    @pytest.fixture(autouse=True)
    def _server(self, redis_url):
        self.url = redis_url

    def make_tier(self, budget, clock, sizeof=None):
        return RedisTier(self.url, budget, prefix=f"t{uuid.uuid4().hex[:8]}:", clock=clock, sizeof=sizeof)


def arr(i: int, n: int = 64) -> np.ndarray:
    return np.random.default_rng(i).standard_normal(n).astype(np.float32)


def test_three_tiers_read_through_and_promote(tmp_path, redis_url):
    with PromptStore(tmp_path / "a", redis_url=redis_url) as a, PromptStore(tmp_path / "b", redis_url=redis_url) as b:
        k = a.key("t", "shared")
        a.put(k, {"x": arr(1)}, kind="t", cost_s=0.5)
        e = b.get(k)  # b's memory and disk miss; Redis has it
        assert_same_tensors(e.tensors, {"x": arr(1)})
        assert b.stats()["kinds"]["t"]["tiers"]["redis"]["hits"] == 1
        assert b.tiers[1].contains(k) == "" and b.tiers[0].contains(k) == ""  # promoted into b's local tiers
        assert b.stats()["tiers"]["redis"]["entries"] == 1


def test_large_entries_move_in_chunks(tmp_path, redis_url):
    big = np.random.default_rng(0).standard_normal(3 * 1024 * 1024 + 17).astype(np.float32)  # 12 MB
    with PromptStore(memory_bytes=0, disk_bytes=0, redis_url=redis_url) as s:
        k = s.key("t", "big")
        assert s.put(k, {"x": big}, kind="t")
        assert s.get(k).tensors["x"].tobytes() == big.tobytes()


def test_two_hosts_share_through_redis_in_separate_processes(tmp_path, redis_url):
    code = """
    import sys, numpy as np
    from promptstore import PromptStore
    s = PromptStore(sys.argv[1], redis_url=sys.argv[2])
    k = s.key("t", "from-host-a")
    if sys.argv[3] == "write":
        s.put(k, {"x": np.arange(10, dtype=np.float32)}, kind="t")
        print("wrote")
    else:
        e = s.get(k)
        print(e.tensors["x"].tolist(), s.stats()["kinds"]["t"]["tiers"]["redis"]["hits"])
    """
    assert run_python(code, str(tmp_path / "host-a"), redis_url, "write").stdout.strip() == "wrote"
    out = run_python(code, str(tmp_path / "host-b"), redis_url, "read").stdout.strip()
    assert out == str([float(i) for i in range(10)]) + " 1"


def test_namespaces_and_prefixes_isolate(tmp_path, redis_url):
    with PromptStore(memory_bytes=0, disk_bytes=0, redis_url=redis_url, namespace="a") as a, \
            PromptStore(memory_bytes=0, disk_bytes=0, redis_url=redis_url, namespace="b") as b, \
            PromptStore(memory_bytes=0, disk_bytes=0, redis_url=redis_url, namespace="a", redis_prefix="other:") as c:
        k = a.key("t", "x")
        a.put(k, {"x": arr(1)}, kind="t")
        assert b.get(k) is None and b.get(b.key("t", "x")) is None
        assert c.get(k) is None  # same namespace, another prefix: another store
        assert a.get(k) is not None


def test_server_killed_mid_run_then_back(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with PromptStore(tmp_path / "local", redis_url=server.url) as s:
                k1 = s.key("t", "1")
                s.put(k1, {"x": arr(1)}, kind="t")
                server.kill()
                for i in range(50):  # every call keeps working on the local tiers
                    k = s.key("t", f"down{i}")
                    assert s.put(k, {"x": arr(i)}, kind="t")
                    assert s.get(k) is not None
                    assert s.get(k1) is not None
                assert s.stats()["tiers"]["redis"]["available"] is False
                server.start()  # same port, empty
                redis_tier = s.tiers[-1]
                redis_tier._down_until[:] = [0.0] * redis_tier.shards  # skip the rest of the backoff, not sleep
                k2 = s.key("t", "after")
                assert s.put(k2, {"x": arr(2)}, kind="t")
                assert s.tiers[-1].contains(k2) == ""
        ours = [w for w in caught if issubclass(w.category, PromptStoreWarning)]
        assert len(ours) == 1 and "unreachable" in str(ours[0].message)
        with PromptStore(tmp_path / "other-host", redis_url=server.url) as other:
            assert other.get(k2) is not None  # sharing resumed
    finally:
        server.stop()


def test_unreachable_at_start_is_one_warning(tmp_path):
    port = RedisServer(tmp_path).port  # nothing listens there
    with pytest.warns(PromptStoreWarning, match="unreachable"):
        s = PromptStore(tmp_path / "s", redis_url=f"redis://127.0.0.1:{port}/0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        k = s.key("t")
        assert s.put(k, {"x": arr(0)}, kind="t") and s.get(k) is not None


def test_wrong_password_is_a_clear_error(tmp_path):
    server = RedisServer(tmp_path / "r", password="s3cret").start()
    try:
        with pytest.raises(TierUnavailableError, match="refused the credentials"):
            PromptStore(tmp_path / "s", redis_url=f"redis://:wrong@127.0.0.1:{server.port}/0")
        with PromptStore(tmp_path / "s", redis_url=server.url) as ok:  # the right one works
            k = ok.key("t")
            ok.put(k, {"x": arr(0)}, kind="t")
            assert ok.tiers[-1].contains(k) == ""
    finally:
        server.stop()


@pytest.mark.parametrize("url", ["localhost:6379", "http://localhost", "redis://", "", "redis://:6379"])
def test_malformed_url(tmp_path, url):
    with pytest.raises(ConfigError):
        PromptStore(tmp_path / "s", redis_url=url)


EVICTOR = """
import sys, numpy as np
from promptstore import PromptStore
url, wid = sys.argv[1], int(sys.argv[2])
s = PromptStore(memory_bytes=0, disk_bytes=0, redis_url=url, redis_bytes=400_000)
for i in range(150):
    chain = [s.key("kv", f"{wid}-{i}-{b}") for b in range(3)]
    for b, k in enumerate(chain):
        s.put(k, {"k": np.full(2000 + 500 * wid, i, np.float32)}, kind="kv", cost_s=0.01 * b, parent=chain[b - 1] if b else None)
    s.get(s.key("kv", f"{(wid + 1) % 2}-{i}-0"))
print("ok")
"""


def test_two_processes_evicting_at_once_keep_budget_and_chains(redis_url):
    procs = [subprocess.Popen([sys.executable, "-c", EVICTOR, redis_url, str(w)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for w in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0 and out.strip() == "ok", err
    with PromptStore(memory_bytes=0, disk_bytes=0, redis_url=redis_url, redis_bytes=400_000) as s:
        usage = s.stats(all_namespaces=True)["tiers"]["redis"]
        assert 0 < usage["bytes"] <= 400_000
        assert usage["lifetime"]["evictions"] > 100
        report = s.verify()
        assert report["ok"], report["problems"]


class RedisStoreVsDict(StoreVsDict):
    """The stateful test with Redis as the only tier (and a tiny budget: eviction at every step)."""

    memory_bytes = 0
    disk_bytes = 0
    exact = False
    url = ""

    def _open(self) -> PromptStore:
        return PromptStore(self.dir, memory_bytes=0, disk_bytes=0, redis_url=self.url, redis_bytes=5000,
                           redis_prefix=self.prefix)

    def __init__(self) -> None:
        self.prefix = f"sm{uuid.uuid4().hex[:8]}:"
        super().__init__()


def test_stateful_against_redis(redis_url):
    from hypothesis import HealthCheck, settings

    RedisStoreVsDict.url = redis_url
    test = RedisStoreVsDict.TestCase
    test.settings = settings(max_examples=30, stateful_step_count=30, deadline=None,
                             suppress_health_check=list(HealthCheck))
    test().runTest()


def test_cli_stats_shows_redis(tmp_path, redis_url):
    with PromptStore(tmp_path / "s", redis_url=redis_url) as s:
        s.put(s.key("t"), {"x": arr(0)}, kind="t")
    exe = os.path.join(os.path.dirname(sys.executable), "promptstore")
    out = subprocess.run([exe, "--dir", str(tmp_path / "s"), "--redis-url", redis_url, "stats"], capture_output=True,
                         text=True, check=True).stdout
    assert "redis" in out and "1 entry" in out
    data = json.loads(subprocess.run([exe, "--dir", str(tmp_path / "s"), "--redis-url", redis_url, "--json", "stats"],
                                     capture_output=True, text=True, check=True).stdout)
    assert data["redis"]["entries"] == 1


def test_a_user_whose_acl_forbids_info_still_gets_a_working_tier(redis_url):
    """The tier asks INFO whether the server is a cluster node; a user not allowed INFO gets a standalone tier."""
    import redis

    admin = redis.Redis.from_url(redis_url)
    admin.execute_command("ACL", "SETUSER", "limited", "on", ">pw", "~*", "+@all", "-info")
    try:
        url = redis_url.replace("redis://", "redis://limited:pw@")
        with pytest.raises(redis.ResponseError):
            redis.Redis.from_url(url).info("cluster")
        tier = RedisTier(url, 1 << 20)
        assert not tier.cluster and tier.available
        e = make_entry(key_of("acl"), {"x": arr(3)})
        assert tier.put(e) and tier.get(key_of("acl")) is not None
    finally:
        admin.execute_command("ACL", "DELUSER", "limited")
