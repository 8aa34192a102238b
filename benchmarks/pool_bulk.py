"""Bulk moves through the public API against the PCIe limit: `commit` + `flush` of a whole tier,
then `load` of it back, for records of 8 KiB to 11.5 MiB.

Per record size, a pool whose device and host tiers hold N pages (8 KiB records: 8,192 pages;
the larger ones about 2 GiB): the device pages are written with random values, then
  offload   commit(all keys) + flush(): from the commit call until every byte is in the host tier
  reload    load(all keys) + synchronize(): from the load call until every byte is on the device
against one contiguous pinned copy of the same bytes in the same direction, in the same run
(D2H and H2D). Also reported: the host time of the commit and load calls (the bookkeeping, in
µs per page) and the transfer engine alone on the same slots (`engine.offload` / `engine.reload`
with no pool around it), which separates the pool's share of a shortfall from the engine's.
After each round a sample of pages is compared bit for bit (data and scales) with what was
written. Medians of --repeats rounds.

Goals (issue: many pages, little host time): >= 0.9x of PCIe both ways for records of 64 KiB
and more, >= 0.5x for 8 KiB records; bookkeeping <= 0.3 µs a page for batches of 256 or more.

    python benchmarks/pool_bulk.py [--device cuda] [--repeats 3] [--records 8k,64k,1m,2m,12m]
        [--scale 1.0] [--json out.json]

Without CUDA it runs the CPU twin (torch engine, memcpy instead of PCIe): the table then
checks that the script runs and the bookkeeping column means something; the ratios do not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier import PageFormat, TieredPool, prefix_keys  # noqa: E402

GIB = 1 << 30
# name: (page format, pages at --scale 1)
RECORDS = {
    "8k": (dict(num_layers=32, num_kv_heads=1, head_dim=128, page_size=1, dtype="fp8_e4m3", scale="per_tensor"), 8192),
    "64k": (dict(num_layers=32, num_kv_heads=8, head_dim=128, page_size=1, dtype="fp8_e4m3", scale="per_page_head"),
            4096),
    "1m": (dict(num_layers=32, num_kv_heads=8, head_dim=128, page_size=16, dtype="fp8_e4m3", scale="per_page_head"),
           2048),
    "2m": (dict(num_layers=32, num_kv_heads=8, head_dim=128, page_size=16, dtype="bf16"), 1024),
    "12m": (dict(num_layers=92, num_kv_heads=8, head_dim=128, page_size=64, dtype="fp8_e4m3", scale="per_page_head"),
            170),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def contiguous_seconds(device: torch.device, nbytes: int, repeats: int, host: torch.Tensor) -> tuple[float, float]:
    """Median seconds of one contiguous pinned copy of nbytes, (D2H, H2D)."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src = host[:nbytes]
    out = []
    for to_host in (True, False):
        times = []
        for _ in range(repeats + 1):
            sync(device)
            t = time.perf_counter()
            if to_host:
                src.copy_(dev, non_blocking=True)
            else:
                dev.copy_(src, non_blocking=True)
            sync(device)
            times.append(time.perf_counter() - t)
        out.append(statistics.median(times[1:]))
    del dev
    return out[0], out[1]


def fill(pool: TieredPool, slots: list[int], seed: int) -> None:
    """Random values in every layer, plane and scale of `slots` (never zeros)."""
    device = pool.device_tier.device
    gen = torch.Generator(device=device).manual_seed(seed)
    index = torch.as_tensor(slots, device=device)
    for layer in range(pool.fmt.num_layers):
        for plane in pool.device_kv(layer):
            if plane is not None:
                plane[index] = (torch.randn((len(slots), *plane.shape[1:]), generator=gen, device=device) * 2).to(plane.dtype)
        for scales in pool.device_scales(layer):
            if scales is not None:
                scales[index] = torch.rand((len(slots), *scales.shape[1:]), generator=gen, device=device) + 0.05


def snapshot(pool: TieredPool, slots: list[int]) -> list[torch.Tensor]:
    """Bytes of every layer, plane and scale of `slots`, on the CPU."""
    index = torch.as_tensor(slots, device=pool.device_tier.device)
    out = []
    for layer in range(pool.fmt.num_layers):
        for tensor in (*pool.device_kv(layer), *pool.device_scales(layer)):
            if tensor is not None:
                # Bytes first (fp8 has few gather kernels); a trailing axis keeps 1-D scales per slot.
                out.append(tensor.unsqueeze(-1).view(torch.uint8)[index].cpu())
    return out


def poison(pool: TieredPool) -> None:
    """Overwrite the whole device tier, so a reload that misses a byte cannot pass the check."""
    for layer in range(pool.fmt.num_layers):
        for tensor in (*pool.device_kv(layer), *pool.device_scales(layer)):
            if tensor is not None:
                tensor.view(torch.uint8).fill_(0x5A)


