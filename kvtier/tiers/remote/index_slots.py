"""Slots of the remote store: reserving them for a writer (free ones past their reuse delay,
never-used ones, new segments), LRU eviction between the watermarks to make room, giving back
what will not be published, reclaiming the reservations of writers that died, setting aside
never-used slots that hold records (``_quarantine``), and restoring a segment on rebuild.
``RemoteIndex`` (index.py) inherits it; every change runs in the index's bounded write
transactions (index_transactions.py). It must never write a page's row (index_publish.py
does) nor touch a segment file beyond the callbacks it is given.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence

from kvtier.tiers.remote.index_schema import recovery_hint
from kvtier.tiers.remote.index_transactions import ROWS_PER_TRANSACTION, STEP_ROWS, TRANSACTION_BUDGET_S
from kvtier.tiers.remote.owners import owner_is_dead

logger = logging.getLogger("kvtier.tiers.remote.index")  # the index's one logger, whichever file speaks

RECLAIM_INTERVAL_S = 30.0
NEVER = 1e300  # free_after of quarantined slots (see ``_quarantine``)


class SlotRef(NamedTuple):
    """One slot of one segment file."""

    seg: int
    slot: int


@dataclass(frozen=True)
class Reservation:
    """Result of ``reserve``: slots now owned by the caller, in request order."""

    slots: list[SlotRef]
    evicted: int


class IndexSlots:
    """Slot reservation, eviction and reclaiming of ``RemoteIndex``."""

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

    def _end_reservations(self, db: sqlite3.Connection, items: Sequence, slots: Sequence[SlotRef]) -> list:
        """Drop this writer's reservations of ``slots``; returns the ``items`` (one per slot)
        whose slot it still owned (a reclaimed reservation is not ours any more)."""
        marks = ",".join("(?, ?)" for _ in slots)
        owned = set(db.execute(
            f"DELETE FROM reservations WHERE owner = ? AND (seg, slot) IN (VALUES {marks}) RETURNING seg, slot",
            (self.owner, *(v for s in slots for v in (s[0], s[1]))),
        ))
        return [item for item, s in zip(items, slots) if (s[0], s[1]) in owned]

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
            if owner_is_dead(owner, created, now, self.reservation_lease_s)
        ]
        db.executemany("DELETE FROM reservations WHERE seg = ? AND slot = ?", dead)
        self._free(db, dead, now)
        return len(dead)

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
