"""A failing remote tier degrades the pool to a cache, never to an outage (real NIXL store, real
files, faults injected at the store's backend seam), and the circuit breaker behind it."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from kvtier import PoolExhausted, TieredPool, prefix_keys
from kvtier.pool import BreakerState, CircuitBreaker
from tests.conftest import fill_random, poison, small_format, snapshot, write_pages

pytest.importorskip("nixl_cu13")


def make_pool(tmp_path, **kw):
    kw.setdefault("device_pages", 8)
    kw.setdefault("host_pages", 16)
    kw.setdefault("model", "m")
    return TieredPool(small_format(), registry=CollectorRegistry(), remote=str(tmp_path), **kw)


def read_back(pool, keys) -> dict:
    slots = pool.allocate(len(keys))
    poison(pool, slots)
    pool.load(keys, slots).synchronize()
    got = {k: snapshot(pool, s) for k, s in zip(keys, slots)}
    pool.release(slots)
    return got


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("fault", ["error", "enospc", "error_after_io"])
def test_a_failing_remote_degrades_the_pool_to_a_cache(tmp_path, gen, caplog, policy, fault):
    """150 batches through 8 device and 16 host slots while every remote write fails: no call
    raises, pages that fit stay readable bit for bit, what had to go is counted and logged once,
    and pages the remote tier already held stay loadable throughout."""
    pool = make_pool(tmp_path, write_policy=policy)
    stored = prefix_keys(np.arange(8 * 16), 8, pool.namespace)
    stored_truth = {}
    for i in range(0, 16, 4):
        stored_truth.update(write_pages(pool, stored[i : i + 4], gen))
    assert pool.flush() == 0  # healthy: all 16 are durable
    pool.evict(tier="device")
    pool.evict(tier="host")
    assert pool.match(stored).remote == 16
    pool.remote.faults.arm(fault, count=10**6, op="WRITE")
    caplog.set_level(logging.WARNING, logger="kvtier.pool.pool")
    truth = {}
    for batch in range(150):
        keys = prefix_keys(np.arange(10_000 + 32 * batch, 10_000 + 32 * batch + 32), 8, pool.namespace)
        truth.update(write_pages(pool, keys, gen))  # must never raise PoolExhausted
        if batch % 25 == 0:
            got = read_back(pool, stored[batch % 16 : batch % 16 + 2])
            assert all(got[k] == stored_truth[k] for k in got), "a page already in the remote tier changed"
    s = pool.stats()
    assert s["remote_breaker"] in ("open", "half_open") and s["remote_failures"]["write"] > 0
    assert s["dropped"].get("remote_unavailable", 0) > 0
    drops = [r for r in caplog.records if "remote tier unavailable" in r.getMessage()]
    assert len(drops) == 1, [r.getMessage() for r in drops]
    # Whatever is still cached is exact; whatever is not is a miss, never another page.
    last = list(truth)[-4:]
    m = pool.match(last)
    assert m.total == 4 and m.remote == 0
    assert read_back(pool, last) == {k: truth[k] for k in last}
    for i in (0, 8):  # the remote's pages, all 16, through the full host tier
        assert read_back(pool, stored[i : i + 8]) == {k: stored_truth[k] for k in stored[i : i + 8]}
    pool.remote.faults.disarm()
    after = prefix_keys(np.arange(90_000, 90_000 + 32), 8, pool.namespace)
    write_pages(pool, after, gen)
    assert pool.flush() == 0  # the breaker probes, closes, and what is dirty is written
    assert pool.stats()["remote_breaker"] == "closed"
    pool.close()


def test_dirty_pages_are_never_dropped_while_the_remote_is_healthy(tmp_path, gen):
    pool = make_pool(tmp_path, write_policy="write_back")
    truth = {}
    for batch in range(40):
        keys = prefix_keys(np.arange(8 * 4 * batch, 8 * 4 * (batch + 1)), 8, pool.namespace)
        truth.update(write_pages(pool, keys, gen))
    assert pool.stats()["dropped"] == {}
    assert pool.flush() == 0
    keys = list(truth)
    for i in range(0, len(keys), 8):
        assert read_back(pool, keys[i : i + 8]) == {k: truth[k] for k in keys[i : i + 8]}
    pool.close()


def test_a_transient_write_failure_is_retried_and_nothing_is_lost(tmp_path, gen):
    pool = make_pool(tmp_path, write_policy="write_through", host_pages=64, remote_backoff_s=0.01)
    pool.remote.faults.arm("error", count=1, op="WRITE")
    keys = prefix_keys(np.arange(8 * 32), 8, pool.namespace)
    truth = {}
    for i in range(0, 32, 4):
        truth.update(write_pages(pool, keys[i : i + 4], gen))
    assert pool.flush() == 0
    s = pool.stats()
    assert s["remote_failures"]["write"] >= 1 and s["remote_breaker_opened"] == 1
    assert s["dropped"] == {} and s["remote_breaker"] == "closed"
    pool.close()
    again = make_pool(tmp_path)
    assert again.match(keys).remote == 32
    for i in range(0, 32, 8):
        assert read_back(again, keys[i : i + 8]) == {k: truth[k] for k in keys[i : i + 8]}
    again.close()


def test_close_with_a_hung_remote_keeps_its_timeout_and_reports_what_was_lost(tmp_path, gen):
    pool = make_pool(tmp_path, write_policy="write_back", close_timeout_s=2.0)
    keys = prefix_keys(np.arange(8 * 8), 8, pool.namespace)
    write_pages(pool, keys, gen)
    pool.remote.faults.arm("timeout", count=10**6, op="WRITE")
    start = time.monotonic()
    lost = pool.close()
    elapsed = time.monotonic() - start
    assert lost == 8
    assert pool.stats()["dropped"]["close"] == 8
    assert elapsed < 30, f"close took {elapsed:.1f} s with close_timeout_s=2"  # it took 60 s before


def test_a_failing_remote_index_is_a_miss_for_match(tmp_path, gen, monkeypatch):
    pool = make_pool(tmp_path)
    keys = prefix_keys(np.arange(8 * 4), 8, pool.namespace)

    def broken(ids):
        raise OSError("index unreadable")

    monkeypatch.setattr(pool.remote, "contains_ids", broken)
    m = pool.match(keys)
    assert (m.total, m.remote) == (0, 0)
    assert pool.stats()["remote_failures"]["read"] == 4
    pool.close()


def test_match_never_waits_behind_a_slow_remote_write(tmp_path, gen):
    """A backup stuck in the store (the fault seam pauses it before publication) holds no pool
    lock: match, commit and load of local pages go on meanwhile."""
    pool = make_pool(tmp_path, write_policy="write_through", host_pages=32)
    entered, release = threading.Event(), threading.Event()

    def stall(keys):
        entered.set()
        release.wait(60)

    pool.remote.faults.before_publish = stall
    keys = prefix_keys(np.arange(8 * 8), 8, pool.namespace)
    truth = write_pages(pool, keys[:4], gen)
    assert entered.wait(60), "the backup never reached the store"
    more = write_pages(pool, keys[4:], gen)
    m = pool.match(keys)
    assert m.total == 8
    assert read_back(pool, keys) == {**truth, **more}
    release.set()
    pool.remote.faults.before_publish = None
    assert pool.flush() == 0
    pool.close()


def test_breaker_backs_off_doubling_with_jitter_and_closes_on_success():
    now = [100.0]
    breaker = CircuitBreaker(base_s=1.0, max_s=8.0, clock=lambda: now[0])
    assert breaker.healthy and breaker.allow()
    breaker.record(False, "disk full")
    assert breaker.state == BreakerState.OPEN and not breaker.allow()
    waits = []
    for _ in range(6):
        waits.append(breaker.wait_s())
        now[0] = breaker.retry_at
        assert breaker.allow() and breaker.state == BreakerState.HALF_OPEN
        assert not breaker.allow()  # one probe at a time
        breaker.record(False, "disk full")
    assert 0.8 <= waits[0] <= 1.2 and 1.6 <= waits[1] <= 2.4 and 3.2 <= waits[2] <= 4.8
    assert all(6.4 <= w <= 9.6 for w in waits[3:])  # capped at max_s, with jitter
    assert breaker.opened == 1 and breaker.failures == 7 and breaker.last_error == "disk full"
    now[0] = breaker.retry_at
    assert breaker.allow()
    breaker.record(True)
    assert breaker.healthy and breaker.wait_s() == 0
    breaker.record(False)
    assert 0.8 <= breaker.wait_s() <= 1.2  # back to the first back-off
    with pytest.raises(ValueError, match="0 < base_s <= max_s"):
        CircuitBreaker(base_s=2.0, max_s=1.0)


def test_a_load_the_host_tier_cannot_hold_still_raises_pool_exhausted(tmp_path, gen):
    pool = make_pool(tmp_path, host_pages=4, device_pages=16)
    keys = prefix_keys(np.arange(8 * 8), 8, pool.namespace)
    write_pages(pool, keys, gen)
    pool.flush()
    pool.evict(tier="device")
    pool.evict(tier="host")
    with pytest.raises(PoolExhausted, match="host tier: need 8 slots"):
        pool.load(keys)
    pool.close()


def _poison_page(pool, slot, value=float("nan")) -> None:
    k, _ = pool.device_kv(1)
    k[slot, 0, 0, 0] = value


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_page_that_cannot_be_encoded_is_refused_alone(tmp_path, gen, caplog, policy, value):
    """bf16 on the device over fp8 storage: a page holding NaN or Inf cannot be encoded. It is
    refused (counted, logged once), every other page of its batch goes down and survives a
    reopen, no slot leaks, and no later, unrelated call raises because of it."""
    fmt = small_format(device_dtype="bf16")
    pool = TieredPool(fmt, device_pages=8, host_pages=16, write_policy=policy, model="m",
                      registry=CollectorRegistry(), remote=str(tmp_path))
    caplog.set_level(logging.WARNING, logger="kvtier.pool.pool")
    keys = prefix_keys(np.arange(8 * 6), 8, pool.namespace)
    slots = pool.allocate(6)
    fill_random(pool, slots, gen)
    _poison_page(pool, slots[2], value)
    pool.commit(keys, slots)
    pool.release(slots)
    more = pool.allocate(8)  # evicts all six: the bad one cannot go down, nothing raises
    pool.release(more)
    assert pool.flush() == 0
    s = pool.stats()
    assert s["dropped"] == {"not_encodable": 1}
    assert s["states"]["device"]["filling"] == 0 and s["states"]["host"]["loading"] == 0
    assert sum("could not be encoded" in r.getMessage() for r in caplog.records) == 1
    m = pool.match(keys)
    assert m.total == 2  # keys[2] is a miss, so the prefix stops there
    pool.close()
    again = TieredPool(fmt, device_pages=8, host_pages=16, model="m", registry=CollectorRegistry(),
                       remote=str(tmp_path))
    assert again.match(keys[:2]).total == 2 and again.match(keys[3:]).total == 3
    assert again.match(keys[2:3]).total == 0
    again.close()


def _four_pages_one_refused(gen):
    """A write-back pool with 4 committed pages (slots still held), the second one not encodable."""
    fmt = small_format(device_dtype="bf16")
    pool = TieredPool(fmt, device_pages=8, host_pages=16, write_policy="write_back", registry=CollectorRegistry())
    keys = prefix_keys(np.arange(8 * 4), 8, pool.namespace)
    slots = pool.allocate(4)
    fill_random(pool, slots, gen)
    _poison_page(pool, slots[1])
    pool.commit(keys, slots)
    return pool, slots


def test_flush_counts_a_refused_page_as_not_durable(gen):
    pool, slots = _four_pages_one_refused(gen)
    assert pool.flush() == 1  # the engine still holds the slots: the page stays the engine's
    s = pool.stats()
    assert s["dropped"] == {"not_encodable": 1} and s["states"]["device"]["filling"] == 1
    pool.release(slots)
    assert pool.stats()["states"]["device"]["filling"] == 0
    pool.close()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_flush_after_an_outage_backs_up_the_host_before_copying_down(tmp_path, gen, policy):
    """The host tier is full of pages the failing remote tier could not take, the breaker still
    open when it recovers: a flush probes with those pages first, so copying the device's new
    pages down drops none of them (it dropped 4 every time when it copied down first)."""
    pool = make_pool(tmp_path, write_policy=policy)
    pool.remote.faults.arm("error_after_io", count=10**6, op="WRITE")
    for batch in range(60):
        keys = prefix_keys(np.arange(10_000 + 32 * batch, 10_000 + 32 * batch + 32), 8, pool.namespace)
        write_pages(pool, keys, gen)
    pool.remote.faults.disarm()
    s = pool.stats()
    assert s["remote_breaker"] != "closed" and s["states"]["host"]["dirty"] > 0
    after = prefix_keys(np.arange(90_000, 90_000 + 32), 8, pool.namespace)
    truth = write_pages(pool, after, gen)
    dropped = dict(pool.stats()["dropped"])
    assert pool.flush() == 0
    s = pool.stats()
    assert s["dropped"] == dropped and s["remote_breaker"] == "closed"
    assert s["states"]["host"]["dirty"] == 0 and s["states"]["device"]["dirty"] == 0
    pool.evict(tier="device")
    pool.evict(tier="host")
    assert read_back(pool, after) == truth
    pool.close()


def test_close_counts_a_page_dropped_during_its_flush_once(gen):
    pool, slots = _four_pages_one_refused(gen)
    pool.release(slots)
    assert pool.close() == 1  # refused by the copy down during close's flush
    assert pool.stats()["dropped"] == {"not_encodable": 1}  # under its own reason, not also "close"


def figures(root, batches: int = 150) -> dict:
    """Run the degraded-remote scenario for every fault kind and write policy and count what
    happened (`python tests/test_pool_faults.py` prints these for RELIABILITY.md)."""
    import tempfile

    import torch

    totals = {"runs": 0, "batches": 0, "calls_raised": 0, "pages_verified": 0, "wrong_pages": 0,
              "remote_pages_verified": 0, "dropped_remote_unavailable": 0, "write_failures": 0,
              "breaker_opened": 0, "recovered": 0}
    for policy in ("write_through", "write_back"):
        for fault in ("error", "enospc", "error_after_io"):
            gen = torch.Generator().manual_seed(len(policy) * 7 + len(fault))
            with tempfile.TemporaryDirectory(dir=root) as store:
                pool = TieredPool(small_format(), device_pages=8, host_pages=16, write_policy=policy, model="m",
                                  registry=CollectorRegistry(), remote=store)
                stored = prefix_keys(np.arange(8 * 16), 8, pool.namespace)
                stored_truth = {}
                for i in range(0, 16, 4):
                    stored_truth.update(write_pages(pool, stored[i : i + 4], gen))
                pool.flush()
                pool.evict(tier="device")
                pool.evict(tier="host")
                pool.remote.faults.arm(fault, count=10**6, op="WRITE")
                truth = {}
                for batch in range(batches):
                    keys = prefix_keys(np.arange(10_000 + 32 * batch, 10_000 + 32 * batch + 32), 8, pool.namespace)
                    try:
                        truth.update(write_pages(pool, keys, gen))
                        cached = [k for k in keys if pool.match([k]).total]
                        got = read_back(pool, cached) if cached else {}
                    except Exception:  # counted: the figure must be 0
                        totals["calls_raised"] += 1
                        continue
                    totals["pages_verified"] += len(got)
                    totals["wrong_pages"] += sum(got[k] != truth[k] for k in got)
                for i in (0, 8):
                    got = read_back(pool, stored[i : i + 8])
                    totals["remote_pages_verified"] += len(got)
                    totals["wrong_pages"] += sum(got[k] != stored_truth[k] for k in got)
                s = pool.stats()
                totals["dropped_remote_unavailable"] += s["dropped"].get("remote_unavailable", 0)
                totals["write_failures"] += s["remote_failures"].get("write", 0)
                totals["breaker_opened"] += s["remote_breaker_opened"]
                pool.remote.faults.disarm()
                write_pages(pool, prefix_keys(np.arange(90_000, 90_032), 8, pool.namespace), gen)
                totals["recovered"] += pool.flush() == 0 and pool.stats()["remote_breaker"] == "closed"
                pool.close()
                totals["runs"] += 1
                totals["batches"] += batches
    return totals


if __name__ == "__main__":
    import json
    import platform
    import sys
    import tempfile

    started = time.time()
    result = figures(tempfile.gettempdir(), batches=int(sys.argv[1]) if len(sys.argv) > 1 else 150)
    result["seconds"] = round(time.time() - started, 1)
    result["date"] = time.strftime("%Y-%m-%d")
    result["python"] = platform.python_version()
    print(json.dumps(result, indent=2))
