"""The pool's two threads to the remote store: one reads, one writes.

Owns the threads and the tickets of remote jobs. Every remote read (a fetch for a load or a
prefetch hint) runs on the reader thread, in order; every write (a backup batch) on the writer
thread, so a load's fetch never queues behind backups. A job's I/O runs without the pool's
lock; its outcome is then applied under the lock by the `apply` callback the pool gave, the
waiters are woken (`changed.notify_all()`), and only then is the ticket marked done. So once
a ticket is done, the pool's indexes already say what the job did.

A backup still inside the store past the store's `timeout_s` (plus `STALL_GRACE_S`) is reported
to the pool at once (`on_stall`, under the lock: its breaker opens, so callers that need room stop
waiting for it) while the call goes on; its pages stay busy until it returns, and its real
outcome is applied then. A stuck disk can hold a write inside the kernel where no timeout
reaches it; this keeps the engine's calls from waiting on it. The store call runs on a third
thread, started with the first backup and kept (the writer hands it one call at a time and waits
for it, so one thread is enough; a thread started per backup cost 68 µs of CPU on the 2-core VM
against 38 for the hand-off).

The writer pulls its work: `next_batch()` (called with the lock held, may wait on `changed`)
returns the next backup batch `(ids, buffers, apply)`, or None to stop. The reader's queue is bounded for prefetch
hints only (`try_read`); a load's fetch always gets in. It must never decide which pages move,
nor touch the pool's indexes outside the callbacks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable

from kvtier.transfer.engine import Ticket

log = logging.getLogger(__name__)

STALL_GRACE_S = 1.0


class RemoteTicket(Ticket):
    """One remote job. `result` holds the store's answer (one bool per page) once `done()`."""

    def __init__(self, num_layers: int) -> None:
        self._event = threading.Event()
        self.num_layers = num_layers
        self.result: list[bool] | None = None
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self._event.is_set()

    def synchronize(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    def wait(self) -> None:
        self._event.wait()

    def wait_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        self._event.wait()

    def _finish(self) -> None:
        self._event.set()


Apply = Callable[[list[bool], "BaseException | None", float], None]


class RemoteLink:
    def __init__(self, store: object, lock: threading.Lock, changed: threading.Condition, num_layers: int,
                 queue_depth: int, next_batch: Callable[[], tuple | None],
                 on_stall: Callable[[str], None] | None = None) -> None:
        self.store = store
        self._on_stall = on_stall
        self.num_layers = num_layers
        self._lock = lock
        self._changed = changed
        self._queue_depth = queue_depth
        self._reads: queue.SimpleQueue = queue.SimpleQueue()
        self._queued_reads = 0
        self._next_batch = next_batch
        self._puts: queue.SimpleQueue | None = None  # the put thread's inbox, once started
        self._reader = threading.Thread(target=self._read_loop, name="kvtier-remote-read", daemon=True)
        self._writer = threading.Thread(target=self._write_loop, name="kvtier-remote-write", daemon=True)
        self._reader.start()
        self._writer.start()

    # --- submitting (the pool holds its lock) --------------------------------------------------
    def read(self, ids: list[bytes], buffers: list, apply: Apply) -> RemoteTicket:
        """Queue a fetch of `ids` into `buffers`; `apply(found, error, seconds)` runs under the lock."""
        ticket = RemoteTicket(self.num_layers)
        self._queued_reads += 1
        self._reads.put((ticket, ids, buffers, apply))
        return ticket

    def try_read(self, ids: list[bytes], buffers: list, apply: Apply) -> RemoteTicket | None:
        """Like `read`, for hints: None when `queue_depth` reads are already queued."""
        if self._queued_reads >= self._queue_depth:
            return None
        return self.read(ids, buffers, apply)

    # --- threads ---------------------------------------------------------------------------------
    def _run(self, ticket: RemoteTicket, fn, ids, buffers, apply: Apply) -> None:
        start = time.perf_counter()
        result, error = None, None
        try:
            result = fn(ids, buffers)
        except Exception as exc:  # the store failed as a whole: every page of the job failed
            error = exc
            log.warning("remote %s of %d pages failed: %r", fn.__name__, len(ids), exc)
        if result is None:
            result = [False] * len(ids)
        ticket.result, ticket.error = result, error
        with self._lock:
            try:
                apply(result, error, time.perf_counter() - start)
            finally:
                self._changed.notify_all()
        ticket._finish()

    def _read_loop(self) -> None:
        while True:
            job = self._reads.get()
            if job is None:
                return
            ticket, ids, buffers, apply = job
            try:
                self._run(ticket, self.store.get_ids, ids, buffers, apply)
            finally:
                with self._lock:
                    self._queued_reads -= 1

    def _write_loop(self) -> None:
        try:
            while True:
                with self._lock:
                    batch = self._next_batch()
                if batch is None:
                    return
                ids, buffers, apply = batch
                self._run(RemoteTicket(self.num_layers), self._put, ids, buffers, apply)
        finally:
            if self._puts is not None:
                self._puts.put(None)  # the put thread ends once it is idle (the writer waited for its call)

    def _put(self, ids: list[bytes], buffers: list) -> list[bool]:
        """`store.put_ids` on a thread of its own, reporting a stall (see the module docstring)."""
        timeout_s = getattr(self.store, "timeout_s", None)
        if self._on_stall is None or timeout_s is None:
            return self.store.put_ids(ids, buffers)
        done: Future = Future()
        if self._puts is None:
            self._puts = queue.SimpleQueue()
            threading.Thread(target=self._put_loop, args=(self._puts,), name="kvtier-remote-put", daemon=True).start()
        self._puts.put((ids, buffers, done))
        limit = timeout_s + STALL_GRACE_S
        try:
            return done.result(limit)
        except FutureTimeout:
            if done.done():
                raise
        with self._lock:
            try:
                self._on_stall(f"remote put of {len(ids)} pages still running after {limit:.3g} s (a stuck disk?)")
            finally:
                self._changed.notify_all()
        return done.result()

    def _put_loop(self, inbox: queue.SimpleQueue) -> None:
        """The put thread: one `store.put_ids` at a time, its outcome handed to the writer."""
        while True:
            job = inbox.get()
            if job is None:
                return
            ids, buffers, done = job
            try:
                done.set_result(self.store.put_ids(ids, buffers))
            except BaseException as exc:  # handed to the writer thread
                done.set_exception(exc)

    # --- closing ---------------------------------------------------------------------------------
    def close(self, timeout_s: float) -> bool:
        """Stop both threads (the writer stops once `next_batch` returns None). Returns False when
        a thread is still inside a store call after `timeout_s` (the store must then stay open)."""
        self._reads.put(None)
        deadline = time.monotonic() + max(0.0, timeout_s)
        for thread in (self._reader, self._writer):
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in (self._reader, self._writer) if t.is_alive()]
        if alive:
            log.error("remote threads %s still inside a store call after %.1f s; leaving the store open", alive, timeout_s)
        return not alive
