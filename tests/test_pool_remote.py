"""TieredPool with the remote tier: real NIXL, real files."""

import threading
import time

import pytest
import torch
from prometheus_client import CollectorRegistry

pytest.importorskip("nixl_cu13")

from kvtier import TieredPool, prefix_keys  # noqa: E402
from kvtier.tiers.remote import RemoteStore  # noqa: E402
from tests.conftest import fill_random, poison, small_format, snapshot  # noqa: E402
from tests.test_pool import run_stress  # noqa: E402


def make_pool(store_dir, **kw):
    kw.setdefault("device_pages", 8)
    kw.setdefault("host_pages", 16)
    kw.setdefault("write_policy", "write_back")
    return TieredPool(kw.pop("fmt", small_format()), remote=str(store_dir), registry=CollectorRegistry(), **kw)


def write(pool, keys, gen):
    truth = {}
    for i in range(0, len(keys), 4):
        batch = keys[i : i + 4]
        slots = pool.allocate(len(batch))
        fill_random(pool, slots, gen)
        truth.update({k: snapshot(pool, s) for k, s in zip(batch, slots)})
        pool.commit(batch, slots)
        pool.release(slots)
    return truth


def stored_pages(tmp_path, gen, n):
    """n pages written by a pool of model "m" that has since closed: they live in the store only."""
    pool = make_pool(tmp_path, model="m")
    keys = prefix_keys(list(range(8 * n)), 8, pool.namespace)
    truth = write(pool, keys, gen)
    pool.close()
    return keys, truth, pool.namespace


def check(pool, keys, truth):
    for i in range(0, len(keys), 6):
        batch = keys[i : i + 6]
        slots = pool.allocate(len(batch))
        poison(pool, slots)
        pool.load(batch, slots).wait()
        for k, s in zip(batch, slots):
            assert snapshot(pool, s) == truth[k], f"page {k[:8]}"
        pool.release(slots)


def test_write_back_spills_through_host_to_remote_and_loads_back(tmp_path, gen):
    pool = make_pool(tmp_path)
    keys = prefix_keys(list(range(8 * 60)), 8, pool.namespace)
    truth = write(pool, keys, gen)  # 60 pages through 8 device and 16 host slots
    s = pool.stats()
    assert s["pages_moved"]["host_to_remote"] >= 60 - 8 - 16 and s["dropped"] == {}
    m = pool.match(keys)
    assert m.total == 60 and m.remote > 0
    check(pool, keys, truth)
    assert pool.stats()["pages_moved"]["remote_to_host"] > 0
    pool.close()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_close_makes_every_page_durable_and_a_new_pool_serves_it(tmp_path, gen, policy):
    pool = make_pool(tmp_path, write_policy=policy, model="m")
    keys = prefix_keys(list(range(8 * 20)), 8, pool.namespace)
    truth = write(pool, keys, gen)
    pool.close()
    again = make_pool(tmp_path, write_policy=policy, model="m")
    m = again.match(keys)
    assert (m.device, m.host, m.remote, m.total) == (0, 0, 20, 20)
    handle = again.load(keys[:6])  # lands in new slots via host
    handle.wait()
    for k, s in zip(keys[:6], handle.slots):
        assert snapshot(again, s) == truth[k]
    again.release(handle.slots)
    check(again, keys, truth)
    again.close()


def test_other_namespaces_never_hit_in_a_shared_store(tmp_path, gen):
    a = make_pool(tmp_path, model="model-a")
    keys = prefix_keys(list(range(8 * 6)), 8, a.namespace)
    write(a, keys, gen)
    a.flush()
    b = make_pool(tmp_path, model="model-b")
    # Same keys on purpose: only the namespace differs.
    assert b.match(keys).total == 0
    with pytest.raises(KeyError):
        b.load(keys)
    b.remote.clear()
    a.close()
    again = make_pool(tmp_path, model="model-a")
    assert again.match(keys).remote == 6  # b's clear left a's pages alone
    again.close()
    b.close()


