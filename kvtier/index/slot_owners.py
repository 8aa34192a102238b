"""Which copy in flight owns each slot of a tier: one int64 per slot, no Python object per page.

Owns the map slot -> the copy (its ticket) still landing in it, which later calls order after:
a load that holds a page still landing waits on that page's copy. Owning, letting go and asking
about a batch are numpy over the flat array from BULK slots, plain loops over the same memory
below (a few numpy calls cost more than a short loop). An owner is forgotten once it owns no
slot. It must never wait on a ticket or know page states.
"""

from __future__ import annotations

from array import array

import numpy as np

BULK = 64  # batches at least this long are set, cleared and read in numpy


class SlotOwners:
    def __init__(self, capacity: int) -> None:
        self._owner = array("q", [0]) * capacity  # 0: no owner; else the owner's number
        self._np_owner = np.frombuffer(self._owner, dtype=np.int64)
        self._tickets: dict[int, object] = {}  # owner number -> ticket
        self._number: dict[int, int] = {}  # id(ticket) -> owner number, while it owns a slot
        self._owns: dict[int, int] = {}  # owner number -> slots it owns
        self._last = 0
        self._owned = 0

    def __len__(self) -> int:
        """Slots with an owner."""
        return self._owned

    def set(self, slots: list[int], ticket: object) -> None:
        """`ticket` owns each of `slots` (distinct), taking them from any owner they had."""
        if not slots:
            return
        number = self._number.get(id(ticket))
        if number is None:
            self._last += 1
            number = self._last
            self._number[id(ticket)] = number
            self._tickets[number] = ticket
            self._owns[number] = 0
        if len(slots) >= BULK:
            at = np.asarray(slots, dtype=np.int64)
            before = self._np_owner[at]
            taken = before[before != 0]
            self._np_owner[at] = number
        else:
            owner = self._owner
            taken = [owner[slot] for slot in slots if owner[slot]]
            for slot in slots:
                owner[slot] = number
        # Counted before the slots taken are let go: a slot this ticket owned already is both.
        self._owns[number] += len(slots)
        self._owned += len(slots)
        for other in (taken.tolist() if isinstance(taken, np.ndarray) else taken):
            self._drop(other, 1)

    def clear(self, slots: list[int], ticket: object) -> None:
        """The slots of `slots` that `ticket` owns have no owner now."""
        number = self._number.get(id(ticket))
        if number is None or not len(slots):
            return
        if len(slots) >= BULK:
            at = np.asarray(slots, dtype=np.int64)
            mine = at[self._np_owner[at] == number]
            self._np_owner[mine] = 0
            gone = mine.size
        else:
            owner, gone = self._owner, 0
            for slot in slots:
                if owner[slot] == number:
                    owner[slot] = 0
                    gone += 1
        self._drop(number, gone)

    def _drop(self, number: int, slots: int) -> None:
        self._owned -= slots
        left = self._owns[number] - slots
        if left:
            self._owns[number] = left
            return
        del self._owns[number], self._number[id(self._tickets.pop(number))]

    def tickets(self, slots: list[int]) -> list:
        """The distinct owners of `slots` (any order)."""
        if not self._owned or not len(slots):
            return []
        if len(slots) >= BULK:
            numbers = self._np_owner[np.asarray(slots, dtype=np.int64)]
            numbers = set(numbers[numbers != 0].tolist())
        else:
            owner = self._owner
            numbers = {owner[slot] for slot in slots} - {0}
        return [self._tickets[n] for n in numbers]
