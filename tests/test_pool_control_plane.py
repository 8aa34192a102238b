"""The pool's control plane: calls cost O(their batch) at any tier size, the lock is never held
across a wait, inputs are checked before anything changes, one key contract everywhere."""

from __future__ import annotations

import sys
import threading
import tracemalloc

import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from kvtier import PageFormat, PoolExhausted, TieredPool, key_id, prefix_keys
from kvtier.index.keys import clear_id_cache
from kvtier.transfer import DoneTicket, TransferEngine
from tests.conftest import fill_random, poison, small_format, snapshot
from tests.deferred_engine import DeferredEngine

LIVENESS_S = 60  # a call that should not wait at all: only a deadlock takes this long


class NoCopyEngine(TransferEngine):
    name = "no-copy"

    def __init__(self, device_tier, host_tier) -> None:
        self.num_layers = device_tier.fmt.num_layers

    def offload(self, device_slots, host_slots, ready=None):
        return DoneTicket(self.num_layers)

    def reload(self, host_slots, device_slots, ready=None):
        return DoneTicket(self.num_layers)

    def device_copy(self, src_slots, dst_slots):
        return DoneTicket(self.num_layers)


TINY = PageFormat(num_layers=1, num_kv_heads=1, head_dim=16, page_size=1, dtype="fp8_e4m3", scale="per_tensor")


def _full_pool(host_pages: int, device_pages: int, policy: str = "write_through"):
    # No offload thread: a thread that holds the lock for a moment would send a match down its
    # other path (read without the lock, applied later), and the line counts would differ by
    # the interleaving, not by the tier's size.
    pool = TieredPool(TINY, device_pages=device_pages, host_pages=host_pages, write_policy=policy,
                      engine=NoCopyEngine, registry=CollectorRegistry(), background_copies=False)
    keys = prefix_keys(np.arange(host_pages), 1, pool.namespace)
    chunk = min(4096, device_pages)
    for start in range(0, host_pages, chunk):
        part = keys[start : start + chunk]
        slots = pool.allocate(len(part))
        pool.commit(part, slots)
        pool.release(slots)
    assert pool.flush() == 0  # the write-through copies the offload thread started have landed
    s = pool.stats()["states"]
    assert s["host"]["free"] == 0 and s["device"]["free"] == 0
    return pool, keys


def _cost(fn) -> tuple[int, int]:
    """(Python lines executed, peak bytes allocated) while fn runs: both grow with any loop over,
    or copy of, a tier, whatever the machine's speed."""
    lines = 0

    def tracer(frame, event, arg):
        nonlocal lines
        if event == "line":
            lines += 1
        return tracer

    tracemalloc.start()
    tracemalloc.reset_peak()
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return lines, peak


