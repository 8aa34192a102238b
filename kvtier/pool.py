"""TieredPool: the public API that serving engines call.

Owns the translation of engine calls (allocate, commit, match, load, release, evict,
flush) into index updates and transfer jobs, under one lock. Deciding is pure Python on
the tier indexes; moving bytes is the transfer engine's job, and copies in flight hold
their slots `busy` until their ticket reports done, so no slot is reused under a copy.
It must never touch page bytes itself.

Tiers: device (GPU memory, or a CPU tensor standing in) -> host (pinned memory) ->
remote (optional page store). Pages are inclusive going up: a page loaded to the device
stays in the host tier, so evicting it from the device again costs nothing.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

import torch
from prometheus_client import REGISTRY

from kvtier.format import PageFormat
from kvtier.index import Namespace, PageState, TierIndex, WritePolicy, make_policy
from kvtier.index.states import READABLE
from kvtier.metrics import Counters, PoolCollector, next_pool_name
from kvtier.tiers import DeviceTier, HostTier
from kvtier.transfer import ReloadTransform, Ticket, TorchEngine
from kvtier.transfer.remote_mover import RemoteMover

S = PageState
log = logging.getLogger(__name__)


class PoolExhausted(RuntimeError):
    """A tier has no free or evictable slot left: every page is held or being copied."""


@dataclass(frozen=True)
class MatchResult:
    """Leading-prefix hits of one `match` call.

    device / host: how many leading keys that tier holds. remote: how many pages of the
    loadable prefix only the remote tier holds. total: how many leading keys can be loaded
    from some tier.
    """

    device: int
    host: int
    remote: int
    total: int


class LoadHandle:
    """The copies of one `load`. `wait`/`wait_layer` order the caller's current stream
    (no host blocking on CUDA); `synchronize` blocks the calling thread."""

    def __init__(self, tickets: list[Ticket], num_layers: int) -> None:
        self._tickets = tickets
        self.num_layers = num_layers
        self.slots: list[int] = []  # device slot of each key, in key order

    def done(self) -> bool:
        return all(t.done() for t in self._tickets)

    def wait(self) -> None:
        for t in self._tickets:
            t.wait()

    def wait_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        for t in self._tickets:
            t.wait_layer(layer)

    def synchronize(self) -> None:
        for t in self._tickets:
            t.synchronize()


def _make_engine(kind, device_tier: DeviceTier, host_tier: HostTier, transform, copy_path: str):
    if callable(kind):
        return kind(device_tier, host_tier)
    if kind == "auto":
        kind = "cuda" if device_tier.device.type == "cuda" else "torch"
    if kind == "torch":
        return TorchEngine(device_tier, host_tier, transform=transform)
    if kind == "cuda":
        from kvtier.transfer.cuda_engine import CudaEngine

        return CudaEngine(device_tier, host_tier, transform=transform, path=copy_path)
    raise ValueError(f"engine must be 'auto', 'torch' or 'cuda', got {kind!r}")


class TieredPool:
    """Pages of one model, one page format and one rank, across device, host (and remote) tiers.

    engine: "auto" (CUDA engine on a CUDA device, torch twin elsewhere), "torch", "cuda",
    or a callable (device_tier, host_tier) -> TransferEngine. copy_path picks the CUDA
    engine's way of moving bytes ("auto", "kernel", "copy_engine", "staged", "torch").
    remote: a directory or file:// URL of a page store (opened and closed by the pool), or a
    RemoteStore the caller owns (same page size and namespace as this pool).
    host_bytes, when given, sizes the host tier in bytes (whole pages) instead of host_pages.
    device_kv / device_scales: the serving engine's own KV tensors (see DeviceTier: (K, V)
    or (latent, None), stacked or per-layer lists); device_pages and device then come from
    them. Without them the pool allocates device_pages (default 1024) on device (default cpu).
    """

    def __init__(
        self,
        fmt: PageFormat,
        device: str | torch.device | None = None,
        device_pages: int | None = None,
        host_pages: int = 4096,
        write_policy: str = "write_through",
        eviction: str = "lru",
        engine="auto",
        copy_path: str = "auto",
        model: str = "default",
        rank: int = 0,
        transform: ReloadTransform | None = None,
        registry=REGISTRY,
        name: str | None = None,
        remote=None,
        remote_capacity_bytes: int | None = None,
        remote_queue_depth: int = 64,
        host_bytes: int | None = None,
        device_kv=None,
        device_scales=None,
    ) -> None:
        if not isinstance(fmt, PageFormat):
            raise TypeError(f"fmt must be a PageFormat, got {type(fmt).__name__}")
        if host_bytes is not None:
            if isinstance(host_bytes, bool) or not isinstance(host_bytes, int) or host_bytes < fmt.page_bytes:
                raise ValueError(f"host_bytes must be an int of at least one page ({fmt.page_bytes} bytes), got {host_bytes!r}")
            host_pages = host_bytes // fmt.page_bytes
        self.fmt = fmt
        self.write_policy = WritePolicy(write_policy)
        self.namespace = Namespace(model, fmt.fingerprint, rank)
        self.name = name or next_pool_name()
        if device_pages is None and device_kv is None:
            device_pages = 1024
        self.device_tier = DeviceTier(fmt, device_pages, device, kv=device_kv, scales=device_scales)
        device_pages = self.device_tier.num_pages
        self.host_tier = HostTier(fmt, host_pages)
        self.engine = _make_engine(engine, self.device_tier, self.host_tier, transform, copy_path)
        self._dev = TierIndex("device", device_pages, make_policy(eviction))
        self._host = TierIndex("host", host_pages, make_policy(eviction))
        self._lock = threading.RLock()
        self._inflight: list[tuple[Ticket, callable]] = []
        self._ready = None
        self.counters = Counters()
        self._registry = registry
        self._collector = PoolCollector(self)
        self.remote = None
        self._mover = None
        self._owns_remote = False
        if remote is not None:
            if isinstance(remote, (str, os.PathLike)):
                from kvtier.tiers.remote import RemoteStore

                remote = RemoteStore(
                    os.fspath(remote),
                    namespace=self.namespace.digest,
                    page_bytes=fmt.page_bytes,
                    capacity_bytes=remote_capacity_bytes,
                )
                self._owns_remote = True
            elif remote.page_bytes != fmt.page_bytes or remote.namespace != self.namespace.digest:
                raise ValueError(
                    f"remote store holds {remote.page_bytes}-byte pages of namespace {remote.namespace[:12]}…; "
                    f"this pool needs {fmt.page_bytes}-byte pages of namespace {self.namespace.digest[:12]}…"
                )
            self.remote = remote
            # One registration of the whole host tier: batches then skip per-call registration.
            remote.register_host_memory(self.host_tier.buffer.view(-1))
            self._mover = RemoteMover(remote, fmt.num_layers, remote_queue_depth)
        if registry is not None:
            registry.register(self._collector)
        self._closed = False

    # --- engine-facing views -------------------------------------------------------------
    def device_kv(self, layer: int):
        """(K, V) device pages of `layer`, each (device_pages, *plane_shape); (latent, None) under MLA."""
        return self.device_tier.layer_kv(layer)

    def device_scales(self, layer: int):
        """(K, V) fp32 scales of `layer`, (device_pages, *scale_shape); (None, None) without device scales."""
        return self.device_tier.layer_scales(layer)

    # --- allocation ----------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Device slots for n new pages, held by the engine until `release`."""
        _check_count(n)
        with self._lock:
            self._check_open()
            self._reap()
            slots = self._take_device(n, S.FILLING)
            for slot in slots:
                self._dev.pin(slot)
            return slots

    def release(self, slots) -> None:
        """The engine stops holding these slots; uncommitted ones are freed, committed ones stay cached."""
        slots = self._check_slots(slots)
        with self._lock:
            self._check_open()
            dev = self._dev
            for slot in slots:
                if not dev.pins[slot]:
                    raise ValueError(f"device slot {slot} is not held by the engine (state {dev.state[slot].name})")
            for slot in slots:
                dev.unpin(slot)
                if not dev.pins[slot] and dev.state[slot] == S.FILLING and not dev.busy[slot]:
                    dev.set_state(slot, S.FREE)
            self._reap()

    def acquire(self, keys) -> list[int]:
        """Hold the device slots of the leading device-resident keys; returns their slots."""
        keys = list(keys)
        with self._lock:
            self._check_open()
            self._reap()
            dev = self._dev
            slots = []
            for key in keys:
                slot = dev.readable_slot(key)
                if slot is None:
                    break
                dev.pin(slot)
                dev.touch(slot)
                slots.append(slot)
            self._copy_popular(slots)
            return slots

    # --- commit / match / load ----------------------------------------------------------
    def commit(self, keys, slots) -> int:
        """The pages in `slots` (from `allocate`) now hold `keys`; the write policy applies.

        A key already on the device keeps its slot; the new slot stays an unkeyed page the
        engine holds. Returns how many pages were newly keyed.
        """
        keys, slots = self._check_pairs(keys, slots)
        with self._lock:
            self._check_open()
            self._reap()
            dev, host = self._dev, self._host
            self._check_fresh("commit", slots)
            self._ready = self.engine.record_ready()
            table = dev.table
            fresh_keys, fresh_slots, clean, dirty = [], [], [], []
            for key, slot in zip(keys, slots):
                if key in table:
                    continue
                fresh_keys.append(key)
                fresh_slots.append(slot)
                (clean if host.readable_slot(key) is not None else dirty).append(slot)
            self.counters.duplicate_commits += len(keys) - len(fresh_keys)
            dev.bind_all(fresh_slots, fresh_keys)
            dev.set_states(clean, S.RESIDENT)
            dev.set_states(dirty, S.DIRTY)
            if dirty and self.write_policy.copy_on_commit():
                self._copy_down(dirty, evicting=False)
            return len(fresh_keys)

    def match(self, keys) -> MatchResult:
        """Longest leading prefix of `keys` per tier; counts hits for the write policy."""
        keys = list(keys)
        with self._lock:
            self._check_open()
            self._reap()
            dev, host = self._dev, self._host
            d = dev.leading(keys)
            h = host.leading(keys)
            dtable, htable = dev.table, host.table
            total = max(d, h)
            while total < len(keys) and (keys[total] in dtable or keys[total] in htable):
                total += 1
            remote = 0
            if self._mover and total < len(keys):
                # The loadable prefix may alternate between local and remote-only pages.
                rest = keys[total:]
                try:
                    # An index lookup, no I/O: asked here rather than queued behind backups.
                    in_remote = self.remote.contains(rest)
                except Exception:  # a failing remote tier is a miss, never an error for the engine
                    self.counters.remote_failures["read"] += len(rest)
                    in_remote = [False] * len(rest)
                for key, remote_has in zip(rest, in_remote):
                    if key in dtable or key in htable:
                        total += 1
                    elif remote_has:
                        total += 1
                        remote += 1
                    else:
                        break
            touched = []
            for key in keys[:d]:
                slot = dtable[key]
                dev.touch(slot)
                touched.append(slot)
            for key in keys[:h]:
                host.touch(htable[key])
            c = self.counters
            on_device = sum(1 for key in keys[:total] if key in dtable)
            c.hits["device"] += on_device
            c.hits["host"] += total - remote - on_device
            c.hits["remote"] += remote
            c.misses += len(keys) - total
            self._copy_popular(touched)
            self._backup_popular([htable[k] for k in keys[:h]])
            return MatchResult(device=d, host=h, remote=remote, total=total)

    def load(self, keys, slots=None) -> LoadHandle:
        """Bring `keys` to the device from wherever they are; `handle.slots` says where.

        slots=None: device-resident keys are held where they are, the rest land in new
        slots (allocated here, after the sources are secured, so allocation cannot evict
        them). With `slots` (from `allocate`): every key is copied into its given slot.
        Returns at once on CUDA; wait on the handle before reading. A key no tier holds
        raises KeyError, and the call leaves the device as it found it.
        """
        keys = list(keys)
        if slots is None:
            if len(set(keys)) != len(keys):
                raise ValueError("keys must not repeat within one call")
        else:
            keys, slots = self._check_pairs(keys, slots)
        with self._lock:
            self._check_open()
            self._reap()
            dev, host = self._dev, self._host
            if slots is not None:
                self._check_fresh("load", slots)
            on_device, on_host, elsewhere, landing = self._classify(keys)
            if landing:  # pages still arriving in the host tier: let them land first
                self._drain()
                on_device, on_host, elsewhere, landing = self._classify(keys)
            dtable, htable = dev.table, host.table
            host_src = [htable[keys[i]] for i in on_host]
            dev_src = [dtable[keys[i]] for i in on_device]
            # Secure every source before anything is allocated: allocation evicts.
            host.hold_all(host_src)
            dev.hold_all(dev_src)
            try:
                if elsewhere:
                    fetched = self._fetch_remote([keys[i] for i in elsewhere]) if self._mover else {}
                    missing = [keys[i] for i in elsewhere if keys[i] not in fetched]
                    if missing:
                        host.unhold_all(fetched.values())
                        raise KeyError(
                            f"load: {len(missing)} of {len(keys)} keys are in no tier; first missing: {missing[0]!r}"
                        )
                    on_host += elsewhere
                    host_src += [fetched[keys[i]] for i in elsewhere]
                if slots is None:
                    new = self._take_device(len(on_host), S.FILLING)
                    for slot in dev_src:
                        dev.pin(slot)
                        dev.touch(slot)
                    out = [0] * len(keys)
                    for i, slot in zip(on_device, dev_src):
                        out[i] = slot
                    for i, slot in zip(on_host, new):
                        out[i] = slot
                        dev.pin(slot)
                    host_dst = new
                else:
                    out = slots
                    host_dst = [slots[i] for i in on_host]
                tickets = []
                if slots is not None and on_device:
                    tickets.append(self._device_copy(dev_src, [slots[i] for i in on_device]))
                if on_host:
                    tickets.append(self._reload(host_src, [(keys[i], slot) for i, slot in zip(on_host, host_dst)]))
            finally:
                host.unhold_all(host_src)
                dev.unhold_all(dev_src)
            handle = LoadHandle(tickets, self.fmt.num_layers)
            handle.slots = out
            return handle

    prefetch = load

    def _classify(self, keys: list):
        """Indexes of keys on the device, readable on the host, elsewhere, and landing in host."""
        on_device, on_host, elsewhere, landing = [], [], [], []
        dtable, htable, hstate = self._dev.table, self._host.table, self._host.state
        for i, key in enumerate(keys):
            if key in dtable:
                on_device.append(i)
                continue
            src = htable.get(key)
            if src is None:
                elsewhere.append(i)
            elif hstate[src] in READABLE:
                on_host.append(i)
            else:
                landing.append(i)
        return on_device, on_host, elsewhere, landing

    # --- eviction / flush / close --------------------------------------------------------
    def evict(self, n: int | None = None, tier: str = "device", keys=None) -> int:
        """Evict up to n unheld pages (all when n is None), or exactly `keys`, from `tier`.

        The write policy applies: dirty pages are copied down first unless it drops them.
        Returns how many pages left the tier.
        """
        if tier not in ("device", "host"):
            raise ValueError(f"evict: tier must be 'device' or 'host', got {tier!r}")
        if n is not None:
            _check_count(n)
        with self._lock:
            self._check_open()
            self._reap()
            index = self._dev if tier == "device" else self._host
            if keys is not None:
                victims = []
                evictable = set(index.policy.order())
                for key in keys:
                    slot = index.lookup(key)
                    if slot is not None and slot in evictable:
                        victims.append(slot)
                victims = victims[:n] if n is not None else victims
            else:
                victims = index.victims(index.capacity if n is None else n)
            if tier == "device":
                return self._evict_device_slots(victims)
            return self._evict_host_slots(victims)

    def flush(self) -> int:
        """Copy every dirty page the write policy keeps down to the last tier and wait for all
        copies. Returns how many such pages are still not durable (0 unless a tier failed)."""
        with self._lock:
            self._check_open()
            return self._flush()

    def _flush(self) -> int:
        dev, host = self._dev, self._host
        keep = self.write_policy.copy_on_evict

        def pending(index: TierIndex) -> list[int]:
            return [s for s in range(index.capacity) if index.state[s] == S.DIRTY and keep(index.hits[s])]

        # Copies free host slots only as they complete: finish them first, and go round
        # until nothing moves.
        while True:
            self._drain()
            dirty = pending(dev)
            moved = self._copy_down(dirty, evicting=False) if dirty else []
            if self._mover:
                self._drain()
                backups = pending(host)
                if backups:
                    self._backup(backups)
            self._drain()
            if not moved:
                break
        left = len(pending(dev)) + (len(pending(host)) if self._mover else 0)
        if left:
            log.warning("flush: %d dirty pages could not be made durable (remote failures: %s)", left, dict(self.counters.remote_failures))
        return left

    def close(self) -> None:
        """Flush, then release memory and streams. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._flush()
            self._closed = True
            self.engine.close()
            if self._mover:
                self._mover.close()
                self.remote.unregister_host_memory(self.host_tier.buffer.view(-1))
                if self._owns_remote:
                    self.remote.close()
            self.host_tier.close()
            if self._registry is not None:
                self._registry.unregister(self._collector)

    def __enter__(self) -> TieredPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> dict:
        with self._lock:
            c = self.counters
            return {
                "pool": self.name,
                "namespace": self.namespace.digest,
                "write_policy": self.write_policy.name,
                "engine": self.engine.name,
                "page_bytes": self.fmt.page_bytes,
                "hits": dict(c.hits),
                "misses": c.misses,
                "pages_moved": dict(c.pages_moved),
                "bytes_moved": dict(c.bytes_moved),
                "evictions": dict(c.evictions),
                "dropped": c.dropped,
                "duplicate_commits": c.duplicate_commits,
                "remote_failures": dict(c.remote_failures),
                "inflight": len(self._inflight),
                "states": {"device": self._dev.state_counts(), "host": self._host.state_counts()},
                "held": {"device": sum(1 for p in self._dev.pins if p)},
            }

    # --- internals: slots ------------------------------------------------------------------
    def _take_device(self, n: int, state: PageState) -> list[int]:
        dev = self._dev
        slots = dev.take_free(n, state)
        if len(slots) < n:
            self._evict_device_slots(dev.victims(n - len(slots)))
            slots += dev.take_free(n - len(slots), state)
        if len(slots) < n and self._inflight:
            self._drain()
            self._evict_device_slots(dev.victims(n - len(slots)))
            slots += dev.take_free(n - len(slots), state)
        if len(slots) < n:
            for slot in slots:
                dev.set_state(slot, S.FREE)
            raise PoolExhausted(self._exhausted("device", n))
        return slots

    def _exhausted(self, tier: str, n: int) -> str:
        index = self._dev if tier == "device" else self._host
        held = sum(1 for p in index.pins if p)
        busy = sum(1 for b in index.busy if b)
        return (
            f"{tier} tier: need {n} slots, none left free or evictable "
            f"({index.capacity} slots: {held} held by the engine, {busy} in copies in flight); "
            f"release pages or raise {tier}_pages"
        )

    def _take_host(self, n: int) -> list[int]:
        """Up to n host slots in LOADING state, evicting host pages as needed (never raises)."""
        host = self._host
        slots = host.take_free(n, S.LOADING)
        if len(slots) < n:
            self._evict_host_slots(host.victims(n - len(slots)))
            slots += host.take_free(n - len(slots), S.LOADING)
        return slots

    def _evict_device_slots(self, victims: list[int]) -> int:
        dev = self._dev
        to_copy, freed = [], 0
        for slot in victims:
            if dev.state[slot] == S.DIRTY:
                if self.write_policy.copy_on_evict(dev.hits[slot]):
                    to_copy.append(slot)
                    continue
                self.counters.dropped += 1
            dev.set_state(slot, S.FREE)
            freed += 1
        if to_copy:
            copied = self._copy_down(to_copy, evicting=True)
            for slot in copied:
                dev.set_state(slot, S.FREE)
            freed += len(copied)
        self.counters.evictions["device"] += freed
        return freed

    def _evict_host_slots(self, victims: list[int]) -> int:
        host, dev = self._host, self._dev
        dirty = [s for s in victims if host.state[s] == S.DIRTY]
        keep = [s for s in dirty if self.write_policy.copy_on_evict(host.hits[s])]
        if keep:
            self._backup(keep)
            self._drain()
        evicted = 0
        for slot in victims:
            state = host.state[slot]
            if state == S.DIRTY and slot in keep:
                continue  # its backup failed: keeping it is the only way not to lose it
            if state == S.DIRTY:
                self.counters.dropped += 1
            key = host.keys[slot]
            dslot = dev.lookup(key)
            # The device copy, if any, is now the only one: it becomes dirty.
            if dslot is not None and dev.state[dslot] == S.RESIDENT:
                dev.set_state(dslot, S.DIRTY)
            host.set_state(slot, S.FREE)
            evicted += 1
        self.counters.evictions["host"] += evicted
        return evicted

    # --- internals: remote ------------------------------------------------------------------
    def _backup(self, host_slots: list[int]) -> None:
        """Copy dirty host pages to the remote store in the background."""
        host, tier = self._host, self.host_tier
        keys = [host.keys[s] for s in host_slots]
        buffers = [tier.page(s) for s in host_slots]
        host.set_states(host_slots, S.OFFLOADING, busy_delta=1)
        ticket = self._mover.submit(lambda store: store.put(keys, buffers))

        def finish() -> None:
            ok = ticket.result if ticket.error is None else [False] * len(keys)
            good = [s for s, o in zip(host_slots, ok) if o]
            bad = [s for s, o in zip(host_slots, ok) if not o]
            host.set_states(good, S.RESIDENT, busy_delta=-1)
            host.set_states(bad, S.DIRTY, busy_delta=-1)
            self.counters.moved("host_to_remote", len(good), len(good) * self.fmt.page_bytes)
            self.counters.remote_failures["write"] += len(bad)

        self._submit(ticket, finish)

    def _backup_popular(self, host_slots: list[int]) -> None:
        """write_through_selective: back up the dirty host pages that just reached enough hits."""
        if not self._mover:
            return
        host = self._host
        ready = [s for s in host_slots if host.state[s] == S.DIRTY and self.write_policy.copy_on_hit(host.hits[s])]
        if ready:
            self._backup(ready)

    def _fetch_remote(self, keys: list, wait: bool = True):
        """Bring remote pages into host slots.

        wait=True: returns {key: host slot} of the pages that arrived, each slot held
        (busy) for the caller to release; raises PoolExhausted when the host tier cannot
        take them all even after the copies in flight finish. wait=False (a prefetch hint):
        fetches what fits and returns the ticket at once; the pages become readable when
        the pool reaps it.
        """
        host, tier = self._host, self.host_tier
        slots = self._take_host(len(keys))
        if wait and len(slots) < len(keys):
            self._drain()  # copies in flight keep host slots busy; let them finish
            slots += self._take_host(len(keys) - len(slots))
            if len(slots) < len(keys):
                host.set_states(slots, S.FREE)
                raise PoolExhausted(self._exhausted("host", len(keys)))
        keys = keys[: len(slots)]
        host.bind_all(slots, keys)
        host.hold_all(slots)
        buffers = [tier.page(s) for s in slots]
        ticket = self._mover.submit(lambda store: store.get(keys, buffers))
        arrived = {}

        def finish() -> None:
            ok = ticket.result if ticket.error is None else [False] * len(keys)
            good = [s for s, o in zip(slots, ok) if o]
            arrived.update((host.keys[s], s) for s in good)
            host.set_states(good, S.RESIDENT, busy_delta=-1)
            host.set_states([s for s, o in zip(slots, ok) if not o], S.FREE, busy_delta=-1)
            if ticket.error is not None:
                self.counters.remote_failures["read"] += len(keys)
            self.counters.moved("remote_to_host", len(good), len(good) * self.fmt.page_bytes)

        if not wait:
            self._submit(ticket, finish)
            return ticket
        ticket.synchronize()
        finish()
        host.hold_all(arrived.values())
        return arrived

    def prefetch_to_host(self, keys) -> Ticket | None:
        """Start bringing the remote-only pages among `keys` into the host tier on the remote
        worker; returns its ticket at once (None when nothing needs fetching)."""
        keys = list(keys)
        with self._lock:
            self._check_open()
            self._reap()
            if not self._mover:
                return None
            wanted = [k for k in keys if k not in self._dev.table and k not in self._host.table]
            return self._fetch_remote(wanted, wait=False) if wanted else None

    # --- internals: copies -----------------------------------------------------------------
    def _copy_down(self, dev_slots: list[int], evicting: bool) -> list[int]:
        """Offload dirty device pages to host. Returns the device slots now clean or whose copy
        is done (evicting: waits for it) or submitted (not evicting)."""
        dev, host = self._dev, self._host
        already = []
        htable = host.table
        if any(dev.keys[slot] in htable for slot in dev_slots):
            # The host tier has (or is fetching from the remote tier) some of these pages:
            # let fetches land, then those device pages are clean and need no copy.
            self._drain()
            already = [slot for slot in dev_slots if host.readable_slot(dev.keys[slot]) is not None]
            dev.set_states(already, S.RESIDENT)
            dev_slots = [slot for slot in dev_slots if dev.state[slot] == S.DIRTY]
        host_slots = self._take_host(len(dev_slots))
        moving = dev_slots[: len(host_slots)]
        if not moving:
            return already
        host.bind_all(host_slots, [dev.keys[slot] for slot in moving])
        dev.set_states(moving, S.OFFLOADING, busy_delta=1)
        host.hold_all(host_slots)
        ticket = self.engine.offload(moving, host_slots, ready=self._ready)

        def finish() -> None:
            dev.set_states(moving, S.RESIDENT, busy_delta=-1)
            host.set_states(host_slots, S.DIRTY if self._mover else S.RESIDENT, busy_delta=-1)
            self.counters.moved("device_to_host", len(moving), len(moving) * self.fmt.page_bytes)
            if self._mover and self.write_policy.copy_on_commit():
                self._backup(host_slots)

        self._submit(ticket, finish)
        if evicting:
            self._drain()
        return already + moving

    def _copy_popular(self, dev_slots: list[int]) -> None:
        """write_through_selective: copy down the dirty pages that just reached enough hits."""
        dev = self._dev
        ready = [s for s in dev_slots if dev.state[s] == S.DIRTY and self.write_policy.copy_on_hit(dev.hits[s])]
        if ready:
            self._copy_down(ready, evicting=False)

    def _reload(self, host_slots: list[int], targets: list[tuple]) -> Ticket:
        dev, host = self._dev, self._host
        dev_slots = [slot for _, slot in targets]
        dev.set_states(dev_slots, S.LOADING, busy_delta=1)
        dev.bind_all(dev_slots, [key for key, _ in targets])
        host.hold_all(host_slots, touch=True)
        ticket = self.engine.reload(host_slots, dev_slots, ready=self.engine.record_ready())

        def finish() -> None:
            dev.set_states(dev_slots, S.RESIDENT, busy_delta=-1)
            host.unhold_all(host_slots)
            self.counters.moved("host_to_device", len(dev_slots), len(dev_slots) * self.fmt.page_bytes)

        self._submit(ticket, finish)
        return ticket

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
        if not self._inflight:
            return
        inflight, self._inflight = self._inflight, []
        for ticket, finish in inflight:
            if ticket.done():
                finish()
            else:
                self._inflight.append((ticket, finish))

    def _drain(self) -> None:
        while self._inflight:
            inflight, self._inflight = self._inflight, []
            for ticket, finish in inflight:
                ticket.synchronize()
                finish()

    # --- input checks ----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"pool {self.name} is closed")

    def _check_slots(self, slots) -> list[int]:
        slots = [int(s) for s in slots]
        cap = self._dev.capacity
        for slot in slots:
            if not 0 <= slot < cap:
                raise ValueError(f"device slot {slot} out of range [0, {cap})")
        if len(set(slots)) != len(slots):
            raise ValueError("slots must not repeat within one call")
        return slots

    def _check_fresh(self, op: str, slots: list[int]) -> None:
        """Every slot came from allocate, is still held by the engine and holds no page yet."""
        dev = self._dev
        for slot in slots:
            if dev.state[slot] != S.FILLING or dev.keys[slot] is not None or not dev.pins[slot]:
                raise ValueError(
                    f"{op}: device slot {slot} must be an allocated, uncommitted slot the engine holds; "
                    f"it is {dev.state[slot].name} with {dev.pins[slot]} holds"
                )

    def _check_pairs(self, keys, slots) -> tuple[list, list[int]]:
        keys = list(keys)
        slots = self._check_slots(slots)
        if len(keys) != len(slots):
            raise ValueError(f"got {len(keys)} keys for {len(slots)} slots; they must pair up")
        if len(set(keys)) != len(keys):
            raise ValueError("keys must not repeat within one call")
        return keys, slots


def _check_count(n) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"page count must be an int >= 0, got {n!r}")
