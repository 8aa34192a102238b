"""The pool's map of reloads still landing in device slots (kvtier.pool.landing)."""

from __future__ import annotations

import numpy as np

from kvtier.pool.landing import Landing
from kvtier.transfer import DoneTicket


def test_marks_clears_and_finds_reloads_by_slot():
    landing = Landing(16)
    assert not landing and landing.tickets_of([1, 2]) == [] and landing.ticket_of(3) is None
    first, second = DoneTicket(2), DoneTicket(2)
    a = landing.mark([1, 2, 3], first)
    b = landing.mark(np.array([3, 4], dtype=np.int64), second)  # slot 3 now lands from the second
    assert a != b and landing
    assert landing.ticket_of(1) is first and landing.ticket_of(3) is second and landing.ticket_of(5) is None
    found = landing.tickets_of([2, 3, 4, 9])
    assert len(found) == 2 and {id(t) for t in found} == {id(first), id(second)}
    assert landing.tickets_of([9, 10]) == []
    landing.clear([1, 2, 3], a)  # slot 3 is the second's: it stays
    assert landing.ticket_of(1) is None and landing.ticket_of(3) is second
    assert landing.tickets_of([1, 2, 3]) == [second]
    landing.clear([3, 4], b)
    assert not landing and landing.tickets_of(list(range(16))) == []
    landing.clear([3, 4], b)  # twice (a cancelled chunk, then its copy landing): nothing left to clear
    assert not landing
