"""Host-side cost of the pool's calls, with byte copies left out: per page, at full tiers, under
threads, in memory; and the cost of prefix keys.

The pool runs on the CPU stand-in with an engine that moves no bytes (`NoCopyEngine`), so what
is timed is the control plane alone: key tables, page states, holds, eviction order, write
policy, locks. Sections (each can be run alone with --sections):

- batch:   µs per page of commit / match / load / allocate at batch 4096 (pools 2-4x the batch).
- full:    µs per call at full tiers (default 1e6 host pages, 1e5 device pages, both full) for
           batches of 1, 16 and 256: allocate, commit, match, load, evict, release; flush with
           nothing dirty; stats(); a Prometheus scrape by prometheus-client (generate_latest)
           and, where the revision has it, by kvtier.metrics.exposition. Targets: <= 5 µs per
           page + 30 µs per call; flush <= 50 µs; stats and scrape <= 200 µs.
- memory:  bytes of index per host page once the host tier holds 1e6 pages (tracemalloc, with
           the caller's keys freed). Target <= 100 B.
- keys:    prefix_keys tokens per second at page size 1 and 16, one core. Targets >= 2 M and
           >= 10 M tokens/s.
- threads: latency of match(16) alone and while three threads commit, load (remote pages) and
           flush through a real remote tier (NIXL POSIX store in a temp dir). Target p99 <= 200 µs.

    python benchmarks/pool_overhead.py [--sections batch,full,memory,keys,threads]
        [--host-pages 1000000] [--device-pages 100000] [--json out.json]

It runs against any kvtier revision with the same public API, so before/after numbers come from
the same script.
"""

from __future__ import annotations

import argparse
import collections
import gc
import inspect
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

# This checkout's kvtier first (an installed kvtier would otherwise answer an A/B's older copy).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

from kvtier import PageFormat, TieredPool, metrics, prefix_keys  # noqa: E402
from kvtier.transfer import DoneTicket, TransferEngine  # noqa: E402


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


POOL_OPTIONS: dict = {}  # keyword arguments every pool of this run gets (--copies)

TINY = dict(num_layers=1, num_kv_heads=1, head_dim=16, page_size=1, dtype="fp8_e4m3", scale="per_tensor")


def _keys(pool, n: int, seed: int) -> list:
    tokens = np.arange(seed, seed + n, dtype=np.int64) % (2**31)
    return prefix_keys(tokens, 1, pool.namespace)


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


# --- batch ----------------------------------------------------------------------------------
def section_batch(args) -> dict:
    fmt = PageFormat(num_layers=2, num_kv_heads=1, head_dim=16, page_size=16, dtype="fp8_e4m3", scale="per_page_head")
    batch = args.batch
    results: dict[str, float] = {}
    for policy in ("write_through", "write_back"):
        rounds = []
        for r in range(args.repeat):
            pool = TieredPool(fmt, **POOL_OPTIONS, device_pages=2 * batch, host_pages=4 * batch, write_policy=policy,
                              engine=NoCopyEngine, registry=CollectorRegistry())
            keys = prefix_keys(np.arange(r * 1_000_003, r * 1_000_003 + batch * 16) % 2**31, 16, pool.namespace)
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
            rounds.append(out)
        for op in rounds[0]:
            results[f"{policy}/{op}"] = statistics.median(r[op] for r in rounds) / batch * 1e6
    print(f"\n== batch {batch}: µs per page, median of {args.repeat} (no byte copies)")
    for name, us in results.items():
        print(f"  {name:<28}{us:>8.2f}")
    return {"batch": batch, "us_per_page": results}


# --- full tiers -------------------------------------------------------------------------------
def _fill(pool, host_pages: int, device_pages: int, chunk: int = 8192) -> list:
    """Commit host_pages distinct pages (write-through: each lands in the host tier), then keep
    the last device_pages resident on the device: both tiers full. Returns the keys."""
    keys = _keys(pool, host_pages, seed=1)
    chunk = min(chunk, device_pages)  # each chunk is allocated on the device at once
    for start in range(0, host_pages, chunk):
        part = keys[start : start + chunk]
        slots = pool.allocate(len(part))
        pool.commit(part, slots)
        pool.release(slots)
    pool.flush()  # the write-through copies the offload thread started have all landed
    return keys