def _ops(pool, keys, fresh, batch):
    host_only = keys[len(keys) // 2 : len(keys) // 2 + batch]
    state = {}

    def allocate():
        state["slots"] = pool.allocate(batch)

    def commit():
        pool.commit(fresh, state["slots"])

    def release():
        pool.release(state["slots"])

    def match():
        pool.match(host_only)

    def load():
        state["loaded"] = pool.load(host_only).slots

    def release_loaded():
        pool.release(state["loaded"])

    def evict():
        pool.evict(batch)

    return [allocate, commit, release, match, load, release_loaded, evict, pool.flush, pool.stats]


def test_every_call_costs_the_same_at_any_tier_size():
    """The same calls at 2k and 64k host pages (both tiers full) execute the same number of
    Python lines, give or take hash probing, and allocate no more: nothing is O(capacity)."""
    batch = 16
    costs = []
    for host_pages, device_pages in ((2048, 256), (65536, 8192)):
        pool, keys = _full_pool(host_pages, device_pages)
        # The key-id cache as a fresh process has it at both sizes: filling 64k pages turns its
        # generations over where 2k do not, and a batch whose keys left the young generation is
        # keyed one key at a time (O(batch) lines, not O(capacity), but more than the C paths'
        # whole call at 2k pages).
        clear_id_cache()
        fresh = prefix_keys(np.arange(10**6, 10**6 + batch), 1, pool.namespace)
        measured = []
        for op in _ops(pool, keys, fresh, batch):
            measured.append((op.__name__, *_cost(op)))
            if op.__name__ == "commit":
                pool.flush()  # let the write-through copies land, unmeasured: every size then does the same
        costs.append(measured)
        pool.close()
    for (name, lines_small, peak_small), (_, lines_big, peak_big) in zip(*costs):
        assert lines_big <= 1.5 * lines_small + 50, f"{name}: {lines_small} lines at 2k pages, {lines_big} at 64k"
        assert peak_big <= 2 * peak_small + 64 * 1024, f"{name}: peak {peak_small} B at 2k pages, {peak_big} B at 64k"


def test_flush_with_nothing_dirty_and_stats_do_not_walk_the_tiers():
    small, _ = _full_pool(1024, 128)
    big, _ = _full_pool(65536, 4096)
    for name in ("flush", "stats"):
        lines_small, _ = _cost(getattr(small, name))
        lines_big, _ = _cost(getattr(big, name))
        assert lines_big <= lines_small + 10, f"{name}: {lines_small} lines vs {lines_big}"


def test_allocate_more_than_can_ever_fit_evicts_nothing(registry, gen):
    pool = TieredPool(small_format(), device_pages=8, host_pages=32, write_policy="write_back", registry=registry)
    keys = prefix_keys(np.arange(64), 8, pool.namespace)
    slots = pool.allocate(8)
    fill_random(pool, slots, gen)
    pool.commit(keys, slots)
    pool.release(slots)
    held = pool.allocate(0)
    assert held == []
    before = pool.stats()
    with pytest.raises(PoolExhausted, match="need 1000000000 slots"):
        pool.allocate(10**9)
    pool.acquire(keys[:3])
    with pytest.raises(PoolExhausted, match="3 held by the engine"):
        pool.allocate(6)
    after = pool.stats()
    assert after["evictions"] == before["evictions"] and after["pages_moved"] == before["pages_moved"]
    assert pool.match(keys).device == 8


@pytest.mark.parametrize("bad", [14.7, "14", True, None, (1,)])
def test_slots_must_be_ints(registry, bad):
    pool = TieredPool(small_format(), device_pages=16, host_pages=16, registry=registry)
    slots = pool.allocate(1)
    keys = prefix_keys(np.arange(8), 8, pool.namespace)
    with pytest.raises(TypeError, match="device slot must be an int"):
        pool.commit(keys, [bad])
    with pytest.raises(TypeError, match="device slot must be an int"):
        pool.release([bad])
    assert pool.stats()["states"]["device"]["filling"] == 1
    pool.commit(keys, [np.int64(slots[0])])  # integer types other than int are indexes too
    assert pool.match(keys).device == 1


@pytest.mark.parametrize("bad", [42, 4.2, None, ("a", "b"), bytearray(b"abc"), "", b""])
def test_keys_outside_the_contract_are_refused_before_anything_changes(registry, gen, bad):
    pool = TieredPool(small_format(), device_pages=8, host_pages=16, registry=registry)
    good = prefix_keys(np.arange(16), 8, pool.namespace)
    slots = pool.allocate(2)
    fill_random(pool, slots, gen)
    before = pool.stats()
    error = ValueError if bad in ("", b"") else TypeError
    for call in (lambda: pool.commit([good[0], bad], slots), lambda: pool.match([good[0], bad]),
                 lambda: pool.load([good[0], bad]), lambda: pool.acquire([bad]),
                 lambda: pool.evict(keys=[bad]), lambda: pool.prefetch_to_host([bad])):
        with pytest.raises(error, match="key 1|key 0"):
            call()
    assert pool.stats()["states"] == before["states"] and pool.stats()["hits"] == before["hits"]
    assert pool.commit(good, slots) == 2


def test_a_str_key_and_its_bytes_are_two_pages(registry, gen):
    pool = TieredPool(small_format(), device_pages=8, host_pages=16, write_policy="write_back", registry=registry)
    slots = pool.allocate(2)
    fill_random(pool, slots, gen)
    pages = {k: snapshot(pool, s) for k, s in zip(("abc", b"abc"), slots)}
    assert pages["abc"] != pages[b"abc"]
    pool.commit(["abc", b"abc"], slots)
    pool.release(slots)
    pool.evict(tier="device")
    for key in ("abc", b"abc"):
        target = pool.allocate(1)
        poison(pool, target)
        pool.load([key], target).wait()
        assert snapshot(pool, target[0]) == pages[key]
        pool.release(target)
    assert key_id("abc") != key_id(b"abc")


def test_match_splits_the_prefix_by_nearest_tier_and_hits_agree(registry, gen):
    pool = TieredPool(small_format(), device_pages=8, host_pages=16, write_policy="write_through", registry=registry,
                      name="split")
    keys = prefix_keys(np.arange(80), 8, pool.namespace)
    slots = pool.allocate(8)
    fill_random(pool, slots, gen)
    pool.commit(keys[:8], slots)
    pool.release(slots)
    pool.evict(keys=keys[2:5])  # device: 0,1,5,6,7; host: all eight (write-through)
    m = pool.match(keys)
    assert (m.device, m.host, m.remote, m.total) == (5, 3, 0, 8)
    assert m.device + m.host + m.remote == m.total
    s = pool.stats()
    assert s["hits"] == {"device": 5, "host": 3, "remote": 0} and s["misses"] == 2
    text = generate_latest(registry).decode()
    assert 'kvtier_hits_total{model="default",pool="split",rank="0",tier="host"} 3.0' in text


def test_match_answers_while_another_thread_holds_the_lock_and_its_use_is_applied_after(registry, gen):
    """A match never queues behind another thread's call: while the pool's lock is held it
    answers from the key tables, and the next call that takes the lock applies what the match
    saw: its hits are counted, and the matched page moves to the back of the eviction order."""
    pool = TieredPool(small_format(), device_pages=4, host_pages=16, write_policy="write_through", registry=registry)
    keys = prefix_keys(np.arange(64), 8, pool.namespace)
    slots = pool.allocate(4)
    fill_random(pool, slots, gen)
    for key, slot in zip(keys, slots):  # committed oldest first: keys[0] is the first victim
        pool.commit([key], [slot])
    pool.release(slots)
    pool.flush()
    pool.evict(keys=keys[3:4])  # device: 0, 1, 2; host: all four
    holding, leave = threading.Event(), threading.Event()

    def holder():  # another thread mid-way through a call
        with pool._lock:
            holding.set()
            leave.wait(LIVENESS_S)

    side = threading.Thread(target=holder)
    side.start()
    assert holding.wait(LIVENESS_S)
    answers = []
    asker = threading.Thread(target=lambda: answers.append([pool.match(keys[:1]), pool.match(keys[2:5])]))
    asker.start()
    asker.join(LIVENESS_S)
    assert not asker.is_alive(), "match waited for the lock"
    assert pool._lock.locked() and side.is_alive()
    first, second = answers[0]
    assert (first.device, first.host, first.total) == (1, 0, 1)
    assert (second.device, second.host, second.total) == (1, 1, 2)
    leave.set()
    side.join(LIVENESS_S)
    s = pool.stats()  # the next holder of the lock applies both matches
    assert s["hits"] == {"device": 2, "host": 1, "remote": 0} and s["misses"] == 1
    assert sum(pool.latency_snapshot()["match"][0]) == 2
    # keys[0] was touched by the match: keys[1] is now the oldest device page
    assert pool.evict(1) == 1
    assert pool.match(keys[:1]).device == 1 and pool.match(keys[1:2]).device == 0
    pool.close()


def test_constructor_refuses_bad_options(registry):
    with pytest.raises(TypeError, match="remote must be a directory path"):
        TieredPool(small_format(), device_pages=4, host_pages=4, registry=registry, remote=123)
    with pytest.raises(ValueError, match="remote_queue_depth must be an int > 0, got 0"):
        TieredPool(small_format(), device_pages=4, host_pages=4, registry=registry, remote_queue_depth=0)
    with pytest.raises(ValueError, match="copy_path='bogus': expected one of"):
        TieredPool(small_format(), device_pages=4, host_pages=4, registry=registry, copy_path="bogus")
    with pytest.raises(ValueError, match="close_timeout_s"):
        TieredPool(small_format(), device_pages=4, host_pages=4, registry=registry, close_timeout_s=0)


def test_two_pools_share_the_default_registry():
    """A target and a draft model (or two ranks) in one process, both on prometheus' default
    registry: both register, both are exported under their own labels, closing one keeps the other."""
    target = TieredPool(small_format(), device_pages=4, host_pages=4, model="target")
    draft = TieredPool(small_format(num_layers=1), device_pages=4, host_pages=4, model="draft", rank=1)
    try:
        text = generate_latest(REGISTRY).decode()
        assert f'kvtier_misses_total{{model="target",pool="{target.name}",rank="0"}}' in text
        assert f'kvtier_misses_total{{model="draft",pool="{draft.name}",rank="1"}}' in text
        target.close()
        text = generate_latest(REGISTRY).decode()
        assert 'model="target"' not in text and 'model="draft"' in text
    finally:
        target.close()
        draft.close()


def test_match_does_not_wait_behind_an_allocation_waiting_for_copies(registry, gen):
    """Thread A allocates; room needs dirty pages copied down, and those copies are held in
    flight. While A waits, match, stats and commit from other threads go through."""
    pool = TieredPool(small_format(), device_pages=4, host_pages=16, write_policy="write_back", engine=DeferredEngine,
                      registry=registry)
    engine = pool.engine
    keys = prefix_keys(np.arange(64), 8, pool.namespace)
    slots = pool.allocate(4)
    fill_random(pool, slots, gen)
    pool.commit(keys[:4], slots)
    pool.release(slots)
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.allocate(2)))
    waiter.start()
    assert engine.submitted.acquire(timeout=LIVENESS_S)  # A has queued the copy-down and waits
    done = threading.Event()

    def other():
        assert pool.match(keys[:4]).total == 4
        pool.stats()
        done.set()

    side = threading.Thread(target=other)
    side.start()
    assert done.wait(LIVENESS_S), "match waited behind an allocation that waits for copies"
    assert waiter.is_alive() and not got
    engine.land()
    waiter.join(LIVENESS_S)
    assert len(got[0]) == 2
    assert pool.stats()["pages_moved"]["device_to_host"] == 2


