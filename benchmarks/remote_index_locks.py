"""How long the remote store's index holds its locks, and what its hot queries cost.

Drives ``RemoteIndex`` directly on a real SQLite file (no page bytes move: the index never
moves any), the way ``RemoteStore`` calls it:
- a large eviction: the store is filled with ``--pages`` pages, then one ``reserve`` under a
  capacity that forces about half of them out; reported: pages evicted, wall time, index
  transactions, and the longest hold of the index lock (which spans SQLite's write lock: every
  write transaction runs inside it), with the CPU time of the longest-CPU hold beside it (on a
  shared machine a holder also waits for a CPU; the load average goes into the JSON);
- the same eviction with every row in one transaction (no row or time bound), as the store
  did before eviction was bounded;
- the longest hold during a publish, a delete and a clear of ``--batch`` pages and a flush of
  that many LRU hits;
- ``present`` (``RemoteStore.contains_ids``) of 2,048 ids, half present, and ``stats``, each the
  median of 21 calls, at the filled size.

    python benchmarks/remote_index_locks.py --pages 100000 --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a source checkout too

from kvtier.index.keys import key_ids  # noqa: E402
from kvtier.tiers.remote import index as remote_index  # noqa: E402
from kvtier.tiers.remote.index import PublishEntry, RemoteIndex, make_owner  # noqa: E402
from kvtier.tiers.remote.records import namespace_fingerprint  # noqa: E402

PAGE = 64 << 10
BOUNDS = (remote_index.ROWS_PER_TRANSACTION, remote_index.TRANSACTION_BUDGET_S)
NS = namespace_fingerprint("be9c4e1a")


def open_index(directory: str) -> RemoteIndex:
    return RemoteIndex(
        os.path.join(directory, "index.sqlite3"), owner=make_owner("bench"),
        reuse_delay_s=0.0, reservation_lease_s=600.0, busy_timeout_s=30.0,
    )


def reserve(index: RemoteIndex, count: int, capacity: int | None):
    return index.reserve(
        count, length=PAGE, slot_stride=PAGE, slots_per_segment=16384, capacity_bytes=capacity,
        high_watermark=0.95, low_watermark=0.85, create_segment=lambda *a: None,
    )


def fill(index: RemoteIndex, keys: list[bytes], batch: int) -> None:
    for start in range(0, len(keys), batch):
        chunk = keys[start : start + batch]
        slots = reserve(index, len(chunk), None).slots
        index.publish(NS, [PublishEntry(k, s, PAGE, 0, 1) for k, s in zip(chunk, slots)])


class Transactions:
    """Counts COMMITs on the index's write connection."""

    def __init__(self, index: RemoteIndex):
        self.count = 0
        index._db.set_trace_callback(self._seen)

    def _seen(self, statement: str) -> None:
        self.count += statement == "COMMIT"


def timed_hold(index: RemoteIndex, fn) -> tuple[float, float, float]:
    """(longest lock hold, most CPU time in one hold, wall time) of ``fn()``, in ms."""
    index.longest_hold_s = index.longest_hold_cpu_s = 0.0
    start = time.perf_counter()
    fn()
    return (index.longest_hold_s * 1e3, index.longest_hold_cpu_s * 1e3,
            (time.perf_counter() - start) * 1e3)


