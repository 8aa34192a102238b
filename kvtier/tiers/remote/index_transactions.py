"""Write transactions of the remote index and the bookkeeping every write shares.

Owns the index's one write connection while a transaction runs (``BEGIN IMMEDIATE`` under the
index's lock, at most the busy timeout to get it), the WAL checkpoints after commits (on the
background thread, never under the lock), the steps that keep each transaction short
(``_in_steps``: ``STEP_ROWS`` rows at a time, commit after ``TRANSACTION_BUDGET_S`` or
``ROWS_PER_TRANSACTION`` rows), the kept counters (meta, per namespace), the logical clock, and
removing pages into the free list. ``RemoteIndex`` (index.py) inherits it. It must never choose
which slots or pages a call takes (index_slots.py, index_publish.py do).
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import time
from collections import Counter
from typing import Callable, Iterable, Iterator, Optional, Sequence

logger = logging.getLogger("kvtier.tiers.remote.index")  # the index's one logger, whichever file speaks

ROWS_PER_TRANSACTION = 256
STEP_ROWS = 16
TRANSACTION_BUDGET_S = 0.002
CHECKPOINT_EVERY_TRANSACTIONS = 64
CHECKPOINT_EVERY_S = 1.0


class IndexTransactions:
    """The write plumbing of ``RemoteIndex``."""

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
