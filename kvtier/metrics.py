"""Pool metrics: plain counters on the hot path, exported to Prometheus at scrape time.

Owns the counter names, the latency histograms and the Prometheus collector. Pools bump plain
ints and fixed-bucket histograms (a few hundred nanoseconds a call, never prometheus-client
objects on the hot path); one `PoolsCollector` per registry turns every live pool's `stats()`
into `kvtier_*` metric families when Prometheus scrapes, labelled by pool, model and rank, so
two pools in one process (a target and a draft model, two ranks) share one registry. It must
never take a pool's lock for longer than one `stats()` call.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import weakref
from collections import defaultdict
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

TIERS = ("device", "host", "remote")
DIRECTIONS = ("device_to_host", "host_to_device", "device_to_device", "host_to_remote", "remote_to_host")
DROP_REASONS = ("selective", "remote_unavailable", "not_encodable", "close")
CALLS = ("load", "commit", "match")
REMOTE_OPS = ("remote_get", "remote_put")
# Seconds, 50 us to 5 s. Few buckets on purpose: prometheus-client formats about 6 µs a sample,
# and the histograms are most of what a scrape exports.
LATENCY_BUCKETS = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 10e-3, 50e-3, 0.25, 1.0, 5.0)
STORE_COUNTERS = (
    "hits", "misses", "corrupt_reads", "raced_reads", "read_failures", "write_failures", "rejected_writes",
    "evictions", "bytes_written", "bytes_read",
)
STORE_GAUGES = ("pages", "used_bytes", "store_pages", "store_used_bytes", "capacity_bytes")

_pool_ids = itertools.count()


class Histogram:
    """Counts of observations per bucket (cumulative only when exported) and their sum."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.sum += seconds

    def snapshot(self) -> tuple[list[int], float]:
        return list(self.counts), self.sum


class Counters:
    """Monotonic counters and latency histograms of one pool."""

    def __init__(self) -> None:
        self.hits = defaultdict(int)  # tier -> pages of matched prefixes whose nearest copy is there
        self.misses = 0  # pages asked for past the loadable prefix
        self.pages_moved = defaultdict(int)  # direction -> pages
        self.bytes_moved = defaultdict(int)  # direction -> bytes
        self.evictions = defaultdict(int)  # tier -> pages evicted
        self.dropped = defaultdict(int)  # reason -> dirty pages let go before they were durable
        self.duplicate_commits = 0
        self.remote_failures = defaultdict(int)  # "read" / "write" -> pages a remote job could not move
        self.latency = {name: Histogram() for name in CALLS + REMOTE_OPS}

    def moved(self, direction: str, pages: int, nbytes: int) -> None:
        self.pages_moved[direction] += pages
        self.bytes_moved[direction] += nbytes


def next_pool_name() -> str:
    return f"pool{next(_pool_ids)}"


# One collector per registry, holding its pools weakly: a pool that is never closed does not
# keep the collector's answer alive.
_collectors: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_collectors_lock = threading.Lock()


def register_pool(registry: object | None, pool: object, name: str | None) -> str:
    """Add `pool` to the registry's kvtier collector (registering it once); returns the pool's
    name, unique among the registry's pools (`name` if given, else pool0, pool1, ...)."""
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"name must be a non-empty str or None, got {name!r}")
    if registry is None:
        return name or next_pool_name()
    with _collectors_lock:
        collector = _collectors.get(registry)
        if collector is None:
            collector = PoolsCollector()
            registry.register(collector)
            _collectors[registry] = collector
        name = name or next_pool_name()
        if name in collector.pools:
            raise ValueError(f"a pool named {name!r} is already registered with this Prometheus registry")
        collector.pools[name] = pool
    return name


def unregister_pool(registry: object | None, pool: object) -> None:
    if registry is None:
        return
    with _collectors_lock:
        collector = _collectors.get(registry)
        if collector is not None and collector.pools.get(pool.name) is pool:
            del collector.pools[pool.name]


class PoolsCollector(Collector):
    """Exports every registered pool's `stats()` as Prometheus metric families."""

    def __init__(self) -> None:
        self.pools: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def collect(self) -> Iterator[Metric]:
        snapshots = []
        for pool in list(self.pools.values()):
            try:
                snapshots.append((pool.stats(), pool.latency_snapshot(), pool.remote_stats()))
            except RuntimeError:  # closed between the listing and the call
                continue
        yield from _families(snapshots)


