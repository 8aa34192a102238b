"""Host time of the pool's per-page bookkeeping: µs per page of commit, flush, match, load and
load into given slots, at batches of 16, 256 and 4,096 pages (and more with --pages).

The pool runs on CPU tensors with an engine that completes every copy at once without moving
bytes (the copies' own cost is pool_latency's and pool_bulk's), so what is timed is the control
plane a GPU run pays on its host thread:
key ids, key tables, page states, holds, eviction order, chunked copy submission. Each round uses
fresh keys (prefix keys at page size 1) in a pool sized for every round, so no call evicts:

- commit: `commit` of freshly allocated slots (write-back: commit queues no copy);
- flush:  `flush` of those dirty device pages (the copies down and their bookkeeping);
- match:  `match` of the keys, all in the host tier only;
- load:   `load(keys)` into new slots, until the handle is done;
- load_into: `load(keys, slots)` into slots from `allocate`, until done;
- first:  from the call to `load(keys)` until its first copy is handed to the engine (how long
  the link would sit idle at the start of a load; µs per call, not per page).

    python benchmarks/pool_bookkeeping.py [--pages 16,256,4096] [--rounds N] [--json out.json]
    python benchmarks/pool_bookkeeping.py --pages 8192
    python benchmarks/pool_bookkeeping.py --layer-ordered   # pools with layer_ordered_loads=True
    python benchmarks/pool_bookkeeping.py --scattered       # the host tier's order scattered first

With --layer-ordered the engine copies subsets of layers too (as the CUDA engine does), so loads of
more than one chunk take the layer-ordered chunk plan (chunks growing 2x instead of 4x); the pages
are so small that no chunk defers its other layers, so the two runs differ in the chunk plan only.

With --scattered each round's pages, once flushed, are loaded again 16 at a time, 8 of them and
8 pages of other requests, in a random order (untimed), so in the host tier's eviction order they
lie scattered as pages served to many requests do, instead of in one run as committed together;
the timed match and loads then take them out of that order piece by piece.

Run each revision's own copy of the script (it puts its own checkout first on sys.path) to
compare revisions.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from kvtier import PageFormat, TieredPool, prefix_keys  # noqa: E402
from kvtier.index import native  # noqa: E402
from pool_overhead import NoCopyEngine  # noqa: E402  benchmarks/pool_overhead.py: completes copies without bytes

FORMAT = dict(num_layers=2, num_kv_heads=1, head_dim=16, page_size=1, dtype="fp8_e4m3", scale="per_tensor")
OPS = ("commit", "flush", "match", "load", "load_into", "first")


class FirstCopyEngine(NoCopyEngine):
    """NoCopyEngine that notes when its first reload of a load arrives (`first` is reset per load)."""

    first: float | None = None

    def reload(self, host_slots, device_slots, ready=None):
        if FirstCopyEngine.first is None:
            FirstCopyEngine.first = time.perf_counter()
        return super().reload(host_slots, device_slots, ready)


class LayersFirstCopyEngine(FirstCopyEngine):
    """FirstCopyEngine that also copies a subset of layers (what layer-ordered loads split by)."""

    reloads_layers = True

    def reload_layers(self, host_slots, device_slots, layers, ready=None):
        return self.reload(host_slots, device_slots, ready)


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def _load(pool, keys, slots=None) -> list[int]:
    handle = pool.load(keys, slots)
    handle.wait()
    return handle.slots


def _scatter(pool, keys, others, rng) -> None:
    """Load `keys` and as many of `others` 16 at a time, 8 of each, in a random order, so the
    host tier's order holds `keys` scattered among `others`."""
    mine, theirs = rng.permutation(len(keys)), rng.permutation(len(others))[: len(keys)]
    for at in range(0, len(keys), 8):
        picked = [keys[i] for i in mine[at : at + 8]] + [others[i] for i in theirs[at : at + 8]]
        _load_and_let_go(pool, [picked[i] for i in rng.permutation(len(picked))])


def _load_and_let_go(pool, keys) -> None:
    pool.release(_load(pool, keys))
    pool.evict(tier="device", keys=keys)


