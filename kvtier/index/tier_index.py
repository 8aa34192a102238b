"""The page table of one tier: key -> slot, slot states, pins, free list, eviction order.

Owns every fact about a tier's slots. A slot is evictable exactly when it is keyed and
readable (RESIDENT or DIRTY), no engine holds it (`pins`), and no copy uses it (`busy`);
the eviction policy sees exactly those slots. It must never move bytes or take locks:
the pool serializes calls.
"""

from __future__ import annotations

from kvtier.index.eviction import EvictionPolicy
from kvtier.index.states import LEGAL, READABLE, PageState, check_transition

_EVICTABLE = (PageState.RESIDENT, PageState.DIRTY)
_IS_EVICTABLE = [s in _EVICTABLE for s in PageState]


class TierIndex:
    def __init__(self, name: str, capacity: int, policy: EvictionPolicy) -> None:
        self.name = name
        self.capacity = capacity
        self.policy = policy
        self.table: dict = {}
        self.keys: list = [None] * capacity
        self.state: list[PageState] = [PageState.FREE] * capacity
        self.pins = [0] * capacity  # engine holds (allocate, acquire, load), dropped by release
        self.busy = [0] * capacity  # copies in flight that read or write the slot
        self.hits = [0] * capacity
        self.free: list[int] = list(range(capacity - 1, -1, -1))
        self.counts = [0] * len(PageState)
        self.counts[PageState.FREE] = capacity

    # --- state ---------------------------------------------------------------------------
    def set_state(self, slot: int, new: PageState) -> None:
        self.set_states((slot,), new)

    def set_states(self, slots, new: PageState, busy_delta: int = 0) -> None:
        """Move every slot to `new` (each transition checked), and change its copies in
        flight by `busy_delta` (+1: a copy starts using it, -1: a copy finished).

        One loop for the whole batch: this is the pool's hot path.
        """
        state, counts, pins, busy = self.state, self.counts, self.pins, self.busy
        legal = [row[new] for row in LEGAL]
        add, remove = self.policy.add, self.policy.remove
        evictable = _IS_EVICTABLE[new]
        freeing = new == PageState.FREE
        for slot in slots:
            old = state[slot]
            if not legal[old]:
                check_transition(self.name, slot, old, new)
            state[slot] = new
            counts[old] -= 1
            counts[new] += 1
            if busy_delta:
                busy[slot] += busy_delta
                assert busy[slot] >= 0, f"{self.name} slot {slot} has no copy in flight"
            if freeing:
                key = self.keys[slot]
                if key is not None:
                    del self.table[key]
                    self.keys[slot] = None
                self.hits[slot] = 0
                self.free.append(slot)
            if evictable and not pins[slot] and not busy[slot]:
                add(slot)
            else:
                remove(slot)

    def _refresh(self, slot: int) -> None:
        if self.state[slot] in _EVICTABLE and not self.pins[slot] and not self.busy[slot]:
            self.policy.add(slot)
        else:
            self.policy.remove(slot)

    # --- slots ---------------------------------------------------------------------------
    def take_free(self, n: int, state: PageState) -> list[int]:
        """Up to n free slots, moved to `state` (FILLING or LOADING)."""
        take = min(n, len(self.free))
        slots = self.free[len(self.free) - take :][::-1]
        del self.free[len(self.free) - take :]
        self.set_states(slots, state)
        return slots

    def bind_all(self, slots, keys) -> None:
        table, slot_keys = self.table, self.keys
        for slot, key in zip(slots, keys):
            if key in table:
                raise ValueError(f"{self.name}: key {key!r} already in slot {table[key]}")
            table[key] = slot
            slot_keys[slot] = key

    def lookup(self, key) -> int | None:
        return self.table.get(key)

    def readable_slot(self, key) -> int | None:
        slot = self.table.get(key)
        if slot is None or self.state[slot] not in READABLE:
            return None
        return slot

    def leading(self, keys) -> int:
        """How many leading keys are keyed here (landing pages count: copies are ordered)."""
        n = 0
        table = self.table
        for key in keys:
            if key not in table:
                break
            n += 1
        return n

    def pin(self, slot: int) -> None:
        self.pins[slot] += 1
        self.policy.remove(slot)

    def unpin(self, slot: int) -> None:
        if self.pins[slot] <= 0:
            raise ValueError(f"{self.name} slot {slot} is not held by the engine (state {self.state[slot].name})")
        self.pins[slot] -= 1
        if not self.pins[slot]:
            self._refresh(slot)

    def hold_all(self, slots, touch: bool = False) -> None:
        busy, hits, remove = self.busy, self.hits, self.policy.remove
        for slot in slots:
            busy[slot] += 1
            remove(slot)
            if touch:
                hits[slot] += 1

    def unhold_all(self, slots) -> None:
        busy, pins, state, add = self.busy, self.pins, self.state, self.policy.add
        evictable = _IS_EVICTABLE
        for slot in slots:
            busy[slot] -= 1
            assert busy[slot] >= 0, f"{self.name} slot {slot} has no copy in flight"
            if not busy[slot] and not pins[slot] and evictable[state[slot]]:
                add(slot)

    def touch(self, slot: int) -> None:
        self.hits[slot] += 1
        self.policy.touch(slot)

    def victims(self, n: int) -> list[int]:
        out = []
        for slot in self.policy.order():
            if len(out) == n:
                break
            out.append(slot)
        return out

    def state_counts(self) -> dict[str, int]:
        return {s.name.lower(): self.counts[s] for s in PageState}
