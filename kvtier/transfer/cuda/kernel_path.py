"""The kernel path: every layer of a transfer, data and scales, moved by one kernel launch.

Owns the launches of native/ (page_copy.cu, page_convert.cu): which kernel a transfer takes,
its argument record, and its grid. Argument records are prepacked once per (operation,
lane) with everything fixed for the engine's life (the device table, the host alias, the
lane's flags and counters); per transfer only the sequence number, slot buffer addresses,
page count and chunk counts are written into them before one cuLaunchKernel. Chunk counts
and grids are cached per page count. The grid is min(chunks, max_blocks): one block per SM
by default keeps megabytes of accesses in flight while leaving most of every SM to the
model; blocks take chunks layer-major, so the first layers land first.
Per-layer launches (first_layer = layer, one layer, no signals) remain for reloads that run
a user ReloadTransform after each layer, and the staged reload's chunks.
It must never choose pages, allocate device memory, or wait.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtier.format import PageFormat
from kvtier.transfer.cuda import plans
from kvtier.transfer.cuda.plans import THREADS
from kvtier.transfer.cuda.tickets import SlotBuffer, StreamLane


@dataclass(frozen=True)
class LaunchShape:
    """One kernel launch: its grid and the most SMs it can occupy at once."""

    kernel: str
    blocks: int
    threads: int
    sms: int


class Launch:
    """One kernel's argument record and the void* block pointing at it (kept alive together)."""

    __slots__ = ("kind", "name", "args", "params", "params_ptr", "index")

    def __init__(self, kind: str, name: str, args: np.ndarray) -> None:
        self.kind = kind
        self.name = name
        self.args = args
        self.params = np.array([args.ctypes.data], dtype=np.uint64)
        self.params_ptr = self.params.ctypes.data
        self.index = {field: i for i, field in enumerate(plans.ARG_FIELDS[kind])}


class KernelPath:
    """Kernel launches over one engine's tiers.

    table: plans.device_table of the device tier; table_ptr: its copy in device memory;
    records: the device address of the host records. launcher(launch, blocks, lane) issues
    one launch on the lane's stream (cuLaunchKernel on a GPU, the emulator in the CPU tests).
    """

    def __init__(self, fmt: PageFormat, table: np.ndarray, table_ptr: int, records: int, launcher, max_blocks: int, sm_count: int) -> None:
        self.fmt = fmt
        self.table = table
        self.table_ptr = table_ptr
        self.records = records
        self.launcher = launcher
        self.max_blocks = max_blocks
        self.sm_count = sm_count
        self.device_scales = fmt.device_has_scales
        self._launches: dict[tuple[str, int], Launch] = {}
        self._chunks: dict[tuple[str, int], plans.Chunks] = {}
        self.last_launch: LaunchShape | None = None
        if fmt.converts:
            fp8 = "e4m3" if fmt.dtype == "fp8_e4m3" else "e5m2"
            wide = "bf16" if fmt.device_dtype == "bf16" else "fp16"
            self.vec = plans.convert_vector(fmt, table)
            self.team = plans.team_size(plans.scale_groups(fmt).seg_count * plans.scale_groups(fmt).seg_len // self.vec)
            self.names = {
                "offload": f"quantize_{wide}_{fp8}_v{self.vec}",
                "reload": f"upcast_{fp8}_{wide}_v{self.vec}",
            }
        else:
            self.names = {op: f"copy_{op}_w{plans.data_word_bytes(fmt, table, records, op)}" for op in ("offload", "reload")}
        self.names["device"] = f"copy_device_w{plans.data_word_bytes(fmt, table, records, 'device')}"

    def _kind(self, op: str) -> str:
        if op == "device" or not self.fmt.converts:
            return "copy"
        return "quantize" if op == "offload" else "upcast"

    def _launch(self, op: str, lane: StreamLane | None) -> Launch:
        """The prepacked record of `op` signalling on `lane` (None: no signals)."""
        key = (op, id(lane))
        found = self._launches.get(key)
        if found is not None:
            return found
        kind, fmt = self._kind(op), self.fmt
        if kind == "copy":
            args = plans.copy_args(fmt, self.table_ptr, self.records, self.device_scales)
        elif kind == "upcast":
            args = plans.upcast_args(fmt, self.table_ptr, self.records)
        else:
            args = plans.quantize_args(fmt, self.table_ptr, self.records, self.vec)
        found = Launch(kind, self.names[op], args)
        if lane is not None:
            args[found.index["flags"]] = lane.flags_alias
            args[found.index["arrived"]] = lane.arrived_ptr
            args[found.index["finished"]] = lane.finished_ptr
        self._launches[key] = found
        return found

    def chunks(self, op: str, count: int) -> plans.Chunks:
        key = (op, count)
        found = self._chunks.get(key)
        if found is None:
            kind, fmt = self._kind(op), self.fmt
            if kind == "copy":
                width = int(self.names[op].rsplit("_w", 1)[1])
                found = plans.copy_chunks(fmt, count, width, self.device_scales)
            elif kind == "upcast":
                found = plans.upcast_chunks(fmt, count, self.vec)
            else:
                found = plans.quantize_chunks(fmt, count, self.team)
            self._chunks[key] = found
        return found

    def submit(
        self,
        op: str,
        lane: StreamLane,
        buffer: SlotBuffer,
        count: int,
        seq: int,
        layers: range | None = None,
        records: int | None = None,
    ) -> None:
        """Launch `op` ("offload", "reload", "device") over `count` pages of `buffer` on the lane's stream.

        layers None: every layer, signalled with `seq` on the lane's flags. A range: those
        layers only and no signals (the caller records events). records: where the records
        are read from (default: the host tier's alias; the staged reload's staging buffer).
        """
        signalled = layers is None
        launch = self._launch(op, lane if signalled else None)
        chunks = self.chunks(op, count)
        first, num_layers = (0, self.fmt.num_layers) if signalled else (layers.start, len(layers))
        args, at = launch.args, launch.index
        args[at["seq"]] = seq
        args[at["num_layers"]] = num_layers
        args[at["chunks_per_layer"]] = chunks.per_layer
        args[at["num_pages"]] = count
        args[at["first_layer"]] = first
        args[at["src_slots"]] = buffer.src_ptr
        args[at["dst_slots"]] = buffer.dst_ptr
        args[at["records"]] = self.records if records is None else records
        if launch.kind == "copy":
            args[at["data_chunks"]] = chunks.data
        elif launch.kind == "quantize":
            args[at["failed"]] = buffer.failed_ptr
        blocks = max(1, min(chunks.per_layer * num_layers, self.max_blocks))
        self.launcher(launch, blocks, lane)
        self.last_launch = LaunchShape(launch.name, blocks, THREADS, min(blocks, self.sm_count))