def _families(snapshots):
    base = ["pool", "model", "rank"]

    def labels(s):
        return [s["pool"], s["model"], str(s["rank"])]

    def counter(name, doc, extra=()):
        return CounterMetricFamily(name, doc, labels=base + list(extra))

    def gauge(name, doc, extra=()):
        return GaugeMetricFamily(name, doc, labels=base + list(extra))

    hits = counter("kvtier_hits", "Pages of matched prefixes, by the nearest tier holding them (MatchResult)", ["tier"])
    misses = counter("kvtier_misses", "Pages asked for past the loadable prefix")
    evictions = counter("kvtier_evictions", "Pages evicted from a tier", ["tier"])
    pages = counter("kvtier_pages_moved", "Pages copied between tiers", ["direction"])
    nbytes = counter("kvtier_bytes_moved", "Bytes copied between tiers", ["direction"])
    dropped = counter("kvtier_dropped_pages", "Dirty pages let go before they were durable, by reason", ["reason"])
    failures = counter("kvtier_remote_failures", "Remote tier pages a remote job could not move", ["op"])
    states = gauge("kvtier_pages", "Slots per tier and page state", ["tier", "state"])
    held = gauge("kvtier_held_pages", "Device slots the engine holds")
    inflight = gauge("kvtier_inflight_copies", "Copies and remote jobs in flight")
    queue = gauge("kvtier_backup_queue_pages", "Host pages waiting to be written to the remote tier")
    breaker = gauge("kvtier_remote_breaker_state", "Remote write circuit breaker: 0 closed (healthy), 1 open, 2 half open")
    opened = counter("kvtier_remote_breaker_opens", "Times remote writes started failing")
    latency = HistogramMetricFamily(
        "kvtier_call_seconds", "Time of pool calls, and of remote jobs from submission to done", labels=base + ["op"]
    )
    store_counters = {
        name: counter(f"kvtier_remote_store_{name}", f"Remote page store counter {name}") for name in STORE_COUNTERS
    }
    store_gauges = {name: gauge(f"kvtier_remote_store_{name}", f"Remote page store gauge {name}") for name in STORE_GAUGES}
    states_code = {"closed": 0, "open": 1, "half_open": 2}
    for s, hist, store in snapshots:
        lab = labels(s)
        for tier in TIERS:
            hits.add_metric(lab + [tier], s["hits"].get(tier, 0))
            evictions.add_metric(lab + [tier], s["evictions"].get(tier, 0))
        misses.add_metric(lab, s["misses"])
        for d in DIRECTIONS:
            pages.add_metric(lab + [d], s["pages_moved"].get(d, 0))
            nbytes.add_metric(lab + [d], s["bytes_moved"].get(d, 0))
        for reason in DROP_REASONS:
            dropped.add_metric(lab + [reason], s["dropped"].get(reason, 0))
        for op in ("read", "write"):
            failures.add_metric(lab + [op], s["remote_failures"].get(op, 0))
        for tier in ("device", "host"):
            for state, count in s["states"][tier].items():
                states.add_metric(lab + [tier, state], count)
        held.add_metric(lab, s["held"]["device"])
        inflight.add_metric(lab, s["inflight"])
        queue.add_metric(lab, s["backup_queue"])
        breaker.add_metric(lab, states_code[s["remote_breaker"]])
        opened.add_metric(lab, s["remote_breaker_opened"])
        for op, (counts, total) in hist.items():
            cumulative, buckets = 0, []
            for bound, count in zip(LATENCY_BUCKETS + (float("inf"),), counts):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            latency.add_metric(lab + [op], buckets, total)
        if store:
            for name, fam in store_counters.items():
                fam.add_metric(lab, store.get(name, 0))
            for name, fam in store_gauges.items():
                fam.add_metric(lab, store.get(name, 0))
    yield from (hits, misses, evictions, pages, nbytes, dropped, failures, states, held, inflight, queue, breaker, opened,
                latency)
    if any(store for _, _, store in snapshots):
        yield from store_counters.values()
        yield from store_gauges.values()
