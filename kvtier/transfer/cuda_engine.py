"""The CUDA copy engine: page moves between the device tier and pinned host records on streams.

Owns the CUDA side of kvtier.transfer: its offload, reload and device-copy streams, the
events that order them against the caller's stream, and three ways to move bytes:

- "kernel": SM kernels from native/ (page_copy.cu, page_convert.cu; CuPy/NVRTC) read or
  write the pinned host records straight through their device alias (UVA): one pass over
  PCIe, any page size, scattered slots, and the only path that converts dtypes (fused
  quantize on offload, fused upcast on reload).
- "copy_engine": cudaMemcpyBatchAsync (cuda.bindings) on the engine's created stream, one
  copy per (page, layer, plane) piece, pieces adjacent on both sides merged into runs. No SM
  is used, so it never slows the model; it needs large pieces to reach PCIe speed (DESIGN.md,
  "Copy mechanisms"). Pass-through only.
- "staged" (converting reloads; elsewhere it acts as "auto"): the copy engines move whole fp8
  records into a device staging buffer, then the upcast kernel converts them from HBM. SMs
  read host memory at about 51 GB/s, the copy engines at 55, so this delivers more bf16 bytes
  per second, but every layer is ready only once all records have landed: for bulk prefetch
  ahead of need, not for layer-by-layer overlap with attention.
- "torch": a device staging buffer laid out as host records (index_select), then one
  cudaMemcpyAsync per run of consecutive host slots (and the reverse). The fallback when CuPy
  is missing, and a second reference in the tests. Its quantize goes through the codec, whose
  NaN check syncs the offload stream with the host: a fallback, not the hot path.

"auto" takes the copy engines when a transfer passes bytes through and every (layer, plane)
piece is at least COPY_ENGINE_MIN_PIECE bytes, else the kernel, and torch where CuPy is
missing (or the GPU predates fp8 conversion instructions, sm_89, for a converting format).
`last_path` and `last_launch` say what the latest transfer used.

Ordering (engine.py's rules): offload waits on `ready`; reload records one event per layer
after that layer's bytes and the user transform, and also takes a `ready` (the destination
slots may still be read by attention queued on the caller's stream); device_copy waits on the
caller's current stream. Slot lists travel to the GPU through pinned staging and a
non-blocking copy on the copy's own stream, so submitting never blocks the host. Memory a
copy reads (slot arrays, staging) was allocated on the copy's stream and is kept by its
ticket until done; torch's allocators also keep it stream-ordered should the ticket be
dropped early.
It must never choose which pages move, block the host on the hot path, or use the legacy
default stream (cudaMemcpyBatchAsync rejects it).

The address arithmetic (Region, PieceCopy, ScaleGroups, expand/merge of copies) is plain
Python over the PageFormat, so the CPU tests check it against TorchEngine without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvtier.format import FP8_MAX, PageFormat, dequantize, quantize
from kvtier.tiers import DeviceTier, HostTier
from kvtier.transfer import native
from kvtier.transfer.engine import DoneTicket, ReloadTransform, Ticket, TransferEngine

PATHS = ("auto", "kernel", "copy_engine", "staged", "torch")
# Measured on the H200 (BENCHMARKS.md, 2026-12-02): from 128 KiB pieces the copy engines
# move 55 GB/s against the SM kernel's 52, and the host queues a piece (about 1.8 us)
# faster than the engines move it (2.4 us), so they keep up; below that, queueing falls
# behind and the kernel wins end to end. Copy engines also leave every SM to the model.
COPY_ENGINE_MIN_PIECE = 128 * 1024
# Threads per block and words per thread per loop trip of native/*.cu (KVTIER_THREADS,
# KVTIER_UNROLL): the grid is sized so each thread has work for a few trips at most.
THREADS = 256
COPY_UNROLL = 4
CONVERT_UNROLL = 2
# cudaMemcpyFlagPreferOverlapWithCompute pays off only for small copies: cudf measured the
# crossover at 128 KiB on GB300, GB10 and an RTX PRO GPU (cudf pull request #23675). Not yet
# measured on the H200: the benchmark's copy_engine rows are where to check it.
PREFER_OVERLAP_MAX_COPY = 128 * 1024
# Device staging of the torch path is bounded; larger batches go through it in chunks.
TORCH_STAGING_BYTES = 256 * 1024 * 1024
# Chunks of a staged reload: the upcast of one overlaps the DMA of the next, so only the last
# chunk's upcast (an eighth) is not hidden behind PCIe.
STAGED_CHUNKS = 8
FP8_CONVERT_CAPABILITY = (8, 9)


# --- address plans ----------------------------------------------------------------------
@dataclass(frozen=True)
class Region:
    """Where piece j of slot s lies in one buffer: offset + s * slot_stride + j * piece_stride (bytes)."""

    offset: int
    slot_stride: int
    piece_stride: int


@dataclass(frozen=True)
class PieceCopy:
    """`num_pieces` pieces of `piece_bytes` for every (src slot, dst slot) pair of a batch.

    `scales` says the device side is the device tier's scale tensor rather than its pages.
    """

    src: Region
    dst: Region
    num_pieces: int
    piece_bytes: int
    scales: bool


def device_data_region(fmt: PageFormat, device_pages: int, first_layer: int) -> Region:
    plane = fmt.device_plane_bytes
    return Region(first_layer * fmt.planes * device_pages * plane, plane, device_pages * plane)


def device_scale_region(fmt: PageFormat, device_pages: int, first_layer: int) -> Region:
    plane = fmt.plane_scale_bytes
    return Region(first_layer * fmt.planes * device_pages * plane, plane, device_pages * plane)


def host_data_region(fmt: PageFormat, first_layer: int) -> Region:
    return Region(fmt.data_offset(first_layer, 0), fmt.page_bytes, fmt.plane_data_bytes)


def host_scale_region(fmt: PageFormat, first_layer: int) -> Region:
    return Region(fmt.scale_offset(first_layer, 0), fmt.page_bytes, fmt.plane_scale_bytes)


def passthrough_copies(fmt: PageFormat, device_pages: int, layers: range, direction: str) -> list[PieceCopy]:
    """The piece copies moving `layers` as bytes in `direction`, data first, then device scales.

    direction: "offload" (device -> host) and "reload" (host -> device) for formats that do
    not convert; "device" (device -> device) for any format, since both sides hold the
    device dtype.
    """
    if layers.step != 1 or not 0 <= layers.start < layers.stop <= fmt.num_layers:
        raise ValueError(f"layers must be a non-empty unit-step range within [0, {fmt.num_layers}), got {layers}")
    if direction not in ("offload", "reload", "device"):
        raise ValueError(f"direction must be 'offload', 'reload' or 'device', got {direction!r}")
    if fmt.converts and direction != "device":
        raise ValueError(f"{direction} of {fmt.describe()} converts dtypes; it has no pass-through copies")
    pieces = len(layers) * fmt.planes
    sides = [(device_data_region, host_data_region, fmt.device_plane_bytes, False)]
    if fmt.device_has_scales:
        sides.append((device_scale_region, host_scale_region, fmt.plane_scale_bytes, True))
    copies = []
    for device_region, host_region, piece_bytes, scales in sides:
        dev = device_region(fmt, device_pages, layers.start)
        host = host_region(fmt, layers.start)
        if direction == "device":
            copies.append(PieceCopy(dev, dev, pieces, piece_bytes, scales))
        elif direction == "offload":
            copies.append(PieceCopy(dev, host, pieces, piece_bytes, scales))
        else:
            copies.append(PieceCopy(host, dev, pieces, piece_bytes, scales))
    return copies


def word_bytes(*values: int) -> int:
    """The widest access (16, 8, 4, 2 or 1 bytes) that divides every address, stride and size."""
    for width in (16, 8, 4, 2):
        if all(v % width == 0 for v in values):
            return width
    return 1


def copy_word_bytes(copy: PieceCopy, src_base: int, dst_base: int) -> int:
    return word_bytes(
        src_base + copy.src.offset,
        dst_base + copy.dst.offset,
        copy.src.slot_stride,
        copy.src.piece_stride,
        copy.dst.slot_stride,
        copy.dst.piece_stride,
        copy.piece_bytes,
    )


def expand_copies(
    copy: PieceCopy, src_base: int, dst_base: int, src_slots: np.ndarray, dst_slots: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dst addresses, src addresses, sizes) of every piece of `copy`, piece-major, as uint64."""
    piece = np.arange(copy.num_pieces, dtype=np.uint64)[:, None]
    src = (
        np.uint64(src_base + copy.src.offset)
        + src_slots.astype(np.uint64)[None, :] * np.uint64(copy.src.slot_stride)
        + piece * np.uint64(copy.src.piece_stride)
    ).ravel()
    dst = (
        np.uint64(dst_base + copy.dst.offset)
        + dst_slots.astype(np.uint64)[None, :] * np.uint64(copy.dst.slot_stride)
        + piece * np.uint64(copy.dst.piece_stride)
    ).ravel()
    return dst, src, np.full(dst.shape, copy.piece_bytes, dtype=np.uint64)


