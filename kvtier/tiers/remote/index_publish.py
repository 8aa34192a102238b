"""Publication and removal of pages in the remote index: making durable records visible
(``publish``; a few pages in one short transaction, ``_publish_small``), and unpublishing them
(``delete``, ``drop_current`` for a record that failed to verify, ``clear`` for a namespace).
A page becomes visible only while its writer still owns the reservation. ``RemoteIndex``
(index.py) inherits it. It must never hand out slots (index_slots.py does).
"""

from __future__ import annotations

import logging
import sqlite3
import time
from typing import Iterator, NamedTuple, Sequence

from kvtier.tiers.remote.index_reads import _SQL_CHUNK, PageLocation
from kvtier.tiers.remote.index_slots import SlotRef
from kvtier.tiers.remote.index_transactions import ROWS_PER_TRANSACTION, STEP_ROWS, TRANSACTION_BUDGET_S

logger = logging.getLogger("kvtier.tiers.remote.index")  # the index's one logger, whichever file speaks

SMALL_PUBLISH_ROWS = 4  # publications of up to this many pages run ``_publish_small``


class PublishEntry(NamedTuple):
    """A durable record to make visible: key id, slot, payload length, CRC32C, write token."""

    key: bytes
    slot: SlotRef
    length: int
    crc: int
    token: int


def _chunks(items: Sequence, size: int) -> Iterator[Sequence]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


class IndexPublication:
    """Publication and removal of pages, for ``RemoteIndex``."""

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
        """``publish`` of a few entries of distinct keys in one transaction of six statements
        (``publish``'s step runs seven): the reservations ended, the counters and the clock
        advanced, the clock and the removal counter read, the rows inserted (a key already
        published keeps its row until the replacement below), the namespace's counts. A put of
        a page costs this transaction, so its statements are kept few and cheap: an UPDATE ...
        RETURNING of the counters cost SQLite 14 µs against 7 for the UPDATE and a SELECT, and a
        one-row DELETE or INSERT tells what it did through ``rowcount`` (1.2-1.8 µs less than
        RETURNING, 2-core VM)."""
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
                    "DELETE FROM reservations WHERE seg = ? AND slot = ? AND owner = ?",
                    (slot[0], slot[1], self.owner),
                ).rowcount == 1
                mine = list(entries) if owned else []
            else:
                mine = self._end_reservations(db, entries, [e.slot for e in entries])
            if not mine:
                return [False] * count
            if len(mine) < count:
                count, length = len(mine), sum(e.length for e in mine)
            db.execute(
                "UPDATE meta SET value = value + CASE name WHEN 'clock' THEN ? WHEN 'pages' THEN ? "
                "ELSE ? END WHERE name IN ('clock', 'pages', 'used_bytes')",
                (count, count, length),
            )
            meta = dict(db.execute("SELECT name, value FROM meta WHERE name IN ('clock', 'removals')"))
            first = meta["clock"] - count + 1
            rows = [
                (ns, e.key, e.slot[0], e.slot[1], e.length, e.crc, e.token, first + n)
                for n, e in enumerate(mine)
            ]
            if count == 1:  # (RETURNING costs SQLite more than the statement: rowcount says it)
                inserted = {rows[0][1]} if db.execute(
                    "INSERT INTO pages VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (ns, key) DO NOTHING", rows[0]
                ).rowcount == 1 else set()
            else:
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
