"""Key id -> slot map of one tier, in flat arrays: about 32 bytes per slot, no object per key.

Owns the mapping between 16-byte key ids (kvtier.index.keys.key_id) and the slots that hold
them. Open addressing with linear probing in a power-of-two bucket array at most half full, and
backward-shift deletion, so there are no tombstones and no rebuilds: every operation is O(1)
expected, whatever the capacity. Ids are stored per slot in one bytearray; the bucket of a
slot and its home bucket are stored too, so unbinding never re-hashes. Buckets come from
Python's hash of the id (SipHash, per process), which is fine for a table that lives in one
process; ids themselves are keyed BLAKE2b, so equal ids mean equal keys.

A dict would cost about 120 bytes per key (a 16-byte bytes object and its entry); this costs
16 (id) + 8 (two buckets) + 8 (bucket and home of the slot). It must never know page states.

Where kvtier.index.native has loaded its C library, lookups, binds and unbinds run there, on
the same buffers with the same hash and probing, so a table's state is the same whichever path
changed it (the Python paths below are its twins; the tests compare the two).
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Iterator

import numpy as np

from kvtier.index import native
from kvtier.index.keys import KEY_ID_BYTES

_EMPTY = -1
_W = KEY_ID_BYTES
# Batches at least this long are looked up with numpy (`get_many`): a probe step costs tens of
# µs of numpy calls whatever the batch, a Python probe 0.4-1 µs a key (more as the batch's
# buckets leave the CPU caches). Measured on a 2-core VM once the numpy probe compared only the
# ids' low halves: 1.2-1.4x faster than the inline loop at 128 keys (tables of 64 Ki and 1 Mi
# slots, a quarter to half full), 2-2.5x at 512; it was 512 while each step compared whole ids.
MANY = 128
# Batches at least this long are bound with numpy (`bind_many`): its checks and the probing
# with a sort a step cost as much as the inline loop at 128 ids (0.62 µs a key, 2-core VM, a
# table of 256 Ki slots a third full), less from 256 (0.46 against 0.63; 0.36 against 0.62 at 512).
BIND_MANY = 256
# Buckets a numpy probe step reads for each id still probing after its first bucket.
WINDOW = 8
_WINDOW_STEPS = np.arange(1, WINDOW + 1, dtype=np.int64)


class KeyTable:
    def __init__(self, capacity: int) -> None:
        buckets = 8
        while buckets < 2 * capacity:
            buckets *= 2
        self.capacity = capacity
        self._mask = buckets - 1
        self._buckets = array("i", [_EMPTY]) * buckets
        self._ids = bytearray(_W * capacity)
        self._bucket_of = array("i", [_EMPTY]) * capacity  # -1: the slot holds no key
        self._home = array("i", [0]) * capacity
        self._len = 0
        # numpy views of the same memory (no copy) for the batch paths.
        self._np_buckets = np.frombuffer(self._buckets, dtype=np.int32)
        self._np_ids = np.frombuffer(self._ids, dtype=np.uint64).reshape(capacity, 2)
        self._np_bucket_of = np.frombuffer(self._bucket_of, dtype=np.int32)
        self._np_home = np.frombuffer(self._home, dtype=np.int32)
        self._c = None  # the C probes of these buffers, once kvtier.index.native is loaded

    def _native(self):
        """The C probes of this table's buffers, or None while the C library is not loaded."""
        return native.attach(self, "Table", self._buckets, self._ids, self._bucket_of, self._home, self._mask)

    def __len__(self) -> int:
        return self._len

    def get(self, kid: bytes) -> int:
        """The slot holding `kid`, or -1."""
        c = self._c or self._native()
        if c is not None:
            return c.get((kid,))[0]
        buckets, ids, mask = self._buckets, self._ids, self._mask
        b = hash(kid) & mask
        while True:
            slot = buckets[b]
            if slot == _EMPTY:
                return -1
            # The 16 bytes at the slot's offset, compared in place (no slice object).
            if ids.startswith(kid, slot * _W) and len(kid) == _W:
                return slot
            b = (b + 1) & mask

    def get_many(self, kids: list[bytes]) -> list[int]:
        """`get` of each id, in order: the same probes, every id's step at once in numpy."""
        c = self._c or self._native()
        if c is not None:
            return c.get(kids if type(kids) in (list, tuple) else list(kids))
        if len(kids) < MANY:
            return self._get_each_inline(kids)
        return self.get_many_array(kids).tolist()

    def get_many_array(self, kids: list[bytes]) -> np.ndarray:
        """`get_many` as an int64 array (in numpy from MANY ids)."""
        n = len(kids)
        c = self._c or self._native()
        if c is not None:
            out = np.empty(n, dtype=np.int64)
            c.get(kids if type(kids) in (list, tuple) else list(kids), out)
            return out
        joined = b"".join(kids)
        if n < MANY or len(joined) != _W * n or not self.capacity:
            return np.array(self._get_each_inline(kids), dtype=np.int64)
        wanted = np.frombuffer(joined, dtype=np.uint64)
        bucket = np.fromiter(map(hash, kids), dtype=np.int64, count=n) & self._mask
        out = self._probe(wanted[0::2], bucket)
        # An id whose low half matched where its high half does not (two ids alike in their
        # first 8 bytes) is looked up again in full.
        found = np.flatnonzero(out >= 0)
        unsure = found[self._np_ids[out[found], 1] != wanted[1::2][found]]
        for i in unsure.tolist():
            out[i] = self.get(kids[i])
        return out

    def _probe(self, want_lo: np.ndarray, bucket: np.ndarray) -> np.ndarray:
        """Probe every id from `bucket` (its home; updated in place to where its probe stopped)
        comparing the low 8 bytes of ids only: the slot where each id's low half matched, else
        -1. Every id's first bucket at once
        (an empty bucket, -1, reads the last slot's id: `keyed` masks it), then the next WINDOW
        buckets of every id still probing at once, as many times as some id needs: at most half
        the buckets are taken, so a run of taken buckets longer than a window is rare, and an
        id's probe costs one or two numpy passes instead of one per bucket."""
        mask, buckets, lo_of = self._mask, self._np_buckets, self._np_ids[:, 0]
        out = np.full(want_lo.size, _EMPTY, dtype=np.int64)
        slot = buckets[bucket]
        keyed = slot >= 0
        hit = (lo_of[slot] == want_lo) & keyed
        out[hit] = slot[hit]
        pending = np.flatnonzero(keyed & ~hit)
        while pending.size:
            at = (bucket[pending, None] + _WINDOW_STEPS) & mask  # (pending, WINDOW) buckets
            slot = buckets[at]
            keyed = slot >= 0
            stop = ~keyed | ((lo_of[slot] == want_lo[pending, None]) & keyed)
            first = stop.argmax(axis=1)  # the first bucket where each id's probe stops (0 if none)
            rows = np.arange(pending.size)
            stopped = stop[rows, first]
            ends = slot[rows, first]
            hit = stopped & (ends >= 0)
            out[pending[hit]] = ends[hit]
            bucket[pending] = np.where(stopped, at[rows, first], at[:, -1])
            pending = pending[~stopped]
        return out

    def _get_each_inline(self, kids) -> list[int]:
        """`get` of each id, the probe loop inline (a short batch: no call per id)."""
        buckets, ids, mask = self._buckets, self._ids, self._mask
        startswith = ids.startswith
        out = []
        append = out.append
        for kid in kids:
            b = hash(kid) & mask
            while True:
                slot = buckets[b]
                if slot == _EMPTY:
                    append(-1)
                    break
                if startswith(kid, slot * _W) and len(kid) == _W:
                    append(slot)
                    break
                b = (b + 1) & mask
        return out

    def leading(self, kids) -> list[int]:
        """The slots of the leading ids the table holds (up to the first miss), the probe loop
        inline: a caller reads no further than the first miss, and pays no call per id."""
        c = self._c or self._native()
        if c is not None:
            return c.get(kids if type(kids) in (list, tuple) else list(kids), None, True)
        buckets, ids, mask = self._buckets, self._ids, self._mask
        startswith = ids.startswith
        out = []
        append = out.append
        for kid in kids:
            b = hash(kid) & mask
            while True:
                slot = buckets[b]
                if slot == _EMPTY:
                    return out
                if startswith(kid, slot * _W) and len(kid) == _W:
                    append(slot)
                    break
                b = (b + 1) & mask
        return out

    def get_each(self, kids: list[bytes]) -> Iterator[int]:
        """`get` of each id, in order, as they are read: one at a time below MANY ids (a caller
        that stops at the first miss pays for what it read), all at once in numpy from MANY."""
        return iter(self.get_many(kids)) if len(kids) >= MANY else map(self.get, kids)

    def __contains__(self, kid: bytes) -> bool:
        return self.get(kid) >= 0

    def bind(self, kid: bytes, slot: int) -> None:
        """Map `kid` to `slot`. The slot must hold no key, and `kid` must not be mapped."""
        if self._bucket_of[slot] != _EMPTY:
            raise ValueError(f"slot {slot} already holds key id {self.id_of(slot).hex()}")
        buckets, ids, mask = self._buckets, self._ids, self._mask
        home = hash(kid) & mask
        b = home
        while True:
            other = buckets[b]
            if other == _EMPTY:
                break
            if ids.startswith(kid, other * _W) and len(kid) == _W:
                raise ValueError(f"key id {kid.hex()} is already in slot {other}")
            b = (b + 1) & mask
        buckets[b] = slot
        at = slot * _W
        self._ids[at : at + _W] = kid
        self._bucket_of[slot] = b
        self._home[slot] = home
        self._len += 1

    def bind_many(self, kids: list[bytes], slots: list[int]) -> None:
        """`bind` of each id to its slot. From BIND_MANY ids, in numpy when the slots hold no key and
        are distinct and the ids are distinct and unmapped (checked before anything changes):
        each id probes to its first empty bucket, one id of those that reach the same bucket
        takes it and the others probe on, so every id sits past only taken buckets, as `bind`
        would leave it. Otherwise one at a time (which raises on the first bad pair)."""
        n = len(kids)
        c = self._c or self._native()
        if c is not None:
            if type(kids) not in (list, tuple):
                kids = list(kids)
            if type(slots) not in (list, tuple):
                slots = list(slots)
            bound = c.bind(kids, slots)  # the pairs before the first that bind would refuse
            self._len += bound
            if bound < n:  # raises on that pair, as the Python path does, or binds the rest
                self._bind_each_inline(kids[bound:], slots[bound:])
            return
        if n < BIND_MANY or not self._bind_many_numpy(kids, slots):
            self._bind_each_inline(kids, slots)

    def _bind_each_inline(self, kids, slots) -> None:
        """`bind` of each pair in order, the probe loop inline (no call per id); the first bad
        pair raises, as `bind` does, after the pairs before it are bound."""
        buckets, ids, mask = self._buckets, self._ids, self._mask
        bucket_of, home_of, startswith = self._bucket_of, self._home, ids.startswith
        bound = 0
        try:
            for kid, slot in zip(kids, slots):
                if bucket_of[slot] != _EMPTY:
                    self.bind(kid, slot)  # raises: the slot holds a key
                if len(kid) != _W:
                    raise ValueError(f"a key id is {_W} bytes, got {len(kid)}")
                home = hash(kid) & mask
                b = home
                while True:
                    other = buckets[b]
                    if other == _EMPTY:
                        break
                    if startswith(kid, other * _W):
                        self.bind(kid, slot)  # raises: the id is mapped
                    b = (b + 1) & mask
                buckets[b] = slot
                at = slot * _W
                ids[at : at + _W] = kid
                bucket_of[slot] = b
                home_of[slot] = home
                bound += 1
        finally:
            self._len += bound

    def _bind_many_numpy(self, kids: list[bytes], slots) -> bool:
        n = len(kids)
        at = np.asarray(slots, dtype=np.int64)
        bucket_of = self._np_bucket_of
        if at.shape != (n,) or (bucket_of[at] != _EMPTY).any():
            return False
        # Distinct slots: each writes its own mark where its bucket goes (they hold no key) and
        # reads it back; a repeated slot reads the mark of its last place at the first.
        marks = -2 - np.arange(n, dtype=np.int32)
        bucket_of[at] = marks
        distinct = np.array_equal(bucket_of[at], marks)
        bucket_of[at] = _EMPTY
        joined = b"".join(kids)
        if not distinct or len(joined) != _W * n or len(set(kids)) != n:
            return False
        wanted = np.frombuffer(joined, dtype=np.uint64)
        mask, buckets = self._mask, self._np_buckets
        home = np.fromiter(map(hash, kids), dtype=np.int64, count=n) & mask
        # The lookup's probe: an id whose low half matches on the way may be mapped already
        # (bind one at a time decides); every other id stopped at an empty bucket, past only
        # taken ones, so it is not mapped, and is placed from there.
        bucket = home.copy()
        found = self._probe(wanted[0::2], bucket)
        if (found >= 0).any():
            return False
        self._np_ids[at] = wanted.reshape(n, 2)
        self._np_home[at] = home
        # Every slot still to place writes itself into its id's empty bucket and reads it back:
        # one of the ids that reached a bucket keeps it, the others probe on to their next empty
        # bucket, so every id sits past only taken buckets, as `bind` would leave it.
        pending = at
        while True:
            buckets[bucket] = pending
            won = buckets[bucket] == pending
            bucket_of[pending[won]] = bucket[won]
            if won.all():
                break
            pending = pending[~won]
            bucket = self._next_empty((bucket[~won] + 1) & mask)
        self._len += n
        return True

    def _next_empty(self, bucket: np.ndarray) -> np.ndarray:
        """The first empty bucket at or after each of `bucket`, WINDOW buckets a numpy pass."""
        mask, buckets = self._mask, self._np_buckets
        out = bucket.copy()
        todo = np.arange(out.size)
        while todo.size:
            at = (out[todo, None] + _WINDOW_STEPS - 1) & mask
            empty = buckets[at] == _EMPTY
            first = empty.argmax(axis=1)
            rows = np.arange(todo.size)
            found = empty[rows, first]
            out[todo] = np.where(found, at[rows, first], (at[:, -1] + 1) & mask)
            todo = todo[~found]
        return out

    def ids_of(self, slots) -> list[bytes]:
        """`id_of` of each slot, in order (numpy from MANY slots)."""
        c = self._c or self._native()
        if c is not None:
            out = c.ids_of(slots)
            if type(out) is int:  # a slot out of range or holding no key: named below
                return [self.id_of(slots[out])]
            return out
        if len(slots) < MANY:
            id_of = self.id_of
            return [id_of(slot) for slot in slots]
        at = np.asarray(slots, dtype=np.int64)
        if (self._np_bucket_of[at] == _EMPTY).any():
            empty = int(at[self._np_bucket_of[at] == _EMPTY][0])
            raise ValueError(f"slot {empty} holds no key")
        # One 16-byte void element per id reads back as a bytes object, no slicing loop.
        return self._np_ids[at].view(f"V{_W}").ravel().tolist()

    def unbind(self, slot: int) -> None:
        """Forget the key of `slot` (no-op if it holds none)."""
        c = self._c or self._native()
        if c is not None:
            if c.unbind(slot):
                self._len -= 1
            return
        bucket_of = self._bucket_of
        hole = bucket_of[slot]
        if hole == _EMPTY:
            return
        bucket_of[slot] = _EMPTY
        self._len -= 1
        buckets, home_of, mask = self._buckets, self._home, self._mask
        buckets[hole] = _EMPTY
        # Backward shift: pull later entries of the probe run into the hole when the hole
        # lies cyclically between their home and where they sit.
        b = (hole + 1) & mask
        while True:
            other = buckets[b]
            if other == _EMPTY:
                return
            home = home_of[other]
            if (b - home) & mask >= (b - hole) & mask:
                buckets[hole] = other
                bucket_of[other] = hole
                buckets[b] = _EMPTY
                hole = b
            b = (b + 1) & mask

    def unbind_many(self, slots) -> None:
        """`unbind` of each slot, in order."""
        c = self._c or self._native()
        if c is not None:
            self._len -= c.unbind_many(slots)
            return
        unbind = self.unbind
        for slot in slots:
            unbind(slot)

    def id_of(self, slot: int) -> bytes:
        """The key id `slot` holds; ValueError when it holds none."""
        if slot < 0:  # (a negative index would read another slot)
            raise IndexError(f"slot {slot} out of range")
        if self._bucket_of[slot] == _EMPTY:
            raise ValueError(f"slot {slot} holds no key")
        at = slot * _W
        return bytes(self._ids[at : at + _W])

    def holds_key(self, slot: int) -> bool:
        return self._bucket_of[slot] != _EMPTY

    def keyed(self, slots: np.ndarray) -> np.ndarray:
        """`holds_key` of each slot of an int64 array, as a bool array."""
        return self._np_bucket_of[slots] != _EMPTY

    @property
    def nbytes(self) -> int:
        return (
            self._buckets.itemsize * len(self._buckets)
            + len(self._ids)
            + self._bucket_of.itemsize * len(self._bucket_of)
            + self._home.itemsize * len(self._home)
        )