def merge_runs(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Copies sorted by destination, those contiguous on both sides merged into one."""
    if dst.size == 0:
        return dst, src, sizes
    order = np.argsort(dst, kind="stable")
    dst, src, sizes = dst[order], src[order], sizes[order]
    joins = (dst[:-1] + sizes[:-1] == dst[1:]) & (src[:-1] + sizes[:-1] == src[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return dst[starts], src[starts], np.add.reduceat(sizes, starts)


def slot_runs(slots: np.ndarray) -> list[tuple[int, int, int]]:
    """(batch index, first slot, count) of each run of consecutive slots in batch order."""
    if slots.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [slots.size]))
    return [(int(s), int(slots[s]), int(e - s)) for s, e in zip(starts, ends)]


@dataclass(frozen=True)
class ScaleGroups:
    """One plane's scale groups in elements (codec._reduce_dims, in scale_shape order).

    Group g starts at g * group_stride and is `seg_count` runs of `seg_len` contiguous
    elements, `seg_stride` apart. Element e of a plane belongs to group (e // scale_div) % scale_mod.
    """

    groups_per_piece: int
    group_stride: int
    seg_count: int
    seg_len: int
    seg_stride: int
    scale_div: int
    scale_mod: int


def scale_groups(fmt: PageFormat) -> ScaleGroups:
    tokens, heads, dim = fmt.page_size, fmt.num_kv_heads, fmt.head_dim
    if fmt.scale == "per_tensor":
        return ScaleGroups(1, 0, 1, fmt.plane_elems, 0, fmt.plane_elems, 1)
    if fmt.scale == "per_token_head":
        return ScaleGroups(tokens * heads, dim, 1, dim, 0, dim, tokens * heads)
    if fmt.scale == "per_page_head":
        if fmt.layout == "nhd":
            return ScaleGroups(heads, dim, tokens, dim, heads * dim, dim, heads)
        return ScaleGroups(heads, tokens * dim, 1, tokens * dim, 0, tokens * dim, heads)
    raise ValueError(f"scale groups need a format with scales, got scale={fmt.scale!r}")


def convert_vector(fmt: PageFormat) -> int:
    """Elements per thread of the converting kernels: 16 when every run is 16-aligned, else 1."""
    groups = scale_groups(fmt)
    aligned = (fmt.plane_elems, groups.group_stride, groups.seg_len, groups.seg_stride, groups.scale_div)
    return 16 if all(v % 16 == 0 for v in aligned) else 1


def team_size(chunks_per_group: int) -> int:
    """Lanes that share one scale group in the quantize kernel: a power of two, at most a warp."""
    team = 1
    while team < chunks_per_group and team < 32:
        team *= 2
    return team


@dataclass(frozen=True)
class LaunchShape:
    """One kernel launch: its grid and the most SMs it can occupy at once."""

    kernel: str
    blocks: int
    threads: int
    sms: int


# --- tickets ------------------------------------------------------------------------------
class CudaTicket(Ticket):
    """A copy in flight: one event per layer (or one for all) and what it must keep alive."""

    def __init__(self, layer_events: list, num_layers: int, device: torch.device, keepalive: tuple) -> None:
        self.layer_events = layer_events
        self.num_layers = num_layers
        self.device = device
        self._keepalive = keepalive

    def _event(self, layer: int):
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        return self.layer_events[layer] if len(self.layer_events) > 1 else self.layer_events[0]

    def done(self) -> bool:
        finished = self.layer_events[-1].query()
        if finished:
            self._keepalive = ()
        return finished

    def synchronize(self) -> None:
        self.layer_events[-1].synchronize()
        self._keepalive = ()

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.layer_events[-1])

    def wait_layer(self, layer: int) -> None:
        torch.cuda.current_stream(self.device).wait_event(self._event(layer))


# --- the engine ---------------------------------------------------------------------------
def _batch_memcpy():
    """cuda.bindings' cudaMemcpyBatchAsync, or None where cuda-bindings is missing or too old."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        return None
    return runtime if hasattr(runtime, "cudaMemcpyBatchAsync") else None


class CudaEngine(TransferEngine):
    """Page copies on CUDA streams. path: "auto", "kernel", "copy_engine" or "torch" (settable
    between transfers); max_blocks: most blocks one kernel launch may take (default one per SM)."""

    name = "cuda"

    def __init__(
        self,
        device_tier: DeviceTier,
        host_tier: HostTier,
        transform: ReloadTransform | None = None,
        path: str = "auto",
        max_blocks: int | None = None,
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaEngine needs CUDA, and torch.cuda.is_available() is False here; use TorchEngine")
        if device_tier.device.type != "cuda":
            raise ValueError(f"CudaEngine needs a device tier on a CUDA device, got device={device_tier.device}")
        if not host_tier.pinned:
            raise ValueError("CudaEngine needs a pinned host tier (HostTier(pin=True)), got pinned=False")
        if host_tier.fmt != device_tier.fmt:
            raise ValueError(f"tier formats differ: device {device_tier.fmt.describe()}, host {host_tier.fmt.describe()}")
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        self.device_tier = device_tier
        self.host_tier = host_tier
        self.fmt = device_tier.fmt
        self.transform = transform
        self.path = path
        index = device_tier.device.index if device_tier.device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        props = torch.cuda.get_device_properties(self.device)
        self.sm_count = props.multi_processor_count
        self.capability = (props.major, props.minor)
        if max_blocks is not None and (isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks <= 0):
            raise ValueError(f"max_blocks must be a positive int or None, got {max_blocks!r}")
        # One block per SM keeps megabytes of 16-byte accesses in flight, several times what
        # PCIe needs to be saturated, while leaving most of every SM to the model.
        self.max_blocks = max_blocks or self.sm_count
        self.offload_stream = torch.cuda.Stream(self.device)
        # Reloads sit on the critical path of attention: let them win the SMs over offloads.
        self.reload_stream = torch.cuda.Stream(self.device, priority=-1)
        self.device_copy_stream = torch.cuda.Stream(self.device)
        # The staged reload's DMA into HBM runs here, beside the upcasts on the reload stream.
        self.staging_stream = torch.cuda.Stream(self.device, priority=-1)
        self.has_cupy = native.cupy_available()
        self._runtime = _batch_memcpy()
        self._host_device_pointer: int | None = None
        self._cupy_streams: dict[int, object] = {}
        self._memcpy_attributes: dict[bool, object] = {}
        self.last_path: str | None = None
        self.last_launch: LaunchShape | None = None

    # --- public API ----------------------------------------------------------------------
    def record_ready(self):
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def offload(self, device_slots, host_slots, ready=None) -> Ticket:
        fmt = self.fmt
        dev_idx = self._slots("device", device_slots, self.device_tier.num_pages, unique=False)
        host_idx = self._slots("host", host_slots, self.host_tier.num_pages, unique=True)
        self._same_length(dev_idx, host_idx)
        if dev_idx.size == 0:
            return DoneTicket(fmt.num_layers)
        path = self._choose(converts=fmt.converts, piece_bytes=fmt.plane_elems * fmt.elem_bytes)
        self.last_path, self.last_launch = path, None
        stream = self.offload_stream
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            if ready is not None:
                stream.wait_event(ready)
            pinned, slots = self._stage_slots(dev_idx, host_idx)
            keep = [pinned, slots]
            if path == "kernel":
                self._kernel_offload(stream, slots, dev_idx.size)
            elif path == "copy_engine":
                self._batch_copy(stream, self._offload_copies(range(fmt.num_layers), dev_idx, host_idx))
            else:
                keep.append(self._torch_offload(slots[0], host_idx))
            event = torch.cuda.Event()
            event.record(stream)
        return CudaTicket([event], fmt.num_layers, self.device, tuple(keep))

    def reload(self, host_slots, device_slots, ready=None) -> Ticket:
        """Host records -> device pages layer by layer; waits on `ready` before writing, if given."""
        fmt = self.fmt
        host_idx = self._slots("host", host_slots, self.host_tier.num_pages, unique=False)
        dev_idx = self._slots("device", device_slots, self.device_tier.num_pages, unique=True)
        self._same_length(host_idx, dev_idx)
        if dev_idx.size == 0:
            return DoneTicket(fmt.num_layers)
        path = self._choose(converts=fmt.converts, piece_bytes=fmt.plane_elems * fmt.elem_bytes, staged_ok=True)
        self.last_path, self.last_launch = path, None
        stream = self.reload_stream
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            if ready is not None:
                stream.wait_event(ready)
            pinned, slots = self._stage_slots(dev_idx, host_idx)
            keep = [pinned, slots]
            if path == "torch":
                events = self._torch_reload(slots[0], host_idx, keep)
            elif path == "staged":
                events = self._staged_reload(stream, slots, host_idx, keep, ready)
            else:
                events = []
                for layer in range(fmt.num_layers):
                    if path == "kernel":
                        self._kernel_reload_layer(stream, slots, dev_idx.size, layer)
                    else:
                        self._batch_copy(stream, self._reload_copies(range(layer, layer + 1), dev_idx, host_idx))
                    events.append(self._land_layer(stream, layer, slots[0]))
        return CudaTicket(events, fmt.num_layers, self.device, tuple(keep))

    def device_copy(self, src_slots, dst_slots) -> Ticket:
        """Device pages -> other device slots, ordered after the caller's current stream."""
        fmt, dev = self.fmt, self.device_tier
        src_idx = self._slots("source device", src_slots, dev.num_pages, unique=False)
        dst_idx = self._slots("destination device", dst_slots, dev.num_pages, unique=True)
        self._same_length(src_idx, dst_idx)
        overlap = np.intersect1d(src_idx, dst_idx)
        if overlap.size:
            raise ValueError(
                f"device_copy source and destination slots overlap at {overlap[:8].tolist()}; "
                "copies within one batch run in no order, so they must be disjoint"
            )
        if src_idx.size == 0:
            return DoneTicket(fmt.num_layers)
        path = self._choose(converts=False, piece_bytes=fmt.device_plane_bytes)
        self.last_path, self.last_launch = path, None
        caller_done = self.record_ready()
        stream = self.device_copy_stream
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            stream.wait_event(caller_done)
            pinned, slots = self._stage_slots(src_idx, dst_idx)
            keep = (pinned, slots)
            copies = passthrough_copies(fmt, dev.num_pages, range(fmt.num_layers), "device")
            if path == "kernel":
                for copy in copies:
                    base = self._device_base(copy)
                    self._launch_copy(stream, copy, base, base, slots[0], slots[1], src_idx.size)
            elif path == "copy_engine":
                self._batch_copy(
                    stream,
                    [expand_copies(c, self._device_base(c), self._device_base(c), src_idx, dst_idx) for c in copies],
                )
            else:
                raw = dev.raw_pages()  # bytes: index_copy_ has no fp8 kernels
                raw.index_copy_(2, slots[1], raw.index_select(2, slots[0]))
                if dev.scales is not None:
                    dev.scales.index_copy_(2, slots[1], dev.scales.index_select(2, slots[0]))
            event = torch.cuda.Event()
            event.record(stream)
        return CudaTicket([event], fmt.num_layers, self.device, keep)

    def close(self) -> None:
        for stream in (self.offload_stream, self.reload_stream, self.device_copy_stream, self.staging_stream):
            stream.synchronize()
        self._cupy_streams.clear()

    # --- choosing a path ---------------------------------------------------------------------
    def _choose(self, converts: bool, piece_bytes: int, staged_ok: bool = False) -> str:
        fp8_ok = self.capability >= FP8_CONVERT_CAPABILITY
        if self.path == "staged":
            if staged_ok and converts:
                if self._runtime is None or not self.has_cupy or not fp8_ok:
                    raise RuntimeError(
                        "path='staged' needs cudaMemcpyBatchAsync (cuda-bindings >= 12.8), CuPy and an sm_89+ GPU"
                    )
                return "staged"
        if self.path in ("auto", "staged"):
            if not converts and self._runtime is not None and piece_bytes >= COPY_ENGINE_MIN_PIECE:
                return "copy_engine"
            if self.has_cupy and (fp8_ok or not converts):
                return "kernel"
            return "torch"
        if self.path == "kernel":
            if not self.has_cupy:
                raise RuntimeError("path='kernel' needs CuPy with a visible CUDA device (pip install cupy-cuda13x)")
            if converts and not fp8_ok:
                raise RuntimeError(
                    f"path='kernel' converts fp8 with sm_89+ instructions; this GPU is sm_{self.capability[0]}{self.capability[1]}"
                )
        if self.path == "copy_engine":
            if converts:
                raise ValueError(
                    f"path='copy_engine' moves bytes as they are, but {self.fmt.describe()} converts dtypes; "
                    "use 'kernel' or 'torch'"
                )
            if self._runtime is None:
                raise RuntimeError(
                    "path='copy_engine' needs cudaMemcpyBatchAsync from cuda-bindings >= 12.8 (pip install cuda-bindings)"
                )
        return self.path

    # --- slots -------------------------------------------------------------------------------
    @staticmethod
    def _slots(name: str, slots, limit: int, unique: bool) -> np.ndarray:
        array = np.asarray(slots, dtype=np.int64)
        if array.ndim != 1:
            raise ValueError(f"{name} slots must be one-dimensional, got shape {array.shape}")
        if array.size:
            low, high = int(array.min()), int(array.max())
            if low < 0 or high >= limit:
                bad = low if low < 0 else high
                raise IndexError(f"{name} slot {bad} out of range [0, {limit})")
            if unique and array.size > 1:
                ordered = np.sort(array)  # a sort and a compare: a tenth of np.unique's time
                repeats = ordered[1:][ordered[1:] == ordered[:-1]]
                if repeats.size:
                    raise ValueError(f"{name} slots are written and must not repeat, got {repeats[:16].tolist()} more than once")
        return array

    @staticmethod
    def _same_length(a: np.ndarray, b: np.ndarray) -> None:
        if a.size != b.size:
            raise ValueError(f"slot lists differ in length: {a.size} vs {b.size}")

    def _stage_slots(self, first: np.ndarray, second: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Both slot lists on the GPU as a (2, n) int64 tensor, copied on the current stream."""
        pinned = torch.empty((2, first.size), dtype=torch.int64, pin_memory=True)
        staged = pinned.numpy()
        staged[0] = first
        staged[1] = second
        return pinned, pinned.to(self.device, non_blocking=True)

    # --- landing a reloaded layer ---------------------------------------------------------
    def _land_layer(self, stream, layer: int, device_slots: torch.Tensor):
        if self.transform is not None:
            for plane in range(self.fmt.planes):
                self.transform(layer, plane, self.device_tier.kv[layer, plane], device_slots)
        event = torch.cuda.Event()
        event.record(stream)
        return event

    # --- kernel path -----------------------------------------------------------------------
    def _host_pointer(self) -> int:
        """The device-side address of the host buffer: its alias in the GPU's address space.

        Kernels and cudaMemcpyBatchAsync both need it: where the device attribute
        CanUseHostPointerForRegisteredMem is 0 (WSL2, for one) the host address of
        cudaHostRegister'ed memory differs from its device alias and copies to it fault
        (sglang #40232). Elsewhere the two are equal.
        """
        if self._host_device_pointer is None:
            host = self.host_tier.buffer.data_ptr()
            if self._runtime is not None:
                error, alias = self._runtime.cudaHostGetDevicePointer(host, 0)
                if error != self._runtime.cudaError_t.cudaSuccess:
                    raise RuntimeError(
                        f"cudaHostGetDevicePointer of the host tier buffer at {host:#x} failed: {error.name}; "
                        "is it registered (HostTier(pin=True))?"
                    )
            else:
                from cupy.cuda import runtime

                attributes = runtime.pointerGetAttributes(host)
                if attributes.type != runtime.memoryTypeHost:
                    raise RuntimeError(
                        f"host tier buffer at {host:#x} is not CUDA-registered host memory "
                        f"(pointer type {attributes.type}, expected {runtime.memoryTypeHost})"
                    )
                alias = attributes.devicePointer
            if not alias:
                raise RuntimeError(f"host tier buffer at {host:#x} has no device mapping; the GPU cannot reach it")
            self._host_device_pointer = int(alias)
        return self._host_device_pointer

    def _cupy_stream(self, stream):
        handle = stream.cuda_stream
        found = self._cupy_streams.get(handle)
        if found is None:
            found = native.cupy_stream(stream)
            self._cupy_streams[handle] = found
        return found

    def _launch(self, stream, module: str, name: str, blocks_wanted: int, args: tuple) -> None:
        import cupy

        function = native.kernel(self.device.index, module, name)
        blocks = max(1, min(blocks_wanted, self.max_blocks))
        with cupy.cuda.Device(self.device.index), self._cupy_stream(stream):
            function((blocks,), (THREADS,), args)
        self.last_launch = LaunchShape(name, blocks, THREADS, min(blocks, self.sm_count))

    def _launch_copy(
        self, stream, copy: PieceCopy, src_base: int, dst_base: int, src_slots, dst_slots, num_pages: int
    ) -> None:
        width = copy_word_bytes(copy, src_base, dst_base)
        units = num_pages * copy.num_pieces * (copy.piece_bytes // width)
        args = (
            np.uint64(src_base + copy.src.offset),
            np.uint64(dst_base + copy.dst.offset),
            np.uint64(src_slots.data_ptr()),
            np.uint64(dst_slots.data_ptr()),
            np.int64(num_pages),
            np.int64(copy.num_pieces),
            np.int64(copy.piece_bytes),
            np.int64(copy.src.slot_stride),
            np.int64(copy.src.piece_stride),
            np.int64(copy.dst.slot_stride),
            np.int64(copy.dst.piece_stride),
        )
        self._launch(stream, "page_copy", f"copy_pages_w{width}", _ceil(units, THREADS * COPY_UNROLL), args)

    def _device_base(self, copy: PieceCopy) -> int:
        dev = self.device_tier
        return dev.scales.data_ptr() if copy.scales else dev.kv.data_ptr()

    def _kernel_offload(self, stream, slots: torch.Tensor, num_pages: int) -> None:
        fmt = self.fmt
        if fmt.converts:
            self._launch_convert(stream, "quantize", slots, num_pages, range(fmt.num_layers))
            return
        host = self._host_pointer()
        for copy in passthrough_copies(fmt, self.device_tier.num_pages, range(fmt.num_layers), "offload"):
            self._launch_copy(stream, copy, self._device_base(copy), host, slots[0], slots[1], num_pages)

    def _kernel_reload_layer(self, stream, slots: torch.Tensor, num_pages: int, layer: int) -> None:
        fmt = self.fmt
        if fmt.converts:
            self._launch_convert(stream, "upcast", slots, num_pages, range(layer, layer + 1))
            return
        host = self._host_pointer()
        for copy in passthrough_copies(fmt, self.device_tier.num_pages, range(layer, layer + 1), "reload"):
            self._launch_copy(stream, copy, host, self._device_base(copy), slots[1], slots[0], num_pages)

    def _staged_reload(self, stream, slots: torch.Tensor, host_idx: np.ndarray, keep: list, ready) -> list:
        """Whole fp8 records -> device staging by the copy engines, chunk by chunk on the staging
        stream, each chunk upcast from HBM on the reload stream while the next one crosses PCIe."""
        fmt, count = self.fmt, host_idx.size
        # Allocated on the staging stream, so its DMA waits for nothing but `ready`: like every
        # other path, nothing of a reload starts before the work the caller queued before it.
        if ready is not None:
            self.staging_stream.wait_event(ready)
        with torch.cuda.stream(self.staging_stream):
            staging = torch.empty((count, fmt.page_bytes), dtype=torch.uint8, device=self.device)
        staging.record_stream(stream)
        pairs = torch.empty_like(slots)  # (device slot, staging row) of every page
        pairs[0].copy_(slots[0])
        torch.arange(count, out=pairs[1])
        keep.extend((staging, pairs))
        record = Region(0, fmt.page_bytes, 0)
        whole = PieceCopy(record, record, 1, fmt.page_bytes, False)
        host, base = self._host_pointer(), staging.data_ptr()
        chunk = -(-count // min(STAGED_CHUNKS, count))
        for first in range(0, count, chunk):
            rows = np.arange(first, min(first + chunk, count), dtype=np.int64)
            self._batch_copy(self.staging_stream, [expand_copies(whole, host, base, host_idx[rows], rows)])
            landed = torch.cuda.Event()
            landed.record(self.staging_stream)
            keep.append(landed)
            stream.wait_event(landed)
            self._launch_convert(
                stream, "upcast", pairs[:, first : first + rows.size], rows.size, range(fmt.num_layers), records=base
            )
        return [self._land_layer(stream, layer, slots[0]) for layer in range(fmt.num_layers)]

    def _launch_convert(
        self, stream, op: str, slots: torch.Tensor, num_pages: int, layers: range, records: int | None = None
    ) -> None:
        """Launch the fused quantize (offload) or upcast (reload) kernel over `layers`.

        `records`: the address of the records the kernel reads or writes, laid out as the
        host tier (default: the host tier itself, through its device alias).
        """
        fmt, pages = self.fmt, self.device_tier.num_pages
        kv = self.device_tier.kv.data_ptr()
        host = self._host_pointer() if records is None else records
        groups = scale_groups(fmt)
        vec = convert_vector(fmt)
        pieces = len(layers) * fmt.planes
        dev_region = device_data_region(fmt, pages, layers.start)
        host_data = host + host_data_region(fmt, layers.start).offset
        host_scales = host + host_scale_region(fmt, layers.start).offset
        dev_pages = kv + dev_region.offset
        fp8 = "e4m3" if fmt.dtype == "fp8_e4m3" else "e5m2"
        wide = "bf16" if fmt.device_dtype == "bf16" else "fp16"
        name = f"{op}_pages_{fp8}_{wide}_v{vec}"
        if op == "upcast":
            units = num_pages * pieces * (fmt.plane_elems // vec)
            args = (
                np.uint64(host_data),
                np.uint64(host_scales),
                np.uint64(dev_pages),
                np.uint64(slots[1].data_ptr()),
                np.uint64(slots[0].data_ptr()),
                np.int64(num_pages),
                np.int64(pieces),
                np.int64(fmt.plane_elems),
                np.int64(fmt.page_bytes),
                np.int64(fmt.plane_data_bytes),
                np.int64(fmt.plane_scale_bytes),
                np.int64(fmt.plane_elems),
                np.int64(pages * fmt.plane_elems),
                np.int64(groups.scale_div),
                np.int64(groups.scale_mod),
            )
            self._launch(stream, "page_convert", name, _ceil(units, THREADS * CONVERT_UNROLL), args)
            return
        team = team_size(groups.seg_count * groups.seg_len // vec)
        teams = num_pages * pieces * groups.groups_per_piece
        args = (
            np.uint64(dev_pages),
            np.uint64(host_data),
            np.uint64(host_scales),
            np.uint64(slots[0].data_ptr()),
            np.uint64(slots[1].data_ptr()),
            np.int64(num_pages),
            np.int64(pieces),
            np.int64(fmt.plane_elems),
            np.int64(pages * fmt.plane_elems),
            np.int64(fmt.page_bytes),
            np.int64(fmt.plane_data_bytes),
            np.int64(fmt.plane_scale_bytes),
            np.int64(groups.groups_per_piece),
            np.int64(groups.group_stride),
            np.int64(groups.seg_count),
            np.int64(groups.seg_len),
            np.int64(groups.seg_stride),
            np.int64(team),
            np.float32(FP8_MAX[fmt.dtype]),
        )
        self._launch(stream, "page_convert", name, _ceil(teams * team, THREADS), args)

    # --- copy-engine path ------------------------------------------------------------------
    def _offload_copies(self, layers: range, dev_idx: np.ndarray, host_idx: np.ndarray):
        host = self._host_pointer()
        return [
            expand_copies(copy, self._device_base(copy), host, dev_idx, host_idx)
            for copy in passthrough_copies(self.fmt, self.device_tier.num_pages, layers, "offload")
        ]

    def _reload_copies(self, layers: range, dev_idx: np.ndarray, host_idx: np.ndarray):
        host = self._host_pointer()
        return [
            expand_copies(copy, host, self._device_base(copy), host_idx, dev_idx)
            for copy in passthrough_copies(self.fmt, self.device_tier.num_pages, layers, "reload")
        ]

    def _batch_copy(self, stream, expanded: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
        runtime = self._runtime
        # Runs merge within one PieceCopy only: a run across the pages tensor and the scales
        # tensor could straddle two allocations, which cudaMemcpyBatchAsync rejects.
        merged = [merge_runs(*part) for part in expanded]
        dst, src, sizes = (np.concatenate(column) for column in zip(*merged))
        prefer_overlap = int(sizes.max()) <= PREFER_OVERLAP_MAX_COPY
        attributes = self._memcpy_attributes.get(prefer_overlap)
        if attributes is None:
            attributes = runtime.cudaMemcpyAttributes()
            attributes.srcAccessOrder = runtime.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
            attributes.flags = (
                runtime.cudaMemcpyFlags.cudaMemcpyFlagPreferOverlapWithCompute
                if prefer_overlap
                else runtime.cudaMemcpyFlags.cudaMemcpyFlagDefault
            )
            self._memcpy_attributes[prefer_overlap] = attributes
        count = int(dst.size)
        result = runtime.cudaMemcpyBatchAsync(
            dst.tolist(), src.tolist(), sizes.tolist(), count, [attributes], [0], 1, stream.cuda_stream
        )
        error = result[0]
        if error != runtime.cudaError_t.cudaSuccess:
            _, text = runtime.cudaGetErrorString(error)
            raise RuntimeError(
                f"cudaMemcpyBatchAsync of {count} copies on stream {stream.cuda_stream:#x} failed: "
                f"{error.name} ({text.decode()})"
            )

    # --- torch path ------------------------------------------------------------------------
    def _staging_chunk(self) -> int:
        return max(1, TORCH_STAGING_BYTES // self.fmt.page_bytes)

    def _torch_offload(self, device_slots: torch.Tensor, host_idx: np.ndarray) -> list[torch.Tensor]:
        fmt, dev, host = self.fmt, self.device_tier, self.host_tier
        chunk = self._staging_chunk()
        staged = []
        for start in range(0, host_idx.size, chunk):
            di = device_slots[start : start + chunk]
            count = di.numel()
            # Zeros, not empty: the padding of a record then holds no stale device bytes.
            staging = torch.zeros((count, fmt.page_bytes), dtype=torch.uint8, device=self.device)
            for layer in range(fmt.num_layers):
                for plane in range(fmt.planes):
                    data = slice(fmt.data_offset(layer, plane), fmt.data_offset(layer, plane) + fmt.plane_elems * fmt.elem_bytes)
                    scale = slice(fmt.scale_offset(layer, plane), fmt.scale_offset(layer, plane) + fmt.plane_scale_bytes)
                    if fmt.converts:
                        q, s = quantize(dev.kv[layer, plane].index_select(0, di), fmt.dtype, fmt.scale, fmt.layout)
                        staging[:, data] = q.view(torch.uint8).reshape(count, -1)
                        staging[:, scale] = s.reshape(count, -1).view(torch.uint8)
                        continue
                    staging[:, data] = dev.raw_plane(layer, plane).index_select(0, di)
                    if fmt.has_scales:
                        staging[:, scale] = dev.scales[layer, plane].index_select(0, di).reshape(count, -1).view(torch.uint8)
            for first, slot, run in slot_runs(host_idx[start : start + chunk]):
                host.buffer[slot : slot + run].copy_(staging[first : first + run], non_blocking=True)
            staged.append(staging)
        return staged

    def _torch_reload(self, device_slots: torch.Tensor, host_idx: np.ndarray, keep: list) -> list:
        fmt, dev, host = self.fmt, self.device_tier, self.host_tier
        chunk = self._staging_chunk()
        starts = list(range(0, host_idx.size, chunk))
        events = []
        for start in starts:
            di = device_slots[start : start + chunk]
            count = di.numel()
            staging = torch.empty((count, fmt.page_bytes), dtype=torch.uint8, device=self.device)
            for first, slot, run in slot_runs(host_idx[start : start + chunk]):
                staging[first : first + run].copy_(host.buffer[slot : slot + run], non_blocking=True)
            keep.append(staging)
            for layer in range(fmt.num_layers):
                for plane in range(fmt.planes):
                    data_at = fmt.data_offset(layer, plane)
                    raw = staging[:, data_at : data_at + fmt.plane_elems * fmt.elem_bytes]
                    scale_at = fmt.scale_offset(layer, plane)
                    scale_raw = staging[:, scale_at : scale_at + fmt.plane_scale_bytes]
                    if fmt.converts:
                        q = raw.view(fmt.torch_dtype).view(count, *fmt.plane_shape)
                        s = scale_raw.view(torch.float32).view(count, *fmt.scale_shape)
                        pages = dequantize(q, s, fmt.scale, fmt.layout, fmt.device_torch_dtype)
                        dev.kv[layer, plane].index_copy_(0, di, pages)
                        continue
                    dev.raw_plane(layer, plane).index_copy_(0, di, raw)
                    if fmt.device_has_scales:
                        s = scale_raw.view(torch.float32).view(count, *fmt.scale_shape)
                        dev.scales[layer, plane].index_copy_(0, di, s)
                # A layer has landed once the last chunk wrote it.
                if start == starts[-1]:
                    events.append(self._land_layer(self.reload_stream, layer, device_slots))
        return events


def _ceil(a: int, b: int) -> int:
    return -(-a // b)
