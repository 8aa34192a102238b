"""The pool on a remote tier that fails or stalls: the write-back breaker closes by itself once
the store is healthy, and a write held inside the store (the fault seam's mid-request hook, as a
stuck disk holds one) opens the breaker at the store's timeout, so no engine call waits for it.
Real NIXL store, real files, real threads."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvtier import PoolExhausted, prefix_keys
from tests.conftest import write_pages
from tests.test_pool_faults import make_pool, read_back

pytest.importorskip("nixl_cu13")


def hold_writes(pool, release: threading.Event | None = None) -> tuple[threading.Event, threading.Event]:
    """Hold every write request inside the store (as a stuck disk holds it) until `release` is
    set, or 60 s: returns (set once a write is held, release)."""
    held, release = threading.Event(), release or threading.Event()

    def hold(op: str) -> None:
        if op == "WRITE":
            held.set()
            release.wait(60)

    pool.remote.faults.mid_request = hold
    return held, release


@pytest.mark.parametrize("fault", ["error", "error_after_io", "timeout", "enospc"])
def test_the_write_back_breaker_closes_by_itself_after_the_store_heals(tmp_path, gen, fault):
    """Three failed write requests open the breaker; with a healthy store again and no flush,
    evictions send a probe once the back-off is over and the breaker closes, and later pages
    are made durable rather than dropped."""
    pool = make_pool(tmp_path, write_policy="write_back", remote_backoff_s=0.05, remote_backoff_max_s=0.2)
    pool.remote.set_timeout(0.5)
    pool.remote.faults.arm(fault, count=3, op="WRITE")
    truth: dict = {}
    batch = 0
    opened_at = closed_at = None
    deadline = time.monotonic() + 60
    while closed_at is None and time.monotonic() < deadline:
        keys = prefix_keys(np.arange(32 * batch, 32 * batch + 32), 8, pool.namespace)  # 4 pages
        truth.update(write_pages(pool, keys, gen))
        batch += 1
        state = pool.stats()["remote_breaker"]
        if opened_at is None and state != "closed":
            opened_at = batch
        elif opened_at is not None and state == "closed":
            closed_at = batch
        time.sleep(0.01)
    assert opened_at is not None, "the faults never opened the breaker"
    assert closed_at is not None, "the breaker never closed without a flush"
    dropped_before = pool.stats()["dropped"].get("remote_unavailable", 0)
    later = prefix_keys(np.arange(900_000, 900_000 + 32 * 40), 8, pool.namespace)
    for i in range(0, len(later), 4):
        truth.update(write_pages(pool, later[i : i + 4], gen))
    assert pool.stats()["dropped"].get("remote_unavailable", 0) == dropped_before  # healthy: none
    assert pool.flush() == 0
    assert read_back(pool, later[-8:]) == {k: truth[k] for k in later[-8:]}
    pool.close()


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_a_write_held_inside_the_store_does_not_hold_the_engine(tmp_path, gen, policy):
    """The store's write request is held (as a stuck disk holds it): allocate, commit, match
    and close each return within the store's timeout plus their own, and pages written before
    stay readable bit for bit."""
    pool = make_pool(tmp_path, write_policy=policy, remote_backoff_s=0.05)
    pool.remote.set_timeout(0.5)
    early = prefix_keys(np.arange(0, 8 * 16), 8, pool.namespace)  # 16 pages
    truth: dict = {}
    for i in range(0, 16, 4):
        truth.update(write_pages(pool, early[i : i + 4], gen))
    assert pool.flush() == 0
    held, release = hold_writes(pool)
    try:
        longest = 0.0
        for batch in range(40):
            keys = prefix_keys(np.arange(1000 + 32 * batch, 1032 + 32 * batch), 8, pool.namespace)
            start = time.monotonic()
            write_pages(pool, keys, gen)
            pool.match(keys + early)
            longest = max(longest, time.monotonic() - start)
        assert held.is_set(), "no write reached the store"
        assert longest < 10, f"an engine call waited {longest:.1f} s behind a held write"
        start = time.monotonic()
        pool.close(timeout_s=1.0)
        assert time.monotonic() - start < 10
    finally:
        release.set()
        pool.remote.faults.mid_request = None
    with make_pool(tmp_path, write_policy=policy) as again:
        assert read_back(again, early[:8]) == {k: truth[k] for k in early[:8]}


def test_a_held_write_that_holds_every_host_page_does_not_hold_the_engine(tmp_path, gen):
    """The held write carries every page of the host tier (the breaker's probe after a failed
    write takes the whole queue), so no dirty device page can be copied down while it is held:
    once the store's timeout has passed, those pages are dropped and counted instead of waited
    for, a load that needs host room raises PoolExhausted naming the stuck write at once, a
    flush returns with the stuck pages counted as not durable, and pages written before stay
    readable bit for bit."""
    pool = make_pool(tmp_path, write_policy="write_through", remote_backoff_s=1.0, remote_backoff_max_s=2.0)
    pool.remote.set_timeout(0.5)
    early = prefix_keys(np.arange(0, 8 * 8), 8, pool.namespace)  # 8 pages, durable before the fault
    truth: dict = {}
    for i in range(0, 8, 4):
        truth.update(write_pages(pool, early[i : i + 4], gen))
    assert pool.flush() == 0
    pool.remote.faults.arm("error", count=1, op="WRITE")
    release = threading.Event()  # set in `finally` even when the hold below was never installed
    try:
        # Fill the host tier with 16 pages not yet durable while the breaker waits out its back-off.
        first = prefix_keys(np.arange(5000, 5032), 8, pool.namespace)
        write_pages(pool, first, gen)
        deadline = time.monotonic() + 10
        while pool.stats()["remote_breaker"] == "closed" and time.monotonic() < deadline:
            time.sleep(0.005)
        assert pool.stats()["remote_breaker"] == "open", "the failed write did not open the breaker"
        held, release = hold_writes(pool, release)
        for batch in range(1, 4):
            write_pages(pool, prefix_keys(np.arange(5000 + 32 * batch, 5032 + 32 * batch), 8, pool.namespace), gen)
        assert held.wait(10), "the probe never reached the store"
        assert pool.stats()["states"]["host"]["offloading"] == 16, pool.stats()["states"]
        longest = 0.0
        for batch in range(10, 30):
            keys = prefix_keys(np.arange(5000 + 32 * batch, 5032 + 32 * batch), 8, pool.namespace)
            start = time.monotonic()
            write_pages(pool, keys, gen)
            longest = max(longest, time.monotonic() - start)
        assert longest < 10, f"an engine call waited {longest:.1f} s behind a held write"
        assert pool.stats()["dropped"].get("remote_unavailable", 0) > 0
        # A load that must fetch into the host tier finds no room the held write will give back
        # soon: it says so at once instead of waiting for it.
        slots = pool.allocate(1)
        start = time.monotonic()
        with pytest.raises(PoolExhausted, match="stuck inside the store"):
            pool.load(early[:1], slots)
        assert time.monotonic() - start < 10
        pool.release(slots)
        # A flush does not wait for the stuck write either: it reports its pages as not durable.
        start = time.monotonic()
        assert pool.flush() >= 16
        assert time.monotonic() - start < 10
        start = time.monotonic()
        pool.close(timeout_s=1.0)
        assert time.monotonic() - start < 10
    finally:
        release.set()
        pool.remote.faults.mid_request = None
    with make_pool(tmp_path, write_policy="write_through") as again:
        assert read_back(again, early) == {k: truth[k] for k in early}


def test_backups_run_on_one_put_thread_that_ends_with_the_pool(tmp_path, gen):
    """Every backup's store call runs on the same put thread (none started per backup); the
    thread ends when the pool closes, and the pages it wrote read back bit for bit."""
    seen: set[int] = set()
    pool = make_pool(tmp_path, write_policy="write_through")
    put_ids = pool.remote.put_ids

    def noting(ids, buffers):
        seen.add(threading.get_ident())
        return put_ids(ids, buffers)

    pool.remote.put_ids = noting
    truth: dict = {}
    keys = prefix_keys(np.arange(0, 8 * 40), 8, pool.namespace)  # 40 pages, 10 commits
    for i in range(0, 40, 4):
        truth.update(write_pages(pool, keys[i : i + 4], gen))
        assert pool.flush() == 0  # each commit's backup done before the next: one batch each
    named = [t for t in threading.enumerate() if t.name == "kvtier-remote-put"]
    assert len(seen) == 1 and len(named) == 1 and named[0].ident in seen
    pool.close()
    named[0].join(10)
    assert not named[0].is_alive()
    with make_pool(tmp_path, write_policy="write_through") as again:
        for i in range(0, 40, 4):
            assert read_back(again, keys[i : i + 4]) == {k: truth[k] for k in keys[i : i + 4]}
