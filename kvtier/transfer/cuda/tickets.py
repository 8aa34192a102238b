"""Tickets of the CUDA engine and the per-stream state they read: flags, sequence numbers, slot buffers.

Owns the two kinds of ticket a CUDA transfer returns and what backs them:
- `FlagTicket`: a transfer made by one kernel launch that signals each layer through the
  lane's flags (native/page_signal.cu). `done()` reads flags[num_layers] from pinned host
  memory and compares it cyclically with the transfer's sequence number, no CUDA call;
  `wait_layer(i)` queues cuStreamWaitValue32(caller stream, &flags[i], seq, GEQ), so the
  caller's stream waits for layer i only; `synchronize()` spins briefly, then sleeps with
  backoff, and checks the stream is still busy so a failed launch raises instead of hanging.
- `EventTicket`: transfers that still record torch events (copy engines, staged, torch
  path, per-layer reloads with a user transform).
A `StreamLane` is one engine stream's flags (pinned, device-mapped int32[num_layers + 1]),
its device counters (int32[num_layers + 1], zeroed once), its sequence number and its pinned
slot buffers: the slot lists a kernel reads through their device alias and the per-page
`failed` marks of the quantize kernel. A buffer goes back to the lane when its ticket has
seen the transfer done (after reading the failed marks), or, when the ticket is dropped
first, once the lane sees the transfer's sequence number land.
It must never decide which pages move or launch anything.
"""

from __future__ import annotations

import collections
import threading
import time

import numpy as np
import torch

from kvtier.transfer.engine import Ticket

SEQ_MASK = 0xFFFFFFFF
SEQ_HALF = 0x80000000
# synchronize(): spin this long (a small transfer lands within it), then sleep, doubling the
# nap up to MAX_NAP_S; every STALL_CHECK_S of sleeping, ask the driver whether the stream is
# idle: idle with the flag unset means the kernel never ran or failed. The longest nap bounds
# how late synchronize() returns after the transfer lands: with 1 ms naps the first H200 run
# returned up to 0.9 ms late (a 16-page 92-layer load done at 5.0 ms, its bytes at 4.0 ms).
SPIN_S = 100e-6
FIRST_NAP_S = 10e-6
MAX_SLEEP_S = 1e-3  # longest sleep while a transfer is not yet due
RATE_MIN_BYTES = 1 << 20  # transfers this large teach their lane its rate
MAX_NAP_S = 50e-6
STALL_CHECK_S = 0.05


def landed(flag: int, seq: int) -> bool:
    """(int32)(flag - seq) >= 0: the flag has reached seq, across 2**32 wrap-around."""
    return ((flag - seq) & SEQ_MASK) < SEQ_HALF


class SlotBuffer:
    """Pinned int32 rows: source slots, destination slots, failed marks; with their device aliases."""

    __slots__ = ("capacity", "tensor", "src", "dst", "failed", "src_ptr", "dst_ptr", "failed_ptr")

    def __init__(self, tensor: torch.Tensor, alias: int) -> None:
        self.capacity = tensor.shape[1]
        self.tensor = tensor
        rows = tensor.numpy()
        self.src, self.dst, self.failed = rows[0], rows[1], rows[2]
        row = self.capacity * 4
        self.src_ptr, self.dst_ptr, self.failed_ptr = alias, alias + row, alias + 2 * row


