"""Loads of the pool: how `TieredPool.load` moves pages that are not where the engine wants them.

Owns a load's mechanics once the call has decided to load now: the chunks it submits (small
first, growing, capped in bytes, so the first bytes move early and a long load makes few copies),
securing each page's source (pinning device and host copies, starting remote fetches, waiting
outside the lock for what is still landing), planning the copies per tier with the batch
lookups of the tier indexes, and submitting them as one handle. TieredPool (pool.py) inherits
it; its methods run under the pool's lock except where they say they wait. It must never decide
whether a call loads (pool.py does) nor touch page bytes itself.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from kvtier.index import PageState
from kvtier.index.key_table import MANY
from kvtier.index.keys import key_ids
from kvtier.pool.checks import REPEATED_KEYS
from kvtier.pool.handles import LoadHandle, PoolExhausted
from kvtier.pool.movement import _READABLE
from kvtier.transfer import JoinedTicket, Ticket

S = PageState
log = logging.getLogger("kvtier.pool.pool")  # the pool's one logger, whichever file speaks

# A load that keeps waiting (every wait a real event: a fetch, a copy, a change) while other
# threads take the room or pages it needs gives up after this long, with PoolExhausted.
_LOAD_PATIENCE_S = 30.0
# A load submits its copies in chunks of this many pages, then _CHUNK_GROWTH times more each time:
# the first bytes move after little bookkeeping, and a load of thousands of pages makes few copies.
_FIRST_CHUNK = 32
_CHUNK_GROWTH = 4
# A layer-ordered load's chunks grow 2x instead: the link waits less for the early chunks'
# bookkeeping (with the 132 KiB pages of that decode step, a 128-page second chunk took longer
# to book than the first chunk's 32 pages take to copy), at the cost of more chunks. Measured on
# an H200 (2026-12-06, prefetched 8 x 8k decode step from graphs, five rounds): 11.92-12.33 ms
# (median 12.07) against 12.02-12.61 (12.46) at growth 4. The extra chunks cost the host 70-95 µs
# a 256-page load and 170-190 µs a 1,024-page one on a 2-core VM, which is why plain loads keep
# growth 4: a caller asks for layer-ordered loads when the link, not its thread, bounds the step.
_SPLIT_CHUNK_GROWTH = 2
# A load of more keys than this keys and checks only its first chunk before that chunk's copy is
# queued, each later chunk's keys with its bookkeeping (`_load_now`'s `more`): keying and checking
# 4,096 keys up front took 0.35-0.4 ms of a 2-core VM, which the link spent idle.
HEAD_START_KEYS = 4 * _FIRST_CHUNK
# ... up to this many bytes a chunk (or MANY pages): a chunk's copy then outlasts the
# next chunk's bookkeeping wherever a page's bookkeeping is shorter than its PCIe time, so a long
# load's copies run back to back instead of waiting for one last chunk of most of the batch.
_CHUNK_BYTES = 64 << 20
# What a layer-ordered load assumes the link moves (bytes/s) when it decides which chunks defer
# their other layers (defers_other_layers): where it is off, only the chunk at which deferring
# starts moves.
_LINK_BYTES_PER_S = 50e9


# A write-through commit of more keys than this starts its copies down itself, in chunks of
# commit_chunks (TieredPool.commit); shorter ones hand them to the offload thread.
COMMIT_IN_CHUNKS = HEAD_START_KEYS


def commit_chunks(n: int, page_bytes: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk of an n-key commit of pages of `page_bytes`, as a load's chunks:
    _FIRST_CHUNK keys, then _CHUNK_GROWTH times more each time up to _CHUNK_BYTES (or MANY keys),
    a tail under half the next chunk joining the one before it."""
    out, pos, chunk, largest = [], 0, _FIRST_CHUNK, max(MANY, _CHUNK_BYTES // page_bytes)
    while pos < n:
        end, chunk = pos + chunk, min(chunk * _CHUNK_GROWTH, largest)
        end = n if pos and n - end < chunk // 2 else min(end, n)
        out.append((pos, end))
        pos = end
    return out


def key_head(keys) -> tuple[list[bytes], list | tuple | None]:
    """(ids, more) for `TieredPool.load` without slots: a long list or tuple of keys gives the ids
    of its first chunk and the keys themselves (the rest keyed by `_load_now` chunk by chunk, from
    position len(ids): no copy of the list, which cost a 16,384-key load 45-80 µs of a 2-core VM
    before its first copy), anything else every id and None."""
    if type(keys) in (list, tuple) and len(keys) > HEAD_START_KEYS:
        return key_ids(keys[:_FIRST_CHUNK]), keys
    return key_ids(keys), None


def defers_other_layers(queued_s: float, chunk_s: float, elapsed_s: float, booked: int, remaining: int) -> bool:
    """Whether a layer-ordered load's next chunk copies only its first layer now, its other layers
    waiting for the load's tail (copied layer by layer after the last chunk), or every layer now.

    Every layer now while the link would otherwise wait for the load's bookkeeping: the copies
    queued so far (queued_s of link time from the load's start) and this chunk's (chunk_s, every
    layer) end before the bookkeeping is expected to end (elapsed_s so far over `booked` pages, as
    much again per page for the `remaining` ones). Past that point the link stays busy anyway, and
    what is left is queued in layer order, so layer 0 lands early and attention over each layer
    overlaps the copies of the next: the link never idles while layer 0 still comes first.
    """
    expected_end = elapsed_s + remaining * (elapsed_s / booked if booked else 0.0)
    return queued_s + chunk_s > expected_end


class Loading:
    """The load mechanics of TieredPool."""

    def _load_now(self, ids: list[bytes], more: list | tuple | None = None) -> LoadHandle | None:
        """The common load in one hold of the lock, or None (the device as it was, but for
        evictions) for the general path: every key on the device or readable in the host tier,
        and device room for the host pages without waiting (free slots, or clean pages to evict).
        Device pages are held where they are; host pages land in new slots keyed at once
        (FREE -> LOADING).

        Keys are taken in chunks (_FIRST_CHUNK pages, then _CHUNK_GROWTH times more each time, or
        _SPLIT_CHUNK_GROWTH times for a load split by layer, up to
        _CHUNK_BYTES; after the first, a tail under half the next chunk joins the one before it), each
        chunk's copy submitted before the next chunk's bookkeeping, so a large load's bytes start moving
        after one small chunk of Python. A chunk that finds a key it cannot load now cancels the chunks
        before it: their pages lose their keys at once and their slots are freed when their copies land.

        With layer_ordered_loads, an engine that reloads a subset of layers (`reloads_layers`), more than one layer and
        more than one chunk's keys, the chunks booked while the link would otherwise wait for the
        bookkeeping copy every layer, and the later ones (defers_other_layers) copy only their first
        layer as they are booked, their other layers following in one call after the last chunk, in
        layer order: the whole load's first layer lands soon after the bookkeeping ends, not with the
        last byte, so attention over layer i overlaps the copies of the layers after it, and the link
        is kept busy from the first chunk on.

        `more`: the whole batch of keys, of which `ids` holds the first len(ids) keys' ids (the first
        chunk's); the keys after them are keyed and checked for repeats a chunk at a time, each
        chunk's while the copies queued before it move, and appended to `ids` (the caller's list); a
        bad or repeated key among them cancels the chunks before it and raises, the device as it was.
        """
        dev, host, engine = self._dev, self._host, self.engine
        dget_many = dev.table.get_many
        landing = self._dev_landing
        total = len(ids) if more is None else len(more)
        out = [-1] * total
        pinned: list[int] = []  # device pages held where they are
        started: list[tuple[list[int], Ticket, list]] = []  # (targets, ticket, flags)
        ready = None
        num_layers = self.fmt.num_layers
        # Split only loads of several chunks: one chunk's copy (one launch on CUDA) already lands layer by layer.
        split = (self._layer_ordered_loads and getattr(engine, "reloads_layers", False)
                 and num_layers > 1 and total > _FIRST_CHUNK)
        pending: list[tuple[list[int], list[int], Ticket, list[bool]]] = []  # split: (srcs, targets, first layer, flags)
        # Split loads: link seconds queued so far, the clock, and one page's copy (every layer, first layer).
        queued_s, started_at = 0.0, time.perf_counter()
        page_s = self.fmt.page_bytes / _LINK_BYTES_PER_S
        pos, chunk = 0, _FIRST_CHUNK
        growth = _SPLIT_CHUNK_GROWTH if split else _CHUNK_GROWTH
        largest = max(MANY, _CHUNK_BYTES // self.fmt.page_bytes)  # MANY: host lookups stay in numpy
        seen = set(ids) if more is not None else None  # keys so far, to find a repeat chunk by chunk
        while pos < total:
            end, chunk = pos + chunk, min(chunk * growth, largest)
            end = total if pos and total - end < chunk // 2 else min(end, total)
            if end > len(ids):  # this chunk's keys, while the copies queued so far move
                try:
                    fresh = key_ids(more[len(ids) : end], len(ids))
                    seen.update(fresh)
                    if len(seen) != end:
                        raise ValueError(REPEATED_KEYS)
                except BaseException:
                    self._cancel_load_now(pinned, started, pending)
                    raise
                ids += fresh
            srcs = []
            dslots = dget_many(ids[pos:end])
            if max(dslots) < 0:  # none on the device (a prefetch): no loop over the chunk
                src_ids, src_pos = ids[pos:end], range(pos, end)
            else:
                src_ids, src_pos = [], []
                for i, slot in enumerate(dslots, pos):
                    if slot >= 0:
                        dev.pin(slot)
                        dev.touch(slot)
                        pinned.append(slot)
                        out[i] = slot
                    else:
                        src_ids.append(ids[i])
                        src_pos.append(i)
            if src_ids:
                # Sources busy first, so that making room (whose copies down take host slots) cannot evict them.
                srcs = host.hold_readable(src_ids)
                if srcs is None:
                    self._cancel_load_now(pinned, started, pending)
                    return None
            pos = end
            n = len(srcs)
            if not n:
                continue
            if n > len(dev.free):
                if n <= dev.capacity - dev.held:
                    self._make_device_room(n - len(dev.free))
                if n > len(dev.free):  # dirty pages are being copied down first (or it can never fit): general path
                    self._release_host(srcs)
                    self._cancel_load_now(pinned, started, pending)
                    return None
            # The new slots are taken (LOADING, held) now and keyed once their copy is queued: the
            # bytes start moving before the key table's binds, all under the lock.
            targets = dev.take_loading(n)
            if ready is None:
                ready = engine.record_ready()
            flags = [False, False, 0]  # cancelled, landed, its number in `landing` (0: not marked yet)
            try:
                if split and defers_other_layers(queued_s, n * page_s, time.perf_counter() - started_at, pos, total - pos):
                    queued_s += n * page_s / num_layers
                    ticket = engine.reload_layers(srcs, targets, range(1), ready=ready)
                    deferred = True
                else:
                    queued_s += n * page_s
                    ticket = engine.reload(srcs, targets, ready=ready)
                    deferred = False
            except BaseException:
                # The copy never started: this chunk's slots go back to the free list, its sources
                # are let go, the chunks before it are cancelled, and the caller sees the error.
                dev.unpin_all(targets)
                dev.set_states(targets, S.FREE, busy_delta=-1)
                self._release_host(srcs)
                self._cancel_load_now(pinned, started, pending)
                raise
            dev.table.bind_many(src_ids, targets)
            if type(src_pos) is range:
                out[src_pos.start : src_pos.stop] = targets
            else:
                for i, slot in zip(src_pos, targets):
                    out[i] = slot
            if deferred:
                started.append((targets, ticket, flags))
                pending.append((srcs, targets, ticket, flags))
                continue
            flags[2] = landing.mark(targets, ticket)
            started.append((targets, ticket, flags))
            self._submit(ticket, self._landed(srcs, targets, flags))
        tickets = landing.tickets_of(pinned) if pinned else []
        tickets += [ticket for _, ticket, _ in started]
        if pending:
            # Every chunk's first layer is queued: now the other layers of all of them, in layer order.
            rest = engine.reload_layers(
                np.concatenate([np.asarray(srcs, dtype=np.int64) for srcs, _, _, _ in pending]),
                np.concatenate([np.asarray(targets, dtype=np.int64) for _, targets, _, _ in pending]),
                range(1, num_layers), ready=ready,
            )
            tickets.append(rest)
            for srcs, targets, first, flags in pending:
                joined = JoinedTicket([first, rest], num_layers)
                flags[2] = landing.mark(targets, joined)
                self._submit(joined, self._landed(srcs, targets, flags))
        return LoadHandle(tickets, num_layers, out)

    def _load_into_now(self, ids: list[bytes], slots: list[int]) -> LoadHandle | None:
        """A load into given slots (checked fresh) in this hold of the lock: when no key is on the
        device and every one is readable in the host tier, one reload of them all (the common
        load into slots the engine chose); else None, nothing changed, for the general path."""
        if not ids or max(self._dev.table.get_many(ids)) >= 0:
            return None
        srcs = self._host.hold_readable(ids)
        if srcs is None:
            return None
        try:
            ticket = self._reload(srcs, slots, ids, [True] * len(ids))
        except BaseException:  # the copy never started: the slots are as they came, the sources let go
            self._release_host(srcs)
            raise
        return LoadHandle([ticket], self.fmt.num_layers, list(slots))

    def _cancel_load_now(self, pinned: list[int], started: list, pending: list) -> None:
        """Undo a `_load_now` that cannot finish: holds on device pages dropped, chunks already
        copying unkeyed and unheld (freed when they land). pending: chunks that copy their first
        layer only (split loads), whose landing is watched from here on."""
        dev, landing = self._dev, self._dev_landing
        for srcs, targets, first, flags in pending:
            self._submit(first, self._landed(srcs, targets, flags))
        for slot in pinned:
            dev.unpin(slot)
        for targets, _, flags in started:
            flags[0] = True
            dev.unpin_all(targets)
            if flags[1]:  # landed already (a synchronous engine): those pages go now
                dev.set_states(targets, S.FREE)
                continue
            for slot in targets:  # still landing: unkeyed now, freed when the copy lands
                dev.table.unbind(slot)
            if flags[2]:
                landing.clear(targets, flags[2])

    def _secure_sources(self, ids: list[bytes]) -> tuple[dict[int, int], dict[int, int]]:
        """Hold a readable copy of every key, busy, so nothing evicts it: device pages where they
        are, else a host slot (read from the remote tier first if needed, waiting outside the
        lock). Returns ({key index: device slot}, {key index: host slot}); raises KeyError, with
        nothing held, when a key is in no tier."""
        dev_src: dict[int, int] = {}
        host_src: dict[int, int] = {}
        deadline, rounds = None, 0
        try:
            while True:
                with self._lock:
                    self._check_open()
                    self._reap()
                    waits, missing = self._plan_sources(ids, dev_src, host_src)
                    if missing:
                        raise KeyError(
                            f"load: {len(missing)} of {len(ids)} keys are in no tier; "
                            f"first missing: key {missing[0]} (id {ids[missing[0]].hex()})"
                        )
                    if not waits:
                        return dev_src, host_src
                for wait in waits:
                    wait()
                rounds += 1
                now = time.monotonic()
                if deadline is None:
                    deadline = now + _LOAD_PATIENCE_S
                elif now > deadline:
                    raise PoolExhausted(
                        f"load: other threads kept taking the room or pages these {len(ids)} keys need "
                        f"for {_LOAD_PATIENCE_S:g} s ({rounds} waits); raise host_pages or load fewer pages at once"
                    )
        except BaseException:
            with self._lock:
                self._dev.unhold_all(dev_src.values())
                self._release_host(host_src.values())
            raise

    def _release_host(self, slots) -> None:
        """Drop a load's holds on host slots; a slot whose fetch failed is freed once idle."""
        host = self._host
        host.unhold_all(slots)
        host.set_states([s for s in slots if host.state[s] == S.LOADING and not host.busy[s]
                         and not host.table.holds_key(s)], S.FREE)
        self._changed.notify_all()  # room for a caller waiting on `_progress_waiter`

    def _plan_sources(self, ids, dev_src: dict[int, int], host_src: dict[int, int]):
        """One round of `_secure_sources` under the lock: (things to wait for, indexes in no tier)."""
        dev, host = self._dev, self._host
        waits, fetch, missing = [], [], []
        for i, slot in list(host_src.items()):
            if host.state[slot] != S.LOADING:
                continue
            if host.table.holds_key(slot):  # our fetch is still landing
                waits.append(self._fetching[slot].synchronize)
                continue
            # Our fetch failed: the page is in no tier now.
            del host_src[i]
            self._release_host((slot,))
            missing.append(i)
        if missing:
            return waits, missing
        # Each tier's lookups at once (numpy over the host table from MANY ids).
        todo = [i for i in range(len(ids)) if i not in host_src and i not in dev_src] if host_src or dev_src else range(len(ids))
        found = dev.table.get_many(ids if type(todo) is range else [ids[i] for i in todo])
        on_dev = [slot for slot in found if slot >= 0]
        dev_src.update((i, slot) for i, slot in zip(todo, found) if slot >= 0)
        off = [i for i, slot in zip(todo, found) if slot < 0] if on_dev else todo
        on_host, hstate = [], host.state
        for i, slot in zip(off, host.table.get_many(ids if type(off) is range else [ids[i] for i in off])):
            if slot >= 0:
                if _READABLE[hstate[slot]]:
                    host_src[i] = slot
                    on_host.append(slot)
                else:  # landing for another call (a prefetch or a copy-down): wait, then look again
                    ticket = self._fetching.get(slot)
                    waits.append(ticket.synchronize if ticket is not None else self._progress_waiter("host"))
                continue
            fetch.append(i)
        dev.hold_all(on_dev, distinct=True)  # the slots of distinct keys
        host.hold_all(on_host, touch=True, distinct=True)
        if fetch and self._link is None:
            return waits, fetch
        if fetch:
            if len(fetch) > self._host.capacity:
                raise PoolExhausted(self._exhausted("host", len(fetch)))
            started = self._fetch([ids[i] for i in fetch], for_load=True)
            for i, (slot, ticket) in zip(fetch, started):
                host_src[i] = slot
                waits.append(ticket.synchronize)
            if len(started) < len(fetch):  # no host room now: wait for copies in flight, then ask again
                wait = self._progress_waiter("host")
                if wait is None:
                    raise PoolExhausted(self._exhausted("host", len(fetch) - len(started)))
                waits.append(wait)
        return [w for w in waits if w is not None], missing

    def _submit_load(self, ids, slots, dev_src: dict[int, int], host_src: dict[int, int], new: list[int]) -> LoadHandle:
        """Under the lock, with every source held: queue the reloads and device copies."""
        dev = self._dev
        tickets: list[Ticket] = []
        dev_idx = sorted(dev_src)
        landing = self._dev_landing.tickets_of([dev_src[i] for i in dev_idx]) if dev_idx else []
        reload_idx = sorted(host_src)
        if slots is None:
            out = [0] * len(ids)
            for i in dev_idx:
                slot = dev_src[i]
                dev.pin(slot)
                dev.touch(slot)
                out[i] = slot
            tickets.extend(landing)
            targets = new
        else:
            out = list(slots)
            if dev_idx:
                for ticket in landing:  # the copy reads pages still landing: order after them
                    ticket.wait()
                tickets.append(self._device_copy([dev_src[i] for i in dev_idx], [slots[i] for i in dev_idx]))
            targets = [slots[i] for i in reload_idx]
        dev.unhold_all(dev_src.values())  # pinned above, or held by the device copy now
        dev_src.clear()
        if reload_idx:
            # A key may have reached the device meanwhile (another thread loaded or committed
            # it): its copy then lands in our slot as a private, unkeyed page.
            keyed = [slot < 0 for slot in dev.table.get_many([ids[i] for i in reload_idx])]
            sources = [host_src[i] for i in reload_idx]
            try:
                tickets.append(self._reload(sources, targets, [ids[i] for i in reload_idx], keyed))
            except BaseException:
                # The reload never started: the device pages held above for `out` are let go (the
                # caller's cleanup lets the host sources and the new slots go).
                if slots is None:
                    for i in dev_idx:
                        dev.unpin(out[i])
                raise
            host_src.clear()  # the reload took over the load's holds on its sources
            for i, slot in zip(reload_idx, targets):
                out[i] = slot
        return LoadHandle(tickets, self.fmt.num_layers, out)
