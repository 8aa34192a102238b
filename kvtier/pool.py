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

import threading
from dataclasses import dataclass

import torch
from prometheus_client import REGISTRY

from kvtier.format import PageFormat
from kvtier.index import Namespace, PageState, TierIndex, WritePolicy, make_policy
from kvtier.metrics import Counters, PoolCollector, next_pool_name
from kvtier.tiers import DeviceTier, HostTier
from kvtier.transfer import ReloadTransform, Ticket, TorchEngine

S = PageState


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


def _make_engine(kind: str, device_tier: DeviceTier, host_tier: HostTier, transform):
    if kind == "auto":
        kind = "cuda" if device_tier.device.type == "cuda" else "torch"
    if kind == "torch":
        return TorchEngine(device_tier, host_tier, transform=transform)
    if kind == "cuda":
        from kvtier.transfer.cuda_engine import CudaEngine

        return CudaEngine(device_tier, host_tier, transform=transform)
    raise ValueError(f"engine must be 'auto', 'torch' or 'cuda', got {kind!r}")


class TieredPool:
    def __init__(
        self,
        fmt: PageFormat,
        device: str | torch.device = "cpu",
        device_pages: int = 1024,
        host_pages: int = 4096,
        write_policy: str = "write_through",
        eviction: str = "lru",
        engine: str = "auto",
        model: str = "default",
        rank: int = 0,
        transform: ReloadTransform | None = None,
        registry=REGISTRY,
        name: str | None = None,
    ) -> None:
        if not isinstance(fmt, PageFormat):
            raise TypeError(f"fmt must be a PageFormat, got {type(fmt).__name__}")
        self.fmt = fmt
        self.write_policy = WritePolicy(write_policy)
        self.namespace = Namespace(model, fmt.fingerprint, rank)
        self.name = name or next_pool_name()
        self.device_tier = DeviceTier(fmt, device_pages, device)
        self.host_tier = HostTier(fmt, host_pages)
        self.engine = _make_engine(engine, self.device_tier, self.host_tier, transform)
        self._dev = TierIndex("device", device_pages, make_policy(eviction))
        self._host = TierIndex("host", host_pages, make_policy(eviction))
        self._lock = threading.RLock()
        self._inflight: list[tuple[Ticket, callable]] = []
        self._ready = None
        self.counters = Counters()
        self._registry = registry
        self._collector = PoolCollector(self)
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
            for slot in slots:
                if dev.state[slot] != S.FILLING or dev.keys[slot] is not None or not dev.pins[slot]:
                    raise ValueError(
                        f"commit: device slot {slot} must be an allocated, uncommitted slot the engine holds; "
                        f"it is {dev.state[slot].name} with {dev.pins[slot]} holds"
                    )
            self._ready = self.engine.record_ready()
            duplicates_before = self.counters.duplicate_commits
            dirty = []
            table = dev.table
            for key, slot in zip(keys, slots):
                if key in table:
                    self.counters.duplicate_commits += 1
                    continue
                dev.bind(slot, key)
                if host.readable_slot(key) is not None:
                    dev.set_state(slot, S.RESIDENT)
                else:
                    dev.set_state(slot, S.DIRTY)
                    dirty.append(slot)
            if dirty and self.write_policy.copy_on_commit():
                self._copy_down(dirty, evicting=False)
            return len(slots) - (self.counters.duplicate_commits - duplicates_before)

    def match(self, keys) -> MatchResult:
        """Longest leading prefix of `keys` per tier; counts hits for the write policy."""
        keys = list(keys)
        with self._lock:
            self._check_open()
            self._reap()
            dev, host = self._dev, self._host
            d = dev.leading(keys)
            h = host.leading(keys)
            total = max(d, h)
            dtable, htable = dev.table, host.table
            while total < len(keys) and (keys[total] in dtable or keys[total] in htable):
                total += 1
            touched = []
            for key in keys[:d]:
                slot = dtable[key]
                dev.touch(slot)
                touched.append(slot)
            for key in keys[:h]:
                host.touch(htable[key])
            c = self.counters
            c.hits["device"] += d
            c.misses["device"] += len(keys) - d
            c.hits["host"] += h
            c.misses["host"] += len(keys) - h
            self._copy_popular(touched)
            return MatchResult(device=d, host=h, remote=0, total=total)

    def load(self, keys, slots) -> LoadHandle:
        """Bring `keys` into device `slots` (from `allocate`) from wherever they are.

        Returns at once on CUDA; wait on the handle before reading. A key that no tier
        holds raises KeyError before any byte moves.
        """
        keys, slots = self._check_pairs(keys, slots)
        with self._lock:
            self._check_open()
            self._reap()
            dev, host = self._dev, self._host
            for slot in slots:
                if dev.state[slot] != S.FILLING or dev.keys[slot] is not None or not dev.pins[slot]:
                    raise ValueError(
                        f"load: device slot {slot} must be an allocated, uncommitted slot the engine holds; "
                        f"it is {dev.state[slot].name} with {dev.pins[slot]} holds"
                    )
            d_src, d_dst, h_src, h_dst, missing = [], [], [], [], []
            for key, slot in zip(keys, slots):
                src = dev.table.get(key)
                if src is not None:
                    d_src.append(src)
                    d_dst.append(slot)
                    continue
                src = host.readable_slot(key)
                if src is not None:
                    h_src.append(src)
                    h_dst.append((key, slot))
                    continue
                missing.append(key)
            if missing:
                raise KeyError(f"load: {len(missing)} of {len(keys)} keys are in no tier; first missing: {missing[0]!r}")
            tickets = []
            if d_src:
                tickets.append(self._device_copy(d_src, d_dst))
            if h_src:
                tickets.append(self._reload(h_src, h_dst))
            self.counters.hits["device"] += len(d_src)
            return LoadHandle(tickets, self.fmt.num_layers)

    prefetch = load

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

    def flush(self) -> None:
        """Copy every dirty page the write policy keeps to the tier below and wait for all copies."""
        with self._lock:
            self._check_open()
            self._flush()

    def _flush(self) -> None:
        self._reap()
        dev = self._dev
        dirty = [
            slot
            for slot in range(dev.capacity)
            if dev.state[slot] == S.DIRTY and self.write_policy.copy_on_evict(dev.hits[slot])
        ]
        if dirty:
            self._copy_down(dirty, evicting=False)
        self._drain()

    def close(self) -> None:
        """Flush, then release memory and streams. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._flush()
            self._closed = True
            self.engine.close()
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
                "misses": dict(c.misses),
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
        for slot in victims:
            key = host.keys[slot]
            dslot = dev.lookup(key)
            # The device copy, if any, is now the only one: it becomes dirty.
            if dslot is not None and dev.state[dslot] == S.RESIDENT:
                dev.set_state(dslot, S.DIRTY)
            host.set_state(slot, S.FREE)
        self.counters.evictions["host"] += len(victims)
        return len(victims)

    # --- internals: copies -----------------------------------------------------------------
    def _copy_down(self, dev_slots: list[int], evicting: bool) -> list[int]:
        """Offload dirty device pages to host. Returns the device slots whose copy is done
        (evicting: waits for it) or submitted (not evicting)."""
        dev, host = self._dev, self._host
        host_slots = self._take_host(len(dev_slots))
        moving = dev_slots[: len(host_slots)]
        if not moving:
            return []
        for dslot, hslot in zip(moving, host_slots):
            host.bind(hslot, dev.keys[dslot])
            dev.set_state(dslot, S.OFFLOADING)
            dev.hold(dslot)
            host.hold(hslot)
        ticket = self.engine.offload(moving, host_slots, ready=self._ready)

        def finish() -> None:
            for dslot, hslot in zip(moving, host_slots):
                dev.set_state(dslot, S.RESIDENT)
                dev.unhold(dslot)
                host.set_state(hslot, S.RESIDENT)
                host.unhold(hslot)
            self.counters.moved("device_to_host", len(moving), len(moving) * self.fmt.page_bytes)

        self._submit(ticket, finish)
        if evicting:
            self._drain()
        return moving

    def _copy_popular(self, dev_slots: list[int]) -> None:
        """write_through_selective: copy down the dirty pages that just reached enough hits."""
        dev = self._dev
        ready = [s for s in dev_slots if dev.state[s] == S.DIRTY and self.write_policy.copy_on_hit(dev.hits[s])]
        if ready:
            self._copy_down(ready, evicting=False)

    def _reload(self, host_slots: list[int], targets: list[tuple]) -> Ticket:
        dev, host = self._dev, self._host
        dev_slots = [slot for _, slot in targets]
        for (key, dslot), hslot in zip(targets, host_slots):
            dev.set_state(dslot, S.LOADING)
            dev.bind(dslot, key)
            dev.hold(dslot)
            host.hold(hslot)
            host.touch(hslot)
        ticket = self.engine.reload(host_slots, dev_slots)

        def finish() -> None:
            for dslot, hslot in zip(dev_slots, host_slots):
                dev.set_state(dslot, S.RESIDENT)
                dev.unhold(dslot)
                host.unhold(hslot)
            self.counters.moved("host_to_device", len(dev_slots), len(dev_slots) * self.fmt.page_bytes)

        self._submit(ticket, finish)
        return ticket

    def _device_copy(self, src: list[int], dst: list[int]) -> Ticket:
        dev = self._dev
        for s, d in zip(src, dst):
            dev.hold(s)
            dev.hold(d)
            dev.touch(s)
        ticket = self.engine.device_copy(src, dst)

        def finish() -> None:
            for s, d in zip(src, dst):
                dev.unhold(s)
                dev.unhold(d)
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
        still = []
        for ticket, finish in self._inflight:
            if ticket.done():
                finish()
            else:
                still.append((ticket, finish))
        self._inflight = still

    def _drain(self) -> None:
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