class _SlotsByKey(dict):
    """id -> slot; a missing id reads as -1 (dict's own lookup stays in C on a hit)."""

    __slots__ = ()

    def __missing__(self, kid: bytes) -> int:
        return -1


class DictKeyTable:
    """The same map as KeyTable over a dict: about 120 bytes per key instead of 32, and a lookup
    about ten times faster (40 ns against 500 in CPython 3.11). The device tier uses it: its
    pages are few (1e5 where the host tier holds 1e6) and every engine call looks them up."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._map = _SlotsByKey()
        self._ids: list[bytes | None] = [None] * capacity
        self._keyed = bytearray(capacity)  # 1 where the slot holds a key, for the numpy batch checks
        self._np_keyed = np.frombuffer(self._keyed, dtype=np.uint8)
        self.get = self._map.__getitem__  # kid -> slot or -1

    def get_many(self, kids: list[bytes]) -> list[int]:
        """`get` of each id, in order (a miss stays in C: dict.get with a default)."""
        return list(map(self._map.get, kids, itertools.repeat(-1)))

    def get_many_array(self, kids: list[bytes]) -> np.ndarray:
        """`get_many` as an int64 array."""
        return np.fromiter(map(self._map.get, kids, itertools.repeat(-1)), dtype=np.int64, count=len(kids))

    def leading(self, kids) -> list[int]:
        """The slots of the leading ids the table holds (up to the first miss)."""
        out = []
        append, get = out.append, self._map.get
        for kid in kids:
            slot = get(kid)
            if slot is None:
                return out
            append(slot)
        return out

    def get_each(self, kids: list[bytes]) -> Iterator[int]:
        """`get` of each id, in order, as they are read."""
        return map(self._map.get, kids, itertools.repeat(-1))

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, kid: bytes) -> bool:
        return kid in self._map

    def bind(self, kid: bytes, slot: int) -> None:
        """Map `kid` to `slot`. The slot must hold no key, and `kid` must not be mapped."""
        if self._ids[slot] is not None:
            raise ValueError(f"slot {slot} already holds key id {self._ids[slot].hex()}")
        other = self._map.get(kid)
        if other is not None:
            raise ValueError(f"key id {kid.hex()} is already in slot {other}")
        self._map[kid] = slot
        self._ids[slot] = kid
        self._keyed[slot] = 1

    def bind_many(self, kids: list[bytes], slots: list[int]) -> None:
        """`bind` of each id to its slot (distinct slots); nothing changes when one cannot be bound."""
        ids, table = self._ids, self._map
        if any(map(ids.__getitem__, slots)):
            taken = next(slot for slot in slots if ids[slot] is not None)
            raise ValueError(f"slot {taken} already holds key id {ids[taken].hex()}")
        before = len(table)
        if table.keys().isdisjoint(kids):
            table.update(zip(kids, slots))
            if len(table) == before + len(kids):  # no id repeats within the batch either
                keyed = self._keyed
                for slot, kid in zip(slots, kids):  # (a loop stores faster than map over __setitem__)
                    ids[slot] = kid
                    keyed[slot] = 1
                return
            for kid in kids:  # a repeated id: take the batch back out, then name it
                table.pop(kid, None)
        mapped = table.keys() & kids
        kid = next(iter(mapped)) if mapped else next(k for k in kids if kids.count(k) > 1)
        raise ValueError(f"key id {kid.hex()} is already in slot {table.get(kid, slots[kids.index(kid)])}")

    def unbind(self, slot: int) -> None:
        """Forget the key of `slot` (no-op if it holds none)."""
        kid = self._ids[slot]
        if kid is not None:
            del self._map[kid]
            self._ids[slot] = None
            self._keyed[slot] = 0

    def unbind_many(self, slots) -> None:
        """`unbind` of each slot, in order."""
        unbind = self.unbind
        for slot in slots:
            unbind(slot)

    def id_of(self, slot: int) -> bytes:
        kid = self._ids[slot]
        if kid is None:
            raise ValueError(f"slot {slot} holds no key")
        return kid

    def ids_of(self, slots) -> list[bytes]:
        """`id_of` of each slot, in order."""
        out = list(map(self._ids.__getitem__, slots))
        if None in out:
            raise ValueError(f"slot {slots[out.index(None)]} holds no key")
        return out

    def holds_key(self, slot: int) -> bool:
        return self._ids[slot] is not None

    def keyed(self, slots: np.ndarray) -> np.ndarray:
        """`holds_key` of each slot of an int64 array, as a bool array."""
        return self._np_keyed[slots] != 0
