"""Shared, crash-safe index of the remote page store: which slot holds which page.

Owns the SQLite database ``index.sqlite3`` in a store directory and every decision about slots:
allocation, publication, LRU eviction between watermarks, freeing, and reclaiming the slots of
writers that died. It is pure Python (stdlib ``sqlite3``) and moves no page bytes; the store
moves bytes with NIXL and calls ``reserve`` before writing a record and ``publish`` only after
the record is durable.

One class, ``RemoteIndex``, over a module per concept: this one opens and closes the connections
and buffers LRU hits; ``index_schema.py`` holds the tables, ``index_transactions.py`` the short
write transactions and kept counters, ``index_slots.py`` reservation, eviction and reclaiming,
``index_publish.py`` publication and removal, ``index_reads.py`` the reads; ``owners.py`` says
who a writer is and whether it died.

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

import logging
import os
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Iterable, Optional, Sequence

from kvtier.tiers.remote.bounded import BoundedCalls
from kvtier.tiers.remote.errors import StoreCorrupt
from kvtier.tiers.remote.index_publish import IndexPublication
from kvtier.tiers.remote.index_reads import MAX_READERS, IndexReads
from kvtier.tiers.remote.index_schema import create_or_check_schema, namespace_rows, recovery_hint
from kvtier.tiers.remote.index_slots import IndexSlots, SlotRef
from kvtier.tiers.remote.index_transactions import IndexTransactions
from kvtier.tiers.remote.presence import RECHECK_S, PresenceCache

logger = logging.getLogger(__name__)

TOUCH_FLUSH_PAGES = 4096
TOUCH_FLUSH_S = 1.0
CACHE_KIB = 64 << 10


class RemoteIndex(IndexPublication, IndexSlots, IndexTransactions, IndexReads):
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
        self._touch_flush_asked = False  # a touch asked for a flush that has not swapped the hits out yet
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
            create_or_check_schema(db, self.path, self.directory)

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

    def flush_touches_later(self) -> None:
        """``flush_touches`` on the index's background thread; a failure only delays the hits."""

        def flush() -> None:
            try:
                self.flush_touches()
            except sqlite3.Error as exc:
                logger.warning("could not record LRU hits in %s yet: %r", self.path, exc)

        self._background.submit(flush)

    def touch(self, ns: bytes, keys: Iterable[bytes]) -> bool:
        """Record hits for LRU, written before this index's next write. Returns True when enough
        are buffered (``TOUCH_FLUSH_PAGES``, or older than ``TOUCH_FLUSH_S``) that the caller
        should call ``flush_touches``, from a thread of its choice. Asks once until a flush
        takes the buffered hits: a hit arriving while an asked-for flush is still queued or
        writing adds to the next one instead of asking again (a caller that reads many pages a
        second would otherwise queue a flush with nearly every call)."""
        with self._touch_lock:
            if not self._pending_touches:
                self._oldest_touch = time.monotonic()
            self._pending_touches.extend((ns, key) for key in keys)
            if self._touch_flush_asked:
                return False
            due = (
                len(self._pending_touches) >= TOUCH_FLUSH_PAGES
                or time.monotonic() - self._oldest_touch >= TOUCH_FLUSH_S
            )
            self._touch_flush_asked = due
            return due

    def flush_touches(self) -> None:
        """Write buffered hits (in bounded transactions)."""
        if not self._pending_touches:  # read without the lock: a hit added meanwhile waits for the next flush
            return
        with self._touch_lock:
            touches, self._pending_touches = self._pending_touches, []
            self._touch_flush_asked = False

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
