"""The CUDA copy engine: page moves between the device tier and pinned host records on streams.

Owns the CUDA side of kvtier.transfer: its offload, reload, device-copy and staging streams,
one StreamLane (flags, counters, sequence numbers, slot buffers) per kernel stream, and the
choice among four ways to move bytes, one module each:

- "kernel" (kernel_path.py): ONE launch per transfer moves every layer, data and scales,
  for any batch size, and signals each layer through pinned, device-mapped flags
  (native/page_signal.cu): `done()` reads a flag with no CUDA call, `wait_layer(i)` is one
  cuStreamWaitValue32 on the caller's stream. The only path that converts dtypes (fused
  quantize on offload, fused upcast on reload).
- "copy_engine" (copy_engine_path.py): cudaMemcpyBatchAsync, no SM used; events per layer.
- "staged" (staged_path.py, converting reloads; elsewhere it acts as "auto"): copy engines
  into a device staging buffer, then the upcast kernel from HBM; events.
- "torch" (torch_path.py): staging and plain copies; the fallback without NVRTC or
  cuda-bindings; events.

Why one launch with flags (BENCHMARKS.md, 2026-12-02 H200): the per-layer scheme spent about
110 us of host time per layer (a plan rebuilt in Python, two CuPy launches each entering a
Device and a stream context, an event), 3.6 ms for one 32-layer page whose bytes need 20 us
of PCIe. A CuPy RawKernel call costs 5.8 us and an event 2 us, so no per-layer launch scheme
can reach tens of microseconds per transfer. Now a transfer costs one prepacked
cuLaunchKernel, a few writes into a cached argument record and a pinned slot buffer, and no
event: its host cost does not grow with the layer count. Slot lists go to the kernel in
pinned memory read through its device alias (no copy to queue, nothing to allocate per
transfer); the kernel reads each entry a few times per chunk, which PCIe latency hides
behind the data's own reads.

"auto" (path_choice.py, pure and tested on the CPU) takes the kernel unless the transfer
passes bytes through, every piece is at least COPY_ENGINE_MIN_PIECE bytes, and the copy
engines' host cost is below the bytes' PCIe time, then the copy engines, whatever the other
direction is doing (offload and reload at once on the H200, 2026-12-03: both on the copy
engines 1.04-1.07x of the both-directions limit from 256 KiB pieces, both on the kernel
0.82x, one on each 0.61-0.67x). Torch where cuda-bindings or NVRTC is missing (or the GPU
predates sm_89 for a converting format). A reload with a user
ReloadTransform runs per layer (the transform is Python between layers): per-layer kernel
launches and events. `last_path` and `last_launch` say what the latest transfer used.

reload_layers (a pool's load of several chunks: each chunk's first layer as it is booked, then
the other layers of all chunks) runs on the reload stream in at most LAYER_RUNS runs of layers,
one kernel launch (or one batch of copy-engine copies) and one event a run (torch copies and
user transforms: a run is one layer).

Ordering (engine.py's rules): offload waits on `ready`; reload waits on `ready` (the
destination slots may still be read by attention queued on the caller's stream);
device_copy waits on the caller's current stream. Every launch and every sequence number on
a lane is issued under the lane's lock, so flags only move forward on a stream.
It must never choose which pages move, block the host on the hot path, or use the legacy
default stream (cudaMemcpyBatchAsync rejects it).
"""

from __future__ import annotations

import collections

import numpy as np
import torch

from kvtier.tiers import DeviceTier, HostTier
from kvtier.transfer import native
from kvtier.transfer.cuda import driver as cuda_driver
from kvtier.transfer.cuda import path_choice, plans
from kvtier.transfer.cuda.copy_engine_path import CopyEnginePath, batch_memcpy_available, batch_memcpy_runtime
from kvtier.transfer.cuda.kernel_path import KernelPath
from kvtier.transfer.cuda.path_choice import PATHS
from kvtier.transfer.cuda.plans import THREADS
from kvtier.transfer.cuda.staged_path import staged_reload
from kvtier.transfer.cuda.tickets import EventTicket, FlagTicket, LayerEventTicket, StreamLane
from kvtier.transfer.cuda.torch_path import TorchPath
from kvtier.transfer.engine import DoneTicket, ReloadTransform, Ticket, TransferEngine, check_layers, layer_runs

