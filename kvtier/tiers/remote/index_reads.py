"""Reads of the remote index: where pages live, whether they are published, its counters.

Owns the index's reader connections (taken one per read, opened up to ``MAX_READERS``, never
shared by two reads at once) and the reads themselves, each run on the index's read threads
(``bounded.py``) so that a read a stuck disk holds in the kernel costs its caller the busy
timeout, then is a miss (``lookup``, ``present``) or raises CallTimedOut (``segment``,
``stats``). ``RemoteIndex`` (index.py) inherits it. It must never write to the index.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import time
from typing import Callable, Iterator, NamedTuple, Optional, Sequence

from kvtier.tiers.remote.bounded import CallTimedOut

logger = logging.getLogger("kvtier.tiers.remote.index")

# Reader connections an index opens at most (each may cache up to CACHE_KIB of the database):
# reads beyond that many at once wait for one to come free.
MAX_READERS = 4
_SQL_CHUNK = 500


class PageLocation(NamedTuple):
    """Where a published page lives and what its record must say."""

    seg: int
    slot: int
    length: int
    crc: int
    token: int


class IndexReads:
    """The read half of ``RemoteIndex``."""

    def _open_reader(self, placeholder: bool = False) -> sqlite3.Connection:
        """A new read-only connection, listed for closing (in place of a None the caller listed
        when `placeholder`)."""
        db = self._connect(self._busy_timeout_s)
        try:
            db.execute("PRAGMA query_only=1")
        except BaseException:
            db.close()
            raise
        with self._readers_lock:
            if not placeholder:
                self._all_readers.append(db)
                return db
            if None in self._all_readers:
                self._all_readers[self._all_readers.index(None)] = db
                return db
        db.close()  # the index closed meanwhile
        raise RuntimeError(f"store index {self.path} is closed")

    @contextlib.contextmanager
    def _reading(self) -> Iterator[sqlite3.Connection]:
        """A reader connection for this thread alone during one read: an idle one (the most
        recently used, so one thread keeps reusing one), else a new one kept for later reads,
        else (MAX_READERS open and busy) the first to come free."""
        db = None
        with self._readers_lock:
            while not self._idle_readers and len(self._all_readers) >= MAX_READERS:
                self._readers_lock.wait()
            if self._idle_readers:
                db = self._idle_readers.pop()
            else:
                self._all_readers.append(None)  # the place of the one opened below, outside the lock
        if db is None:
            try:
                db = self._open_reader(placeholder=True)
            except BaseException:
                with self._readers_lock:
                    if None in self._all_readers:
                        self._all_readers.remove(None)
                    self._readers_lock.notify()
                raise
        try:
            self._apply_busy_timeout(db)
            yield db
        finally:
            with self._readers_lock:
                self._idle_readers.append(db)
                self._readers_lock.notify()

    def _bounded_read(self, read: Callable[[], object]):
        """``read()`` (which takes a reader connection) on the read threads, waiting at most
        the busy timeout; raises CallTimedOut after it."""
        return self._reads.run(read, self._busy_timeout_s)

    def lookup(self, ns: bytes, keys: Sequence[bytes]) -> list[Optional[PageLocation]]:
        """Location of each key's published page in namespace ``ns``, or None; all None when
        the index gives no answer within the busy timeout (a stuck disk: misses, not a wait)."""
        read_at = time.monotonic()

        def read() -> tuple[dict[bytes, PageLocation], Optional[int]]:
            found: dict[bytes, PageLocation] = {}
            removals = None
            for start in range(0, len(keys), _SQL_CHUNK):
                chunk = list(dict.fromkeys(keys[start : start + _SQL_CHUNK]))
                with self._reading() as reader:
                    # One statement, one snapshot: the removal counter (key NULL) with the keys.
                    rows = reader.execute(
                        f"SELECT NULL, value, 0, 0, 0, 0 FROM meta WHERE name = 'removals' UNION ALL "
                        f"SELECT key, seg, slot, length, crc, token FROM pages "
                        f"WHERE ns = ? AND key IN ({','.join('?' * len(chunk))})",
                        (ns, *chunk),
                    ).fetchall()
                for key, seg, slot, length, crc, token in rows:
                    if key is None:
                        removals = seg if removals is None else removals  # the first snapshot's
                    else:
                        found[key] = PageLocation(seg, slot, length, crc, token)
            return found, removals

        try:
            found, removals = self._bounded_read(read)
        except CallTimedOut as exc:
            logger.warning("lookup of %d keys in %s gave up: %s", len(keys), self.path, exc)
            return [None] * len(keys)
        if removals is not None and found:
            self.presence.learn(removals, read_at, ns, found)
        if len(found) < len(keys):
            self.presence.forget(ns, [key for key in keys if key not in found])
        return [found.get(key) for key in keys]

    def present(self, ns: bytes, keys: Sequence[bytes], length: int, fresh: bool = False) -> list[bool]:
        """Whether each key has a published page of ``length`` bytes in ``ns`` (no locations).
        Keys a read found published are answered from memory (``presence``) while no process
        has removed pages since, checked at least every ``presence.recheck_s``. Keys the index
        gives no answer for within the busy timeout are False (a stuck disk). ``fresh`` reads
        the index whatever the cache knows (a writer about to skip pages it finds present)."""
        known = None if fresh else self.presence.answer(ns, length, keys)
        if known is not None:
            return known
        read_at = time.monotonic()

        def read() -> tuple[dict[bytes, PageLocation], Optional[int]]:
            found: dict[bytes, PageLocation] = {}
            removals = None
            with self._reading() as reader:
                for start in range(0, len(keys), _SQL_CHUNK):
                    chunk = keys[start : start + _SQL_CHUNK]
                    # One statement, one snapshot: the removal counter (key NULL) with the keys.
                    rows = reader.execute(
                        f"SELECT NULL, value, 0, 0, 0, 0 FROM meta WHERE name = 'removals' UNION ALL "
                        f"SELECT key, seg, slot, length, crc, token FROM pages WHERE ns = ? AND length = ? "
                        f"AND key IN ({','.join('?' * len(chunk))})",
                        (ns, length, *chunk),
                    ).fetchall()
                    for key, seg, slot, size, crc, token in rows:
                        if key is None:
                            removals = seg if removals is None else removals
                        else:
                            found[key] = PageLocation(seg, slot, size, crc, token)
            return found, removals

        try:
            found, removals = self._bounded_read(read)
        except CallTimedOut as exc:
            logger.warning("presence of %d keys in %s: no answer, misses: %s", len(keys), self.path, exc)
            return [False] * len(keys)
        if removals is not None:
            self.presence.learn(removals, read_at, ns, found)
        return [key in found for key in keys]

    def segment(self, seg: int) -> tuple[int, int]:
        """(slot_stride, nslots) of segment ``seg``; CallTimedOut (an OSError) past the busy
        timeout."""
        def read() -> Optional[tuple[int, int]]:
            with self._reading() as reader:
                return reader.execute(
                    "SELECT slot_stride, nslots FROM segments WHERE id = ?", (seg,)
                ).fetchone()

        row = self._bounded_read(read)
        if row is None:
            raise KeyError(f"segment {seg} is not in {self.path}")
        return row

    def stats(self, ns: bytes) -> dict[str, int]:
        """Page counts and bytes of namespace ``ns`` and of the whole store, from counters the
        writes keep (a few rows read, whatever the store holds); CallTimedOut past the busy
        timeout."""
        def read() -> tuple:
            with self._reading() as db:
                db.execute("BEGIN")
                try:
                    meta = dict(db.execute("SELECT name, value FROM meta WHERE name IN ('pages', 'used_bytes')"))
                    row = db.execute("SELECT pages, used_bytes FROM namespaces WHERE ns = ?", (ns,)).fetchone()
                    segments, allocated = db.execute(
                        "SELECT COUNT(*), COALESCE(SUM(next_unused), 0) FROM segments"
                    ).fetchone()
                    reserved = db.execute("SELECT COUNT(*) FROM reservations").fetchone()[0]
                finally:
                    db.execute("COMMIT")
            return meta, row, segments, allocated, reserved

        meta, row, segments, allocated, reserved = self._bounded_read(read)
        pages, used = row if row is not None else (0, 0)
        return {
            "pages": pages,
            "used_bytes": used,
            "store_pages": meta["pages"],
            "store_used_bytes": meta["used_bytes"],
            "reserved_slots": reserved,
            "free_slots": allocated - meta["pages"] - reserved,
            "segments": segments,
        }
