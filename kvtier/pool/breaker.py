"""A circuit breaker for the remote tier's writes: a failing store is probed, not hammered.

Owns the health state of one remote direction and the back-off between attempts:
CLOSED (healthy: write whenever there is work), OPEN (the last attempt failed: nothing is
tried until `retry_at`), HALF_OPEN (one probe batch is in flight; its outcome closes the
breaker or opens it again with twice the back-off, up to `max_s`, with jitter so that many
processes on one store do not probe in step). It must never do I/O or sleep; the pool asks
it, acts, and reports the outcome.
"""

from __future__ import annotations

import random
import time
from typing import Callable
from enum import IntEnum


class BreakerState(IntEnum):
    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class CircuitBreaker:
    def __init__(self, base_s: float = 0.1, max_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < base_s <= max_s:
            raise ValueError(f"back-off must satisfy 0 < base_s <= max_s, got base_s={base_s!r} max_s={max_s!r}")
        self.base_s = base_s
        self.max_s = max_s
        self._clock = clock
        self.state = BreakerState.CLOSED
        self.retry_at = 0.0
        self._backoff = base_s
        self.opened = 0  # times the breaker went from CLOSED to OPEN
        self.failures = 0  # failed attempts, probes included
        self.last_error: str | None = None

    @property
    def healthy(self) -> bool:
        return self.state == BreakerState.CLOSED

    def allow(self) -> bool:
        """May an attempt start now? Turns OPEN into HALF_OPEN once the back-off has passed."""
        if self.state == BreakerState.CLOSED:
            return True
        if self.state == BreakerState.OPEN and self._clock() >= self.retry_at:
            self.state = BreakerState.HALF_OPEN
            return True
        return False

    def wait_s(self) -> float:
        """Seconds until an attempt may start (0 when one may start now; inf while a probe runs)."""
        if self.state == BreakerState.CLOSED:
            return 0.0
        if self.state == BreakerState.HALF_OPEN:
            return float("inf")
        return max(0.0, self.retry_at - self._clock())

    def force_probe(self) -> None:
        """Let the next attempt start now (an explicit flush or close asks for one)."""
        if self.state == BreakerState.OPEN:
            self.retry_at = self._clock()

    def record(self, ok: bool, error: str | None = None) -> None:
        """The outcome of an attempt that `allow` let start."""
        if ok:
            self.state = BreakerState.CLOSED
            self._backoff = self.base_s
            return
        self.failures += 1
        self.last_error = error
        if self.state == BreakerState.CLOSED:
            self.opened += 1
        else:
            self._backoff = min(self.max_s, self._backoff * 2)
        self.state = BreakerState.OPEN
        self.retry_at = self._clock() + self._backoff * random.uniform(0.8, 1.2)
