"""Pool metrics: plain counters on the hot path, exported to Prometheus at scrape time.

Owns the counter names and the Prometheus collector. The pool bumps plain ints (a dict
add per batch, never per page through prometheus-client); `PoolCollector` turns them into
`kvtier_*` metric families when Prometheus scrapes. It must never take the pool's lock
for longer than one `stats()` call.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

TIERS = ("device", "host", "remote")
DIRECTIONS = ("device_to_host", "host_to_device", "device_to_device", "host_to_remote", "remote_to_host")

_pool_ids = itertools.count()


def next_pool_name() -> str:
    return f"pool{next(_pool_ids)}"


class Counters:
    """Monotonic counters of one pool."""

    def __init__(self) -> None:
        self.hits = defaultdict(int)  # tier -> pages of matched prefixes that tier serves (nearest first)
        self.misses = 0  # pages asked for past the loadable prefix
        self.pages_moved = defaultdict(int)  # direction -> pages
        self.bytes_moved = defaultdict(int)  # direction -> bytes
        self.evictions = defaultdict(int)  # tier -> pages evicted
        self.dropped = 0  # dirty pages dropped by write_through_selective
        self.duplicate_commits = 0
        self.remote_failures = defaultdict(int)  # "read" / "write" -> failed pages

    def moved(self, direction: str, pages: int, nbytes: int) -> None:
        self.pages_moved[direction] += pages
        self.bytes_moved[direction] += nbytes


class PoolCollector(Collector):
    """Exports one pool's `stats()` as Prometheus metric families labelled by pool."""

    def __init__(self, pool) -> None:
        self.pool = pool

    def collect(self):
        s = self.pool.stats()
        name = s["pool"]
        fams = {
            "hits": CounterMetricFamily(
                "kvtier_hits", "Pages of matched prefixes, by the nearest tier holding them", labels=["pool", "tier"]
            ),
            "evictions": CounterMetricFamily("kvtier_evictions", "Pages evicted from a tier", labels=["pool", "tier"]),
        }
        for field, fam in fams.items():
            for tier in TIERS:
                fam.add_metric([name, tier], s[field].get(tier, 0))
            yield fam
        misses = CounterMetricFamily("kvtier_misses", "Pages asked for past the loadable prefix", labels=["pool"])
        misses.add_metric([name], s["misses"])
        yield misses
        pages = CounterMetricFamily("kvtier_pages_moved", "Pages copied between tiers", labels=["pool", "direction"])
        nbytes = CounterMetricFamily("kvtier_bytes_moved", "Bytes copied between tiers", labels=["pool", "direction"])
        for d in DIRECTIONS:
            pages.add_metric([name, d], s["pages_moved"].get(d, 0))
            nbytes.add_metric([name, d], s["bytes_moved"].get(d, 0))
        yield pages
        yield nbytes
        dropped = CounterMetricFamily("kvtier_dropped_pages", "Dirty pages dropped by write_through_selective", labels=["pool"])
        dropped.add_metric([name], s["dropped"])
        yield dropped
        failures = CounterMetricFamily("kvtier_remote_failures", "Remote tier pages that failed to move", labels=["pool", "op"])
        for op in ("read", "write"):
            failures.add_metric([name, op], s["remote_failures"].get(op, 0))
        yield failures
        states = GaugeMetricFamily("kvtier_pages", "Slots per tier and page state", labels=["pool", "tier", "state"])
        for tier in ("device", "host"):
            for state, count in s["states"][tier].items():
                states.add_metric([name, tier, state], count)
        yield states