# A subset reload (reload_layers) takes at most this many launches and events: a split load's
# other layers land in runs of L/8 layers at 32 or 92 layers, one layer each at 8 or fewer.
LAYER_RUNS = 8
# Batches up to this many slots are checked in plain Python (faster than numpy's per-call
# overhead); longer ones with numpy.
SMALL_BATCH = 256


class ReadyEvent:
    """An event recorded on the caller's stream by record_ready(); its handle is reused once dropped."""

    __slots__ = ("cuda_event", "_handle", "_free")

    def __init__(self, handle, free: list) -> None:
        self._handle = handle
        self.cuda_event = int(handle)
        self._free = free

    def __del__(self) -> None:
        self._free.append(self._handle)


class CudaEngine(TransferEngine):
    """Page copies on CUDA streams. path: "auto", "kernel", "copy_engine", "staged" or "torch"
    (settable between transfers); max_blocks: most blocks one kernel launch may take (default
    one per SM)."""

    name = "cuda"
    queues_copies = True  # on the engine's streams

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
        if max_blocks is not None and (isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks <= 0):
            raise ValueError(f"max_blocks must be a positive int or None, got {max_blocks!r}")
        self.device_tier = device_tier
        self.host_tier = host_tier
        self.fmt = fmt = device_tier.fmt
        self.transform = transform
        self.path = path
        index = device_tier.device.index if device_tier.device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        props = torch.cuda.get_device_properties(self.device)
        self.sm_count = props.multi_processor_count
        self.capability = (props.major, props.minor)
        # One block per SM keeps megabytes of 16-byte accesses in flight, several times what
        # PCIe needs to be saturated, while leaving most of every SM to the model.
        self.max_blocks = max_blocks or self.sm_count
        self.offload_stream = torch.cuda.Stream(self.device)
        # Reloads sit on the critical path of attention: let them win the SMs over offloads.
        self.reload_stream = torch.cuda.Stream(self.device, priority=-1)
        self.device_copy_stream = torch.cuda.Stream(self.device)
        # The staged reload's DMA into HBM runs here, beside the upcasts on the reload stream.
        self.staging_stream = torch.cuda.Stream(self.device, priority=-1)
        self.has_kernels = native.kernels_available(index)
        self.driver = cuda_driver.Driver(self.device) if cuda_driver.available() else None
        # The copy engines' runtime is imported at their first use (path_choice only needs to know
        # they can run): a first pool on the kernel path does without the import.
        self._runtime = None
        self._copy_engine: CopyEnginePath | None = None
        self._copy_engine_possible = batch_memcpy_available()
        self.records = self._host_pointer()
        self.table = plans.device_table(device_tier)
        self._table_device = torch.from_numpy(self.table).to(self.device)
        self.torch_path = TorchPath(device_tier, host_tier, self.device)
        self.kernels = None
        self.offload_lane = self.reload_lane = self.device_lane = None
        if self.has_kernels and self.driver is not None:
            self.kernels = KernelPath(
                fmt, self.table, self._table_device.data_ptr(), self.records, self._launch, self.max_blocks, self.sm_count
            )
            self.offload_lane = self._lane(self.offload_stream)
            self.reload_lane = self._lane(self.reload_stream)
            self.device_lane = self._lane(self.device_copy_stream)
        torch.cuda.synchronize(self.device)  # the table and the zeroed counters are in place
        self._functions: dict[str, object] = {}
        self._free_events: list = []
        self._retired: collections.deque = collections.deque()
        self.last_path: str | None = None
        self._abilities = path_choice.Abilities(self.kernels is not None, self._copy_engine_possible, self.capability)

    @property
    def copy_engine(self) -> CopyEnginePath | None:
        """The copy-engine path (None where cuda-bindings cannot run it), built at first use."""
        if self._copy_engine is None and self._copy_engine_possible:
            runtime = batch_memcpy_runtime()
            if runtime is None:
                raise RuntimeError("cuda.bindings.runtime lacks cudaMemcpyBatchAsync (cuda-bindings >= 12.8 needed)")
            self._runtime = runtime
            batch = None if self.driver is None else self.driver.batch_memcpy
            self._copy_engine = CopyEnginePath(self.fmt, self.table, self.records, runtime, batch)
        return self._copy_engine

    @property
    def last_launch(self):
        """Grid of the latest kernel launch (None before any)."""
        return None if self.kernels is None else self.kernels.last_launch

    # --- public API ----------------------------------------------------------------------
    def record_ready(self):
        if self.driver is None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            return event
        handle = self._free_events.pop() if self._free_events else self.driver.create_event()
        self.driver.record_event(handle, torch._C._cuda_getCurrentRawStream(self.device.index))
        return ReadyEvent(handle, self._free_events)

    def offload(self, device_slots, host_slots, ready=None) -> Ticket:
        fmt = self.fmt
        dev = self._slots("device", device_slots, self.device_tier.num_pages, unique=False)
        host = self._slots("host", host_slots, self.host_tier.num_pages, unique=True)
        count = self._same_length(dev, host)
        if count == 0:
            return DoneTicket(fmt.num_layers)
        self._reap()
        path = self._choose(converts=fmt.converts, count=count, calls=1)
        self.last_path = path
        if path == "kernel":
            lane = self.offload_lane
            with lane.lock:
                if ready is not None:
                    self.wait_ready(lane.stream, lane.cu_stream, ready)
                buffer = lane.buffer(count)
                buffer.src[:count] = dev
                buffer.dst[:count] = host
                if fmt.converts:
                    buffer.failed[:count] = 0
                seq = lane.next_seq()
                self.kernels.submit("offload", lane, buffer, count, seq)
            return FlagTicket(lane, seq, buffer, count, fmt.converts, self.device, count * fmt.page_bytes)
        stream = self.offload_stream
        dev_idx, host_idx = np.asarray(dev, dtype=np.int64), np.asarray(host, dtype=np.int64)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            if ready is not None:
                self.wait_ready(stream, None, ready)
            keep, failed = [], []
            if path == "copy_engine":
                self.copy_engine.copy(stream.cuda_stream, self.copy_engine.pieces("offload", range(fmt.num_layers), dev_idx, host_idx))
            else:
                slots = torch.from_numpy(dev_idx).pin_memory().to(self.device, non_blocking=True)
                staged, failed = self.torch_path.offload(slots, host_idx)
                keep = [slots, staged]
            event = torch.cuda.Event()
            event.record(stream)
        return EventTicket([event], fmt.num_layers, self.device, tuple(keep), self._retired, failed)

    def reload(self, host_slots, device_slots, ready=None) -> Ticket:
        """Host records -> device pages; waits on `ready` before writing, if given."""
        fmt = self.fmt
        host = self._slots("host", host_slots, self.host_tier.num_pages, unique=False)
        dev = self._slots("device", device_slots, self.device_tier.num_pages, unique=True)
        count = self._same_length(host, dev)
        if count == 0:
            return DoneTicket(fmt.num_layers)
        self._reap()
        path = self._choose(converts=fmt.converts, count=count, calls=fmt.num_layers, staged_ok=True)
        self.last_path = path
        if path == "kernel" and self.transform is None:
            lane = self.reload_lane
            with lane.lock:
                if ready is not None:
                    self.wait_ready(lane.stream, lane.cu_stream, ready)
                buffer = lane.buffer(count)
                buffer.src[:count] = host
                buffer.dst[:count] = dev
                seq = lane.next_seq()
                self.kernels.submit("reload", lane, buffer, count, seq)
            return FlagTicket(lane, seq, buffer, count, False, self.device, count * fmt.page_bytes)
        stream = self.reload_stream
        host_idx, dev_idx = np.asarray(host, dtype=np.int64), np.asarray(dev, dtype=np.int64)
        keep: list = []
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            if path == "staged":
                events = staged_reload(self, host_idx, dev_idx, ready, keep)
                return EventTicket(events, fmt.num_layers, self.device, tuple(keep), self._retired)
            if ready is not None:
                self.wait_ready(stream, None, ready)
            if path == "torch":
                slots = torch.from_numpy(dev_idx).pin_memory().to(self.device, non_blocking=True)
                keep.append(slots)
                events = self.torch_path.reload(slots, host_idx, keep, lambda layer: self.land_layer(stream, layer, dev_idx))
            elif path == "kernel":
                events = self._kernel_reload_per_layer(host, dev, count, keep)
            else:
                events = []
                for layer in range(fmt.num_layers):
                    self.copy_engine.copy(
                        stream.cuda_stream, self.copy_engine.pieces("reload", range(layer, layer + 1), host_idx, dev_idx)
                    )
                    events.append(self.land_layer(stream, layer, dev_idx))
        return EventTicket(events, fmt.num_layers, self.device, tuple(keep), self._retired)

    reloads_layers = True

    def reload_layers(self, host_slots, device_slots, layers: range, ready=None) -> Ticket:
        """Only `layers` of host records -> device pages, on the reload stream (after any earlier
        reload), one launch or copy and one event per layer; waits on `ready` first, if given."""
        fmt = self.fmt
        check_layers(layers, fmt.num_layers)
        if len(layers) == fmt.num_layers:
            return self.reload(host_slots, device_slots, ready)
        host = self._slots("host", host_slots, self.host_tier.num_pages, unique=False)
        dev = self._slots("device", device_slots, self.device_tier.num_pages, unique=True)
        count = self._same_length(host, dev)
        if count == 0:
            return DoneTicket(fmt.num_layers)
        self._reap()
        path = self._choose(converts=fmt.converts, count=count, calls=len(layers), staged_ok=False)
        self.last_path = path
        stream = self.reload_stream
        host_idx, dev_idx = np.asarray(host, dtype=np.int64), np.asarray(dev, dtype=np.int64)
        keep: list = []
        # One launch (or batch of copies) and one event a run of layers; a user transform runs
        # between layers, so then a run is one layer.
        runs = layer_runs(layers, LAYER_RUNS) if self.transform is None else [range(i, i + 1) for i in layers]
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            if path == "kernel":
                lane = self.reload_lane
                with lane.lock:
                    if ready is not None:
                        self.wait_ready(lane.stream, lane.cu_stream, ready)
                    buffer = lane.buffer(count)
                    buffer.src[:count] = host
                    buffer.dst[:count] = dev
                    keep.append(buffer)
                    events = []
                    for run in runs:
                        self.kernels.submit("reload", lane, buffer, count, 0, layers=run)
                        events.append(self.land_layer(stream, run[-1], dev_idx))
            else:
                if ready is not None:
                    self.wait_ready(stream, None, ready)
                if path == "copy_engine":
                    events = []
                    for run in runs:
                        self.copy_engine.copy(stream.cuda_stream, self.copy_engine.pieces("reload", run, host_idx, dev_idx))
                        events.append(self.land_layer(stream, run[-1], dev_idx))
                else:  # torch (or staged, which has no per-layer form): plain torch copies of those layers
                    runs = [range(i, i + 1) for i in layers]
                    slots = torch.from_numpy(dev_idx).pin_memory().to(self.device, non_blocking=True)
                    keep.append(slots)
                    events = self.torch_path.reload(
                        slots, host_idx, keep, lambda layer: self.land_layer(stream, layer, dev_idx), layers=layers
                    )
        return LayerEventTicket(events, runs, fmt.num_layers, self.device, tuple(keep), self._retired)

    def device_copy(self, src_slots, dst_slots) -> Ticket:
        """Device pages -> other device slots, ordered after the caller's current stream."""
        fmt, tier = self.fmt, self.device_tier
        src = self._slots("source device", src_slots, tier.num_pages, unique=False)
        dst = self._slots("destination device", dst_slots, tier.num_pages, unique=True)
        count = self._same_length(src, dst)
        overlap = sorted(set(np.asarray(src).tolist()) & set(np.asarray(dst).tolist()))
        if overlap:
            raise ValueError(
                f"device_copy source and destination slots overlap at {overlap[:8]}; "
                "copies within one batch run in no order, so they must be disjoint"
            )
        if count == 0:
            return DoneTicket(fmt.num_layers)
        self._reap()
        path = self._choose(converts=False, count=count, calls=1, piece_bytes=fmt.device_plane_bytes)
        self.last_path = path
        caller_done = self.record_ready()
        if path == "kernel":
            lane = self.device_lane
            with lane.lock:
                self.wait_ready(lane.stream, lane.cu_stream, caller_done)
                buffer = lane.buffer(count)
                buffer.src[:count] = src
                buffer.dst[:count] = dst
                seq = lane.next_seq()
                self.kernels.submit("device", lane, buffer, count, seq)
            return FlagTicket(lane, seq, buffer, count, False, self.device)
        stream = self.device_copy_stream
        src_idx, dst_idx = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        keep = []
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            self.wait_ready(stream, None, caller_done)
            if path == "copy_engine":
                self.copy_engine.copy(stream.cuda_stream, self.copy_engine.pieces("device", range(fmt.num_layers), src_idx, dst_idx))
            else:
                pair = torch.from_numpy(np.stack([src_idx, dst_idx])).pin_memory().to(self.device, non_blocking=True)
                keep.append(pair)
                self.torch_path.device_copy(pair[0], pair[1])
            event = torch.cuda.Event()
            event.record(stream)
        return EventTicket([event], fmt.num_layers, self.device, tuple(keep), self._retired)

    def close(self) -> None:
        for stream in (self.offload_stream, self.reload_stream, self.device_copy_stream, self.staging_stream):
            stream.synchronize()
        self._retired.clear()

    # --- choosing a path ---------------------------------------------------------------------
    def _choose(self, converts: bool, count: int, calls: int, staged_ok: bool = False, piece_bytes: int | None = None) -> str:
        return path_choice.choose(
            self.path, self.fmt, self._abilities, converts=converts, count=count, calls=calls, staged_ok=staged_ok,
            piece_bytes=piece_bytes,
        )

    # --- slots -------------------------------------------------------------------------------
    @staticmethod
    def _slots(name: str, slots, limit: int, unique: bool):
        """The slots checked (a list for small batches, an int64 array for large ones)."""
        if isinstance(slots, list) and len(slots) <= SMALL_BATCH:
            if slots:
                low, high = min(slots), max(slots)
                if low < 0 or high >= limit:
                    raise IndexError(f"{name} slot {low if low < 0 else high} out of range [0, {limit})")
                if unique and len(set(slots)) != len(slots):
                    seen, repeats = set(), []
                    for slot in slots:
                        if slot in seen and slot not in repeats:
                            repeats.append(slot)
                        seen.add(slot)
                    raise ValueError(f"{name} slots are written and must not repeat, got {repeats[:16]} more than once")
            return slots
        array = np.asarray(slots, dtype=np.int64)
        if array.ndim != 1:
            raise ValueError(f"{name} slots must be one-dimensional, got shape {array.shape}")
        if array.size:
            low, high = int(array.min()), int(array.max())
            if low < 0 or high >= limit:
                raise IndexError(f"{name} slot {low if low < 0 else high} out of range [0, {limit})")
            if unique and array.size > 1:
                ordered = np.sort(array)  # a sort and a compare: a tenth of np.unique's time
                repeats = ordered[1:][ordered[1:] == ordered[:-1]]
                if repeats.size:
                    raise ValueError(f"{name} slots are written and must not repeat, got {repeats[:16].tolist()} more than once")
        return array

    @staticmethod
    def _same_length(a, b) -> int:
        if len(a) != len(b):
            raise ValueError(f"slot lists differ in length: {len(a)} vs {len(b)}")
        return len(a)

    # --- ordering helpers ----------------------------------------------------------------------
    def wait_ready(self, stream, cu_stream, ready) -> None:
        """Order `stream` after `ready` (a ReadyEvent or a torch.cuda.Event)."""
        handle = getattr(ready, "cuda_event", None)
        if self.driver is not None and handle is not None:
            if handle:  # 0: a torch event never recorded, nothing to wait for
                self.driver.wait_event(cu_stream if cu_stream is not None else stream.cuda_stream, handle)
            return
        stream.wait_event(ready)

    def land_layer(self, stream, layer: int, device_slots: np.ndarray):
        """Run the user transform over a landed layer (on `stream`), then record its event."""
        if self.transform is not None:
            slots = torch.from_numpy(np.asarray(device_slots, dtype=np.int64)).to(self.device, non_blocking=True)
            for plane in range(self.fmt.planes):
                self.transform(layer, plane, self.device_tier.plane(layer, plane), slots)
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def _reap(self) -> None:
        retired = self._retired
        while retired and retired[0][0].query():
            retired.popleft()

    # --- kernel path ---------------------------------------------------------------------------
    def _kernel_reload_per_layer(self, host, dev, count: int, keep: list) -> list:
        """Per-layer launches, each followed by the user transform and an event (reload stream)."""
        lane, stream = self.reload_lane, self.reload_stream
        events = []
        with lane.lock:
            buffer = lane.buffer(count)
            buffer.src[:count] = host
            buffer.dst[:count] = dev
            keep.append(buffer)
            for layer in range(self.fmt.num_layers):
                self.kernels.submit("reload", lane, buffer, count, 0, layers=range(layer, layer + 1))
                events.append(self.land_layer(stream, layer, dev))
        return events

    def _launch(self, launch, blocks: int, lane: StreamLane) -> None:
        function = self._functions.get(launch.name)
        if function is None:
            function = self._compile(launch.name)
        self.driver.launch(function, blocks, THREADS, lane.cu_stream, launch.params_ptr, launch.name)

    def _compile(self, name: str):
        module = "page_copy" if name.startswith("copy_") else "page_convert"
        function = self.driver.function(native.function(self.device.index, module, name))
        self._functions[name] = function
        return function

    def _lane(self, stream) -> StreamLane:
        layers = self.fmt.num_layers
        # 32 flags = one 128-byte line at least, so no lane's flags share a line with another's.
        flags = torch.zeros(max(32, layers + 1), dtype=torch.int32, pin_memory=True)
        counters = torch.zeros(layers + 1, dtype=torch.int32, device=self.device)
        return StreamLane(stream, layers, flags, self._alias(flags), counters, self._pinned_slots, self.driver)

    def _pinned_slots(self, capacity: int) -> tuple[torch.Tensor, int]:
        tensor = torch.zeros((3, capacity), dtype=torch.int32, pin_memory=True)
        return tensor, self._alias(tensor)

    def _alias(self, tensor: torch.Tensor) -> int:
        """Device address of a tensor from torch's pinned allocator (cudaHostAlloc)."""
        try:
            return self.driver.host_device_pointer(tensor.data_ptr())
        except RuntimeError:
            # Allocations of cudaHostAlloc are reachable from the device at their host
            # address wherever addressing is unified (every 64-bit platform CUDA 13 runs on),
            # even when the driver declines to name a separate alias.
            return tensor.data_ptr()

    def _host_pointer(self) -> int:
        """The device-side address of the host buffer: its alias in the GPU's address space.

        Kernels and cudaMemcpyBatchAsync both need it: where the device attribute
        CanUseHostPointerForRegisteredMem is 0 (WSL2, for one) the host address of
        cudaHostRegister'ed memory differs from its device alias and copies to it fault
        (sglang #40232). Elsewhere the two are equal.
        """
        host = self.host_tier.buffer.data_ptr()
        if self.driver is not None:
            return self.driver.host_device_pointer(host)
        if self._runtime is not None:
            error, alias = self._runtime.cudaHostGetDevicePointer(host, 0)
            if error != self._runtime.cudaError_t.cudaSuccess:
                raise RuntimeError(
                    f"cudaHostGetDevicePointer of the host tier buffer at {host:#x} failed: {error.name}; "
                    "is it registered (HostTier(pin=True))?"
                )
            return int(alias)
        # Without cuda-bindings only the torch path runs, and it copies through torch, which
        # resolves registered host memory itself.
        return host
