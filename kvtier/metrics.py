"""Pool metrics: plain counters on the hot path, exported to Prometheus at scrape time.

Owns the counter names, the latency histograms and the Prometheus collector. Pools bump plain
ints and fixed-bucket histograms (a few hundred nanoseconds a call, never prometheus-client
objects on the hot path); one `PoolsCollector` per registry turns every live pool's `stats()`
into `kvtier_*` metric families when Prometheus scrapes, labelled by pool, model and rank, so
two pools in one process (a target and a draft model, two ranks) share one registry. It must
never take a pool's lock for longer than one `stats()` call. A pool's series (sample names,
label dicts, text lines up to the value) are built once and reused by every scrape.
prometheus-client formats each sample in Python, several µs a sample, so `exposition` renders the
same text (byte for byte) from the same snapshots, for engines that serve kvtier's metrics on an
endpoint of their own.

What a pool exports (`_FAMILIES`): hits and evictions per tier, misses, pages and bytes moved per
direction, dirty pages dropped per reason, slots per tier and page state, held slots, copies in
flight, and the `kvtier_call_seconds` histograms of load, commit and match. Series only a remote
tier can move are exported only for a pool with one (`remote=`): `tier="remote"` hits, the
directions to and from it, `reason="remote_unavailable"`, `kvtier_remote_failures`, the backup
queue, the circuit breaker, the `remote_get`/`remote_put` histograms and the store's own
`kvtier_remote_store_*` counters and gauges (the latter while the store answers). Evictions from
the remote tier are the store's (`kvtier_remote_store_evictions_total`). A family no pool has a
series of is left out. Names are as Prometheus shows them: counters end in `_total`; the store's
gauges are `kvtier_remote_store_pages` / `_used_bytes` (the whole store), `_namespace_pages` /
`_namespace_used_bytes` (this pool's namespace) and `_capacity_bytes`. A pool with the cluster tier (Mooncake Store, `cluster=`) adds
`kvtier_tier_*{tier="cluster"}`: reads by outcome (hit, miss, corrupt, failed, skipped while its
breaker is open), writes by outcome, bytes, seconds in its calls, its breaker's state and opens.
Every HELP text is written here, never generated.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

from prometheus_client.core import Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

TIERS = ("device", "host", "remote")
DIRECTIONS = ("device_to_host", "host_to_device", "device_to_device", "host_to_remote", "remote_to_host")
DROP_REASONS = ("selective", "remote_unavailable", "not_encodable", "close")
CALLS = ("load", "commit", "match")
REMOTE_OPS = ("remote_get", "remote_put")
# Seconds, 50 us to 5 s. Few buckets on purpose: prometheus-client formats about 6 µs a sample,
# and the histograms are most of what a scrape exports.
LATENCY_BUCKETS = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 10e-3, 50e-3, 0.25, 1.0, 5.0)
# The remote store's own series: (family name after kvtier_remote_store_, stats() key, HELP text).
STORE_COUNTERS_HELP = {
    "hits": "Pages the store read back whole and verified (header, CRC32C, MAC)",
    "misses": "Pages asked of the store that it did not hold",
    "corrupt_reads": "Pages whose record failed its header, CRC32C or MAC check; each left the index",
    "raced_reads": "Pages rewritten or removed while they were read (a miss, nothing dropped)",
    "read_failures": "Pages whose read request or segment file failed; each left the index",
    "write_failures": "Pages whose write request failed or timed out",
    "rejected_writes": "Pages the store had no room for, even after evicting",
    "evictions": "Pages the store evicted to stay under its capacity (every namespace's)",
    "bytes_written": "Payload bytes written to the store",
    "bytes_read": "Payload bytes read from the store",
}
STORE_COUNTERS = tuple(STORE_COUNTERS_HELP)
STORE_GAUGES = (
    ("namespace_pages", "pages", "Pages the store holds of this pool's namespace (model, page format, rank)"),
    ("namespace_used_bytes", "used_bytes", "Payload bytes the store holds of this pool's namespace"),
    ("pages", "store_pages", "Pages the store holds, every namespace"),
    ("used_bytes", "store_used_bytes", "Payload bytes the store holds, every namespace"),
    ("capacity_bytes", "capacity_bytes", "Payload bytes the store may hold before it evicts"),
)

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
        yield from _metrics(_snapshots(list(self.pools.values())))


class _Family(NamedTuple):
    """One exported metric family: its series per pool (`keys`: the values of `labels` besides
    pool, model and rank, one tuple a series) and how a snapshot gives their values (`read`: one
    value a key, fourteen a key for a histogram)."""

    name: str  # a counter's samples are named `name`_total, a histogram's `name`_bucket/_count/_sum
    type: str
    doc: str
    labels: tuple[str, ...]
    keys: Callable[[dict, bool], tuple[tuple[str, ...], ...]]
    read: Callable[[dict, dict, dict, tuple], list]
    store: bool | str = False  # the remote store's own counters: exported while the store answers;
    # a name: the counters of that tier behind the remote link (store[name]), exported while it has them


_ONE = ((),)  # a family with one series a pool and no labels of its own
_STATE_CODE = {"closed": 0, "open": 1, "half_open": 2}
_LE = tuple(repr(bound) for bound in LATENCY_BUCKETS) + ("+Inf",)


def _read_histograms(s, hist, store, keys) -> list:
    out = []
    for (op,) in keys:
        counts, total = hist[op]
        cumulative = list(itertools.accumulate(counts))
        out += cumulative
        out.append(cumulative[-1])
        out.append(total)
    return out


def _remote_only(s: dict, remote: bool) -> tuple[tuple[str, ...], ...]:
    return _ONE if remote else ()


def _store_family(name: str, key: str, typ: str, doc: str) -> _Family:
    return _Family(f"kvtier_remote_store_{name}", typ, doc, (), _remote_only,
                   lambda s, hist, store, keys: [store.get(key, 0)], store=True)


def _cluster_family(name: str, typ: str, doc: str, label: str, stats: dict[str, str]) -> _Family:
    """A family of the cluster tier's counters (kvtier.tiers.cluster), tier="cluster"; `stats`
    maps each value of `label` to its counter."""
    if not label:
        return _Family(name, typ, doc, ("tier",), lambda s, remote: (("cluster",),) if remote else (),
                       lambda s, hist, store, keys: [store["cluster"][stats[""]]], store="cluster")
    return _Family(name, typ, doc, ("tier", label),
                   lambda s, remote: tuple(("cluster", v) for v in stats) if remote else (),
                   lambda s, hist, store, keys: [store["cluster"][stats[v]] for _, v in keys], store="cluster")


_CLUSTER_FAMILIES = (
    _cluster_family("kvtier_tier_reads", "counter", "Pages a tier behind the remote link was asked for, by outcome",
                    "outcome", {"hit": "hits", "miss": "misses", "corrupt": "corrupt_reads", "failed": "read_failures",
                                "skipped": "skipped_reads"}),
    _cluster_family("kvtier_tier_writes", "counter", "Pages written to a tier behind the remote link, by outcome",
                    "outcome", {"written": "pages_written", "failed": "write_failures", "skipped": "skipped_writes"}),
    _cluster_family("kvtier_tier_bytes", "counter", "Bytes a tier behind the remote link moved (records)", "op",
                    {"read": "bytes_read", "write": "bytes_written"}),
    _cluster_family("kvtier_tier_seconds", "counter", "Seconds spent in a tier's batched calls", "op",
                    {"get": "get_seconds", "put": "put_seconds", "exists": "exists_seconds"}),
    _cluster_family("kvtier_tier_breaker_state", "gauge", "A tier's circuit breaker: 0 closed (healthy), 1 open, 2 half open",
                    "", {"": "breaker_code"}),
    _cluster_family("kvtier_tier_breaker_opens", "counter", "Times a tier's calls started failing", "",
                    {"": "breaker_opens"}),
)


_FAMILIES: tuple[_Family, ...] = (
    _Family("kvtier_hits", "counter", "Pages of matched prefixes, by the nearest tier holding them (MatchResult)",
            ("tier",), lambda s, remote: tuple((t,) for t in TIERS if remote or t != "remote"),
            lambda s, hist, store, keys: [s["hits"].get(k, 0) for (k,) in keys]),
    _Family("kvtier_misses", "counter", "Pages asked for past the loadable prefix", (), lambda s, remote: _ONE,
            lambda s, hist, store, keys: [s["misses"]]),
    _Family("kvtier_evictions", "counter", "Pages evicted from a tier", ("tier",),
            lambda s, remote: (("device",), ("host",)),
            lambda s, hist, store, keys: [s["evictions"].get(k, 0) for (k,) in keys]),
    _Family("kvtier_pages_moved", "counter", "Pages copied between tiers", ("direction",),
            lambda s, remote: tuple((d,) for d in DIRECTIONS if remote or "remote" not in d),
            lambda s, hist, store, keys: [s["pages_moved"].get(k, 0) for (k,) in keys]),
    _Family("kvtier_bytes_moved", "counter", "Bytes copied between tiers", ("direction",),
            lambda s, remote: tuple((d,) for d in DIRECTIONS if remote or "remote" not in d),
            lambda s, hist, store, keys: [s["bytes_moved"].get(k, 0) for (k,) in keys]),
    _Family("kvtier_dropped_pages", "counter", "Dirty pages let go before they were durable, by reason", ("reason",),
            lambda s, remote: tuple((r,) for r in DROP_REASONS if remote or r != "remote_unavailable"),
            lambda s, hist, store, keys: [s["dropped"].get(k, 0) for (k,) in keys]),
    _Family("kvtier_remote_failures", "counter", "Remote tier pages a remote job could not move", ("op",),
            lambda s, remote: (("read",), ("write",)) if remote else (),
            lambda s, hist, store, keys: [s["remote_failures"].get(k, 0) for (k,) in keys]),
    _Family("kvtier_pages", "gauge", "Slots per tier and page state", ("tier", "state"),
            lambda s, remote: tuple((t, state) for t in ("device", "host") for state in s["states"][t]),
            lambda s, hist, store, keys: [s["states"][t][state] for t, state in keys]),
    _Family("kvtier_held_pages", "gauge", "Device slots the engine holds", (), lambda s, remote: _ONE,
            lambda s, hist, store, keys: [s["held"]["device"]]),
    _Family("kvtier_inflight_copies", "gauge", "Copies and remote jobs in flight", (), lambda s, remote: _ONE,
            lambda s, hist, store, keys: [s["inflight"]]),
    _Family("kvtier_backup_queue_pages", "gauge", "Host pages waiting to be written to the remote tier", (),
            _remote_only, lambda s, hist, store, keys: [s["backup_queue"] for _ in keys]),
    _Family("kvtier_remote_breaker_state", "gauge",
            "Remote write circuit breaker: 0 closed (healthy), 1 open, 2 half open", (), _remote_only,
            lambda s, hist, store, keys: [_STATE_CODE[s["remote_breaker"]] for _ in keys]),
    _Family("kvtier_remote_breaker_opens", "counter", "Times remote writes started failing", (), _remote_only,
            lambda s, hist, store, keys: [s["remote_breaker_opened"] for _ in keys]),
    _Family("kvtier_call_seconds", "histogram", "Time of pool calls, and of remote jobs from submission to done",
            ("op",), lambda s, remote: tuple((op,) for op in CALLS + (REMOTE_OPS if remote else ())), _read_histograms),
    *(_store_family(name, name, "counter", STORE_COUNTERS_HELP[name]) for name in STORE_COUNTERS),
    *(_store_family(name, key, "gauge", doc) for name, key, doc in STORE_GAUGES),
    *_CLUSTER_FAMILIES,
)


class _Layout:
    """A pool's series, built once: per family, the sample names and label dicts handed to
    prometheus-client, the same samples' text lines up to their value (`exposition`), and their
    keys. A pool's labels never change, so neither does this."""

    __slots__ = ("keys", "labels", "lines", "names")

    def __init__(self, s: dict, remote: bool) -> None:
        base = {"pool": s["pool"], "model": s["model"], "rank": str(s["rank"])}
        self.keys, self.names, self.labels = [], [], []
        for fam in _FAMILIES:
            keys = fam.keys(s, remote)
            names, labels = [], []
            for key in keys:
                series = {**base, **dict(zip(fam.labels, key))}
                if fam.type == "histogram":
                    names += [f"{fam.name}_bucket"] * len(_LE) + [f"{fam.name}_count", f"{fam.name}_sum"]
                    labels += [{**series, "le": le} for le in _LE] + [series, series]
                else:
                    names.append(fam.name + "_total" if fam.type == "counter" else fam.name)
                    labels.append(series)
            self.keys.append(keys)
            self.names.append(names)
            self.labels.append(labels)
        self.lines = [[_line_head(name, series) for name, series in zip(names, labels)]
                      for names, labels in zip(self.names, self.labels)]


