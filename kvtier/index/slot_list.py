"""An ordered set of slots as an intrusive doubly linked list over flat arrays.

Owns only the order of the slots it holds: append, remove, move to the end and walk from the
front, each O(1) per slot (the walk O(slots visited)), with 9 bytes per slot of capacity and no
Python object per slot. The eviction order and each tier's dirty list are SlotLists. It must
never know what a slot holds or why it is listed.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

_NIL = -1


class SlotList:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        head = capacity  # the sentinel: next of the sentinel is the first slot
        self._head = head
        self._next = array("i", [_NIL]) * (capacity + 1)
        self._prev = array("i", [_NIL]) * (capacity + 1)
        self._next[head] = head
        self._prev[head] = head
        self._member = bytearray(capacity)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, slot: int) -> bool:
        return bool(self._member[slot])

    def append(self, slot: int) -> None:
        """Put `slot` at the end (moving it there if already listed)."""
        nxt, prv, head = self._next, self._prev, self._head
        if self._member[slot]:
            p, n = prv[slot], nxt[slot]
            nxt[p] = n
            prv[n] = p
        else:
            self._member[slot] = 1
            self._len += 1
        last = prv[head]
        nxt[last] = slot
        prv[slot] = last
        nxt[slot] = head
        prv[head] = slot

    def discard(self, slot: int) -> None:
        """Take `slot` out if listed."""
        if not self._member[slot]:
            return
        nxt, prv = self._next, self._prev
        p, n = prv[slot], nxt[slot]
        nxt[p] = n
        prv[n] = p
        self._member[slot] = 0
        self._len -= 1

    def move_to_end(self, slot: int) -> None:
        """Move a listed slot to the end; an unlisted slot stays unlisted."""
        if self._member[slot]:
            self.append(slot)

    def first(self, n: int) -> list[int]:
        """Up to n slots from the front, in order (reads n links, never the whole list)."""
        out: list[int] = []
        nxt, head = self._next, self._head
        slot = nxt[head]
        while slot != head and len(out) < n:
            out.append(slot)
            slot = nxt[slot]
        return out

    def __iter__(self) -> Iterator[int]:
        """Walk from the front. The list must not change while the walk is under way."""
        nxt, head = self._next, self._head
        slot = nxt[head]
        while slot != head:
            yield slot
            slot = nxt[slot]
