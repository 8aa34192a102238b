"""The index's C paths (native/host_index.c through kvtier.index.native) against their Python
twins: the same key ids, the same table buffers after the same operations, the same errors, a
pool giving the same answers; and the build itself: kept on disk, safe under concurrent
processes, off on request, Python where no compiler works."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

import kvtier.index.key_table as key_table
from kvtier import PageState, TieredPool, prefix_keys
from kvtier.index import native
from kvtier.index.key_table import KeyTable
from kvtier.index.keys import key_id, key_ids, clear_id_cache
from kvtier.index.tier_index import TierIndex
from tests.conftest import fill_random, python_index_paths, small_format

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def lib():
    found = native.start(wait=True)
    assert found is not None, "the C index paths did not build (is a C compiler installed?)"
    return found


def _random_keys(rng: random.Random, n: int) -> list:
    """bytes and str keys of 1 to 300 bytes (one, two and three BLAKE2b blocks), ASCII and not,
    lone surrogates included, and the block edges exactly."""
    out = []
    for i in range(n):
        size = rng.choice([1, 2, 31, 32, 33, 127, 128, 129, 255, 256, 257, rng.randint(1, 300)])
        if i % 3 == 0:
            out.append(rng.randbytes(size))
        elif i % 3 == 1:
            out.append("".join(chr(rng.randint(32, 126)) for _ in range(size)))
        else:
            out.append("".join(chr(rng.choice([rng.randint(0x80, 0xD7FF), rng.randint(0xD800, 0xDFFF),
                                               rng.randint(0xE000, 0x10FFFF), rng.randint(32, 126)]))
                               for _ in range(size)))
    return out


def _on_both_paths(monkeypatch, run) -> list:
    """[run() on the C paths, run() on the Python paths]."""
    got = []
    for python in (False, True):
        with monkeypatch.context() as m:
            if python:
                python_index_paths(m)
            got.append(run())
    return got


def _c_ids(lib, keys):
    """The ids the C fill gives `keys` into an empty cache (None where it leaves them to Python)."""
    out = [None] * len(keys)
    if lib.fill(keys, out, {}, {}, 1 << 30, 1 << 30, 1 << 40) is None:
        return None
    return out


@pytest.mark.parametrize("avx2", [True, False])
def test_c_key_ids_are_the_python_ids(lib, avx2):
    """Keys of one block (up to 128 bytes, bytes or ASCII) hash four at a time, in lanes of mixed
    kinds and sizes and in short last groups, on AVX2 (where the CPU has it) and on the build for
    any CPU; longer and non-ASCII keys one at a time: the ids of kvtier.index.keys.key_id."""
    rng = random.Random(1)
    keys = _random_keys(rng, 3000) + ["abc", b"abc", "a" * 128, b"a" * 128, "\ud800", "é"]
    want = [key_id(k) for k in keys]
    has_avx2 = lib.lanes(True)
    try:
        assert lib.lanes(avx2) == (avx2 and has_avx2)
        assert _c_ids(lib, keys) == want
        for n in range(1, 10):  # every size of a last group of four
            assert _c_ids(lib, keys[-n:]) == want[-n:]
        assert _c_ids(lib, tuple(keys[:10])) == want[:10]
        assert _c_ids(lib, []) == []
        # "abc" and b"abc" keep two ids
        assert _c_ids(lib, ["abc"]) != _c_ids(lib, [b"abc"])
    finally:
        lib.lanes(True)


class _Bytes(bytes):
    pass


@pytest.mark.parametrize("bad", [b"", "", _Bytes(b"x"), bytearray(b"x"), 7, None])
def test_c_key_ids_leave_anything_but_plain_non_empty_keys_to_python(lib, bad):
    assert _c_ids(lib, [b"fine", bad]) is None
    with pytest.raises(TypeError):
        lib.fill(5, [], {}, {}, 1 << 30, 1 << 30, 1 << 40)


@pytest.mark.parametrize("bad", [b"", "", _Bytes(b"x"), bytearray(b"x"), 7, None, ["unhashable"]])
def test_c_cached_ids_leave_anything_but_plain_non_empty_keys_to_python(lib, bad):
    """`known` (key_ids' first look, at the young generation) answers plain non-empty keys only:
    each key's cached id or None, and how many it lacks; for anything else key_ids takes the
    Python path, which names a bad key and hashes a subclass of bytes."""
    young = {b"fine": key_id(b"fine"), "also": key_id("also")}
    assert lib.known([b"fine", "also", b"new"], young) == ([young[b"fine"], young["also"], None], 1)
    assert lib.known((b"fine",), young) == ([young[b"fine"]], 0)
    assert lib.known([b"fine", bad], young) is None
    if type(bad) is _Bytes:  # a key, never cached
        assert key_ids([b"fine", bad]) == [key_id(b"fine"), key_id(bytes(bad))]
        return
    with pytest.raises((TypeError, ValueError), match="^key 1: "):
        key_ids([b"fine", bad])


def test_key_ids_of_new_keys_are_the_same_on_both_paths(lib, monkeypatch):
    """key_ids' batch fill (every key new, or some cached) hashes in C; the same ids as one key
    at a time in Python."""
    rng = random.Random(2)
    keys = _random_keys(rng, 600)
    want = [key_id(k) for k in keys]
    clear_id_cache()
    assert key_ids(keys[:300]) == want[:300]  # every key new
    assert key_ids(keys) == want  # half cached
    clear_id_cache()
    python_index_paths(monkeypatch)
    assert key_ids(keys) == want


def _tables(capacity: int, monkeypatch):
    """(a table on the C paths, one on the Python paths binding one pair at a time)."""
    c_table = KeyTable(capacity)
    assert c_table._native() is not None
    with monkeypatch.context() as m:
        python_index_paths(m)
        py_table = KeyTable(capacity)
        assert py_table._native() is None
    return c_table, py_table


def _state(table: KeyTable) -> tuple:
    keyed = np.flatnonzero(table._np_bucket_of >= 0)
    return (bytes(table._buckets), table._np_bucket_of.tobytes(), table._np_home[keyed].tobytes(),
            table._np_ids[keyed].tobytes(), len(table))


@pytest.mark.parametrize("capacity", [8, 300, 5000])
def test_c_table_changes_its_buffers_as_python_binds_and_unbinds_one_at_a_time(lib, monkeypatch, capacity):
    """Random binds (single and batched), unbinds and lookups on two tables: after every step the
    C table's buckets, ids, homes and count equal the Python table's (binding one pair at a
    time), and every lookup agrees, before and after backward shifts."""
    rng = random.Random(capacity)
    c_table, py_table = _tables(capacity, monkeypatch)
    monkeypatch.setattr(key_table, "BIND_MANY", 10**9)  # the Python table binds one pair at a time
    ids = [rng.randbytes(16) for _ in range(2 * capacity)]
    held: dict[int, bytes] = {}
    for _ in range(60):
        free = [s for s in range(capacity) if s not in held]
        op = rng.random()
        if op < 0.45 and free:
            slots = rng.sample(free, rng.randint(1, len(free)))
            taken = set(held.values())
            kids = rng.sample([k for k in ids if k not in taken], len(slots))
            with monkeypatch.context() as m:
                python_index_paths(m)
                py_table.bind_many(kids, slots)
            c_table.bind_many(kids, slots)
            held.update(zip(slots, kids))
        elif op < 0.55 and free:
            taken = set(held.values())
            slot, kid = free[0], next(k for k in ids if k not in taken)
            with monkeypatch.context() as m:
                python_index_paths(m)
                py_table.bind(kid, slot)
            c_table.bind(kid, slot)
            held[slot] = kid
        else:
            for slot in rng.sample(range(capacity), rng.randint(1, capacity)):
                with monkeypatch.context() as m:
                    python_index_paths(m)
                    py_table.unbind(slot)
                c_table.unbind(slot)
                held.pop(slot, None)
        assert _state(c_table) == _state(py_table)
        asked = rng.sample(ids, min(len(ids), rng.randint(1, 400))) + [rng.randbytes(16), b"short", b"x" * 17]
        where = {kid: slot for slot, kid in held.items()}
        want = [where.get(kid, -1) for kid in asked]
        assert c_table.get_many(asked) == want
        assert c_table.get_many_array(asked).tolist() == want
        assert [c_table.get(k) for k in asked] == want
        assert list(c_table.get_each(asked)) == want
        lead = want.index(-1) if -1 in want else len(want)
        assert c_table.leading(asked) == want[:lead]
        with monkeypatch.context() as m:
            python_index_paths(m)
            assert py_table.get_many(asked) == want
            assert py_table.leading(asked) == want[:lead]
        keyed = rng.sample(sorted(held), min(len(held), rng.randint(0, 300)))
        assert c_table.ids_of(keyed) == [held[s] for s in keyed]
        assert c_table.ids_of(np.asarray(keyed, dtype=np.int64)) == [held[s] for s in keyed]
        keyless = [s for s in range(capacity) if s not in held]
        if keyless:
            with pytest.raises(ValueError, match=f"slot {keyless[0]} holds no key"):
                c_table.ids_of(keyed + keyless[:1] + keyed)
    for bad in (-1, capacity):
        with pytest.raises(IndexError):
            c_table.ids_of([bad])


def test_c_bind_many_refuses_what_bind_refuses_and_keeps_the_pairs_before(lib, monkeypatch):
    """A slot that holds a key, an id already mapped, an id or a slot twice, an id of the wrong
    size: the same error as the Python path, the pairs before the bad one bound, the table
    exactly the Python table's afterwards."""
    monkeypatch.setattr(key_table, "BIND_MANY", 10**9)
    rng = random.Random(3)
    ids = [rng.randbytes(16) for _ in range(64)]
    for kids, slots, message in (
        (ids[10:20], list(range(15, 25)), "slot 15 already holds"),
        (ids[5:15], list(range(30, 40)), "is already in slot 5"),
        (ids[20:25] + ids[20:21], list(range(40, 46)), "is already in slot"),
        (ids[25:28], [50, 51, 50], "slot 50 already holds"),
        (ids[28:30] + [b"short"], [52, 53, 54], "a key id is 16 bytes"),
    ):
        c_table, py_table = _tables(64, monkeypatch)
        for table, python in ((c_table, False), (py_table, True)):
            with monkeypatch.context() as m:
                if python:
                    python_index_paths(m)
                table.bind_many(ids[:20], list(range(20)))
                with pytest.raises(ValueError, match=message):
                    table.bind_many(kids, slots)
        assert _state(c_table) == _state(py_table)
        assert c_table.get_many(ids) == [py_table.get(k) for k in ids]


def test_a_table_changed_on_both_paths_in_turn_stays_one_table(lib, monkeypatch):
    """The C and Python paths share the buffers: binds and unbinds alternating between them
    leave a table whose every lookup agrees on both."""
    rng = random.Random(4)
    table = KeyTable(512)
    ids = [rng.randbytes(16) for _ in range(512)]
    slots = list(range(512))
    rng.shuffle(slots)
    for turn, at in enumerate(range(0, 512, 64)):
        with monkeypatch.context() as m:
            if turn % 2:
                python_index_paths(m)
                table._c = None
            table.bind_many([ids[s] for s in slots[at : at + 64]], slots[at : at + 64])
            for s in rng.sample(slots[: at + 64], 20):
                table.unbind(s)
        c_view = table.get_many(ids)
        with monkeypatch.context() as m:
            python_index_paths(m)
            saved, table._c = table._c, None
            assert table.get_many(ids) == c_view == [table.get(k) for k in ids]
            table._c = saved


def test_a_pool_gives_the_same_answers_on_the_c_and_python_paths(lib, monkeypatch):
    """test_index_batch's workload (matches, loads, evictions, pages read back bit-exact) on the C
    paths and on the Python paths: the same trace."""
    from tests.test_index_batch import _workload

    c_trace = _workload()
    with monkeypatch.context() as m:
        python_index_paths(m)
        assert _workload() == c_trace


def _in_fresh_process(code: str, env: dict) -> subprocess.Popen:
    full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT), "HOME": os.environ.get("HOME", "/root")}
    full.update(env)
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=full, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


