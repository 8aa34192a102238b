"""Fault seam of the remote store's data path, used by tests; inert unless armed.

Owns the choice of which NIXL requests fail and how. It must never change bytes, touch files
or the index: it only tells the NIXL wrapper to refuse, fail or hold a request, and gives
tests a hook between a put's durable records and their publication.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional


class FaultInjector:
    """``arm(mode, count, op)`` makes the next ``count`` transfers of ``op`` ("READ", "WRITE"
    or None for both) fail as ``mode``:
    - ``"error"``: raise before anything is posted to NIXL (a backend that refuses the request);
    - ``"error_after_io"``: the real transfer runs to completion, then is reported failed (an I/O
      error after some bytes moved);
    - ``"timeout"``: the real transfer is posted but treated as in progress until the store's
      timeout passes, then released through the same path as a real timeout;
    - ``"enospc"``: raise as a backend whose device is full (``ENOSPC``), before any byte moves.
    ``before_publish(ids)``, when set, runs after a put's records are durable and before they
    are published (tests kill the process there); ``mid_request(op)``, when set, runs while a
    request is posted and not yet waited for (tests kill the process there too).
    """

    MODES = ("error", "error_after_io", "timeout", "enospc")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: list[list] = []
        self.before_publish: Optional[Callable[[list[bytes]], None]] = None
        self.mid_request: Optional[Callable[[str], None]] = None

    def arm(self, mode: str, count: int = 1, op: Optional[str] = None) -> None:
        """Fail the next ``count`` transfers of ``op`` as ``mode``."""
        if mode not in self.MODES:
            raise ValueError(f"fault mode {mode!r}; expected one of {self.MODES}")
        if op not in ("READ", "WRITE", None):
            raise ValueError(f"fault op {op!r}; expected 'READ', 'WRITE' or None")
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"fault count {count!r}; expected an int >= 1")
        with self._lock:
            self._armed.append([mode, op, count])

    def disarm(self) -> None:
        """Forget every armed fault and hook."""
        with self._lock:
            self._armed.clear()
        self.before_publish = None
        self.mid_request = None

    def quiet(self, op: str) -> bool:
        """Whether no fault is armed for ``op`` and no ``mid_request`` hook is set: then a path
        that bypasses NIXL (small batches) may run."""
        return self.mid_request is None and not any(entry[1] in (None, op) for entry in self._armed)

    def take(self, op: str) -> Optional[str]:
        """The fault mode for this transfer, if one is armed for ``op``."""
        with self._lock:
            for entry in self._armed:
                mode, wanted, remaining = entry
                if wanted in (None, op) and remaining > 0:
                    entry[2] -= 1
                    if entry[2] == 0:
                        self._armed.remove(entry)
                    return mode
        return None
