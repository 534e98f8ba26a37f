"""Storage tiers. Each passes the shared contract suite in tests/tier_contract.py (run by tests/test_tiers.py and tests/test_redis.py)."""

from .base import Tier
from .disk import DiskTier
from .memory import MemoryTier

__all__ = ["Tier", "MemoryTier", "DiskTier"]
