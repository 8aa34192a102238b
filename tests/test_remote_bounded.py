"""Bounded calls (the remote index's reads): a call that blocks costs its caller the timeout,
later callers a short wait while it is stuck, and nobody anything once it returns. Real threads."""

from __future__ import annotations

import threading
import time

import pytest

from kvtier.tiers.remote.bounded import STUCK_WAIT_S, BoundedCalls, CallTimedOut


def test_a_stuck_call_costs_one_timeout_then_short_waits_until_it_returns():
    calls = BoundedCalls("test-bounded", 3)
    release = threading.Event()
    with pytest.raises(CallTimedOut):
        calls.run(lambda: release.wait(60), 0.3)
    start = time.monotonic()
    with pytest.raises(CallTimedOut):
        calls.run(lambda: release.wait(60), 5.0)  # stuck already: the short wait, not 5 s
    assert time.monotonic() - start < 5.0 - 1.0
    assert calls.run(lambda: 7, 5.0) == 7  # a call that answers in time still answers
    release.set()
    deadline = time.monotonic() + 30
    while calls._stuck and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls._stuck == 0 and calls.timed_out == 2
    assert calls.run(lambda: threading.current_thread().name, 5.0) == "test-bounded"
    with pytest.raises(ZeroDivisionError):
        calls.run(lambda: 1 / 0, 5.0)
    calls.close()
    assert STUCK_WAIT_S < 1.0


def test_no_more_threads_than_allowed_run_at_once():
    calls = BoundedCalls("test-bounded", 2)
    release = threading.Event()
    running = []
    lock = threading.Lock()

    def call():
        with lock:
            running.append(1)
        release.wait(60)
        return len(running)

    for _ in range(2):
        with pytest.raises(CallTimedOut):
            calls.run(call, 0.2)
    with pytest.raises(CallTimedOut, match="all 2 threads"):
        calls.run(call, 0.2)
    assert len(running) == 2
    release.set()
    calls.close()