def run_batch(n: int, rounds: int, seed: int, layer_ordered: bool = False, scattered: bool = False) -> dict:
    pool = TieredPool(PageFormat(**FORMAT), device="cpu", device_pages=2 * n, host_pages=n * (rounds + 2),
                      write_policy="write_back", engine=LayersFirstCopyEngine if layer_ordered else FirstCopyEngine,
                      registry=CollectorRegistry(), layer_ordered_loads=layer_ordered)
    rng = np.random.default_rng(seed)
    others = []
    if scattered:  # pages of other requests, in the host tier for the whole run
        others = prefix_keys(rng.integers(0, 2**31, n), 1, pool.namespace)
        slots = pool.allocate(n)
        pool.commit(others, slots)
        pool.release(slots)
        pool.flush()
        pool.evict(tier="device", keys=others)
    samples: dict[str, list[float]] = {op: [] for op in OPS}
    # The calls back to back (no collection in between): each round's keys are new, the
    # tables and the CPU caches warm, as in a serving loop.
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds + 1):  # round 0 warms up
            keys = prefix_keys(rng.integers(0, 2**31, n), 1, pool.namespace)
            slots = pool.allocate(n)
            t_commit, _ = _timed(lambda: pool.commit(keys, slots))
            pool.release(slots)
            t_flush, left = _timed(pool.flush)
            assert left == 0
            pool.evict(tier="device", keys=keys)
            if scattered:
                _scatter(pool, keys, others, rng)
            t_match, m = _timed(lambda: pool.match(keys))
            assert m.host == n, m
            FirstCopyEngine.first = None
            started = time.perf_counter()
            t_load, loaded = _timed(lambda: _load(pool, keys))
            t_first = FirstCopyEngine.first - started
            pool.release(loaded)
            pool.evict(tier="device", keys=keys)
            targets = pool.allocate(n)
            t_into, _ = _timed(lambda: _load(pool, keys, targets))
            pool.release(targets)
            pool.evict(tier="device", keys=keys)
            if r:
                for op, t in zip(OPS, (t_commit, t_flush, t_match, t_load, t_into, t_first)):
                    samples[op].append(t)
    finally:
        gc.enable()
        pool.close()
    calls = {op: statistics.median(v) * 1e6 for op, v in samples.items()}
    fastest = {op: min(v) * 1e6 for op, v in samples.items()}
    return {"pages": n, "rounds": rounds, "us_per_call": calls, "us_per_call_min": fastest, "us_per_page": {op: us / n for op, us in calls.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", default="16,256,4096", help="comma-separated batch sizes (e.g. 16,256,4096,8192)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="timed rounds per batch size (median; default 4096 / pages, at least 9, at most 101)")
    ap.add_argument("--layer-ordered", action="store_true", help="pools with layer_ordered_loads=True")
    ap.add_argument("--scattered", action="store_true",
                    help="scatter each round's pages in the host tier's eviction order first (untimed)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    # The index's C paths built (or loaded) first, as a long-running server has them.
    print(f"index paths: {'C' if native.start(wait=True) is not None else 'Python (no C library)'}")
    sizes = [int(p) for p in args.pages.split(",")]
    rows = [run_batch(n, args.rounds or max(9, min(101, 4096 // n)), seed=n, layer_ordered=args.layer_ordered,
                      scattered=args.scattered) for n in sizes]
    print(f"µs per page (µs per call), median of {args.rounds or '4096 / pages'} rounds; torch {torch.__version__}, CPU tensors"
          + (", layer-ordered loads" if args.layer_ordered else "") + (", scattered host order" if args.scattered else ""))
    print(f"{'pages':>7}" + "".join(f"{op:>20}" for op in OPS))
    for row in rows:
        print(f"{row['pages']:>7}" + "".join(
            f"{row['us_per_page'][op]:>10.3f} ({row['us_per_call'][op]:>6.0f})" for op in OPS))
    if args.json:
        out = {"benchmark": "pool_bookkeeping", "date": time.strftime("%Y-%m-%d %H:%M"), "python": platform.python_version(),
               "torch": torch.__version__, "cpu": platform.processor() or platform.machine(), "format": FORMAT,
               "rounds": args.rounds, "layer_ordered": args.layer_ordered, "scattered": args.scattered, "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
