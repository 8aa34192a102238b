"""Shared, crash-safe index of the remote page store: which slot holds which page.

Owns the SQLite database ``index.sqlite3`` in a store directory and every decision about slots:
allocation, publication, LRU eviction between watermarks, freeing, and reclaiming the slots of
writers that died. It is pure Python (stdlib ``sqlite3``) and moves no page bytes; the caller
(``kvtier.tiers.remote``) moves bytes with NIXL and calls ``reserve`` before writing a record and
``publish`` only after the record is durable.

Rules it keeps, whatever process or thread calls it:
- A slot is in exactly one state: never used (above a segment's ``next_unused``), reserved (a row
  in ``reservations``, owned by one writer), published (a row in ``pages``), or free (a row in
  ``free_slots``). Every transition happens inside one ``BEGIN IMMEDIATE`` transaction.
- A page becomes visible only through ``publish``, which succeeds only while the writer still owns
  its reservation; a writer that died keeps its reservation until ``reclaim`` frees it, so a
  half-written slot is never visible.
- A slot that held a published page (overwritten, deleted, evicted, cleared, found corrupt) is
  handed out again only after ``reuse_delay_s``, so a reader that looked the page up just before
  it was freed normally finishes reading before the slot is rewritten. The record header and
  checksum, checked by the reader, make the rare slower reader a miss, never wrong bytes.
- LRU order is a logical clock in the database (``last_access``), bumped by publication and by
  hits. Hits are buffered in memory and written at the next write transaction of this index, by
  ``flush_touches`` (which ``touch`` asks for after ``TOUCH_FLUSH_PAGES`` hits or
  ``TOUCH_FLUSH_S`` seconds), and on close: a hit costs no write transaction, the order is exact
  for this index's own writes, and other processes see its hits within about a second. Hits of a
  process that dies before a flush are lost (those pages just look older).
- Eviction is store-wide: pages of every namespace in the directory compete for one capacity.
  Removal by namespace (``clear``) never touches another namespace.

It must never touch segment files beyond calling the ``create_segment`` callback it is given, and
never hold its lock while a caller moves bytes.

Durability: WAL journal with ``synchronous=NORMAL``. A commit survives a process crash; after an
operating-system crash or power loss the last commits may be lost, which makes those pages misses
(their records were made durable before publication, and a lost publication is only a lost page;
a slot reused after a lost commit holds another key's record, which readers reject).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sqlite3
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, NamedTuple, Optional, Sequence

SCHEMA_VERSION = 1
INDEX_FILENAME = "index.sqlite3"
TOUCH_FLUSH_PAGES = 4096
TOUCH_FLUSH_S = 1.0
RECLAIM_INTERVAL_S = 30.0
_SQL_CHUNK = 500

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS segments (
    id INTEGER PRIMARY KEY,
    slot_stride INTEGER NOT NULL,
    nslots INTEGER NOT NULL,
    next_unused INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS segments_open ON segments (slot_stride, id);
CREATE TABLE IF NOT EXISTS pages (
    ns TEXT NOT NULL,
    key BLOB NOT NULL,
    seg INTEGER NOT NULL,
    slot INTEGER NOT NULL,
    length INTEGER NOT NULL,
    crc INTEGER NOT NULL,
    token INTEGER NOT NULL,
    last_access INTEGER NOT NULL,
    PRIMARY KEY (ns, key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS pages_lru ON pages (last_access);
CREATE UNIQUE INDEX IF NOT EXISTS pages_slot ON pages (seg, slot);
CREATE TABLE IF NOT EXISTS reservations (
    seg INTEGER NOT NULL,
    slot INTEGER NOT NULL,
    length INTEGER NOT NULL,
    owner TEXT NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (seg, slot)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS free_slots (
    seg INTEGER NOT NULL,
    slot INTEGER NOT NULL,
    slot_stride INTEGER NOT NULL,
    free_after REAL NOT NULL,
    PRIMARY KEY (seg, slot)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS free_by_stride ON free_slots (slot_stride, free_after);
"""


class SlotRef(NamedTuple):
    """One slot of one segment file."""

    seg: int
    slot: int


