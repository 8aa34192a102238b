"""Moves pages between the host tier and the remote store on one background thread.

Owns the worker thread, its bounded job queue and the tickets it hands back. Every call
that moves bytes to or from the remote store goes through this one thread, in order;
index-only queries (`contains`) are made by the pool directly, since the store's index is
thread-safe and they should not wait behind queued backups. The worker never takes the pool's lock: it only fills in results and marks the
ticket done; the pool applies them when it reaps the ticket. It must never decide which
pages move, nor touch the pool's indexes.
"""

from __future__ import annotations

import logging
import queue
import threading

from kvtier.transfer.engine import Ticket

log = logging.getLogger(__name__)


class RemoteTicket(Ticket):
    """One remote job. `result` holds the store's answer once `done()`."""

    def __init__(self, num_layers: int) -> None:
        self._event = threading.Event()
        self.num_layers = num_layers
        self.result = None
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self._event.is_set()

    def synchronize(self) -> None:
        self._event.wait()

    wait = synchronize

    def wait_layer(self, layer: int) -> None:
        self._event.wait()

    def _finish(self, result=None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self._event.set()


class RemoteMover:
    def __init__(self, store, num_layers: int, queue_depth: int = 64) -> None:
        self.store = store
        self.num_layers = num_layers
        self._jobs: queue.Queue = queue.Queue(maxsize=queue_depth)
        self._thread = threading.Thread(target=self._run, name="kvtier-remote", daemon=True)
        self._thread.start()

    def submit(self, fn, *args) -> RemoteTicket:
        """Run `fn(store, *args)` on the worker; blocks while the queue is full (backpressure)."""
        if not self._thread.is_alive():
            raise RuntimeError("the remote mover is closed")
        ticket = RemoteTicket(self.num_layers)
        self._jobs.put((ticket, fn, args))
        return ticket

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            ticket, fn, args = item
            try:
                ticket._finish(result=fn(self.store, *args))
            except Exception as exc:  # handed to the pool through the ticket, which counts it
                log.warning("remote job %s failed: %r", getattr(fn, "__name__", fn), exc)
                ticket._finish(error=exc)

    def close(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
