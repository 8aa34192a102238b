"""Which reload is still landing in each device slot, for the pool.

Owns one number per device slot (0: nothing landing; else the number of the reload copying
into it) and the reloads by number, so a load marks and clears a chunk's slots with one numpy
assignment each instead of a dict entry per page, and finds the reloads still landing in the
pages it reuses in one gather. The pool (pool.py, loading.py, movement.py) uses it under its
lock. Where kvtier.index.native is loaded, marks and clears run there (`set_where`). It must
never decide anything about a page.
"""

from __future__ import annotations

import numpy as np

from kvtier.index import native
from kvtier.index.slot_list import first_of_each
from kvtier.transfer import Ticket


class Landing:
    """Reloads in flight by device slot, over `capacity` slots."""

    def __init__(self, capacity: int) -> None:
        self._of = np.zeros(capacity, dtype=np.int64)
        self._tickets: dict[int, Ticket] = {}
        self._next = 1

    def __bool__(self) -> bool:
        return bool(self._tickets)

    def mark(self, slots, ticket: Ticket) -> int:
        """`ticket` now lands in `slots` (overriding what landed there before); its number."""
        number = self._next
        self._next += 1
        lib = native.module()
        if lib is not None:
            lib.set_where(self._of, slots, number, -1)
        else:
            self._of[np.asarray(slots, dtype=np.int64)] = number
        self._tickets[number] = ticket
        return number

    def clear(self, slots, number: int) -> None:
        """Reload `number` no longer lands in `slots` (those it still held): it landed, or the
        load that started it gave the pages up. The reload is forgotten."""
        lib = native.module()
        if lib is not None:
            lib.set_where(self._of, slots, 0, number)
        else:
            at = np.asarray(slots, dtype=np.int64)
            if at.size:
                mine = at[self._of[at] == number]
                self._of[mine] = 0
        self._tickets.pop(number, None)

    def tickets_of(self, slots) -> list[Ticket]:
        """The distinct reloads still landing in any of `slots`."""
        at = np.asarray(slots, dtype=np.int64)
        if not self._tickets or not at.size:
            return []
        # (not np.unique: its first call in a process imports numpy.ma, 6-11 ms)
        numbers, _ = first_of_each(self._of[at])
        tickets = self._tickets
        return [tickets[n] for n in numbers.tolist() if n and n in tickets]

    def ticket_of(self, slot: int) -> Ticket | None:
        """The reload still landing in `slot`, or None."""
        return self._tickets.get(int(self._of[slot])) if self._tickets else None