class PageLocation(NamedTuple):
    """Where a published page lives and what its record must say."""

    seg: int
    slot: int
    length: int
    crc: int
    token: int


@dataclass(frozen=True)
class Reservation:
    """Result of ``reserve``: slots now owned by the caller, in request order."""

    slots: list[SlotRef]
    evicted: int


def _process_start_ticks(pid: int) -> Optional[int]:
    """Start time of ``pid`` in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()
    if fields[0] == b"Z":
        return -1
    return int(fields[19])


def make_owner(instance_token: str) -> str:
    """Identity of a writer: host, pid, pid start time, and a token unique to one open index."""
    pid = os.getpid()
    return f"{socket.gethostname()}|{pid}|{_process_start_ticks(pid)}|{instance_token}"


def _owner_is_dead(owner: str, created: float, now: float, lease_s: float) -> bool:
    host, pid_text, start_text, _ = owner.split("|")
    if host != socket.gethostname():
        return now - created > lease_s
    pid = int(pid_text)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    start = _process_start_ticks(pid)
    return start == -1 or (start is not None and str(start) != start_text)


class RemoteIndex:
    """The SQLite index of one store directory, shared by every process that opens it."""

    def __init__(
        self,
        directory: str,
        *,
        owner: str,
        reuse_delay_s: float,
        reservation_lease_s: float,
        busy_timeout_s: float = 60.0,
    ):
        self.path = os.path.join(directory, INDEX_FILENAME)
        self.owner = owner
        self.reuse_delay_s = reuse_delay_s
        self.reservation_lease_s = reservation_lease_s
        self._lock = threading.Lock()
        self._pending_touches: list[tuple[str, bytes]] = []
        self._oldest_touch = 0.0
        self._last_reclaim = 0.0
        self._db = sqlite3.connect(
            self.path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
        )
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        with self._transaction() as db:
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)
            db.execute(
                "INSERT OR IGNORE INTO meta VALUES "
                "('schema_version', ?), ('clock', 0), ('used_bytes', 0)",
                (SCHEMA_VERSION,),
            )
            found = self._meta(db, "schema_version")
            if found != SCHEMA_VERSION:
                raise ValueError(
                    f"{self.path}: index schema version {found}, expected {SCHEMA_VERSION}"
                )

    # ----------------------------------------------------------------- transactions
    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; BEGIN IMMEDIATE takes the database write lock up front, so two
        writers never deadlock upgrading read locks."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    @staticmethod
    def _meta(db: sqlite3.Connection, name: str) -> int:
        return db.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()[0]

    @staticmethod
    def _add_meta(db: sqlite3.Connection, name: str, delta: int) -> None:
        db.execute("UPDATE meta SET value = value + ? WHERE name = ?", (delta, name))

    def _tick(self, db: sqlite3.Connection, count: int) -> int:
        """Reserve ``count`` consecutive logical-clock values; returns the first."""
        first = self._meta(db, "clock") + 1
        self._add_meta(db, "clock", count)
        return first

    def _flush_touches(self, db: sqlite3.Connection) -> None:
        touches, self._pending_touches = self._pending_touches, []
        if not touches:
            return
        first = self._tick(db, len(touches))
        db.executemany(
            "UPDATE pages SET last_access = ? WHERE ns = ? AND key = ?",
            [(first + i, ns, key) for i, (ns, key) in enumerate(touches)],
        )

    def _free(self, db: sqlite3.Connection, slots: Iterable[tuple[int, int]], now: float) -> None:
        """Move slots to the free list; reusable after the reuse delay."""
        db.executemany(
            "INSERT OR REPLACE INTO free_slots "
            "SELECT ?, ?, slot_stride, ? FROM segments WHERE id = ?",
            [(seg, slot, now + self.reuse_delay_s, seg) for seg, slot in slots],
        )

    def _remove_pages(self, db: sqlite3.Connection, rows: Sequence[tuple], now: float) -> None:
        """Unpublish pages given as (ns, key, seg, slot, length) rows and free their slots."""
        db.executemany("DELETE FROM pages WHERE ns = ? AND key = ?", [r[:2] for r in rows])
        self._free(db, [(r[2], r[3]) for r in rows], now)
        self._add_meta(db, "used_bytes", -sum(r[4] for r in rows))

    # ----------------------------------------------------------------- reads
    def lookup(self, ns: str, keys: Sequence[bytes]) -> list[Optional[PageLocation]]:
        """Location of each key's published page in namespace ``ns``, or None."""
        found: dict[bytes, PageLocation] = {}
        with self._lock:
            for start in range(0, len(keys), _SQL_CHUNK):
                chunk = list(dict.fromkeys(keys[start : start + _SQL_CHUNK]))
                marks = ",".join("?" * len(chunk))
                for key, seg, slot, length, crc, token in self._db.execute(
                    f"SELECT key, seg, slot, length, crc, token FROM pages "
                    f"WHERE ns = ? AND key IN ({marks})",
                    (ns, *chunk),
                ):
                    found[bytes(key)] = PageLocation(seg, slot, length, crc, token)
        return [found.get(key) for key in keys]

    def segment(self, seg: int) -> tuple[int, int]:
        """(slot_stride, nslots) of segment ``seg``."""
        with self._lock:
            row = self._db.execute(
                "SELECT slot_stride, nslots FROM segments WHERE id = ?", (seg,)
            ).fetchone()
        if row is None:
            raise KeyError(f"segment {seg} is not in {self.path}")
        return row

    def touch(self, ns: str, keys: Iterable[bytes]) -> bool:
        """Record hits for LRU, written at the next write transaction of this index. Returns
        True when enough are buffered (``TOUCH_FLUSH_PAGES``, or older than ``TOUCH_FLUSH_S``)
        that the caller should call ``flush_touches``, from a thread of its choice."""
        with self._lock:
            if not self._pending_touches:
                self._oldest_touch = time.monotonic()
            self._pending_touches.extend((ns, key) for key in keys)
            return (
                len(self._pending_touches) >= TOUCH_FLUSH_PAGES
                or time.monotonic() - self._oldest_touch >= TOUCH_FLUSH_S
            )

    def flush_touches(self) -> None:
        """Write buffered hits."""
        with self._transaction() as db:
            self._flush_touches(db)

    def stats(self, ns: str) -> dict[str, int]:
        """Page counts and bytes of namespace ``ns`` and of the whole store."""
        with self._lock:
            db = self._db
            pages, used = db.execute(
                "SELECT COUNT(*), COALESCE(SUM(length), 0) FROM pages WHERE ns = ?", (ns,)
            ).fetchone()
            store_pages, store_used = db.execute(
                "SELECT COUNT(*), COALESCE(SUM(length), 0) FROM pages"
            ).fetchone()
            reserved = db.execute("SELECT COUNT(*) FROM reservations").fetchone()[0]
            free = db.execute("SELECT COUNT(*) FROM free_slots").fetchone()[0]
            segments = db.execute("SELECT COUNT(*) FROM segments").fetchone()[0]
        return {
            "pages": pages,
            "used_bytes": used,
            "store_pages": store_pages,
            "store_used_bytes": store_used,
            "reserved_slots": reserved,
            "free_slots": free,
            "segments": segments,
        }

    # ----------------------------------------------------------------- writes
    def reserve(
        self,
        count: int,
        *,
        length: int,
        slot_stride: int,
        slots_per_segment: int,
        capacity_bytes: Optional[int],
        high_watermark: float,
        low_watermark: float,
        create_segment: Callable[[int, int, int], None],
    ) -> Reservation:
        """Own ``count`` slots for records of ``length`` payload bytes, evicting LRU pages first.

        When the published plus reserved bytes would pass ``high_watermark * capacity_bytes``,
        least recently used pages (of any namespace) are evicted until they fit under
        ``low_watermark * capacity_bytes``. Fewer slots than asked are returned only when the
        request cannot fit even after evicting everything evictable. ``create_segment(seg,
        slot_stride, nslots)`` is called inside the transaction for each new segment, so its
        file exists before any other process can see the segment.
        """
        now = time.time()
        with self._transaction() as db:
            self._flush_touches(db)
            if now - self._last_reclaim >= RECLAIM_INTERVAL_S:
                self._reclaim(db, now)
            evicted = 0
            if capacity_bytes is not None:
                count, evicted = self._make_room(
                    db, count, length, capacity_bytes, high_watermark, low_watermark, now
                )
            slots = self._allocate(db, count, slot_stride, slots_per_segment, now, create_segment)
            db.executemany(
                "INSERT INTO reservations VALUES (?, ?, ?, ?, ?)",
                [(s.seg, s.slot, length, self.owner, now) for s in slots],
            )
        return Reservation(slots, evicted)

    def _make_room(
        self,
        db: sqlite3.Connection,
        count: int,
        length: int,
        capacity_bytes: int,
        high_watermark: float,
        low_watermark: float,
        now: float,
    ) -> tuple[int, int]:
        reserved = db.execute("SELECT COALESCE(SUM(length), 0) FROM reservations").fetchone()[0]
        used = self._meta(db, "used_bytes") + reserved
        high = high_watermark * capacity_bytes
        if used + count * length <= high:
            return count, 0
        target = low_watermark * capacity_bytes - count * length
        evicted = 0
        while used > target:
            rows = db.execute(
                "SELECT ns, key, seg, slot, length FROM pages ORDER BY last_access LIMIT ?",
                (_SQL_CHUNK,),
            ).fetchall()
            if not rows:
                break
            victims = []
            for row in rows:
                if used <= target:
                    break
                victims.append(row)
                used -= row[4]
            self._remove_pages(db, victims, now)
            evicted += len(victims)
        fits = max(0, int((high - used) // length))
        return min(count, fits), evicted

    def _allocate(
        self,
        db: sqlite3.Connection,
        count: int,
        slot_stride: int,
        slots_per_segment: int,
        now: float,
        create_segment: Callable[[int, int, int], None],
    ) -> list[SlotRef]:
        slots = [
            SlotRef(seg, slot)
            for seg, slot in db.execute(
                "SELECT seg, slot FROM free_slots WHERE slot_stride = ? AND free_after <= ? "
                "ORDER BY seg, slot LIMIT ?",
                (slot_stride, now, count),
            )
        ]
        db.executemany(
            "DELETE FROM free_slots WHERE seg = ? AND slot = ?", [(s.seg, s.slot) for s in slots]
        )
        open_segments = db.execute(
            "SELECT id, nslots, next_unused FROM segments "
            "WHERE slot_stride = ? AND next_unused < nslots ORDER BY id",
            (slot_stride,),
        ).fetchall()
        for seg, nslots, next_unused in open_segments:
            if len(slots) == count:
                break
            take = min(count - len(slots), nslots - next_unused)
            slots.extend(SlotRef(seg, slot) for slot in range(next_unused, next_unused + take))
            db.execute("UPDATE segments SET next_unused = ? WHERE id = ?", (next_unused + take, seg))
        while len(slots) < count:
            take = min(count - len(slots), slots_per_segment)
            seg = db.execute(
                "INSERT INTO segments (slot_stride, nslots, next_unused) VALUES (?, ?, ?)",
                (slot_stride, slots_per_segment, take),
            ).lastrowid
            create_segment(seg, slot_stride, slots_per_segment)
            slots.extend(SlotRef(seg, slot) for slot in range(take))
        return slots

    def publish(
        self, ns: str, entries: Sequence[tuple[bytes, SlotRef, int, int, int]]
    ) -> list[bool]:
        """Make durable records visible: entries are (key, slot, length, crc, token).

        An entry whose reservation this writer no longer owns (reclaimed after its lease) is not
        published and returns False. A key's previous page, if any, is freed; of two entries
        for one key, the later wins."""
        now = time.time()
        with self._transaction() as db:
            self._flush_touches(db)
            owned = set(
                db.execute("SELECT seg, slot FROM reservations WHERE owner = ?", (self.owner,))
            )
            published = [tuple(entry[1]) in owned for entry in entries]
            mine = [entry for entry, ok in zip(entries, published) if ok]
            db.executemany(
                "DELETE FROM reservations WHERE seg = ? AND slot = ?", [e[1] for e in mine]
            )
            latest: dict[bytes, tuple] = {}
            superseded = []
            for entry in mine:
                if entry[0] in latest:
                    superseded.append(latest[entry[0]][1])
                latest[entry[0]] = entry
            self._free(db, superseded, now)
            self._remove_pages(db, self._page_rows(db, ns, list(latest)), now)
            first = self._tick(db, len(latest))
            db.executemany(
                "INSERT INTO pages VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (ns, key, slot.seg, slot.slot, length, crc, token, first + i)
                    for i, (key, slot, length, crc, token) in enumerate(latest.values())
                ],
            )
            self._add_meta(db, "used_bytes", sum(e[2] for e in latest.values()))
        return published

    @staticmethod
    def _page_rows(db: sqlite3.Connection, ns: str, keys: Sequence[bytes]) -> list[tuple]:
        """(ns, key, seg, slot, length) rows of the published pages among ``keys``."""
        rows = []
        for start in range(0, len(keys), _SQL_CHUNK):
            chunk = keys[start : start + _SQL_CHUNK]
            rows.extend(
                db.execute(
                    f"SELECT ns, key, seg, slot, length FROM pages "
                    f"WHERE ns = ? AND key IN ({','.join('?' * len(chunk))})",
                    (ns, *chunk),
                )
            )
        return rows

    def release(self, slots: Sequence[SlotRef]) -> None:
        """Give back reserved slots that will not be published (failed or abandoned writes)."""
        now = time.time()
        with self._transaction() as db:
            owned = set(
                db.execute("SELECT seg, slot FROM reservations WHERE owner = ?", (self.owner,))
            )
            mine = [tuple(s) for s in slots if tuple(s) in owned]
            db.executemany("DELETE FROM reservations WHERE seg = ? AND slot = ?", mine)
            self._free(db, mine, now)

    def delete(self, ns: str, keys: Sequence[bytes]) -> list[bool]:
        """Unpublish keys of namespace ``ns``; True where a page existed."""
        now = time.time()
        with self._transaction() as db:
            self._flush_touches(db)
            rows = self._page_rows(db, ns, list(dict.fromkeys(keys)))
            self._remove_pages(db, rows, now)
        existed = {bytes(row[1]) for row in rows}
        return [key in existed for key in keys]

    def drop_if_current(self, ns: str, key: bytes, token: int) -> bool:
        """Unpublish ``key`` only if its page is still the write ``token`` (a corrupt record)."""
        now = time.time()
        with self._transaction() as db:
            row = db.execute(
                "SELECT ns, key, seg, slot, length FROM pages WHERE ns = ? AND key = ? AND token = ?",
                (ns, key, token),
            ).fetchone()
            if row is not None:
                self._remove_pages(db, [row], now)
        return row is not None

    def clear(self, ns: str) -> int:
        """Unpublish every page of namespace ``ns`` and nothing else; returns the count."""
        now = time.time()
        with self._transaction() as db:
            self._flush_touches(db)
            rows = db.execute(
                "SELECT ns, key, seg, slot, length FROM pages WHERE ns = ?", (ns,)
            ).fetchall()
            self._remove_pages(db, rows, now)
        return len(rows)

    def reclaim(self) -> int:
        """Free slots reserved by writers that died; returns how many."""
        with self._transaction() as db:
            return self._reclaim(db, time.time())

    def _reclaim(self, db: sqlite3.Connection, now: float) -> int:
        self._last_reclaim = now
        dead = [
            (seg, slot)
            for seg, slot, owner, created in db.execute(
                "SELECT seg, slot, owner, created FROM reservations WHERE owner != ?",
                (self.owner,),
            ).fetchall()
            if _owner_is_dead(owner, created, now, self.reservation_lease_s)
        ]
        db.executemany("DELETE FROM reservations WHERE seg = ? AND slot = ?", dead)
        self._free(db, dead, now)
        return len(dead)

    def close(self) -> None:
        """Write buffered hits and close the connection."""
        self.flush_touches()
        self._db.close()