def test_failed_backups_are_counted_kept_dirty_and_retried(tmp_path, gen):
    pool = make_pool(tmp_path, write_policy="write_through", host_pages=32)
    pool.remote.faults.arm("error", count=10**6, op="WRITE")
    keys = prefix_keys(list(range(8 * 8)), 8, pool.namespace)
    truth = write(pool, keys, gen)
    assert pool.flush() == 8  # every page is still in the host tier, and flush says so
    s = pool.stats()
    assert s["remote_failures"]["write"] >= 8 and s["pages_moved"].get("host_to_remote", 0) == 0
    assert s["states"]["host"]["dirty"] == 8 and s["remote_breaker"] == "open" and s["dropped"] == {}
    pool.remote.faults.disarm()
    assert pool.flush() == 0  # the retry
    s = pool.stats()
    assert s["pages_moved"]["host_to_remote"] == 8 and s["states"]["host"]["dirty"] == 0
    assert s["remote_breaker"] == "closed"
    pool.close()
    again = make_pool(tmp_path)
    check(again, keys, truth)
    again.close()


def test_read_failures_are_misses_and_the_pool_goes_on(tmp_path, gen):
    keys, truth, _ = stored_pages(tmp_path, gen, 4)
    again = make_pool(tmp_path, model="m")
    again.remote.faults.arm("error", count=1, op="READ")
    with pytest.raises(KeyError, match="4 of 4 keys"):
        again.load(keys)
    assert again.stats()["states"]["host"]["free"] == 16  # nothing half-landed stays
    assert again.stats()["remote_failures"]["read"] == 4
    # A page whose read failed left the remote index at once: a miss from now on, never a
    # promise that fails again.
    assert again.match(keys).total == 0
    fresh = prefix_keys(list(range(1000, 1000 + 8 * 4)), 8, again.namespace)
    check(again, fresh, write(again, fresh, gen))  # the pool goes on
    again.close()


def test_prefetch_to_host_runs_in_the_background(tmp_path, gen):
    keys, truth, _ = stored_pages(tmp_path, gen, 5)
    again = make_pool(tmp_path, model="m")
    ticket = again.prefetch_to_host(keys)
    ticket.synchronize()
    m = again.match(keys)
    assert (m.host, m.remote) == (5, 0)
    check(again, keys, truth)
    assert again.prefetch_to_host(keys) is None  # nothing left to fetch
    again.close()


def test_a_caller_owned_store_must_match_the_pool(tmp_path):
    fmt = small_format()
    store = RemoteStore(str(tmp_path), namespace="ab" * 32, page_bytes=fmt.page_bytes)
    with pytest.raises(ValueError, match="namespace"):
        TieredPool(fmt, device_pages=4, host_pages=4, remote=store, registry=CollectorRegistry())
    store.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("slow_writes", [False, pytest.param(True, marks=pytest.mark.stress)], ids=["", "slow_writes"])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_threads_with_a_remote_tier_never_lose_or_mix_pages(tmp_path, policy, slow_writes):
    pool = make_pool(tmp_path, write_policy=policy, device_pages=64, host_pages=96)
    if slow_writes:
        # Every remote write takes 200 ms more (a slow disk): loads wait for host room while
        # backups are in flight and must sleep until one lands, not retry on a timer and give up.
        pool.remote.faults.mid_request = lambda op: time.sleep(0.2) if op == "WRITE" else None
    loaded = run_stress(pool, threads=4, iterations=25, lossless=True)
    assert loaded >= 4 * 25  # every iteration of every thread loaded its pick
    assert pool.stats()["pages_moved"]["remote_to_host"] > 0
    assert pool.flush() == 0
    pool.close()


def test_committing_a_page_the_host_is_fetching_from_remote(tmp_path, gen):
    keys, _, namespace = stored_pages(tmp_path, gen, 4)
    fmt = small_format()
    store = RemoteStore(str(tmp_path), namespace=namespace.digest, page_bytes=fmt.page_bytes, timeout_s=0.5)
    again = TieredPool(fmt, device_pages=8, host_pages=16, write_policy="write_through", remote=store,
                       model="m", registry=CollectorRegistry())
    store.faults.arm("timeout", count=1, op="READ")  # the fetch stays in flight for 0.5 s, then fails
    ticket = again.prefetch_to_host(keys)
    assert not ticket.done()
    slots = again.allocate(4)  # the engine recomputes the same pages meanwhile
    fill_random(again, slots, gen)
    recomputed = {k: snapshot(again, s) for k, s in zip(keys, slots)}
    # commit never waits: the pages the host tier is still fetching stay dirty on the device
    assert again.commit(keys, slots) == 4
    again.release(slots)
    assert again.stats()["states"]["device"]["dirty"] == 4
    ticket.synchronize()  # the fetch times out: a miss
    assert again.flush() == 0  # write-through copies them down now
    s = again.stats()
    assert s["pages_moved"]["device_to_host"] == 4
    again.evict(tier="device")
    check(again, keys, recomputed)
    assert store.stats()["read_failures"] == 4  # the timed-out fetch was a miss, counted by the store
    again.close()
    store.close()


