"""Where the host time of one `TieredPool.load` goes: cProfile of loads of pages held in the host
tier, in the prefetched decode step's format (4 layers x 8 kv heads x 128, page 16, fp8 with
per-token-head scales: 132 KiB records) at 4,096 pages (batch 8 x 8k) and 16 pages, with
layer-ordered loads on and off. Each load follows an evict of the same keys (untimed), as in
`benchmarks/decode_ttft.py`; the profile covers the load call alone, not its copies' landing.

    PYTHONPATH=. python scripts/load_call_profile.py [--pages 4096,16] [--loads 5] [--top 25]

Prints, per configuration, the median wall time of the unprofiled calls, then the profile's
functions by total and by own time. Runs on the CPU twin too (torch engine).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier import PageFormat, TieredPool, prefix_keys  # noqa: E402

FORMAT = dict(num_layers=4, num_kv_heads=8, head_dim=128, page_size=16, dtype="fp8_e4m3", scale="per_token_head")


def decode_step_pool(pages: int, device: str, layer_ordered: bool) -> tuple[TieredPool, list[bytes]]:
    """A write-through pool in FORMAT with room for `pages` on the device and in the host tier,
    and the keys of `pages` random pages committed and flushed to the host tier (still on the
    device too)."""
    fmt = PageFormat(**FORMAT)
    pool = TieredPool(fmt, device=device, device_pages=pages + 8, host_pages=pages + 8,
                      write_policy="write_through", registry=CollectorRegistry(), layer_ordered_loads=layer_ordered)
    keys = prefix_keys(np.random.default_rng(pages).integers(0, 2**31, pages * fmt.page_size), fmt.page_size,
                       pool.namespace)
    slots = pool.allocate(pages)
    pool.commit(keys, slots)
    pool.release(slots)
    pool.flush()
    return pool, keys


def run(pages: int, loads: int, layer_ordered: bool, top: int, device: str) -> None:
    pool, keys = decode_step_pool(pages, device, layer_ordered)
    cuda = device == "cuda"
    with pool:
        walls, prof = [], cProfile.Profile()
        for i in range(2 * loads + 1):
            pool.evict(tier="device", keys=keys)
            if cuda:
                torch.cuda.synchronize()
            profiled = i > loads
            if profiled:
                prof.enable()
            t0 = time.perf_counter()
            handle = pool.load(keys)
            wall = time.perf_counter() - t0
            if profiled:
                prof.disable()
            elif i:
                walls.append(wall)
            handle.synchronize()  # the host sees the copies land, so the next evict can take every page
            pool.release(handle.slots)
    print(f"== {pages} pages, layer_ordered_loads={layer_ordered}, {device}: load call {statistics.median(walls) * 1e3:.3f} ms "
          f"(median of {len(walls)} unprofiled; {statistics.median(walls) / pages * 1e6:.2f} µs a page)", flush=True)
    for order in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(order).print_stats(top)
        text = out.getvalue()
        print(text[text.find("   ncalls"):], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", default="4096,16")
    ap.add_argument("--loads", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    for pages in (int(p) for p in args.pages.split(",")):
        for layer_ordered in ((True, False) if pages > 128 else (False,)):
            run(pages, args.loads, layer_ordered, args.top, args.device)


if __name__ == "__main__":
    main()
