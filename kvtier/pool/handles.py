"""What the pool hands back to the engine: match results, load handles, and its one error.

Owns the small value types of the public API. It must never decide anything or touch an index.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.transfer import Ticket


class PoolExhausted(RuntimeError):
    """A tier has no free or evictable slot left: every page is held or being copied."""


@dataclass(frozen=True)
class MatchResult:
    """The loadable prefix of one `match` call, split by the nearest tier holding each page.

    total: how many leading keys can be loaded from some tier. device / host / remote: how many
    pages of those `total` are nearest in that tier (a page on the device counts as device even
    when the host has it too; remote counts pages only the remote tier holds), so
    device + host + remote == total. `kvtier_hits_total{tier}` counts exactly these numbers.
    """

    device: int
    host: int
    remote: int
    total: int


class LoadHandle:
    """The copies of one `load`. `wait`/`wait_layer` order the caller's current stream
    (no host blocking on CUDA); `synchronize` blocks the calling thread.

    `slots[i]` is the device slot of key i. Pages that were already landing on the device
    for an earlier load are waited for too.
    """

    def __init__(self, tickets: list[Ticket], num_layers: int, slots: list[int]) -> None:
        self._tickets = tickets
        self.num_layers = num_layers
        self.slots = slots

    def done(self) -> bool:
        return all(t.done() for t in self._tickets)

    def wait(self) -> None:
        for t in self._tickets:
            t.wait()

    def wait_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        for t in self._tickets:
            t.wait_layer(layer)

    def synchronize(self) -> None:
        for t in self._tickets:
            t.synchronize()
