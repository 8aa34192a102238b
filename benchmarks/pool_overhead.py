"""Host-side bookkeeping cost per page of commit, match and load, with byte copies left out.

The pool runs on the CPU stand-in with an engine that moves no bytes, so what is timed is
the index work alone: key tables, page states, holds, eviction order and write policy.
Target: <= 2 us per page at batch 4096 (a GPU moving 64 KiB pages at 50 GB/s handles about
760k pages a second; the bookkeeping must never be the bottleneck).

    python benchmarks/pool_overhead.py [--batch 4096] [--repeat 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from prometheus_client import CollectorRegistry

from kvtier import PageFormat, TieredPool, prefix_keys
from kvtier.transfer import DoneTicket, TransferEngine


class NoCopyEngine(TransferEngine):
    """Completes every copy at once without touching bytes: isolates the bookkeeping."""

    name = "no-copy"

    def __init__(self, device_tier, host_tier) -> None:
        self.num_layers = device_tier.fmt.num_layers

    def offload(self, device_slots, host_slots, ready=None):
        return DoneTicket(self.num_layers)

    def reload(self, host_slots, device_slots, ready=None):
        return DoneTicket(self.num_layers)

    def device_copy(self, src_slots, dst_slots):
        return DoneTicket(self.num_layers)


def one_round(batch: int, policy: str, seed: int) -> dict[str, float]:
    fmt = PageFormat(num_layers=2, num_kv_heads=1, head_dim=16, page_size=16, dtype="fp8_e4m3", scale="per_page_head")
    pool = TieredPool(
        fmt, device_pages=2 * batch, host_pages=4 * batch, write_policy=policy, engine=NoCopyEngine, registry=CollectorRegistry()
    )
    keys = prefix_keys(list(range(seed, seed + batch * fmt.page_size)), fmt.page_size, pool.namespace)
    out = {}
    slots = pool.allocate(batch)
    t = time.perf_counter()
    pool.commit(keys, slots)
    out["commit"] = time.perf_counter() - t
    pool.release(slots)
    t = time.perf_counter()
    m = pool.match(keys)
    out["match"] = time.perf_counter() - t
    assert m.total == batch
    pool.flush()
    pool.evict(tier="device")
    targets = pool.allocate(batch)
    t = time.perf_counter()
    pool.load(keys, targets).wait()
    out["load"] = time.perf_counter() - t
    pool.release(targets)
    t = time.perf_counter()
    pool.allocate(batch)
    out["allocate"] = time.perf_counter() - t
    pool.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results = {}
    for policy in ("write_through", "write_back"):
        rounds = [one_round(args.batch, policy, seed=i * 1_000_003) for i in range(args.repeat)]
        for op in rounds[0]:
            per_page = statistics.median(r[op] for r in rounds) / args.batch * 1e6
            results[f"{policy}/{op}"] = per_page
    print(f"kvtier pool bookkeeping, batch {args.batch}, median of {args.repeat} (us per page, no byte copies)")
    print(f"{'policy/op':<28}{'us/page':>10}{'target':>10}")
    for name, us in results.items():
        target = "<= 2.0" if name.split("/")[1] in ("commit", "match", "load") else ""
        print(f"{name:<28}{us:>10.3f}{target:>10}")
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "batch": args.batch,
        "us_per_page": results,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(meta, f, indent=2)


if __name__ == "__main__":
    main()
