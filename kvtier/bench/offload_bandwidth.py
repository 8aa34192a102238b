"""Offload / reload bandwidth of kvtier's copy engine, against the PCIe limits and per-page copies.

One run measures, on the same machine and in the same process:
- the limits: one contiguous pinned D2H copy, one H2D copy, and both directions at once;
- the baseline: one cudaMemcpyAsync per (page, plane) piece (torch `copy_` on a stream; the
  mechanism of vLLM's swap_blocks);
- kvtier offload and reload of scattered pages, 4 KiB to 4 MiB records, per engine path;
- reload with fp8 -> bf16 upcast (bf16 bytes delivered per second) and offload with
  bf16 -> fp8 quantize (bf16 bytes consumed per second);
- offload and reload at the same time, per pairing of copy mechanisms (kvtier.bench.both_directions);
- a synthetic decode loop (a bf16 matmul per layer standing in for attention) with all KV
  reloaded layer by layer from host (wait_layer per layer), against the same loop with the
  KV resident, and against the transfer alone.
GPU work is timed with CUDA events after a warm-up, median of repeats (every repeat kept in the
JSON). It prints a table and writes JSON (--json) and a PNG (--png, needs matplotlib; drawn by
kvtier.bench.plots, also from an earlier report with --from-json). Without CUDA it runs the CPU twin
(TorchEngine, small sizes, wall-clock timing) and says so; those numbers are not PCIe numbers.
Page sizes come from PageFormats (tokens per page varied at 8 heads x 128 dims) so the
engine's real paths run. Run it as `kvtier bench` or `python benchmarks/offload_bandwidth.py`;
nothing else in kvtier imports it.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from kvtier.bench import both_directions, plots
from kvtier.format import PageFormat
from kvtier.tiers import DeviceTier, HostTier
from kvtier.transfer import TorchEngine

HEADS, HEAD_DIM = 8, 128
GIB = 1024**3
MIB = 1024**2


# --- formats and progress ------------------------------------------------------------------
def page_format(page_kib: int, layers: int = 1, converting: bool = False) -> PageFormat:
    """A format whose device page (all planes, bf16) is `page_kib` KiB: 4 KiB per token at 8 x 128."""
    tokens = page_kib * 1024 // (2 * HEADS * HEAD_DIM * 2) // layers
    if tokens < 1 or tokens * 2 * HEADS * HEAD_DIM * 2 * layers != page_kib * 1024:
        raise ValueError(f"page size {page_kib} KiB is not a multiple of {4 * layers} KiB")
    if converting:
        return PageFormat(layers, HEADS, HEAD_DIM, tokens, dtype="fp8_e4m3", scale="per_token_head", device_dtype="bf16")
    return PageFormat(layers, HEADS, HEAD_DIM, tokens)


def progress(total: int, enabled: bool) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, disable=not enabled, leave=False, file=sys.stderr)


class Results:
    def __init__(self, bar: Any) -> None:
        self.rows: list[dict] = []
        self.bar = bar

    def add(
        self, section: str, path: str, page_bytes: int, pages: int, seconds: float, moved: int, note: str = "",
        runs: tuple[float, ...] = (),
    ) -> None:
        """One measurement: `seconds` is the median of the repeats, `runs` every repeat's seconds."""
        self.rows.append(
            {
                "section": section,
                "path": path,
                "page_bytes": page_bytes,
                "pages": pages,
                "seconds": seconds,
                "bytes": moved,
                "gbps": moved / seconds / 1e9 if seconds > 0 else float("nan"),
                "runs_gbps": [moved / s / 1e9 for s in runs if s > 0],
                "note": note,
            }
        )
        if self.bar is not None:
            self.bar.update(1)


# --- timing -----------------------------------------------------------------------------------
class Timing(NamedTuple):
    device_s: float  # median GPU time from the first queued copy to the last landed byte
    submit_s: float  # median host time of queueing the work (the engine's Python and launches)
    device_runs: tuple[float, ...]  # every repeat's GPU time, for the spread


