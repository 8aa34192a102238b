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

The class is split in three files along that line: this one is the pool's face (what each
call decides, under the lock); movement.py starts the copies it schedules and applies them
when they land; room.py takes slots and evicts to make them. TieredPool inherits both.

It must never touch page bytes itself, nor hold its lock while it waits.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
from prometheus_client import REGISTRY

from collections.abc import Iterable

from kvtier.format import PageFormat
from kvtier.index import Namespace, PageState, TierIndex, WritePolicy, make_policy
from kvtier.index.key_table import MANY
from kvtier.index.keys import hold_id_cache, key_ids, release_id_cache
from kvtier.index.prefix import leading_slots, walk, walk_slots
from kvtier.index.slot_list import SlotList
from kvtier.metrics import Counters, register_pool, unregister_pool
from kvtier.pool.breaker import CircuitBreaker
from kvtier.pool.checks import check_copy_path, check_copy_path_runs, check_count, check_host_size, check_positive, check_slots, check_unique
from kvtier.pool.handles import LoadHandle, MatchResult, PoolExhausted
from kvtier.pool.movement import _READABLE, Movement
from kvtier.pool.remote_link import RemoteLink
from kvtier.pool.room import TierRoom
from kvtier.pool.signal import ChangeSignal
from kvtier.tiers import DeviceTier, HostTier
from kvtier.transfer import JoinedTicket, ReloadTransform, Ticket, TorchEngine

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from kvtier.tiers.cluster import ClusterSettings
    from kvtier.tiers.remote import RemoteStore

S = PageState
Key = str | bytes
log = logging.getLogger(__name__)

# A load that keeps waiting (every wait a real event: a fetch, a copy, a change) while other
# threads take the room or pages it needs gives up after this long, with PoolExhausted.
_LOAD_PATIENCE_S = 30.0
# A load submits its copies in chunks of this many pages, then _CHUNK_GROWTH times more each time:
# the first bytes move after little bookkeeping, and a load of thousands of pages makes few copies.
_FIRST_CHUNK = 32
_CHUNK_GROWTH = 4
# ... up to this many bytes a chunk (or MANY pages): a chunk's copy then outlasts the
# next chunk's bookkeeping wherever a page's bookkeeping is shorter than its PCIe time, so a long
# load's copies run back to back instead of waiting for one last chunk of most of the batch.
_CHUNK_BYTES = 64 << 20


def _make_engine(kind, device_tier: DeviceTier, host_tier: HostTier, transform, copy_path: str):
    if callable(kind):
        return kind(device_tier, host_tier)
    check_copy_path_runs(copy_path, kind, device_tier.device)
    if kind == "auto":
        kind = "cuda" if device_tier.device.type == "cuda" else "torch"
    if kind == "torch":
        return TorchEngine(device_tier, host_tier, transform=transform)
    if kind == "cuda":
        from kvtier.transfer.cuda_engine import CudaEngine

        return CudaEngine(device_tier, host_tier, transform=transform, path=copy_path)
    raise ValueError(f"engine must be 'auto', 'torch', 'cuda' or a callable, got {kind!r}")


def _open_remote(remote, fmt: PageFormat, namespace: Namespace, capacity_bytes, create: bool, cluster):
    """(store, owned): the local store, the cluster tier (kvtier.tiers.cluster) behind it when
    `cluster` is given, or the cluster alone without `remote`."""
    store, owned = (None, False) if remote is None else _open_local(remote, fmt, namespace, capacity_bytes, create)
    if cluster is None:
        return store, owned
    from kvtier.tiers.cluster import open_cluster

    return open_cluster(cluster, store, owned, namespace=namespace.digest, page_bytes=fmt.page_bytes), True


