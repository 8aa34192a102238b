"""TieredPool: the public API that serving engines call.

Owns the translation of engine calls (allocate, commit, match, load, acquire, release, evict,
flush, close) into index updates and copies between tiers. Deciding is pure Python on the tier
indexes (kvtier.index), under one lock that is never held across a wait: no call waits for a
copy, a remote read or write, or a flush while it holds the lock, so a `match` never queues
behind another thread's I/O. A call that needs room or bytes that are still moving decides
under the lock, starts the copies, lets go of the lock, waits, and decides again.

Copies in flight hold their slots `busy` until their ticket reports done, so no slot is reused
under a copy. Engine copies (device <-> host) are reaped by the calls themselves; remote jobs
(host <-> remote) run on the pool's reader and writer threads (remote_link.py), which apply
their outcome under the lock when the I/O is over.

Tiers: device (GPU memory, or a CPU tensor standing in) -> host (pinned memory) -> remote
(optional page store). Pages are inclusive going up: a page loaded to the device stays in the
host tier, so evicting it from the device again costs nothing.

A failing remote tier degrades the pool to a two-tier cache, never to an outage: backups go
through a circuit breaker (breaker.py) with back-off; while it is not healthy, a tier that needs
room and finds only pages that could not be made durable drops the oldest of them, counts them
(`dropped{reason="remote_unavailable"}`) and logs the cause once per outage. A dirty page is
never dropped while the remote tier is healthy. Remote pages stay loadable throughout.

The class is split along that line: this one is the pool's face (what each call decides,
under the lock); loading.py carries out a load it decided on (chunks, sources, plans);
draining.py is what flush and close wait for; movement.py starts the copies it schedules and
applies them when they land; room.py takes slots and evicts to make them; opening.py opens the
engine and the remote tier. TieredPool inherits the four classes.

It must never touch page bytes itself, nor hold its lock while it waits.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Callable

import torch
from prometheus_client import REGISTRY

from collections.abc import Iterable, Mapping

from kvtier.format import PageFormat
from kvtier.index import Namespace, PageState, TierIndex, WritePolicy, make_policy, native
from kvtier.index.keys import hold_id_cache, key_ids, plain_distinct, release_id_cache
from kvtier.index.prefix import leading_slots, walk, walk_slots
from kvtier.index.slot_list import SlotList
from kvtier.metrics import Counters, register_pool, unregister_pool
from kvtier.pool.breaker import CircuitBreaker
from kvtier.pool.checks import check_copy_path, check_count, check_host_size, check_positive, check_slots, check_unique
from kvtier.pool.draining import Draining
from kvtier.pool.handles import LoadHandle, MatchResult
from kvtier.pool.landing import Landing
from kvtier.pool.loading import COMMIT_IN_CHUNKS, Loading, commit_chunks, key_head
from kvtier.pool.movement import _READABLE, Movement
from kvtier.pool.opening import make_engine, open_remote
from kvtier.pool.remote_link import RemoteLink
from kvtier.pool.room import TierRoom
from kvtier.pool.signal import ChangeSignal
from kvtier.tiers import DeviceTier, HostTier
from kvtier.transfer import ReloadTransform, Ticket

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from kvtier.tiers.cluster import ClusterSettings
    from kvtier.tiers.remote import RemoteStore

S = PageState
Key = str | bytes
log = logging.getLogger(__name__)


class TieredPool(Loading, Draining, Movement, TierRoom):
    """Pages of one model, one page format and one rank, across device, host (and remote) tiers.

    engine: "auto" (CUDA engine on a CUDA device, torch twin elsewhere), "torch", "cuda",
    or a callable (device_tier, host_tier) -> TransferEngine. copy_path picks the CUDA
    engine's way of moving bytes ("auto", "kernel", "copy_engine", "staged", "torch").
    remote: a directory or file:// URL of a page store (opened and closed by the pool), or a
    RemoteStore the caller owns (same page size and namespace as this pool); remote_create
    lets the pool create missing parent directories of a remote path.
    cluster: a Mooncake Store cluster shared by hosts ("host:port" of its mooncake_master, a
    mapping of kvtier.tiers.cluster.ClusterSettings fields, or settings), behind `remote` or alone.
    host_pages (default 4096) or host_bytes (whole pages of that many bytes) sizes the host tier; not both.
    close_timeout_s bounds `close()` (flush included) when the remote tier hangs.
    remote_backoff_s / remote_backoff_max_s: first and longest pause between backup attempts
    while the remote tier fails. remote_queue_depth: prefetch hints queued at most.
    device_kv / device_scales: the serving engine's own KV tensors (see DeviceTier: (K, V)
    or (latent, None), stacked or per-layer lists); device_pages and device then come from
    them. Without them the pool allocates device_pages (default 1024) on device (default cpu).
    background_copies: write-through copies start on the pool's offload thread after commit
    returns (True, the default: commit costs only its own bookkeeping, and the copy's work runs
    while the engine's thread waits on the GPU), or inside commit (False: better for a caller
    that never blocks, where a second thread only competes for the GIL). Either way a commit of
    more than COMMIT_IN_CHUNKS pages over an engine that queues its copies starts them inside
    commit, chunk by chunk (see `commit`).
    layer_ordered_loads: a load of several chunks copies every layer of the chunks booked while
    the link would otherwise wait for the bookkeeping, and only the first layer of the later ones,
    whose other layers follow layer by layer (with an engine that copies a subset of layers), so
    layer 0 lands soon after the bookkeeping ends and attention overlaps the copies of the next
    layers: a prefetched 8 x 8k decode step from CUDA graphs took 12.85-12.96 ms against
    13.77-14.04 without it (H100, 2026-12-06). Such a load's chunks grow 2x instead of 4x, so
    the link waits less for the early chunks' bookkeeping (H200: 12.07 ms median against 12.46
    for that step), at 70-95 µs more host time for a 256-page load on a 2-core VM. Off by
    default: the earlier form (every chunk split) cost a 256-page load twice the host time on an
    H100 host; this one leaves loads of 32 pages or fewer (one chunk) as they were, measured at
    full tiers on a 2-core VM only, not yet on a GPU host (BENCHMARKS.md, "Time to first token
    and prefetched decode").
    """

    def __init__(
        self,
        fmt: PageFormat,
        device: str | torch.device | None = None,
        device_pages: int | None = None,
        host_pages: int | None = None,
        write_policy: str = "write_through",
        eviction: str = "lru",
        engine: str | Callable = "auto",
        copy_path: str = "auto",
        model: str = "default",
        rank: int = 0,
        transform: ReloadTransform | None = None,
        registry: CollectorRegistry | None = REGISTRY,
        name: str | None = None,
        remote: str | os.PathLike | RemoteStore | None = None,
        remote_capacity_bytes: int | None = None,
        remote_queue_depth: int = 64,
        host_bytes: int | None = None,
        close_timeout_s: float = 30.0,
        remote_backoff_s: float = 0.1,
        remote_backoff_max_s: float = 30.0,
        remote_batch_bytes: int = 64 << 20,
        device_kv: tuple | None = None,
        device_scales: tuple | None = None,
        background_copies: bool = True,
        remote_create: bool = False,
        cluster: str | Mapping | ClusterSettings | None = None,
        layer_ordered_loads: bool = False,
    ) -> None:
        if not isinstance(fmt, PageFormat):
            raise TypeError(f"fmt must be a PageFormat, got {type(fmt).__name__}")
        check_host_size(host_pages, host_bytes)
        if host_pages is None:
            host_pages = 4096
        if host_bytes is not None:
            if isinstance(host_bytes, bool) or not isinstance(host_bytes, int) or host_bytes < fmt.page_bytes:
                raise ValueError(f"host_bytes must be an int of at least one page ({fmt.page_bytes} bytes), got {host_bytes!r}")
            host_pages = host_bytes // fmt.page_bytes
        check_copy_path(copy_path)
        if not isinstance(layer_ordered_loads, bool):
            raise TypeError(f"layer_ordered_loads must be a bool, got {layer_ordered_loads!r}")
        self._layer_ordered_loads = layer_ordered_loads
        check_positive(remote_queue_depth, "remote_queue_depth", integer=True)
        check_positive(close_timeout_s, "close_timeout_s")
        check_positive(remote_batch_bytes, "remote_batch_bytes", integer=True)
        self.fmt = fmt
        self.write_policy = WritePolicy(write_policy)
        self.namespace = Namespace(model, fmt.fingerprint, rank)
        if device_pages is None and device_kv is None:
            device_pages = 1024
        self.device_tier = DeviceTier(fmt, device_pages, device, kv=device_kv, scales=device_scales)
        device_pages = self.device_tier.num_pages
        self.host_tier = HostTier(fmt, host_pages, size=None if host_bytes is None else ("host_bytes", host_bytes))
        self.engine = make_engine(engine, self.device_tier, self.host_tier, transform, copy_path)
        # The device tier's keys: in the compact table where its C paths are loaded (faster than a
        # dict there: 2-core VM, 4,096-page commit 0.66 -> 0.55 µs a page, load 0.49 -> 0.36), else
        # over a dict (ten times faster than the compact table's Python paths).
        lib = native.start()  # the index's C paths: loaded if built before, else built in a thread
        self._dev = TierIndex("device", device_pages, make_policy(eviction, device_pages), compact_keys=lib is not None)
        self._host = TierIndex("host", host_pages, make_policy(eviction, host_pages))
        self.close_timeout_s = close_timeout_s
        self._lock = threading.Lock()
        # Three conditions on the one lock, so that a thread is woken only for what it waits for:
        # callers waiting for progress (copies, remote jobs), the remote writer for backup work,
        # the offload thread for write-through copies to start.
        self._changed = ChangeSignal(self._lock)
        self._backup_work = threading.Condition(self._lock)
        self._offload_work = threading.Condition(self._lock)
        self._inflight: list[tuple[Ticket, object]] = []  # engine copies: (ticket, finish)
        self._matches: collections.deque = collections.deque()  # matches that found the lock taken
        self._dev_landing = Landing(self.device_tier.num_pages)  # device slot -> reload still landing in it
        self._fetching: dict[int, Ticket] = {}  # host slot -> remote fetch still landing in it
        self._evicting = bytearray(device_pages)  # device slots to free once their copy-down lands
        self._ready = None  # the latest commit's ready event (eviction copies wait on it)
        self._pending_down: list[tuple[list[int], list[bytes], object]] = []  # write-through copies to start
        self.counters = Counters()
        self.remote = None
        self._link: RemoteLink | None = None
        self._owns_remote = False
        self._backup_queue = SlotList(host_pages)  # DIRTY host slots to write to the remote tier
        self._backups_in_flight = 0
        self._backups_stalled = 0  # of those, held inside the store past its timeout (room.py)
        self._breaker = CircuitBreaker(remote_backoff_s, remote_backoff_max_s)
        self._drop_logged = False
        self._bad_page_logged = False
        self._batch_pages = max(1, remote_batch_bytes // fmt.page_bytes)
        self._closing = False
        self._closed = False
        self._registry = registry
        self.name = register_pool(registry, self, name)
        if remote is not None or cluster is not None:
            try:
                self.remote, self._owns_remote = open_remote(
                    remote, fmt, self.namespace, remote_capacity_bytes, remote_create, cluster
                )
                # One registration of the whole host tier: batches then skip per-call registration.
                self.remote.register_host_memory(self.host_tier.buffer.view(-1))
            except BaseException:
                unregister_pool(registry, self)
                if self._owns_remote:
                    self.remote.close()
                raise
            self._link = RemoteLink(
                self.remote, self._lock, self._changed, fmt.num_layers, remote_queue_depth, self._next_backup,
                self._backup_stalled,
            )
        self._offloader = None
        if background_copies:
            self._offloader = threading.Thread(target=self._offload_loop, name="kvtier-offload", daemon=True)
            self._offloader.start()
        hold_id_cache()

    # --- engine-facing views -------------------------------------------------------------
    def device_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(K, V) device pages of `layer`, each (device_pages, *plane_shape); (latent, None) under MLA."""
        return self.device_tier.layer_kv(layer)

    def device_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(K, V) fp32 scales of `layer`, (device_pages, *scale_shape); (None, None) without device scales."""
        return self.device_tier.layer_scales(layer)

    # --- allocation ----------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Device slots for n new pages, held by the engine until `release`.

        Evicts what it must (copying dirty pages down first, outside the lock); raises
        PoolExhausted at once, evicting nothing, when n can never fit beside the pages the
        engine holds.
        """
        check_count(n)
        return self._take_device(n)

    def release(self, slots: Iterable[int]) -> None:
        """The engine stops holding these slots; uncommitted ones are freed, committed ones stay cached."""
        slots = check_slots(slots, self._dev.capacity)
        with self._lock:
            self._check_open()
            dev = self._dev
            for slot in slots:
                if not dev.pins[slot]:
                    raise ValueError(f"device slot {slot} is not held by the engine (state {S(dev.state[slot]).name})")
            dev.set_states(dev.unpin_all(slots), S.FREE)
            self._reap()

    def acquire(self, keys: Iterable[Key]) -> list[int]:
        """Hold the device slots of the leading device-resident keys; returns their slots."""
        ids = key_ids(keys)
        with self._lock:
            self._check_open()
            self._reap()
            dev = self._dev
            slots = []
            for kid in ids:
                slot = dev.readable_slot(kid)
                if slot < 0:
                    break
                dev.pin(slot)
                dev.touch(slot)
                slots.append(slot)
            self._copy_popular(slots)
            return slots

    # --- commit / match / load ----------------------------------------------------------
    def commit(self, keys: Iterable[Key], slots: Iterable[int]) -> int:
        """The pages in `slots` (from `allocate`) now hold `keys`; the write policy applies.

        A key already on the device keeps its slot; the new slot stays an unkeyed page the
        engine holds. Returns how many pages were newly keyed. Never waits. Under write-through
        the copies down start right after, on the pool's offload thread (ordered after the
        engine's writes by an event recorded here); a copy that finds no host room then happens
        at eviction or flush instead. A commit of more than COMMIT_IN_CHUNKS pages over an engine
        that queues its copies (the CUDA engine) starts them itself, in growing chunks, each
        chunk's copy queued before the next chunk's bookkeeping: the bytes start moving after one
        small chunk instead of after the whole batch's keying and the offload thread's booking.
        """
        start = time.perf_counter()
        if type(keys) is not list and type(keys) is not tuple:
            if isinstance(keys, (str, bytes)):
                key_ids(keys)  # raises: one key is not a batch of keys
            keys = list(keys)
        chunked = (len(keys) > COMMIT_IN_CHUNKS and getattr(self.engine, "queues_copies", False)
                   and self.write_policy.copy_on_commit())
        # A chunked commit of plain distinct keys hashes each chunk's keys with its bookkeeping
        # (the keys are checked now, and hashing them cannot fail), so its first copy starts
        # before the whole batch is hashed.
        ids = None if chunked and plain_distinct(keys) else key_ids(keys)
        # One C pass (`commit_fresh`) checks a plain list of slots and keys them; on a fault it
        # changes nothing and the checks below name it.
        one_pass = ids is not None and not chunked and type(slots) in (list, tuple) and len(slots) == len(ids)
        if not one_pass:
            slots = check_slots(slots, self._dev.capacity)
            if len(keys) != len(slots):
                raise ValueError(f"got {len(keys)} keys for {len(slots)} slots; they must pair up")
        if ids is not None:
            check_unique(ids)
        with self._lock:
            self._check_open()
            self._reap()
            # The event first: if recording it fails, no page has changed. (A commit that then
            # names a fault leaves a later event as the latest: copies that wait on it still wait
            # for everything the engine had queued.)
            ready = self._ready = self.engine.record_ready()
            done = self._dev.commit_fresh(slots, ids, self._host) if one_pass else None
            if done is None:
                if one_pass:
                    slots = check_slots(slots, self._dev.capacity)
                self._check_fresh("commit", slots)
            if not chunked:
                copies = self.write_policy.copy_on_commit()
                if done is not None:
                    absent_slots, absent_ids, fresh = done
                    self.counters.duplicate_commits += len(ids) - fresh
                else:
                    fresh, absent_slots, absent_ids = self._key_commit(ids, slots)
                if absent_slots and copies:
                    # background_copies: the offload thread starts the copy down, so that commit
                    # costs the engine only the bookkeeping of its own pages.
                    if self._offloader is not None:
                        self._pending_down.append((absent_slots, absent_ids, ready))
                        self._offload_work.notify()
                    else:
                        self._start_copy_down(absent_slots, absent_ids, evicting=False, ready=ready)
            else:
                # A long commit over an engine that queues its copies starts them itself, chunk by
                # chunk as a load does: the link starts after one small chunk's bookkeeping, and
                # each later chunk is booked while the copies before it move, where the offload
                # thread could only start once the whole batch was keyed (and then booked the
                # whole batch's host slots before its one copy).
                fresh = 0
                for pos, end in commit_chunks(len(keys), self.fmt.page_bytes):
                    part = key_ids(keys[pos:end], pos) if ids is None else ids[pos:end]
                    count, absent_slots, absent_ids = self._key_commit(part, slots[pos:end])
                    fresh += count
                    if absent_slots:
                        try:
                            self._start_copy_down(absent_slots, absent_ids, evicting=False, ready=ready)
                        except Exception:  # as on the offload thread: the pages stay dirty for eviction or flush
                            log.exception("write-through copy of %d pages failed to start", len(absent_slots))
            self.counters.latency["commit"].observe(time.perf_counter() - start)
            return fresh

    def _key_commit(self, ids: list[bytes], slots: list[int]) -> tuple[int, list[int], list[bytes]]:
        """Key a commit's fresh FILLING `slots` (checked) with `ids`: (pages newly keyed, the slots
        and ids of those the host tier does not hold, whose copy down the write policy may start).
        A key already on the device keeps its slot (counted as a duplicate commit); a page the host
        tier holds readable is clean at once."""
        dev, host = self._dev, self._host
        fresh_ids, fresh_slots, _, _ = dev.partition(ids, slots)
        absent_ids, absent_slots, held, at = host.partition(fresh_ids, fresh_slots)
        # A page the host tier holds is clean, unless it is still being fetched there.
        clean = {slot for slot, h in zip(held, at) if _READABLE[host.state[h]]}
        self.counters.duplicate_commits += len(ids) - len(fresh_ids)
        dev.key_filled(fresh_slots, fresh_ids, clean)
        return len(fresh_ids), absent_slots, absent_ids

    def match(self, keys: Iterable[Key]) -> MatchResult:
        """The loadable prefix of `keys`, split by nearest tier (see MatchResult); counts hits.

        Never waits for the pool's lock: when it is free (and there is no remote tier to ask,
        which is never asked under the lock) the match walks the key tables under it and
        applies the use of the pages it found (eviction order, hit counts, the write policy's
        copies of popular pages) and the counters at once; else it reads the tables without
        the lock and the use is applied when the lock is free, or by the next call that takes
        it, so a match never queues behind another thread's call. Like any match, the answer
        is advice: a page can leave before the `load` that follows.
        """
        start = time.perf_counter()
        ids = key_ids(keys)
        self._check_open()
        if self.remote is None and self._lock.acquire(blocking=False):
            # The lock is free: walk under it, and touch the slots the walk found.
            try:
                if not self._closed:
                    self._reap()
                    on_device, on_host, touched_dev, touched_host = walk_slots(self._dev.table, self._host.table, ids)
                    self._touch_slots(touched_dev, touched_host)
                    self._count_match((ids, on_device, on_host, 0, on_device + on_host, 0, start), None)
                    return MatchResult(device=on_device, host=on_host, remote=0, total=on_device + on_host)
            finally:
                self._lock.release()
        on_device, on_host, remote, total = walk(self._dev.table, self._host.table, ids, 0)
        failed = 0
        if self.remote is not None and total < len(ids):
            rest = ids[total:]
            try:
                in_remote = self.remote.contains_ids(rest)
            except Exception as exc:  # a failing remote tier is a miss, never an error for the engine
                log.warning("remote index lookup of %d pages failed: %r", len(rest), exc)
                in_remote = [False] * len(rest)
                failed = len(rest)
            # Local tables again past the first local miss: pages may have arrived meanwhile.
            more_device, more_host, remote, total = walk(self._dev.table, self._host.table, ids, total, in_remote)
            on_device += more_device
            on_host += more_host
        seen = (ids, on_device, on_host, remote, total, failed, start)
        if self._lock.acquire(blocking=False):
            try:
                if not self._closed:
                    self._reap()
                    self._apply_match(seen, None)
            finally:
                self._lock.release()
        else:  # deque.append is atomic: the lock's holder (or the next taker) applies it
            self._matches.append((seen, time.perf_counter()))
        return MatchResult(device=on_device, host=on_host, remote=remote, total=total)

    def _apply_match(self, seen: tuple, ended: float | None) -> None:
        """Touch a match's pages and count it (under the lock). ended: when a deferred match
        returned (None: now)."""
        self._touch_prefix(seen[0])
        self._count_match(seen, ended)

    def _count_match(self, seen: tuple, ended: float | None) -> None:
        ids, on_device, on_host, remote, total, failed, start = seen
        c = self.counters
        c.hits["device"] += on_device
        c.hits["host"] += on_host
        c.hits["remote"] += remote
        c.misses += len(ids) - total
        if failed:
            c.remote_failures["read"] += failed
        c.latency["match"].observe((time.perf_counter() if ended is None else ended) - start)

    def _apply_matches(self) -> None:
        """The matches that found the lock taken, in order (under the lock); a closed pool's are
        left unapplied, as a match that finds the pool closed applies nothing."""
        matches = self._matches
        while matches and not self._closed:
            seen, ended = matches.popleft()
            self._apply_match(seen, ended)

    def _touch_prefix(self, ids: list[bytes]) -> None:
        """Count a use of the leading device keys and the leading host keys (LRU, write policy)."""
        self._touch_slots(leading_slots(self._dev.table, ids), leading_slots(self._host.table, ids))

    def _touch_slots(self, touched_dev: list[int], touched_host: list[int]) -> None:
        """Count a use of these device and host slots (LRU, write policy)."""
        dev, host = self._dev, self._host
        dev.touch_all(touched_dev)
        host.touch_all(touched_host)
        self._copy_popular(touched_dev)
        self._backup_popular(touched_host)

    def load(self, keys: Iterable[Key], slots: Iterable[int] | None = None) -> LoadHandle:
        """Bring `keys` to the device from wherever they are; `handle.slots` says where.

        slots=None: device-resident keys are held where they are, the rest land in new
        slots (allocated after the sources are secured, so allocation cannot evict them).
        With `slots` (from `allocate`): every key is copied into its given slot.
        Returns once the copies are queued (at once on CUDA; remote pages are read into the
        host tier first, without the lock); wait on the handle before reading. A key no tier
        holds raises KeyError, and the call leaves the device as it found it.
        """
        start = time.perf_counter()
        # without slots, a long load keys its first chunk now, the rest once that chunk's copy is queued
        ids, more = key_head(keys) if slots is None else (key_ids(keys), None)
        check_unique(ids)
        if slots is not None:
            slots = check_slots(slots, self._dev.capacity)
            if len(ids) != len(slots):
                raise ValueError(f"got {len(ids)} keys for {len(slots)} slots; they must pair up")
            with self._lock:
                self._check_open()
                self._check_fresh("load", slots)
                self._reap()
                handle = self._load_into_now(ids, slots)
                if handle is not None:
                    self.counters.latency["load"].observe(time.perf_counter() - start)
                    return handle
        else:
            with self._lock:
                self._check_open()
                self._reap()
                handle = self._load_now(ids, more)
                if handle is not None:
                    self.counters.latency["load"].observe(time.perf_counter() - start)
                    return handle
            if more is not None and len(ids) < len(keys):  # the general path: keys not yet keyed
                ids += key_ids(keys[len(ids):], len(ids))
                check_unique(ids)
        dev_src, host_src = self._secure_sources(ids)
        new: list[int] = []
        try:
            if slots is None:
                new = self._take_device(len(host_src))
            with self._lock:
                # Hands the held sources over to the copies (and empties dev_src / host_src).
                handle = self._submit_load(ids, slots, dev_src, host_src, new)
                new = []
                self._reap()
                self.counters.latency["load"].observe(time.perf_counter() - start)
            return handle
        except BaseException:
            with self._lock:
                self._dev.unhold_all(dev_src.values())
                self._release_host(list(host_src.values()))
                if new:
                    for slot in new:
                        self._dev.unpin(slot)
                    self._dev.set_states(new, S.FREE)
            raise

    prefetch = load

    def prefetch_to_host(self, keys: Iterable[Key]) -> Ticket | None:
        """Start bringing the remote-only pages among `keys` into the host tier on the remote
        reader; returns its ticket at once (None when nothing needs fetching or there is no room
        now). A hint: it never waits and never raises for the pages."""
        ids = key_ids(keys)
        with self._lock:
            self._check_open()
            self._reap()
            if self._link is None:
                return None
            dtable, htable = self._dev.table, self._host.table
            wanted = [k for k in dict.fromkeys(ids) if k not in dtable and k not in htable]
            started = self._fetch(wanted, for_load=False) if wanted else []
            return started[0][1] if started else None

    # --- eviction / flush / close --------------------------------------------------------
    def evict(self, n: int | None = None, tier: str = "device", keys: Iterable[Key] | None = None) -> int:
        """Evict up to n unheld pages (all when n is None), or exactly `keys`, from `tier`.

        The write policy applies: dirty pages are copied down first (waiting outside the lock)
        unless it drops them. Returns how many pages left the tier.
        """
        if tier not in ("device", "host"):
            raise ValueError(f"evict: tier must be 'device' or 'host', got {tier!r}")
        if n is not None:
            check_count(n)
        ids = key_ids(keys) if keys is not None else None
        with self._lock:
            self._check_open()
            self._reap()
            index = self._dev if tier == "device" else self._host
            if ids is not None:
                victims = [s for s in index.table.get_many(ids) if s >= 0 and index.evictable(s)]
                victims = victims[:n] if n is not None else victims
            else:
                victims = index.victims(index.capacity if n is None else n)
            ids_chosen = index.ids_of(victims)
            chosen = list(zip(victims, ids_chosen))
            if tier == "device":
                self._evict_device(victims)
            else:
                self._evict_host(victims)
        # Dirty pages leave once their copy down lands: wait for those (outside the lock).
        while True:
            with self._lock:
                self._reap()
                if tier == "device":
                    waiting = [slot for slot, _ in chosen if self._evicting[slot]]
                else:
                    host = self._host
                    done = [slot for slot, kid in chosen if host.lookup(kid) == slot
                            and host.state[slot] == S.RESIDENT and host.evictable(slot)]
                    self._evict_host(done)
                    waiting = [slot for slot, kid in chosen if host.lookup(kid) == slot and (
                        slot in self._backup_queue or host.state[slot] == S.OFFLOADING)]
                wait = self._progress_waiter(tier) if waiting else None
                if wait is None:
                    return sum(1 for slot, now in zip(victims, index.table.get_many(ids_chosen)) if now != slot)
            wait()

    def flush(self) -> int:
        """Copy every dirty page the write policy keeps down to the last tier and wait for all
        copies. Returns how many pages could not be made durable (still dirty, or refused
        because they could not be encoded): 0 unless a tier failed."""
        with self._lock:
            self._check_open()
        return sum(self._flush(deadline=None))

    def close(self, timeout_s: float | None = None) -> int:
        """Flush (for at most `timeout_s`, default `close_timeout_s`), then release memory,
        streams and threads. Returns how many pages could not be made durable; they are also
        counted as `dropped{reason="close"}`. Safe to call twice (later calls return 0)."""
        timeout_s = self.close_timeout_s if timeout_s is None else check_positive(timeout_s, "timeout_s")
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._closed or self._closing:
                return 0
            self._closing = True
        if self.remote is not None and hasattr(self.remote, "set_timeout"):
            self.remote.set_timeout(max(0.001, timeout_s / 2))
        left, gone = self._flush(deadline=deadline)
        with self._lock:
            self._closed = True
            if left:  # those dropped during the flush are counted under their own reason already
                self.counters.dropped["close"] += left
                log.warning("close: %d pages were not made durable and are gone", left)
            self._changed.notify_all()
            self._backup_work.notify_all()
            self._offload_work.notify_all()
        if self._offloader is not None:
            self._offloader.join()
        for ticket, _ in self._inflight:
            ticket.synchronize()
        self.engine.close()
        if self._link is not None:
            # What is left of the deadline (a few ms at least, for threads already stopping):
            # a writer a stuck disk holds is left behind, never waited for past the timeout.
            stopped = self._link.close(max(0.05, deadline - time.monotonic()))
            if stopped:
                self.remote.unregister_host_memory(self.host_tier.buffer.view(-1))
                if self._owns_remote:
                    self.remote.close()
        self.host_tier.close()
        unregister_pool(self._registry, self)
        release_id_cache()
        return left + gone

    def latency_snapshot(self) -> dict[str, tuple[list[int], float]]:
        """Bucket counts and sums of the call and remote-job latency histograms (for the exporter)."""
        with self._lock:
            self._apply_matches()
            return {op: hist.snapshot() for op, hist in self.counters.latency.items()}

    def remote_stats(self) -> dict:
        """The remote store's own counters (empty without a remote tier); asked without the lock."""
        store = self.remote
        if store is None or self._closed:
            return {}
        try:
            return store.stats()
        except Exception as exc:  # a scrape must never fail because the store does
            log.warning("remote store stats failed: %r", exc)
            return {}

    def __enter__(self) -> TieredPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> dict:
        """Counters and gauges of this pool: O(1), whatever the tiers hold."""
        with self._lock:
            self._apply_matches()
            c = self.counters
            return {
                "pool": self.name,
                "model": self.namespace.model,
                "rank": self.namespace.rank,
                "namespace": self.namespace.digest,
                "write_policy": self.write_policy.name,
                "engine": self.engine.name,
                "page_bytes": self.fmt.page_bytes,
                "hits": dict(c.hits),
                "misses": c.misses,
                "pages_moved": dict(c.pages_moved),
                "bytes_moved": dict(c.bytes_moved),
                "evictions": dict(c.evictions),
                "dropped": dict(c.dropped),
                "duplicate_commits": c.duplicate_commits,
                "remote_failures": dict(c.remote_failures),
                "remote_breaker": self._breaker.state.name.lower(),
                "remote_breaker_opened": self._breaker.opened,
                "backup_queue": len(self._backup_queue),
                "inflight": len(self._inflight) + self._backups_in_flight + len(self._fetching),
                "states": {"device": self._dev.state_counts(), "host": self._host.state_counts()},
                "held": {"device": self._dev.held},
            }

    # --- input checks ----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed or self._closing:
            raise RuntimeError(f"pool {self.name} is closed")

    def _check_fresh(self, op: str, slots: list[int]) -> None:
        """Every slot came from allocate, is still held by the engine and holds no page yet."""
        dev = self._dev
        slot = dev.first_unfresh(slots)
        if slot >= 0:
            raise ValueError(
                f"{op}: device slot {slot} must be an allocated, uncommitted slot the engine holds; "
                f"it is {S(dev.state[slot]).name} with {dev.pins[slot]} holds"
            )