_USE = """
    import os, sys
    from kvtier.index import native
    from kvtier.index.keys import key_id
    lib = native.start(wait=True)
    keys = [os.urandom(40) for _ in range(100)] + ["k%d" % i for i in range(100)]
    out = [None] * len(keys)
    ok = lib is not None and lib.fill(keys, out, {}, {}, 1 << 30, 1 << 30, 1 << 40) and out == [key_id(k) for k in keys]
    print("C" if ok else ("python" if lib is None else "WRONG"))
"""


def test_processes_building_at_once_each_load_one_whole_library(tmp_path):
    """Four fresh processes build into an empty cache directory at once: each loads a library
    that gives the right ids, one library is kept, no temporary file is left; a fifth process
    loads it without building."""
    folder = tmp_path / "cache"
    procs = [_in_fresh_process(_USE, {"KVTIER_HOST_CACHE": str(folder)}) for _ in range(4)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [o.strip() for o, _ in outs] == ["C"] * 4, [e[-2000:] for _, e in outs]
    kept = sorted(os.listdir(folder))
    assert len(kept) == 1 and kept[0].startswith(native.MODULE + "."), kept
    stamp = os.stat(folder / kept[0]).st_mtime_ns
    out, err = _in_fresh_process(_USE, {"KVTIER_HOST_CACHE": str(folder)}).communicate(timeout=180)
    assert out.strip() == "C", err[-2000:]
    assert os.stat(folder / kept[0]).st_mtime_ns == stamp and os.listdir(folder) == kept


@pytest.mark.parametrize("how", ["off", "no compiler"])
def test_without_the_c_library_a_pool_runs_on_python(tmp_path, how):
    """KVTIER_HOST_CACHE=off, or a compiler that fails: no library, one log line, and a pool's
    commit, match and load work on the Python paths."""
    env = {"KVTIER_HOST_CACHE": "off"} if how == "off" else {"KVTIER_HOST_CACHE": str(tmp_path / "c"), "CC": "false"}
    code = "import logging\nlogging.basicConfig()\n" + textwrap.dedent(_USE) + textwrap.dedent("""
    import torch
    from prometheus_client import CollectorRegistry
    from kvtier import PageFormat, TieredPool
    fmt = PageFormat(num_layers=2, num_kv_heads=1, head_dim=16, page_size=4, dtype="bf16", scale="none")
    pool = TieredPool(fmt, device="cpu", device_pages=8, host_pages=32, registry=CollectorRegistry())
    slots = pool.allocate(4)
    pool.commit(["a", "b", "c", "d"], slots)
    pool.release(slots)
    pool.flush()
    pool.evict(tier="device", keys=["a", "b", "c", "d"])
    assert pool.match(["a", "b", "c", "d", "e"]).host == 4
    h = pool.load(["a", "b", "c", "d"])
    h.wait()
    assert len(h.slots) == 4 and native.module() is None and pool._host.table._native() is None
    pool.close()
    print("pool ok")
    """)
    out, err = _in_fresh_process(code, env).communicate(timeout=180)
    assert out.split() == ["python", "pool", "ok"], err[-2000:]
    if how == "no compiler":  # said once; nothing left in the directory
        assert err.count("C index paths are not built") == 1, err[-2000:]
        assert os.listdir(tmp_path / "c") == []


def _order(lst) -> tuple:
    """What a SlotList is: its walk from the front, each listed slot's stamp, its length and the
    next stamp (unlisted slots' stale links are nobody's business)."""
    walk, slot = [], lst._next[lst._head]
    while slot != lst._head:
        walk.append(slot)
        slot = lst._next[slot]
    back, slot = [], lst._prev[lst._head]
    while slot != lst._head:
        back.append(slot)
        slot = lst._prev[slot]
    assert back[::-1] == walk
    member = [s for s in range(lst.capacity) if lst._member[s]]
    assert sorted(walk) == member
    return walk, [lst._stamp[s] for s in walk], len(lst), lst._stamps


@pytest.mark.parametrize("capacity", [1, 50, 3000])
def test_c_slot_lists_keep_the_order_the_python_paths_keep(lib, monkeypatch, capacity):
    """Random appends, extends (repeats, listed slots, numpy arrays), discards one and many,
    moves to the end and walks on two lists: after every step the C list's order, stamps and
    length are the Python list's (one-at-a-time and numpy paths)."""
    from kvtier.index.slot_list import SlotList

    rng = random.Random(capacity + 7)
    c_list = SlotList(capacity)
    assert c_list._native() is not None
    with monkeypatch.context() as m:
        python_index_paths(m)
        py_list = SlotList(capacity)
    for step in range(200):
        op = rng.randrange(9)
        k = rng.randint(0, min(capacity, 400))
        picked = [rng.randrange(capacity) for _ in range(k)]
        distinct = rng.sample(range(capacity), k)
        listed = [s for s in distinct if s in c_list]
        unlisted = [s for s in distinct if s not in c_list]
        calls = [
            ("append", (picked[0],) if picked else (0,)),
            ("extend", (picked,)),
            ("extend", (distinct,)),
            ("extend_distinct", (np.asarray(distinct, dtype=np.int64),)),
            ("extend_unlisted", (unlisted,)),
            ("discard", (picked[0],) if picked else (0,)),
            ("discard_many", (picked,)),
            ("discard_distinct", (np.asarray(distinct, dtype=np.int64),)),
            ("move_to_end", (listed[0],) if listed else (0,)),
        ]
        name, args = calls[op]
        getattr(c_list, name)(*args)
        with monkeypatch.context() as m:
            python_index_paths(m)
            getattr(py_list, name)(*args)
            want_first = py_list.first(k)
        assert _order(c_list) == _order(py_list), (step, name)
        assert c_list.first(k) == want_first
    with pytest.raises(IndexError):
        c_list.extend([0, capacity])
    with pytest.raises(IndexError):
        c_list.discard_many([-1])


def test_c_slot_lists_under_an_lru_policy_pick_the_python_victims(lib, monkeypatch):
    """An LRU policy driven by the same random adds, touches and removes on both paths picks the
    same victims in the same order."""
    from kvtier.index.eviction import make_policy

    rng = random.Random(9)
    c_lru = make_policy("lru", 2000)
    with monkeypatch.context() as m:
        python_index_paths(m)
        py_lru = make_policy("lru", 2000)
    for _ in range(150):
        slots = rng.sample(range(2000), rng.randint(1, 300))
        op = rng.choice(["add_many", "touch_many", "remove_many", "add_many_distinct", "touch_many_distinct"])
        if op == "touch_many" and rng.random() < 0.5:  # repeats: each moves the slot again
            slots += rng.sample(slots, min(len(slots), 20))
        arg = np.asarray(slots, dtype=np.int64) if op.endswith("distinct") else slots
        getattr(c_lru, op)(arg)
        with monkeypatch.context() as m:
            python_index_paths(m)
            getattr(py_lru, op)(arg)
            want = py_lru.victims(500), _order(py_lru)
        assert (c_lru.victims(500), _order(c_lru)) == want


def _tier_snapshot(index) -> tuple:
    """Every fact set_states keeps, after checking the ones it owns alone (counts, the free and
    dirty lists; TierIndex.check adds the pool's rules for keys and the eviction order, which
    these random walks do not follow)."""
    from kvtier.index import PageState

    states = [index.state[s] for s in range(index.capacity)]
    assert [states.count(st) for st in PageState] == index.counts
    assert sorted(index.free) == [s for s in range(index.capacity) if states[s] == PageState.FREE]
    assert sorted(index.dirty.first(index.capacity)) == [s for s in range(index.capacity) if states[s] == PageState.DIRTY]
    assert index.busy_slots == sum(1 for b in index.busy if b) and index.held == sum(1 for p in index.pins if p)
    return (bytes(index.state), index.pins.tobytes(), index.busy.tobytes(), bytes(index.hits), list(index.counts),
            index.busy_slots, index.held, index.free.tobytes(), index.dirty.first(index.capacity),
            index.policy.victims(index.capacity),
            index.table.get_many([index.table.id_of(s) for s in range(index.capacity) if index.table.holds_key(s)]))


@pytest.mark.parametrize("seed", range(4))
def test_c_state_changes_leave_what_the_python_loops_leave(lib, monkeypatch, seed):
    """Random batches through set_states (every target state, copies starting and ending,
    repeats, illegal moves, frees of held or busy slots), pins and unpins, takes and binds, on
    two tier indexes: after every step the C one's states, pins, copies, hits, counts, free list,
    dirty list, eviction order and keys are the Python one's, and a fault raises the same error
    after the same partial changes."""
    from kvtier.index import PageState, TierIndex, make_policy
    from kvtier.index.states import LEGAL

    rng = random.Random(seed)
    cap = 300
    c_index = TierIndex("t", cap, make_policy("lru", cap))
    assert c_index._native() is not None
    with monkeypatch.context() as m:
        python_index_paths(m)
        py_index = TierIndex("t", cap, make_policy("lru", cap))
    for index in (c_index, py_index):  # hits near saturation: touches stop at 255
        for slot in range(0, cap, 3):
            index.hits[slot] = 254
    ids = iter([rng.randbytes(16) for _ in range(100000)])
    states = list(PageState)
    counted = {"set_states": 0, "hold_readable": 0, "touch_all or idle": 0}
    for step in range(600):
        op = rng.random()
        in_use = [s for s in range(cap) if c_index.state[s] != PageState.FREE]
        if op < 0.2:
            n = rng.randint(0, 80)
            call = ("take_free", (n, rng.choice([PageState.FILLING, PageState.LOADING]), rng.choice([0, 0, 1])))
        elif op < 0.3 and in_use:
            unkeyed = [s for s in in_use if not c_index.table.holds_key(s)]
            picked = rng.sample(unkeyed, min(len(unkeyed), rng.randint(1, 70)))
            call = ("bind_all", (picked, [next(ids) for _ in picked]))
        elif op < 0.4 and in_use:
            picked = rng.sample(in_use, min(len(in_use), rng.randint(1, 40)))
            if rng.random() < 0.2:
                picked += picked[:3]  # a repeat: the loops apply it
            call = (rng.choice(["pin_all", "unpin_all"]), (picked,))
        elif op < 0.55 and in_use:
            if rng.random() < 0.5:
                call = ("take_loading", (min(len(c_index.free), rng.randint(0, 40)),))
            else:
                idle = [s for s in in_use if c_index.state[s] in (PageState.RESIDENT, PageState.DIRTY)
                        and not c_index.pins[s] and not c_index.busy[s]]
                picked = rng.sample(idle, min(len(idle), rng.randint(0, 40)))
                call = ("reuse", (picked, PageState.LOADING, rng.choice([0, 1])))
        elif op < 0.65 and in_use:
            picked = rng.sample(in_use, min(len(in_use), rng.randint(1, 60)))
            if rng.random() < 0.2:
                picked += picked[:3]
            name = rng.choice(["hold_all", "unhold_all", "hold_readable", "hold_readable", "touch_all", "idle"])
            if name == "hold_readable":  # the ids of distinct keyed slots, readable or not, or one no tier holds
                keyed = list(dict.fromkeys(s for s in picked if c_index.table.holds_key(s)))
                if rng.random() < 0.5:
                    keyed = [s for s in keyed if c_index.state[s] in (PageState.RESIDENT, PageState.DIRTY,
                                                                       PageState.OFFLOADING)]
                kids = [c_index.table.id_of(s) for s in keyed] + ([next(ids)] if rng.random() < 0.1 else [])
                call = (name, (kids,))
                counted["hold_readable"] += 1
            elif name in ("touch_all", "idle"):  # (repeats too: each counts a use, or is answered)
                call = (name, (picked,))
                counted["touch_all or idle"] += 1
            else:
                call = (name, (picked, rng.random() < 0.5) if name == "hold_all" else (picked,))
        elif in_use:
            new, delta = rng.choice(states), rng.choice([0, 0, 1, -1])
            fine = [s for s in in_use if LEGAL[c_index.state[s]][new] and c_index.busy[s] + delta >= 0
                    and (new != PageState.FREE or (not c_index.pins[s] and not c_index.busy[s] + delta))]
            if not fine:
                continue
            picked = rng.sample(fine, min(len(fine), rng.randint(1, 100)))  # (a repeat: see the faults below)
            call = ("set_states", (np.asarray(picked) if rng.random() < 0.2 else picked, new, delta))
            counted["set_states"] += 1
        else:
            continue
        name, args = call
        outcomes = []
        for index, python in ((c_index, False), (py_index, True)):
            with monkeypatch.context() as m:
                if python:
                    python_index_paths(m)
                if name in ("unpin_all", "unhold_all"):  # only slots held (by the engine, by copies), each as often
                    held = list(index.pins if name == "unpin_all" else index.busy)
                    keep = []
                    for s in args[0]:
                        if held[s]:
                            held[s] -= 1
                            keep.append(s)
                    args = (keep,)
                try:
                    got = getattr(index, name)(*args)
                    outcomes.append(("ok", got))
                except (AssertionError, RuntimeError, ValueError) as exc:
                    outcomes.append((type(exc).__name__, str(exc)))
        assert outcomes[0] == outcomes[1] and outcomes[0][0] == "ok", (step, name, outcomes)
        want = _tier_snapshot(py_index)
        assert _tier_snapshot(c_index) == want, (step, name)
    assert counted["set_states"] > 120 and counted["hold_readable"] > 5 and counted["touch_all or idle"] > 5, counted


@pytest.mark.parametrize("fault", ["illegal", "held", "busy", "no copy", "repeat"])
def test_a_faulty_state_change_raises_the_python_error_on_the_c_path(lib, monkeypatch, fault):
    """A batch with one slot that cannot move: the same error as the Python loops, after the
    same partial changes (the C pass changes nothing and hands the batch to the loops)."""
    from kvtier.index import PageState, TierIndex, make_policy

    def run():
        index = TierIndex("t", 64, make_policy("lru", 64))
        slots = index.take_free(20, PageState.FILLING)
        index.bind_all(slots, [bytes([i]) * 16 for i in range(20)])
        index.set_states(slots, PageState.DIRTY)
        bad = slots[7]
        if fault == "illegal":  # DIRTY -> LOADING
            target, delta = PageState.LOADING, 0
        elif fault == "held":
            index.pin(bad)
            target, delta = PageState.FREE, 0
        elif fault == "repeat":  # no state moves to itself: the second DIRTY -> OFFLOADING is illegal
            slots = slots + [bad]
            target, delta = PageState.OFFLOADING, 1
        elif fault == "busy":  # a copy reads the slot
            index.set_states([bad], PageState.OFFLOADING, busy_delta=1)
            index.set_states([s for s in slots if s != bad], PageState.OFFLOADING)
            target, delta = PageState.FREE, 0
        else:  # a copy ends that never started
            index.set_states([s for s in slots if s != bad], PageState.OFFLOADING, busy_delta=1)
            index.set_states([bad], PageState.OFFLOADING)
            target, delta = PageState.RESIDENT, -1
        with pytest.raises((AssertionError, RuntimeError)) as err:
            index.set_states(slots, target, busy_delta=delta)
        return (type(err.value).__name__, str(err.value), bytes(index.state), index.busy.tobytes(),
                index.pins.tobytes(), list(index.free))

    c_got, py_got = _on_both_paths(monkeypatch, run)
    assert c_got == py_got


@pytest.mark.parametrize("call", ["unhold_all", "unpin_all"])
def test_letting_go_of_a_slot_not_held_raises_the_python_error_on_the_c_path(lib, monkeypatch, call):
    from kvtier.index import PageState, TierIndex, make_policy

    def run():
        index = TierIndex("t", 32, make_policy("lru", 32))
        slots = index.take_free(10, PageState.FILLING)
        index.pin_all(slots[:5])
        index.hold_all(slots[:5])
        with pytest.raises((AssertionError, ValueError)) as err:
            getattr(index, call)(slots[:6])
        return (type(err.value).__name__, str(err.value), index.pins.tobytes(), index.busy.tobytes(),
                index.held, index.busy_slots)

    c_got, py_got = _on_both_paths(monkeypatch, run)
    assert c_got == py_got


def test_the_id_cache_fills_and_turns_over_the_same_on_both_paths(lib, monkeypatch):
    """Batches of new, cached and old-generation keys, keys too long to cache, and generations
    turning over by count and by size: the C fill leaves the cache's generations and their sizes
    exactly as the Python fill does, and every id is right."""
    import kvtier.index.keys as keys_mod

    monkeypatch.setattr(keys_mod, "ID_CACHE_GENERATION", 300)
    monkeypatch.setattr(keys_mod, "ID_CACHE_GENERATION_CHARS", 20000)
    monkeypatch.setattr(keys_mod, "ID_CACHE_MAX_KEY", 200)
    rng = random.Random(12)
    pool_of_keys = _random_keys(rng, 900)
    batches = [rng.sample(pool_of_keys, rng.randint(1, 120)) for _ in range(60)]
    # At the edges: a batch that fills the young generation to exactly its count, or its size
    # (None: the cache emptied first): 292 keys then 8 more reach the count exactly; 100 keys of
    # 19,801 bytes then 8 of 199 bytes reach the size exactly, or of 198 stop one short of it.
    batches += [None, [f"a{i:03d}" for i in range(292)], [f"b{i:03d}" for i in range(8)],
                None, [b"c" * 100] + [bytes([i]) * 199 for i in range(1, 100)],
                [bytes([i]) * 24 + b"d" for i in range(7)] + [b"g" * 24],
                None, [b"e" * 100] + [bytes([i]) * 199 for i in range(1, 100)],
                [bytes([i]) * 24 + b"f" for i in range(7)] + [b"h" * 23]]
    def run():
        clear_id_cache()
        seen = []
        for batch in batches:
            if batch is None:
                clear_id_cache()
                continue
            assert key_ids(batch) == [key_id(k) for k in batch]
            seen.append((dict(keys_mod._young), dict(keys_mod._old), keys_mod._young_chars))
        return seen

    c_seen, py_seen = _on_both_paths(monkeypatch, run)
    clear_id_cache()
    assert c_seen == py_seen
    assert any(len(old) for _, old, _ in c_seen)  # the generations did turn over


def _commit_run(monkeypatch, path: str, policy: str, steps: int = 90) -> list:
    """A fixed random sequence of commits through a pool (new keys, keys on the device, keys the
    host tier holds readable, keys it holds while they land there), with flushes, evictions and
    releases between them; path "one pass": the C `commit_fresh`; "fallback": the pool's other
    path with the C paths loaded; "python": the Python twins. Returns every commit's answer and
    both tiers' facts after it."""
    one_pass = []
    real = TierIndex.commit_fresh

    def counted(self, *args):
        done = real(self, *args)
        one_pass.append(done is not None)
        return done

    with monkeypatch.context() as m:
        if path == "python":
            python_index_paths(m)
        m.setattr(TierIndex, "commit_fresh", counted if path == "one pass" else (lambda self, *args: None))
        rng = np.random.default_rng(5)
        gen = torch.Generator().manual_seed(5)
        pool = TieredPool(small_format(num_layers=2), device_pages=48, host_pages=96, write_policy=policy,
                          registry=CollectorRegistry(), background_copies=False)
        trace = []
        with pool:
            seen: list = []
            for step in range(steps):
                n = int(rng.integers(1, 14))
                fresh = prefix_keys(np.arange(n * pool.fmt.page_size) + 1000 * step, pool.fmt.page_size, pool.namespace)
                old = [seen[i] for i in rng.permutation(len(seen))[: int(rng.integers(0, 5))]] if seen else []
                keys = list(dict.fromkeys(fresh[: n - len(old)] + old))
                if rng.random() < 0.2 and len(pool._host.free) > 2:  # a key landing in the host tier (as a fetch)
                    landing = prefix_keys(np.arange(pool.fmt.page_size) + 7_000_000 + step, pool.fmt.page_size,
                                          pool.namespace)[0]
                    with pool._lock:
                        slot = pool._host.take_loading(1)[0]
                        pool._host.table.bind(key_ids([landing])[0], slot)
                    keys.append(landing)
                slots = pool.allocate(len(keys))
                fill_random(pool, slots, gen)
                trace.append(("commit", pool.commit(keys, slots), pool.counters.duplicate_commits))
                pool.release(slots)
                seen.extend(fresh[: n - len(old)])
                action = rng.random()
                if action < 0.3:
                    pool.flush()
                elif action < 0.5:
                    pool.evict(tier="device", keys=[k for k in seen if rng.random() < 0.5])
                trace.append(("tiers", _tier_snapshot(pool._dev), _tier_snapshot(pool._host),
                              pool._host.counts[PageState.LOADING]))
                with pool._lock:
                    pool._host.check()
    return trace, one_pass


@pytest.mark.parametrize("policy", ["write_back", "write_through", "write_through_selective"])
def test_a_commit_in_one_c_pass_keys_what_the_python_paths_key(lib, monkeypatch, policy):
    """Commits of new keys, keys already on the device (kept where they are), keys the host tier
    holds readable (clean at once) and keys it holds while they land (dirty, no copy down):
    the one C pass leaves both tiers, the answers and the duplicate counts as the pool's other
    path and the Python twins do, and it ran for every commit."""
    c_trace, one_pass = _commit_run(monkeypatch, "one pass", policy)
    assert one_pass and all(one_pass), one_pass
    assert c_trace == _commit_run(monkeypatch, "fallback", policy)[0]
    assert c_trace == _commit_run(monkeypatch, "python", policy)[0]
    kinds = {t[1] for t in c_trace if t[0] == "commit"}
    assert len(kinds) > 3  # commits of several sizes


@pytest.mark.parametrize("fault", ["bool", "numpy", "float", "negative", "out of range", "repeat", "committed",
                                   "released", "count", "repeated key"])
def test_a_faulty_commit_raises_the_python_error_and_changes_nothing(lib, monkeypatch, fault):
    """A commit with one bad slot (or key): the same error on the C path as on the Python
    paths, and both tiers as they were; a numpy integer slot is no fault (the checks take it)."""

    def run():
        pool = TieredPool(small_format(num_layers=2), device_pages=32, host_pages=64, registry=CollectorRegistry(),
                          background_copies=False)
        with pool:
            keys = prefix_keys(np.arange(10 * pool.fmt.page_size), pool.fmt.page_size, pool.namespace)
            done = pool.allocate(3)
            pool.commit(keys[:3], done)
            slots = pool.allocate(6)
            released = pool.allocate(1)
            pool.release(released)
            keys = keys[3:9]
            bad = {"bool": True, "numpy": np.int64(slots[2]), "float": float(slots[2]), "negative": -1,
                   "out of range": 32, "repeat": slots[0], "committed": done[1], "released": released[0]}
            if fault == "count":
                slots = slots[:5]
            elif fault == "repeated key":
                keys[4] = keys[1]
            else:
                slots[2] = bad[fault]
            before = (_tier_snapshot(pool._dev), _tier_snapshot(pool._host))
            try:
                got = ("ok", pool.commit(keys, slots))
            except (TypeError, ValueError) as exc:
                got = (type(exc).__name__, str(exc))
                assert (_tier_snapshot(pool._dev), _tier_snapshot(pool._host)) == before
            return got, _tier_snapshot(pool._dev), _tier_snapshot(pool._host)

    c_got, py_got = _on_both_paths(monkeypatch, run)
    assert c_got == py_got
    assert (c_got[0][0] == "ok") == (fault == "numpy"), c_got[0]


def test_landing_marks_and_clears_in_c_as_numpy_does(lib, monkeypatch):
    """The pool's record of which reload lands in which device slot: random marks (over earlier
    ones) and clears (of the slots a reload still holds) leave the same numbers and find the
    same reloads on the C path as on numpy."""
    from kvtier.pool.landing import Landing
    from kvtier.transfer import DoneTicket

    rng = random.Random(4)
    cap = 500
    c_land, py_land = Landing(cap), Landing(cap)
    marked: list = []
    for step in range(400):
        if marked and rng.random() < 0.4:
            slots, number = marked.pop(rng.randrange(len(marked)))
            args = ("clear", slots, number)
        else:
            slots = rng.sample(range(cap), rng.randint(0, 60))
            args = ("mark", np.asarray(slots, dtype=np.int64) if rng.random() < 0.3 else slots, DoneTicket(1))
        got = []
        for land, python in ((c_land, False), (py_land, True)):
            with monkeypatch.context() as m:
                if python:
                    python_index_paths(m)
                got.append(getattr(land, args[0])(*args[1:]))
        if args[0] == "mark":
            assert got[0] == got[1]
            marked.append((args[1], got[0]))
        assert np.array_equal(c_land._of, py_land._of), step
        probe = rng.sample(range(cap), 30)
        assert [id(t) for t in c_land.tickets_of(probe)] == [id(t) for t in py_land.tickets_of(probe)]
        assert sorted(c_land._tickets) == sorted(py_land._tickets)
    assert c_land._of.any()
