"""The contract between the pool and whatever moves page bytes between tiers.

Owns the `TransferEngine` interface and the `Ticket` a submitted copy returns. An engine
moves bytes between a `DeviceTier` and a `HostTier` (kvtier.tiers) and converts dtypes on
the way (quantize on offload, upcast on reload) when the page format says so. It must never
decide which pages move: the pool decides, the engine only copies what it is told.

Ordering rules every engine keeps:
- `offload` starts reading device slots only after `ready` (an event recorded after the
  kernel that wrote them) has completed.
- `reload` writes device slots only after `ready` (an event recorded after the work already
  queued on the caller's stream, which may still read a slot just handed out again), and
  records one completion per layer; `Ticket.wait_layer(i)` orders the caller's current
  stream after layer i only.
- `reload_layers` (engines with `reloads_layers`) copies only some layers, on the same stream
  as `reload`, so a pool can queue a large load's first layer chunk by chunk and its other
  layers after; its ticket's `wait_layer` of a layer it does not copy orders nothing.
- `device_copy` likewise writes only after the caller's queued work; its source and
  destination slots are disjoint.
- Destination slots never repeat within one call. Readers wait on the ticket (`wait`,
  `wait_layer`) before they read copied slots.
- The pool reuses a source or destination slot only after `Ticket.done()` says the copy
  finished; engines never hold slots past that.
- An offload that cannot encode a page (NaN or infinity under fp8 storage) still completes
  the rest of its batch and names the page in `Ticket.failed_positions()`; it never raises
  for it and never writes a scale that would decode it as numbers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch

# A user transform run over landed pages: (layer, plane, the device tier's whole
# (num_pages, *plane_shape) tensor of that layer and plane, int64 slots that just landed)
# -> None, editing those slots in place. It runs on the reload stream after the layer's
# bytes have landed and before the layer's readiness is signalled.
ReloadTransform = Callable[[int, int, torch.Tensor, torch.Tensor], None]


class Ticket(ABC):
    """One submitted copy. Cheap to poll; waiting is explicit."""

    @abstractmethod
    def done(self) -> bool:
        """True once every byte of the copy has landed (never blocks)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the calling thread until the copy has landed."""

    @abstractmethod
    def wait(self) -> None:
        """Order the caller's current stream after the whole copy (CPU: block until done)."""

    @abstractmethod
    def wait_layer(self, layer: int) -> None:
        """Order the caller's current stream after layer `layer` of the copy only."""

    def failed_positions(self) -> list[int]:
        """Positions in the batch whose page could not be encoded (valid once `done()`).

        An offload that quantizes refuses a page holding a NaN or an infinity: that page's
        host record is left with unspecified contents and must not be published, while the
        rest of the batch completes. Always empty for copies that do not convert.
        """
        return []


class DoneTicket(Ticket):
    """A copy that already finished when it was submitted (the synchronous CPU twin)."""

    def __init__(self, num_layers: int, failed: list[int] | None = None) -> None:
        self.num_layers = num_layers
        self._failed = failed or []

    def done(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait(self) -> None:
        return None

    def wait_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")

    def failed_positions(self) -> list[int]:
        return list(self._failed)


class JoinedTicket(Ticket):
    """Several copies as one: done when all are, waits on each (a part's `wait_layer` of a
    layer it does not copy orders nothing)."""

    def __init__(self, parts: list[Ticket], num_layers: int) -> None:
        self.parts = parts
        self.num_layers = num_layers

    def done(self) -> bool:
        return all(t.done() for t in self.parts)

    def synchronize(self) -> None:
        for t in self.parts:
            t.synchronize()

    def wait(self) -> None:
        for t in self.parts:
            t.wait()

    def wait_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        for t in self.parts:
            t.wait_layer(layer)

    def failed_positions(self) -> list[int]:
        return [p for t in self.parts for p in t.failed_positions()]


class TransferEngine(ABC):
    """Moves whole pages between the device tier and the host tier."""

    name = "abstract"

    @abstractmethod
    def offload(self, device_slots: list[int], host_slots: list[int], ready: object | None = None) -> Ticket:
        """Copy device pages into host records (quantizing when the format converts)."""

    @abstractmethod
    def reload(self, host_slots: list[int], device_slots: list[int], ready: object | None = None) -> Ticket:
        """Copy host records into device pages layer by layer (upcasting when it converts)."""

    # Engines that can copy a subset of a reload's layers set this and implement reload_layers.
    reloads_layers = False
    # Engines whose offload and reload return once the copies are queued (they move later, on a
    # stream) set this: a long commit then starts its copies chunk by chunk itself. An engine
    # that copies inside the call leaves them to the pool's offload thread.
    queues_copies = False

    def reload_layers(self, host_slots: list[int], device_slots: list[int], layers: range, ready: object | None = None) -> Ticket:
        """Copy only `layers` of host records into device pages, layer by layer, on the same
        stream as `reload` (so calls land in the order they were made). The ticket covers
        those layers: `wait_layer(i)` for a layer outside them orders nothing, `done()` says
        they landed. Engines with `reloads_layers` False do not implement it."""
        raise NotImplementedError(f"{type(self).__name__} cannot reload a subset of layers")

    @abstractmethod
    def device_copy(self, src_slots: list[int], dst_slots: list[int]) -> Ticket:
        """Copy device pages to other device slots (all layers, planes and scales)."""

    def record_ready(self) -> object | None:
        """An event after the work queued so far on the caller's stream (None on the CPU)."""
        return None

    def close(self) -> None:
        """Release streams and staging memory."""


def check_layers(layers: range, num_layers: int) -> None:
    """`layers` must be a non-empty step-1 range inside [0, num_layers)."""
    if not isinstance(layers, range) or layers.step != 1 or not layers or layers.start < 0 or layers.stop > num_layers:
        raise ValueError(f"layers must be a non-empty range inside [0, {num_layers}) with step 1, got {layers!r}")


def layer_runs(layers: range, most: int) -> list[range]:
    """`layers` cut into at most `most` contiguous runs of near-equal length, in order: a
    subset reload's launches (and readiness events), so its host cost stays bounded at any
    layer count."""
    n = len(layers)
    k = max(1, min(n, most))
    bounds = [layers.start + (n * j) // k for j in range(k + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]
