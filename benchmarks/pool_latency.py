"""Host time of the pool's calls on small batches, through the public API, on a CUDA device.

What a scheduler pays per request: `load()` of 1-16 pages held in the host tier (time until
the call returns, and until the copy is done), `commit()` of 1-16 pages under write-through
(which queues an offload), and large loads end to end against the PCIe limit measured in the
same run. Formats: 32 layers x 8 kv heads x 128, page 16, fp8 (1 MiB pages); 92 layers, page 64
(11.5 MiB pages); 92 layers fp8 stored with bf16 on the device (the upcast on reload).

Targets (issue: serving-grade control plane): load of 1-16 pages returns in <= 100 µs of host
time at 32 layers and <= 150 µs at 92 layers, and is done within the bytes' PCIe time +
100 µs; commit of 1-16 pages <= 50 µs; large loads >= 0.85x of the PCIe limit end to end.

Small calls are timed twice: each right after device work and a synchronize (as a scheduler
calls the pool between steps: the columns "load ret" and "commit"; the CPU caches are cold), and
back to back, several calls in a row ("b2b": the calls' own cost).

    python benchmarks/pool_latency.py [--device cuda] [--repeats 30] [--pages 1,4,16,large] [--json out.json]

On a machine without CUDA it runs the CPU twin (device="cpu") and says so: the numbers then
measure the torch engine's synchronous copies, not the control plane of a GPU run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

# This checkout's kvtier first (an installed kvtier would otherwise answer an A/B's older copy).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from kvtier import PageFormat, TieredPool, prefix_keys  # noqa: E402
from kvtier.index import native  # noqa: E402

FORMATS = {
    "32L fp8 (1 MiB)": dict(num_layers=32, num_kv_heads=8, head_dim=128, page_size=16, dtype="fp8_e4m3",
                            scale="per_page_head"),
    "92L fp8 (11.5 MiB)": dict(num_layers=92, num_kv_heads=8, head_dim=128, page_size=64, dtype="fp8_e4m3",
                               scale="per_page_head"),
    "92L fp8->bf16": dict(num_layers=92, num_kv_heads=8, head_dim=128, page_size=64, dtype="fp8_e4m3",
                          scale="per_page_head", device_dtype="bf16"),
}


def pcie_h2d_gbps(device: torch.device, nbytes: int = 256 << 20) -> float:
    """GB/s (1e9 bytes) of one contiguous pinned host-to-device copy of `nbytes` (3 warm-up copies,
    median of 10 timed by CUDA events); NaN off CUDA. The PCIe limit the benchmarks compare
    against: decode_ttft.py, engine_host_cost.py and scripts/reload_timeline_probe.py use it too."""
    if device.type != "cuda":
        return float("nan")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for _ in range(3):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return nbytes / statistics.median(times) / 1e9


def fill(pool: TieredPool, slots: list[int], seed: int) -> None:
    """Random pages written on the device, as an engine's kernels would (no host work in between)."""
    device = pool.device_tier.device
    gen = torch.Generator(device=device).manual_seed(seed)
    index = torch.as_tensor(slots, device=device)
    for layer in range(pool.fmt.num_layers):
        for plane in pool.device_kv(layer):
            if plane is not None:
                values = torch.randn((len(slots), *plane.shape[1:]), generator=gen, device=device) * 2
                plane[index] = values.to(plane.dtype)
        for scales in pool.device_scales(layer):
            if scales is not None:
                scales[index] = torch.rand((len(slots), *scales.shape[1:]), generator=gen, device=device) + 0.05


def _back_to_back(pool: TieredPool, fresh, n: int, sync, calls: int = 8, rounds: int = 4) -> tuple[float, float]:
    """Median host time of `calls` commits, then `calls` loads, of n pages each, issued one after
    another with no device work or synchronization between them (the pages were written once
    before): the calls' own cost, without the cold caches that the column measured after
    device work pays."""
    commits, loads = [], []
    for r in range(rounds):
        keys = [fresh(n) for _ in range(calls)]
        slots = [pool.allocate(n) for _ in range(calls)]
        fill(pool, [s for part in slots for s in part], r)
        sync()
        for k, part in zip(keys, slots):
            t = time.perf_counter()
            pool.commit(k, part)
            commits.append((time.perf_counter() - t) * 1e6)
        for part in slots:
            pool.release(part)
        pool.flush()
        for k in keys:
            pool.evict(keys=k)
        sync()
        handles = []
        for k in keys:
            t = time.perf_counter()
            handles.append(pool.load(k))
            loads.append((time.perf_counter() - t) * 1e6)
        for handle, k in zip(handles, keys):
            handle.synchronize()
            pool.release(handle.slots)
            pool.evict(keys=k)
    return statistics.median(commits), statistics.median(loads)


