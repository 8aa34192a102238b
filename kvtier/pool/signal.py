"""A condition that counts its notifications, so a waiter never misses one.

A caller decides under the pool's lock that it must wait for progress, then waits after letting
the lock go (other work runs in between). A plain `Condition.wait` would miss a notification sent
in that gap and sleep until its timeout; `wait_past(generation)` returns at once when anything
was notified since `generation` was read under the lock.
"""

from __future__ import annotations

import threading
import time


class ChangeSignal(threading.Condition):
    def __init__(self, lock) -> None:
        super().__init__(lock)
        self.generation = 0  # notifications so far; read and bumped under the lock

    def notify_all(self) -> None:
        self.generation += 1
        super().notify_all()

    def wait_past(self, generation: int, timeout: float) -> bool:
        """Under the lock: wait until a notification after `generation` (True) or `timeout` (False)."""
        deadline = time.monotonic() + timeout
        while self.generation == generation:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.wait(left)
        return True
