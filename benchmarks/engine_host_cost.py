"""Host cost of one engine call: microseconds per reload / offload, submit only and submit to done.

For each format, path and batch size (1, 4, 16, 256 pages) it times, median of repeats:
- submit: the host time of `engine.reload(...)` / `engine.offload(..., ready=engine.record_ready())`
  (record_ready included: the pool calls it for every transfer);
- done: from the start of the call until `ticket.done()` first reads True (busy polling), the
  latency a caller that polls sees;
and prints the bytes' PCIe time at the contiguous pinned rate measured in the same run.
Formats: 32 layers x 8 kv heads x 128 dims x 16 tokens fp8_e4m3 per_page_head (1 MiB pages),
the same at 92 layers x 64 tokens (11.5 MiB), and 92 layers fp8 stored / bf16 on the device
(upcast on reload, quantize on offload). Without CUDA it times the torch twin (TorchEngine,
at most 16 pages) and says so: those are not GPU numbers.
It also times, anywhere, the kernel path's own Python per transfer (slot checks, slot
buffer, argument record, ticket) with the one driver call left out, so the GPU run's
submit column can be split into Python and driver.
Run: PYTHONPATH=. python benchmarks/engine_host_cost.py [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier.format import PageFormat  # noqa: E402
from kvtier.tiers import DeviceTier, HostTier  # noqa: E402
from kvtier.transfer import TorchEngine  # noqa: E402
from pool_latency import pcie_h2d_gbps  # noqa: E402  benchmarks/pool_latency.py

FORMATS = {
    "32L fp8 1MiB": PageFormat(32, 8, 128, 16, dtype="fp8_e4m3", scale="per_page_head"),
    "92L fp8 11.5MiB": PageFormat(92, 8, 128, 64, dtype="fp8_e4m3", scale="per_page_head"),
    "92L fp8->bf16": PageFormat(92, 8, 128, 64, dtype="fp8_e4m3", scale="per_page_head", device_dtype="bf16"),
}
BATCHES = (1, 4, 16, 256)


def time_calls(call, repeats: int) -> tuple[float, float]:
    """(median submit s, median submit-to-done s) of `call` (returns a ticket)."""
    submit, done = [], []
    for _ in range(repeats + 1):
        began = time.perf_counter()
        ticket = call()
        queued = time.perf_counter()
        while not ticket.done():
            pass
        finished = time.perf_counter()
        submit.append(queued - began)
        done.append(finished - began)
    return statistics.median(submit[1:]), statistics.median(done[1:])


def paths_for(fmt: PageFormat, op: str) -> list[str]:
    from kvtier.transfer import native
    from kvtier.transfer.cuda import driver
    from kvtier.transfer.cuda.copy_engine_path import batch_memcpy_runtime

    kernels = native.kernels_available() and driver.available()
    paths = ["auto"] + (["kernel"] if kernels else [])
    if batch_memcpy_runtime() is not None:
        if not fmt.converts:
            paths.append("copy_engine")
        elif op == "reload" and kernels:
            paths.append("staged")
    return paths + ["torch"]


def python_share(repeats: int = 2000) -> list[dict]:
    """Median us of the kernel path's Python per reload (the launch itself a no-op), per format and size."""
    from kvtier.transfer.cuda import plans
    from kvtier.transfer.cuda.engine import CudaEngine
    from kvtier.transfer.cuda.kernel_path import KernelPath
    from kvtier.transfer.cuda.tickets import FlagTicket, StreamLane

    rows = []
    for label, fmt in FORMATS.items():
        dev, host = DeviceTier(fmt, 16, "cpu"), HostTier(fmt, 16, pin=False)
        path = KernelPath(fmt, plans.device_table(dev), 0, host.buffer.data_ptr(), lambda *launch: None, 132, 132)
        flags = torch.zeros(fmt.num_layers + 1, dtype=torch.int32)
        counters = torch.zeros(fmt.num_layers + 1, dtype=torch.int32)

        def pinned(capacity):
            tensor = torch.zeros((3, capacity), dtype=torch.int32)
            return tensor, tensor.data_ptr()

        lane = StreamLane(None, fmt.num_layers, flags, flags.data_ptr(), counters, pinned, None)
        for count in (1, 16):
            slots, times = list(range(count)), []
            for _ in range(repeats):
                began = time.perf_counter()
                host_slots = CudaEngine._slots("host", slots, 16, unique=False)
                dev_slots = CudaEngine._slots("device", slots, 16, unique=True)
                with lane.lock:
                    buffer = lane.buffer(count)
                    buffer.src[:count] = host_slots
                    buffer.dst[:count] = dev_slots
                    seq = lane.next_seq()
                    path.submit("reload", lane, buffer, count, seq)
                ticket = FlagTicket(lane, seq, buffer, count, False, None)
                times.append(time.perf_counter() - began)
                lane.flags[fmt.num_layers] = seq  # what the kernel's last block stores
                ticket.done()
            rows.append({"format": label, "pages": count, "python_us": statistics.median(times) * 1e6})
        host.close()
    return rows


