"""The page table of one tier: key id -> slot, slot states, pins, free list, eviction order.

Owns every fact about a tier's slots, in flat arrays (no Python object per slot): about 70
bytes per slot whatever the tier holds (with the compact key table; the device tier, which
has few slots and many lookups, keys them through a dict instead), and every operation O(the slots it is given), never
O(capacity). A slot is evictable exactly when it is keyed and readable (RESIDENT or DIRTY),
no engine holds it (`pins`) and no copy uses it (`busy`); the eviction policy sees exactly
those slots. DIRTY slots are also kept on a list of their own, so finding what is not yet
durable costs O(dirty pages). Counts of slots per state, held and busy are kept as they
change, so statistics cost O(1).

It must never move bytes or take locks: the pool serializes calls.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

import numpy as np

from kvtier.index import native
from kvtier.index.eviction import EvictionPolicy
from kvtier.index.key_table import MANY, DictKeyTable, KeyTable
from kvtier.index.slot_list import BULK, SlotList
from kvtier.index.states import LEGAL, READABLE, PageState, check_transition

S = PageState
_FREE, _DIRTY, _FILLING = int(S.FREE), int(S.DIRTY), int(S.FILLING)
_LEGAL_TO = {new: [row[new] for row in LEGAL] for new in PageState}
_EVICTABLE = [s in (S.RESIDENT, S.DIRTY) for s in PageState]
_READABLE = [s in READABLE for s in PageState]
_HITS_MAX = 255
_NP_EVICTABLE = np.array(_EVICTABLE)
_NP_READABLE = np.array(_READABLE)
_NP_LEGAL_TO = {new: np.array(row) for new, row in _LEGAL_TO.items()}
# The same tables for the C paths (kvtier.index.native's States): legal[old * 6 + new].
_C_LEGAL = bytes(LEGAL[old][new] for old in PageState for new in PageState)
_C_EVICTABLE = bytes(_EVICTABLE)


_POSITIONS = np.arange(1 << 16, dtype=np.int32)
# Binds of this many slots and more go through the table's bind_many (as fast as one bind at a
# time at 16 slots through the dict table, 1.2x faster at 256; slower below 16).
_BIND_BATCH = 16


class TierIndex:
    def __init__(self, name: str, capacity: int, policy: EvictionPolicy, compact_keys: bool = True) -> None:
        if policy.capacity != capacity:
            raise ValueError(f"{name}: eviction policy sized for {policy.capacity} slots, tier has {capacity}")
        self.name = name
        self.capacity = capacity
        self.policy = policy
        # compact_keys: the key table in flat arrays (32 B a slot, for tiers of millions of pages);
        # else over a dict (about 120 B a key, lookups about ten times faster).
        self.table = KeyTable(capacity) if compact_keys else DictKeyTable(capacity)
        self.state = bytearray(capacity)  # PageState values; FREE is 0
        self.pins = array("i", [0]) * capacity  # engine holds (allocate, acquire, load), dropped by release
        self.busy = array("i", [0]) * capacity  # copies in flight that read or write the slot
        self.hits = bytearray(capacity)  # uses, saturating at 255 (write policies look for >= 2)
        # Scratch for `_unique_slots`: each slot's position in the batch being checked.
        self._stamp = np.zeros(capacity, dtype=np.int32)
        self.dirty = SlotList(capacity)
        self.free = array("i", range(capacity - 1, -1, -1))  # a stack: slot 0 is handed out first
        self.counts = [0] * len(PageState)
        self.counts[S.FREE] = capacity
        self.held = 0  # slots with pins > 0
        self.busy_slots = 0  # slots with busy > 0
        # numpy views of the same arrays (no copy) for the batch paths.
        self._np_state = np.frombuffer(self.state, dtype=np.uint8)
        self._np_pins = np.frombuffer(self.pins, dtype=np.int32)
        self._np_busy = np.frombuffer(self.busy, dtype=np.int32)
        self._np_hits = np.frombuffer(self.hits, dtype=np.uint8)
        self._c = None  # the C state changes of these arrays, once kvtier.index.native is loaded

    def _native(self):
        """The C state changes of this tier's arrays, or None while the C library is not loaded."""
        return native.attach(self, "States", self.state, self.pins, self.busy, self.hits, _C_LEGAL, _C_EVICTABLE)

    def _unique_slots(self, slots, distinct: bool = False) -> np.ndarray | None:
        """A long batch as an int64 array when no slot repeats in it (the numpy paths' condition),
        else None (the one-at-a-time loops, which apply repeats in order). Each slot's position
        is written to a scratch array and read back: a repeated slot reads back one position at
        both places (13 µs for 4,096 slots, against 358 for np.unique's sort, on a 2-core VM).
        distinct: the caller knows no slot repeats (the slots of distinct keys): no check."""
        n = len(slots)
        if n < BULK:
            return None
        at = slots if type(slots) is np.ndarray else np.fromiter(slots, dtype=np.int64, count=n)
        if distinct:
            return at
        positions = _POSITIONS[:n] if n <= _POSITIONS.size else np.arange(n, dtype=np.int32)
        stamp = self._stamp
        stamp[at] = positions
        if not np.array_equal(stamp[at], positions):
            return None
        return at

    # --- lookups -----------------------------------------------------------------------------
    def lookup(self, kid: bytes) -> int:
        """The slot keyed by `kid` in any state, or -1."""
        return self.table.get(kid)

    def readable_slot(self, kid: bytes) -> int:
        """The slot keyed by `kid` if its bytes are readable now, else -1."""
        slot = self.table.get(kid)
        if slot >= 0 and not _READABLE[self.state[slot]]:
            return -1
        return slot

    def id_of(self, slot: int) -> bytes:
        return self.table.id_of(slot)

    def ids_of(self, slots: Sequence[int]) -> list[bytes]:
        """The key id of each slot, in order (every one must hold a key)."""
        return self.table.ids_of(slots)

    def partition(self, kids: list[bytes], slots: list[int]) -> tuple[list[bytes], list[int], list[int], list[int]]:
        """Pairs (id, slot elsewhere) split by whether this tier holds the id: (ids it does not
        hold, their slots, slots of the ids it holds, where it holds them), each in order; no
        loop when it holds none (a commit of fresh pages)."""
        found = self.table.get_many(kids)
        if max(found, default=-1) < 0:
            return kids, slots, [], []
        absent = [i for i, at in enumerate(found) if at < 0]
        held = [i for i, at in enumerate(found) if at >= 0]
        return [kids[i] for i in absent], [slots[i] for i in absent], [slots[i] for i in held], [found[i] for i in held]

    def dirty_kept(self, keep=None, ordered: bool = True) -> list[int]:
        """DIRTY slots whose hit counts `keep` accepts (None: every one), oldest first, or in no
        particular order (faster for many) when not `ordered`."""
        dirty = self.dirty.first(len(self.dirty)) if ordered else self.dirty.members()
        if keep is None:
            return dirty
        hits = self.hits
        return [slot for slot in dirty if keep(hits[slot])]

    def idle(self, slots: Sequence[int]) -> list[int]:
        """The slots of `slots` no copy is using, in order (in C, else long batches in numpy)."""
        c = self._c or self._native()
        if c is not None:
            return c.idle(slots)
        if len(slots) >= BULK:
            at = np.asarray(slots, dtype=np.int64)
            return at[self._np_busy[at] == 0].tolist()
        busy = self.busy
        return [slot for slot in slots if not busy[slot]]

    def first_unfresh(self, slots: Sequence[int]) -> int:
        """The first of `slots` that is not an allocated, uncommitted slot an engine holds
        (FILLING, unkeyed, pinned, no copy in flight), or -1. Long batches in numpy."""
        if len(slots) >= BULK:
            at = np.asarray(slots, dtype=np.int64)
            bad = ((self._np_state[at] != _FILLING) | (self._np_pins[at] == 0) | (self._np_busy[at] != 0)
                   | self.table.keyed(at))
            return int(at[bad.argmax()]) if bad.any() else -1
        state, pins, busy, holds_key = self.state, self.pins, self.busy, self.table.holds_key
        for slot in slots:
            if state[slot] != _FILLING or not pins[slot] or busy[slot] or holds_key(slot):
                return slot
        return -1

    def slots_in(self, state: PageState) -> list[int]:
        """Every slot in `state` (one vectorized scan of the states: O(capacity) in C)."""
        return np.flatnonzero(self._np_state == state).tolist()

    def evictable(self, slot: int) -> bool:
        return slot in self.policy

    # --- state ---------------------------------------------------------------------------
    def set_state(self, slot: int, new: PageState) -> None:
        self.set_states((slot,), new)

    def set_states(self, slots: Sequence[int], new: PageState, busy_delta: int = 0, distinct: bool = False) -> None:
        """Move every slot to `new` (each transition checked), and change its copies in
        flight by `busy_delta` (+1: a copy starts using it, -1: a copy finished).

        One loop for the whole batch: this is the pool's hot path. Moving to FREE forgets the
        key and returns the slot to the free list. distinct: the caller knows no slot repeats
        (slots of distinct keys, or fresh from the free list), so a long batch skips that check.
        """
        if not len(slots):
            return
        c = self._c or self._native()
        if c is not None:
            changes = c.set(slots, new, busy_delta)
            if changes is not None:  # (else a repeat or a fault: the loops below apply or name it)
                self._apply(changes, slots, new)
                return
        elif new != _FREE and len(slots) >= BULK and self._set_states_bulk(slots, new, busy_delta, distinct):
            return
        state, counts, pins, busy, dirty = self.state, self.counts, self.pins, self.busy, self.dirty
        legal, evictable, was_evictable = _LEGAL_TO[new], _EVICTABLE[new], _EVICTABLE
        into_dirty = new == _DIRTY
        count = 0
        # Three loops, one per kind of change, each as short as it can be: this loop runs for
        # every page of every call. A slot is in the eviction order exactly when its state is
        # evictable and it is neither pinned nor busy.
        # The eviction-order changes go over in one call at the end (numpy for a long batch, one
        # inline loop for a short one).
        adds, removes = [], []
        listing = None
        if new == _FREE:
            unbind, hits, free = self.table.unbind, self.hits, self.free
            remove = removes.append
            for slot in slots:
                old = state[slot]
                if not legal[old]:
                    check_transition(self.name, slot, PageState(old), new)
                assert not pins[slot] and not busy[slot] + busy_delta, f"{self.name} slot {slot} freed while held or busy"
                if busy_delta:
                    busy[slot] = 0
                    self.busy_slots -= 1
                elif was_evictable[old]:
                    remove(slot)
                if old == _DIRTY:
                    dirty.discard(slot)
                state[slot] = _FREE
                counts[old] -= 1
                unbind(slot)
                hits[slot] = 0
                free.append(slot)
                count += 1
        elif not busy_delta:
            add, remove = adds.append, removes.append
            # Slots turning DIRTY join the dirty list at the end, in one chain after the loop
            # (each is off it by then: a slot that was DIRTY left it first), unless one repeats.
            listing = [] if into_dirty else None
            for slot in slots:
                old = state[slot]
                if not legal[old]:
                    check_transition(self.name, slot, PageState(old), new)
                state[slot] = new
                counts[old] -= 1
                count += 1
                if old == _DIRTY:
                    dirty.discard(slot)
                if into_dirty:
                    listing.append(slot)
                if evictable != was_evictable[old] and not busy[slot] and not pins[slot]:
                    if evictable:
                        add(slot)
                    else:
                        remove(slot)
        else:
            add, remove = adds.append, removes.append
            listing = [] if into_dirty else None
            for slot in slots:
                old = state[slot]
                if not legal[old]:
                    check_transition(self.name, slot, PageState(old), new)
                state[slot] = new
                counts[old] -= 1
                count += 1
                if old == _DIRTY:
                    dirty.discard(slot)
                if into_dirty:
                    listing.append(slot)
                before = busy[slot]
                after = before + busy_delta
                assert after >= 0, f"{self.name} slot {slot} has no copy in flight"
                busy[slot] = after
                if not before:
                    self.busy_slots += 1
                    if was_evictable[old] and not pins[slot]:
                        remove(slot)
                elif not after:
                    self.busy_slots -= 1
                    if evictable and not pins[slot]:
                        add(slot)
        counts[new] += count
        if listing:
            if len(set(listing)) == len(listing):
                dirty.extend_unlisted(listing)
            else:
                dirty.extend(listing)
        if removes:  # each loop above only adds or only removes
            self.policy.remove_many(removes)
        if adds:
            self.policy.add_many(adds)

    def _apply(self, changes: tuple, slots, new: PageState) -> None:
        """The rest of `set_states` after its C pass changed the slots' states, copies and hits:
        counts, the dirty list, keys and the free list of freed slots, the eviction order (in
        the order the loops apply them)."""
        left, adds, removes, undirty, freed, busy_change = changes
        counts = self.counts
        for st, n in enumerate(left):
            counts[st] -= n
        counts[new] += len(slots)
        self.busy_slots += busy_change
        if undirty:
            self.dirty.discard_many(undirty)
        if new == _DIRTY:
            self.dirty.extend(slots)
        if freed:
            self.table.unbind_many(freed)
            self.free.extend(freed)
        if removes:
            self.policy.remove_many(removes)
        if adds:
            self.policy.add_many(adds)

    def _set_states_bulk(self, slots: Sequence[int], new: PageState, busy_delta: int, distinct: bool) -> bool:
        """`set_states` of a long batch of distinct slots to a state other than FREE, in numpy;
        False (nothing changed) when a slot repeats or a transition is illegal, for the loops to
        apply or report."""
        at = self._unique_slots(slots, distinct)
        if at is None:
            return False
        state, busy, pins = self._np_state, self._np_busy, self._np_pins
        old = state[at]
        if not _NP_LEGAL_TO[new][old].all():
            return False
        before = busy[at]
        after = before + busy_delta
        if busy_delta and (after < 0).any():
            return False  # the loop names the slot
        evictable = _EVICTABLE[new]
        unpinned = pins[at] == 0
        if busy_delta > 0:  # copies start: slots idle before leave the eviction order
            started = before == 0
            self.busy_slots += int(started.sum())
            leaving = at[started & _NP_EVICTABLE[old] & unpinned]
            joining = at[:0]
            busy[at] = after
        elif busy_delta:  # copies end: slots idle now may join it
            ended = after == 0
            self.busy_slots -= int(ended.sum())
            leaving = at[:0]
            joining = at[ended & unpinned] if evictable else at[:0]
            busy[at] = after
        else:
            changes = (_NP_EVICTABLE[old] != evictable) & (before == 0) & unpinned
            leaving = at[:0] if evictable else at[changes]
            joining = at[changes] if evictable else at[:0]
        state[at] = new
        counts = self.counts
        for st, n in enumerate(np.bincount(old, minlength=len(counts)).tolist()):
            counts[st] -= n
        counts[new] += at.size
        if new == _DIRTY:
            self.dirty.extend_distinct(at)  # moved to the end, in order, as the loop appends
        else:
            was_dirty = at[old == _DIRTY]
            if was_dirty.size:
                self.dirty.discard_distinct(was_dirty)
        if leaving.size:
            self.policy.remove_many_distinct(leaving)
        if joining.size:
            self.policy.add_many_distinct(joining)
        return True

    def _refresh(self, slot: int) -> None:
        if _EVICTABLE[self.state[slot]] and not self.pins[slot] and not self.busy[slot]:
            self.policy.add(slot)
        else:
            self.policy.remove(slot)

    # --- slots ---------------------------------------------------------------------------
    def take_free(self, n: int, state: PageState, busy_delta: int = 0) -> list[int]:
        """Up to n free slots, moved to `state` (FILLING or LOADING), `busy_delta` copies on each."""
        free = self.free
        take = min(n, len(free))
        if not take:
            return []
        if state != S.FILLING and state != S.LOADING:
            raise AssertionError(f"{self.name}: free slots are taken FILLING or LOADING, not {PageState(state).name}")
        slots = free[len(free) - take :].tolist()
        slots.reverse()
        del free[len(free) - take :]
        # A free slot is unkeyed, unheld, idle and on no list, and FILLING and LOADING pages
        # join none: only its state and copies change.
        c = self._c or self._native()
        if c is not None:
            c.mark(slots, state, busy_delta, 0)
        elif take >= BULK:
            at = np.array(slots, dtype=np.int64)
            self._np_state[at] = state
            if busy_delta:
                self._np_busy[at] = busy_delta
        else:
            state_of, busy = self.state, self.busy
            for slot in slots:
                state_of[slot] = state
                if busy_delta:
                    busy[slot] = busy_delta
        self.counts[S.FREE] -= take
        self.counts[state] += take
        if busy_delta:
            self.busy_slots += take
        return slots

    def take_loading(self, n: int) -> list[int]:
        """n free slots (the caller checked there are enough), LOADING, one copy in flight and held
        by the engine, in one pass instead of three (take, pin, copy): what a load's new pages are
        until their bytes land. Not keyed: the caller binds their ids (`table.bind_many`) right
        after queueing their copy, under the same lock."""
        if not n:
            return []
        free = self.free
        if n > len(free):
            raise AssertionError(f"{self.name}: {n} slots wanted, {len(free)} free")
        slots = free[len(free) - n :].tolist()
        slots.reverse()
        del free[len(free) - n :]
        state, pins, busy = self.state, self.pins, self.busy
        loading = int(S.LOADING)
        c = self._c or self._native()
        if c is not None:
            c.mark(slots, loading, 1, 1)
        elif n >= BULK:  # free slots never repeat
            at = np.array(slots, dtype=np.int64)
            self._np_state[at] = loading
            self._np_busy[at] = 1
            self._np_pins[at] = 1
        else:
            for slot in slots:
                state[slot] = loading
                busy[slot] = 1
                pins[slot] = 1
        self.counts[S.FREE] -= n
        self.counts[S.LOADING] += n
        self.busy_slots += n
        self.held += n
        return slots

    def reuse(self, slots: Iterable[int], state: PageState, busy_delta: int = 0) -> None:
        """Evict keyed, evictable slots (RESIDENT, or DIRTY pages the caller lets go) and hand
        them straight to a new page in `state` (LOADING), `busy_delta` copies on each: the same
        as moving them to FREE and taking them back, in one pass."""
        c = self._c or self._native()
        if c is not None:
            if type(slots) not in (list, tuple) and not isinstance(slots, np.ndarray):
                slots = list(slots)
            assert _LEGAL_TO[state][_FREE], f"{self.name}: FREE -> {PageState(state).name} is illegal"
            done = c.reuse(slots, state, busy_delta)
            if done is not None:  # (else a repeat, or a slot not evictable: the loop below)
                left, undirty = done
                self.policy.remove_many(slots)
                if undirty:
                    self.dirty.discard_many(undirty)
                self.table.unbind_many(slots)
                counts = self.counts
                for st, n in enumerate(left):
                    counts[st] -= n
                counts[state] += len(slots)
                if busy_delta:
                    self.busy_slots += len(slots)
                return
        elif self._reuse_bulk(slots, state, busy_delta):
            return
        state_of, counts, pins, busy, dirty = self.state, self.counts, self.pins, self.busy, self.dirty
        unbind, hits, remove = self.table.unbind, self.hits, self.policy.remove
        legal = _LEGAL_TO[state]
        count = 0
        for slot in slots:
            old = state_of[slot]
            if not _EVICTABLE[old] or pins[slot] or busy[slot]:
                raise AssertionError(f"{self.name} slot {slot} reused while {PageState(old).name}, pinned or busy")
            remove(slot)
            if old == _DIRTY:
                dirty.discard(slot)
            unbind(slot)
            hits[slot] = 0
            state_of[slot] = state
            counts[old] -= 1
            count += 1
            if busy_delta:
                busy[slot] = busy_delta
        if count:
            assert legal[_FREE], f"{self.name}: FREE -> {PageState(state).name} is illegal"
            counts[state] += count
            if busy_delta:
                self.busy_slots += count

    def _reuse_bulk(self, slots, state: PageState, busy_delta: int) -> bool:
        """`reuse` of a long batch of distinct evictable, unpinned, idle slots in numpy (the keys
        still go one `unbind` at a time: the table's own structure); False, nothing changed,
        for the loop to apply or report otherwise."""
        at = self._unique_slots(slots)
        if at is None:
            return False
        old = self._np_state[at]
        if not (_NP_EVICTABLE[old].all() and not self._np_pins[at].any() and not self._np_busy[at].any()):
            return False
        assert _LEGAL_TO[state][_FREE], f"{self.name}: FREE -> {PageState(state).name} is illegal"
        self.policy.remove_many_distinct(at)
        was_dirty = at[old == _DIRTY]
        if was_dirty.size:
            self.dirty.discard_distinct(was_dirty)
        unbind = self.table.unbind
        for slot in at.tolist():
            unbind(slot)
        self._np_hits[at] = 0
        self._np_state[at] = state
        counts = self.counts
        for st, n in enumerate(np.bincount(old, minlength=len(counts)).tolist()):
            counts[st] -= n
        counts[state] += at.size
        if busy_delta:
            self._np_busy[at] = busy_delta
            self.busy_slots += at.size
        return True

    def bind_all(self, slots: Sequence[int], kids: Sequence[bytes]) -> None:
        """Key each slot (FILLING or LOADING, unkeyed) with its id: from _BIND_BATCH slots in
        the table's batch bind (the dict's in C, the compact table's in one inline loop or in
        numpy), below it one `bind` at a time (the batch bind's checks cost more there)."""
        if len(slots) >= _BIND_BATCH:
            self.table.bind_many(kids, slots)
            return
        bind = self.table.bind
        for slot, kid in zip(slots, kids):
            bind(kid, slot)

    def key_filled(self, slots: list[int], kids: list[bytes], clean: set[int] | None = None) -> None:
        """Distinct FILLING slots the engine holds, idle and unkeyed (as `first_unfresh` found
        them), take their keys and become DIRTY pages, or RESIDENT where in `clean`: one pass
        with no transition checks (both are legal from FILLING, and a held slot joins no
        eviction order until the engine lets it go)."""
        n = len(slots)
        if not n:
            return
        self.bind_all(slots, kids)
        dirty = [slot for slot in slots if slot not in clean] if clean else slots
        if n >= BULK:
            self._np_state[np.array(slots, dtype=np.int64)] = _DIRTY
            if clean:
                self._np_state[np.array(list(clean), dtype=np.int64)] = int(S.RESIDENT)
            if dirty:
                self.dirty.extend_distinct(np.array(dirty, dtype=np.int64))
        else:
            state = self.state
            for slot in dirty:
                state[slot] = _DIRTY
            if clean:
                resident = int(S.RESIDENT)
                for slot in clean:
                    state[slot] = resident
            if dirty:
                self.dirty.extend_unlisted(dirty)
        counts = self.counts
        counts[_FILLING] -= n
        counts[_DIRTY] += len(dirty)
        counts[S.RESIDENT] += n - len(dirty)

    def commit_fresh(self, slots, kids: list[bytes], host: TierIndex) -> tuple[list[int], list[bytes], int] | None:
        """A commit's bookkeeping in one C pass (this is the device tier): the checks of
        `check_slots` and `first_unfresh`, the partitions by this tier's and `host`'s tables, and
        `key_filled` (see the C `States.commit`). `kids` are distinct. Returns (the slots and ids
        `host` lacks, how many slots were keyed), or None, with nothing changed, when C is not
        loaded or it found a fault: the caller's Python path names it."""
        c = self._c or self._native()
        if c is None or type(self.table) is not KeyTable or type(host.table) is not KeyTable:
            return None  # (the dict table of a device tier made before C was loaded)
        done = c.commit(slots, kids, self.table._c or self.table._native(), host.table._c or host.table._native(),
                        host._c or host._native())
        if done is None:
            return None
        dirty, absent_slots, absent_ids, keyed, clean = done
        self.table._len += keyed
        if dirty:
            self.dirty.extend_unlisted(dirty)
        counts = self.counts
        counts[_FILLING] -= keyed
        counts[_DIRTY] += keyed - clean
        counts[S.RESIDENT] += clean
        return absent_slots, absent_ids, keyed

    def pin(self, slot: int) -> None:
        if not self.pins[slot]:
            self.held += 1
        self.pins[slot] += 1
        self.policy.remove(slot)

    def pin_all(self, slots: Iterable[int]) -> None:
        """Pin slots that are not in the eviction order (FILLING or LOADING ones)."""
        pins = self.pins
        for slot in slots:
            if not pins[slot]:
                self.held += 1
            pins[slot] += 1

    def unpin_all(self, slots: Iterable[int]) -> list[int]:
        """Drop one engine hold on each slot (every one must be held); returns the slots left
        unheld in FILLING and idle, which the caller frees."""
        c = self._c or self._native()
        if c is not None:
            if type(slots) not in (list, tuple) and not isinstance(slots, np.ndarray):
                slots = list(slots)
            done = c.unpin(slots)
            if done is not None:  # (else a repeat, or a slot not held: the loop below)
                adds, idle_filling, unheld = done
                self.held -= unheld
                if adds:
                    self.policy.add_many(adds)
                return idle_filling
        pins, state, busy = self.pins, self.state, self.busy
        adds: list[int] = []
        evictable, add = _EVICTABLE, adds.append
        filling = int(S.FILLING)
        idle_filling = []
        for slot in slots:
            left = pins[slot] - 1
            if left < 0:
                raise ValueError(f"{self.name} slot {slot} is not held by the engine (state {PageState(state[slot]).name})")
            pins[slot] = left
            if left:
                continue
            self.held -= 1
            st = state[slot]
            if busy[slot]:
                continue
            if evictable[st]:
                add(slot)
            elif st == filling:
                idle_filling.append(slot)
        if adds:
            self.policy.add_many(adds)
        return idle_filling

    def unpin(self, slot: int) -> None:
        if self.pins[slot] <= 0:
            raise ValueError(f"{self.name} slot {slot} is not held by the engine (state {PageState(self.state[slot]).name})")
        self.pins[slot] -= 1
        if not self.pins[slot]:
            self.held -= 1
            self._refresh(slot)

    def hold_readable(self, kids: list[bytes]) -> list[int] | None:
        """The slots of distinct ids, held (`hold_all`, touched) when every id is keyed here and
        readable; else None, with nothing held. One C pass where C is loaded; else from MANY ids
        the lookup, the check and the hold share one int64 array."""
        if not kids:
            return []
        c = self._c or self._native()
        if c is not None and type(self.table) is KeyTable and type(kids) is list:  # one C pass
            held = c.hold_keyed(kids, self.table._c or self.table._native(), True)
            if held is None:
                return None
            slots, idle = held
            self.busy_slots += idle
            self.policy.remove_many(slots)
            return slots
        if len(kids) < MANY:
            slots = self.table.get_many(kids)
            if min(slots) < 0 or not all(map(_READABLE.__getitem__, map(self.state.__getitem__, slots))):
                return None
            self.hold_all(slots, touch=True, distinct=True)
            return slots
        at = self.table.get_many_array(kids)
        if at.min() < 0 or not _NP_READABLE[self._np_state[at]].all():
            return None
        self.hold_all(at, touch=True, distinct=True)
        return at.tolist()

    def hold_all(self, slots: Iterable[int], touch: bool = False, distinct: bool = False) -> None:
        """A copy starts reading or writing each slot: none is evicted until `unhold_all`.
        distinct: the caller knows no slot repeats (as for `set_states`)."""
        c = self._c or self._native()
        if c is not None:
            if type(slots) not in (list, tuple) and not isinstance(slots, np.ndarray):
                slots = list(slots)
            self.busy_slots += c.hold(slots, touch)
            self.policy.remove_many(slots)
            return
        at = self._unique_slots(slots, distinct)
        if at is not None:
            before = self._np_busy[at]
            self.busy_slots += int((before == 0).sum())
            self._np_busy[at] = before + 1
            self.policy.remove_many_distinct(at)
            if touch:
                hits = self._np_hits
                hits[at] = np.minimum(hits[at].astype(np.int16) + 1, _HITS_MAX)
            return
        busy, hits = self.busy, self.hits
        idle = 0
        for slot in slots:
            if not busy[slot]:
                idle += 1
            busy[slot] += 1
            if touch and hits[slot] < _HITS_MAX:
                hits[slot] += 1
        self.busy_slots += idle
        # Out of the eviction order in one call (no call per slot): a repeated slot leaves once,
        # as its first `remove` would have left it.
        self.policy.remove_many(slots if isinstance(slots, (list, tuple)) else list(slots))

    def unhold_all(self, slots: Iterable[int], distinct: bool = False) -> None:
        c = self._c or self._native()
        if c is not None:
            if type(slots) not in (list, tuple) and not isinstance(slots, np.ndarray):
                slots = list(slots)
            done = c.unhold(slots)
            if done is not None:  # (else a repeat, or a slot with no copy: the loop below)
                adds, idle = done
                self.busy_slots -= idle
                if adds:
                    self.policy.add_many(adds)
                return
        at = self._unique_slots(slots, distinct) if c is None else None
        if at is not None:
            left = self._np_busy[at] - 1
            if not (left < 0).any():  # else the loop names the slot
                self._np_busy[at] = left
                idle = left == 0
                self.busy_slots -= int(idle.sum())
                joining = at[idle & (self._np_pins[at] == 0) & _NP_EVICTABLE[self._np_state[at]]]
                if joining.size:
                    self.policy.add_many_distinct(joining)
                return
        busy, pins, state = self.busy, self.pins, self.state
        adds = []
        evictable, add = _EVICTABLE, adds.append
        for slot in slots:
            left = busy[slot] - 1
            assert left >= 0, f"{self.name} slot {slot} has no copy in flight"
            busy[slot] = left
            if not left:
                self.busy_slots -= 1
                if not pins[slot] and evictable[state[slot]]:
                    add(slot)
        if adds:  # into the eviction order in one call, in order (no call per slot)
            self.policy.add_many(adds)

    def touch(self, slot: int) -> None:
        if self.hits[slot] < _HITS_MAX:
            self.hits[slot] += 1
        self.policy.touch(slot)

    def touch_all(self, slots: list[int]) -> None:
        """`touch` of each slot, in order."""
        c = self._c or self._native()
        if c is not None:
            c.touch(slots)
            self.policy.touch_many(slots)
            return
        at = self._unique_slots(slots)
        if at is not None:
            hits = self._np_hits
            hits[at] = np.minimum(hits[at], _HITS_MAX - 1) + 1
            self.policy.touch_many_distinct(at)
            return
        hits = self.hits
        for slot in slots:
            if hits[slot] < _HITS_MAX:
                hits[slot] += 1
        self.policy.touch_many(slots)

    def victims(self, n: int) -> list[int]:
        """Up to n evictable slots, first victim first (reads at most n entries)."""
        return self.policy.victims(n)

    def check(self) -> None:
        """Raise AssertionError naming the first slot whose facts disagree (tests call this after
        stress; it is O(capacity), never called by the pool)."""
        counts = [0] * len(PageState)
        free = set(self.free)
        assert len(free) == len(self.free), f"{self.name}: a slot is twice in the free list"
        for slot in range(self.capacity):
            st = self.state[slot]
            counts[st] += 1
            listed = _EVICTABLE[st] and not self.pins[slot] and not self.busy[slot]
            assert (slot in self.policy) == listed, (
                f"{self.name} slot {slot}: {PageState(st).name} pins {self.pins[slot]} busy {self.busy[slot]} "
                f"{'is' if slot in self.policy else 'is not'} in the eviction order"
            )
            assert (slot in self.dirty) == (st == _DIRTY), f"{self.name} slot {slot}: dirty list disagrees with {PageState(st).name}"
            assert (slot in free) == (st == _FREE), f"{self.name} slot {slot}: free list disagrees with {PageState(st).name}"
            keyed = self.table.holds_key(slot)
            if st in (S.RESIDENT, S.DIRTY, S.OFFLOADING):
                assert keyed, f"{self.name} slot {slot}: {PageState(st).name} without a key"
            if st in (S.FREE, S.FILLING):
                assert not keyed, f"{self.name} slot {slot}: {PageState(st).name} with a key"
            if keyed:
                assert self.table.get(self.table.id_of(slot)) == slot, f"{self.name} slot {slot}: key table disagrees"
        assert counts == self.counts, f"{self.name}: counts {self.counts}, slots say {counts}"
        assert self.held == sum(1 for p in self.pins if p), f"{self.name}: held count"
        assert self.busy_slots == sum(1 for b in self.busy if b), f"{self.name}: busy count"

    def state_counts(self) -> dict[str, int]:
        return {s.name.lower(): self.counts[s] for s in PageState}
