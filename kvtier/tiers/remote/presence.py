"""What this process knows is in the remote index, so that asking costs no SQLite read.

It keeps, per published key it has seen, the page's location (segment, slot, length, CRC32C,
token): "published?" is answered from it, and so is "where?" for a read whose keys are all
known, which then needs no SQLite read either (a cold index cost a get 0.4-0.6 ms of disk
reads before its first byte moved, on a virtio disk). A location from memory can only be stale
within the window below (another process replaced or removed the page); a read from it is then
a record whose token or checksum does not match, which the store answers by reading the whole
batch's locations from the index again: never wrong bytes. (Within that window a key another process rewrote can be
read in its previous record, still intact in a slot not yet reused: keys name their content, so
that is the same page.)

A `match` of pages only the remote tier holds asked SQLite each time; SQLite gives up Python's
GIL for the query, and winning it back beside busy threads (the pool's copy, backup and fetch
threads, the engine's) took milliseconds (`benchmarks/pool_overhead.py --sections threads`).
This cache answers "published?" for keys a read found published, or this process published,
with no I/O and no lock.

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
from collections.abc import Iterable, Mapping, Sequence

RECHECK_S = 1.0
CAPACITY = 1 << 18  # keys (about 30 MB at most)


class PresenceCache:
    def __init__(self, recheck_s: float = RECHECK_S, capacity: int = CAPACITY) -> None:
        self.recheck_s = recheck_s
        self.capacity = capacity
        self._lock = threading.Lock()  # held only for dict updates, never across I/O
        self._epoch: int | None = None  # the removal counter the contents are valid for
        self._checked = float("-inf")  # when the counter was last read and equal to the epoch
        # ns -> key -> its page's location (any object with a `length`, the index's PageLocation)
        self._known: dict[bytes, dict[bytes, object]] = {}
        self._size = 0
        self.hits = 0  # answers given without SQLite (for tests and stats)
        self.location_hits = 0  # locations given without SQLite (for tests and stats)

    def answer(self, ns: bytes, length: int, keys: Sequence[bytes]) -> list[bool] | None:
        """[True] * len(keys) when every key is known published with pages of `length` bytes
        and the epoch was read within `recheck_s`; else None (ask the index). Takes no lock:
        the dicts are only ever added to or replaced whole."""
        if time.monotonic() - self._checked >= self.recheck_s:
            return None
        known = self._known.get(ns)
        if known is None:
            return None
        for key in keys:
            loc = known.get(key)
            if loc is None or loc.length != length:
                return None
        self.hits += 1
        return [True] * len(keys)

    def locations(self, ns: bytes, keys: Sequence[bytes]) -> list | None:
        """Every key's location when all are known and the epoch was read within `recheck_s`;
        else None (ask the index)."""
        if time.monotonic() - self._checked >= self.recheck_s:
            return None
        known = self._known.get(ns)
        if known is None:
            return None
        found = [known.get(key) for key in keys]
        if None in found:
            return None
        self.location_hits += 1
        return found

    def learn(self, removals: int, read_at: float, ns: bytes, found: Mapping[bytes, object]) -> None:
        """A read that took the counter `removals` at `read_at`, then found `found` (key ->
        location) published; or a write transaction that published them and left the counter
        at `removals`."""
        with self._lock:
            if self._epoch is None or removals > self._epoch:
                self._reset(removals)
            if removals != self._epoch:
                return  # the cache moved past this read meanwhile: what it saw may be stale
            self._checked = max(self._checked, read_at)
            if self._size + len(found) > self.capacity:
                self._reset(removals)
                if len(found) > self.capacity:
                    return  # more than the cache may hold: those are asked again
            known = self._known.setdefault(ns, {})
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
            for ns, gone in drop.items():
                self._drop(ns, gone)

    def forget(self, ns: bytes, keys: Sequence[bytes]) -> None:
        """A read found `keys` of `ns` unpublished: never answer them from memory again (until
        a read finds them published), whatever the counter says."""
        with self._lock:
            self._drop(ns, keys)

    def _drop(self, ns: bytes, keys: Iterable[bytes]) -> None:
        known = self._known.get(ns)
        if not known:
            return
        gone = [key for key in keys if key in known]
        if gone:
            # Replace the dict, never mutate one an `answer` may be reading.
            fresh = dict(known)
            for key in gone:
                del fresh[key]
            self._size -= len(gone)
            self._known[ns] = fresh

    def _reset(self, removals: int) -> None:
        self._epoch = removals
        self._known = {}
        self._size = 0
