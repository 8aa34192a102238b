"""Eviction policies: which evictable slot of a tier goes first.

Owns the order of evictable slots only. The index tells a policy when a slot becomes
evictable (`add`), stops being evictable (`remove`) and is used (`touch`); the policy
never decides whether a slot may be evicted. New policies (ARC, S3-FIFO) implement the
same four methods.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator


class EvictionPolicy(ABC):
    @abstractmethod
    def add(self, slot: int) -> None:
        """`slot` became evictable."""

    @abstractmethod
    def remove(self, slot: int) -> None:
        """`slot` is no longer evictable (pinned, busy or freed)."""

    @abstractmethod
    def touch(self, slot: int) -> None:
        """`slot` was used; it may or may not be evictable now."""

    @abstractmethod
    def order(self) -> Iterator[int]:
        """Evictable slots, first victim first."""

    @abstractmethod
    def __len__(self) -> int: ...


class LRUPolicy(EvictionPolicy):
    """Least recently used first; a slot that becomes evictable counts as just used."""

    def __init__(self) -> None:
        self._slots: OrderedDict[int, None] = OrderedDict()

    def add(self, slot: int) -> None:
        self._slots[slot] = None
        self._slots.move_to_end(slot)

    def remove(self, slot: int) -> None:
        self._slots.pop(slot, None)

    def touch(self, slot: int) -> None:
        if slot in self._slots:
            self._slots.move_to_end(slot)

    def order(self) -> Iterator[int]:
        return iter(list(self._slots))

    def __len__(self) -> int:
        return len(self._slots)


POLICIES = {"lru": LRUPolicy}


def make_policy(name: str) -> EvictionPolicy:
    if name not in POLICIES:
        raise ValueError(f"eviction policy must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name]()