def _open_local(remote, fmt: PageFormat, namespace: Namespace, capacity_bytes, create: bool):
    """(store, owned): open a directory or file:// URL, or check a caller's RemoteStore."""
    if isinstance(remote, (str, os.PathLike)):
        from kvtier.tiers.remote import RemoteStore
        from kvtier.tiers.remote.labels import format_fields

        store = RemoteStore(os.fspath(remote), namespace=namespace.digest, page_bytes=fmt.page_bytes,
                            capacity_bytes=capacity_bytes, create=create,
                            namespace_label={"model": namespace.model, "rank": namespace.rank,
                                             "format": format_fields(fmt)})
        return store, True
    if not all(hasattr(remote, name) for name in ("put_ids", "get_ids", "contains_ids", "page_bytes", "namespace")):
        raise TypeError(
            f"remote must be a directory path, a file:// URL or a kvtier RemoteStore, got {type(remote).__name__} {remote!r}"
        )
    if remote.page_bytes != fmt.page_bytes or remote.namespace != namespace.digest:
        raise ValueError(
            f"remote store holds {remote.page_bytes}-byte pages of namespace {remote.namespace[:12]}…; "
            f"this pool needs {fmt.page_bytes}-byte pages of namespace {namespace.digest[:12]}…"
        )
    return remote, False


