"""Loads submitted in chunks: a large load's first copy starts after one small chunk of
bookkeeping. The pages, the per-layer waits, a key missing in a later chunk and a chunk that
needs room only copies can make, on real engines (the torch twin, and the deferred engine whose
copies land when the test says)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from kvtier import TieredPool, prefix_keys
from kvtier.pool import loading
from kvtier.transfer import TorchEngine
from kvtier.transfer.engine import layer_runs
from tests.conftest import fill_random, poison, small_format, snapshot
from tests.deferred_engine import DeferredEngine
from tests.failing_reload import FailingTorchEngine

LIVENESS_S = 30


class CountingEngine(TorchEngine):
    """The torch twin, remembering how many pages each reload it was given moved: `reloads`
    for whole reloads and a split load's first-layer chunks, `rests` (pages, layers) for the
    other layers of a split load."""

    def __init__(self, device_tier, host_tier) -> None:
        super().__init__(device_tier, host_tier)
        self.reloads: list[int] = []
        self.rests: list[tuple[int, range]] = []

    def reload(self, host_slots, device_slots, ready=None):
        self.reloads.append(len(device_slots))
        return super().reload(host_slots, device_slots, ready)

    def reload_layers(self, host_slots, device_slots, layers, ready=None):
        if layers.start == 0:
            self.reloads.append(len(device_slots))
        else:
            self.rests.append((len(device_slots), layers))
        return super().reload_layers(host_slots, device_slots, layers, ready)


@pytest.fixture(autouse=True)
def slow_link(monkeypatch):
    """A link so slow that every chunk of a layer-ordered load defers its other layers (the copies
    queued always outlast the bookkeeping): the split path, which most tests here cover."""
    monkeypatch.setattr(loading, "_LINK_BYTES_PER_S", 1.0)


def _pool(registry, engine, device_pages=200, host_pages=300, policy="write_through", ordered=True):
    """Layer-ordered loads on unless `ordered` is False: most tests here cover that path."""
    return TieredPool(small_format(page_size=1), device_pages=device_pages, host_pages=host_pages,
                      write_policy=policy, engine=engine, registry=registry, background_copies=False,
                      layer_ordered_loads=ordered)


def _write(pool, keys, gen, flush=True):
    expected = {}
    for lo in range(0, len(keys), 50):
        part = keys[lo : lo + 50]
        slots = pool.allocate(len(part))
        fill_random(pool, slots, gen)
        expected.update({k: snapshot(pool, s) for k, s in zip(part, slots)})
        pool.commit(part, slots)
        pool.release(slots)
    if flush:
        pool.flush()
    return expected


def _check_indexes(pool):
    pool._dev.check()
    pool._host.check()


@pytest.mark.parametrize("container", [list, tuple])
@pytest.mark.parametrize("ordered", [False, True])
def test_a_large_load_is_copied_in_growing_chunks_and_lands_bit_exact(registry, gen, ordered, container):
    """Keys as a list or a tuple: the later chunks are keyed from the caller's own sequence, which
    the load leaves as it was."""
    pool = _pool(registry, CountingEngine, ordered=ordered)
    keys = prefix_keys(np.arange(170), 1, pool.namespace)
    expected = _write(pool, keys, gen)
    pool.evict(keys=keys[10:])  # 10 stay on the device, 160 come from the host
    pool.engine.reloads.clear()
    asked = container(keys)
    handle = pool.load(asked)
    assert list(asked) == keys
    first = loading._FIRST_CHUNK
    growth = loading._SPLIT_CHUNK_GROWTH if ordered else loading._CHUNK_GROWTH
    if ordered:
        # Chunks grow 2x: the keys (device pages included) are cut at 32, then 64 more, then the
        # last 74 (under the next chunk's 128, not under half of it: a chunk of their own). The
        # device pages are in the first chunk, so it reloads 22 pages.
        assert growth == 2
        assert pool.engine.reloads == [first - 10, first * growth, 170 - first - first * growth]
        assert 170 - first - first * growth >= first * growth * growth // 2
    else:
        # Chunks grow 4x: cut at 32, then 128 more, and the last 10 ride with those (a tail
        # shorter than half the next chunk): the first chunk reloads 22 pages, the second 138.
        assert pool.engine.reloads == [first - 10, 170 - first]
        assert 170 - first - first * growth < first * growth * growth // 2
    # Layer-ordered: each chunk copied its first layer; the other layers of all 160 follow in
    # one call. Otherwise each chunk copied every layer.
    assert pool.engine.rests == ([(160, range(1, pool.fmt.num_layers))] if ordered else [])
    for layer in range(pool.fmt.num_layers):
        handle.wait_layer(layer)
    handle.synchronize()
    assert handle.done() and len(set(handle.slots)) == 170
    assert all(snapshot(pool, s) == expected[k] for k, s in zip(keys, handle.slots))
    pool.release(handle.slots)
    assert pool.match(keys).device == 170
    _check_indexes(pool)
    pool.close()


def test_chunks_copy_every_layer_while_the_link_would_wait_for_bookkeeping(registry, gen, monkeypatch):
    """With a link far faster than the bookkeeping, no chunk of a layer-ordered load defers its
    other layers (each copies every layer as it is booked: the link never waits); the pages land
    bit-exact and every layer can be waited for."""
    monkeypatch.setattr(loading, "_LINK_BYTES_PER_S", 1e30)
    pool = _pool(registry, CountingEngine)
    keys = prefix_keys(np.arange(170), 1, pool.namespace)
    expected = _write(pool, keys, gen)
    pool.evict(keys=keys)
    pool.engine.reloads.clear()
    handle = pool.load(keys)
    first, second = loading._FIRST_CHUNK, loading._FIRST_CHUNK * loading._SPLIT_CHUNK_GROWTH
    assert pool.engine.reloads == [first, second, 170 - first - second] and pool.engine.rests == []
    for layer in range(pool.fmt.num_layers):
        handle.wait_layer(layer)
    handle.synchronize()
    assert all(snapshot(pool, s) == expected[k] for k, s in zip(keys, handle.slots))
    pool.release(handle.slots)
    _check_indexes(pool)
    pool.close()


@pytest.mark.parametrize("queued_s, chunk_s, elapsed_s, booked, remaining, defers", [
    (0.0, 1e-3, 1e-4, 32, 4064, False),  # the first chunk: the bookkeeping has 12.7 ms to go
    (5e-3, 1e-3, 2e-3, 600, 3496, False),  # 6 ms of copies queued against 13.7 ms of bookkeeping
    (13e-3, 1e-3, 2e-3, 600, 3496, True),  # 14 ms queued: the link stays busy past the 13.7 ms of bookkeeping
    (1e-3, 1e-3, 5e-3, 4096, 0, False),  # the last chunk, the link idle before it: every layer now
    (4.5e-3, 1e-3, 5e-3, 4096, 0, True),  # the last chunk behind 4.5 ms of copies
])
def test_which_chunks_defer_their_other_layers(queued_s, chunk_s, elapsed_s, booked, remaining, defers):
    assert loading.defers_other_layers(queued_s, chunk_s, elapsed_s, booked, remaining) is defers


def test_layer_ordered_loads_must_be_a_bool(registry):
    with pytest.raises(TypeError, match="layer_ordered_loads"):
        _pool(registry, CountingEngine, ordered=1)


def test_chunks_stop_growing_at_the_chunk_bytes(registry, gen, monkeypatch):
    """Past _CHUNK_BYTES a chunk grows no more, so the last chunk is never most of the load."""
    pool = _pool(registry, CountingEngine)
    monkeypatch.setattr(loading, "_CHUNK_BYTES", 50 * pool.fmt.page_bytes)
    monkeypatch.setattr(loading, "MANY", 40)  # the floor of the cap: a chunk never gets fewer
    keys = prefix_keys(np.arange(170), 1, pool.namespace)
    expected = _write(pool, keys, gen)
    pool.evict(tier="device")
    pool.engine.reloads.clear()
    handle = pool.load(keys)
    assert pool.engine.reloads == [32, 50, 50, 38]
    assert pool.engine.rests == [(170, range(1, pool.fmt.num_layers))]
    handle.synchronize()
    assert all(snapshot(pool, s) == expected[k] for k, s in zip(keys, handle.slots))
    pool.release(handle.slots)
    _check_indexes(pool)
    pool.close()


@pytest.mark.parametrize("engine", [TorchEngine, DeferredEngine])
def test_a_key_missing_in_a_later_chunk_leaves_the_device_as_it_was(registry, gen, engine):
    """Chunks before the missing key were already copying: their pages lose their keys at once
    and their slots are freed when the copies land (at once on the torch twin)."""
    pool = _pool(registry, engine)
    keys = prefix_keys(np.arange(120), 1, pool.namespace)
    if engine is DeferredEngine:
        # Write-through copies are deferred too: land them as they come until the writes are done.
        stop, lander = _landing(pool.engine)
        try:
            _write(pool, keys[:100], gen)
        finally:
            stop.set()
            lander.join(LIVENESS_S)
    else:
        _write(pool, keys[:100], gen)
    pool.evict(tier="device")
    before = pool.stats()["states"]["device"]
    asked = keys[:90] + [keys[110]] + keys[90:100]  # the missing key sits in the second chunk
    with pytest.raises(KeyError, match="1 of 101 keys"):
        pool.load(asked)
    if engine is DeferredEngine:
        assert pool.engine.pending() == 1  # the first chunk's copy was submitted before the miss
        assert pool.match(keys[:100]).device == 0, "a cancelled chunk's pages must not be found"
        pool.engine.land()
        pool.match(keys[:1])  # a call that reaps the landed copy
    assert pool.stats()["states"]["device"] == before
    assert pool.match(keys[:100]).device == 0
    _check_indexes(pool)
    pool.close()


@pytest.mark.parametrize("engine", [TorchEngine, DeferredEngine])
@pytest.mark.parametrize("bad", ["repeat", "type", "empty"])
def test_a_bad_key_in_a_later_chunk_raises_after_the_first_chunk_and_leaves_the_device_as_it_was(registry, gen, engine, bad):
    """A long load keys its first chunk before that chunk's copy is queued and every later
    chunk's keys with its bookkeeping: a repeated or malformed key past the first chunk raises
    as it would up front, the first chunk's copy is cancelled, and the device is as it was."""
    pool = _pool(registry, engine, device_pages=250)
    keys = prefix_keys(np.arange(200), 1, pool.namespace)
    if engine is DeferredEngine:
        stop, lander = _landing(pool.engine)
        try:
            expected = _write(pool, keys, gen)
        finally:
            stop.set()
            lander.join(LIVENESS_S)
    else:
        expected = _write(pool, keys, gen)
    pool.evict(tier="device")
    before = pool.stats()["states"]["device"]
    assert len(keys) > loading.HEAD_START_KEYS
    asked = list(keys)
    asked[150] = {"repeat": keys[3], "type": 12345, "empty": b""}[bad]
    error = {"repeat": (ValueError, "must not repeat"), "type": (TypeError, "^key 150: "), "empty": (ValueError, "^key 150: .*empty")}[bad]
    with pytest.raises(error[0], match=error[1]):
        pool.load(asked)
    if engine is DeferredEngine:
        assert pool.engine.pending() >= 1  # the first chunk's copy was queued before the bad key was seen
        assert pool.match(keys).device == 0, "a cancelled chunk's pages must not be found"
        pool.engine.land()
        pool.match(keys[:1])  # a call that reaps the landed copies
    assert pool.stats()["states"]["device"] == before
    assert pool.match(keys).device == 0
    handle = pool.load(keys)  # the same keys, well formed: every page arrives intact
    if engine is DeferredEngine:
        pool.engine.land()
    handle.synchronize()
    assert all(snapshot(pool, s) == expected[k] for k, s in zip(keys, handle.slots))
    pool.release(handle.slots)
    _check_indexes(pool)
    pool.close()


