"""Long write-through commits start their copies down themselves, chunk by chunk: the link starts
after one small chunk's bookkeeping instead of the whole batch's. Short commits still hand the
copy to the offload thread. Checked on real engines (the torch twin, and the deferred engine whose
copies land when the test says): which thread starts each copy and how many pages it moves, that
every page reaches the host tier bit-exact (read back through evict + load into poisoned slots),
a copy that fails to start, and threads committing, loading and evicting at once."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvtier import TieredPool
from kvtier.pool.loading import COMMIT_IN_CHUNKS, commit_chunks
from kvtier.transfer import TorchEngine
from tests.conftest import fill_random, poison, small_format, snapshot
from tests.deferred_engine import DeferredEngine

LIVENESS_S = 30


class RecordingDeferred(DeferredEngine):
    """The deferred engine, remembering each offload's page count and the thread that asked."""

    def __init__(self, device_tier, host_tier) -> None:
        super().__init__(device_tier, host_tier)
        self.offloads: list[tuple[int, str]] = []

    def offload(self, device_slots, host_slots, ready=None):
        self.offloads.append((len(device_slots), threading.current_thread().name))
        return super().offload(device_slots, host_slots, ready)


class Queueing(TorchEngine):
    """The torch twin taken for an engine that queues its copies (the CUDA engine's kind), so
    that long commits take the chunked path; its copies still happen inside the call."""

    queues_copies = True


class FailingOnce(Queueing):
    """The twin whose first offload fails to start (as a launch that raises would)."""

    def __init__(self, device_tier, host_tier) -> None:
        super().__init__(device_tier, host_tier)
        self.failed = 0

    def offload(self, device_slots, host_slots, ready=None):
        if not self.failed:
            self.failed = 1
            raise RuntimeError("offload could not start")
        return super().offload(device_slots, host_slots, ready)


def _pool(registry, engine, device_pages=700, host_pages=900, policy="write_through", **kw):
    return TieredPool(small_format(page_size=1), device_pages=device_pages, host_pages=host_pages,
                      write_policy=policy, engine=engine, registry=registry, **kw)


class Lander:
    """Lands the deferred engine's copies on a thread while the `with` block runs."""

    def __init__(self, engine: DeferredEngine) -> None:
        self.engine = engine
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.engine.land()
            self.engine.submitted.acquire(timeout=0.01)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(LIVENESS_S)
        assert not self.thread.is_alive()


def _read_back(pool, keys, expected) -> None:
    """Evict every key from the device, load it back into poisoned slots: the host tier's bytes."""
    pool.evict(pool.device_tier.num_pages)
    assert pool.match(keys).device == 0
    slots = pool.allocate(len(keys))
    poison(pool, slots)
    pool.load(keys, slots).wait()
    for key, slot in zip(keys, slots):
        assert snapshot(pool, slot) == expected[key], key
    pool.release(slots)


def _recording_pool(registry, **kw):
    """(pool, its RecordingDeferred engine)."""
    engines = []

    def make(d, h):
        engines.append(RecordingDeferred(d, h))
        return engines[-1]

    pool = _pool(registry, make, **kw)
    return pool, engines[0]


def _commit(pool, keys, gen):
    slots = pool.allocate(len(keys))
    fill_random(pool, slots, gen)
    expected = {k: snapshot(pool, s) for k, s in zip(keys, slots)}
    return slots, expected


@pytest.mark.parametrize("n", [COMMIT_IN_CHUNKS + 1, 600])
def test_a_long_commit_starts_its_copies_in_chunks_on_the_calling_thread(registry, gen, n):
    pool, engine = _recording_pool(registry)
    try:
        keys = [f"long-{i}" for i in range(n)]
        slots, expected = _commit(pool, keys, gen)
        assert pool.commit(keys, slots) == n
        sizes = [end - start for start, end in commit_chunks(n, pool.fmt.page_bytes)]
        assert len(sizes) > 1
        # Every chunk's copy was queued inside commit, by the caller, in the chunks' order.
        assert engine.offloads == [(size, threading.current_thread().name) for size in sizes]
        pool.release(slots)
        with Lander(engine):
            assert pool.flush() == 0
            pool._dev.check()
            pool._host.check()
            _read_back(pool, keys, expected)
    finally:
        pool.close()


