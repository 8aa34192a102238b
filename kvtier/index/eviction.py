"""Eviction policies: which evictable slot of a tier goes first.

Owns the order of evictable slots only. The index tells a policy when a slot becomes
evictable (`add`), stops being evictable (`remove`) and is used (`touch`); the policy
never decides whether a slot may be evicted. Every method is O(1) per slot and `victims(n)`
reads at most n entries, whatever the tier's size. New policies (ARC, S3-FIFO) implement the
same five methods (the batch forms `add_many`, `remove_many`, `touch_many` default to loops).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from kvtier.index import slot_list
from kvtier.index.slot_list import SlotList


class EvictionPolicy(ABC):
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    @abstractmethod
    def add(self, slot: int) -> None:
        """`slot` became evictable."""

    @abstractmethod
    def remove(self, slot: int) -> None:
        """`slot` is no longer evictable (pinned, busy or freed)."""

    @abstractmethod
    def touch(self, slot: int) -> None:
        """`slot` was used; it may or may not be evictable now."""

    def add_many(self, slots: list[int]) -> None:
        """`add` of each slot, in order."""
        for slot in slots:
            self.add(slot)

    def add_many_distinct(self, slots: np.ndarray) -> None:
        """`add_many` of an int64 array of distinct slots."""
        self.add_many(slots.tolist())

    def remove_many(self, slots: list[int]) -> None:
        """`remove` of each slot."""
        for slot in slots:
            self.remove(slot)

    def remove_many_distinct(self, slots: np.ndarray) -> None:
        """`remove_many` of an int64 array of distinct slots."""
        self.remove_many(slots.tolist())

    def touch_many(self, slots: list[int]) -> None:
        """`touch` of each slot, in order."""
        for slot in slots:
            self.touch(slot)

    def touch_many_distinct(self, slots: np.ndarray) -> None:
        """`touch_many` of an int64 array of distinct slots."""
        self.touch_many(slots.tolist())

    @abstractmethod
    def victims(self, n: int) -> list[int]:
        """Up to n evictable slots, first victim first."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, slot: int) -> bool: ...


class LRUPolicy(SlotList, EvictionPolicy):
    """Least recently used first; a slot that becomes evictable counts as just used.

    The order is a SlotList: add appends (or moves to the end), remove unlinks, touch moves a
    listed slot to the end, victims reads from the front.
    """

    add = SlotList.append
    remove = SlotList.discard
    touch = SlotList.move_to_end
    victims = SlotList.first
    add_many = SlotList.extend
    add_many_distinct = SlotList.extend_distinct
    remove_many = SlotList.discard_many
    remove_many_distinct = SlotList.discard_distinct

    def touch_many(self, slots: list[int]) -> None:
        c = self._c or self._native()
        if c is not None:  # in C: the listed ones moved to the end in one pass
            self._stamps += c.touch(slots, self._stamps)
            return
        if len(slots) >= slot_list.BULK:  # the listed ones picked in numpy
            at = np.asarray(slots, dtype=np.int64)
            self.extend(at[self._np_member[at] != 0].tolist())
            return
        member = self._member
        self.extend([slot for slot in slots if member[slot]])

    def touch_many_distinct(self, slots: np.ndarray) -> None:
        self.extend_distinct(slots[self._np_member[slots] != 0])


POLICIES = {"lru": LRUPolicy}


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    if name not in POLICIES:
        raise ValueError(f"eviction policy must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name](capacity)
