"""When does a long write-through commit's first copy start? (CPU, no GPU needed.)

A pool over an engine that queues its copies and moves no bytes (as the CUDA engine's host side
looks to the pool), host tier full of clean pages after the first rounds: each round commits N
fresh pages and flushes. Prints the medians of the time from the commit call to the engine's
first offload call, to commit's return, and to flush's return. Give a checkout to time another
revision (it is put first on the path).

    python scripts/commit_first_copy.py [CHECKOUT] [--pages 2048] [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("checkout", nargs="?", default=str(Path(__file__).resolve().parents[1]))
ap.add_argument("--pages", type=int, default=2048)
ap.add_argument("--rounds", type=int, default=30)
args = ap.parse_args()
sys.path.insert(0, args.checkout)

import numpy as np  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from kvtier import PageFormat, TieredPool, prefix_keys  # noqa: E402
from kvtier.transfer.engine import DoneTicket, TransferEngine  # noqa: E402


class QueueingNoCopy(TransferEngine):
    name = "no-copy"
    queues_copies = True

    def __init__(self, device_tier, host_tier) -> None:
        self.num_layers = device_tier.fmt.num_layers
        self.calls: list[float] = []

    def offload(self, device_slots, host_slots, ready=None):
        self.calls.append(time.perf_counter())
        return DoneTicket(self.num_layers)

    def reload(self, host_slots, device_slots, ready=None):
        return DoneTicket(self.num_layers)

    def device_copy(self, src_slots, dst_slots):
        return DoneTicket(self.num_layers)


n = args.pages
fmt = PageFormat(num_layers=1, num_kv_heads=1, head_dim=16, page_size=1, dtype="fp8_e4m3", scale="per_tensor")
pool = TieredPool(fmt, device_pages=n + 8, host_pages=3 * n, write_policy="write_through", engine=QueueingNoCopy,
                  registry=CollectorRegistry())
first, returned, flushed, copies = [], [], [], 0
try:
    for r in range(args.rounds):
        keys = prefix_keys(np.arange(r * n, (r + 1) * n) % 2**31, 1, pool.namespace)
        slots = pool.allocate(n)
        pool.engine.calls.clear()
        t0 = time.perf_counter()
        pool.commit(keys, slots)
        t1 = time.perf_counter()
        pool.flush()
        t2 = time.perf_counter()
        first.append(pool.engine.calls[0] - t0)
        returned.append(t1 - t0)
        flushed.append(t2 - t0)
        copies = len(pool.engine.calls)
        pool.release(slots)
        pool.evict(n)
finally:
    pool.close()
us = lambda xs: statistics.median(xs) * 1e6  # noqa: E731
print(f"{args.checkout}: {n} pages, first copy {us(first):.0f} us, commit returns {us(returned):.0f} us, "
      f"flushed {us(flushed):.0f} us, {copies} copies a commit")
