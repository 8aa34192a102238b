"""Making the pool durable: what `flush` and `close` wait for.

Owns the loop that pushes every page not yet durable down the tiers (device pages copied to
the host tier, host pages backed up to the remote tier), waits outside the lock for the copies
and backups in flight, and says which pages could not be made durable (a failing remote tier,
pages that cannot be encoded) within a deadline. TieredPool (pool.py) inherits it. It must
never drop a page itself nor hold the lock while it waits.
"""

from __future__ import annotations

import logging
import time

from kvtier.index import PageState
from kvtier.index.keys import KEY_ID_BYTES

S = PageState
log = logging.getLogger("kvtier.pool.pool")  # the pool's one logger, whichever file speaks
# A flush looks again at what it owes this often while backups are still queued (under steady
# commits the backup queue may never drain, and the pages owed are done long before it does), or
# less often where looking takes long: at most FLUSH_LOOK_SHARE of the time, under the lock.
FLUSH_ROUND_S = 0.25
FLUSH_LOOK_SHARE = 0.05


class Draining:
    """The flush loop of TieredPool."""

    def _flush(self, deadline: float | None) -> tuple[int, int]:
        """Make durable the pages that are not when the flush starts (pages committed meanwhile
        are copied too, but not waited for or counted: under steady commits a flush would
        otherwise never see nothing left, and would report new pages as failures). Returns
        (pages still not durable, pages dropped meanwhile, already counted by their reason)."""
        keep = None if self.write_policy.keeps_every_page else self.write_policy.copy_on_evict
        dropped = self.counters.dropped
        dropped_before = dropped.get("not_encodable", 0) + dropped.get("remote_unavailable", 0)
        last = None
        stuck = False
        round_s = FLUSH_ROUND_S
        owed = None  # key ids of the pages not durable when the flush started
        probe_first = True
        while True:
            with self._lock:
                began = time.monotonic()
                self._reap()
                dev = self._dev
                dev_kept = dev.dirty_kept(keep)
                kept_ids = None
                if owed is None:  # one block of ids (no object a page) until a round leaves some
                    parts = []
                    for index, slots in self._not_durable_slots(dev_kept):
                        ids = index.ids_of(slots)
                        if slots is dev_kept:
                            kept_ids = ids
                        parts.append(b"".join(ids))
                    owed = b"".join(parts)
                # Host pages first: their backups probe a remote tier the breaker holds off.
                # A page already queued keeps its place (appending would move it behind the
                # pages committed since, which steady commits would keep doing).
                if self._link is not None:
                    queue = self._backup_queue
                    unqueued = [s for s in self._host.idle(self._host.dirty_kept(keep)) if s not in queue]
                    if unqueued:
                        queue.extend_unlisted(unqueued)
                    if len(self._backup_queue):
                        self._breaker.force_probe()
                        self._backup_work.notify()
                # Flush copies every dirty page itself (after the latest commit's event, which
                # follows every queued batch's): the offload thread's queued batches go, or one
                # would copy a page again after flush returned, once something made it dirty.
                self._pending_down.clear()
                dev_dirty = dev.idle(dev_kept)
                # A copy down needs host room, which an unhealthy remote tier makes by dropping
                # dirty host pages: the first round lets the probe answer before copying down.
                waiting_for_probe = (probe_first and dev_dirty and self._link is not None
                                     and not self._breaker.healthy and len(self._backup_queue))
                probe_first = False
                if dev_dirty and not waiting_for_probe:
                    # (every kept page idle, the common case: their ids are those just read)
                    self._copy_down(dev_dirty, evicting=False, ids=kept_ids if len(dev_dirty) == len(dev_kept) else None)
                locked = time.monotonic() - began
            # Wait for everything this round started (or a round's time, while backups are still
            # queued), then look again while that helps.
            idle = self._wait_idle(deadline, round_s)
            with self._lock:
                self._reap()
                looked = time.monotonic()
                on_device, on_host = self._not_durable_ids() if owed and self._any_not_durable() else (set(), set())
                round_s = max(FLUSH_ROUND_S, (locked + time.monotonic() - looked) / FLUSH_LOOK_SHARE)
                if type(owed) is bytes:
                    owed = {owed[at : at + KEY_ID_BYTES] for at in range(0, len(owed), KEY_ID_BYTES)} if on_device or on_host else set()
                owed &= on_device | on_host
                left = len(owed)
                if idle:  # progress is judged between idle rounds only
                    # Progress is a page a tier nearer durable: one copied down from the device counts.
                    distance = left + len(owed & on_device)
                    stuck = last is not None and distance >= last and not waiting_for_probe
                    last = distance
            if not left or stuck or (deadline is not None and time.monotonic() >= deadline):
                break
        gone = dropped.get("not_encodable", 0) + dropped.get("remote_unavailable", 0) - dropped_before
        if left + gone:
            log.warning("flush: %d pages could not be made durable (remote failures: %s; last error: %s)",
                        left + gone, dict(self.counters.remote_failures), self._breaker.last_error)
        return left, gone

    def _not_durable_slots(self, dev_kept: list[int] | None = None) -> list[tuple]:
        """(tier, slots) of the pages the write policy keeps that no last tier holds yet, dirty
        or being copied down, for the device then the host tier (the host tier's only with a
        remote tier). O(dirty pages); slots being copied are found with one vectorized scan of
        the tier's states, only while copies are in flight. dev_kept: the device's kept dirty
        slots, when the caller has them (they are the device's slots then, unless copies are
        in flight)."""
        keep = None if self.write_policy.keeps_every_page else self.write_policy.copy_on_evict
        found = []
        for index in (self._dev, self._host):
            slots: list[int] = []
            if index is self._dev or self._link is not None:
                slots = dev_kept if index is self._dev and dev_kept is not None else index.dirty_kept(keep, ordered=False)
                if index.counts[S.OFFLOADING]:
                    slots = slots + index.slots_in(S.OFFLOADING)
            found.append((index, slots))
        return found

    def _not_durable_ids(self) -> tuple[set[bytes], set[bytes]]:
        """Key ids of `_not_durable_slots`: (on the device, in the host tier)."""
        (dev, on_dev), (host, on_host) = self._not_durable_slots()
        return set(dev.ids_of(on_dev)), set(host.ids_of(on_host))

    def _any_not_durable(self) -> bool:
        """Whether a page may not be durable yet (any DIRTY or OFFLOADING page where
        `_not_durable_ids` looks): O(1), so that a flush that made everything durable does not
        collect ids to find nothing."""
        dev, host = self._dev.counts, self._host.counts
        return bool(dev[S.DIRTY] or dev[S.OFFLOADING]
                    or self._link is not None and (host[S.DIRTY] or host[S.OFFLOADING]))

    def _wait_idle(self, deadline: float | None, round_s: float | None = None) -> bool:
        """Wait outside the lock until no engine copy is in flight and the backup queue has
        drained, the breaker refuses to try again, or the backup in flight has stalled inside
        the store, before `deadline`. Returns True then; False once `round_s` has passed with
        backups still queued or running (the caller looks at what it owes and comes back)."""
        round_end = None if round_s is None else time.monotonic() + round_s
        while True:
            with self._lock:
                self._reap()
                tickets = [t for t, _ in self._inflight]
                if not tickets:
                    if self._link is None:
                        return True
                    # A backup stalled inside the store (room.py, `_backup_stalled`) is not waited
                    # for: it may never return, and the writer waits in it, so the queue cannot move.
                    stalled = self._backups_stalled
                    busy = self._backups_in_flight > stalled or (
                        not stalled and len(self._backup_queue) and self._breaker.wait_s() == 0)
                    if not busy:
                        return True
                    now = time.monotonic()
                    remaining = None if deadline is None else deadline - now
                    if remaining is not None and remaining <= 0:
                        return True
                    if round_end is not None:
                        if now >= round_end:
                            return False
                        remaining = round_end - now if remaining is None else min(remaining, round_end - now)
                    self._changed.wait(timeout=remaining if remaining is not None else 1.0)
                    continue
            for ticket in tickets:
                ticket.synchronize()
