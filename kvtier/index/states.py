"""Page states of one tier slot, and the only transitions allowed between them.

Owns the state machine; every state change in the index goes through `check_transition`.
It must never know which tier or engine is involved.

FREE        no page; in the free list.
FILLING     handed to the engine by allocate (or given a private copy); not keyed.
LOADING     bytes of a keyed page are landing from another tier.
RESIDENT    keyed, readable, and the tier below holds it too (or there is no tier below).
DIRTY       keyed, readable, and the tier below does not hold it.
OFFLOADING  keyed, readable, being copied to the tier below.
"""

from __future__ import annotations

from enum import IntEnum


class PageState(IntEnum):
    FREE = 0
    FILLING = 1
    LOADING = 2
    RESIDENT = 3
    DIRTY = 4
    OFFLOADING = 5


S = PageState
ALLOWED: dict[PageState, frozenset[PageState]] = {
    S.FREE: frozenset({S.FILLING, S.LOADING}),
    # FILLING -> LOADING: a slot the engine allocated receives a page from another tier.
    # FILLING -> OFFLOADING: a committed page whose copy to the tier below starts at once.
    S.FILLING: frozenset({S.FREE, S.RESIDENT, S.DIRTY, S.LOADING, S.OFFLOADING}),
    # A load that fails frees the slot; a landed copy is clean or dirty w.r.t. the tier below.
    # LOADING -> FILLING: a reload into a slot the engine holds could not start; the slot goes
    # back to the engine as it was.
    S.LOADING: frozenset({S.FREE, S.RESIDENT, S.DIRTY, S.FILLING}),
    # RESIDENT -> DIRTY when the tier below evicts its copy.
    S.RESIDENT: frozenset({S.FREE, S.DIRTY}),
    # DIRTY -> FREE is a deliberate, counted drop: write_through_selective's unpopular pages, or
    # pages that could not be made durable while the tier below was failing.
    S.DIRTY: frozenset({S.OFFLOADING, S.RESIDENT, S.FREE}),
    # OFFLOADING -> FREE / FILLING: the copy could not encode the page (NaN or Inf under fp8
    # storage), so it leaves the cache; a slot the engine still holds goes back to FILLING.
    S.OFFLOADING: frozenset({S.RESIDENT, S.DIRTY, S.FREE, S.FILLING}),
}
# ALLOWED as a matrix, for the hot path: LEGAL[old][new].
LEGAL = [[new in ALLOWED[old] for new in PageState] for old in PageState]
READABLE = frozenset({S.RESIDENT, S.DIRTY, S.OFFLOADING})


class IllegalTransition(RuntimeError):
    pass


def check_transition(tier: str, slot: int, old: PageState, new: PageState) -> None:
    if new not in ALLOWED[old]:
        allowed = ", ".join(s.name for s in sorted(ALLOWED[old])) or "none"
        raise IllegalTransition(f"{tier} slot {slot}: {old.name} -> {new.name} is illegal (from {old.name}: {allowed})")
