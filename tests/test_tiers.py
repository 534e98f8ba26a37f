"""The shared tier contract, run against the memory and the disk tier."""

from __future__ import annotations

from promptstore._tiers import DiskTier, MemoryTier

from tier_contract import TierContract


class TestMemoryTier(TierContract):
    def make_tier(self, budget, clock, sizeof=None):
        return MemoryTier(budget, clock=clock, sizeof=sizeof)


class TestDiskTier(TierContract):
    @staticmethod
    def _folder():
        import tempfile

        return tempfile.mkdtemp(prefix="ps-disk-")

    def make_tier(self, budget, clock, sizeof=None):
        return DiskTier(self._folder(), budget, clock=clock, sizeof=sizeof)