def section_full(args) -> dict:
    fmt = PageFormat(**TINY)
    registry = CollectorRegistry()
    pool = TieredPool(fmt, **POOL_OPTIONS, device_pages=args.device_pages, host_pages=args.host_pages, write_policy="write_through",
                      engine=NoCopyEngine, registry=registry)
    t = time.perf_counter()
    keys = _fill(pool, args.host_pages, args.device_pages)
    fill_s = time.perf_counter() - t
    s = pool.stats()
    assert s["states"]["host"]["free"] == 0 and s["states"]["device"]["free"] == 0, s["states"]
    print(f"\n== full tiers: {args.host_pages} host pages, {args.device_pages} device pages, both full "
          f"(filled in {fill_s:.1f} s); µs per call, median of {args.calls}")
    rows = {}
    fresh = _keys(pool, args.calls * (1 + 16 + 256), seed=50_000_000)  # never committed before
    cursor = [0]
    # In the host tier, off the device, and far enough from the LRU front that the commits timed
    # below (which push the oldest host pages out) never reach them.
    host_only = keys[args.host_pages // 2 : args.host_pages - args.device_pages]

    def take(n):
        out = fresh[cursor[0] : cursor[0] + n]
        cursor[0] += n
        return out

    for batch in (1, 16, 256):
        samples: dict[str, list[float]] = {
            op: [] for op in ("allocate", "release", "commit", "commit+copy", "match", "load", "evict")}
        for i in range(args.calls):
            t = time.perf_counter()
            slots = pool.allocate(batch)
            samples["allocate"].append(time.perf_counter() - t)
            t = time.perf_counter()
            pool.commit(take(batch), slots)
            samples["commit"].append(time.perf_counter() - t)
            # The write-through copy runs on the offload thread after commit returns: timed here
            # with it, and settled before the next call so every row times its own call only.
            pool.flush()
            samples["commit+copy"].append(time.perf_counter() - t)
            t = time.perf_counter()
            pool.release(slots)
            samples["release"].append(time.perf_counter() - t)
            # One slice of `batch` keys: slicing to the end first would copy (and touch) up to
            # 900k list entries right before the timed call, flushing the CPU caches it measures.
            at = (i * batch * 7) % (len(host_only) - batch)
            probe = host_only[at : at + batch]
            t = time.perf_counter()
            pool.match(probe)
            samples["match"].append(time.perf_counter() - t)
            t = time.perf_counter()
            handle = pool.load(probe)
            samples["load"].append(time.perf_counter() - t)
            pool.release(handle.slots)
            t = time.perf_counter()
            pool.evict(batch)
            samples["evict"].append(time.perf_counter() - t)
        for op, values in samples.items():
            us = _median_us(values)
            # commit+copy times the write-through copy's own work too: measured, not a target.
            target = None if op == "commit+copy" else 5 * batch + 30
            rows[f"{op}/{batch}"] = {"us_per_call": us, "us_per_page": us / batch, "target_us": target}
    flush = []
    stats = []
    scrape = []
    exposition = getattr(metrics, "exposition", None)  # kvtier's own text rendering, where it has one
    fast = []
    for _ in range(args.calls):
        t = time.perf_counter()
        pool.flush()
        flush.append(time.perf_counter() - t)
        t = time.perf_counter()
        pool.stats()
        stats.append(time.perf_counter() - t)
        t = time.perf_counter()
        generate_latest(registry)
        scrape.append(time.perf_counter() - t)
        if exposition is not None:
            t = time.perf_counter()
            exposition(registry)
            fast.append(time.perf_counter() - t)
    rows["flush (nothing dirty)"] = {"us_per_call": _median_us(flush), "target_us": 50}
    rows["stats()"] = {"us_per_call": _median_us(stats), "target_us": 200}
    rows["scrape"] = {"us_per_call": _median_us(scrape), "target_us": 200}
    if fast:
        rows["scrape (exposition)"] = {"us_per_call": _median_us(fast), "target_us": 200}
    for name, row in rows.items():
        if row["target_us"] is None:
            per_page = f"{row['us_per_page']:>9.2f}"
            print(f"  {name:<24}{row['us_per_call']:>11.1f} µs {per_page} µs/page   (no target)")
            continue
        verdict = "ok" if row["us_per_call"] <= row["target_us"] else "MISS"
        per_page = f"{row['us_per_page']:>9.2f}" if "us_per_page" in row else " " * 9
        print(f"  {name:<24}{row['us_per_call']:>11.1f} µs {per_page} µs/page   target {row['target_us']:>6.0f} µs  {verdict}")
    pool.close()
    return {"host_pages": args.host_pages, "device_pages": args.device_pages, "fill_s": fill_s, "calls": rows}


# --- memory ---------------------------------------------------------------------------------
def section_memory(args) -> dict:
    fmt = PageFormat(**TINY)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    pool = TieredPool(fmt, **POOL_OPTIONS, device_pages=1024, host_pages=args.host_pages, write_policy="write_through",
                      engine=NoCopyEngine, registry=CollectorRegistry())
    empty = tracemalloc.get_traced_memory()[0]
    chunk = 1024
    for start in range(0, args.host_pages, chunk):
        part = _keys(pool, chunk, seed=1 + start)
        slots = pool.allocate(chunk)
        pool.commit(part, slots)
        pool.release(slots)
        del part
    pool.flush()
    gc.collect()
    full = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    s = pool.stats()
    held = args.host_pages - s["states"]["host"]["free"]
    per_page_full = (full - base) / args.host_pages
    print(f"\n== memory: {held} host pages held; index {per_page_full:.0f} B per host page "
          f"(empty pool {(empty - base) / args.host_pages:.0f} B per slot); target <= 100 B")
    pool.close()
    return {"host_pages": args.host_pages, "bytes_per_host_page": per_page_full,
            "bytes_per_slot_empty": (empty - base) / args.host_pages}


# --- keys -----------------------------------------------------------------------------------
def section_keys(args) -> dict:
    fmt = PageFormat(**TINY)
    pool = TieredPool(fmt, **POOL_OPTIONS, device_pages=8, host_pages=8, engine=NoCopyEngine, registry=CollectorRegistry())
    rng = np.random.default_rng(0)
    out = {}
    for page, n in ((1, 400_000), (16, 4_000_000)):
        tokens = rng.integers(0, 2**31, n, dtype=np.int64)
        best = min(_time(lambda: prefix_keys(tokens, page, pool.namespace)) for _ in range(5))
        out[f"page_{page}"] = n / best
        print(f"  prefix_keys page {page:>2}: {n / best / 1e6:6.2f} M tokens/s (target {'2' if page == 1 else '10'} M)")
    pool.close()
    return {"tokens_per_s": out}


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# --- threads --------------------------------------------------------------------------------
def section_threads(args) -> dict:
    fmt = PageFormat(num_layers=2, num_kv_heads=2, head_dim=64, page_size=16, dtype="fp8_e4m3", scale="per_page_head")
    with tempfile.TemporaryDirectory() as store:
        pool = TieredPool(fmt, **POOL_OPTIONS, device_pages=512, host_pages=1024, write_policy="write_through",
                          registry=CollectorRegistry(), remote=store)
        warm = _keys(pool, 4096, seed=7)
        for start in range(0, len(warm), 256):
            part = warm[start : start + 256]
            slots = pool.allocate(len(part))
            pool.commit(part, slots)
            pool.release(slots)
        pool.flush()
        # The last pages committed (on the device when the threads start) and pages long since
        # evicted to the remote tier that the loader never loads back, so every match of them
        # asks the remote index.
        probes = {"recent": warm[-16:], "remote": warm[2048:2064]}
        found = {name: collections.Counter() for name in probes}

        def lat(n):
            out = {name: [] for name in probes}
            for i in range(n):
                for name, probe in probes.items():
                    t = time.perf_counter()
                    hit = pool.match(probe)
                    out[name].append(time.perf_counter() - t)
                    found[name].update(device=hit.device, host=hit.host, remote=hit.remote)
                    time.sleep(0.0005)
            return out

        alone = lat(args.calls * 4)
        stop = threading.Event()
        counts = {"commit": 0, "load": 0, "flush": 0}

        pause = [0.0]

        def committer():
            seed = 10_000_000
            while not stop.is_set():
                time.sleep(pause[0])
                part = _keys(pool, 16, seed)
                seed += 16
                slots = pool.allocate(16)
                pool.commit(part, slots)
                pool.release(slots)
                counts["commit"] += 1

        def loader():
            i = 0
            while not stop.is_set():
                time.sleep(pause[0])
                part = warm[(i * 16) % 2048 :][:16]
                i += 1
                handle = pool.load(part)
                handle.synchronize()
                pool.release(handle.slots)
                counts["load"] += 1

        def flusher():
            while not stop.is_set():
                pool.flush()
                counts["flush"] += 1
                time.sleep(0.002)

        runs = {}
        for name, nap in (("paced", 0.001), ("busy", 0.0)):
            pause[0] = nap
            stop.clear()
            threads = [threading.Thread(target=f) for f in (committer, loader, flusher)]
            for t in threads:
                t.start()
            time.sleep(0.2)
            runs[name] = lat(args.calls * 4)
            stop.set()
            for t in threads:
                t.join()
        pool.close()
    res = {}
    print("\n== threads: match(16) p50 / p99 / max (target p99 <= 200 µs)")
    for probe in probes:
        print(f"  {probe} pages (hits over the run: {dict(found[probe])})")
        for name, label, values in (
            ("alone", "alone", alone),
            ("paced", "beside commit, load and flush threads that pause 1 ms between calls", runs["paced"]),
            ("busy", "beside the same threads calling back to back (Python's GIL hands over every 5 ms)", runs["busy"]),
        ):
            arr = np.array(values[probe]) * 1e6
            r = {"p50_us": float(np.percentile(arr, 50)), "p99_us": float(np.percentile(arr, 99)), "max_us": float(arr.max())}
            res[name if probe == "recent" else f"{name}_{probe}"] = r
            print(f"  {r['p50_us']:8.0f} {r['p99_us']:8.0f} {r['max_us']:8.0f} µs  {label}")
    print(f"  other threads did {counts}")
    res["other_calls"] = counts
    res["hits"] = {name: dict(c) for name, c in found.items()}
    return res


SECTIONS = {"batch": section_batch, "full": section_full, "memory": section_memory, "keys": section_keys,
            "threads": section_threads}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="batch,full,memory,keys,threads",
                    help=f"comma-separated sections to run, of {','.join(SECTIONS)}")
    ap.add_argument("--batch", type=int, default=4096, help="batch of the 'batch' section (default 4096)")
    ap.add_argument("--repeat", type=int, default=7, help="rounds of the 'batch' section (default 7)")
    ap.add_argument("--host-pages", type=int, default=1_000_000, help="host tier size of 'full' and 'memory'")
    ap.add_argument("--device-pages", type=int, default=100_000, help="device tier size of 'full'")
    ap.add_argument("--calls", type=int, default=200, help="calls timed per operation and batch (default 200)")
    ap.add_argument("--copies", choices=("background", "inline"), default="background",
                    help="where write-through copies start: the pool's offload thread (default) or inside commit")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for this run (seconds; CPython's default is 0.005)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    wanted = [s for s in args.sections.split(",") if s]
    try:  # the index's C paths built (or loaded) first, as a long-running server has them
        from kvtier.index import native
        print(f"index paths: {'C' if native.start(wait=True) is not None else 'Python (no C library)'}")
    except ImportError:
        print("index paths: Python (this revision has no C paths)")
    if "background_copies" in inspect.signature(TieredPool).parameters:  # older revisions lack it
        POOL_OPTIONS["background_copies"] = args.copies == "background"
    unknown = [s for s in wanted if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "python": platform.python_version(), "torch": torch.__version__,
            "copies": args.copies, "switch_interval_s": sys.getswitchinterval(),
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    print(f"kvtier control plane, {meta}")
    results = {"meta": meta}
    for name in wanted:
        results[name] = SECTIONS[name](args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
