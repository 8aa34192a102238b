"""The page table of one tier: key -> slot, slot states, pins, free list, eviction order.

Owns every fact about a tier's slots. A slot is evictable exactly when it is keyed and
readable (RESIDENT or DIRTY), no engine holds it (`pins`), and no copy uses it (`busy`);
the eviction policy sees exactly those slots. It must never move bytes or take locks:
the pool serializes calls.
"""

from __future__ import annotations

from kvtier.index.eviction import EvictionPolicy
from kvtier.index.states import KEYED, PageState, check_transition

_EVICTABLE = (PageState.RESIDENT, PageState.DIRTY)


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
        old = self.state[slot]
        check_transition(self.name, slot, old, new)
        self.state[slot] = new
        self.counts[old] -= 1
        self.counts[new] += 1
        if new == PageState.FREE:
            key = self.keys[slot]
            if key is not None:
                del self.table[key]
                self.keys[slot] = None
            self.hits[slot] = 0
            self.free.append(slot)
        self._refresh(slot)

    def _refresh(self, slot: int) -> None:
        if self.state[slot] in _EVICTABLE and not self.pins[slot] and not self.busy[slot]:
            self.policy.add(slot)
        else:
            self.policy.remove(slot)

    # --- slots ---------------------------------------------------------------------------
    def take_free(self, n: int, state: PageState) -> list[int]:
        """Up to n free slots, moved to `state` (FILLING or LOADING)."""
        take = min(n, len(self.free))
        slots = [self.free.pop() for _ in range(take)]
        for slot in slots:
            self.set_state(slot, state)
        return slots

    def bind(self, slot: int, key) -> None:
        if key in self.table:
            raise ValueError(f"{self.name}: key {key!r} already in slot {self.table[key]}")
        assert self.keys[slot] is None, f"{self.name} slot {slot} already keyed"
        self.table[key] = slot
        self.keys[slot] = key

    def lookup(self, key) -> int | None:
        return self.table.get(key)

    def readable_slot(self, key) -> int | None:
        slot = self.table.get(key)
        if slot is None or self.state[slot] not in (PageState.RESIDENT, PageState.DIRTY, PageState.OFFLOADING):
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

    def hold(self, slot: int) -> None:
        """A copy starts using the slot."""
        self.busy[slot] += 1
        self.policy.remove(slot)

    def unhold(self, slot: int) -> None:
        assert self.busy[slot] > 0, f"{self.name} slot {slot} has no copy in flight"
        self.busy[slot] -= 1
        if not self.busy[slot]:
            self._refresh(slot)

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

    def is_keyed(self, slot: int) -> bool:
        return self.state[slot] in KEYED

    def state_counts(self) -> dict[str, int]:
        return {s.name.lower(): self.counts[s] for s in PageState}

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_evictable(self) -> int:
        return len(self.policy)