# About 10 ms at the H200's 1.98 GHz: longer than any submission here, so the GPU is still
# busy with the sleep when the copies are queued, and the events time the copies alone.
SLEEP_CYCLES = 20_000_000


def time_cuda(run: Callable[[], list], repeats: int, warmup: int) -> Timing:
    """Median device time of `run` (which queues work and returns what the current stream
    must wait on), with the host's queueing kept off the clock, and median queueing time.

    A serving engine queues copies ahead of the GPU (while the previous step computes), so
    the device time is the bandwidth it sees as long as queueing keeps up; `submit_s` says
    whether it does."""
    for _ in range(warmup):
        for ticket in run():
            ticket.wait()
    torch.cuda.synchronize()
    device, submit = [], []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        began = time.perf_counter()
        tickets = run()
        submit.append(time.perf_counter() - began)
        for ticket in tickets:
            ticket.wait()
        end.record()
        end.synchronize()
        device.append(start.elapsed_time(end) / 1e3)
    return Timing(statistics.median(device), statistics.median(submit), tuple(device))


def time_wall_runs(run: Callable[[], object], repeats: int, warmup: int) -> tuple[float, ...]:
    for _ in range(warmup):
        run()
    samples = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        samples.append(time.perf_counter() - began)
    return tuple(samples)


def time_wall(run: Callable[[], object], repeats: int, warmup: int) -> float:
    return statistics.median(time_wall_runs(run, repeats, warmup))