def test_a_load_larger_than_the_host_tier_says_so(tmp_path, gen):
    from kvtier import PoolExhausted

    keys, _, _ = stored_pages(tmp_path, gen, 8)
    small = make_pool(tmp_path, model="m", device_pages=16, host_pages=4)
    assert small.match(keys).remote == 8
    with pytest.raises(PoolExhausted, match="host tier: need 8 slots"):
        small.load(keys)  # in the remote tier, but 8 pages cannot pass through 4 host slots at once
    handle = small.load(keys[:4])
    handle.wait()
    assert len(handle.slots) == 4
    small.close()


def commit_steadily(pool, base, truth, lock, stop, errors):
    """Commit 4 fresh random pages at a time until `stop`, each page listed in `truth` once
    committed; an exception ends the thread into `errors`."""
    try:
        g = torch.Generator().manual_seed(base)
        n = 0
        while not stop.is_set():
            keys = prefix_keys(list(range(base + 32 * n, base + 32 * n + 32)), 8, pool.namespace)
            n += 1
            slots = pool.allocate(len(keys))
            fill_random(pool, slots, g)
            pages = {k: snapshot(pool, s) for k, s in zip(keys, slots)}
            pool.commit(keys, slots)
            pool.release(slots)
            with lock:
                truth.update(pages)
    except Exception as exc:
        errors.append(repr(exc))


def test_flush_returns_once_its_pages_are_durable_while_commits_keep_the_backup_queue_busy(tmp_path, gen):
    """Backups slowed at the store's fault seam and a committer that never pauses: the backup
    queue never drains, and flush still returns once the pages dirty when it began are durable
    (it used to wait for an empty queue, and under steady commits never returned)."""
    pool = make_pool(tmp_path, write_policy="write_through", device_pages=32, host_pages=64)
    pool.remote.faults.before_publish = lambda ids: time.sleep(0.01)
    truth, lock, stop, errors = {}, threading.Lock(), threading.Event(), []
    thread = threading.Thread(target=commit_steadily, args=(pool, 0, truth, lock, stop, errors))
    thread.start()
    try:
        waited = time.monotonic() + 60
        while pool.stats()["backup_queue"] < 8:  # the committer ahead of the backups
            assert time.monotonic() < waited and not errors, errors or "the committer never got ahead of the backups"
            time.sleep(0.002)
        with lock:
            before = list(truth)
        assert pool.flush() == 0
        assert all(pool.remote.contains(before))  # durable in the last tier
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    pool.remote.faults.before_publish = None
    assert pool.flush() == 0
    pool.evict(tier="device")
    pool.evict(tier="host")
    check(pool, list(truth)[-40:], truth)
    pool.close()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_flush_beside_steady_commits_makes_what_was_dirty_durable_and_reports_no_failure(tmp_path, gen, policy, caplog):
    pool = make_pool(tmp_path, write_policy=policy, device_pages=32, host_pages=64)
    truth, lock, stop, errors = {}, threading.Lock(), threading.Event(), []
    threads = [threading.Thread(target=commit_steadily, args=(pool, base, truth, lock, stop, errors))
               for base in (0, 10**7)]
    for t in threads:
        t.start()
    try:
        for _ in range(12):
            time.sleep(0.02)
            with lock:
                before = list(truth)  # committed before this flush starts
            with caplog.at_level("WARNING", logger="kvtier.pool.pool"):
                assert pool.flush() == 0  # pages committed meanwhile are not failures
            assert all(pool.remote.contains(before[-200:]))  # durable in the last tier
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors
    assert "could not be made durable" not in caplog.text
    assert pool.flush() == 0
    pool.evict(tier="device")
    pool.evict(tier="host")
    check(pool, list(truth)[-60:], truth)
    pool.close()
