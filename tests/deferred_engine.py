"""A CPU copy engine whose copies land only when the test says so.

It is the torch twin with the asynchrony of a GPU: `offload`, `reload` and `device_copy` queue
the copy and return a ticket that is not done; `land()` performs the oldest queued copies (bytes
move then, as they would when a stream reaches them) and marks their tickets done. Tests use it
to hold copies in flight and check what the pool does meanwhile: which calls wait, which do not,
and that no slot is reused under a copy.
"""

from __future__ import annotations

import threading

from kvtier.transfer import Ticket, TorchEngine


class DeferredTicket(Ticket):
    def __init__(self, num_layers: int, layers: range | None = None) -> None:
        self.num_layers = num_layers
        self.layers = range(num_layers) if layers is None else layers  # what the copy moves
        self.landed = threading.Event()
        self.failed: list[int] = []

    def done(self) -> bool:
        return self.landed.is_set()

    def synchronize(self) -> None:
        self.landed.wait()

    def wait(self) -> None:
        self.landed.wait()

    def wait_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        if layer in self.layers:
            self.landed.wait()

    def failed_positions(self) -> list[int]:
        return list(self.failed)


class DeferredEngine(TorchEngine):
    name = "deferred"
    queues_copies = True  # they land when the test says

    def __init__(self, device_tier, host_tier) -> None:
        super().__init__(device_tier, host_tier)
        self._queue: list[tuple[DeferredTicket, object]] = []
        self._lock = threading.Lock()
        self.submitted = threading.Semaphore(0)  # released once per queued copy

    def _defer(self, run, layers: range | None = None) -> DeferredTicket:
        ticket = DeferredTicket(self.fmt.num_layers, layers)
        with self._lock:
            self._queue.append((ticket, run))
        self.submitted.release()
        return ticket

    def offload(self, device_slots, host_slots, ready=None):
        device_slots, host_slots = list(device_slots), list(host_slots)

        def run(ticket):
            done = TorchEngine.offload(self, device_slots, host_slots)
            ticket.failed = done.failed_positions()

        return self._defer(run)

    def reload(self, host_slots, device_slots, ready=None):
        host_slots, device_slots = list(host_slots), list(device_slots)
        return self._defer(lambda ticket: TorchEngine.reload(self, host_slots, device_slots))

    def reload_layers(self, host_slots, device_slots, layers, ready=None):
        host_slots, device_slots = list(host_slots), list(device_slots)
        return self._defer(lambda ticket: TorchEngine.reload_layers(self, host_slots, device_slots, layers), layers)

    def device_copy(self, src_slots, dst_slots):
        src_slots, dst_slots = list(src_slots), list(dst_slots)
        return self._defer(lambda ticket: TorchEngine.device_copy(self, src_slots, dst_slots))

    def pending(self) -> int:
        with self._lock:
            return len(self._queue)

    def land(self, n: int | None = None) -> int:
        """Perform the n oldest queued copies (all when None); returns how many landed."""
        with self._lock:
            take = self._queue if n is None else self._queue[:n]
            self._queue = [] if n is None else self._queue[n:]
        for ticket, run in take:
            run(ticket)
            ticket.landed.set()
        return len(take)