class StreamDone:
    """A stream's queued work as something with wait(), like a ticket."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.event = torch.cuda.Event()
        self.event.record(stream)

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)


# --- GPU measurements ---------------------------------------------------------------------------
def gpu_meta() -> dict:
    meta = {
        "mode": "gpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
    }
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
        meta["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        meta["driver"] = "unknown"
    for module in ("cupy", "triton", "cuda.bindings"):
        try:
            meta[module] = getattr(importlib.import_module(module), "__version__", "unknown")
        except ImportError:
            meta[module] = None
    return meta


def gpu_limits(nbytes: int, repeats: int) -> dict:
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d2h_stream, h2d_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def d2h():
        d2h_stream.wait_stream(torch.cuda.current_stream())  # start after the start event
        with torch.cuda.stream(d2h_stream):
            host.copy_(device, non_blocking=True)
        return [StreamDone(d2h_stream)]

    def h2d():
        h2d_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(h2d_stream):
            device2.copy_(host2, non_blocking=True)
        return [StreamDone(h2d_stream)]

    def both():
        return d2h() + h2d()

    limits = {
        "d2h_gbps": nbytes / time_cuda(d2h, repeats, 2).device_s / 1e9,
        "h2d_gbps": nbytes / time_cuda(h2d, repeats, 2).device_s / 1e9,
        "both_gbps": 2 * nbytes / time_cuda(both, repeats, 2).device_s / 1e9,
        "bytes": nbytes,
    }
    return limits


def gpu_paths() -> list[str]:
    from kvtier.transfer import native
    from kvtier.transfer.cuda import driver
    from kvtier.transfer.cuda.copy_engine_path import batch_memcpy_runtime

    kernels = native.kernels_available() and driver.available()
    paths = []
    if kernels:
        paths.append("kernel")
    if batch_memcpy_runtime() is not None:
        paths.append("copy_engine")
        if kernels:
            paths.append("staged")
    paths.append("torch")
    return paths


def fill_random(dev: DeviceTier, host: HostTier) -> None:
    """Never-zero device pages and valid host records (fp8 codes and positive scales)."""
    fmt = dev.fmt
    if fmt.device_dtype in ("bf16", "fp16"):
        dev.kv.uniform_(0.5, 2.0)
    host.buffer.copy_(torch.randint(0, 120, host.buffer.shape, dtype=torch.uint8))  # positive fp8 codes
    if fmt.has_scales:
        for layer in range(fmt.num_layers):
            for plane in range(fmt.planes):
                host.scale_view(layer, plane).fill_(0.0625)


def gpu_page_size(
    results: Results, page_kib: int, pages: int, paths: list[str], args: argparse.Namespace, blocks: int | None
) -> None:
    from kvtier.transfer.cuda_engine import CudaEngine

    rng = np.random.default_rng(page_kib)
    for converting in (False, True):
        fmt = page_format(page_kib, converting=converting)
        dev = DeviceTier(fmt, 2 * pages, "cuda")
        host = HostTier(fmt, 2 * pages, pin=True)
        fill_random(dev, host)
        dslots = rng.permutation(2 * pages)[:pages].tolist()
        hslots = rng.permutation(2 * pages)[:pages].tolist()
        dslots_b = np.setdiff1d(np.arange(2 * pages), dslots)[:pages].tolist()
        hslots_b = np.setdiff1d(np.arange(2 * pages), hslots)[:pages].tolist()
        device_bytes = pages * fmt.device_plane_bytes * fmt.planes * fmt.num_layers
        wire_bytes = pages * fmt.page_bytes
        for path in paths:
            if (converting and path == "copy_engine") or (not converting and path == "staged"):
                continue
            engine = CudaEngine(dev, host, path=path, max_blocks=blocks)
            reload = time_cuda(lambda: [engine.reload(hslots, dslots, ready=engine.record_ready())], args.repeats, 2)
            reload_s, reload_note = reload.device_s, _launch_note(engine, reload)
            if path == "staged":  # only reloads convert through staging; its offload is the kernel's
                page = device_bytes // pages
                note = f"bf16 bytes delivered; fp8 record {fmt.page_bytes / 1024:.1f} KiB; {reload_note}"
                results.add("reload+upcast", path, page, pages, reload_s, device_bytes, note, reload.device_runs)
                engine.close()
                continue
            offload = time_cuda(lambda: [engine.offload(dslots, hslots, ready=engine.record_ready())], args.repeats, 2)
            offload_s, offload_note = offload.device_s, _launch_note(engine, offload)
            if converting:
                # Keyed by the bf16 page size, like the pass-through rows; the fp8 record is about half.
                page = device_bytes // pages
                fp8 = f"fp8 record {fmt.page_bytes / 1024:.1f} KiB"
                results.add("offload+quantize", path, page, pages, offload_s, device_bytes,
                            f"bf16 bytes read; {fp8}; {offload_note}", offload.device_runs)
                results.add("reload+upcast", path, page, pages, reload_s, device_bytes,
                            f"bf16 bytes delivered; {fp8}; {reload_note}", reload.device_runs)
            else:
                results.add("offload", path, fmt.page_bytes, pages, offload_s, wire_bytes, offload_note, offload.device_runs)
                results.add("reload", path, fmt.page_bytes, pages, reload_s, wire_bytes, reload_note, reload.device_runs)
            engine.close()
        if not converting:
            both_directions.measure(results, time_cuda, dev, host, (dslots, hslots, dslots_b, hslots_b), paths, args.repeats)
            piece = time_cuda(lambda: per_piece_offload(dev, host, dslots, hslots), args.repeats, 1)
            results.add(
                "offload", "per-piece memcpy", fmt.page_bytes, pages, piece.device_s, wire_bytes,
                "one cudaMemcpyAsync per (page, plane), vLLM swap_blocks style", piece.device_runs,
            )
        host.close()


_baseline_stream = None


def per_piece_offload(dev: DeviceTier, host: HostTier, dslots: list[int], hslots: list[int]) -> list:
    global _baseline_stream
    if _baseline_stream is None:
        _baseline_stream = torch.cuda.Stream()
    fmt = dev.fmt
    _baseline_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(_baseline_stream):
        for plane in range(fmt.planes):
            source = dev.raw_plane(0, plane)
            target = host.raw_plane(0, plane)
            for d, h in zip(dslots, hslots):
                target[h].copy_(source[d], non_blocking=True)
    return [StreamDone(_baseline_stream)]


def _launch_note(engine, timing: Timing) -> str:
    submit = f"queued in {timing.submit_s * 1e3:.2f} ms"
    shape = engine.last_launch
    if shape is None:
        return f"{submit}; no SM kernel" if engine.last_path == "copy_engine" else submit
    return f"{submit}; {shape.blocks} blocks x {shape.threads} threads on <= {shape.sms} SMs"


def gpu_decode_loop(results: Results, layers: int, pages: int, repeats: int, paths: list[str]) -> dict:
    from kvtier.transfer.cuda_engine import CudaEngine

    fmt = PageFormat(layers, HEADS, HEAD_DIM, 16)
    dev = DeviceTier(fmt, pages, "cuda")
    host = HostTier(fmt, pages, pin=True)
    fill_random(dev, host)
    x = torch.randn(2048, 4096, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    slots = list(range(pages))
    sink = torch.zeros((), device="cuda")

    def layer_step(layer: int) -> None:
        nonlocal sink
        torch.matmul(x, w)
        sink = sink + dev.kv[layer, 0, 0, 0, 0, 0].float()  # depends on the layer's KV having landed

    def resident():
        for layer in range(layers):
            layer_step(layer)
        return []

    out = {"layers": layers, "pages": pages, "kv_bytes": pages * fmt.page_bytes,
           "resident_ms": time_cuda(resident, repeats, 2).device_s * 1e3, "paths": {}}
    for path in paths:
        engine = CudaEngine(dev, host, path=path)

        def overlapped():
            ticket = engine.reload(slots, slots, ready=engine.record_ready())
            for layer in range(layers):
                ticket.wait_layer(layer)
                layer_step(layer)
            return [ticket]

        def transfer_only():
            return [engine.reload(slots, slots, ready=engine.record_ready())]

        overlapped_s = time_cuda(overlapped, repeats, 2).device_s
        transfer_s = time_cuda(transfer_only, repeats, 2).device_s
        out["paths"][path] = {"reload_overlapped_ms": overlapped_s * 1e3, "transfer_only_ms": transfer_s * 1e3}
        results.add("decode loop, reload per layer", path, fmt.page_bytes, pages, overlapped_s, pages * fmt.page_bytes,
                    f"resident {out['resident_ms']:.2f} ms, transfer alone {transfer_s * 1e3:.2f} ms")
        engine.close()
    host.close()
    return out


def run_gpu(args: argparse.Namespace) -> dict:
    meta = gpu_meta()
    paths = args.paths or gpu_paths()
    budget = int(args.max_gib * GIB)
    sizes = args.sizes
    converting_paths = [p for p in paths if p != "copy_engine"]
    decode_paths = [p for p in paths if p not in ("torch", "staged")] or paths
    bar = progress(1 + len(sizes) * (2 * len(paths) + len(both_directions.pairings(paths)) + 1 + 2 * len(converting_paths)) + len(decode_paths), not args.no_progress)
    results = Results(bar)
    limits = gpu_limits(min(budget, 1 * GIB), args.repeats)
    if bar is not None:
        bar.update(1)
    for page_kib in sizes:
        pages = args.pages if args.pages else max(64, min(4096, budget // (page_kib * 1024)))
        gpu_page_size(results, page_kib, pages, paths, args, args.blocks)
    decode = gpu_decode_loop(results, args.decode_layers, args.decode_pages, args.repeats, decode_paths)
    if bar is not None:
        bar.close()
    return {"meta": meta, "limits": limits, "rows": results.rows, "decode": decode}


# --- CPU twin -------------------------------------------------------------------------------------
def run_cpu(args: argparse.Namespace) -> dict:
    meta = {
        "mode": "cpu twin (no CUDA): TorchEngine between CPU tensors; not PCIe numbers",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
    }
    sizes = args.sizes
    bar = progress(len(sizes) * 4 + 2, not args.no_progress)
    results = Results(bar)
    nbytes = 64 * MIB
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    limits = {"memcpy_gbps": nbytes / time_wall(lambda: dst.copy_(src), args.repeats, 1) / 1e9, "bytes": nbytes}
    if bar is not None:
        bar.update(1)
    rng = np.random.default_rng(0)
    for page_kib in sizes:
        pages = args.pages if args.pages else max(16, min(512, (32 * MIB) // (page_kib * 1024)))
        for converting in (False, True):
            fmt = page_format(page_kib, converting=converting)
            dev = DeviceTier(fmt, 2 * pages, "cpu")
            host = HostTier(fmt, 2 * pages, pin=False)
            fill_random(dev, host)
            engine = TorchEngine(dev, host)
            dslots = rng.permutation(2 * pages)[:pages].tolist()
            hslots = rng.permutation(2 * pages)[:pages].tolist()
            page = fmt.device_plane_bytes * fmt.planes * fmt.num_layers if converting else fmt.page_bytes
            offload_runs = time_wall_runs(lambda: engine.offload(dslots, hslots), args.repeats, 1)
            reload_runs = time_wall_runs(lambda: engine.reload(hslots, dslots), args.repeats, 1)
            names = ("offload+quantize", "reload+upcast") if converting else ("offload", "reload")
            note = f"bf16 bytes; fp8 record {fmt.page_bytes / 1024:.1f} KiB" if converting else ""
            for name, runs in zip(names, (offload_runs, reload_runs)):
                results.add(name, "cpu twin", page, pages, statistics.median(runs), pages * page, note, runs)
            host.close()
    fmt = PageFormat(4, HEADS, HEAD_DIM, 16)
    dev, host = DeviceTier(fmt, 32, "cpu"), HostTier(fmt, 32, pin=False)
    fill_random(dev, host)
    engine, slots = TorchEngine(dev, host), list(range(32))
    x, w = torch.randn(256, 256), torch.randn(256, 256)

    def overlapped():
        ticket = engine.reload(slots, slots)
        for layer in range(fmt.num_layers):
            ticket.wait_layer(layer)
            torch.matmul(x, w)

    decode_s = time_wall(overlapped, args.repeats, 1)
    results.add("decode loop, reload per layer", "cpu twin", fmt.page_bytes, 32, decode_s, 32 * fmt.page_bytes)
    if bar is not None:
        bar.close()
    return {"meta": meta, "limits": limits, "rows": results.rows, "decode": {"layers": fmt.num_layers, "pages": 32}}


# --- output ------------------------------------------------------------------------------------------
def print_table(report: dict) -> None:
    meta = report["meta"]
    print(f"# kvtier offload bandwidth — {meta['mode']}")
    print("# " + ", ".join(f"{k}={v}" for k, v in meta.items() if k != "mode"))
    print("# limits: " + ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in report["limits"].items()))
    header = f"{'section':<30} {'path':<18} {'page KiB':>9} {'pages':>6} {'GB/s':>8} {'ms':>9}  note"
    print(header)
    print("-" * len(header))
    for row in report["rows"]:
        print(
            f"{row['section']:<30} {row['path']:<18} {row['page_bytes'] / 1024:>9.1f} {row['pages']:>6} "
            f"{row['gbps']:>8.2f} {row['seconds'] * 1e3:>9.3f}  {row['note']}"
        )
    decode = report.get("decode", {})
    if "resident_ms" in decode:
        print(f"# decode loop: {decode['layers']} layers, {decode['pages']} pages, resident {decode['resident_ms']:.2f} ms")
        for path, times in decode["paths"].items():
            overlapped, alone = times["reload_overlapped_ms"], times["transfer_only_ms"]
            print(f"#   {path}: reload overlapped {overlapped:.2f} ms, transfer alone {alone:.2f} ms")


def write_png(report: dict, target: Path) -> Path:
    """Draw the report (kvtier.bench.plots.offload_figure) into `target`; PlotUnavailable without matplotlib."""
    return plots.save(plots.offload_figure(report), target)


def _kib_list(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"page sizes must be comma-separated KiB counts such as 4,64,1024; got {text!r}")
    if any(size <= 0 or size % 4 for size in sizes):
        raise argparse.ArgumentTypeError(f"page sizes must be positive multiples of 4 KiB; got {text!r}")
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options, shared by `kvtier bench` and `python benchmarks/offload_bandwidth.py`."""
    parser.add_argument("--quick", action="store_true",
                        help="small sweep: 5 repeats, 0.25 GiB per transfer, a short decode loop "
                             "(what scripts/gpu_check.sh runs)")
    parser.add_argument("--pages", type=int, default=None, metavar="N",
                        help="pages per transfer (default: as many as --max-gib allows, 64 to 4096; CPU twin 16 to 512)")
    parser.add_argument("--sizes", type=_kib_list, default=None, metavar="KIB,...",
                        help="page sizes in KiB, comma separated multiples of 4 "
                             "(default: 4,16,64,256,1024,4096; CPU twin 4,16,64,256)")
    parser.add_argument("--paths", type=str, default=None, metavar="PATH,...",
                        help="copy paths to measure, comma separated: kernel, copy_engine, staged, torch "
                             "(default: every one available)")
    parser.add_argument("--blocks", type=int, default=None, metavar="N",
                        help="most blocks one kernel launch may take (default: one per SM)")
    parser.add_argument("--max-gib", type=float, default=None, metavar="GIB",
                        help="bytes of one transfer at most, in GiB (default: 4; 0.25 with --quick)")
    parser.add_argument("--repeats", type=int, default=None, metavar="N",
                        help="timed repeats per measurement, after warm-up; the median is reported and the JSON keeps every "
                             "repeat for error bars (default: 15; 5 with --quick)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE",
                        help="write the report (meta, limits, rows with every repeat, decode loop) as JSON")
    parser.add_argument("--png", type=Path, default=None, metavar="FILE",
                        help="draw the report as a PNG (needs matplotlib: pip install 'kvtier[bench]'); "
                             "checked before anything is measured")
    parser.add_argument("--from-json", type=Path, default=None, metavar="FILE",
                        help="measure nothing: print the table of an earlier --json report and draw it with --png")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr (tqdm)")


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Defaults that depend on the machine (CUDA or the CPU twin) and on --quick."""
    gpu = torch.cuda.is_available()
    default_sizes = [4, 16, 64, 256, 1024, 4096] if gpu else [4, 16, 64, 256]
    args.sizes = args.sizes or default_sizes
    args.paths = args.paths.split(",") if args.paths else None
    args.repeats = args.repeats or (5 if args.quick else 15)
    args.max_gib = args.max_gib or (0.25 if args.quick else 4.0)
    args.decode_layers = 8 if args.quick else 32
    args.decode_pages = 256 if args.quick else 1024
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="offload_bandwidth.py", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return resolve_args(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Measure (or read --from-json), print the table, write --json and --png. 2: a target cannot be written."""
    try:
        if args.png is not None:
            plots.check_target(args.png)
    except plots.PlotUnavailable as err:
        print(f"kvtier bench: {err}; nothing was measured", file=sys.stderr)
        return 2
    if args.json is not None and not args.json.parent.is_dir():
        print(f"kvtier bench: --json {str(args.json)!r}: folder {str(args.json.parent)!r} does not exist", file=sys.stderr)
        return 2
    if args.from_json is not None and not args.from_json.is_file():
        print(f"kvtier bench: --from-json {str(args.from_json)!r} does not exist", file=sys.stderr)
        return 2
    if args.from_json is not None:
        report = json.loads(args.from_json.read_text())
    elif torch.cuda.is_available():
        report = run_gpu(args)
    else:
        print("# no CUDA on this machine: running the CPU twin (TorchEngine) with small sizes", file=sys.stderr)
        report = run_cpu(args)
    print_table(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"# wrote {args.json}")
    if args.png:
        print(f"# wrote {write_png(report, args.png)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