@pytest.mark.parametrize("bad, error", [("", ValueError), ("long-3", ValueError), (7, TypeError)])
def test_a_long_commit_with_a_bad_or_repeated_key_late_in_the_batch_changes_nothing(registry, gen, bad, error):
    """A chunked commit hashes each chunk's keys as it goes, so every key is checked (type, empty,
    repeat) before the first chunk is keyed: a fault at position 250 raises with no page keyed
    and no copy queued, and the same slots commit afterwards."""
    pool, engine = _recording_pool(registry)
    try:
        keys = [f"long-{i}" for i in range(300)]
        slots, expected = _commit(pool, keys, gen)
        before = pool.stats()["states"]
        wrong = list(keys)
        wrong[250] = bad
        with pytest.raises(error, match="250|repeat"):
            pool.commit(wrong, slots)
        assert pool.stats()["states"] == before
        assert engine.offloads == []
        assert pool.match(keys[:1]).total == 0
        assert pool.commit(tuple(keys), slots) == 300  # a tuple takes the same path
        pool.release(slots)
        with Lander(engine):
            assert pool.flush() == 0
            _read_back(pool, keys, expected)
    finally:
        pool.close()


def test_a_short_commit_leaves_its_copy_to_the_offload_thread(registry, gen):
    pool, engine = _recording_pool(registry)
    try:
        keys = [f"short-{i}" for i in range(COMMIT_IN_CHUNKS)]
        slots, _ = _commit(pool, keys, gen)
        pool.commit(keys, slots)
        pool.release(slots)
        assert engine.submitted.acquire(timeout=LIVENESS_S)  # queued by the offload thread (not by a flush)
        engine.submitted.release()
        assert engine.offloads == [(COMMIT_IN_CHUNKS, "kvtier-offload")]
        with Lander(engine):
            assert pool.flush() == 0
    finally:
        pool.close()


def test_a_long_commit_over_an_engine_that_copies_in_the_call_leaves_the_copy_to_the_offload_thread(registry, gen):
    """The torch twin copies inside offload(): a long commit hands the copy to the offload thread
    (where the memcpy runs beside the caller) instead of copying inside commit."""
    calls = []

    class Recording(TorchEngine):
        def offload(self, device_slots, host_slots, ready=None):
            calls.append((len(device_slots), threading.current_thread().name))
            return super().offload(device_slots, host_slots, ready)

    pool = _pool(registry, Recording)
    try:
        keys = [f"sync-{i}" for i in range(300)]
        slots, expected = _commit(pool, keys, gen)
        pool.commit(keys, slots)
        pool.release(slots)
        deadline = time.monotonic() + LIVENESS_S
        while pool.stats()["states"]["device"]["dirty"] and time.monotonic() < deadline:
            time.sleep(0.001)  # the offload thread's copy (a flush now would copy them itself)
        assert calls == [(300, "kvtier-offload")]
        assert pool.flush() == 0
        _read_back(pool, keys, expected)
    finally:
        pool.close()


def test_a_long_write_back_commit_copies_nothing(registry, gen):
    pool, engine = _recording_pool(registry, policy="write_back")
    try:
        keys = [f"wb-{i}" for i in range(400)]
        slots, _ = _commit(pool, keys, gen)
        assert pool.commit(keys, slots) == 400
        assert engine.offloads == []
        assert pool.stats()["states"]["device"]["dirty"] == 400
        pool.release(slots)
    finally:
        with Lander(engine):  # close flushes the dirty pages
            pool.close()


def test_a_chunk_whose_copy_fails_to_start_stays_dirty_and_flush_copies_it(registry, gen):
    pool = _pool(registry, FailingOnce)
    try:
        keys = [f"fail-{i}" for i in range(300)]
        slots, expected = _commit(pool, keys, gen)
        assert pool.commit(keys, slots) == 300  # the failed start is logged, never raised
        assert pool.engine.failed == 1
        first = commit_chunks(300, pool.fmt.page_bytes)[0][1]
        assert pool.stats()["states"]["device"]["dirty"] == first  # the first chunk only
        pool.release(slots)
        assert pool.flush() == 0
        pool._dev.check()
        pool._host.check()
        _read_back(pool, keys, expected)
    finally:
        pool.close()