@pytest.mark.parametrize("ordered", [False, True])
@pytest.mark.parametrize("fail_at", [1, 2])
def test_a_reload_that_fails_to_start_leaves_both_tiers_as_they_were(registry, gen, ordered, fail_at):
    """The engine raises as a chunk's copy is started (the first chunk's, or the second's after
    the first was queued): the load raises that error, no device slot stays taken or held, no host
    page stays held, and the same load then lands every page bit-exact."""
    pool = _pool(registry, FailingTorchEngine, ordered=ordered)
    keys = prefix_keys(np.arange(170), 1, pool.namespace)
    expected = _write(pool, keys, gen)
    pool.evict(keys=keys[10:])  # 10 stay on the device, 160 come from the host
    before = pool.stats()["states"]
    pool.engine.arm(fail_at)
    with pytest.raises(RuntimeError, match="injected"):
        pool.load(keys)
    assert pool.engine.calls == fail_at
    pool.match(keys[:1])  # a call that reaps whatever landed
    assert pool.stats()["states"] == before
    assert pool._dev.held == 0 and pool._dev.busy_slots == 0 and pool._host.busy_slots == 0
    assert pool.match(keys).device == 10
    _check_indexes(pool)
    handle = pool.load(keys)
    handle.synchronize()
    assert all(snapshot(pool, s) == expected[k] for k, s in zip(keys, handle.slots))
    pool.release(handle.slots)
    _check_indexes(pool)
    pool.close()


