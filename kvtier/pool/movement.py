"""Movement: the copies TieredPool schedules, between device and host and to and from the remote tier.

Owns starting copies (offload to the host tier, reload to the device, device to device, reads
from and backups to the remote tier), what happens when each lands (page states, holds,
counters), the offload thread's loop, and reaping finished copies. TieredPool (pool.py)
inherits it: the pool's face decides under its lock, then calls these, which start copies and
return at once; a copy's `finish` runs under the lock from whichever call reaps it.
It must never wait for a copy while it holds the lock, nor touch page bytes (the transfer
engine and the remote link do).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvtier.index import PageState

if TYPE_CHECKING:
    from kvtier.transfer import Ticket

S = PageState
log = logging.getLogger("kvtier.pool.pool")  # the pool's one logger, whichever file speaks
# States whose bytes are readable in place (a page being offloaded is still whole where it was).
_READABLE = [s in (S.RESIDENT, S.DIRTY, S.OFFLOADING) for s in PageState]


class Movement:
    # --- internals: copies -----------------------------------------------------------------
    def _copy_down(self, dev_slots: list[int], evicting: bool, ids: list[bytes] | None = None) -> list[int]:
        """Start offloading dirty device pages to the host tier (as many as it has room for now).

        Pages the host tier already has become clean at once; pages it is still fetching are
        left dirty. evicting: each page copied is freed when its copy lands. Returns the device
        slots that are clean now or whose copy started. Never waits. ids: the slots' key ids,
        when the caller has read them.
        """
        dev, host = self._dev, self._host
        hstate, readable = host.state, _READABLE
        if ids is None:
            ids = dev.ids_of(dev_slots)
        found = host.table.get_many(ids)
        if max(found, default=-1) < 0:  # none in the host tier (the common case): no loop
            return self._start_copy_down(list(dev_slots), ids, evicting)
        clean, moving, moving_ids = [], [], []
        for slot, kid, h in zip(dev_slots, ids, found):
            if h < 0:
                moving.append(slot)
                moving_ids.append(kid)
            elif readable[hstate[h]]:
                clean.append(slot)
        dev.set_states(clean, S.RESIDENT)
        if not moving:
            return clean
        return clean + self._start_copy_down(moving, moving_ids, evicting)

    def _offload_loop(self) -> None:
        """The offload thread: starts the write-through copies that commits queued."""
        dev = self._dev
        with self._lock:
            while True:
                while not self._pending_down and not self._closed:
                    self._offload_work.wait()
                if self._closed:
                    return  # close flushed every dirty page first
                batches, self._pending_down = self._pending_down, []
                for slots, ids, ready in batches:
                    get = dev.table.get
                    live = [(s, k) for s, k in zip(slots, ids)
                            if dev.state[s] == S.DIRTY and not dev.busy[s] and get(k) == s]
                    if not live:
                        continue
                    try:
                        self._start_copy_down([s for s, _ in live], [k for _, k in live], evicting=False, ready=ready)
                    except Exception:  # the pages stay dirty: eviction or flush copies them
                        log.exception("write-through copy of %d pages failed to start", len(live))
                self._changed.notify_all()

    def _start_copy_down(self, moving: list[int], ids: list[bytes], evicting: bool, ready=None) -> list[int]:
        """Copy dirty device pages that the host tier does not hold (`ids` are their keys) into
        as many host slots as there is room for now; returns the device slots whose copy started.
        The copy waits for `ready` (default: the latest commit's event)."""
        dev, host = self._dev, self._host
        host_slots = self._take_host(len(moving), busy_delta=1)
        moving = moving[: len(host_slots)]
        if not moving:
            return []
        host.bind_all(host_slots, ids[: len(host_slots)])
        # Distinct slots from here on: the host tier just keyed each one's page.
        dev.set_states(moving, S.OFFLOADING, busy_delta=1, distinct=True)
        if evicting:
            for slot in moving:
                self._evicting[slot] = 1
        try:
            ticket = self.engine.offload(moving, host_slots, ready=self._ready if ready is None else ready)
        except BaseException:
            # No copy started: the pages stay dirty on the device (eviction or flush copies them
            # later) and the host slots go back to the free list.
            host.set_states(host_slots, S.FREE, busy_delta=-1)
            dev.set_states(moving, S.DIRTY, busy_delta=-1, distinct=True)
            if evicting:
                for slot in moving:
                    self._evicting[slot] = 0
            raise

        def finish() -> None:
            failed = set(ticket.failed_positions())
            bad = sorted(failed)
            if failed:
                good = [i for i in range(len(moving)) if i not in failed]
                dev_good, host_good = [moving[i] for i in good], [host_slots[i] for i in good]
            else:
                dev_good, host_good = moving, host_slots
            dev.set_states(dev_good, S.RESIDENT, busy_delta=-1, distinct=True)
            host.set_states(host_good, S.DIRTY if self._link is not None else S.RESIDENT, busy_delta=-1, distinct=True)
            if bad:
                self._refuse_unencodable([moving[i] for i in bad], [host_slots[i] for i in bad])
            self.counters.moved("device_to_host", len(dev_good), len(dev_good) * self.fmt.page_bytes)
            if self._link is not None and self.write_policy.copy_on_commit() and host_good:
                for slot in host_good:
                    self._backup_queue.append(slot)
                self._backup_work.notify()
            if evicting:
                self._free_evicted(moving)

        self._submit(ticket, finish)
        return moving

    def _refuse_unencodable(self, dev_slots: list[int], host_slots: list[int]) -> None:
        """Pages whose offload could not encode them (NaN or Inf over fp8 storage) leave the
        cache: the host slot is freed, the device slot is unkeyed (back to FILLING while the
        engine holds it, else freed). Counted and logged; the engine's own copy is untouched."""
        dev, host = self._dev, self._host
        if not self._bad_page_logged:
            self._bad_page_logged = True
            log.warning(
                "%d pages could not be encoded as %s (NaN or Inf in the KV); they are not cached, counted in "
                "kvtier_dropped_pages_total{reason=\"not_encodable\"} (first key id %s)",
                len(dev_slots), self.fmt.dtype, dev.id_of(dev_slots[0]).hex(),
            )
        host.unhold_all(host_slots)
        host.set_states(host_slots, S.FREE)
        for slot in dev_slots:
            self._evicting[slot] = 0
            dev.busy[slot] -= 1
            if not dev.busy[slot]:
                dev.busy_slots -= 1
            dev.table.unbind(slot)
            dev.set_state(slot, S.FILLING if dev.pins[slot] else S.FREE)
        self._count_drop("not_encodable", len(dev_slots))

    def _copy_popular(self, dev_slots: list[int]) -> None:
        """write_through_selective: copy down the dirty pages that just reached enough hits."""
        if not self.write_policy.copies_on_hit:
            return
        dev = self._dev
        ready = [s for s in dev_slots if dev.state[s] == S.DIRTY and not dev.busy[s] and self.write_policy.copy_on_hit(dev.hits[s])]
        if ready:
            self._copy_down(ready, evicting=False)

    def _reload(self, host_slots: list[int], dev_slots: list[int], ids: list[bytes], keyed: list[bool]) -> Ticket:
        """Copy host pages (held busy by the caller, whose holds the copy takes over) into device
        slots (FILLING, held by the caller). Keyed targets become LOADING pages of their key
        until the copy lands; the others stay private copies."""
        dev, host = self._dev, self._host
        if all(keyed):
            landing, private = dev_slots, []
            dev.bind_all(dev_slots, ids)
        else:
            landing = [s for s, b in zip(dev_slots, keyed) if b]
            private = [s for s, b in zip(dev_slots, keyed) if not b]
            dev.bind_all(landing, [k for k, b in zip(ids, keyed) if b])
            dev.hold_all(private)
        dev.set_states(landing, S.LOADING, busy_delta=1, distinct=True)  # keyed just above
        try:
            ticket = self.engine.reload(host_slots, dev_slots, ready=self.engine.record_ready())
        except BaseException:
            # The copy never started: the slots go back to the caller as they came (FILLING,
            # unkeyed, held), and the host pages stay the caller's to let go.
            for slot in landing:
                dev.table.unbind(slot)
            dev.set_states(landing, S.FILLING, busy_delta=-1, distinct=True)
            dev.unhold_all(private)
            raise
        number = self._dev_landing.mark(landing, ticket)

        def finish() -> None:
            dev.set_states(landing, S.RESIDENT, busy_delta=-1, distinct=True)
            dev.unhold_all(private)
            host.unhold_all(host_slots, distinct=True)  # the slots of distinct keys
            self._dev_landing.clear(landing, number)
            self.counters.moved("host_to_device", len(dev_slots), len(dev_slots) * self.fmt.page_bytes)

        self._submit(ticket, finish)
        return ticket

    def _landed(self, srcs: list[int], targets: list[int], flags: list):
        """What happens when a `_load_now` chunk's copy lands: its pages become RESIDENT (or,
        cancelled, their slots free) and its host sources are let go. flags: [cancelled, landed,
        the chunk's number in `_dev_landing` (0: never marked)]."""
        dev, host, landing = self._dev, self._host, self._dev_landing

        def finish() -> None:
            flags[1] = True
            dev.set_states(targets, S.FREE if flags[0] else S.RESIDENT, busy_delta=-1, distinct=True)
            host.unhold_all(srcs, distinct=True)
            if flags[2]:
                landing.clear(targets, flags[2])
            self.counters.moved("host_to_device", len(targets), len(targets) * self.fmt.page_bytes)

        return finish

    def _device_copy(self, src: list[int], dst: list[int]) -> Ticket:
        dev = self._dev
        dev.hold_all(src, touch=True)
        dev.hold_all(dst)
        ticket = self.engine.device_copy(src, dst)

        def finish() -> None:
            dev.unhold_all(src)
            dev.unhold_all(dst)
            self.counters.moved("device_to_device", len(src), len(src) * self.fmt.page_bytes)

        self._submit(ticket, finish)
        return ticket

    def _submit(self, ticket: Ticket, finish) -> None:
        if ticket.done():
            finish()
        else:
            self._inflight.append((ticket, finish))

    def _reap(self) -> None:
        if self._matches:
            self._apply_matches()
        if not self._inflight:
            return
        inflight, self._inflight = self._inflight, []
        for ticket, finish in inflight:
            if ticket.done():
                finish()
            else:
                self._inflight.append((ticket, finish))
        if len(self._inflight) < len(inflight):  # slots came free: callers waiting for room look again
            self._changed.notify_all()

    # --- internals: remote ---------------------------------------------------------------------
    def _next_backup(self):
        """The writer thread's next batch (called under the lock; waits on `_changed`)."""
        host, tier, queue = self._host, self.host_tier, self._backup_queue
        while True:
            if self._closed:
                return None
            if len(queue) and self._breaker.allow():
                slots = []
                for slot in queue.first(self._batch_pages):
                    queue.discard(slot)
                    if host.state[slot] == S.DIRTY and not host.busy[slot]:
                        slots.append(slot)
                if not slots:
                    if self._breaker.state != self._breaker.state.CLOSED:
                        self._breaker.record(True)
                    continue
                host.set_states(slots, S.OFFLOADING, busy_delta=1)
                self._backups_in_flight += 1
                ids = [host.id_of(s) for s in slots]
                buffers = [tier.page(s) for s in slots]
                return ids, buffers, lambda ok, error, seconds: self._backup_done(slots, ok, error, seconds)
            self._backup_work.wait(timeout=None if not len(queue) else max(0.001, self._breaker.wait_s()))

    def _backup_done(self, slots: list[int], ok: list[bool], error, seconds: float) -> None:
        host = self._host
        good = [s for s, o in zip(slots, ok) if o]
        bad = [s for s, o in zip(slots, ok) if not o]
        self._backups_in_flight -= 1
        # One writer thread: the backup that returns is the stalled one, if one was.
        self._backups_stalled = min(self._backups_stalled, self._backups_in_flight)
        host.set_states(good, S.RESIDENT, busy_delta=-1)
        host.set_states(bad, S.DIRTY, busy_delta=-1)
        for slot in bad:
            self._backup_queue.append(slot)
        c = self.counters
        c.moved("host_to_remote", len(good), len(good) * self.fmt.page_bytes)
        c.remote_failures["write"] += len(bad)
        c.latency["remote_put"].observe(seconds)
        was_healthy = self._breaker.healthy
        self._breaker.record(not bad, None if not bad else repr(error) if error else f"{len(bad)} of {len(slots)} pages not written")
        if self._breaker.healthy and not was_healthy:
            log.warning("remote tier writes work again; backups resumed")
            self._drop_logged = False
        elif was_healthy and not self._breaker.healthy:
            log.warning("remote tier writes fail (%s); backing off, pages stay in the host tier", self._breaker.last_error)

    def _backup_popular(self, host_slots: list[int]) -> None:
        """write_through_selective: back up the dirty host pages that just reached enough hits."""
        if self._link is None or not self.write_policy.copies_on_hit:
            return
        host = self._host
        ready = [s for s in host_slots if host.state[s] == S.DIRTY and self.write_policy.copy_on_hit(host.hits[s])]
        for slot in ready:
            self._backup_queue.append(slot)
        if ready:
            self._backup_work.notify()

    def _fetch(self, ids: list[bytes], for_load: bool) -> list[tuple[int, Ticket]]:
        """Start reading remote pages into host slots (as many as have room now).

        Returns (host slot, ticket) per page started, in order. for_load: the caller holds each
        slot (busy) from now on and releases it itself; else (a prefetch hint) the slot becomes
        evictable when the page lands.
        """
        host, tier = self._host, self.host_tier
        # The fetch's hold, dropped when it lands; for a load, also the load's own, dropped by
        # the load (_release_host).
        slots = self._take_host(len(ids), busy_delta=2 if for_load else 1)
        if not slots:
            return []
        ids = ids[: len(slots)]
        host.bind_all(slots, ids)
        buffers = [tier.page(s) for s in slots]

        def apply(ok: list[bool], error: BaseException | None, seconds: float) -> None:
            good = [s for s, o in zip(slots, ok) if o]
            bad = [s for s, o in zip(slots, ok) if not o]
            for s in slots:
                self._fetching.pop(s, None)
            host.set_states(good, S.RESIDENT, busy_delta=-1)
            host.unhold_all(bad)
            # A failed page loses its key at once (a miss from now on); a load that still holds
            # the slot frees it when it looks (_release_host).
            host.set_states([s for s in bad if not host.busy[s]], S.FREE)
            for s in bad:
                if host.busy[s]:
                    host.table.unbind(s)
            c = self.counters
            c.moved("remote_to_host", len(good), len(good) * self.fmt.page_bytes)
            # The remote index promised these pages (or they were asked for by key): a page it
            # could not serve, whatever the reason, is a failed read; the store unpublished it.
            c.remote_failures["read"] += len(bad)
            c.latency["remote_get"].observe(seconds)

        submit = self._link.read if for_load else self._link.try_read
        ticket = submit(ids, buffers, apply)
        if ticket is None:  # a hint that does not fit in the queue: give the slots back
            host.unhold_all(slots)
            host.set_states(slots, S.FREE)
            return []
        for s in slots:
            self._fetching[s] = ticket
        return [(s, ticket) for s in slots]
