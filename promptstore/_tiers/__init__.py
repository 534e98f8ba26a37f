"""Storage tiers. Each passes the shared contract suite in tests/test_tier_contract.py."""

from .base import Tier
from .disk import DiskTier
from .memory import MemoryTier

__all__ = ["Tier", "MemoryTier", "DiskTier"]
