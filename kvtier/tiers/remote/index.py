"""Shared, crash-safe index of the remote page store: which slot holds which page.

Owns the SQLite database ``index.sqlite3`` in a store directory and every decision about slots:
allocation, publication, LRU eviction between watermarks, freeing, and reclaiming the slots of
writers that died. It is pure Python (stdlib ``sqlite3``) and moves no page bytes; the store
moves bytes with NIXL and calls ``reserve`` before writing a record and ``publish`` only after
the record is durable.

Pages are rows keyed by ``(ns, key)``: the 16-byte namespace fingerprint and the 16-byte key id
(``kvtier.index.keys.key_id``), the same two fields a record header carries (schema 2; schema 1
keyed pages by the namespace hex and the key's UTF-8 bytes, which made ``"k"`` and ``b"k"`` one
page, and is refused at open).

Rules it keeps, whatever process or thread calls it:
- A slot is in exactly one state: never used (at or above a segment's ``next_unused``),
  reserved (a row in ``reservations``, owned by one writer), published (a row in ``pages``), or
  free (a row in ``free_slots``). Every transition happens inside a ``BEGIN IMMEDIATE``
  transaction, so ``sum(next_unused) = pages + reservations + free slots`` always.
- A page becomes visible only through ``publish``, which succeeds only while the writer still
  owns its reservation; a writer that died keeps its reservation until ``reclaim`` frees it, so
  a half-written slot is never visible.
- A slot that held a published page (overwritten, deleted, evicted, cleared, found unreadable)
  is handed out again only after ``reuse_delay_s``, so a reader that looked the page up just
  before it was freed normally finishes reading before the slot is rewritten. The record header
  and checksum, checked by the reader, make the rare slower reader a miss, never wrong bytes.
- No transaction is long: work over many rows (eviction, publication, deletion, clearing, LRU
  hits, reservation) runs ``STEP_ROWS`` rows at a time, and a transaction commits once
  ``TRANSACTION_BUDGET_S`` (2 ms) has passed or it holds ``ROWS_PER_TRANSACTION`` (64) rows, so
  neither this index's lock nor SQLite's write lock is held for long however costly a row is
  (rows of random keys in a large store dirty many B-tree pages, and COMMIT writes them all to
  the WAL). Measured on the 2-vCPU VM with 100,000 pages (a probe now in git history:
  ``git show f5c0dc5:benchmarks/remote_index_locks.py``): evicting 57,501 of them held the
  lock at most 6.3 ms (2.9 ms of CPU; the rest is waiting for a CPU on a shared machine), against 1.16 s in one transaction; publish, delete, clear and
  LRU flushes of 4,096 pages at most 10 ms (3.3 ms of CPU). A large put may therefore publish
  its pages in several steps; each page is published whole or not at all. ``longest_hold_s``
  records the longest hold since open, ``longest_hold_cpu_s`` the most CPU time one hold took.
- Page and byte counts, store-wide (``meta``) and per namespace (``namespaces``), are kept by
  the transactions that publish and remove pages, so ``stats`` reads a few rows whatever the
  store holds.
- LRU order is a logical clock in the database (``last_access``), bumped by publication and by
  hits. Hits are buffered in memory and written before this index's next write, by
  ``flush_touches`` (which ``touch`` asks for after ``TOUCH_FLUSH_PAGES`` hits or
  ``TOUCH_FLUSH_S`` seconds), and on close: a hit costs no write transaction, the order is exact
  for this index's own writes, and other processes see its hits within about a second. Hits of a
  process that dies before a flush are lost (those pages just look older).
- Eviction is store-wide: pages of every namespace in the directory compete for one capacity.
  Removal by namespace (``clear``) never touches another namespace.

Reads (``lookup``, ``present``, ``stats``) go through reader connections of their own, so they
never wait behind this process's write transactions (WAL readers see the last commit), and run
on the index's read threads (``bounded.py``): a read a stuck disk holds in the kernel costs its
caller the busy timeout, then it is a miss. A writer waits for this index's lock at most the
busy timeout too.

It must never touch segment files beyond calling the ``create_segment`` and
``unused_slots_empty`` callbacks it is given (a segment id whose file holds records it does not
know is skipped; never-used slots that hold records are set aside, see ``_quarantine``), and
never hold its lock while a caller moves bytes.

Durability: WAL journal with ``synchronous=NORMAL``. A commit survives a process crash; after an
operating-system crash or power loss the last commits may be lost, which makes those pages misses
(their records were made durable before publication, and a lost publication is only a lost page;
a slot reused after a lost commit holds another key's record, which readers reject).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sqlite3
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, NamedTuple, Optional, Sequence

from kvtier.tiers.remote.bounded import BoundedCalls
from kvtier.tiers.remote.errors import StoreCorrupt, StoreVersionMismatch
from kvtier.tiers.remote.index_reads import _SQL_CHUNK, MAX_READERS, IndexReads, PageLocation  # noqa: F401 (PageLocation: re-exported)
from kvtier.tiers.remote.presence import RECHECK_S, PresenceCache

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 2
TOUCH_FLUSH_PAGES = 4096
TOUCH_FLUSH_S = 1.0
RECLAIM_INTERVAL_S = 30.0
ROWS_PER_TRANSACTION = 256
STEP_ROWS = 16
CACHE_KIB = 64 << 10
TRANSACTION_BUDGET_S = 0.002
SMALL_PUBLISH_ROWS = 4  # publications of up to this many pages run ``_publish_small``
CHECKPOINT_EVERY_TRANSACTIONS = 64
CHECKPOINT_EVERY_S = 1.0
NEVER = 1e300  # free_after of quarantined slots (see ``_quarantine``)

_SCHEMA = """
CREATE TABLE meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE segments (
    id INTEGER PRIMARY KEY,
    slot_stride INTEGER NOT NULL,
    nslots INTEGER NOT NULL,
    next_unused INTEGER NOT NULL
);
CREATE INDEX segments_open ON segments (slot_stride, id);
CREATE TABLE pages (
    ns BLOB NOT NULL,
    key BLOB NOT NULL,
    seg INTEGER NOT NULL,
    slot INTEGER NOT NULL,
    length INTEGER NOT NULL,
    crc INTEGER NOT NULL,
    token INTEGER NOT NULL,
    last_access INTEGER NOT NULL,
    PRIMARY KEY (ns, key)
) WITHOUT ROWID;
CREATE INDEX pages_lru ON pages (last_access);
CREATE UNIQUE INDEX pages_slot ON pages (seg, slot);
CREATE TABLE namespaces (
    ns BLOB PRIMARY KEY,
    pages INTEGER NOT NULL,
    used_bytes INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE reservations (
    seg INTEGER NOT NULL,
    slot INTEGER NOT NULL,
    length INTEGER NOT NULL,
    owner TEXT NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (seg, slot)
) WITHOUT ROWID;
CREATE TABLE free_slots (
    seg INTEGER NOT NULL,
    slot INTEGER NOT NULL,
    slot_stride INTEGER NOT NULL,
    free_after REAL NOT NULL,
    PRIMARY KEY (seg, slot)
) WITHOUT ROWID;
CREATE INDEX free_by_stride ON free_slots (slot_stride, free_after);
"""
# Readable labels of namespaces (kvtier.tiers.remote.labels), for people only; added without a
# schema change, so an index written before it gains the table when it is next opened.
_LABELS_TABLE = "CREATE TABLE IF NOT EXISTS namespace_labels (ns BLOB PRIMARY KEY, label TEXT NOT NULL) WITHOUT ROWID"


class SlotRef(NamedTuple):
    """One slot of one segment file."""

    seg: int
    slot: int



class PublishEntry(NamedTuple):
    """A durable record to make visible: key id, slot, payload length, CRC32C, write token."""

    key: bytes
    slot: SlotRef
    length: int
    crc: int
    token: int


@dataclass(frozen=True)
class Reservation:
    """Result of ``reserve``: slots now owned by the caller, in request order."""

    slots: list[SlotRef]
    evicted: int


def recovery_hint(directory: str) -> str:
    return (
        f"check it with `kvtier store check {directory}`; rebuild the index from the segment "
        f"files with `kvtier store rebuild {directory}` once no process has the store open "
        "(the damaged index is kept beside the new one)"
    )


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


def _chunks(items: Sequence, size: int) -> Iterator[Sequence]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


class RemoteIndex(IndexReads):
    """The SQLite index of one store directory, shared by every process that opens it."""

    def __init__(
        self,
        path: str,
        *,
        owner: str,
        reuse_delay_s: float,
        reservation_lease_s: float,
        busy_timeout_s: float,
        presence_recheck_s: float = RECHECK_S,
    ):
        self.path = path
        self.directory = os.path.dirname(path)
        self.owner = owner
        self.reuse_delay_s = reuse_delay_s
        self.reservation_lease_s = reservation_lease_s
        self.longest_hold_s = self.longest_hold_cpu_s = 0.0
        self._lock = threading.Lock()
        # Reads never wait for another thread's read: each takes an idle reader connection (WAL
        # mode lets connections read at once) and one more is opened when all are busy, up to
        # MAX_READERS.
        self._readers_lock = threading.Condition(threading.Lock())
        self._idle_readers: list[sqlite3.Connection] = []
        self._all_readers: list[sqlite3.Connection] = []
        self._busy_timeout_s = busy_timeout_s
        self._applied_timeout: dict[int, float] = {}  # id(connection) -> busy timeout it has
        # Reads run on these threads and give up at the busy timeout (a read can sleep in the
        # kernel on a frozen file system; see bounded.py).
        self._reads = BoundedCalls("kvtier-remote-index-read", MAX_READERS)
        self._touch_lock = threading.Lock()
        self._unreleased: list[SlotRef] = []  # releases that failed (a full disk): retried
        self._pending_touches: list[tuple[bytes, bytes]] = []
        # `present` answers keys a read found published from memory (see presence.py); the
        # write transaction in progress lists the pages it removes, and counts its bumps of
        # meta.removals, for the cache to drop once it commits.
        self.presence = PresenceCache(presence_recheck_s)
        self._txn_removed: list[tuple[bytes, bytes]] = []
        self._txn_bumps = 0
        self._oldest_touch = 0.0
        self._last_reclaim = 0.0
        self._background = ThreadPoolExecutor(1, thread_name_prefix="kvtier-remote-index")
        self._checkpoint_pending = False
        self._since_checkpoint = 0
        self._last_checkpoint = time.monotonic()
        self._db = self._reader = self._checkpointer = None
        self._unused_slots_empty: Optional[Callable[[int, int, int], bool]] = None
        try:
            self._db = self._connect(busy_timeout_s)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA wal_autocheckpoint=0")
            self._create_or_check_schema()
            self._reader = self._open_reader()
            self._idle_readers.append(self._reader)
            self._checkpointer = self._connect(busy_timeout_s)
        except sqlite3.DatabaseError as exc:
            self._close_connections()
            what = "is damaged or not a kvtier index" if not isinstance(
                exc, sqlite3.OperationalError
            ) else "could not be opened"
            raise StoreCorrupt(
                f"store index {path} {what} ({type(exc).__name__}: {exc}); {recovery_hint(self.directory)}"
            ) from exc
        except BaseException:
            self._close_connections()
            raise

    def _connect(self, busy_timeout_s: float) -> sqlite3.Connection:
        db = sqlite3.connect(
            self.path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
        )
        self._applied_timeout[id(db)] = busy_timeout_s
        # SQLite's default page cache is 2 MB; an index of 100,000 pages is about 30 MB, and
        # rows of random keys touch pages all over it.
        db.execute(f"PRAGMA cache_size = {-CACHE_KIB}")
        return db

    def _close_connections(self) -> None:
        self._reads.close()
        self._background.shutdown(wait=True)
        with self._readers_lock:
            readers, self._all_readers, self._idle_readers = self._all_readers, [], []
        for db in (self._db, self._checkpointer, *readers):
            if db is not None:
                db.close()

    def _create_or_check_schema(self) -> None:
        with self._transaction() as db:
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not tables:
                for statement in _SCHEMA.split(";"):
                    if statement.strip():
                        db.execute(statement)
                db.execute(
                    "INSERT INTO meta VALUES ('schema_version', ?), ('clock', 0), "
                    "('used_bytes', 0), ('pages', 0), ('removals', 0)",
                    (SCHEMA_VERSION,),
                )
                db.execute(_LABELS_TABLE)
                return
            row = None
            if "meta" in tables:
                row = db.execute("SELECT value FROM meta WHERE name = 'schema_version'").fetchone()
            if row is None:
                raise sqlite3.DatabaseError(f"tables {sorted(tables)} but no kvtier schema version")
            if row[0] != SCHEMA_VERSION:
                raise StoreVersionMismatch(
                    f"store index {self.path} has schema {row[0]}; this kvtier reads schema "
                    f"{SCHEMA_VERSION} (pages keyed by 16-byte key ids, record format 3), so the "
                    f"store's pages cannot be served. Move or delete {self.directory} (or give "
                    "the pool another directory) to start an empty store there."
                )
            # An index written before the removal counter or the labels existed (same schema otherwise).
            db.execute("INSERT OR IGNORE INTO meta VALUES ('removals', 0)")
            db.execute(_LABELS_TABLE)

    def set_busy_timeout(self, seconds: float) -> None:
        """How long a write waits for another thread's or process's write lock, and a read for
        its answer (then it is a miss). Never waits itself: each connection takes the new value
        the next time it is used (one may be inside a call a stuck disk holds)."""
        self._busy_timeout_s = seconds

    def _apply_busy_timeout(self, db: sqlite3.Connection) -> None:
        """Give ``db`` (which this thread alone uses now) the current busy timeout."""
        seconds = self._busy_timeout_s
        if self._applied_timeout.get(id(db)) != seconds:
            db.execute(f"PRAGMA busy_timeout = {max(1, int(seconds * 1000))}")
            self._applied_timeout[id(db)] = seconds

    # ----------------------------------------------------------------- transactions
    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; BEGIN IMMEDIATE takes the database write lock up front, so two
        writers never deadlock upgrading read locks. The WAL is checkpointed after the commit,
        outside the lock (see ``_checkpoint``)."""
        if not self._lock.acquire(timeout=self._busy_timeout_s):
            raise sqlite3.OperationalError(
                f"store index {self.path}: another thread's write has held it for over "
                f"{self._busy_timeout_s:.3g} s (a stuck disk?)"
            )
        try:
            self._apply_busy_timeout(self._db)
            start, cpu = time.monotonic(), time.thread_time()
            self._db.execute("BEGIN IMMEDIATE")
            self._txn_removed, self._txn_bumps = [], 0
            try:
                yield self._db
                removals = self._meta(self._db, "removals") if self._txn_bumps else 0
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
            finally:
                self.longest_hold_s = max(self.longest_hold_s, time.monotonic() - start)
                self.longest_hold_cpu_s = max(self.longest_hold_cpu_s, time.thread_time() - cpu)
            if self._txn_bumps:
                self.presence.removed(removals, self._txn_bumps, self._txn_removed)
            self._since_checkpoint += 1
            if not self._checkpoint_pending and (
                self._since_checkpoint >= CHECKPOINT_EVERY_TRANSACTIONS
                or start - self._last_checkpoint >= CHECKPOINT_EVERY_S
            ):
                self._checkpoint_pending = True
                self._since_checkpoint = 0
                self._last_checkpoint = time.monotonic()
                self._background.submit(self._checkpoint)
        finally:
            self._lock.release()

    def _checkpoint(self) -> None:
        """Copy the WAL into the database, on the index's background thread and a connection of
        its own. SQLite's automatic checkpoint runs inside the COMMIT that crosses 1,000 WAL
        pages, with two fsyncs, under this index's lock: measured here it held the lock for
        0.3-1 s (the longest hold of a 4,096-page publish went from 1,038 ms to 5 ms without it);
        run on the caller's thread, its fsyncs slowed the reads waiting behind it. A PASSIVE
        checkpoint waits for no reader or writer."""
        try:
            self._apply_busy_timeout(self._checkpointer)
            self._checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)")
        except sqlite3.Error as exc:
            logger.warning("index checkpoint of %s failed (retried later): %r", self.path, exc)
        finally:
            with self._lock:
                self._checkpoint_pending = False

    def flush_touches_later(self) -> None:
        """``flush_touches`` on the index's background thread; a failure only delays the hits."""

        def flush() -> None:
            try:
                self.flush_touches()
            except sqlite3.Error as exc:
                logger.warning("could not record LRU hits in %s yet: %r", self.path, exc)

        self._background.submit(flush)

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

    def _count_pages(
        self, db: sqlite3.Connection, rows: Iterable[tuple[bytes, int]], sign: int, clock: int = 0
    ) -> None:
        """Add (sign=1) or remove (sign=-1) pages given as (ns, length) from the counters, and
        advance the logical clock by ``clock`` in the same statement."""
        pages: Counter = Counter()
        used: Counter = Counter()
        for ns, length in rows:
            pages[ns] += 1
            used[ns] += length
        if not pages:
            if clock:
                self._add_meta(db, "clock", clock)
            return
        db.executemany(
            "INSERT INTO namespaces VALUES (?, ?, ?) ON CONFLICT (ns) DO UPDATE SET "
            "pages = pages + excluded.pages, used_bytes = used_bytes + excluded.used_bytes",
            [(ns, sign * pages[ns], sign * used[ns]) for ns in pages],
        )
        db.execute(
            "UPDATE meta SET value = value + CASE name WHEN 'pages' THEN ? WHEN 'used_bytes' THEN ? "
            "ELSE ? END WHERE name IN ('pages', 'used_bytes', 'clock')",
            (sign * sum(pages.values()), sign * sum(used.values()), clock),
        )

    def _free(self, db: sqlite3.Connection, slots: Sequence[tuple[int, int]], now: float) -> None:
        """Move slots to the free list; reusable after the reuse delay."""
        if not slots:
            return
        db.executemany(
            "INSERT INTO free_slots SELECT ?, ?, slot_stride, ? FROM segments WHERE id = ?",
            [(seg, slot, now + self.reuse_delay_s, seg) for seg, slot in slots],
        )

    def _remove_pages(self, db: sqlite3.Connection, rows: Sequence[tuple], now: float) -> None:
        """Unpublish pages given as (ns, key, seg, slot, length) rows and free their slots."""
        if not rows:
            return
        db.executemany("DELETE FROM pages WHERE ns = ? AND key = ?", [r[:2] for r in rows])
        self._free(db, [(r[2], r[3]) for r in rows], now)
        self._count_pages(db, ((r[0], r[4]) for r in rows), -1)
        self._add_meta(db, "removals", 1)  # every process's presence cache learns of it
        self._txn_bumps += 1
        self._txn_removed.extend((r[0], r[1]) for r in rows)

    def touch(self, ns: bytes, keys: Iterable[bytes]) -> bool:
        """Record hits for LRU, written before this index's next write. Returns True when enough
        are buffered (``TOUCH_FLUSH_PAGES``, or older than ``TOUCH_FLUSH_S``) that the caller
        should call ``flush_touches``, from a thread of its choice."""
        with self._touch_lock:
            if not self._pending_touches:
                self._oldest_touch = time.monotonic()
            self._pending_touches.extend((ns, key) for key in keys)
            return (
                len(self._pending_touches) >= TOUCH_FLUSH_PAGES
                or time.monotonic() - self._oldest_touch >= TOUCH_FLUSH_S
            )

    def _in_steps(
        self,
        items: Sequence,
        apply: Callable[[sqlite3.Connection, Sequence], Optional[Iterable]],
        committed: Optional[list] = None,
        step_rows: int = STEP_ROWS,
    ) -> None:
        """``apply(db, step)`` over ``items``, ``step_rows`` at a time, in transactions that
        commit once ``TRANSACTION_BUDGET_S`` has passed or ``ROWS_PER_TRANSACTION`` rows are in.
        What ``apply`` returns is added to ``committed`` once its transaction has committed."""
        position = 0
        while position < len(items):
            pending: list = []
            with self._transaction() as db:
                start, rows = time.monotonic(), 0
                while position < len(items) and rows < ROWS_PER_TRANSACTION and (
                    not rows or time.monotonic() - start < TRANSACTION_BUDGET_S
                ):
                    step = items[position : position + step_rows]
                    pending.extend(apply(db, step) or ())
                    position += len(step)
                    rows += len(step)
            if committed is not None:
                committed.extend(pending)

    def flush_touches(self) -> None:
        """Write buffered hits (in bounded transactions)."""
        if not self._pending_touches:  # read without the lock: a hit added meanwhile waits for the next flush
            return
        with self._touch_lock:
            touches, self._pending_touches = self._pending_touches, []

        def write(db: sqlite3.Connection, step: Sequence[tuple[bytes, bytes]]) -> None:
            first = self._tick(db, len(step))
            db.executemany(
                "UPDATE pages SET last_access = ? WHERE ns = ? AND key = ?",
                [(first + i, ns, key) for i, (ns, key) in enumerate(step)],
            )

        self._in_steps(touches, write)

    def set_label(self, ns: bytes, label: str) -> None:
        """Keep ``label`` (JSON, kvtier.tiers.remote.labels) as the readable name of ``ns``."""
        with self._transaction() as db:
            db.execute(
                "INSERT INTO namespace_labels VALUES (?, ?) ON CONFLICT (ns) DO UPDATE SET label = excluded.label "
                "WHERE label != excluded.label",
                (ns, label),
            )

    def namespaces(self) -> list[tuple[bytes, int, int, str | None]]:
        """(ns, pages, used bytes, label or None) of every namespace holding pages."""
        with self._reading() as db:
            return namespace_rows(db)

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
        spare: int = 0,
    ) -> Reservation:
        """Own ``count`` slots for records of ``length`` payload bytes, evicting LRU pages first.
        With ``spare``, up to that many more slots are reserved in the same transaction (after
        the ``count`` asked for, in ``slots``) where they fit under the high watermark without
        evicting anything or adding a segment: a writer of small batches keeps them for its
        next puts, so each of those costs one transaction (``publish``), not two.

        When the published plus reserved bytes would pass ``high_watermark * capacity_bytes``,
        least recently used pages (of any namespace) are evicted until they fit under
        ``low_watermark * capacity_bytes``. Fewer slots than asked are returned only when the
        request cannot fit even after evicting everything evictable. Eviction and allocation
        run in bounded transactions (see the module docstring); ``create_segment(seg,
        slot_stride, nslots)`` is called inside the transaction that adds a segment, so its file
        exists before any other process can see the segment; when it raises FileExistsError (a
        file there holds records this index does not know) the next id is tried.
        """
        self.flush_touches()
        self._retry_releases()
        slots: list[SlotRef] = []
        try:
            evicted = self._reserve(
                count, slots, length, slot_stride, slots_per_segment, capacity_bytes,
                high_watermark, low_watermark, create_segment, spare,
            )
        except BaseException:
            if slots:  # committed by earlier transactions of this call: give them back
                self.release(slots)
            raise
        return Reservation(slots, evicted)

    def _reserve(
        self,
        count: int,
        slots: list[SlotRef],
        length: int,
        slot_stride: int,
        slots_per_segment: int,
        capacity_bytes: Optional[int],
        high_watermark: float,
        low_watermark: float,
        create_segment: Callable[[int, int, int], None],
        spare: int = 0,
    ) -> int:
        """``reserve``'s loop: appends to ``slots`` as each transaction commits; returns how
        many pages it evicted."""
        evicted = 0
        evicting = exhausted = False
        while len(slots) < count:
            want = count - len(slots)
            with self._transaction() as db:
                now = time.time()
                if now - self._last_reclaim >= RECLAIM_INTERVAL_S:
                    self._reclaim(db, now)
                take = want
                room = spare  # spare slots: only where they need no eviction
                if capacity_bytes is not None:
                    used = db.execute(
                        "SELECT (SELECT COALESCE(SUM(length), 0) FROM reservations) + "
                        "(SELECT value FROM meta WHERE name = 'used_bytes')"
                    ).fetchone()[0]
                    high = high_watermark * capacity_bytes
                    if used + want * length > high:
                        evicting = True
                    if evicting and not exhausted and used > low_watermark * capacity_bytes - want * length:
                        victims = self._evict_some(db, used - (low_watermark * capacity_bytes - want * length), now)
                        evicted += victims
                        exhausted = victims == 0
                        if victims:
                            continue
                    take = min(want, max(0, int((high - used) // length)))
                    room = min(spare, max(0, int((high - used) // length) - want))
                take = min(take, STEP_ROWS * 4)
                if take == 0:
                    break
                new = self._allocate(db, take, slot_stride, slots_per_segment, now, create_segment)
                if take == want and room > 0:
                    new += self._allocate(db, room, slot_stride, slots_per_segment, now, None)
                db.executemany(
                    "INSERT INTO reservations VALUES (?, ?, ?, ?, ?)",
                    [(s.seg, s.slot, length, self.owner, now) for s in new],
                )
                slots.extend(new)
        return evicted

    def _evict_some(self, db: sqlite3.Connection, excess: float, now: float) -> int:
        """Evict least recently used pages, ``STEP_ROWS`` at a time, until ``excess`` bytes are
        gone or the transaction's budget is spent; returns how many."""
        start, evicted = time.monotonic(), 0
        while excess > 0 and evicted < ROWS_PER_TRANSACTION and (
            not evicted or time.monotonic() - start < TRANSACTION_BUDGET_S
        ):
            rows = db.execute(
                "SELECT ns, key, seg, slot, length FROM pages ORDER BY last_access LIMIT ?",
                (STEP_ROWS,),
            ).fetchall()
            victims = []
            for row in rows:
                if excess <= 0:
                    break
                victims.append(row)
                excess -= row[4]
            if not victims:
                break
            self._remove_pages(db, victims, now)
            evicted += len(victims)
        return evicted

    def _allocate(
        self,
        db: sqlite3.Connection,
        count: int,
        slot_stride: int,
        slots_per_segment: int,
        now: float,
        create_segment: Optional[Callable[[int, int, int], None]],
    ) -> list[SlotRef]:
        """Up to ``count`` slots: free ones past their reuse delay, then never-used ones of open
        segments, then new segments (none where ``create_segment`` is None)."""
        slots = [
            SlotRef(seg, slot)
            for seg, slot in db.execute(
                # In the order of free_by_stride: sorting a large free list by (seg, slot)
                # took milliseconds under the lock.
                "SELECT seg, slot FROM free_slots WHERE slot_stride = ? AND free_after <= ? "
                "ORDER BY free_after LIMIT ?",
                (slot_stride, now, count),
            )
        ]
        db.executemany(
            "DELETE FROM free_slots WHERE seg = ? AND slot = ?", [(s.seg, s.slot) for s in slots]
        )
        if slots:
            slots = self._not_published(db, slots)
        open_segments = db.execute(
            "SELECT id, nslots, next_unused FROM segments "
            "WHERE slot_stride = ? AND next_unused < nslots ORDER BY id",
            (slot_stride,),
        ).fetchall()
        for seg, nslots, next_unused in open_segments:
            if len(slots) == count:
                break
            take = min(count - len(slots), nslots - next_unused)
            if self._unused_slots_empty is not None and not self._unused_slots_empty(seg, next_unused, take):
                self._quarantine(db, seg, next_unused, nslots)
                continue
            slots.extend(SlotRef(seg, slot) for slot in range(next_unused, next_unused + take))
            db.execute("UPDATE segments SET next_unused = ? WHERE id = ?", (next_unused + take, seg))
        while len(slots) < count and create_segment is not None:
            take = min(count - len(slots), slots_per_segment)
            seg = db.execute("SELECT COALESCE(MAX(id), 0) + 1 FROM segments").fetchone()[0]
            while True:
                try:
                    create_segment(seg, slot_stride, slots_per_segment)
                    break
                except FileExistsError as exc:  # records this index does not know: never reused
                    logger.warning("%s; segment id %d skipped", exc, seg)
                    seg += 1
            db.execute(
                "INSERT INTO segments VALUES (?, ?, ?, ?)", (seg, slot_stride, slots_per_segment, take)
            )
            slots.extend(SlotRef(seg, slot) for slot in range(take))
        return slots

    def _not_published(self, db: sqlite3.Connection, slots: list[SlotRef]) -> list[SlotRef]:
        """``slots`` (from the free list) without those that also hold a published page: a
        damaged index (a flipped bit SQLite does not detect) must not hand out a slot whose
        record is the only copy of a page. Such slots leave the free list and are logged."""
        marks = ",".join("(?, ?)" for _ in slots)
        taken = set(db.execute(
            f"SELECT seg, slot FROM pages WHERE (seg, slot) IN (VALUES {marks})",
            [v for s in slots for v in s],
        ))
        if not taken:
            return slots
        logger.error(
            "store index %s is damaged: %d slots are both free and published (%s); they are not "
            "reused. %s", self.path, len(taken), sorted(taken)[:5], recovery_hint(self.directory),
        )
        return [s for s in slots if (s.seg, s.slot) not in taken]

    def watch_unused_slots(self, unused_slots_empty: Callable[[int, int, int], bool]) -> None:
        """Before handing out never-used slots ``[first, first + count)`` of segment ``seg``,
        ask ``unused_slots_empty(seg, first, count)`` whether they really hold no record."""
        self._unused_slots_empty = unused_slots_empty

    def _quarantine(self, db: sqlite3.Connection, seg: int, first: int, nslots: int) -> None:
        """Slots this index believes never used hold records: it lost commits (a power loss, a
        copy put back). The rest of the segment is never handed out (free, reusable only after
        ``kvtier store rebuild`` brings their records back), so no durable page is overwritten."""
        logger.warning(
            "segment %d of %s holds records in slots %d.. the index believes unused (it lost its "
            "last commits); those slots are left alone: %s", seg, self.path, first, recovery_hint(self.directory),
        )
        db.execute("UPDATE segments SET next_unused = nslots WHERE id = ?", (seg,))
        db.executemany(
            "INSERT INTO free_slots SELECT id, ?, slot_stride, ? FROM segments WHERE id = ?",
            [(slot, NEVER, seg) for slot in range(first, nslots)],
        )

    def publish(self, ns: bytes, entries: Sequence[PublishEntry]) -> list[bool]:
        """Make durable records visible (in bounded transactions).

        An entry whose reservation this writer no longer owns (reclaimed after its lease) is not
        published and returns False. A key's previous page, if any, is freed; of two entries
        for one key, the later wins (the earlier's slot is freed)."""
        self.flush_touches()
        if len(entries) <= SMALL_PUBLISH_ROWS and len({e.key for e in entries}) == len(entries):
            return self._publish_small(ns, entries)
        published = [False] * len(entries)
        latest: dict[bytes, int] = {}
        superseded: list[int] = []
        for i, entry in enumerate(entries):
            if entry.key in latest:
                superseded.append(latest[entry.key])
            latest[entry.key] = i
        counter: list[int] = []  # meta.removals as the last step left it

        def write(db: sqlite3.Connection, step: Sequence[int]) -> list[int]:
            now = time.time()
            mine = self._end_reservations(db, step, [entries[i].slot for i in step])
            self._remove_pages(db, self._page_rows(db, ns, [entries[i].key for i in mine]), now)
            meta = dict(db.execute("SELECT name, value FROM meta WHERE name IN ('clock', 'removals')"))
            counter[:] = [meta["removals"]]
            first = meta["clock"] + 1
            db.executemany(
                "INSERT INTO pages VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (ns, e.key, e.slot.seg, e.slot.slot, e.length, e.crc, e.token, first + n)
                    for n, e in enumerate(entries[i] for i in mine)
                ],
            )
            self._count_pages(db, ((ns, entries[i].length) for i in mine), 1, clock=len(mine))
            return mine

        done: list[int] = []
        try:
            # A publication step costs a dozen statements whatever its size, and its rows (fresh
            # keys into consecutive slots) are cheap: larger steps keep statements per page down.
            self._in_steps(list(latest.values()), write, done, step_rows=4 * STEP_ROWS)
        except sqlite3.Error as exc:  # what committed before stays published
            logger.warning("publishing %d pages in %s stopped after %d: %r", len(latest), self.path, len(done), exc)
        else:  # this process may answer for, and read, what it just published
            if done:
                self.presence.learn(counter[0], time.monotonic(), ns, {
                    entries[i].key: PageLocation(entries[i].slot.seg, entries[i].slot.slot,
                                                 entries[i].length, entries[i].crc, entries[i].token)
                    for i in done
                })
        for i in done:
            published[i] = True
        for i in superseded:
            published[i] = published[latest[entries[i].key]]
        self.release([entries[i].slot for i in superseded])
        return published

    def _publish_small(self, ns: bytes, entries: Sequence[PublishEntry]) -> list[bool]:
        """``publish`` of a few entries of distinct keys in one transaction of five statements
        (``publish``'s step runs seven): the reservations ended, the rows inserted (a key
        already published keeps its row until the replacement below), the counters and the
        clock advanced in one statement that also returns the removal counter, the namespace's
        counts. A put of a page costs this transaction, so its statements are kept few."""
        try:
            return self._publish_few(ns, entries)
        except sqlite3.Error as exc:  # nothing committed
            logger.warning("publishing %d pages in %s failed: %r", len(entries), self.path, exc)
            return [False] * len(entries)

    def _publish_few(self, ns: bytes, entries: Sequence[PublishEntry]) -> list[bool]:
        count = len(entries)
        length = sum(e.length for e in entries)
        with self._transaction() as db:
            if count == 1:
                slot = entries[0].slot
                owned = db.execute(
                    "DELETE FROM reservations WHERE seg = ? AND slot = ? AND owner = ? RETURNING 1",
                    (slot[0], slot[1], self.owner),
                ).fetchone() is not None
                mine = list(entries) if owned else []
            else:
                mine = self._end_reservations(db, entries, [e.slot for e in entries])
            if not mine:
                return [False] * count
            if len(mine) < count:
                count, length = len(mine), sum(e.length for e in mine)
            meta = dict(db.execute(
                "UPDATE meta SET value = value + CASE name WHEN 'clock' THEN ? WHEN 'pages' THEN ? "
                "WHEN 'used_bytes' THEN ? ELSE 0 END "
                "WHERE name IN ('clock', 'pages', 'used_bytes', 'removals') RETURNING name, value",
                (count, count, length),
            ))
            first = meta["clock"] - count + 1
            rows = [
                (ns, e.key, e.slot[0], e.slot[1], e.length, e.crc, e.token, first + n)
                for n, e in enumerate(mine)
            ]
            inserted = {row[0] for row in db.execute(
                "INSERT INTO pages VALUES " + ",".join(["(?, ?, ?, ?, ?, ?, ?, ?)"] * count)
                + " ON CONFLICT (ns, key) DO NOTHING RETURNING key",
                [v for row in rows for v in row],
            )}
            if len(inserted) < count:  # keys published before: their previous pages go
                replaced = [row for row in rows if row[1] not in inserted]
                self._remove_pages(db, self._page_rows(db, ns, [row[1] for row in replaced]), time.time())
                db.executemany("INSERT INTO pages VALUES (?, ?, ?, ?, ?, ?, ?, ?)", replaced)
                removals = self._meta(db, "removals")
            else:
                removals = meta["removals"]
            db.execute(
                "INSERT INTO namespaces VALUES (?, ?, ?) ON CONFLICT (ns) DO UPDATE SET "
                "pages = pages + excluded.pages, used_bytes = used_bytes + excluded.used_bytes",
                (ns, count, length),
            )
        # this process may answer for, and read, what it just published
        self.presence.learn(removals, time.monotonic(), ns, {
            e.key: PageLocation(e.slot[0], e.slot[1], e.length, e.crc, e.token) for e in mine
        })
        if len(mine) == len(entries):
            return [True] * len(entries)
        kept = {id(e) for e in mine}
        return [id(e) in kept for e in entries]

    def _end_reservations(self, db: sqlite3.Connection, items: Sequence, slots: Sequence[SlotRef]) -> list:
        """Drop this writer's reservations of ``slots``; returns the ``items`` (one per slot)
        whose slot it still owned (a reclaimed reservation is not ours any more)."""
        marks = ",".join("(?, ?)" for _ in slots)
        owned = set(db.execute(
            f"DELETE FROM reservations WHERE owner = ? AND (seg, slot) IN (VALUES {marks}) RETURNING seg, slot",
            (self.owner, *(v for s in slots for v in (s[0], s[1]))),
        ))
        return [item for item, s in zip(items, slots) if (s[0], s[1]) in owned]

    @staticmethod
    def _page_rows(db: sqlite3.Connection, ns: bytes, keys: Sequence[bytes]) -> list[tuple]:
        """(ns, key, seg, slot, length) rows of the published pages among ``keys``."""
        rows = []
        for chunk in _chunks(keys, _SQL_CHUNK):
            rows.extend(
                db.execute(
                    f"SELECT ns, key, seg, slot, length FROM pages "
                    f"WHERE ns = ? AND key IN ({','.join('?' * len(chunk))})",
                    (ns, *chunk),
                )
            )
        return rows

    def release(self, slots: Sequence[SlotRef]) -> None:
        """Give back reserved slots that will not be published (failed or abandoned writes).
        When the release fails (a full disk refuses the commit), the slots are released again
        by the next ``reserve`` of this index, and the error is raised."""
        slots = list(slots)
        try:
            self._in_steps(
                slots, lambda db, step: self._free(db, self._end_reservations(db, step, step), time.time())
            )
        except sqlite3.Error:
            with self._touch_lock:  # slots released already are not ours: freeing them again is a no-op
                self._unreleased.extend(slots)
            raise

    def _retry_releases(self) -> None:
        with self._touch_lock:
            pending, self._unreleased = self._unreleased, []
        if pending:
            try:
                self.release(pending)
            except sqlite3.Error as exc:
                logger.warning("%d reserved slots of %s still not released: %r", len(pending), self.path, exc)

    def delete(self, ns: bytes, keys: Sequence[bytes]) -> list[bool]:
        """Unpublish keys of namespace ``ns``; True where a page existed."""
        self.flush_touches()

        def remove(db: sqlite3.Connection, step: Sequence[bytes]) -> list[bytes]:
            rows = self._page_rows(db, ns, step)
            self._remove_pages(db, rows, time.time())
            return [row[1] for row in rows]

        existed: list[bytes] = []
        self._in_steps(list(dict.fromkeys(keys)), remove, existed)
        gone = set(existed)
        return [key in gone for key in keys]

    def drop_current(self, ns: bytes, entries: Sequence[tuple[bytes, int]]) -> list[bool]:
        """Unpublish each (key, token) only if the key's page is still that write (a record
        that failed to read or verify); True where it was dropped."""
        def drop(db: sqlite3.Connection, step: Sequence[tuple[bytes, int]]) -> list[tuple[bytes, int]]:
            rows = [
                row
                for key, token in step
                for row in db.execute(
                    "SELECT ns, key, seg, slot, length, token FROM pages "
                    "WHERE ns = ? AND key = ? AND token = ?",
                    (ns, key, token),
                )
            ]
            self._remove_pages(db, [row[:5] for row in rows], time.time())
            return [(row[1], row[5]) for row in rows]

        dropped: list[tuple[bytes, int]] = []
        self._in_steps(list(dict.fromkeys(map(tuple, entries))), drop, dropped)
        gone = set(dropped)
        return [tuple(entry) in gone for entry in entries]

    def clear(self, ns: bytes) -> int:
        """Unpublish every page of namespace ``ns`` and nothing else; returns the count."""
        self.flush_touches()
        removed = 0
        finished = False
        while not finished:
            with self._transaction() as db:
                start, rows = time.monotonic(), 0
                while not finished and rows < ROWS_PER_TRANSACTION and (
                    not rows or time.monotonic() - start < TRANSACTION_BUDGET_S
                ):
                    step = db.execute(
                        "SELECT ns, key, seg, slot, length FROM pages WHERE ns = ? LIMIT ?",
                        (ns, STEP_ROWS),
                    ).fetchall()
                    self._remove_pages(db, step, time.time())
                    rows += len(step)
                    finished = len(step) < STEP_ROWS
            removed += rows
        return removed

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

    # ----------------------------------------------------------------- rebuild
    def restore_segment(
        self, seg: int, slot_stride: int, nslots: int, records: Sequence[tuple]
    ) -> None:
        """Add segment ``seg`` to an empty index with ``records`` published, given as (ns, key,
        slot, length, crc, token, last_access); every other slot is free. Used by
        ``tool.rebuild_index`` while it holds the store exclusively."""
        now = time.time()
        with self._transaction() as db:
            db.execute("INSERT INTO segments VALUES (?, ?, ?, ?)", (seg, slot_stride, nslots, nslots))
            db.executemany(
                "INSERT INTO pages VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [(ns, key, seg, slot, length, crc, token, last_access)
                 for ns, key, slot, length, crc, token, last_access in records],
            )
            used = {r[2] for r in records}
            db.executemany(
                "INSERT INTO free_slots VALUES (?, ?, ?, ?)",
                [(seg, slot, slot_stride, now) for slot in range(nslots) if slot not in used],
            )
            self._count_pages(db, ((r[0], r[3]) for r in records), 1)
            db.execute(
                "UPDATE meta SET value = MAX(value, ?) WHERE name = 'clock'",
                (max((r[6] for r in records), default=0),),
            )

    def close(self) -> None:
        """Write buffered hits, finish background work and close the connections, waiting at
        most the busy timeout: what a stuck disk holds then is left to the process's exit."""
        finished = self._background.submit(self.flush_touches)
        try:
            finished.result(timeout=self._busy_timeout_s)
        except FutureTimeout:
            self._background.shutdown(wait=False)
            self._reads.close()
            logger.error(
                "store index %s: background work still running after %.3g s (a stuck disk?); its "
                "connections are left to the process's exit", self.path, self._busy_timeout_s,
            )
            return
        finally:
            if finished.done():
                self._close_connections()


def stored_labels(db: sqlite3.Connection) -> dict[bytes, str]:
    """ns -> label JSON of every labelled namespace; {} for an index without the labels table
    (one no kvtier with labels has opened)."""
    if not db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'namespace_labels'").fetchone():
        return {}
    return dict(db.execute("SELECT ns, label FROM namespace_labels"))


def namespace_rows(db: sqlite3.Connection) -> list[tuple[bytes, int, int, str | None]]:
    """(ns, pages, used bytes, label or None) of every namespace with pages, most pages first,
    from the kept counters."""
    labels = stored_labels(db)
    rows = db.execute("SELECT ns, pages, used_bytes FROM namespaces WHERE pages > 0 ORDER BY pages DESC")
    return [(ns, pages, used, labels.get(ns)) for ns, pages, used in rows]
