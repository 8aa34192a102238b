"""Room in a tier: the pool's slot taking and eviction, the half of TieredPool that makes space.

Owns how a call gets device or host slots when none are free: which pages leave (LRU front,
clean first; dirty pages copied down or queued for backup, or, while the remote tier is down,
dropped and counted, except a probe batch once the breaker's back-off is over), and what a caller waits on when nothing can leave yet. TieredPool
(pool.py) inherits it; every method here runs under the pool's lock and never waits, except
`_take_device`, which lets go of the lock while it waits for progress.
It must never choose which keys an engine call wants, nor move bytes itself (movement.py
starts the copies).
"""

from __future__ import annotations

import logging

import numpy as np

from kvtier.index import PageState
from kvtier.index.slot_list import BULK
from kvtier.pool.handles import PoolExhausted

S = PageState
log = logging.getLogger("kvtier.pool.pool")  # the pool's one logger, whichever file speaks
# Eviction looks this many entries past what it needs, so pages it must pass over (dirty ones
# whose copy cannot start yet) do not hide clean pages behind them. Bounded: calls stay O(batch).
_OVERSCAN = 256


class TierRoom:
    # --- internals: device slots -------------------------------------------------------------
    def _take_device(self, n: int) -> list[int]:
        """n device slots in FILLING, held by the caller. Evicts as needed; waits outside the lock."""
        dev = self._dev
        got: list[int] = []
        try:
            while True:
                with self._lock:
                    self._check_open()
                    self._reap()
                    if n - len(got) > dev.capacity - dev.held:
                        raise PoolExhausted(self._exhausted("device", n - len(got)))
                    more = dev.take_free(n - len(got), S.FILLING)
                    need = n - len(got) - len(more)
                    if need:
                        self._make_device_room(need)
                        more += dev.take_free(need, S.FILLING)
                    dev.pin_all(more)
                    got += more
                    if len(got) == n:
                        return got
                    wait = self._progress_waiter("device")
                    if wait is None:
                        if self._drop_undurable_device(n - len(got)):
                            continue  # room now: take it at once
                        raise PoolExhausted(self._exhausted("device", n - len(got)))
                wait()
        except BaseException:
            if got:
                with self._lock:
                    for slot in got:
                        dev.unpin(slot)
                    dev.set_states(got, S.FREE)
            raise

    def _progress_waiter(self, tier: str):
        """Something to wait for (outside the lock) that may free slots of `tier`, or None."""
        if self._inflight:
            return self._inflight[0][0].synchronize
        # A backup held inside the store past its timeout (`_backup_stalled`) is no progress: it
        # may never return, and the writer thread waits in it, so the queue cannot move either.
        stalled = self._backups_stalled
        if self._link is not None and (self._backups_in_flight > stalled or self._fetching or (
                not stalled and len(self._backup_queue) and self._breaker.wait_s() < float("inf"))):
            # Remote jobs notify `_changed` when they land; a queue waiting out the breaker wakes
            # when it may retry. Woken only by a change after this point (never a lost wake-up),
            # so a caller's retries follow real events, not a timer.
            retry_in = self._breaker.wait_s() if self._backup_queue else 0.0
            timeout = min(1.0, max(0.001, retry_in)) if retry_in > 0 else 1.0
            generation = self._changed.generation

            def wait() -> None:
                with self._lock:
                    self._changed.wait_past(generation, timeout)

            return wait
        return None

    def _exhausted(self, tier: str, n: int) -> str:
        index = self._dev if tier == "device" else self._host
        advice = ("release pages the engine holds or raise device_pages" if tier == "device"
                  else "raise host_pages or load fewer pages at once")
        if self._backups_stalled:
            advice = ("a remote write is stuck inside the store past its timeout (a stuck disk?) and holds "
                      f"its host pages until it returns; {advice}")
        return (
            f"{tier} tier: need {n} slots, none left free or evictable "
            f"({index.capacity} slots: {index.held} held by the engine, {index.busy_slots} in copies in flight, "
            f"{index.counts[S.DIRTY]} not yet durable); {advice}"
        )

    def _evict_device(self, victims: list[int], want: int | None = None) -> int:
        """Free device slots from `victims` (LRU order) until `want` are free or on their way:
        clean pages go now; dirty pages the write policy keeps go once their copy down lands
        (their copies start here). Dirty pages whose copy cannot start yet (no host room) are
        passed over, so clean pages behind them still go. Returns how many are free now or on
        their way."""
        dev = self._dev
        want = len(victims) if want is None else want
        free, dirty = [], []
        rest = iter(victims)
        for slot in rest:
            if len(free) + len(dirty) >= want:
                break
            if dev.state[slot] == S.DIRTY:
                if self.write_policy.copy_on_evict(dev.hits[slot]):
                    dirty.append(slot)
                    continue
                self._count_drop("selective", 1)
            free.append(slot)
        dev.set_states(free, S.FREE)
        freed = len(free)
        started = 0
        if dirty:
            for slot in self._copy_down(dirty, evicting=True):
                if self._evicting[slot]:
                    started += 1  # freed when its copy lands
                elif dev.state[slot] == S.FREE:
                    started += 1  # its copy landed at once and freed it (_free_evicted counted it)
                elif dev.state[slot] == S.RESIDENT and not dev.busy[slot] and not dev.pins[slot]:
                    dev.set_state(slot, S.FREE)  # the host tier already had it
                    freed += 1
        if freed + started < want:  # passed-over dirty pages: look further for clean ones
            more = []
            for slot in rest:
                if freed + started + len(more) >= want:
                    break
                if dev.state[slot] == S.RESIDENT:
                    more.append(slot)
            dev.set_states(more, S.FREE)
            freed += len(more)
        self.counters.evictions["device"] += freed
        return freed + started

    def _free_evicted(self, slots) -> None:
        dev = self._dev
        done = []
        for slot in slots:
            if self._evicting[slot]:
                self._evicting[slot] = 0
                if dev.state[slot] == S.RESIDENT and not dev.busy[slot] and not dev.pins[slot]:
                    done.append(slot)
        dev.set_states(done, S.FREE)
        self.counters.evictions["device"] += len(done)

    # --- internals: host slots -----------------------------------------------------------------
    def _take_host(self, n: int, busy_delta: int = 0) -> list[int]:
        """Up to n host slots in LOADING state with `busy_delta` copies on each, evicting host
        pages as needed (evicted slots are handed over directly); never waits."""
        host = self._host
        slots = host.take_free(n, S.LOADING, busy_delta)
        if len(slots) < n:
            need = n - len(slots)
            self._evict_host(host.victims(need), want=need, into=slots, busy_delta=busy_delta)
            if len(slots) < n:  # dirty pages were passed over: look further for clean ones
                need = n - len(slots)
                self._evict_host(host.victims(need + _OVERSCAN), want=need, into=slots, busy_delta=busy_delta)
        return slots

    def _make_device_room(self, need: int) -> None:
        """Evict from the device tier's LRU front until `need` slots are free or on their way.
        The first look reads `need` entries; only when it had to pass pages over (dirty ones
        whose copy cannot start yet) does a second look read up to _OVERSCAN entries further."""
        dev = self._dev
        got = self._evict_device(dev.victims(need), want=need)
        if got < need:
            self._evict_device(dev.victims(need + _OVERSCAN), want=need - got)
    def _evict_host(self, victims: list[int], want: int | None = None, into: list | None = None,
                    busy_delta: int = 0) -> int:
        """Free host slots from `victims` (LRU order) until `want` are free or on their way.

        Clean pages go now. Dirty pages the write policy keeps are queued for backup while the
        remote tier is healthy (they go once durable); while it is not, the oldest are dropped,
        counted and logged once per outage. Pages already queued are passed over, so clean
        pages behind them still go. Returns how many are free now or on their way. With `into`,
        the freed slots are not freed but handed to new pages (LOADING, `busy_delta` copies)
        and appended to `into`."""
        host = self._host
        want = len(victims) if want is None else want
        free, queued = self._clean_victims(victims, want), 0
        if free is None:
            free, unavailable = [], 0
            for slot in victims:
                if len(free) + queued >= want:
                    break
                if host.state[slot] == S.DIRTY:
                    if not self.write_policy.copy_on_evict(host.hits[slot]):
                        self._count_drop("selective", 1)
                    elif self._breaker.healthy or (
                            self._breaker.wait_s() == 0 and not self._backups_in_flight):
                        # Unhealthy but its back-off is over: these pages are the probe (write-back
                        # queues pages only here, so without it no probe would ever be sent).
                        if slot not in self._backup_queue:
                            self._backup_queue.append(slot)
                            queued += 1
                        continue
                    else:
                        unavailable += 1
                free.append(slot)
            if unavailable:
                self._drop_unavailable("host", unavailable)
            # A page the host tier lets go that no tier below holds (no remote tier, or not
            # durable there yet): its device copy, if any, is now the only one.
            orphans = free if self._link is None else [slot for slot in free if host.state[slot] == S.DIRTY]
        else:
            orphans = free if self._link is None else []
        self._dirty_device_copies(orphans)
        if len(self._backup_queue):
            self._backup_queue.discard_many(free)
        if into is None:
            host.set_states(free, S.FREE)
        else:
            host.reuse(free, S.LOADING, busy_delta)
            into.extend(free)
        if queued:
            self._backup_work.notify()
        self.counters.evictions["host"] += len(free)
        return len(free) + queued

    def _clean_victims(self, victims: list[int], want: int) -> list[int] | None:
        """The first `want` victims when they are BULK or more and all clean (the host tier's
        steady state under write-through: they all go, no per-page choice), found in numpy;
        else None, for `_evict_host`'s loop to choose page by page."""
        if want < BULK or len(victims) < want:
            return None
        free = victims[:want]
        if (self._host._np_state[np.asarray(free, dtype=np.int64)] == int(S.DIRTY)).any():
            return None
        return free

    def _dirty_device_copies(self, host_slots: list[int]) -> None:
        """The device's RESIDENT copies of the pages in `host_slots` (which the host tier is
        letting go, and no tier below holds) become DIRTY: each is now the only copy. Batch
        lookups from BULK slots, one at a time below."""
        host, dev = self._host, self._dev
        if len(host_slots) < BULK:
            for slot in host_slots:
                dslot = dev.lookup(host.id_of(slot))
                if dslot >= 0 and dev.state[dslot] == S.RESIDENT:
                    dev.set_state(dslot, S.DIRTY)
            return
        found = dev.table.get_many_array(host.table.ids_of(host_slots))
        held = found[found >= 0]
        held = held[dev._np_state[held] == int(S.RESIDENT)]
        if held.size:
            dev.set_states(held.tolist(), S.DIRTY, distinct=True)

    def _drop_undurable_device(self, need: int) -> int:
        """Device room as a last resort, while the remote tier is unavailable and nothing in
        flight can free host room (a backup held inside the store holds every host page it
        could use): up to `need` dirty device pages whose copy down cannot start are dropped,
        oldest first, counted and logged once per outage, as the host tier drops its own.
        Returns how many were dropped."""
        if self._link is None or self._breaker.healthy:
            return 0
        dev = self._dev
        drop = []
        for slot in dev.victims(need + _OVERSCAN):
            if dev.state[slot] == S.DIRTY and not dev.busy[slot] and not dev.pins[slot]:
                drop.append(slot)
                if len(drop) == need:
                    break
        if drop:
            dev.set_states(drop, S.FREE)
            self.counters.evictions["device"] += len(drop)
            self._drop_unavailable("device", len(drop))
        return len(drop)

    def _drop_unavailable(self, tier: str, n: int) -> None:
        self._count_drop("remote_unavailable", n)
        if not self._drop_logged:
            self._drop_logged = True
            log.warning(
                "remote tier unavailable (%s): dropping %s pages that could not be made durable to make room; "
                "they are counted in kvtier_dropped_pages_total{reason=\"remote_unavailable\"}",
                self._breaker.last_error, tier,
            )

    def _backup_stalled(self, reason: str) -> None:
        """A backup is still inside the store past its timeout (the link says so, under the
        lock): the breaker opens, so tiers that need room drop what cannot be made durable
        instead of waiting for it, and callers stop counting it as progress
        (`_backups_stalled`, until it returns). Its pages stay busy until it returns."""
        self._backups_stalled = min(self._backups_stalled + 1, self._backups_in_flight)
        was_healthy = self._breaker.healthy
        self._breaker.record(False, reason)
        if was_healthy:
            log.warning("remote tier writes stall (%s); backing off, pages stay in the host tier", reason)

    def _count_drop(self, reason: str, n: int) -> None:
        self.counters.dropped[reason] += n