def test_long_commits_beside_loads_and_evictions_on_threads(registry):
    """Three threads commit long batches of fresh pages (their copies started inside commit) into
    a host tier too small for all of them, while a fourth loads and evicts pages committed before:
    no thread fails, the indexes stay consistent, and every page any tier still holds reads back
    as written."""
    pool = _pool(registry, Queueing, device_pages=1200, host_pages=700)
    written: dict[str, tuple[bytes, bytes]] = {}
    lock = threading.Lock()
    errors: list[BaseException] = []
    stop = threading.Event()

    def committer(t: int) -> None:
        gen = torch.Generator().manual_seed(100 + t)
        try:
            for round_ in range(6):
                n = COMMIT_IN_CHUNKS + 1 + 37 * round_
                keys = [f"t{t}-r{round_}-{i}" for i in range(n)]
                slots, expect = _commit(pool, keys, gen)
                pool.commit(keys, slots)
                pool.release(slots)
                with lock:
                    written.update(expect)
                pool.evict(n // 2)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def loader() -> None:
        try:
            while not stop.is_set():
                with lock:
                    keys = list(written)[-64:]
                if not keys:
                    continue
                found = pool.match(keys)
                if not found.total:
                    continue
                try:
                    handle = pool.load(keys[: found.total])
                except KeyError:
                    continue  # a page left both tiers between match and load: match's answer is advice
                handle.wait()
                for key, slot in zip(keys, handle.slots):
                    if snapshot(pool, slot) != written[key]:
                        raise AssertionError(f"{key} read back other bytes")
                pool.release(handle.slots)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=committer, args=(t,)) for t in range(3)]
    load_thread = threading.Thread(target=loader)
    try:
        for thread in threads + [load_thread]:
            thread.start()
        for thread in threads:
            thread.join(LIVENESS_S * 4)
            assert not thread.is_alive()
        stop.set()
        load_thread.join(LIVENESS_S)
        assert not load_thread.is_alive()
        assert not errors, errors
        pool.flush()
        pool._dev.check()
        pool._host.check()
        # Whatever a tier still holds is what was written (read from the device or the host).
        held = [k for k in written if pool.match([k]).total == 1]
        assert len(held) >= 700  # the host tier's pages at least
        for lo in range(0, len(held), 200):
            part = held[lo : lo + 200]
            slots = pool.allocate(len(part))
            poison(pool, slots)
            pool.load(part, slots).wait()
            for key, slot in zip(part, slots):
                assert snapshot(pool, slot) == written[key], key
            pool.release(slots)
    finally:
        stop.set()
        pool.close()


@pytest.mark.parametrize("bulk", [10**9, 64])
def test_clean_host_pages_evicted_for_a_commit_leave_their_device_copies_dirty(registry, gen, monkeypatch, bulk):
    """With no remote tier, a clean host page that makes room for a commit's copies was the only
    copy below the device: the device's RESIDENT copy of it turns DIRTY (so eviction or flush
    copies it down again). The same with the batch path (`_evict_clean_host`, from 64 victims) and
    the page-by-page loop; every page still reads back as written."""
    from kvtier.pool import room

    monkeypatch.setattr(room, "BULK", bulk)
    pool = _pool(registry, Queueing, device_pages=600, host_pages=300)
    try:
        first = [f"a-{i}" for i in range(300)]
        slots_a, expected = _commit(pool, first, gen)
        pool.commit(first, slots_a)
        assert pool.flush() == 0
        states = pool.stats()["states"]
        assert states["device"]["resident"] == 300 and states["host"]["resident"] == 300
        second = [f"b-{i}" for i in range(200)]
        slots_b, more = _commit(pool, second, gen)
        expected.update(more)
        pool.commit(second, slots_b)  # chunked: its copies (made in the call) take 200 host slots
        stats = pool.stats()
        assert stats["evictions"]["host"] == 200
        assert stats["states"]["host"]["resident"] == 300
        # The 200 first pages that left the host tier are dirty on the device; the rest are clean.
        assert stats["states"]["device"]["dirty"] == 200 and stats["states"]["device"]["resident"] == 300
        assert sorted(pool._dev.dirty) == sorted(s for k, s in zip(first, slots_a)
                                                 if pool._host.table.get(pool._dev.id_of(s)) < 0)
        assert pool.flush() == 0  # copies them down again, evicting 200 host pages in turn
        assert pool.stats()["evictions"]["host"] == 400
        pool._dev.check()
        pool._host.check()
        pool.release(slots_a)
        pool.release(slots_b)
        for key, slot in zip(first + second, slots_a + slots_b):
            assert snapshot(pool, slot) == expected[key]
    finally:
        pool.close()
