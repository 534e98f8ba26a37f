"""A Hypothesis state machine drives the store and a plain dict side by side.

With room for everything the store must equal the dict after every step; under a small
byte budget it must hold a subset of it (never a wrong value), stay within budget, and
never keep a chained entry whose parent it dropped.
"""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from promptstore import PromptStore, make_key

KEYS = st.integers(0, 11)


def key(i: int) -> bytes:
    return make_key("sm", str(i))


class StoreVsDict(RuleBasedStateMachine):
    memory_bytes: int | str = "64MiB"
    disk_bytes: int | str = "64MiB"
    exact = True

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="ps-sm-")
        self.store = self._open()
        self.model: dict[int, bytes] = {}
        self.parent: dict[int, int] = {}

    def _open(self) -> PromptStore:
        return PromptStore(self.dir, memory_bytes=self.memory_bytes, disk_bytes=self.disk_bytes)

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _forget(self, i: int) -> None:
        self.model.pop(i, None)
        self.parent.pop(i, None)
        for child in [c for c, p in self.parent.items() if p == i]:
            self._forget(child)

    @rule(i=KEYS, n=st.integers(0, 400), seed=st.integers(0, 2**16), cost=st.floats(0, 5))
    def put(self, i, n, seed, cost):
        data = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
        self.store.put(key(i), {"x": data}, kind="sm", cost_s=cost)
        self.model[i] = data.tobytes()
        self.parent.pop(i, None)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), seed=st.integers(0, 2**16))
    def put_child(self, data, seed):
        p = data.draw(st.sampled_from(sorted(self.model)))
        if key(p) not in self.store:
            return
        c = data.draw(KEYS.filter(lambda c: c != p))
        # No cycles: the child must not be an ancestor of the parent.
        a = p
        while a in self.parent:
            a = self.parent[a]
            if a == c:
                return
        x = np.random.default_rng(seed).standard_normal(8).astype(np.float32)
        self.store.put(key(c), {"x": x}, kind="sm", parent=key(p))
        self.model[c] = x.tobytes()
        self.parent[c] = p

    @rule(i=KEYS)
    def get(self, i):
        e = self.store.get(key(i))
        if e is not None:
            assert i in self.model
            assert e.tensors["x"].tobytes() == self.model[i]
        elif self.exact:
            assert i not in self.model

    @rule(i=KEYS)
    def delete(self, i):
        self.store.delete(key(i))
        self._forget(i)

    @rule()
    def drop_memory(self):
        if self.store.tiers[0].name == "memory":
            self.store.tiers[0].clear()

    @rule()
    def reopen(self):
        self.store.close()
        self.store = self._open()

    @invariant()
    def within_budgets(self):
        for tier in self.store.tiers:
            assert tier.usage()["bytes"] <= tier.budget

    @invariant()
    def matches_model(self):
        stored = {i.key for i in self.store.ls()}
        model = {key(i) for i in self.model}
        if self.exact:
            assert stored == model
        else:
            assert stored <= model

    @invariant()
    def every_tier_holds_whole_chains(self):
        for tier in self.store.tiers:
            present = {i.key: i.parent for i in tier.infos()}
            for parent in present.values():
                assert parent is None or parent in present


class BoundedStoreVsDict(StoreVsDict):
    memory_bytes = 3000
    disk_bytes = 6000
    exact = False


TestStoreVsDict = StoreVsDict.TestCase
TestStoreVsDict.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])
TestBoundedStoreVsDict = BoundedStoreVsDict.TestCase
TestBoundedStoreVsDict.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
