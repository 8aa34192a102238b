"""The index's batch paths: the key-id cache, numpy lookups (KeyTable.get_many) and numpy
linking (SlotList.extend / discard_many) give exactly what the one-at-a-time paths give."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import random
import threading

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

import kvtier.index.key_table as key_table
import kvtier.index.keys as keys_mod
import kvtier.index.prefix as prefix_mod
import kvtier.index.slot_list as slot_list
import kvtier.index.tier_index as tier_index
import kvtier.pool.loading as loading_mod
from kvtier import TieredPool, key_id, prefix_keys
from kvtier.index.key_table import DictKeyTable, KeyTable
from kvtier.index.slot_list import SlotList
from tests.conftest import fill_random, python_index_paths, small_format, snapshot
from tests.test_pool_control_plane import (
    test_threads_on_a_full_pool_with_copies_in_flight_never_mix_pages as _threads_stress,
)


def _numpy_everywhere(monkeypatch) -> None:
    """Every batch, however short, takes the numpy path, and the pool's walks read every id
    past the first in chunks."""
    monkeypatch.setattr(key_table, "MANY", 1)
    monkeypatch.setattr(key_table, "BIND_MANY", 1)
    monkeypatch.setattr(slot_list, "BULK", 1)
    monkeypatch.setattr(tier_index, "BULK", 1)
    monkeypatch.setattr(tier_index, "MANY", 1)
    monkeypatch.setattr(loading_mod, "MANY", 1)
    monkeypatch.setattr(prefix_mod, "MANY", 1)


@pytest.fixture
def numpy_always(monkeypatch):
    _numpy_everywhere(monkeypatch)


@pytest.fixture(autouse=True)
def python_paths(monkeypatch):
    """This file tests the index's Python twins (numpy and one-at-a-time paths);
    test_index_native.py tests the C paths against them."""
    python_index_paths(monkeypatch)


# --- key ids -------------------------------------------------------------------------------
def test_cached_ids_are_the_ids(monkeypatch):
    monkeypatch.setattr(keys_mod, "ID_CACHE_GENERATION", 64)
    keys_mod.clear_id_cache()
    rng = random.Random(3)
    pool = [os.urandom(rng.randint(1, 40)) for _ in range(300)] + [f"k{i}" for i in range(300)]
    for _ in range(20):
        batch = rng.sample(pool, 50)
        assert keys_mod.key_ids(batch) == [key_id(k) for k in batch]
        # Between one and two generations of keys are remembered, never more.
        assert len(keys_mod._young) < 64 and len(keys_mod._old) <= 64


def test_the_id_cache_is_bounded_by_size_and_keeps_no_huge_key_alive():
    keys_mod.clear_id_cache()
    huge = [os.urandom(1 << 20) for _ in range(64)] + ["x" * (1 << 20)]
    before = [sys.getrefcount(k) for k in huge]
    assert keys_mod.key_ids(huge) == [key_id(k) for k in huge]
    assert [sys.getrefcount(k) for k in huge] == before  # none is held by the cache
    mid = [os.urandom(keys_mod.ID_CACHE_MAX_KEY) for _ in range(3000)]  # 12 MiB of cacheable keys
    assert keys_mod.key_ids(mid) == [key_id(k) for k in mid]
    held = sum(len(k) for k in keys_mod._young) + sum(len(k) for k in keys_mod._old)
    assert held <= 2 * keys_mod.ID_CACHE_GENERATION_CHARS + keys_mod.ID_CACHE_MAX_KEY
    assert keys_mod.key_ids(mid[-8:]) == [key_id(k) for k in mid[-8:]]  # recent ones still cached
    keys_mod.clear_id_cache()


def test_a_cached_str_key_and_its_bytes_keep_two_ids():
    keys_mod.clear_id_cache()
    first = keys_mod.key_ids(["abc", b"abc"])
    again = keys_mod.key_ids([b"abc", "abc"])
    assert first[0] != first[1]
    assert again == [first[1], first[0]]
    assert first == [key_id("abc"), key_id(b"abc")]


def test_a_bad_key_after_cached_ones_is_named():
    good = [os.urandom(32) for _ in range(5)]
    keys_mod.key_ids(good)
    with pytest.raises(TypeError, match="key 5"):
        keys_mod.key_ids(good + [7])
    with pytest.raises(ValueError, match="key 2"):
        keys_mod.key_ids(good[:2] + [b""])


def test_threads_turning_the_cache_over_never_see_a_wrong_id(monkeypatch):
    monkeypatch.setattr(keys_mod, "ID_CACHE_GENERATION", 16)
    keys_mod.clear_id_cache()
    shared = [os.urandom(32) for _ in range(200)]
    truth = {k: key_id(k) for k in shared}
    errors = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(300):
            batch = rng.sample(shared, rng.randint(1, 40))
            got = keys_mod.key_ids(batch)
            if got != [truth[k] for k in batch]:
                errors.append(seed)
                return

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert len(keys_mod._young) < 16 and len(keys_mod._old) <= 16


# --- prefix walks ----------------------------------------------------------------------------
def _walk_one_by_one(dev, host, ids, start, in_remote):
    d = h = r = 0
    for i in range(start, len(ids)):
        if dev.get(ids[i]) >= 0:
            d += 1
        elif host.get(ids[i]) >= 0:
            h += 1
        elif in_remote is not None and in_remote[i - start]:
            r += 1
        else:
            return d, h, r, i
    return d, h, r, len(ids)


@pytest.mark.parametrize("many", [1, 7, 512])
def test_prefix_walks_find_what_one_lookup_at_a_time_finds(monkeypatch, many):
    monkeypatch.setattr(prefix_mod, "MANY", many)
    rng = random.Random(many)
    for trial in range(40):
        n = rng.choice([1, 5, 40, 600, 3000])
        ids = [os.urandom(16) for _ in range(n)]
        dev, host = DictKeyTable(n), KeyTable(n)
        where = [rng.choices("dhrx", weights=(4, 4, 2, 1 if trial % 3 else 0.01))[0] for _ in range(n)]
        dev.bind_many([k for k, w in zip(ids, where) if w == "d"], [i for i, w in enumerate(where) if w == "d"])
        host.bind_many([k for k, w in zip(ids, where) if w == "h"], [i for i, w in enumerate(where) if w == "h"])
        start = rng.randrange(n)
        in_remote = [w == "r" for w in where[start:]] if trial % 2 else None
        want = _walk_one_by_one(dev, host, ids, start, in_remote)
        assert prefix_mod.walk(dev, host, ids, start, in_remote) == want, trial
        for table in (dev, host):
            lead = []
            for kid in ids:
                if table.get(kid) < 0:
                    break
                lead.append(table.get(kid))
            assert prefix_mod.leading_slots(table, ids) == lead, trial


@pytest.mark.parametrize("many", [1, 7, 512])
def test_walk_slots_finds_what_walk_and_leading_slots_find(monkeypatch, many):
    """The walk that keeps its slots (a match under the lock) counts what `walk` counts and
    finds each tier's leading slots, pages held by both tiers included."""
    monkeypatch.setattr(prefix_mod, "MANY", many)
    rng = random.Random(many + 1)
    for trial in range(40):
        n = rng.choice([1, 5, 31, 33, 40, 600, 3000])
        ids = [os.urandom(16) for _ in range(n)]
        dev, host = DictKeyTable(n), KeyTable(n)
        where = [rng.choices("dhbx", weights=(4, 4, 3, 1 if trial % 3 else 0.01))[0] for _ in range(n)]
        dev.bind_many([k for k, w in zip(ids, where) if w in "db"], [i for i, w in enumerate(where) if w in "db"])
        host.bind_many([k for k, w in zip(ids, where) if w in "hb"], [i for i, w in enumerate(where) if w in "hb"])
        d, h, _, end = _walk_one_by_one(dev, host, ids, 0, None)
        got = prefix_mod.walk_slots(dev, host, ids)
        assert got == (d, h, prefix_mod.leading_slots(dev, ids), prefix_mod.leading_slots(host, ids)), trial
        assert d + h == end