@pytest.mark.parametrize("on_device", [5, 0])
def test_a_reload_into_given_slots_that_fails_to_start_leaves_both_tiers_as_they_were(registry, gen, on_device):
    """A load into slots from `allocate` (the general path with keys on the device, the one
    reload without): the engine raises as the reload is started. The load raises that error;
    the given slots are the caller's again, unkeyed and held as they came; no host page stays
    held; the same load then lands every page bit-exact."""
    pool = _pool(registry, FailingTorchEngine, ordered=False)
    keys = prefix_keys(np.arange(40), 1, pool.namespace)
    expected = _write(pool, keys, gen)
    pool.evict(keys=keys[on_device:])  # these are copied on the device, the others come from the host
    targets = pool.allocate(40)
    before = pool.stats()["states"]
    pool.engine.arm(1)
    with pytest.raises(RuntimeError, match="injected"):
        pool.load(keys, targets)
    assert pool.engine.calls == 1
    pool.match(keys[:1])  # a call that reaps the device copies that did start
    assert pool.stats()["states"] == before
    assert pool._dev.held == 40 and pool._dev.busy_slots == 0 and pool._host.busy_slots == 0
    assert pool.match(keys).device == on_device and pool.match(keys).host == 40 - on_device
    _check_indexes(pool)
    handle = pool.load(keys, targets)
    handle.synchronize()
    assert handle.slots == targets
    assert all(snapshot(pool, s) == expected[k] for k, s in zip(keys, targets))
    pool.release(targets)
    _check_indexes(pool)
    pool.close()


