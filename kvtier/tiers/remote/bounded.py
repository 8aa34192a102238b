"""Calls that may block on a stuck disk, run where the caller can stop waiting for them.

Owns a few daemon threads that run blocking calls (the remote index's SQLite reads) for callers
that wait at most a deadline. A SQLite read in WAL mode writes its read mark into the index's
shared-memory file; on a frozen file system (``fsfreeze``, a hung device) that write faults and
sleeps in the kernel until the thaw, and no timeout inside SQLite ends it. Here the caller gives
up at its deadline (``CallTimedOut``) and the thread stays behind until the call returns, then
serves again. While a call that outlived its caller's deadline is still running (the disk is
stuck), later calls wait at most ``STUCK_WAIT_S``: a stuck disk costs one caller the timeout,
not every caller. It must never run more than ``max_threads`` calls at once (a call beyond that
waits for a thread within its deadline), never kill or interrupt a call, and never retry one.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable, TypeVar

T = TypeVar("T")

STUCK_WAIT_S = 0.05


class CallTimedOut(TimeoutError):
    """A bounded call did not return within its deadline (it goes on in the background)."""


class BoundedCalls:
    def __init__(self, name: str, max_threads: int) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads {max_threads!r}; expected >= 1")
        self.name = name
        self.max_threads = max_threads
        self._lock = threading.Condition(threading.Lock())
        self._idle: list[queue.SimpleQueue] = []
        self._threads = 0
        self._closed = False
        self._stuck = 0  # calls still running after their caller gave up
        self.timed_out = 0  # calls whose caller stopped waiting (for stats and tests)

    def run(self, fn: Callable[[], T], timeout_s: float) -> T:
        """``fn()`` on one of the threads; raises CallTimedOut if no thread is free or the
        call has not returned within ``timeout_s`` seconds; re-raises what ``fn`` raised."""
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")
        if self._stuck:
            timeout_s = min(timeout_s, STUCK_WAIT_S)
        inbox = self._take(timeout_s)
        done: Future = Future()
        inbox.put((fn, done))
        try:
            return done.result(timeout_s)
        except TimeoutError:
            if done.done():
                raise
            with self._lock:
                self.timed_out += 1
                self._stuck += 1
            done.add_done_callback(self._unstuck)
            raise CallTimedOut(f"{self.name}: no answer within {timeout_s:.3g} s") from None

    def _take(self, timeout_s: float) -> queue.SimpleQueue:
        with self._lock:
            if not self._idle and self._threads < self.max_threads:
                self._threads += 1
                inbox: queue.SimpleQueue = queue.SimpleQueue()
                threading.Thread(target=self._serve, args=(inbox,), name=self.name, daemon=True).start()
                return inbox
            if not self._lock.wait_for(lambda: self._idle, timeout_s):
                self.timed_out += 1
                raise CallTimedOut(
                    f"{self.name}: all {self.max_threads} threads are still inside earlier calls "
                    f"after {timeout_s:.3g} s"
                )
            return self._idle.pop()

    def _unstuck(self, _: Future) -> None:
        with self._lock:
            self._stuck -= 1

    def close(self) -> None:
        """Idle threads end now, busy ones when their call returns."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for inbox in idle:
            inbox.put(None)

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        while True:
            job = inbox.get()
            if job is None:
                return
            fn, done = job
            try:
                done.set_result(fn())
            except BaseException as exc:  # handed to the caller
                done.set_exception(exc)
            with self._lock:
                if self._closed:
                    return
                self._idle.append(inbox)
                self._lock.notify()