class TieredPool(Movement, TierRoom):
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
    that never blocks, where a second thread only competes for the GIL).
    layer_ordered_loads: a load of several chunks copies every chunk's first layer first, then
    the other layers layer by layer (with an engine that copies a subset of layers), so layer 0
    lands after about 1/L of the bytes; off by default: on an H100 host it cost a 256-page load
    twice the host time and 0.75x of PCIe against 0.89x, and a prefetched decode step did not gain
    (BENCHMARKS.md, "Time to first token and prefetched decode").
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
        self.engine = _make_engine(engine, self.device_tier, self.host_tier, transform, copy_path)
        self._dev = TierIndex("device", device_pages, make_policy(eviction, device_pages), compact_keys=False)
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
        self._dev_landing: dict[int, Ticket] = {}  # device slot -> reload still landing in it
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
                self.remote, self._owns_remote = _open_remote(
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
        at eviction or flush instead.
        """
        start = time.perf_counter()
        ids = key_ids(keys)
        slots = check_slots(slots, self._dev.capacity)
        if len(ids) != len(slots):
            raise ValueError(f"got {len(ids)} keys for {len(slots)} slots; they must pair up")
        check_unique(ids)
        with self._lock:
            self._check_open()
            self._reap()
            dev, host = self._dev, self._host
            self._check_fresh("commit", slots)
            ready = self._ready = self.engine.record_ready()
            fresh_ids, fresh_slots, _, _ = dev.partition(ids, slots)
            absent_ids, absent_slots, held, at = host.partition(fresh_ids, fresh_slots)
            # A page the host tier holds is clean, unless it is still being fetched there.
            clean = {slot for slot, h in zip(held, at) if _READABLE[host.state[h]]}
            self.counters.duplicate_commits += len(ids) - len(fresh_ids)
            dev.key_filled(fresh_slots, fresh_ids, clean)
            if absent_slots and self.write_policy.copy_on_commit():
                # background_copies: the offload thread starts the copy down, so that commit
                # costs the engine only the bookkeeping of its own pages.
                if self._offloader is not None:
                    self._pending_down.append((absent_slots, absent_ids, ready))
                    self._offload_work.notify()
                else:
                    self._start_copy_down(absent_slots, absent_ids, evicting=False, ready=ready)
            self.counters.latency["commit"].observe(time.perf_counter() - start)
            return len(fresh_ids)

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
        ids = key_ids(keys)
        check_unique(ids)
        if slots is not None:
            slots = check_slots(slots, self._dev.capacity)
            if len(ids) != len(slots):
                raise ValueError(f"got {len(ids)} keys for {len(slots)} slots; they must pair up")
            with self._lock:
                self._check_open()
                self._check_fresh("load", slots)
        else:
            with self._lock:
                self._check_open()
                self._reap()
                handle = self._load_now(ids)
                if handle is not None:
                    self.counters.latency["load"].observe(time.perf_counter() - start)
                    return handle
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

    def _load_now(self, ids: list[bytes]) -> LoadHandle | None:
        """The common load in one hold of the lock, or None (the device as it was, but for
        evictions) for the general path: every key on the device or readable in the host tier,
        and device room for the host pages without waiting (free slots, or clean pages to evict).
        Device pages are held where they are; host pages land in new slots keyed at once
        (FREE -> LOADING).

        Keys are taken in chunks (_FIRST_CHUNK pages, then _CHUNK_GROWTH times more each time, up to
        _CHUNK_BYTES; after the first, a tail under half the next chunk joins the one before it), each
        chunk's copy submitted before the next chunk's bookkeeping, so a large load's bytes start moving
        after one small chunk of Python. A chunk that finds a key it cannot load now cancels the chunks
        before it: their pages lose their keys at once and their slots are freed when their copies land.

        With layer_ordered_loads, an engine that reloads a subset of layers (`reloads_layers`), more than one layer and
        more than one chunk's keys, each chunk copies only its first layer as it is booked, and the
        other layers of every chunk follow in one call after the last chunk, in layer order: the
        whole load's first layer lands after 1/L of its bytes, not near the end as when each chunk
        moves every layer, so attention over layer i overlaps the copies of the layers after it.
        """
        dev, host, engine = self._dev, self._host, self.engine
        dget_many = dev.table.get_many
        landing = self._dev_landing
        out = [-1] * len(ids)
        pinned: list[int] = []  # device pages held where they are
        started: list[tuple[list[int], Ticket, list[bool]]] = []  # (targets, ticket, cancelled)
        ready = None
        num_layers = self.fmt.num_layers
        # Split only loads of several chunks: one chunk's copy (one launch on CUDA) already lands layer by layer.
        split = (self._layer_ordered_loads and getattr(engine, "reloads_layers", False)
                 and num_layers > 1 and len(ids) > _FIRST_CHUNK)
        pending: list[tuple[list[int], list[int], Ticket, list[bool]]] = []  # split: (srcs, targets, first layer, flags)
        pos, chunk = 0, _FIRST_CHUNK
        largest = max(MANY, _CHUNK_BYTES // self.fmt.page_bytes)  # MANY: host lookups stay in numpy
        while pos < len(ids):
            end, chunk = pos + chunk, min(chunk * _CHUNK_GROWTH, largest)
            end = len(ids) if pos and len(ids) - end < chunk // 2 else min(end, len(ids))
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
            targets = dev.take_bound(src_ids)
            if ready is None:
                ready = engine.record_ready()
            if type(src_pos) is range:
                out[src_pos.start : src_pos.stop] = targets
            else:
                for i, slot in zip(src_pos, targets):
                    out[i] = slot
            flags = [False, False]  # cancelled, landed
            if split:
                ticket = engine.reload_layers(srcs, targets, range(1), ready=ready)
                started.append((targets, ticket, flags))
                pending.append((srcs, targets, ticket, flags))
                continue
            ticket = engine.reload(srcs, targets, ready=ready)
            landing.update(dict.fromkeys(targets, ticket))
            started.append((targets, ticket, flags))
            self._submit(ticket, self._landed(srcs, targets, ticket, flags))
        tickets = list({landing[s] for s in pinned if s in landing}) if landing else []
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
                landing.update(dict.fromkeys(targets, joined))
                self._submit(joined, self._landed(srcs, targets, joined, flags))
        return LoadHandle(tickets, num_layers, out)

    def _cancel_load_now(self, pinned: list[int], started: list, pending: list) -> None:
        """Undo a `_load_now` that cannot finish: holds on device pages dropped, chunks already
        copying unkeyed and unheld (freed when they land). pending: chunks that copy their first
        layer only (split loads), whose landing is watched from here on."""
        dev, landing = self._dev, self._dev_landing
        for srcs, targets, first, flags in pending:
            self._submit(first, self._landed(srcs, targets, first, flags))
        for slot in pinned:
            dev.unpin(slot)
        for targets, ticket, flags in started:
            flags[0] = True
            dev.unpin_all(targets)
            if flags[1]:  # landed already (a synchronous engine): those pages go now
                dev.set_states(targets, S.FREE)
                continue
            for slot in targets:  # still landing: unkeyed now, freed when the copy lands
                dev.table.unbind(slot)
                if landing.get(slot) is ticket:
                    del landing[slot]

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
        landing = list({self._dev_landing[dev_src[i]] for i in dev_idx if dev_src[i] in self._dev_landing})
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
            host_src.clear()  # the reload takes over the load's holds on its sources
            tickets.append(self._reload(sources, targets, [ids[i] for i in reload_idx], keyed))
            for i, slot in zip(reload_idx, targets):
                out[i] = slot
        return LoadHandle(tickets, self.fmt.num_layers, out)

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

    def _flush(self, deadline: float | None) -> tuple[int, int]:
        """Make durable the pages that are not when the flush starts (pages committed meanwhile
        are copied too, but not waited for or counted: under steady commits a flush would
        otherwise never see nothing left, and would report new pages as failures). Returns
        (pages still not durable, pages dropped meanwhile, already counted by their reason)."""
        keep = None if self.write_policy.keeps_every_page else self.write_policy.copy_on_evict
        dropped = self.counters.dropped
        dropped_before = dropped.get("not_encodable", 0) + dropped.get("remote_unavailable", 0)
        last = None
        owed = None  # key ids of the pages not durable when the flush started
        probe_first = True
        while True:
            with self._lock:
                self._reap()
                if owed is None:
                    owed = set().union(*self._not_durable_ids())
                # Host pages first: their backups probe a remote tier the breaker holds off.
                if self._link is not None:
                    for s in self._host.idle(self._host.dirty_kept(keep)):
                        self._backup_queue.append(s)
                    if len(self._backup_queue):
                        self._breaker.force_probe()
                        self._backup_work.notify()
                # Flush copies every dirty page itself (after the latest commit's event, which
                # follows every queued batch's): the offload thread's queued batches go, or one
                # would copy a page again after flush returned, once something made it dirty.
                self._pending_down.clear()
                dev = self._dev
                dev_dirty = dev.idle(dev.dirty_kept(keep))
                # A copy down needs host room, which an unhealthy remote tier makes by dropping
                # dirty host pages: the first round lets the probe answer before copying down.
                waiting_for_probe = (probe_first and dev_dirty and self._link is not None
                                     and not self._breaker.healthy and len(self._backup_queue))
                probe_first = False
                if dev_dirty and not waiting_for_probe:
                    self._copy_down(dev_dirty, evicting=False)
            # Wait for everything this round started, then look again while that helps.
            self._wait_idle(deadline)
            with self._lock:
                self._reap()
                on_device, on_host = self._not_durable_ids() if owed and self._any_not_durable() else (set(), set())
                owed &= on_device | on_host
                left = len(owed)
                # Progress is a page a tier nearer durable: one copied down from the device counts.
                distance = left + len(owed & on_device)
                stuck = last is not None and distance >= last and not waiting_for_probe
            if not left or stuck or (deadline is not None and time.monotonic() >= deadline):
                break
            last = distance
        gone = dropped.get("not_encodable", 0) + dropped.get("remote_unavailable", 0) - dropped_before
        if left + gone:
            log.warning("flush: %d pages could not be made durable (remote failures: %s; last error: %s)",
                        left + gone, dict(self.counters.remote_failures), self._breaker.last_error)
        return left, gone

    def _not_durable_ids(self) -> tuple[set[bytes], set[bytes]]:
        """Key ids of the pages the write policy keeps that no last tier holds yet, dirty or
        being copied down: (on the device, in the host tier). O(dirty pages); slots being
        copied are found with one vectorized scan of the tier's states, only while copies are
        in flight."""
        keep = None if self.write_policy.keeps_every_page else self.write_policy.copy_on_evict
        found = []
        for index in (self._dev, self._host):
            out: set[bytes] = set()
            if index is self._dev or self._link is not None:
                out.update(index.ids_of(index.dirty_kept(keep, ordered=False)))
                if index.counts[S.OFFLOADING]:
                    out.update(index.ids_of(index.slots_in(S.OFFLOADING)))
            found.append(out)
        return found[0], found[1]

    def _any_not_durable(self) -> bool:
        """Whether a page may not be durable yet (any DIRTY or OFFLOADING page where
        `_not_durable_ids` looks): O(1), so that a flush that made everything durable does not
        collect ids to find nothing."""
        dev, host = self._dev.counts, self._host.counts
        return bool(dev[S.DIRTY] or dev[S.OFFLOADING]
                    or self._link is not None and (host[S.DIRTY] or host[S.OFFLOADING]))

    def _wait_idle(self, deadline: float | None) -> None:
        """Wait outside the lock until no engine copy is in flight and the backup queue has
        drained or the breaker refuses to try again before `deadline`."""
        while True:
            with self._lock:
                self._reap()
                tickets = [t for t, _ in self._inflight]
                if not tickets:
                    if self._link is None:
                        return
                    busy = self._backups_in_flight or (len(self._backup_queue) and self._breaker.wait_s() == 0)
                    if not busy:
                        return
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return
                    self._changed.wait(timeout=remaining if remaining is not None else 1.0)
                    continue
            for ticket in tickets:
                ticket.synchronize()

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