def run(args) -> list[dict]:
    cuda = torch.cuda.is_available()
    rows = []
    rate = pcie_h2d_gbps(torch.device("cuda")) * 1e9 if cuda else float("nan")  # bytes/s
    batches = BATCHES if cuda and not args.quick else tuple(b for b in BATCHES if b <= 16)
    for label, fmt in FORMATS.items():
        pages = max(batches)
        dev = DeviceTier(fmt, pages, "cuda" if cuda else "cpu")
        host = HostTier(fmt, pages, pin=cuda)
        for layer in range(fmt.num_layers):
            for plane in range(fmt.planes):
                dev.raw_plane(layer, plane).random_(0, 120)  # finite codes and values in every dtype
                if dev.has_scales:
                    dev.scale_plane(layer, plane).uniform_(0.5, 2.0)
        host.buffer.random_(0, 120)
        if cuda:
            from kvtier.transfer.cuda_engine import CudaEngine

            engines = {path: (lambda p=path: CudaEngine(dev, host, path=p)) for path in ("auto", "kernel", "copy_engine", "staged", "torch")}
        else:
            engines = {"torch twin": lambda: TorchEngine(dev, host)}
        for op in ("reload", "offload"):
            for path in paths_for(fmt, op) if cuda else ["torch twin"]:
                engine = engines[path]()
                for count in batches:
                    slots = list(range(count))
                    repeats = 5 if count >= 256 else args.repeats
                    if op == "reload":
                        call = (lambda e=engine, s=slots: e.reload(s, s, ready=e.record_ready()))
                    else:
                        call = (lambda e=engine, s=slots: e.offload(s, s, ready=e.record_ready()))
                    submit_s, done_s = time_calls(call, repeats)
                    wire = count * fmt.page_bytes / rate
                    rows.append({
                        "format": label, "op": op, "path": path, "taken": getattr(engine, "last_path", "torch"),
                        "pages": count, "page_bytes": fmt.page_bytes, "submit_us": submit_s * 1e6,
                        "done_us": done_s * 1e6, "pcie_us": wire * 1e6,
                    })
                engine.close()
        host.close()
        del dev
        if cuda:
            torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the rows and the environment here")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="batches of at most 16 pages")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda:
        print("no CUDA: timing the torch twin (TorchEngine) on the CPU; these are not GPU numbers")
    share = python_share()
    rows = run(args)
    if args.json:
        env = {"torch": torch.__version__, "cuda": torch.version.cuda,
               "gpu": torch.cuda.get_device_name() if cuda else "none (CPU twin)"}
        args.json.write_text(json.dumps({"env": env, "python_share": share, "rows": rows}, indent=1))
    print("kernel path's Python per reload, the launch left out (us):")
    for r in share:
        print(f"  {r['format']:16} {r['pages']:3d} pages {r['python_us']:6.1f}")
    print(f"{'format':16} {'op':8} {'path':12} {'taken':12} {'pages':>5} {'submit us':>10} {'done us':>10} {'pcie us':>9}")
    for r in rows:
        print(f"{r['format']:16} {r['op']:8} {r['path']:12} {r['taken']:12} {r['pages']:5d} "
              f"{r['submit_us']:10.1f} {r['done_us']:10.1f} {r['pcie_us']:9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