def eviction(directory: str, pages: int, batch: int, bounded: bool) -> dict:
    remote_index.ROWS_PER_TRANSACTION = BOUNDS[0] if bounded else 10 * pages
    remote_index.TRANSACTION_BUDGET_S = BOUNDS[1] if bounded else float("inf")
    index = open_index(directory)
    keys = key_ids(f"page-{i}" for i in range(pages))
    fill(index, keys, batch)
    transactions = Transactions(index)
    evicted = []
    hold, cpu, wall = timed_hold(
        index, lambda: evicted.append(reserve(index, 1, capacity=pages * PAGE // 2).evicted)
    )
    index.close()
    return {"rows_per_transaction": remote_index.ROWS_PER_TRANSACTION,
            "budget_s": remote_index.TRANSACTION_BUDGET_S, "pages": pages, "evicted": evicted[0],
            "transactions": transactions.count, "longest_hold_ms": hold,
            "longest_hold_cpu_ms": cpu, "wall_ms": wall}


def operations(directory: str, pages: int, batch: int) -> dict:
    index = open_index(directory)
    keys = key_ids(f"page-{i}" for i in range(pages))
    fill(index, keys, batch)
    fresh = key_ids(f"fresh-{i}" for i in range(batch))
    slots = reserve(index, batch, None).slots
    result = {}
    result["publish"] = timed_hold(
        index, lambda: index.publish(NS, [PublishEntry(k, s, PAGE, 0, 1) for k, s in zip(fresh, slots)])
    )
    rng = random.Random(0)
    hits = rng.sample(keys, batch)
    index.touch(NS, hits)
    result["flush_touches"] = timed_hold(index, index.flush_touches)
    result["delete"] = timed_hold(index, lambda: index.delete(NS, fresh))
    probe = rng.sample(keys, 1024) + key_ids(f"absent-{i}" for i in range(1024))
    samples = []
    for _ in range(21):
        start = time.perf_counter()
        index.present(NS, probe, PAGE)
        samples.append((time.perf_counter() - start) * 1e3)
    result["contains_ids_2048_ms"] = statistics.median(samples)
    samples = []
    for _ in range(21):
        start = time.perf_counter()
        index.stats(NS)
        samples.append((time.perf_counter() - start) * 1e3)
    result["stats_ms"] = statistics.median(samples)
    result["clear"] = timed_hold(index, lambda: index.clear(NS))
    index.close()
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--pages", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for name, bounded in (("bounded", True), ("one transaction", False)):
            directory = os.path.join(root, name.replace(" ", "-"))
            os.mkdir(directory)
            rows.append(dict(eviction(directory, args.pages, args.batch, bounded), mode=name))
        remote_index.ROWS_PER_TRANSACTION, remote_index.TRANSACTION_BUDGET_S = BOUNDS
        directory = os.path.join(root, "operations")
        os.mkdir(directory)
        ops = operations(directory, args.pages, args.batch)
        small = os.path.join(root, "small")
        os.mkdir(small)
        ops_small = operations(small, 2048, 512)
    print(f"eviction of a store of {args.pages} pages down to half its capacity")
    print(f"{'mode':>16} | {'evicted':>7} {'transactions':>12} {'longest hold ms':>15} "
          f"{'its CPU ms':>10} {'wall ms':>8}")
    for r in rows:
        print(f"{r['mode']:>16} | {r['evicted']:7d} {r['transactions']:12d} "
              f"{r['longest_hold_ms']:15.2f} {r['longest_hold_cpu_ms']:10.2f} {r['wall_ms']:8.1f}")
    print(f"\nbatches of {args.batch} pages in a store of {args.pages} pages: "
          "longest hold / most CPU in one hold / wall, ms")
    for op in ("publish", "flush_touches", "delete", "clear"):
        hold, cpu, wall = ops[op]
        print(f"{op:>16} | {hold:7.2f} / {cpu:7.2f} / {wall:8.1f}")
    print(f"\ncontains_ids of 2048 ids (half present): {ops['contains_ids_2048_ms']:.2f} ms at "
          f"{args.pages} pages, {ops_small['contains_ids_2048_ms']:.2f} ms at 2048 pages")
    print(f"stats(): {ops['stats_ms'] * 1e3:.0f} us at {args.pages} pages, "
          f"{ops_small['stats_ms'] * 1e3:.0f} us at 2048 pages")
    if args.json:
        report = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "sqlite": sqlite3.sqlite_version,
            "load_average": os.getloadavg(),
            "args": vars(args),
            "eviction": rows,
            "operations": ops,
            "operations_2048_pages": ops_small,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
