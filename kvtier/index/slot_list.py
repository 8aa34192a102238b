"""An ordered set of slots as an intrusive doubly linked list over flat arrays.

Owns only the order of the slots it holds: append, remove, move to the end and walk from the
front, each O(1) per slot (the walk O(slots visited)), with 17 bytes per slot of capacity and no
Python object per slot. The eviction order and each tier's dirty list are SlotLists. It must
never know what a slot holds or why it is listed.

Every slot joins at the end, so the list's order is the order in which its slots last joined:
each slot keeps that number (its stamp). A batch that leaves (``discard_many``) finds where each
run of its leaving slots begins and ends from its neighbours' links, and pairs the k-th
beginning with the k-th end by their stamps, in a fixed number of numpy calls (pointer jumping
along the links took log2 of the longest run in calls: 38-58 µs for 128 slots, 450-540 for
2,048 on the 2-core VM).

Where kvtier.index.native has loaded its C library, batches are linked and unlinked there, one
slot after the other on the same arrays (the one-at-a-time paths' result, whatever the batch),
and walks from the front read the links there.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

import numpy as np

from kvtier.index import native

_NIL = -1
# Batches at least this long are linked and unlinked with numpy (`extend`, `discard_many`), and
# TierIndex changes their states, holds and pins with numpy. Measured on a 2-core VM (land, hold,
# let go and dirty a batch of host slots, 8,192 or 1e6 of capacity): numpy is 1.5x faster than
# the loops at 128 slots and 3x at 256 once no batch path calls np.unique (numpy 2 hashes there,
# ten times slower than a sort); 1,024 was the threshold while they did, 256 until flushes and
# loads of 128 pages measured faster through numpy too (flush of 128: 3.1 -> 2.5 µs a page), 128
# until unlinking a batch took a fixed number of numpy calls (stamps) and 64 to 127 slots measured
# faster through numpy (µs a call, pool_bookkeeping on the VM: flush of 64 145-149 -> 120-123, of
# 96 201-206 -> 141, match of 96 81-83 -> 69-70; a load of 64 118-121 -> 123).
BULK = 64
# `members` scans the flags of the whole capacity (about 0.5 ns a slot) rather than walk the
# links (about 100 ns a listed slot) once at least one slot in DENSE is listed.
DENSE = 64


def first_of_each(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(each distinct value, sorted; the position of its first occurrence in `values`): what
    np.unique(values, return_index=True) gives, by a stable sort (numpy 2's np.unique hashes,
    about ten times slower for a few thousand ints)."""
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    first = np.empty(ordered.size, dtype=bool)
    first[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    return ordered[first], order[first]


class SlotList:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        head = capacity  # the sentinel: next of the sentinel is the first slot
        self._head = head
        self._next = array("i", [_NIL]) * (capacity + 1)
        self._prev = array("i", [_NIL]) * (capacity + 1)
        self._next[head] = head
        self._prev[head] = head
        # 1 where listed; one byte more for the sentinel (never listed), so a batch can look up
        # any slot's neighbours' flags, and 2 marks the slots of a batch leaving the list.
        self._member = bytearray(capacity + 1)
        self._stamp = array("q", [0]) * capacity  # when each slot last joined (the list's order)
        self._stamps = 0  # the next stamp
        self._len = 0
        # numpy views of the same memory (no copy) for the batch operations.
        self._np_next = np.frombuffer(self._next, dtype=np.int32)
        self._np_prev = np.frombuffer(self._prev, dtype=np.int32)
        self._np_member = np.frombuffer(self._member, dtype=np.uint8)
        self._np_stamp = np.frombuffer(self._stamp, dtype=np.int64)
        self._c = None  # the C links of these arrays, once kvtier.index.native is loaded

    def _native(self):
        """The C links of this list's arrays, or None while the C library is not loaded."""
        return native.attach(self, "Links", self._next, self._prev, self._member, self._stamp)

    def _append_c(self, c, slots) -> None:
        self._len += c.append(slots, self._stamps)
        self._stamps += len(slots)

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
        self._stamp[slot] = self._stamps
        self._stamps += 1
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

    def extend(self, slots: list[int]) -> None:
        """`append` of each slot, in order (a slot listed twice ends where its last append puts it)."""
        c = self._c or self._native()
        if c is not None:
            self._append_c(c, slots)
            return
        if len(slots) < BULK or len(set(slots)) != len(slots):
            self._append_each(slots)
            return
        self.extend_distinct(np.asarray(slots, dtype=np.int64))

    def _append_each(self, slots) -> None:
        """`append` of each slot in order, the linking inline (a short batch: no call per slot)."""
        c = self._c or self._native()
        if c is not None:
            self._append_c(c, slots)
            return
        nxt, prv, member, head, stamp = self._next, self._prev, self._member, self._head, self._stamp
        added = 0
        now = self._stamps
        for slot in slots:
            if member[slot]:
                p, n = prv[slot], nxt[slot]
                nxt[p] = n
                prv[n] = p
            else:
                member[slot] = 1
                added += 1
            stamp[slot] = now
            now += 1
            last = prv[head]
            nxt[last] = slot
            prv[slot] = last
            nxt[slot] = head
            prv[head] = slot
        self._stamps = now
        self._len += added

    def _discard_each(self, slots) -> None:
        """`discard` of each slot, the unlinking inline (a short batch: no call per slot)."""
        c = self._c or self._native()
        if c is not None:
            self._len -= c.discard(slots)
            return
        nxt, prv, member = self._next, self._prev, self._member
        gone = 0
        for slot in slots:
            if member[slot]:
                p, n = prv[slot], nxt[slot]
                nxt[p] = n
                prv[n] = p
                member[slot] = 0
                gone += 1
        self._len -= gone

    def extend_unlisted(self, slots: list[int]) -> None:
        """`extend` of a short list of distinct slots none of which is listed (no check): one
        loop that links them in a chain, no call per slot."""
        c = self._c or self._native()
        if c is not None:
            self._append_c(c, slots)
            return
        nxt, prv, member, head, stamp = self._next, self._prev, self._member, self._head, self._stamp
        last = prv[head]
        now = self._stamps
        for slot in slots:
            nxt[last] = slot
            prv[slot] = last
            member[slot] = 1
            stamp[slot] = now
            now += 1
            last = slot
        nxt[last] = head
        prv[head] = last
        self._stamps = now
        self._len += len(slots)

    def extend_distinct(self, new: np.ndarray) -> None:
        """`extend` of an int64 array of slots the caller knows to be distinct (no check)."""
        c = self._c or self._native()
        if c is not None:
            self._append_c(c, new)
            return
        if new.size < BULK:
            self._append_each(new.tolist())
            return
        listed = new[self._np_member[new] != 0]
        if listed.size:
            self.discard_distinct(listed)
        nxt, prv, head = self._np_next, self._np_prev, self._head
        last = int(prv[head])
        nxt[new[:-1]] = new[1:]
        prv[new[1:]] = new[:-1]
        first, end = int(new[0]), int(new[-1])
        nxt[last] = first
        prv[first] = last
        nxt[end] = head
        prv[head] = end
        self._np_member[new] = 1
        self._np_stamp[new] = np.arange(self._stamps, self._stamps + new.size, dtype=np.int64)
        self._stamps += new.size
        self._len += new.size

    def discard_many(self, slots) -> None:
        """`discard` of each slot: the listed ones leave, the rest of the order stays as it was.

        In numpy: the runs of leaving slots along the order begin where a slot's previous one
        stays and end where its next one stays; the k-th beginning and the k-th end by stamp
        (the list's order) bound one run, whose staying neighbours are linked to each other."""
        c = self._c or self._native()
        if c is not None:
            self._len -= c.discard(slots)
            return
        if len(slots) < BULK:
            self._discard_each(slots)
            return
        self._unlink_distinct(first_of_each(np.asarray(slots, dtype=np.int64))[0])

    def discard_distinct(self, slots: np.ndarray) -> None:
        """`discard_many` of an int64 array of slots the caller knows to be distinct."""
        c = self._c or self._native()
        if c is not None:
            self._len -= c.discard(slots)
            return
        if slots.size < BULK:
            self._discard_each(slots.tolist())
            return
        self._unlink_distinct(slots)

    def _unlink_distinct(self, gone: np.ndarray) -> None:
        """`discard_many` of distinct slots (in any order)."""
        member = self._np_member
        gone = gone[member[gone] != 0]
        if not gone.size:
            return
        nxt, prv = self._np_next, self._np_prev
        if gone.size == self._len:  # every listed slot leaves (a whole tier's batch): empty the list
            nxt[self._head] = prv[self._head] = self._head
            member[gone] = 0
            self._len = 0
            return
        # Flags, not a search: a sorted lookup of random neighbours mispredicts its branches
        # (127 µs of 2,048 slots on the VM against 22 in a loop over the same values).
        member[gone] = 2
        before, after = prv[gone], nxt[gone]
        starts = np.flatnonzero(member[before] != 2)
        ends = np.flatnonzero(member[after] != 2)
        member[gone] = 0
        if starts.size > 1:  # several runs: pair their beginnings and ends in the list's order
            stamp = self._np_stamp
            starts = starts[np.argsort(stamp[gone[starts]])]
            ends = ends[np.argsort(stamp[gone[ends]])]
        before, after = before[starts], after[ends]
        nxt[before] = after
        prv[after] = before
        self._len -= gone.size

    def move_to_end(self, slot: int) -> None:
        """Move a listed slot to the end; an unlisted slot stays unlisted."""
        if self._member[slot]:
            self.append(slot)

    def first(self, n: int) -> list[int]:
        """Up to n slots from the front, in order (reads n links, never the whole list)."""
        c = self._c or self._native()
        if c is not None:
            return c.first(min(n, self._len))
        out: list[int] = []
        append, nxt = out.append, self._next
        slot = nxt[self._head]
        for _ in range(min(n, self._len)):  # the list holds _len slots: no end test needed
            append(slot)
            slot = nxt[slot]
        return out

    def members(self) -> list[int]:
        """Every listed slot, in no particular order: a vectorized scan of the membership flags
        when at least BULK slots, and one slot in DENSE of the capacity, are listed (then no
        slower than the walk), else the walk from the front."""
        if self._len >= BULK and self._len * DENSE >= self.capacity:
            return np.flatnonzero(self._np_member).tolist()
        return self.first(self._len)

    def __iter__(self) -> Iterator[int]:
        """Walk from the front. The list must not change while the walk is under way."""
        nxt, head = self._next, self._head
        slot = nxt[head]
        while slot != head:
            yield slot
            slot = nxt[slot]