# --- KeyTable.get_many -----------------------------------------------------------------------
@pytest.mark.parametrize("fill", [0.1, 0.5, 1.0])
def test_get_many_finds_what_get_finds(numpy_always, fill):
    rng = random.Random(int(fill * 10))
    capacity = 600
    table = KeyTable(capacity)
    ids = [os.urandom(16) for _ in range(2 * capacity)]
    bound = rng.sample(range(capacity), int(capacity * fill))
    for slot in bound:
        table.bind(ids[slot], slot)
    # Unbinding shifts probe runs back: lookups must still agree afterwards.
    for slot in rng.sample(bound, len(bound) // 3):
        table.unbind(slot)
    for n in (1, 2, 7, 64, 500, 1200):
        asked = rng.sample(ids, n)
        assert table.get_many(asked) == [table.get(k) for k in asked]
        assert list(table.get_each(asked)) == [table.get(k) for k in asked]
    assert table.get_many([]) == []


def test_get_many_on_a_full_table_at_the_default_thresholds():
    table = KeyTable(4096)
    ids = [os.urandom(16) for _ in range(8192)]
    for slot in range(4096):
        table.bind(ids[slot], slot)
    asked = ids[::2] + ids[1::2]
    got = table.get_many(asked)
    assert got == [table.get(k) for k in asked]
    assert sorted(s for s in got if s >= 0) == list(range(4096))


# --- SlotList batch linking ------------------------------------------------------------------
def _walk_back(lst: SlotList) -> list[int]:
    out, slot = [], lst._prev[lst._head]
    while slot != lst._head:
        out.append(slot)
        slot = lst._prev[slot]
    return out[::-1]


@pytest.mark.parametrize("fill", [0.0, 0.5, 0.9])
def test_bind_many_in_numpy_keys_what_bind_keys(numpy_always, fill):
    """Ids bound in one numpy batch are found where one-at-a-time binds would put them, stay
    found while others leave (backward shifts over the batch's probe runs), and read back."""
    rng = random.Random(int(fill * 10) + 1)
    capacity = 700
    one, batch = KeyTable(capacity), KeyTable(capacity)
    ids = [os.urandom(16) for _ in range(capacity)]
    first = rng.sample(range(capacity), int(capacity * fill))
    for slot in first:
        one.bind(ids[slot], slot)
        batch.bind(ids[slot], slot)
    rest = [s for s in range(capacity) if s not in set(first)]
    rng.shuffle(rest)
    for slot in rest:
        one.bind(ids[slot], slot)
    batch.bind_many([ids[s] for s in rest], rest)
    assert len(batch) == len(one) == capacity
    assert batch.get_many(ids) == one.get_many(ids) == list(range(capacity))
    assert batch.ids_of(list(range(capacity))) == ids
    for slot in rng.sample(range(capacity), capacity // 2):
        batch.unbind(slot)
        one.unbind(slot)
        asked = rng.sample(ids, 50)
        assert batch.get_many(asked) == one.get_many(asked)
    with pytest.raises(ValueError, match="holds no key"):
        batch.ids_of([s for s in range(capacity) if not batch.holds_key(s)][:1] * 600)


def test_bind_many_refuses_a_bad_batch_before_changing_anything(numpy_always):
    table = KeyTable(64)
    ids = [os.urandom(16) for _ in range(64)]
    table.bind_many(ids[:10], list(range(10)))
    before = (bytes(table._buckets), bytes(table._ids), len(table))
    for kids, slots, message in (
        (ids[10:20], list(range(5, 15)), "slot 5 already holds"),  # a slot that holds a key
        (ids[5:15], list(range(20, 30)), "is already in slot 5"),  # an id already mapped
        (ids[20:25] + ids[20:21], list(range(30, 36)), "is already in slot"),  # an id twice
    ):
        with pytest.raises(ValueError, match=message):
            table.bind_many(kids, slots)
        if message != "is already in slot":  # one at a time, the pairs before the bad one stay
            assert (bytes(table._buckets), bytes(table._ids), len(table)) == before


def test_first_of_each_is_what_np_unique_gives():
    rng = np.random.default_rng(2)
    for n in (1, 2, 50, 3000):
        values = rng.integers(0, max(2, n // 3), n)
        got, first = slot_list.first_of_each(values)
        want, want_first = np.unique(values, return_index=True)
        assert got.tolist() == want.tolist() and first.tolist() == want_first.tolist()


def test_members_are_the_listed_slots_dense_or_sparse():
    rng = random.Random(9)
    for listed in (0, 3, 500, 2000, 4000):
        lst = SlotList(4096)
        lst.extend(rng.sample(range(4096), listed))
        assert sorted(lst.members()) == sorted(lst)


def test_index_batch_checks_agree_with_the_loops(monkeypatch):
    """first_unfresh, idle and ids_of give the same answers below and above BULK."""
    from kvtier.index import PageState, TierIndex, make_policy

    for compact in (False, True):
        index = TierIndex("device", 3000, make_policy("lru", 3000), compact_keys=compact)
        slots = index.take_free(2500, PageState.FILLING)
        index.pin_all(slots)
        kids = [os.urandom(16) for _ in slots]
        answers = []
        for bulk in (10**9, 1):
            monkeypatch.setattr(tier_index, "BULK", bulk)
            answers.append((index.first_unfresh(slots), index.idle(slots)))
        assert answers[0] == answers[1] == (-1, slots)
        index.bind_all(slots[1000:], kids[1000:])
        index.hold_all(slots[:7])
        for bulk in (10**9, 1):
            monkeypatch.setattr(tier_index, "BULK", bulk)
            answers.append((index.first_unfresh(slots[500:]), index.first_unfresh(slots[3:]), index.idle(slots)))
        assert answers[2] == answers[3] == (slots[1000], slots[3], slots[7:])
        assert index.ids_of(slots[1000:]) == kids[1000:]


@pytest.mark.parametrize("bulk", [10**9, 1])
def test_key_filled_and_take_free_leave_what_the_state_machine_leaves(monkeypatch, bulk):
    """A commit's one pass (key_filled) and take_free's leave each slot, count, list and key
    as bind_all and set_states do, below and above BULK."""
    from kvtier.index import PageState, TierIndex, make_policy

    monkeypatch.setattr(tier_index, "BULK", bulk)
    monkeypatch.setattr(slot_list, "BULK", bulk)
    rng = random.Random(bulk)
    for compact in (False, True):
        fast = TierIndex("device", 600, make_policy("lru", 600), compact_keys=compact)
        slow = TierIndex("device", 600, make_policy("lru", 600), compact_keys=compact)
        for _ in range(6):
            n = rng.randint(0, 90)
            slots = fast.take_free(n, PageState.FILLING)
            free = slow.free
            want = free[len(free) - len(slots):].tolist()[::-1]
            del free[len(free) - len(slots):]
            slow.set_states(want, PageState.FILLING)
            assert slots == want
            fast.pin_all(slots)
            slow.pin_all(slots)
            kids = [os.urandom(16) for _ in slots]
            clean = set(rng.sample(slots, len(slots) // 3))
            fast.key_filled(slots, kids, clean)
            slow.bind_all(slots, kids)
            slow.set_states([s for s in slots if s in clean], PageState.RESIDENT)
            slow.set_states([s for s in slots if s not in clean], PageState.DIRTY)
            let_go = rng.sample(slots, len(slots) // 2)
            for index in (fast, slow):
                index.set_states(index.unpin_all(let_go), PageState.FREE)
                index.check()
            assert bytes(fast.state) == bytes(slow.state) and fast.counts == slow.counts
            assert list(fast.dirty) == list(slow.dirty) and list(fast.policy) == list(slow.policy)
            assert fast.ids_of(slots) == slow.ids_of(slots) == kids


@pytest.mark.parametrize("bulk", [10**9, 1])
def test_take_loading_then_bind_leaves_what_the_state_machine_leaves(monkeypatch, bulk):
    """A load's new slots: take_loading (LOADING, held, one copy in flight, not keyed: a lookup
    misses until the bind) then bind_many leave each slot, count, hold and key as take_free, pin
    and bind_all do, below and above BULK; the landing (set_states, unhold, unpin) leaves both
    alike too."""
    from kvtier.index import PageState, TierIndex, make_policy

    monkeypatch.setattr(tier_index, "BULK", bulk)
    monkeypatch.setattr(slot_list, "BULK", bulk)
    rng = random.Random(bulk + 1)
    fast = TierIndex("device", 400, make_policy("lru", 400))
    slow = TierIndex("device", 400, make_policy("lru", 400))
    for _ in range(8):
        n = rng.randint(0, 70)
        kids = [os.urandom(16) for _ in range(n)]
        slots = fast.take_loading(n)
        assert all(fast.lookup(k) < 0 for k in kids)
        assert all(fast.state[s] == PageState.LOADING and fast.pins[s] == 1 and fast.busy[s] == 1 for s in slots)
        fast.table.bind_many(kids, slots)
        want = slow.take_free(n, PageState.LOADING, busy_delta=1)
        slow.pin_all(want)
        slow.bind_all(want, kids)
        assert slots == want
        for index in (fast, slow):
            index.check()
            assert [index.lookup(k) for k in kids] == slots
        assert bytes(fast.state) == bytes(slow.state) and fast.counts == slow.counts
        assert (fast.held, fast.busy_slots) == (slow.held, slow.busy_slots)
        landed = rng.sample(slots, len(slots) // 2)
        let_go = rng.sample(landed, len(landed) // 2)
        for index in (fast, slow):
            index.set_states(landed, PageState.RESIDENT)
            index.unhold_all(landed)
            index.set_states(index.unpin_all(let_go), PageState.FREE)
            index.check()
        assert bytes(fast.state) == bytes(slow.state) and fast.counts == slow.counts
        assert list(fast.policy) == list(slow.policy)


def test_reuse_in_numpy_leaves_what_the_loop_leaves(monkeypatch):
    """`reuse` of a long batch (numpy: eviction order, dirty list, hits, states, counts, busy)
    leaves each index as the one-slot-at-a-time loop does, for clean and dirty victims taken from
    the eviction order, and falls back to the loop's refusal for a held slot."""
    from kvtier.index import PageState, TierIndex, make_policy

    rng = random.Random(11)
    for compact in (False, True):
        indexes = []
        for bulk in (10**9, 1):
            monkeypatch.setattr(tier_index, "BULK", bulk)
            index = TierIndex("host", 500, make_policy("lru", 500), compact_keys=compact)
            slots = index.take_free(400, PageState.LOADING)
            index.bind_all(slots, [bytes([i % 256, i // 256]) * 8 for i in range(400)])
            index.set_states(slots, PageState.RESIDENT)
            index.set_states(slots[::7], PageState.DIRTY)
            for slot in slots[::5]:
                index.touch(slot)
                index.hits[slot] = 3
            indexes.append(index)
        victims = indexes[0].victims(300)
        assert victims == indexes[1].victims(300)
        rng.shuffle(victims)
        for bulk, index in zip((10**9, 1), indexes):
            monkeypatch.setattr(tier_index, "BULK", bulk)
            index.reuse(victims[:250], PageState.LOADING, busy_delta=1)
            index.check()
        fast, slow = indexes[1], indexes[0]
        assert bytes(fast.state) == bytes(slow.state) and fast.counts == slow.counts
        assert bytes(fast.hits) == bytes(slow.hits) and bytes(fast.busy) == bytes(slow.busy)
        assert fast.busy_slots == slow.busy_slots
        assert list(fast.dirty) == list(slow.dirty) and list(fast.policy) == list(slow.policy)
        assert all(not fast.table.holds_key(slot) for slot in victims[:250])
        monkeypatch.setattr(tier_index, "BULK", 1)
        held = fast.victims(80)
        fast.pin(held[40])
        with pytest.raises(AssertionError, match="reused while"):
            fast.reuse(held, PageState.LOADING)


@pytest.mark.parametrize("many", [10**9, 1])
def test_hold_readable_holds_all_or_nothing(monkeypatch, many):
    """A load chunk's sources: every id keyed and readable -> their slots, held busy and touched;
    one id missing or not readable -> None, nothing held."""
    from kvtier.index import PageState, TierIndex, make_policy

    monkeypatch.setattr(tier_index, "MANY", many)
    monkeypatch.setattr(tier_index, "BULK", min(many, 128))
    index = TierIndex("host", 300, make_policy("lru", 300))
    slots = index.take_free(200, PageState.LOADING)
    kids = [os.urandom(16) for _ in slots]
    index.bind_all(slots, kids)
    index.set_states(slots, PageState.RESIDENT)
    index.set_state(slots[7], PageState.DIRTY)
    index.set_state(slots[7], PageState.OFFLOADING)  # still readable where it is
    asked = kids[:150]
    assert index.hold_readable(asked) == slots[:150]
    assert [index.busy[s] for s in slots[:151]] == [1] * 150 + [0]
    assert [index.hits[s] for s in slots[:151]] == [1] * 150 + [0]
    assert not any(s in index.policy for s in slots[:150]) and slots[150] in index.policy
    index.unhold_all(slots[:150])
    before = (bytes(index.busy), bytes(index.hits), list(index.policy), index.busy_slots)
    for bad in ([os.urandom(16)] + kids[150:], kids[150:] + [os.urandom(16)]):
        assert index.hold_readable(bad) is None
    fresh = index.take_free(1, PageState.LOADING)
    index.bind_all(fresh, [b"l" * 16])
    assert index.hold_readable(kids[150:] + [b"l" * 16]) is None
    assert (bytes(index.busy), bytes(index.hits), list(index.policy), index.busy_slots) == before
    assert index.hold_readable([]) == []
    index.check()


def test_extend_and_discard_many_keep_the_order_one_at_a_time_keeps(monkeypatch):
    rng = random.Random(5)
    for trial in range(150):
        capacity = rng.choice([3, 40, 400])
        # ref: one `append` / `discard` a slot; one: the short-batch inline loops; batch: numpy.
        ref, one, batch = SlotList(capacity), SlotList(capacity), SlotList(capacity)
        for _ in range(15):
            k = rng.randint(0, capacity)
            if rng.random() < 0.5:
                slots = rng.sample(range(capacity), k)
                if rng.random() < 0.2:
                    slots += slots[: k // 3]  # repeats: the last append decides
                for slot in slots:
                    ref.append(slot)
                monkeypatch.setattr(slot_list, "BULK", 10**9)
                one.extend(slots)
                monkeypatch.setattr(slot_list, "BULK", 1)
                batch.extend(slots)
            else:
                slots = [rng.randrange(capacity) for _ in range(k)]
                for slot in slots:
                    ref.discard(slot)
                monkeypatch.setattr(slot_list, "BULK", 10**9)
                one.discard_many(slots)
                monkeypatch.setattr(slot_list, "BULK", 1)
                batch.discard_many(slots)
            for got in (one, batch):
                assert list(got) == list(ref), f"trial {trial}"
                assert _walk_back(got) == list(ref)
                assert len(got) == len(ref)
                assert all((s in got) == (s in ref) for s in range(capacity))


def test_discard_many_of_one_stretch_or_all_keeps_the_order(monkeypatch):
    """The two short cuts of discard_many (one run of the order leaves; every slot leaves)."""
    rng = random.Random(6)
    monkeypatch.setattr(slot_list, "BULK", 1)
    for trial in range(60):
        order = rng.sample(range(300), rng.randint(1, 300))
        one, batch = SlotList(300), SlotList(300)
        one.extend(order)
        batch.extend(order)
        i = rng.randrange(len(order))
        j = rng.randint(i + 1, len(order)) if trial % 5 else len(order)
        gone = order[i:j] if trial % 5 else order
        gone = gone + rng.sample(range(300), 3) if trial % 3 == 0 else gone  # unlisted slots too
        rng.shuffle(gone)
        for slot in gone:
            one.discard(slot)
        batch.discard_many(gone)
        assert list(batch) == list(one) and _walk_back(batch) == list(one) and len(batch) == len(one), trial


def test_batches_leaving_many_runs_keep_the_order_whatever_joined_them(monkeypatch):
    """discard_distinct (any order of its slots) and discard_many pair each run of leaving slots'
    ends by when its slots joined: joins by append, move_to_end, extend (loop and numpy),
    extend_unlisted and extend_distinct, interleaved, against one append / discard at a time."""
    rng = random.Random(7)
    for trial in range(120):
        capacity = rng.choice([5, 64, 700])
        ref, batch = SlotList(capacity), SlotList(capacity)
        for _ in range(25):
            op = rng.randrange(6)
            if op == 0:  # single joins (append, or move_to_end of a listed slot)
                for slot in rng.sample(range(capacity), rng.randint(1, min(capacity, 8))):
                    if slot in ref and rng.random() < 0.5:
                        ref.move_to_end(slot)
                        batch.move_to_end(slot)
                    else:
                        ref.append(slot)
                        batch.append(slot)
            elif op in (1, 2):  # a batch joins: numpy or the loops, listed slots move to the end
                slots = rng.sample(range(capacity), rng.randint(0, capacity))
                for slot in slots:
                    ref.append(slot)
                monkeypatch.setattr(slot_list, "BULK", 1 if op == 1 else 10**9)
                if op == 1 and slots:
                    batch.extend_distinct(np.array(slots, dtype=np.int64))
                else:
                    batch.extend(slots)
            elif op == 3:  # unlisted slots join in one chain
                slots = [s for s in rng.sample(range(capacity), rng.randint(0, capacity)) if s not in ref]
                for slot in slots:
                    ref.append(slot)
                batch.extend_unlisted(slots)
            else:  # a batch leaves: several runs, scattered slots, unlisted ones, any order
                listed = list(ref)
                gone: list[int] = []
                for _ in range(rng.randint(1, 6)):
                    if listed:
                        i = rng.randrange(len(listed))
                        gone += listed[i : i + rng.randint(1, 40)]
                gone += rng.sample(range(capacity), min(capacity, rng.randint(0, 5)))
                gone = list(dict.fromkeys(gone))
                rng.shuffle(gone)
                for slot in gone:
                    ref.discard(slot)
                monkeypatch.setattr(slot_list, "BULK", 1)
                if op == 4:
                    batch.discard_distinct(np.array(gone, dtype=np.int64))
                else:
                    batch.discard_many(gone + gone[: len(gone) // 4])  # repeats leave once
            assert list(batch) == list(ref), f"trial {trial}"
            assert _walk_back(batch) == list(ref)
            assert len(batch) == len(ref)
            assert all((s in batch) == (s in ref) for s in range(capacity))


# --- the pool on the numpy paths -----------------------------------------------------------------
def _workload() -> list:
    """A fixed random sequence of pool calls; returns what every call answered, and checks each
    page read back and the tiers' facts (TierIndex.check) after each call."""
    rng = np.random.default_rng(11)
    gen = torch.Generator().manual_seed(11)
    pool = TieredPool(small_format(num_layers=2), device_pages=40, host_pages=90, registry=CollectorRegistry(),
                      background_copies=False)
    truth: dict = {}
    trace = []
    with pool:
        for step in range(150):
            op = rng.integers(0, 4)
            if op == 0:
                n = int(rng.integers(1, 12))
                keys = prefix_keys(np.arange(n * pool.fmt.page_size) + 10_000 * step, pool.fmt.page_size, pool.namespace)
                slots = pool.allocate(n)
                fill_random(pool, slots, gen)
                for k, s in zip(keys, slots):
                    truth[k] = snapshot(pool, s)
                trace.append(("commit", pool.commit(keys, slots), slots))
                pool.release(slots)
            elif op == 1 and truth:
                known = list(truth)
                asked = [known[i] for i in rng.permutation(len(known))[: int(rng.integers(1, 30))]]
                asked.append(b"no tier holds this key")  # ends every prefix
                m = pool.match(asked)
                trace.append(("match", m))
                if m.total:
                    handle = pool.load(asked[: m.total])
                    handle.synchronize()
                    trace.append(("load", handle.slots))
                    for k, s in zip(asked, handle.slots):
                        assert snapshot(pool, s) == truth[k], f"step {step}: key in slot {s} holds another page"
                    pool.release(handle.slots)
            elif op == 2:
                trace.append(("evict", pool.evict(int(rng.integers(1, 20)))))
            else:
                trace.append(("evict host", pool.evict(int(rng.integers(1, 10)), tier="host")))
            pool._dev.check()
            pool._host.check()
    return trace


def test_a_pool_gives_the_same_answers_on_both_paths(monkeypatch):
    """The same calls with every batch on the one-at-a-time paths, then on the numpy paths:
    the same slots, matches and evictions, every page read back bit-exact."""
    python = _workload()
    assert any(op == "load" for op, *_ in python) and any(op == "evict host" for op, *_ in python)
    _numpy_everywhere(monkeypatch)
    assert _workload() == python


def test_threads_with_copies_in_flight_never_mix_pages_on_the_numpy_paths(numpy_always, registry):
    """The control plane's thread stress (four threads, a lander thread landing copies at random
    moments) with every batch on the numpy paths."""
    _threads_stress(registry)


def test_a_repeated_slot_anywhere_in_a_batch_sends_it_to_the_loops():
    from kvtier.index import TierIndex, make_policy

    index = TierIndex("host", 200_000, make_policy("lru", 200_000))
    rng = np.random.default_rng(5)
    for n in (tier_index.BULK, 4096, 70_000):  # past the precomputed positions too
        slots = rng.permutation(200_000)[:n].tolist()
        got = index._unique_slots(slots)
        assert got is not None and got.tolist() == slots
        for _ in range(5):  # after batches that left their positions in the scratch array
            i, j = sorted(rng.choice(n, 2, replace=False).tolist())
            repeated = list(slots)
            repeated[j] = repeated[i]
            assert index._unique_slots(repeated) is None, (n, i, j)
            assert index._unique_slots(slots) is not None
    assert index._unique_slots(list(range(tier_index.BULK - 1))) is None  # short: the loops


def test_the_id_cache_is_let_go_when_the_last_pool_closes():
    """Keys a pool's calls cached stay referenced while a pool is open and are let go when the
    last pool closes (in a fresh process: no pool of another test is open there)."""
    code = textwrap.dedent("""
        import os, sys, torch
        from kvtier import PageFormat, TieredPool
        from kvtier.index import keys as keys_mod
        fmt = PageFormat(num_layers=1, num_kv_heads=1, head_dim=16, page_size=4)
        first = TieredPool(fmt, device="cpu", device_pages=16, host_pages=16, registry=None)
        second = TieredPool(fmt, device="cpu", device_pages=16, host_pages=16, registry=None)
        keys = [os.urandom(keys_mod.ID_CACHE_MAX_KEY) for _ in range(8)]
        before = [sys.getrefcount(k) for k in keys]
        slots = first.allocate(len(keys))
        first.commit(keys, slots)
        first.release(slots)
        assert first.match(keys).total == len(keys)
        held = [sys.getrefcount(k) for k in keys]
        assert all(h > b for h, b in zip(held, before)), (before, held)
        first.close()
        assert [sys.getrefcount(k) for k in keys] == held, "another pool is still open"
        second.close()
        assert [sys.getrefcount(k) for k in keys] == before
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr[-3000:]


# --- batch paths of the tables and the index against their one-at-a-time paths ---------------
def test_get_many_tells_ids_apart_that_share_their_low_half(monkeypatch):
    """The numpy lookup compares the low 8 bytes of ids while probing: an id whose home bucket
    holds another id with the same low half (made here by search) must still be told apart."""
    monkeypatch.setattr(key_table, "MANY", 1)
    rng = random.Random(5)
    capacity = 256
    table = KeyTable(capacity)
    mask = table._mask
    asked, want = [], []
    for slot in range(0, 120, 2):
        b = rng.randbytes(16)
        while True:  # a twin of b (same low half) that lands in b's home bucket
            a = b[:8] + rng.randbytes(8)
            if a != b and hash(a) & mask == hash(b) & mask:
                break
        table.bind(a, slot)
        if slot % 4 == 0:  # half the time b is held too, one bucket on
            table.bind(b, slot + 1)
        asked += [b, a]
        want += [slot + 1 if slot % 4 == 0 else -1, slot]
    assert [table.get(k) for k in asked] == want
    assert table.get_many(asked) == want
    monkeypatch.setattr(key_table, "_WINDOW_STEPS", key_table._WINDOW_STEPS[:1])  # one bucket a pass
    assert table.get_many(asked) == want


@pytest.mark.parametrize("window", [1, key_table.WINDOW])
def test_probe_runs_longer_than_a_window(monkeypatch, window):
    """Ids that share one home bucket make a probe run several windows long: the numpy lookups
    and binds walk it pass after pass and agree with the one-at-a-time paths, before and after
    backward shifts."""
    monkeypatch.setattr(key_table, "MANY", 1)
    monkeypatch.setattr(key_table, "BIND_MANY", 1)
    monkeypatch.setattr(key_table, "_WINDOW_STEPS", key_table._WINDOW_STEPS[:window])
    rng = random.Random(11)
    capacity = 256
    one, batch = KeyTable(capacity), KeyTable(capacity)
    mask = one._mask
    home = 500  # near the end of the 512 buckets: the run wraps around to bucket 0
    twins = []
    while len(twins) < 70:
        kid = rng.randbytes(16)
        if hash(kid) & mask == home:
            twins.append(kid)
    others = [rng.randbytes(16) for _ in range(60)]
    for slot, kid in enumerate(twins[:30] + others[:30]):
        one.bind(kid, slot)
        batch.bind(kid, slot)
    late = twins[30:] + others[30:]
    slots = list(range(60, 60 + len(late)))
    for slot, kid in zip(slots, late):
        one.bind(kid, slot)
    batch.bind_many(late, slots)
    every = twins + others + [rng.randbytes(16) for _ in range(40)]
    want = [one.get(k) for k in every]
    assert batch.get_many(every) == [batch.get(k) for k in every] == want
    for slot in rng.sample(range(60 + len(late)), 50):
        one.unbind(slot)
        batch.unbind(slot)
    assert batch.get_many(every) == [one.get(k) for k in every]


@pytest.mark.parametrize("compact", [True, False])
def test_bind_many_of_a_short_batch_keys_what_bind_keys_and_names_the_bad_pair(compact):
    """Below BIND_MANY the compact table binds in one inline loop, the dict table in C: the same map
    as bind one at a time, with duplicates, taken slots and full tables refused."""
    rng = random.Random(7)
    capacity = 200
    make = KeyTable if compact else DictKeyTable
    one, batch = make(capacity), make(capacity)
    ids = [os.urandom(16) for _ in range(capacity)]
    slots = list(range(capacity))
    rng.shuffle(slots)
    for start in range(0, capacity, 40):  # five batches fill the table
        part = slots[start : start + 40]
        for slot in part:
            one.bind(ids[slot], slot)
        batch.bind_many([ids[s] for s in part], part)
        assert batch.get_many(ids) == one.get_many(ids)
        assert batch.keyed(np.arange(capacity)).tolist() == [one.holds_key(s) for s in range(capacity)]
    assert len(batch) == capacity
    batch.unbind(slots[0])
    batch.unbind(slots[1])
    free, other = slots[0], slots[1]
    with pytest.raises(ValueError, match="already in slot"):  # an id mapped already
        batch.bind_many([ids[slots[3]]], [free])
    with pytest.raises(ValueError, match="already holds"):  # a slot that holds a key
        batch.bind_many([ids[free]], [slots[2]])
    fresh = os.urandom(16)
    with pytest.raises(ValueError, match="already in slot"):  # an id twice in the batch
        batch.bind_many([fresh, fresh], [free, other])
    if not compact:  # the dict table refuses a batch before changing anything
        assert batch.get(fresh) == -1 and not batch.holds_key(free)
    else:  # one at a time: the pair before the bad one stays
        assert batch.get(fresh) == free
        batch.unbind(free)
    assert not batch.holds_key(other) and len(batch) == capacity - 2
    batch.bind_many([ids[free], ids[other]], [free, other])
    assert batch.get_many(ids) == [one.get(k) for k in ids]
    assert batch.keyed(np.arange(capacity)).all()


def test_touch_all_in_numpy_counts_what_the_loop_counts(monkeypatch):
    """Hit counts saturate at 255 and the eviction order moves the same way on both paths; a
    batch with a repeated slot takes the loop (each touch counts)."""
    got = []
    for bulk in (1, 10**9):
        monkeypatch.setattr(tier_index, "BULK", bulk)
        monkeypatch.setattr(slot_list, "BULK", bulk)
        from kvtier.index import PageState
        from kvtier.index.eviction import make_policy

        index = tier_index.TierIndex("t", 300, make_policy("lru", 300))
        slots = index.take_free(300, PageState.FILLING)
        index.bind_all(slots, [os.urandom(16) for _ in slots])
        index.set_states(slots, PageState.RESIDENT)
        for s in slots[:50]:
            index.hits[s] = 250
        r = random.Random(3)
        for _ in range(12):
            batch = r.sample(slots, 200)
            index.touch_all(batch)
        index.touch_all([slots[5], slots[5], slots[6]])
        index.check()
        got.append((bytes(index.hits), index.victims(300)))
    assert got[0] == got[1]
    assert max(got[0][0]) == 255


def test_bind_many_in_numpy_sends_a_repeated_slot_or_a_low_half_twin_to_the_loop(numpy_always):
    """A slot twice in a batch, or an id whose low half matches a mapped id on its probe, leaves
    the numpy bind before anything changes; the loop then binds what `bind` would."""
    rng = random.Random(11)
    table = KeyTable(64)
    mask = table._mask
    ids = [rng.randbytes(16) for _ in range(40)]
    table.bind_many(ids[:20], list(range(20)))
    before = (bytes(table._buckets), bytes(table._bucket_of), len(table))  # (unbinding leaves stale id bytes)
    with pytest.raises(ValueError, match="slot 30 already holds"):
        table.bind_many(ids[20:23], [30, 31, 30])
    assert table.get(ids[20]) == 30 and table.get(ids[21]) == 31  # the loop's pairs before the bad one
    table.unbind(30)
    table.unbind(31)
    assert (bytes(table._buckets), bytes(table._bucket_of), len(table)) == before
    b = ids[0]
    while True:  # an id alike in its low half with a mapped one, whose probe passes that one
        twin = b[:8] + rng.randbytes(8)
        if hash(twin) & mask == hash(b) & mask:
            break
    table.bind_many([twin] + ids[20:30], [40] + list(range(41, 51)))
    assert table.get_many([twin, b] + ids[20:30]) == [40, 0] + list(range(41, 51))
    assert [table.get(k) for k in [twin, b]] == [40, 0]