@pytest.mark.parametrize("on_device", [0, 5])
def test_a_load_into_given_slots_of_host_pages_is_one_reload(registry, gen, monkeypatch, on_device):
    """A load into slots from `allocate` whose keys are all readable in the host tier and none
    on the device: one reload of every page in the call's first hold of the lock, the general
    path never asked; with some keys on the device, the general path. Either way the pages land
    bit-exact in the given slots, and the tiers end as the general path alone leaves them."""
    from kvtier.pool.loading import Loading

    def run(one_reload: bool):
        general: list[int] = []
        with monkeypatch.context() as m:
            if not one_reload:
                m.setattr(TieredPool, "_load_into_now", lambda self, ids, slots: None)
            m.setattr(TieredPool, "_secure_sources", lambda self, ids: general.append(len(ids)) or Loading._secure_sources(self, ids))
            pool = _pool(registry, CountingEngine, ordered=False)
            keys = prefix_keys(np.arange(40), 1, pool.namespace)
            expected = _write(pool, keys, torch.Generator().manual_seed(3))
            pool.evict(keys=keys[on_device:])
            targets = pool.allocate(40)
            poison(pool, targets)
            reloads_before = len(pool.engine.reloads)
            handle = pool.load(keys, targets)
            handle.synchronize()
            assert handle.slots == targets
            assert all(snapshot(pool, s) == expected[k] for k, s in zip(keys, targets))
            _check_indexes(pool)
            facts = (pool.stats()["states"], pool._dev.held, pool._dev.busy_slots, pool._host.busy_slots,
                     bytes(pool._host.hits), [pool._dev.table.get(i) for i in pool._dev.ids_of(targets[on_device:])])
            pool.release(targets)
            pool.close()
            return facts, general, pool.engine.reloads[reloads_before:]

    facts, general, reloads = run(True)
    assert facts == run(False)[0]
    if on_device:
        assert general == [40]
    else:
        assert general == [] and reloads == [40]