def test_a_second_load_of_a_landing_page_waits_for_its_copy(registry, gen):
    pool = TieredPool(small_format(), device_pages=8, host_pages=16, write_policy="write_through",
                      engine=DeferredEngine, registry=registry)
    engine = pool.engine
    keys = prefix_keys(np.arange(16), 8, pool.namespace)
    slots = pool.allocate(2)
    fill_random(pool, slots, gen)
    expected = {k: snapshot(pool, s) for k, s in zip(keys, slots)}
    pool.commit(keys, slots)
    assert engine.submitted.acquire(timeout=LIVENESS_S)  # the offload thread queued the write-through copy
    engine.land()
    pool.release(slots)
    pool.evict(tier="device")
    first = pool.load(keys)
    second = pool.load(keys)  # the pages are still landing from the first load
    assert second.slots == first.slots
    assert not first.done() and not second.done()
    engine.land()
    second.synchronize()
    assert all(snapshot(pool, s) == expected[k] for k, s in zip(keys, second.slots))
    pool.release(first.slots)
    pool.release(second.slots)


def test_threads_on_a_full_pool_with_copies_in_flight_never_mix_pages(registry):
    """Four threads allocate, commit, load and evict on small tiers while a fifth thread lands
    copies at random moments: every page read back is the page written under its key."""
    pool = TieredPool(small_format(num_layers=2), device_pages=24, host_pages=48, write_policy="write_back",
                      engine=DeferredEngine, registry=registry)
    engine = pool.engine
    stop = threading.Event()
    errors: list[str] = []
    truth: dict = {}
    truth_lock = threading.Lock()
    loads = [0]

    def lander():
        rng = np.random.default_rng(1)
        while not stop.is_set():
            engine.submitted.acquire(timeout=0.01)
            if rng.random() < 0.7:
                engine.land(int(rng.integers(1, 4)))
        engine.land()

    def worker(tid: int):
        gen = torch.Generator().manual_seed(tid)
        rng = np.random.default_rng(tid)
        try:
            for step in range(40):
                keys = prefix_keys(np.arange(8) + 1000 * tid + 8 * step, 8, pool.namespace)
                slots = pool.allocate(1)
                fill_random(pool, slots, gen)
                with truth_lock:
                    truth[keys[0]] = snapshot(pool, slots[0])
                pool.commit(keys, slots)
                pool.release(slots)
                with truth_lock:
                    mine = [k for k in truth if rng.random() < 0.2][:3]
                m = pool.match(mine)
                if m.total:
                    try:
                        handle = pool.load(mine[: m.total])
                    except KeyError as exc:
                        # Write-back without a remote tier: another thread's evict may drop a matched
                        # page from every tier between this match and this load (allowed; see run_stress).
                        if "in no tier" not in str(exc):
                            raise
                        continue
                    handle.synchronize()
                    with truth_lock:
                        loads[0] += 1
                    for k, s in zip(mine, handle.slots):
                        if snapshot(pool, s) != truth[k]:
                            errors.append(f"thread {tid}: key {k.hex()[:8]} in slot {s} holds another page")
                    pool.release(handle.slots)
                if step % 7 == 0:
                    pool.evict(2)
        except Exception as exc:  # any error fails the test with its thread named
            errors.append(f"thread {tid}: {exc!r}")

    landing = threading.Thread(target=lander)
    landing.start()
    workers = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(LIVENESS_S * 3)
    assert not any(t.is_alive() for t in workers), "a worker never finished"
    assert pool.flush() == 0  # the lander still lands the flush's copies
    stop.set()
    landing.join(LIVENESS_S)
    assert not errors, errors[:5]
    assert loads[0] > 0, "no load ever ran: the test checked nothing"
    pool._dev.check()
    pool._host.check()


def test_flush_leaves_no_write_through_copy_queued_behind_it(registry, gen):
    """A commit queues its write-through copy for the offload thread; a flush that runs first
    copies the page itself and drops the queued batch, so nothing copies the page again once
    host eviction makes the device copy the only one (dirty) again."""
    for i in range(200):
        pool = TieredPool(small_format(), device_pages=8, host_pages=4, write_policy="write_through",
                          registry=CollectorRegistry())
        keys = prefix_keys(np.arange(4 * pool.fmt.page_size) + i, pool.fmt.page_size, pool.namespace)
        slots = pool.allocate(4)
        fill_random(pool, slots, gen)
        pool.commit(keys, slots)
        pool.release(slots)
        assert pool.flush() == 0
        pool.evict(tier="host")
        states = pool.stats()["states"]
        assert states["device"]["dirty"] == 4 and states["host"]["resident"] == 0, f"round {i}: {states}"
        pool.close()