class StreamLane:
    """One engine stream's flags, counters, sequence number and slot buffers.

    `flags` is an int32 tensor of at least num_layers + 1 entries in (pinned) host memory and
    `flags_alias` its device address; `counters` an int32 device tensor of num_layers + 1
    zeros. `pin(tensor) -> alias` pins nothing itself: it returns the device alias of a pinned
    tensor (the identity on the CPU emulator). `driver` may be None where nothing waits on
    the GPU (the CPU emulator).
    """

    def __init__(
        self, stream, num_layers: int, flags: torch.Tensor, flags_alias: int, counters: torch.Tensor, pinned, driver
    ) -> None:
        if flags.numel() < num_layers + 1 or counters.numel() < num_layers + 1:
            raise ValueError(f"a lane of {num_layers} layers needs {num_layers + 1} flags and counters")
        self.stream = stream
        self.stream_handle = 0 if stream is None else stream.cuda_stream
        self.cu_stream = None if driver is None else driver.stream(self.stream_handle)
        self.num_layers = num_layers
        self.flags_tensor = flags
        self.flags = flags.numpy()
        self.flags_alias = flags_alias
        self.counters = counters
        self.arrived_ptr = counters.data_ptr()
        self.finished_ptr = counters.data_ptr() + 4 * num_layers
        self.driver = driver
        self.lock = threading.RLock()  # a dropped ticket may hand its buffer back while the lock is held
        self.seq = 0
        self.bytes_per_s = 0.0  # the fastest rate a transfer of this lane was seen landing at (0: none yet)
        self._pinned = pinned
        self._free: dict[int, list[SlotBuffer]] = {}
        self._orphans: collections.deque[tuple[int, SlotBuffer]] = collections.deque()

    def next_seq(self) -> int:
        """The next sequence number (call under `lock`, and launch before releasing it)."""
        self.seq = (self.seq + 1) & SEQ_MASK
        return self.seq

    def saw(self, bytes_per_s: float) -> None:
        """A transfer landed this fast, counted from its submission (queueing only makes it look slower)."""
        if bytes_per_s > self.bytes_per_s:
            self.bytes_per_s = bytes_per_s

    def landed(self, seq: int, layer: int) -> bool:
        return landed(int(self.flags[layer]), seq)

    def buffer(self, count: int) -> SlotBuffer:
        """A slot buffer of at least `count` entries that no transfer in flight reads."""
        while self._orphans and self.landed(self._orphans[0][0], self.num_layers):
            self.recycle(self._orphans.popleft()[1])
        capacity = 64
        while capacity < count:
            capacity *= 2
        free = self._free.get(capacity)
        if free:
            return free.pop()
        return SlotBuffer(*self._pinned(capacity))

    def recycle(self, buffer: SlotBuffer) -> None:
        self._free.setdefault(buffer.capacity, []).append(buffer)

    def orphan(self, seq: int, buffer: SlotBuffer) -> None:
        """A buffer whose ticket was dropped before it saw its transfer land."""
        self._orphans.append((seq, buffer))