def test_a_long_load_that_falls_back_to_the_general_path_keys_every_key(registry, gen):
    """A key no tier holds in a later chunk of a long load: the chunks before it are cancelled and
    the general path names the missing key among all the keys asked; a generator of keys (no
    length up front) is keyed whole and loads bit-exact."""
    pool = _pool(registry, TorchEngine, device_pages=250)
    keys = prefix_keys(np.arange(210), 1, pool.namespace)
    expected = _write(pool, keys[:200], gen)
    pool.evict(tier="device")
    before = pool.stats()["states"]["device"]
    asked = keys[:150] + [keys[205]] + keys[150:200]
    with pytest.raises(KeyError, match="1 of 201 keys"):
        pool.load(asked)
    assert pool.stats()["states"]["device"] == before
    # a malformed key after the missing one is still named, at its place in the whole batch
    with pytest.raises(TypeError, match="^key 190: "):
        pool.load(asked[:190] + [12345] + asked[191:])
    assert pool.stats()["states"]["device"] == before
    handle = pool.load(k for k in keys[:200])
    handle.synchronize()
    assert all(snapshot(pool, s) == expected[k] for k, s in zip(keys[:200], handle.slots))
    pool.release(handle.slots)
    _check_indexes(pool)
    pool.close()


def _landing(engine):
    """A thread landing the engine's copies as they come, until the returned event is set."""
    stop = threading.Event()

    def run():
        while not stop.is_set():
            engine.land()
            stop.wait(0.001)

    thread = threading.Thread(target=run)
    thread.start()
    return stop, thread


def test_a_chunk_that_needs_pages_copied_down_first_waits_in_the_general_path(registry, gen):
    """Write-back: the first chunk fits in free slots and starts copying; the second needs room
    that only copies down of dirty pages can make, held in flight, so the load cancels its first
    chunk, takes the general path, waits for the copies, and every page arrives intact."""
    pool = _pool(registry, DeferredEngine, device_pages=90, host_pages=300, policy="write_back")
    engine = pool.engine
    keys = prefix_keys(np.arange(100), 1, pool.namespace)
    stop, lander = _landing(engine)
    try:
        expected = _write(pool, keys[:50], gen, flush=False)
        pool.evict(keys=keys[:50])  # copied down (write-back) and freed
        expected.update(_write(pool, keys[50:], gen, flush=False))
    finally:
        stop.set()
        lander.join(LIVENESS_S)
    m = pool.match(keys)
    assert (m.device, m.host) == (50, 50)  # the first 50 are on the host only, the last 50 on the device
    assert pool.stats()["states"]["device"]["dirty"] == 50
    engine.land()
    while engine.submitted.acquire(timeout=0):
        pass
    got = []
    loader = threading.Thread(target=lambda: got.append(pool.load(keys[:50])))
    loader.start()
    # The first chunk's reload, then the copy down that makes room for the second chunk.
    assert engine.submitted.acquire(timeout=LIVENESS_S) and engine.submitted.acquire(timeout=LIVENESS_S)
    assert engine.pending() >= 2 and loader.is_alive()  # (the general path may have queued more copies down)
    stop, lander = _landing(engine)
    try:
        loader.join(LIVENESS_S)
    finally:
        stop.set()
        lander.join(LIVENESS_S)
    assert not loader.is_alive()
    handle = got[0]
    engine.land()
    handle.synchronize()
    assert all(snapshot(pool, s) == expected[k] for k, s in zip(keys[:50], handle.slots))
    pool.release(handle.slots)
    engine.land()
    pool.match(keys[:1])  # reaps what landed
    assert pool.stats()["states"]["device"]["loading"] == 0
    _check_indexes(pool)
    pool.close()


