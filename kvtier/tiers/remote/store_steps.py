"""The steps of a put and a get in the remote store, in the order that keeps its promises.

A put: slots reserved (a small put takes this store's spare reservations), segments located,
records written and made durable, only then published, and every slot not published given back.
A get: locations from memory for a small batch (a stale one costs a second read, never wrong
bytes) or from the index, records read and checked, and pages that failed their checks taken
out of the index unless a writer replaced them meanwhile. ``RemoteStore`` (store.py) inherits
it; its public calls check their input and hand over. It must never move bytes itself
(``datapath`` and ``small_batches`` do) nor decide which slot holds which page (``index``).
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections import Counter
from typing import Optional, Sequence

from kvtier.tiers.remote.buffers import PageBuffers
from kvtier.tiers.remote.datapath import REQUEST_ERRORS
from kvtier.tiers.remote.errors import StoreUnsafe
from kvtier.tiers.remote.index_publish import PublishEntry
from kvtier.tiers.remote.index_reads import PageLocation
from kvtier.tiers.remote.index_slots import Reservation, SlotRef
from kvtier.tiers.remote.records import new_tokens
from kvtier.tiers.remote.small_batches import SMALL_BATCH_PAGES

logger = logging.getLogger("kvtier.tiers.remote.store")  # the store's one logger, whichever file speaks

# Slots a small put reserves ahead for the next ones (see ``StoreSteps._reserve``), and how
# long they are kept before going back.
SPARE_SLOTS = 16
SPARE_MAX_AGE_S = 30.0


def _log_by_reason(message: str, bad: dict[int, str]) -> None:
    """One warning per distinct reason, with how many pages it took."""
    if not bad:
        return
    for reason, count in Counter(bad.values()).items():
        logger.warning(message, count, reason)


class StoreSteps:
    """The put and get steps of ``RemoteStore``."""

    def _reserve(self, count: int):
        """Slots for ``count`` pages: a small batch takes this store's spare reservations (and
        reserves ``SPARE_SLOTS`` more with its own when they run out), so a small put commits
        one index transaction, its publication; others reserve their own."""
        spare = 0
        if count <= SMALL_BATCH_PAGES:
            with self._spare_lock:
                stale = self._spares if time.monotonic() - self._spares_at > self._spare_age_s else []
                if stale:
                    self._spares = []
                elif len(self._spares) >= count:
                    taken, self._spares = self._spares[:count], self._spares[count:]
                    return Reservation(taken, 0)
            self._release_quietly(stale)
            # at most 1/64 of the capacity, so spares never make a store evict noticeably early
            spare = min(SPARE_SLOTS, self.capacity_bytes // (64 * self.slot_stride))
        reservation = self._index.reserve(
            count,
            length=self.page_bytes,
            slot_stride=self.slot_stride,
            slots_per_segment=self.slots_per_segment,
            capacity_bytes=self.capacity_bytes,
            high_watermark=self.high_watermark,
            low_watermark=self.low_watermark,
            create_segment=self._medium.create,
            spare=spare,
        )
        if len(reservation.slots) > count:
            extra = reservation.slots[count:]
            with self._spare_lock:
                if not self._spares:
                    self._spares_at = time.monotonic()
                self._spares.extend(extra)
            reservation = Reservation(reservation.slots[:count], reservation.evicted)
        return reservation

    def _release_spares(self) -> None:
        with self._spare_lock:
            spares, self._spares = self._spares, []
        self._release_quietly(spares)

    def _put(self, ids: list[bytes], pages: PageBuffers) -> list[bool]:
        try:
            reservation = self._reserve(len(ids))
        except (sqlite3.Error, OSError) as exc:
            logger.warning("remote put of %d pages could not reserve slots: %r", len(ids), exc)
            self._count(write_failures=len(ids))
            return [False] * len(ids)
        slots = reservation.slots
        if reservation.evicted or len(slots) < len(ids):
            self._count(evictions=reservation.evicted, rejected_writes=len(ids) - len(slots))
        published = [False] * len(ids)
        if not slots:
            return published
        tokens = new_tokens(len(slots))
        try:
            located = self._medium.locate(slots, self.page_bytes, for_write=True)
        except REQUEST_ERRORS as exc:
            logger.warning("remote put of %d pages could not open segments: %r", len(slots), exc)
            self._release_quietly(slots)
            self._count(write_failures=len(slots))
            return published
        except StoreUnsafe:
            self._release_quietly(slots)
            raise
        _log_by_reason("remote put: %d pages not written: %s", located.bad)
        writable = [i for i in range(len(slots)) if i not in located.bad]
        durable = self._path.write_durable(ids, tokens, located, writable, pages)
        moved, crcs = durable if durable is not None else self._path.write(ids, tokens, located, writable, pages)
        try:
            if moved:
                if durable is None:
                    self._medium.make_durable({slots[i].seg for i in moved})
                if self.faults.before_publish is not None:
                    self.faults.before_publish([ids[i] for i in moved])
                outcome = self._index.publish(
                    self._ns_fp,
                    [PublishEntry(ids[i], slots[i], self.page_bytes, crcs[i], tokens[i]) for i in moved],
                )
                for i, ok in zip(moved, outcome):
                    published[i] = ok
        except (OSError, sqlite3.Error) as exc:
            logger.warning("remote put of %d pages failed to sync or publish: %r", len(moved), exc)
        self._release_quietly([slots[i] for i in range(len(slots)) if not published[i]])
        written = sum(published)
        self._count(write_failures=len(slots) - written, bytes_written=written * self.page_bytes)
        return published

    def _release_quietly(self, slots: Sequence[SlotRef]) -> None:
        if not slots:
            return
        try:
            self._index.release(slots)
        except sqlite3.Error as exc:
            logger.error("could not release %d reserved slots (reclaimed when this process "
                         "exits): %r", len(slots), exc)

    def _get(self, ids: list[bytes], pages: PageBuffers, prefix: bool) -> list[bool]:
        if self.faults.quiet("READ"):
            remembered = self._index.presence.locations(self._ns_fp, ids)
            if remembered is not None:
                found = self._read_remembered(ids, pages, remembered)
                if found is not None:
                    return found
        locations = self._index.lookup(self._ns_fp, ids)
        wanted = []
        for i, loc in enumerate(locations):
            if loc is not None and loc.length == self.page_bytes:
                wanted.append(i)
            elif prefix:
                break
        found = [False] * len(ids)
        failed: list[int] = []
        checks: list = []
        if wanted:
            try:
                located = self._medium.locate(
                    [SlotRef(locations[i].seg, locations[i].slot) for i in wanted],
                    self.page_bytes, for_write=False,
                )
            except REQUEST_ERRORS as exc:
                logger.warning("remote get of %d pages could not open segments: %r", len(wanted), exc)
                located = None
                failed.extend(wanted)
            if located is not None:
                _log_by_reason("remote get: %d pages unreadable: %s", located.bad)
                failed.extend(wanted[j] for j in located.bad)
                readable = [j for j in range(len(wanted)) if j not in located.bad]
                request_failed, checks = self._path.read(
                    ids, located, wanted, readable, locations, pages
                )
                failed.extend(request_failed)
        for sources, check in checks:
            for i, ok in zip(sources, check.result()):
                found[i] = ok
        self._unpublish_failed(
            [(ids[i], locations[i]) for i in failed],
            [(ids[i], locations[i]) for sources, _ in checks for i in sources if not found[i]],
        )
        hits = [ids[i] for i in range(len(ids)) if found[i]]
        if hits and self._index.touch(self._ns_fp, hits):
            self._index.flush_touches_later()
        self._count(hits=len(hits), misses=len(ids) - len(hits), bytes_read=len(hits) * self.page_bytes)
        return found

    def _read_remembered(self, ids: list[bytes], pages: PageBuffers, locations: list) -> Optional[list[bool]]:
        """Read a batch at the locations this process remembers (no SQLite read); None
        when any page is not where it was remembered (replaced, removed, unreadable): the
        caller then reads the batch's locations from the index, so a stale location costs a
        second read, never wrong bytes. Nothing is unpublished from here."""
        if any(loc.length != self.page_bytes for loc in locations):
            return None
        try:
            located = self._medium.locate(
                [SlotRef(loc.seg, loc.slot) for loc in locations], self.page_bytes, for_write=False
            )
        except REQUEST_ERRORS:
            return None
        wanted = list(range(len(ids)))
        if located.bad:
            return None
        failed, checks = self._path.read(ids, located, wanted, wanted, locations, pages)
        verdicts = [ok for _, check in checks for ok in check.result()]
        if failed or len(verdicts) != len(ids) or not all(verdicts):
            self._index.presence.forget(self._ns_fp, ids)
            self._count(stale_locations=1)
            return None
        if self._index.touch(self._ns_fp, ids):
            self._index.flush_touches_later()
        self._count(locations_from_memory=1, hits=len(ids), bytes_read=len(ids) * self.page_bytes)
        return [True] * len(ids)

    def _unpublish_failed(
        self, unreadable: list[tuple[bytes, PageLocation]], bad: list[tuple[bytes, PageLocation]]
    ) -> None:
        """Take pages that could not be read, or whose records failed their checks, out of the
        index, unless a writer replaced them meanwhile (a raced read)."""
        if not unreadable and not bad:
            return
        try:
            dropped = self._index.drop_current(
                self._ns_fp, [(key, loc.token) for key, loc in unreadable + bad]
            )
        except sqlite3.Error as exc:
            logger.error("could not unpublish %d unreadable remote pages: %r", len(unreadable) + len(bad), exc)
            dropped = [False] * (len(unreadable) + len(bad))
        corrupt = sum(dropped[len(unreadable):])
        for (key, loc), ok in zip(bad, dropped[len(unreadable):]):
            if ok:
                logger.warning(
                    "remote page %s in segment %d slot %d failed its header/checksum check; dropped",
                    key.hex(), loc.seg, loc.slot,
                )
        self._count(
            read_failures=len(unreadable), corrupt_reads=corrupt, raced_reads=len(bad) - corrupt
        )