_layouts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # pool -> _Layout


def _snapshots(pools) -> list[tuple[_Layout, dict, dict, dict]]:
    """Each open pool's layout, `stats()`, latency histograms and remote store counters."""
    out = []
    for pool in pools:
        try:
            s, hist, store = pool.stats(), pool.latency_snapshot(), pool.remote_stats()
        except RuntimeError:  # closed between the listing and the call
            continue
        layout = _layouts.get(pool)
        if layout is None:
            layout = _layouts[pool] = _Layout(s, getattr(pool, "remote", None) is not None)
        out.append((layout, s, hist, store))
    return out


def _exported(fam: _Family, store: dict) -> bool:
    if fam.store is False:
        return True
    return bool(store) if fam.store is True else fam.store in store


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def _line_head(name: str, labels: dict[str, str]) -> str:
    """A sample's line in the text format up to its value, as prometheus-client writes it."""
    return name + "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items())) + "} "


def _header(fam: _Family) -> str:
    name = fam.name + "_total" if fam.type == "counter" else fam.name
    doc = fam.doc.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {name} {doc}\n# TYPE {name} {fam.type}\n"


_HEADERS = tuple(_header(fam) for fam in _FAMILIES)


def _value(v: float) -> str:
    """prometheus-client's float formatting (Go's), with whole numbers below a million short-cut."""
    if type(v) is int and -1_000_000 < v < 1_000_000:
        return f"{v}.0"
    return floatToGoString(v)