def _layer_bytes(pool, slots, layer):
    """Exact bytes of one layer (every plane, data and scales) of device `slots`."""
    dev, fmt = pool.device_tier, pool.fmt
    idx = torch.as_tensor(slots, dtype=torch.int64)
    out = b"".join(dev.raw_plane(layer, plane)[idx].numpy().tobytes() for plane in range(fmt.planes))
    if dev.has_scales:
        out += b"".join(dev.scale_plane(layer, plane)[idx].numpy().tobytes() for plane in range(fmt.planes))
    return out


def test_a_split_load_orders_each_layer_after_exactly_its_own_copies(registry, gen):
    """A load of several chunks: each chunk's first layer is queued as the chunk is booked, the
    other layers of all chunks after the last one. wait_layer(0) returns once every chunk's first
    layer landed, while layers 1.. are still poison; wait_layer(i > 0) waits for the rest; each
    waiter (its own thread) then reads its layer bit-exact."""
    pool = _pool(registry, DeferredEngine)
    engine, layers = pool.engine, pool.fmt.num_layers
    assert layers > 1
    keys = prefix_keys(np.arange(100), 1, pool.namespace)
    stop, lander = _landing(engine)
    try:
        expected_pages = _write(pool, keys, gen)
    finally:
        stop.set()
        lander.join(LIVENESS_S)
    pool.evict(tier="device")
    poison(pool, list(range(pool.device_tier.num_pages)))
    while engine.submitted.acquire(timeout=0):
        pass
    handle = pool.load(keys)
    # 32 pages, then the other 68 (a tail under half of 128 joins): two first-layer copies, one for the rest.
    assert engine.pending() == 3
    poisoned = {layer: _layer_bytes(pool, handle.slots, layer) for layer in range(layers)}
    seen: dict[int, tuple[int, bytes]] = {}
    landed = [0]

    def waiter(layer):
        handle.wait_layer(layer)
        seen[layer] = (landed[0], _layer_bytes(pool, handle.slots, layer))

    threads = [threading.Thread(target=waiter, args=(layer,)) for layer in range(layers)]
    for t in threads:
        t.start()
    landed[0] = engine.land(1)  # the first chunk's first layer: no layer is whole yet
    threads[0].join(0.05)
    assert threads[0].is_alive() and not seen
    landed[0] += engine.land(1)  # the second chunk's first layer: layer 0 is whole, nothing else
    threads[0].join(LIVENESS_S)
    assert not threads[0].is_alive() and seen[0][0] == 2
    for layer in range(1, layers):
        assert _layer_bytes(pool, handle.slots, layer) == poisoned[layer], f"layer {layer} copied with layer 0"
        assert threads[layer].is_alive()
    landed[0] += engine.land(1)  # the other layers of all 100 pages
    for t in threads:
        t.join(LIVENESS_S)
        assert not t.is_alive()
    assert all(seen[layer][0] == 3 for layer in range(1, layers))
    handle.synchronize()
    assert handle.done()
    assert all(snapshot(pool, s) == expected_pages[k] for k, s in zip(keys, handle.slots))
    for layer in range(layers):  # what each waiter read is its layer's final, bit-exact bytes
        assert seen[layer][1] == _layer_bytes(pool, handle.slots, layer) != poisoned[layer]
    pool.release(handle.slots)
    assert pool.match(keys).device == 100
    _check_indexes(pool)
    pool.close()


@pytest.mark.parametrize("layers", [range(1, 2), range(1, 4), range(0, 9), range(1, 32), range(1, 92), range(5, 6)])
def test_layer_runs_cover_each_layer_once_in_order(layers):
    """A subset reload's runs: contiguous, in order, every layer once, at most 8, near-equal."""
    runs = layer_runs(layers, 8)
    assert [layer for run in runs for layer in run] == list(layers)
    assert len(runs) == min(8, len(layers)) and all(run.step == 1 and len(run) for run in runs)
    assert max(map(len, runs)) - min(map(len, runs)) <= 1
