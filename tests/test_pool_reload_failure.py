"""A load that picks its own slots (slots=None) and takes the general path (`_submit_load`, which
reloads through `movement._reload`), whose reload raises as it is started: the load raises the
engine's error and gives back everything it took (new device slots, holds on device and host
sources, keys bound to its targets); the same load then lands every page bit-exact.

Two ways a load reaches the general path, on real pool objects and real threads:
- some of its pages are only in the remote tier (real NIXL store in a temporary directory),
  read into the host tier by the pool's reader thread before the reload;
- the device has no free slot and its evictable pages are dirty (write-back): the room must
  wait for their copies down, landed by a thread of the test (the deferred engine).
The engine is the torch twin (or the deferred engine) whose chosen reload call raises."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest

from kvtier import TieredPool, prefix_keys
from kvtier.index import PageState
from kvtier.index.keys import key_ids
from tests.conftest import poison, small_format, snapshot, write_pages
from tests.failing_reload import FailingDeferredEngine, FailingTorchEngine

S = PageState
LIVENESS_S = 30


def _slots(index) -> dict[int, tuple]:
    """Every slot of a tier: (state, key id or None, engine holds (pins), copies in flight (busy))."""
    table = index.table
    return {
        slot: (S(index.state[slot]), table.id_of(slot) if table.holds_key(slot) else None,
               index.pins[slot], index.busy[slot])
        for slot in range(index.capacity)
    }


def _changed(before: dict, after: dict) -> dict[int, tuple]:
    return {slot: (before[slot], after[slot]) for slot in before if before[slot] != after[slot]}


def _nothing_left(pool) -> None:
    """No copy or fetch in flight, no reload marked as landing, the indexes consistent."""
    assert not pool._inflight and not pool._dev_landing and not pool._fetching
    assert not any(pool._evicting)
    assert pool._dev.busy_slots == 0 and pool._host.busy_slots == 0
    pool._dev.check()
    pool._host.check()


def _poison_all_but(pool, keep) -> None:
    """0xFF bytes and NaN scales in every device slot but `keep`: wherever the load's new pages
    land, they land over poison."""
    keep = set(keep)
    poison(pool, [s for s in range(pool._dev.capacity) if s not in keep])


def _retry_lands_bit_exact(pool, engine, keys, expected, dev_slots, landing=contextlib.nullcontext) -> None:
    """With every device slot but the load's resident pages (`dev_slots`) poisoned, the same load,
    unarmed, takes the general path again and lands every page bit-exact; the new pages let go,
    nothing is left held. `landing(engine)` wraps the load (a thread landing deferred copies)."""
    _poison_all_but(pool, dev_slots)
    engine.arm(0)
    with landing(engine):
        handle = pool.load(keys)
        handle.synchronize()
    assert engine.general == [True]
    assert sorted(handle.slots[: len(dev_slots)]) == sorted(dev_slots)
    assert all(snapshot(pool, s) == expected[k] for k, s in zip(keys, handle.slots))
    pool.release(handle.slots)
    pool.match(keys[:1])  # a call that reaps
    assert pool._dev.held == 0
    _nothing_left(pool)


@contextlib.contextmanager
def _landing(engine):
    """A thread landing the deferred engine's copies as they come, for the block's duration;
    whatever is still queued lands after it."""
    stop = threading.Event()

    def run():
        while not stop.is_set():
            engine.land()
            stop.wait(0.001)

    thread = threading.Thread(target=run, name="test-lander", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(LIVENESS_S)
        assert not thread.is_alive()
        engine.land()


def test_a_load_from_the_remote_tier_whose_reload_fails_gives_everything_back(tmp_path, registry, gen):
    """5 keys on the device, 10 in the host tier, 10 only in the remote tier: the load cannot
    take the chunked path, reads the 10 into the host tier, takes 20 new device slots and fails
    as their reload starts. Afterwards every device slot is exactly as before (state, key, pins,
    copies); in the host tier only the 10 slots the remote pages were read into changed (FREE ->
    RESIDENT, keyed, unheld, idle: a cache fill the load keeps). With the remote pages dropped
    from the host again, the same load takes the general path again and lands bit-exact."""
    pytest.importorskip("nixl_cu13")
    pool = TieredPool(small_format(page_size=1), device_pages=40, host_pages=60, write_policy="write_through",
                      remote=str(tmp_path), engine=FailingTorchEngine, registry=registry, background_copies=False)
    engine = pool.engine
    keys = prefix_keys(np.arange(25), 1, pool.namespace)
    on_dev, on_host, remote_only = keys[:5], keys[5:15], keys[15:]
    expected = write_pages(pool, keys, gen)
    assert pool.flush() == 0  # every page durable in the remote tier
    pool.evict(keys=on_host + remote_only)
    pool.evict(tier="host", keys=remote_only)
    m = pool.match(keys)
    assert (m.device, m.host, m.remote) == (5, 10, 10)
    _nothing_left(pool)
    dev_slots = [pool._dev.lookup(kid) for kid in key_ids(on_dev)]
    dev_before, host_before = _slots(pool._dev), _slots(pool._host)

    engine.arm(1)
    with pytest.raises(RuntimeError, match="injected"):
        pool.load(keys)
    assert engine.general == [True]  # one reload, the general path's, and it raised
    pool.match(keys[:1])  # a call that reaps

    assert _changed(dev_before, _slots(pool._dev)) == {}
    host_after = _slots(pool._host)
    filled = _changed(host_before, host_after)
    assert len(filled) == len(remote_only)
    assert all(old == (S.FREE, None, 0, 0) and new[0] == S.RESIDENT and new[2:] == (0, 0)
               for old, new in filled.values())
    assert {new[1] for _, new in filled.values()} == set(key_ids(remote_only))
    assert pool._dev.held == 0
    m = pool.match(keys)
    assert (m.device, m.host, m.remote) == (5, 20, 0)
    _nothing_left(pool)

    pool.evict(tier="host", keys=remote_only)  # the retry reads them from the remote tier again
    _retry_lands_bit_exact(pool, engine, keys, expected, dev_slots)
    pool.close()


def test_a_load_that_waits_for_device_room_whose_reload_fails_gives_everything_back(registry, gen):
    """Write-back: 5 keys on the device, 20 in the host tier, and the other 35 device slots hold
    dirty pages. The load cannot take the chunked path (its room waits for copies down), waits
    in the general path while a thread lands those copies, takes 20 new slots and fails as their
    reload starts. Afterwards the load's own pages and slots are exactly as before; the only
    changes are the dirty pages evicted for room (DIRTY -> FREE on the device, each now in the
    host tier, RESIDENT, unheld and idle). With the device filled again, the same load takes the
    general path again and lands bit-exact over poisoned slots."""
    pool = TieredPool(small_format(page_size=1), device_pages=40, host_pages=200, write_policy="write_back",
                      engine=FailingDeferredEngine, registry=registry, background_copies=False)
    engine = pool.engine
    keys = prefix_keys(np.arange(25), 1, pool.namespace)
    filler = prefix_keys(np.arange(1000, 1035), 1, pool.namespace)
    with _landing(engine):
        expected = write_pages(pool, keys, gen)
        pool.evict(keys=keys[5:])  # copied down, then freed on the device
        write_pages(pool, filler, gen)
    pool.match(keys[:1])  # a call that reaps
    m = pool.match(keys)
    assert (m.device, m.host) == (5, 20)
    assert len(pool._dev.free) == 0 and pool._dev.counts[S.DIRTY] == 40
    _nothing_left(pool)
    dev_slots = [pool._dev.lookup(kid) for kid in key_ids(keys[:5])]
    dev_before, host_before = _slots(pool._dev), _slots(pool._host)

    engine.arm(1)
    with _landing(engine), pytest.raises(RuntimeError, match="injected"):
        pool.load(keys)
    assert engine.general == [True]  # one reload, the general path's, and it raised
    pool.match(keys[:1])  # a call that reaps

    dev_after, host_after = _slots(pool._dev), _slots(pool._host)
    evicted = _changed(dev_before, dev_after)
    assert len(evicted) >= 20  # room for the load's 20 new pages (more if it looked before copies landed)
    evicted_ids = {dev_before[s][1] for s in evicted}
    assert evicted_ids <= set(key_ids(filler))  # the load's own pages and slots are as they were
    for old, new in evicted.values():
        assert old[0] == S.DIRTY and old[2:] == (0, 0) and new == (S.FREE, None, 0, 0)
    copied = _changed(host_before, host_after)  # the host slots of the load's sources are as they were
    assert {new[1] for _, new in copied.values()} == evicted_ids
    for old, new in copied.values():
        assert old == (S.FREE, None, 0, 0) and new[0] == S.RESIDENT and new[2:] == (0, 0)
    assert pool._dev.held == 0
    m = pool.match(keys)
    assert (m.device, m.host) == (5, 20)
    _nothing_left(pool)

    with _landing(engine):
        write_pages(pool, prefix_keys(np.arange(2000, 2000 + len(pool._dev.free)), 1, pool.namespace), gen)
    pool.match(keys[:1])
    assert len(pool._dev.free) == 0
    # poisoned: the dirty pages whose slots the load will take
    _retry_lands_bit_exact(pool, engine, keys, expected, dev_slots, _landing)
    with _landing(engine):  # close copies the dirty pages down
        pool.close()