def measure(name: str, spec: dict, device: torch.device, repeats: int, pcie: float, large_bytes: int,
            points: tuple[str, ...] = ("1", "4", "16", "large")) -> list[dict]:
    fmt = PageFormat(**spec)
    large = max(17, large_bytes // fmt.page_bytes)
    counts = [large if p == "large" else int(p) for p in points]
    rows = []
    pages = 2 * max(16, *counts) + 8
    pool = TieredPool(fmt, device=device, device_pages=pages, host_pages=pages, write_policy="write_through",
                      registry=CollectorRegistry())
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    counter = [0]

    def fresh(n):
        counter[0] += 1
        return prefix_keys(np.arange(counter[0] * 10**6, counter[0] * 10**6 + n * fmt.page_size), fmt.page_size,
                           pool.namespace)

    for n in counts:
        commit_us, load_us, done_us = [], [], []
        for r in range(repeats if n <= 16 else max(3, repeats // 6)):
            keys = fresh(n)
            slots = pool.allocate(n)
            fill(pool, slots, r)
            sync()
            t = time.perf_counter()
            pool.commit(keys, slots)
            commit_us.append((time.perf_counter() - t) * 1e6)
            pool.release(slots)
            pool.flush()
            pool.evict(keys=keys)  # on the host only now
            sync()
            t = time.perf_counter()
            handle = pool.load(keys)
            returned = time.perf_counter()
            handle.synchronize()
            landed = time.perf_counter()
            load_us.append((returned - t) * 1e6)
            done_us.append((landed - t) * 1e6)
            pool.release(handle.slots)
            pool.evict(keys=keys)
        warm_commit = warm_load = float("nan")
        if n <= 16:
            warm_commit, warm_load = _back_to_back(pool, fresh, n, sync, calls=max(2, min(8, pages // 2 // n)))
        nbytes = n * fmt.page_bytes
        pcie_us = nbytes / (pcie * 1e9) * 1e6 if pcie == pcie else float("nan")
        row = {
            "format": name, "pages": n, "page_bytes": fmt.page_bytes, "pcie_us": pcie_us,
            "load_returns_us": statistics.median(load_us), "load_done_us": statistics.median(done_us),
            "commit_us": statistics.median(commit_us),
            "commit_back_to_back_us": warm_commit, "load_returns_back_to_back_us": warm_load,
            "load_gbps": nbytes / (statistics.median(done_us) / 1e6) / 1e9,
            "engine_path": getattr(pool.engine, "last_path", None),
        }
        if pcie == pcie:
            row["load_vs_pcie"] = row["load_gbps"] / pcie
        rows.append(row)
    pool.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda (default) or cpu")
    ap.add_argument("--repeats", type=int, default=30, help="timed calls per point (median)")
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated formats of: " + ", ".join(FORMATS))
    ap.add_argument("--large-mib", type=int, default=256, help="MiB moved by the large-load point (default 256)")
    ap.add_argument("--pages", default="1,4,16,large",
                    help="comma-separated page counts per call; 'large' is the --large-mib point (default 1,4,16,large)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    # The index's C paths built (or loaded) first, as a long-running server has them.
    print(f"index paths: {'C' if native.start(wait=True) is not None else 'Python (no C library)'}")
    device = torch.device(args.device)
    if device.type != "cuda":
        print("no CUDA: the CPU twin runs (synchronous torch copies); these numbers are not the GPU control plane")
    pcie = pcie_h2d_gbps(device)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "python": platform.python_version(), "torch": torch.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "pcie_h2d_gbps": pcie}
    print(f"pool call latency, {meta}")
    rows = []
    for name in args.formats.split(","):
        rows += measure(name, FORMATS[name], device, args.repeats, pcie, args.large_mib << 20, tuple(args.pages.split(",")))
    print(f"{'format':<20}{'pages':>6}{'PCIe µs':>10}{'load ret µs':>13}{'load done µs':>14}{'commit µs':>11}"
          f"{'GB/s':>8}{'x PCIe':>8}{'b2b load':>10}{'b2b commit':>12}  path")
    for r in rows:
        print(f"{r['format']:<20}{r['pages']:>6}{r['pcie_us']:>10.1f}{r['load_returns_us']:>13.1f}"
              f"{r['load_done_us']:>14.1f}{r['commit_us']:>11.1f}{r['load_gbps']:>8.1f}{r.get('load_vs_pcie', float('nan')):>8.2f}"
              f"{r['load_returns_back_to_back_us']:>10.1f}{r['commit_back_to_back_us']:>12.1f}  {r['engine_path']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