class FlagTicket(Ticket):
    """A one-launch transfer on `lane` with sequence number `seq` (see the module docstring)."""

    __slots__ = ("_lane", "_seq", "_buffer", "_count", "_reads_failed", "_failed", "num_layers", "device", "nbytes",
                 "submitted")

    def __init__(
        self, lane: StreamLane, seq: int, buffer: SlotBuffer, count: int, reads_failed: bool, device, nbytes: int = 0
    ) -> None:
        self.nbytes = nbytes  # bytes the transfer moves (0: unknown); with `submitted`, what synchronize expects
        self.submitted = time.perf_counter()
        self._lane = lane
        self._seq = seq
        self._buffer = buffer
        self._count = count
        self._reads_failed = reads_failed
        self._failed: list[int] = []
        self.num_layers = lane.num_layers
        self.device = device

    def done(self) -> bool:
        if self._buffer is None:
            return True
        if not landed(int(self._lane.flags[self.num_layers]), self._seq):
            return False
        if self.nbytes >= RATE_MIN_BYTES:
            self._lane.saw(self.nbytes / (time.perf_counter() - self.submitted))
        buffer, self._buffer = self._buffer, None
        if self._reads_failed:
            self._failed = np.flatnonzero(buffer.failed[: self._count]).tolist()
        with self._lane.lock:
            self._lane.recycle(buffer)
        return True

    def synchronize(self) -> None:
        """Return once the transfer has landed. Where the lane has seen its rate (the fastest
        transfer of its direction so far, bytes over the time from submission to landing),
        sleep through most of the time this one should take and spin around the moment it is
        due, so a large transfer neither burns a core for its whole length nor is seen late
        by a nap's timer slack (a 10 µs sleep lasts 60-110 µs on Linux); then nap with backoff.
        Queueing only makes a transfer look slower and the lane keeps the fastest, so the sleep
        ends before the transfer does (a rate seen too fast only starts the spin sooner)."""
        if self.done():
            return
        lane = self._lane
        if lane.bytes_per_s and self.nbytes:
            due = self.submitted + self.nbytes / lane.bytes_per_s
            while True:
                left = due - SPIN_S - time.perf_counter()
                if left <= 0:
                    break
                time.sleep(min(left, MAX_SLEEP_S))
                if self.done():
                    return
            spin_until = max(time.perf_counter(), due) + SPIN_S
        else:
            spin_until = time.perf_counter() + SPIN_S
        while time.perf_counter() < spin_until:
            if self.done():
                return
        nap, slept = FIRST_NAP_S, 0.0
        while not self.done():
            time.sleep(nap)
            slept += nap
            nap = min(2 * nap, MAX_NAP_S)
            if slept >= STALL_CHECK_S:
                slept = 0.0
                lane = self._lane
                if lane.driver is not None and lane.driver.stream_idle(lane.cu_stream) and not self.done():
                    raise RuntimeError(
                        f"transfer {self._seq} on stream {lane.stream_handle:#x} never signalled: the stream is "
                        f"idle but flags[{self.num_layers}] = {int(lane.flags[self.num_layers])}"
                    )

    def wait(self) -> None:
        self._wait_flag(self.num_layers)

    def wait_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        self._wait_flag(layer)

    def _wait_flag(self, index: int) -> None:
        lane = self._lane
        if landed(int(lane.flags[index]), self._seq):
            return
        caller = torch._C._cuda_getCurrentRawStream(self.device.index)
        lane.driver.wait_value(caller, lane.flags_alias + 4 * index, self._seq)

    def failed_positions(self) -> list[int]:
        if not self.done():
            raise RuntimeError("failed_positions() is valid once done() is True")
        return list(self._failed)

    def __del__(self) -> None:
        buffer = self._buffer
        if buffer is not None:
            self._buffer = None
            with self._lane.lock:
                self._lane.orphan(self._seq, buffer)


class EventTicket(Ticket):
    """A copy in flight: one torch event per layer (or one for all) and what it must keep alive."""

    def __init__(
        self, layer_events: list, num_layers: int, device: torch.device, keepalive: tuple, retired, failed=()
    ) -> None:
        self.layer_events = layer_events
        self.num_layers = num_layers
        self.device = device
        self._keepalive = keepalive
        self._retired = retired
        self._failed = list(failed)

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

    def failed_positions(self) -> list[int]:
        if not self.done():
            raise RuntimeError("failed_positions() is valid once done() is True")
        return list(self._failed)

    def __del__(self) -> None:
        # Dropped before done: what the copy still reads (pinned slot lists, staging) must
        # outlive it, so it goes to the engine's `retired` queue until the last event fires.
        if self._keepalive:
            self._retired.append((self.layer_events[-1], self._keepalive))


class LayerEventTicket(EventTicket):
    """A copy of some layers only (`reload_layers`): one event per run of layers, in order (a
    layer is ready at its run's event); `wait_layer` of a layer outside them orders nothing."""

    def __init__(self, run_events: list, runs: list, num_layers: int, device, keepalive: tuple, retired) -> None:
        super().__init__(run_events, num_layers, device, keepalive, retired)
        self._by_layer = {layer: event for run, event in zip(runs, run_events) for layer in run}

    def wait_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        event = self._by_layer.get(layer)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
