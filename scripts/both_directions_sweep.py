"""Issue 25 goal 2 sweep: offload (device -> pinned host) and reload (host -> device) at once, per
copy kernel variant, launch shape and copy-engine pairing, at small pieces.

For every piece size (bytes of one (page, layer, plane) piece; 8 KiB to 256 KiB, 1 MiB as a
reference) it lays out a device tier (one region per (layer, plane), page stride = piece) and
pinned host records (page_format's layout: record = layers * planes pieces), picks scattered
slots (a random permutation: offload reads device slots A and writes host slots B, reload reads
host slots C and writes device slots D, A/D and B/C disjoint), and times, with CUDA events around
one call per direction (--mib per direction, default 128 MiB):
  - offload alone, reload alone, both at once on two streams (GB/s of all bytes moved);
  - the same run's limits: contiguous pinned cudaMemcpyAsync D2H, H2D and both at once.
Both streams are held by a cuStreamWaitValue32 gate on a mapped host flag until everything is
enqueued, so host submission (copy-engine batches of thousands of pieces) is not in the GPU time;
it is reported apart (submit_ms). The second stream waits on the first's start event, so the
time is one interval: start -> the later end.

Variants:
  kernel variants (native/page_copy.cu compiled by NVRTC with -D overrides, the real source):
    cur          the module kvtier loads (prebuilt cubin or its NVRTC build): 256 threads, unroll 4
    u2/u8/u16    KVTIER_COPY_UNROLL, 256 threads
    t128/t512    KVTIER_THREADS (and combinations, e.g. t512u8)
    se           KVTIER_COPY_STORE_EACH=1 (store each word right after its load; default: all
                 loads of a chunk before its stores)
  launch variants: blocks per direction = SMs/4, SMs/2, SMs (the engine's max_blocks), 2*SMs,
    4*SMs, occ (persistent: SMs * max resident blocks per SM), all (one block per chunk);
    asymmetric pairs (offload blocks, reload blocks); w8 (8-byte words instead of uint4);
    nosig (no per-layer signals; the engine always signals).
  copy engines: cudaMemcpyBatchAsync of every piece as kvtier's copy_engine_path (srcAccessOrder
    stream, PreferOverlapWithCompute when pieces <= 128 KiB, or the default flag), in batches of
    all / 1024 / 128 pieces, through cuda.bindings' runtime wrapper over Python lists ("ce:" rows),
    and through libcuda's cuMemcpyBatchAsync over numpy arrays as kvtier submits them ("ce-ctypes:"
    rows, driver.BatchMemcpy); pairings CE offload + kernel reload and kernel offload + CE reload.

Every variant's copy is checked bit-exact once per piece size (destinations poisoned, both
directions at once) before it is timed; a variant that fails the check is not timed. Fail-soft:
an exception in one variant is recorded and the sweep goes on. A time budget (--budget-s) skips
what is left, recorded as skipped. Results: $OUT/both_directions_sweep.json (OUT defaults to
/tmp), a table on stdout.

    OUT=/tmp/out python scripts/both_directions_sweep.py            # about 2-3 minutes
    python scripts/both_directions_sweep.py --sizes 16,64 --quick    # a smoke run
    python scripts/both_directions_sweep.py --variants cur --rows 'k:cur@sm$|^ce[:-]'   # copy-engine rows
    python scripts/both_directions_sweep.py --variants cur --rows '^ce-ctypes' --threads  # a thread a direction
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KIB = 1024
DEFAULT_SIZES = "8,16,32,64,128,256,1024"
POISON_DEV = 0xA5
POISON_HOST = 0x5A

# name -> -D overrides of native/page_copy.cu (None: the module kvtier itself loads).
KERNEL_VARIANTS = {
    "cur": None,
    "u2": {"KVTIER_COPY_UNROLL": 2},
    "u8": {"KVTIER_COPY_UNROLL": 8},
    "u16": {"KVTIER_COPY_UNROLL": 16},
    "t128": {"KVTIER_THREADS": 128},
    "t512": {"KVTIER_THREADS": 512},
    "t128u8": {"KVTIER_THREADS": 128, "KVTIER_COPY_UNROLL": 8},
    "t512u8": {"KVTIER_THREADS": 512, "KVTIER_COPY_UNROLL": 8},
    "t512u2": {"KVTIER_THREADS": 512, "KVTIER_COPY_UNROLL": 2},
    "se": {"KVTIER_COPY_STORE_EACH": 1},
    "u8se": {"KVTIER_COPY_UNROLL": 8, "KVTIER_COPY_STORE_EACH": 1},
}
QUICK_KERNEL_VARIANTS = ("cur", "u8", "t512", "se")


def compile_variant(capability: tuple[int, int], defines: dict) -> bytes:
    """native/page_copy.cu as kvtier.transfer.native compiles it (source text with includes inlined,
    COMPILE_OPTIONS, the GPU's architecture) plus -D overrides: a cubin, or NUL-terminated PTX
    where NVRTC does not know the GPU. Needs no GPU (the CPU check compiles every variant)."""
    from cuda.bindings import nvrtc

    from kvtier.transfer import native

    arch, cubin = native.target(capability)
    program, = native._nvrtc_check(
        nvrtc, nvrtc.nvrtcCreateProgram(native.source("page_copy").encode(), b"page_copy.cu", 0, [], []), "nvrtcCreateProgram")
    try:
        options = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in native.COMPILE_OPTIONS),
                   *(f"-D{k}={v}".encode() for k, v in defines.items())]
        native._nvrtc_check(nvrtc, nvrtc.nvrtcCompileProgram(program, len(options), options), f"compiling page_copy.cu {defines}", program)
        size_call, get_call = (nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN) if cubin else (nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX)
        size, = native._nvrtc_check(nvrtc, size_call(program), "size")
        image = b" " * size
        native._nvrtc_check(nvrtc, get_call(program, image), "image")
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    return image if cubin else image.rstrip(b"\0 ") + b"\0"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="piece sizes in KiB, comma separated (default %(default)s)")
    parser.add_argument("--mib", type=int, default=128, help="MiB moved per direction per call (default %(default)s)")
    parser.add_argument("--layers", type=int, default=4, help="layers of a page (default %(default)s; 2 planes, K and V)")
    parser.add_argument("--reps", type=int, default=5, help="timed reps per point, median reported (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed reps per point (default %(default)s)")
    parser.add_argument("--budget-s", type=float, default=170.0, help="stop starting new variants after this (default %(default)s)")
    parser.add_argument("--variants", default="", help="only kernel variants with these names (comma separated)")
    parser.add_argument("--rows", default="", help="only rows whose label matches this regular expression")
    parser.add_argument("--quick", action="store_true", help="fewer variants and reps (a smoke run)")
    parser.add_argument("--no-gate", action="store_true", help="do not hold the streams until everything is enqueued")
    parser.add_argument("--threads", action="store_true",
                        help="each direction queues from a thread of its own (as the pool's offload thread beside a "
                             "loading caller); submit ms is then the wall time until both have queued")
    parser.add_argument("--seed", type=int, default=25)
    parser.add_argument("--compile-check", metavar="SM", default="",
                        help="no GPU: compile every kernel variant with NVRTC for sm_SM (e.g. 90) and exit")
    return parser.parse_args(argv)


class Sweep:
    """Buffers, streams, kernels and timing of one run (one GPU)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import numpy as np
        import torch
        from cuda.bindings import driver

        from kvtier.transfer import native
        from kvtier.transfer.cuda import plans
        from kvtier.transfer.cuda.driver import Driver

        self.np, self.torch, self.cu, self.native, self.plans = np, torch, driver, native, plans
        self.args = args
        self.device = torch.device("cuda", 0)
        torch.cuda.set_device(self.device)
        torch.zeros(1, device=self.device)
        self.drv = Driver(self.device)
        props = torch.cuda.get_device_properties(self.device)
        self.sms = props.multi_processor_count
        self.capability = torch.cuda.get_device_capability(self.device)
        self.gpu = props.name
        self.planes = 2
        self.layers = args.layers
        self.bytes_per_dir = args.mib * 1024 * 1024
        # Device tier and host records, twice the bytes of one direction each (two slot sets).
        self.dev = torch.empty(2 * self.bytes_per_dir, dtype=torch.uint8, device=self.device)
        self.host = torch.empty(2 * self.bytes_per_dir, dtype=torch.uint8, pin_memory=True)
        gen = torch.Generator(device=self.device).manual_seed(args.seed)
        self.dev.random_(generator=gen)
        self.host.copy_(torch.empty_like(self.dev).random_(generator=gen))
        torch.cuda.synchronize()
        self.host_alias = self.drv.host_device_pointer(self.host.data_ptr())
        self.streams = [torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)]
        # Gate: a mapped pinned int32 the first stream waits on until everything is enqueued.
        self.gate = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self.gate_np = self.gate.numpy()
        self.gate_alias = self.drv.host_device_pointer(self.gate.data_ptr())
        self.gate_seq = 0
        self.lanes = [self._lane() for _ in self.streams]
        self.gate_note = "off (--no-gate)" if args.no_gate else self._try_gate()
        self.modules: dict[str, object] = {}
        self.functions: dict[tuple[str, str], int] = {}
        self.occupancy: dict[tuple[str, str], int] = {}
        self.runtime = None
        self.batch = None  # kvtier driver.BatchMemcpy, made at the first ctypes variant
        self.ce_attributes: dict[bool, object] = {}
        self.layout = None

    def _try_gate(self) -> str:
        """Hold a stream on the gate once; where stream memory operations fail, time without it."""
        try:
            self.gate_seq += 1
            try:
                self.drv.wait_value(self.streams[0].cuda_stream, self.gate_alias, self.gate_seq)
            finally:
                self.gate_np[0] = self.gate_seq
            self.streams[0].synchronize()
            return "on"
        except Exception as error:  # noqa: BLE001 - the sweep still runs, submission inside the times
            self.args.no_gate = True
            return f"off ({error!r})"

    # --- per-stream signals (as the engine's lanes) ------------------------------------------
    def _lane(self) -> dict:
        torch, plans = self.torch, self.plans
        flags = torch.zeros(max(32, self.layers + 1), dtype=torch.int32, pin_memory=True)
        arrived = torch.zeros(self.layers, dtype=torch.int32, device=self.device)
        finished = torch.zeros(1, dtype=torch.int32, device=self.device)
        args = self.np.zeros(len(plans.COPY_FIELDS), dtype=self.np.int64)
        params = self.np.array([args.ctypes.data], dtype=self.np.uint64)
        return {"flags": flags, "flags_alias": self.drv.host_device_pointer(flags.data_ptr()), "arrived": arrived,
                "finished": finished, "args": args, "params": params, "seq": 0}

    # --- kernels ---------------------------------------------------------------------------
    def kernel(self, variant: str, name: str) -> int:
        key = (variant, name)
        if key in self.functions:
            return self.functions[key]
        defines = KERNEL_VARIANTS[variant]
        if defines is None:
            handle = self.native.function(self.device.index, "page_copy", name)
        else:
            module = self.modules.get(variant)
            if module is None:
                module = self.modules[variant] = self._compile(defines)
            cu = self.cu
            error, found = cu.cuModuleGetFunction(module, name.encode())
            if error != cu.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuModuleGetFunction({name}) of variant {variant}: {error.name}")
            handle = int(found)
        self.functions[key] = handle
        error, blocks = self.cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(self.cu.CUfunction(handle), self.threads(variant), 0)
        self.occupancy[key] = int(blocks) if error == self.cu.CUresult.CUDA_SUCCESS else 1
        return handle

    def threads(self, variant: str) -> int:
        return int((KERNEL_VARIANTS[variant] or {}).get("KVTIER_THREADS", 256))

    def unroll(self, variant: str) -> int:
        return int((KERNEL_VARIANTS[variant] or {}).get("KVTIER_COPY_UNROLL", 4))

    def _compile(self, defines: dict):
        """native/page_copy.cu (the text kvtier compiles) built by NVRTC with kvtier's options plus -D overrides."""
        cu, np = self.cu, self.np
        image = compile_variant(self.capability, defines)
        error, device = cu.cuDeviceGet(self.device.index)
        error, context = cu.cuDevicePrimaryCtxRetain(device)
        cu.cuCtxPushCurrent(context)
        try:
            buffer = np.frombuffer(image, dtype=np.uint8)
            error, module = cu.cuModuleLoadData(buffer.ctypes.data)
        finally:
            cu.cuCtxPopCurrent()
        if error != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuModuleLoadData of variant {defines}: {error.name}")
        return module

    # --- layout of one piece size ------------------------------------------------------------
    def set_piece(self, piece: int) -> dict:
        np, torch = self.np, self.torch
        record = self.layers * self.planes * piece
        n = self.bytes_per_dir // record
        if n < 1:
            raise ValueError(f"a page of {record} bytes is more than --mib {self.args.mib}: raise --mib")
        slots = 2 * n
        rng = np.random.default_rng(self.args.seed + piece)
        dev_perm, host_perm = rng.permutation(slots), rng.permutation(slots)
        slot_sets = {  # (source slots, destination slots) per direction
            "offload": (dev_perm[:n], host_perm[:n]),
            "reload": (host_perm[n:], dev_perm[n:]),
        }
        rows = self.layers * self.planes
        table = np.zeros((4, rows), dtype=np.int64)
        base = self.dev.data_ptr()
        for row in range(rows):
            table[0, row] = base + row * slots * piece
            table[1, row] = piece
        table_dev = torch.from_numpy(table).to(self.device)
        slot_dev = {op: tuple(torch.from_numpy(s.astype(np.int32)).to(self.device) for s in pair) for op, pair in slot_sets.items()}
        torch.cuda.synchronize()
        self.layout = {"piece": piece, "record": record, "pages": n, "slots": slots, "table": table, "table_dev": table_dev,
                       "slot_sets": slot_sets, "slot_dev": slot_dev, "ce": {}}
        return self.layout

    def dev_view(self):
        lay = self.layout
        return self.dev.view(self.layers, self.planes, lay["slots"], lay["piece"])

    def host_view(self):
        lay = self.layout
        return self.host.view(lay["slots"], self.layers, self.planes, lay["piece"])

    # --- enqueueing one direction --------------------------------------------------------------
    def kernel_call(self, lane_index: int, op: str, variant: str, blocks: str, word: int = 16, signals: bool = True):
        """A callable that launches variant's copy_<op>_w<word> over the layout's pages on the lane's stream."""
        plans, lay = self.plans, self.layout
        name = f"copy_{op}_w{word}"
        function = self.kernel(variant, name)
        threads, unroll = self.threads(variant), self.unroll(variant)
        chunk = threads * unroll
        units = lay["pages"] * self.planes * (lay["piece"] // word)
        data_chunks = -(-units // chunk)
        total = data_chunks * self.layers
        grid = self.grid(blocks, variant, name, total)
        lane = self.lanes[lane_index]
        stream = self.streams[lane_index]
        src, dst = lay["slot_dev"][op]
        values = {
            "flags": lane["flags_alias"] if signals else 0, "arrived": lane["arrived"].data_ptr(), "finished": lane["finished"].data_ptr(),
            "num_layers": self.layers, "chunks_per_layer": data_chunks, "table": lay["table_dev"].data_ptr(),
            "records": self.host_alias, "src_slots": src.data_ptr(), "dst_slots": dst.data_ptr(), "num_pages": lay["pages"],
            "first_layer": 0, "planes": self.planes, "table_row": self.layers * self.planes, "record_bytes": lay["record"],
            "data_bytes": lay["record"], "plane_data_bytes": lay["piece"], "piece_bytes": lay["piece"], "scale_piece_bytes": 0,
            "data_chunks": data_chunks,
        }
        fields = plans.COPY_FIELDS
        seq_at = fields.index("seq")
        drv = self.drv

        def call():
            args = lane["args"]
            for key, value in values.items():
                args[fields.index(key)] = value
            lane["seq"] = (lane["seq"] + 1) & 0x7FFFFFFF
            args[seq_at] = lane["seq"]
            drv.launch(function, grid, threads, stream.cuda_stream, lane["params"].ctypes.data, name)

        call.grid = grid
        call.threads = threads
        return call

    def grid(self, blocks: str, variant: str, name: str, total: int) -> int:
        sms = self.sms
        caps = {"sm/4": max(1, sms // 4), "sm/2": max(1, sms // 2), "sm": sms, "2sm": 2 * sms, "4sm": 4 * sms,
                "occ": sms * max(1, self.occupancy.get((variant, name), 1)), "all": total}
        return max(1, min(total, caps[blocks]))

    def ce_call(self, lane_index: int, op: str, batch: int | None, flag: str = "auto", via: str = "bindings"):
        """A callable that copies every piece of `op` with cudaMemcpyBatchAsync (batches of `batch` pieces; None: one call),
        through cuda.bindings' runtime wrapper over lists (via="bindings") or libcuda through ctypes over numpy
        arrays (via="ctypes", kvtier's driver.BatchMemcpy)."""
        np, lay = self.np, self.layout
        if self.runtime is None:
            from kvtier.transfer.cuda.copy_engine_path import batch_memcpy_runtime

            self.runtime = batch_memcpy_runtime()
            if self.runtime is None:
                raise RuntimeError("cuda.bindings has no cudaMemcpyBatchAsync")
        runtime = self.runtime
        key = op
        if key not in lay["ce"]:
            src_slots, dst_slots = lay["slot_sets"][op]
            piece, slots, record = lay["piece"], lay["slots"], lay["record"]
            rows = np.arange(self.layers * self.planes, dtype=np.int64)
            dev_base, host_base = self.dev.data_ptr(), self.host.data_ptr()

            def dev_addr(s):
                return (dev_base + rows[None, :] * slots * piece + s.astype(np.int64)[:, None] * piece).ravel()

            def host_addr(s):
                return (host_base + s.astype(np.int64)[:, None] * record + rows[None, :] * piece).ravel()

            if op == "offload":
                src, dst = dev_addr(src_slots), host_addr(dst_slots)
            else:
                src, dst = host_addr(src_slots), dev_addr(dst_slots)
            lay["ce"][key] = (dst.astype(np.uint64), src.astype(np.uint64), np.full(src.size, piece, dtype=np.uint64))
        overlap = lay["piece"] <= 128 * KIB if flag == "auto" else flag == "overlap"
        stream = self.streams[lane_index]
        if via == "ctypes":
            if self.batch is None:
                from kvtier.transfer.cuda.driver import Driver

                self.batch = Driver(self.torch.device("cuda")).batch_memcpy
                if self.batch is None:
                    raise RuntimeError("libcuda has no cuMemcpyBatchAsync reachable through ctypes")
            arrays = lay["ce"][key]
            step = arrays[0].size if batch is None else batch
            chunks = [tuple(a[i:i + step] for a in arrays) for i in range(0, arrays[0].size, step)]
            submit = self.batch

            def call_ctypes():
                handle = stream.cuda_stream
                for d, s, z in chunks:
                    submit(handle, d, s, z, overlap)

            return call_ctypes
        dst, src, sizes = (a.tolist() for a in lay["ce"][key])
        attributes = self.ce_attributes.get(overlap)
        if attributes is None:
            attributes = runtime.cudaMemcpyAttributes()
            attributes.srcAccessOrder = runtime.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
            attributes.flags = (runtime.cudaMemcpyFlags.cudaMemcpyFlagPreferOverlapWithCompute if overlap
                                else runtime.cudaMemcpyFlags.cudaMemcpyFlagDefault)
            self.ce_attributes[overlap] = attributes
        step = len(src) if batch is None else batch
        parts = [(dst[i:i + step], src[i:i + step], sizes[i:i + step]) for i in range(0, len(src), step)]

        def call():
            handle = stream.cuda_stream
            for d, s, z in parts:
                result = runtime.cudaMemcpyBatchAsync(d, s, z, len(d), [attributes], [0], 1, handle)
                if result[0] != runtime.cudaError_t.cudaSuccess:
                    raise RuntimeError(f"cudaMemcpyBatchAsync of {len(d)} copies failed: {result[0].name}")

        return call

    def contiguous_call(self, lane_index: int, op: str):
        """cudaMemcpyAsync (torch copy_ of pinned memory) of one contiguous block of bytes_per_dir."""
        torch, count = self.torch, self.bytes_per_dir
        stream = self.streams[lane_index]
        if op == "offload":
            src, dst = self.dev[:count], self.host[:count]
        else:
            src, dst = self.host[count:2 * count], self.dev[count:2 * count]

        def call():
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)

        return call

    # --- checking and timing -----------------------------------------------------------------
    def check(self, calls: dict) -> None:
        """Poison the destinations of `calls` ({op: (lane, callable)}), run them at once, compare bit-exact."""
        torch, lay = self.torch, self.layout
        torch.cuda.synchronize()
        dev, host = self.dev_view(), self.host_view()
        if "offload" in calls:
            host[torch.from_numpy(lay["slot_sets"]["offload"][1])] = POISON_HOST
        if "reload" in calls:
            dev[:, :, lay["slot_dev"]["reload"][1].long()] = POISON_DEV
        torch.cuda.synchronize()
        self.time_once([(lane, call) for lane, call in calls.values()])
        torch.cuda.synchronize()
        host_on_dev = self.host.to(self.device).view(lay["slots"], self.layers, self.planes, lay["piece"])
        bad = []
        if "offload" in calls:
            src, dst = (s.long() for s in lay["slot_dev"]["offload"])
            if not torch.equal(host_on_dev[dst], dev[:, :, src].permute(2, 0, 1, 3)):
                bad.append("offload")
        if "reload" in calls:
            src, dst = (s.long() for s in lay["slot_dev"]["reload"])
            if not torch.equal(dev[:, :, dst], host_on_dev[src].permute(1, 2, 0, 3)):
                bad.append("reload")
        del host_on_dev
        if bad:
            raise AssertionError(f"not bit-exact: {', '.join(bad)}")

    def time_once(self, lanes: list) -> tuple[float, float]:
        """(GPU ms from the first stream's start to the last end, host ms to enqueue) of one rep.

        lanes: [(lane index, callable)], lane indices distinct."""
        torch, drv = self.torch, self.drv
        first = self.streams[lanes[0][0]]
        start = torch.cuda.Event(enable_timing=True)
        ends = [torch.cuda.Event(enable_timing=True) for _ in lanes]
        gated = not self.args.no_gate
        self.gate_seq = (self.gate_seq + 1) & 0x7FFFFFFF or 1
        try:
            if gated:
                drv.wait_value(first.cuda_stream, self.gate_alias, self.gate_seq)
            start.record(first)
            for index, _ in lanes[1:]:
                self.streams[index].wait_event(start)
            if self.args.threads and len(lanes) > 1:
                submit = self._submit_threads([call for _, call in lanes], self.device)
            else:
                t0 = time.perf_counter()
                for (index, call), end in zip(lanes, ends):
                    call()
                submit = (time.perf_counter() - t0) * 1e3
            for (index, _), end in zip(lanes, ends):
                end.record(self.streams[index])
        finally:
            self.gate_np[0] = self.gate_seq
        for index, _ in lanes:
            self.streams[index].synchronize()
        return max(start.elapsed_time(end) for end in ends), submit

    def _submit_threads(self, calls: list, device) -> float:
        """Run each call on a thread of its own (the device's context made current there first),
        all released at once; ms until the last returns."""
        barrier = threading.Barrier(len(calls) + 1)
        errors: list = []

        def run(call):
            try:
                self.torch.cuda.set_device(device)
                self.torch.cuda.current_stream(device).synchronize()  # the primary context, current here
            except BaseException as error:  # noqa: BLE001 - raised on the caller's thread below
                errors.append(error)
                call = None
            barrier.wait()  # reached even when the set-up failed, so no thread waits forever
            if call is None:
                return
            try:
                call()
            except BaseException as error:  # noqa: BLE001 - raised on the caller's thread below
                errors.append(error)

        workers = [threading.Thread(target=run, args=(call,)) for call in calls]
        for worker in workers:
            worker.start()
        barrier.wait()
        t0 = time.perf_counter()
        for worker in workers:
            worker.join()
        submit = (time.perf_counter() - t0) * 1e3
        if errors:
            raise errors[0]
        return submit

    def measure(self, lanes: list, nbytes: int) -> dict:
        for _ in range(self.args.warmup):
            self.time_once(lanes)
        runs = [self.time_once(lanes) for _ in range(self.args.reps)]
        gpu = sorted(r[0] for r in runs)
        submit = sorted(r[1] for r in runs)
        median = gpu[len(gpu) // 2]
        return {"gbps": nbytes / (median * 1e-3) / 1e9, "ms": median, "ms_min": gpu[0], "ms_max": gpu[-1],
                "submit_ms": submit[len(submit) // 2]}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compile_check:
        capability = (int(args.compile_check[:-1]), int(args.compile_check[-1]))
        failed = 0
        for name, defines in KERNEL_VARIANTS.items():
            try:
                image = compile_variant(capability, defines or {})
                print(f"{name:<8} {defines or '(defaults)'}: {len(image)} B")
            except Exception as error:  # noqa: BLE001
                failed += 1
                print(f"{name:<8} {defines}: FAILED {error}")
        return 1 if failed else 0
    out_dir = Path(os.environ.get("OUT", "/tmp"))
    out_dir.mkdir(parents=True, exist_ok=True)
    out_path = out_dir / "both_directions_sweep.json"
    if args.quick:
        args.reps, args.warmup = min(args.reps, 3), 1
    t_start = time.perf_counter()
    report: dict = {"args": vars(args), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "sizes": {}, "errors": []}

    def save() -> None:
        report["elapsed_s"] = time.perf_counter() - t_start
        out_path.write_text(json.dumps(report, indent=1, default=str))

    try:
        sweep = Sweep(args)
    except Exception as error:  # noqa: BLE001 - nothing can run without the setup
        report["errors"].append({"setup": repr(error), "trace": traceback.format_exc()})
        save()
        print(traceback.format_exc())
        return 1
    import torch

    report["gpu"] = {"name": sweep.gpu, "sms": sweep.sms, "capability": list(sweep.capability), "torch": torch.__version__}
    report["gate"] = sweep.gate_note
    try:
        import cuda.bindings

        report["gpu"]["cuda_bindings"] = cuda.bindings.__version__
        report["gpu"]["driver"] = sweep.cu.cuDriverGetVersion()[1]
    except Exception:  # noqa: BLE001
        pass
    names = [v for v in (args.variants.split(",") if args.variants else
                         (QUICK_KERNEL_VARIANTS if args.quick else KERNEL_VARIANTS)) if v in KERNEL_VARIANTS]
    if "cur" not in names:
        names.insert(0, "cur")
    sizes = [int(s) * KIB for s in args.sizes.split(",") if s.strip()]
    bytes_dir = sweep.bytes_per_dir

    # (label, kind, {op: spec}) where spec = ("k", variant, blocks, word, signals) | ("ce", batch, flag)
    def plan() -> list:
        rows = []
        for variant in names:
            block_set = ("sm/4", "sm/2", "sm", "2sm", "4sm", "occ", "all") if variant == "cur" else ("sm/2", "sm", "2sm")
            if args.quick:
                block_set = ("sm/2", "sm", "2sm") if variant == "cur" else ("sm",)
            for blocks in block_set:
                spec = ("k", variant, blocks, 16, True)
                rows.append((f"k:{variant}@{blocks}", "sym", {"offload": spec, "reload": spec}))
        for b_off, b_rel in (("sm", "sm/2"), ("sm/2", "sm"), ("sm", "2sm"), ("2sm", "sm"), ("sm/4", "sm"), ("sm", "sm/4")):
            rows.append((f"k:cur off@{b_off} + rel@{b_rel}", "both_only",
                         {"offload": ("k", "cur", b_off, 16, True), "reload": ("k", "cur", b_rel, 16, True)}))
        for blocks in ("sm", "2sm"):
            spec = ("k", "cur", blocks, 8, True)
            rows.append((f"k:cur w8@{blocks}", "sym", {"offload": spec, "reload": spec}))
        spec = ("k", "cur", "sm", 16, False)
        rows.append(("k:cur nosig@sm", "sym", {"offload": spec, "reload": spec}))
        for batch in ((None, 1024, 128) if not args.quick else (None,)):
            for flag in (("auto", "default") if batch is None else ("auto",)):
                spec = ("ce", batch, flag, "bindings")
                rows.append((f"ce:batch={batch or 'all'} flag={flag}", "sym", {"offload": spec, "reload": spec}))
        for batch in (None, 4096, 1024):
            for flag in (("auto", "default") if batch is None else ("auto",)):
                spec = ("ce", batch, flag, "ctypes")
                rows.append((f"ce-ctypes:batch={batch or 'all'} flag={flag}", "sym", {"offload": spec, "reload": spec}))
        for blocks in (("sm/2", "sm", "2sm") if not args.quick else ("sm",)):
            rows.append((f"ce off + k:cur rel@{blocks}", "both_only",
                         {"offload": ("ce", None, "auto", "bindings"), "reload": ("k", "cur", blocks, 16, True)}))
            rows.append((f"k:cur off@{blocks} + ce rel", "both_only",
                         {"offload": ("k", "cur", blocks, 16, True), "reload": ("ce", None, "auto", "bindings")}))
        if args.rows:
            pattern = re.compile(args.rows)
            rows = [row for row in rows if pattern.search(row[0])]
        return rows

    def make(lane: int, op: str, spec: tuple):
        if spec[0] == "k":
            _, variant, blocks, word, signals = spec
            return sweep.kernel_call(lane, op, variant, blocks, word, signals)
        _, batch, flag, via = spec
        return sweep.ce_call(lane, op, batch, flag, via)

    lane_of = {"offload": 0, "reload": 1}
    print(f"# {sweep.gpu}, {sweep.sms} SMs, {args.mib} MiB per direction per call, {args.layers} layers x 2 planes, "
          f"median of {args.reps}, gate {sweep.gate_note}", flush=True)
    for piece in sizes:
        key = f"{piece // KIB}KiB"
        entry: dict = {"limits": {}, "variants": {}}
        report["sizes"][key] = entry
        try:
            lay = sweep.set_piece(piece)
            entry["pages"], entry["pieces_per_direction"] = lay["pages"], lay["pages"] * args.layers * 2
            moved = lay["pages"] * lay["record"]  # bytes of one direction's call (bytes_dir where it divides)
        except Exception as error:  # noqa: BLE001
            entry["error"] = repr(error)
            print(f"\n## piece {key}: ERROR {error!r}", flush=True)
            report["errors"].append({"size": key, "error": repr(error), "trace": traceback.format_exc()})
            save()
            continue
        # Same-run limits: contiguous pinned cudaMemcpyAsync.
        try:
            d2h, h2d = sweep.contiguous_call(0, "offload"), sweep.contiguous_call(1, "reload")
            entry["limits"] = {"d2h": sweep.measure([(0, d2h)], bytes_dir), "h2d": sweep.measure([(1, h2d)], bytes_dir),
                               "both": sweep.measure([(0, d2h), (1, h2d)], 2 * bytes_dir)}
        except Exception as error:  # noqa: BLE001
            entry["limits"]["error"] = repr(error)
            report["errors"].append({"size": key, "limits": repr(error), "trace": traceback.format_exc()})
        limit_both = entry["limits"].get("both", {}).get("gbps")
        lim = entry["limits"]
        print(f"\n## piece {key}: {entry['pages']} pages, {entry['pieces_per_direction']} pieces per direction; limits "
              + " ".join(f"{k} {v['gbps']:.1f}" for k, v in lim.items() if isinstance(v, dict)) + " GB/s", flush=True)
        print(f"{'variant':<36} {'grid':>11} {'offload':>8} {'reload':>8} {'both':>8} {'x limit':>8} {'submit ms':>9}")
        for label, kind, specs in plan():
            if time.perf_counter() - t_start > args.budget_s:
                entry["variants"][label] = {"skipped": "time budget"}
                continue
            result: dict = {}
            entry["variants"][label] = result
            try:
                calls = {op: make(lane_of[op], op, spec) for op, spec in specs.items()}
                result["grid"] = {op: getattr(call, "grid", None) for op, call in calls.items()}
                sweep.check({op: (lane_of[op], call) for op, call in calls.items()})
                result["bit_exact"] = True
                if kind == "sym":
                    result["offload"] = sweep.measure([(0, calls["offload"])], moved)
                    result["reload"] = sweep.measure([(1, calls["reload"])], moved)
                result["both"] = sweep.measure([(0, calls["offload"]), (1, calls["reload"])], 2 * moved)
                if limit_both:
                    result["both_x_limit"] = result["both"]["gbps"] / limit_both
            except Exception as error:  # noqa: BLE001 - fail soft per variant
                result["error"] = repr(error)
                report["errors"].append({"size": key, "variant": label, "error": repr(error), "trace": traceback.format_exc()})
                try:
                    torch.cuda.synchronize()
                except Exception:  # noqa: BLE001 - a sticky error ends the run below
                    report["errors"].append({"fatal": "CUDA context unusable", "trace": traceback.format_exc()})
                    save()
                    print(f"{label:<36} ERROR {error!r}; CUDA context unusable, stopping")
                    return 1

            def g(op):
                return f"{result[op]['gbps']:8.1f}" if op in result else f"{'-':>8}"

            grid = "/".join(str(v) if v is not None else "ce" for v in result.get("grid", {}).values())
            if "error" in result:
                print(f"{label:<36} ERROR {result['error'][:120]}", flush=True)
            else:
                x = f"{result['both_x_limit']:8.2f}" if "both_x_limit" in result else f"{'-':>8}"
                submit = result["both"]["submit_ms"]
                print(f"{label:<36} {grid:>11} {g('offload')} {g('reload')} {g('both')} {x} {submit:9.2f}", flush=True)
        save()

    # Summary: the best both-at-once variant per size.
    print("\n## best both-at-once per piece size (x = of the same size's contiguous both-directions limit)")
    summary = {}
    for key, entry in report["sizes"].items():
        done = [(label, r) for label, r in entry.get("variants", {}).items() if "both_x_limit" in r]
        if not done:
            continue
        best = max(done, key=lambda item: item[1]["both_x_limit"])
        kernel_only = [(label, r) for label, r in done if "ce" not in label]
        best_k = max(kernel_only, key=lambda item: item[1]["both_x_limit"]) if kernel_only else None
        cur = entry["variants"].get("k:cur@sm", {})
        summary[key] = {"best": best[0], "best_x": best[1]["both_x_limit"],
                        "best_kernel_only": best_k[0] if best_k else None,
                        "best_kernel_only_x": best_k[1]["both_x_limit"] if best_k else None,
                        "current_x": cur.get("both_x_limit")}
        print(f"{key:>8}: best {best[0]} {best[1]['both_x_limit']:.2f}x; kernels only "
              + (f"{best_k[0]} {best_k[1]['both_x_limit']:.2f}x" if best_k else "-")
              + (f"; current k:cur@sm {cur['both_x_limit']:.2f}x" if "both_x_limit" in cur else ""))
    report["summary"] = summary
    save()
    print(f"\nwrote {out_path} ({len(report['errors'])} errors, {time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
