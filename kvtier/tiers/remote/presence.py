"""What this process knows is in the remote index, so that asking costs no SQLite read.

A `match` of pages only the remote tier holds asked SQLite each time; SQLite gives up Python's
GIL for the query, and winning it back beside busy threads (the pool's copy, backup and fetch
threads, the engine's) took milliseconds (`benchmarks/pool_overhead.py --sections threads`).
This cache answers "published?" for keys a read found published, with no I/O and no lock.

Correctness rests on one counter in the index, ``meta.removals``, bumped by every transaction
that removes pages (eviction, delete, clear, replacement, a record found unreadable), whatever
process runs it:
- the cache holds the counter value it is valid for (its epoch);
- a read takes the counter *before* it looks the keys up, and adds what it found only while
  that value is still the epoch: a page it saw cannot have been removed before that value;
- once `recheck_s` has passed since the counter was last read, the next answer reads it again
  (one SQLite read) and empties the cache when it moved;
- this process's own removals drop their keys and advance the epoch when they commit;
- a lookup (the read of a page) that finds a key unpublished drops it, whatever the counter.
So a page another process removed is answered "published" for at most `recheck_s`, the same
advice a `match` already is (a page can leave before the `load` that follows, which then
misses); pages this process removed, never. Misses are not cached: a page another process
publishes is seen at once. The cache holds at most `capacity` keys and is emptied when full.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence

RECHECK_S = 1.0
CAPACITY = 1 << 18  # keys (about 30 MB at most)


class PresenceCache:
    def __init__(self, recheck_s: float = RECHECK_S, capacity: int = CAPACITY) -> None:
        self.recheck_s = recheck_s
        self.capacity = capacity
        self._lock = threading.Lock()  # held only for dict updates, never across I/O
        self._epoch: int | None = None  # the removal counter the contents are valid for
        self._checked = float("-inf")  # when the counter was last read and equal to the epoch
        self._known: dict[tuple[bytes, int], set[bytes]] = {}
        self._size = 0
        self.hits = 0  # answers given without SQLite (for tests and stats)

    def answer(self, ns: bytes, length: int, keys: Sequence[bytes]) -> list[bool] | None:
        """[True] * len(keys) when every key is known published and the epoch was read within
        `recheck_s`; else None (ask the index). Takes no lock: the sets are only ever added
        to or replaced whole."""
        if time.monotonic() - self._checked >= self.recheck_s:
            return None
        known = self._known.get((ns, length))
        if known is None or not all(map(known.__contains__, keys)):
            return None
        self.hits += 1
        return [True] * len(keys)

    def learn(self, removals: int, read_at: float, ns: bytes, length: int, found: Iterable[bytes]) -> None:
        """A read that took the counter `removals` at `read_at`, then found `found` published."""
        with self._lock:
            if self._epoch is None or removals > self._epoch:
                self._reset(removals)
            if removals != self._epoch:
                return  # the cache moved past this read meanwhile: what it saw may be stale
            self._checked = max(self._checked, read_at)
            found = list(found)
            if self._size + len(found) > self.capacity:
                self._reset(removals)
                if len(found) > self.capacity:
                    return  # more than the cache may hold: those are asked again
            known = self._known.setdefault((ns, length), set())
            before = len(known)
            known.update(found)
            self._size += len(known) - before

    def removed(self, removals_after: int, bumps: int, keys: Iterable[tuple[bytes, bytes]]) -> None:
        """This process committed a transaction that removed `keys` ((ns, key) pairs), bumping
        the counter `bumps` times to `removals_after`."""
        with self._lock:
            if self._epoch is None:
                return
            if self._epoch != removals_after - bumps:  # another process removed pages meanwhile
                self._reset(removals_after)
                return
            self._epoch = removals_after
            drop: dict[bytes, list[bytes]] = {}
            for ns, key in keys:
                drop.setdefault(ns, []).append(key)
            for (ns, length), known in list(self._known.items()):
                gone = drop.get(ns)
                if gone:
                    # Replace the set, never mutate one an `answer` may be reading.
                    fresh = known.difference(gone)
                    self._size -= len(known) - len(fresh)
                    self._known[(ns, length)] = fresh

    def forget(self, ns: bytes, keys: Sequence[bytes]) -> None:
        """A read found `keys` of `ns` unpublished: never answer them from memory again (until
        a read finds them published), whatever the counter says."""
        with self._lock:
            for (space, length), known in list(self._known.items()):
                if space == ns and not known.isdisjoint(keys):
                    fresh = known.difference(keys)
                    self._size -= len(known) - len(fresh)
                    self._known[(space, length)] = fresh

    def _reset(self, removals: int) -> None:
        self._epoch = removals
        self._known = {}
        self._size = 0