def exposition(source: CollectorRegistry | Iterable[object]) -> bytes:
    """kvtier's metrics in the Prometheus text format, rendered here instead of by prometheus-client:
    the families, HELP and TYPE lines, samples and values `generate_latest` writes for them, in the
    same order, at a fraction of its cost a sample. `source` is a registry (the pools registered
    with it, and nothing else of it) or the pools themselves (any registry, or none). For an engine
    that serves kvtier's metrics on an endpoint of its own; not with `generate_latest` of the same
    registry on the same endpoint, which would export every series twice."""
    if isinstance(source, CollectorRegistry):
        collector = _collectors.get(source)
        pools = list(collector.pools.values()) if collector is not None else []
    else:
        pools = list(source)
    out = []
    snapshots = _snapshots(pools)
    for i, fam in enumerate(_FAMILIES):
        lines = []
        for layout, s, hist, store in snapshots:
            keys = layout.keys[i]
            if keys and _exported(fam, store):
                lines += [f"{head}{_value(v)}\n" for head, v in zip(layout.lines[i], fam.read(s, hist, store, keys))]
        if lines:
            out.append(_HEADERS[i])
            out += lines
    return "".join(out).encode()


def _metrics(snapshots) -> Iterator[Metric]:
    for i, fam in enumerate(_FAMILIES):
        samples = []
        for layout, s, hist, store in snapshots:
            keys = layout.keys[i]
            if keys and _exported(fam, store):
                samples += map(Sample, layout.names[i], layout.labels[i], fam.read(s, hist, store, keys))
        if samples:
            metric = Metric(fam.name, fam.doc, fam.type)
            metric.samples = samples
            yield metric
