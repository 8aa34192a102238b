"""Tier memory: device pages, host page records, and the remote page store."""

from kvtier.tiers.device import DeviceTier
from kvtier.tiers.host import HostTier

__all__ = ["DeviceTier", "HostTier"]