def measure(name: str, spec: dict, pages: int, device: torch.device, repeats: int, pinned: torch.Tensor) -> dict:
    fmt = PageFormat(**spec)
    nbytes = pages * fmt.page_bytes
    d2h_s, h2d_s = contiguous_seconds(device, nbytes, repeats, pinned)
    pool = TieredPool(fmt, device=device, device_pages=pages, host_pages=pages, write_policy="write_through",
                      registry=CollectorRegistry())
    rng = np.random.default_rng(0)
    sample = sorted(rng.choice(pages, size=min(8, pages), replace=False).tolist())
    rounds = []
    for r in range(repeats + 1):  # the first round warms up (kernel compiles, pinned buffers)
        keys = prefix_keys(np.arange(r * 10**8, r * 10**8 + pages * fmt.page_size) % 2**31, fmt.page_size, pool.namespace)
        slots = pool.allocate(pages)
        fill(pool, slots, r)
        expected = snapshot(pool, [slots[i] for i in sample])
        sync(device)
        t0 = time.perf_counter()
        pool.commit(keys, slots)
        t1 = time.perf_counter()
        left = pool.flush()
        t2 = time.perf_counter()
        pool.release(slots)
        if left:
            raise RuntimeError(f"{name}: flush left {left} pages not durable")
        gone = pool.evict(tier="device")
        if gone != pages:
            raise RuntimeError(f"{name}: {gone} of {pages} pages left the device")
        poison(pool)
        sync(device)
        t3 = time.perf_counter()
        handle = pool.load(keys)
        t4 = time.perf_counter()
        handle.synchronize()
        t5 = time.perf_counter()
        got = snapshot(pool, [handle.slots[i] for i in sample])
        if not all(torch.equal(a, b) for a, b in zip(expected, got)):
            raise RuntimeError(f"{name}: a reloaded page differs from what was written (round {r})")
        pool.release(handle.slots)
        pool.evict(tier="device")
        pool.evict(tier="host")
        rounds.append({"commit_call_s": t1 - t0, "offload_s": t2 - t0, "load_call_s": t4 - t3, "reload_s": t5 - t3})
    rounds = rounds[1:]
    engine = pool.engine
    dev_slots = list(range(pages))
    host_slots = list(range(pages))
    engine_runs = {"offload": [], "reload": []}
    for _ in range(repeats + 1):
        for op in ("offload", "reload"):
            sync(device)
            t = time.perf_counter()
            if op == "offload":
                ticket = engine.offload(dev_slots, host_slots, ready=engine.record_ready())
            else:
                ticket = engine.reload(host_slots, dev_slots, ready=engine.record_ready())
            ticket.synchronize()
            engine_runs[op].append(time.perf_counter() - t)
    path = getattr(engine, "last_path", None)
    pool.close()
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    eng = {op: statistics.median(v[1:]) for op, v in engine_runs.items()}
    return {
        "record": name, "format": fmt.describe(), "page_bytes": fmt.page_bytes, "pages": pages, "bytes": nbytes,
        "contiguous_d2h_gbps": nbytes / d2h_s / 1e9, "contiguous_h2d_gbps": nbytes / h2d_s / 1e9,
        "offload_gbps": nbytes / med["offload_s"] / 1e9, "reload_gbps": nbytes / med["reload_s"] / 1e9,
        "offload_vs_pcie": d2h_s / med["offload_s"], "reload_vs_pcie": h2d_s / med["reload_s"],
        "engine_offload_vs_pcie": d2h_s / eng["offload"], "engine_reload_vs_pcie": h2d_s / eng["reload"],
        "commit_call_us_per_page": med["commit_call_s"] / pages * 1e6,
        "load_call_us_per_page": med["load_call_s"] / pages * 1e6,
        "engine_path": path, "rounds": rounds, "engine_runs_s": engine_runs,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds per record size (median)")
    ap.add_argument("--records", default=",".join(RECORDS), help="comma-separated, of " + ",".join(RECORDS))
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every page count (the CPU check uses less)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda":
        print("no CUDA: the CPU twin runs (torch engine, memcpy); the ratios are not PCIe ratios")
    wanted = [r for r in args.records.split(",") if r]
    unknown = [r for r in wanted if r not in RECORDS]
    if unknown:
        ap.error(f"unknown records {unknown}; choose from {list(RECORDS)}")
    sizes = {r: max(2, int(RECORDS[r][1] * args.scale)) for r in wanted}
    largest = max(PageFormat(**RECORDS[r][0]).page_bytes * sizes[r] for r in wanted)
    pinned = torch.empty(largest, dtype=torch.uint8, pin_memory=device.type == "cuda")
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "python": platform.python_version(), "torch": torch.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    print(f"bulk moves through the public API, {meta}")
    rows = [measure(r, RECORDS[r][0], sizes[r], device, args.repeats, pinned) for r in wanted]
    print(f"{'record':>7}{'pages':>7}{'D2H GB/s':>10}{'H2D GB/s':>10}{'offload':>9}{'x PCIe':>8}{'reload':>8}"
          f"{'x PCIe':>8}{'engine off/re x':>17}{'commit µs/pg':>14}{'load µs/pg':>12}  path")
    for r in rows:
        print(f"{r['page_bytes'] / 1024:>6.1f}K{r['pages']:>7}{r['contiguous_d2h_gbps']:>10.1f}{r['contiguous_h2d_gbps']:>10.1f}"
              f"{r['offload_gbps']:>9.1f}{r['offload_vs_pcie']:>8.2f}{r['reload_gbps']:>8.1f}{r['reload_vs_pcie']:>8.2f}"
              f"{r['engine_offload_vs_pcie']:>9.2f} /{r['engine_reload_vs_pcie']:>5.2f}"
              f"{r['commit_call_us_per_page']:>14.2f}{r['load_call_us_per_page']:>12.2f}  {r['engine_path']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
