"""The remote index's presence cache: `present` answers keys a read found published from memory,
never reports a page this process removed, and reports one another process removed for at most
`recheck_s`. Real SQLite files; a second RemoteIndex on the same file (its own connections and
cache) or a child process plays the other process."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvtier import TieredPool, prefix_keys
from kvtier.index.keys import key_ids
from kvtier.tiers.remote.index import RemoteIndex
from kvtier.tiers.remote.owners import make_owner
from tests.conftest import fill_random, small_format
from tests.test_remote_index import NS_A, NS_B, PAGE, fill, filled_elsewhere, reserve, run_in_child


def open_index(tmp_path, owner="test", recheck_s=3600.0) -> RemoteIndex:
    return RemoteIndex(
        str(tmp_path / "index.sqlite3"), owner=make_owner(owner), reuse_delay_s=0.0,
        reservation_lease_s=600.0, busy_timeout_s=10.0, presence_recheck_s=recheck_s,
    )


class Reads:
    """Statements the index's reader connections run (their trace callbacks)."""

    def __init__(self, index: RemoteIndex):
        self.statements: list[str] = []
        self._index = index
        self._hooked: set[int] = set()

    def hook(self) -> None:
        for db in self._index._all_readers:
            if db is not None and id(db) not in self._hooked:
                self._hooked.add(id(db))
                db.set_trace_callback(self.statements.append)


def test_published_keys_are_answered_from_memory_after_one_read(tmp_path):
    keys = filled_elsewhere(tmp_path, 40)
    index = open_index(tmp_path)
    reads = Reads(index)
    reads.hook()
    assert index.present(NS_A, keys[:16], PAGE) == [True] * 16
    assert len(reads.statements) == 1
    for _ in range(5):
        assert index.present(NS_A, keys[:16], PAGE) == [True] * 16
        assert index.present(NS_A, keys[4:12], PAGE) == [True] * 8
    assert len(reads.statements) == 1  # no more SQLite reads
    assert index.presence.hits == 10
    # A key never read, a miss, another length or namespace: asked of the index, answered right.
    unknown = key_ids(["nope"])
    assert index.present(NS_A, keys[:3] + unknown, PAGE) == [True, True, True, False]
    assert index.present(NS_A, keys[:3] + unknown, PAGE) == [True, True, True, False]  # misses not cached
    assert index.present(NS_A, keys[:2], PAGE + 1) == [False, False]
    assert index.present(NS_B, keys[:2], PAGE) == [False, False]
    assert len(reads.statements) == 5
    index.close()


def test_pages_this_process_removes_are_never_reported(tmp_path):
    index = open_index(tmp_path)
    keys = fill(index, NS_A, [f"k{i}" for i in range(300)])
    assert index.present(NS_A, keys, PAGE) == [True] * 300
    assert index.delete(NS_A, keys[:5]) == [True] * 5
    assert index.present(NS_A, keys[:8], PAGE) == [False] * 5 + [True] * 3
    assert index.present(NS_A, keys[5:], PAGE) == [True] * 295
    hits = index.presence.hits
    # Eviction between watermarks (a reservation that needs room) removes the oldest pages.
    result = reserve(index, 1, capacity=300 * PAGE, high=0.9, low=0.5)
    assert result.evicted > 0
    answers = index.present(NS_A, keys[5:], PAGE)
    assert sum(answers) == 295 - result.evicted and answers == sorted(answers)  # the oldest went
    assert index.clear(NS_A) == 295 - result.evicted
    assert index.present(NS_A, keys, PAGE) == [False] * 300
    assert index.presence.hits == hits  # every answer after a removal was read again
    index.close()


def test_a_page_another_index_removes_is_reported_at_most_recheck_s(tmp_path):
    mine = open_index(tmp_path, recheck_s=0.3)
    other = open_index(tmp_path, owner="other")
    keys = fill(mine, NS_A, [f"k{i}" for i in range(20)])
    assert mine.present(NS_A, keys, PAGE) == [True] * 20
    removed_at = time.monotonic()
    assert other.delete(NS_A, keys[:2]) == [True, True]
    while True:
        answer = mine.present(NS_A, keys[:4], PAGE)
        if answer == [False, False, True, True]:
            break
        assert answer == [True] * 4  # stale, while the cache is trusted
        assert time.monotonic() - removed_at < 0.3 + 5.0  # recheck_s, and a loaded machine's slack
        time.sleep(0.01)
    # After the counter moved, the cache starts again from the index's answers.
    assert mine.present(NS_A, keys[2:], PAGE) == [True] * 18
    assert mine.present(NS_A, keys[2:], PAGE) == [True] * 18
    hits = mine.presence.hits
    assert mine.present(NS_A, keys[2:], PAGE) == [True] * 18 and mine.presence.hits == hits + 1
    mine.close()
    other.close()


def test_recheck_zero_always_asks_the_index(tmp_path):
    mine = open_index(tmp_path, recheck_s=0.0)
    other = open_index(tmp_path, owner="other")
    keys = fill(mine, NS_A, ["a", "b"])
    assert mine.present(NS_A, keys, PAGE) == [True, True]
    other.delete(NS_A, keys[:1])
    assert mine.present(NS_A, keys, PAGE) == [False, True]
    assert mine.presence.hits == 0
    mine.close()
    other.close()


def test_a_removal_by_a_child_process_reaches_the_cache(tmp_path):
    mine = open_index(tmp_path, recheck_s=0.0)
    keys = fill(mine, NS_A, [f"k{i}" for i in range(10)])
    assert mine.present(NS_A, keys, PAGE) == [True] * 10
    run_in_child(tmp_path, (
        "from tests.test_remote_presence import open_index\n"
        "from tests.test_remote_index import NS_A\n"
        "from kvtier.index.keys import key_ids\n"
        "index = open_index(directory, owner='child')\n"
        "assert index.delete(NS_A, key_ids(['k3'])) == [True]\n"
        "index.close()\n"
    ))
    assert mine.present(NS_A, keys, PAGE) == [True] * 3 + [False] + [True] * 6
    mine.close()


def test_an_index_without_the_removal_counter_gains_it(tmp_path):
    index = open_index(tmp_path)
    keys = fill(index, NS_A, ["a", "b"])
    index.close()
    db = sqlite3.connect(str(tmp_path / "index.sqlite3"))
    db.execute("DELETE FROM meta WHERE name = 'removals'")  # as an earlier kvtier wrote it
    db.commit()
    db.close()
    again = open_index(tmp_path)
    assert again.present(NS_A, keys, PAGE) == [True, True]
    assert again.delete(NS_A, keys[:1]) == [True]
    assert again.present(NS_A, keys, PAGE) == [False, True]
    again.close()


def test_threads_removing_and_asking_never_see_a_removed_page(tmp_path):
    """Each remover deletes its key and then must never be told it is present, while other
    threads keep asking for the same keys (their reads race the removals into the cache)."""
    index = open_index(tmp_path)
    rounds, removers, askers = 60, 3, 3
    errors: list[str] = []
    stop = threading.Event()
    names = [[f"t{t}-{r}" for r in range(rounds)] for t in range(removers)]

    def remover(t):
        try:
            for r in range(rounds):
                key = fill(index, NS_A, [names[t][r]])
                for _ in range(3):
                    index.present(NS_A, key, PAGE)  # into the cache
                assert index.delete(NS_A, key) == [True]
                for _ in range(3):
                    if index.present(NS_A, key, PAGE) != [False]:
                        errors.append(f"{names[t][r]} reported after its removal")
        except Exception as exc:
            errors.append(repr(exc))

    def asker(t):
        all_keys = [k for row in names for k in key_ids(row)]
        i = 0
        while not stop.is_set():
            index.present(NS_A, all_keys[i % len(all_keys) : i % len(all_keys) + 8], PAGE)
            i += 5

    ask = [threading.Thread(target=asker, args=(t,)) for t in range(askers)]
    rem = [threading.Thread(target=remover, args=(t,)) for t in range(removers)]
    for t in ask + rem:
        t.start()
    for t in rem:
        t.join()
    stop.set()
    for t in ask:
        t.join()
    assert not errors, errors[:5]
    assert index.present(NS_A, [k for row in names for k in key_ids(row)], PAGE) == [False] * (rounds * removers)
    index.close()


def test_a_pool_asks_the_index_once_for_pages_only_the_remote_tier_holds(tmp_path):
    pytest.importorskip("nixl_cu13")
    from kvtier.tiers.remote import RemoteStore

    with pytest.raises(ValueError, match="presence_recheck_s"):
        RemoteStore(str(tmp_path / "bad"), namespace="ab", page_bytes=64, presence_recheck_s=-1)
    fmt = small_format()
    pool = TieredPool(fmt, device_pages=4, host_pages=4, write_policy="write_through",
                      remote=str(tmp_path), registry=CollectorRegistry())
    keys = prefix_keys(list(range(8 * 12)), 8, pool.namespace)
    gen = torch.Generator().manual_seed(3)
    for i in range(0, 12, 4):
        slots = pool.allocate(4)
        fill_random(pool, slots, gen)
        pool.commit(keys[i : i + 4], slots)
        pool.release(slots)
    assert pool.flush() == 0
    pool.evict(tier="device")
    pool.evict(tier="host")
    store = pool.remote
    assert pool.match(keys).remote == 12  # one index read
    before = store.stats()["contains_from_memory"]
    for _ in range(3):
        assert pool.match(keys).remote == 12
    assert store.stats()["contains_from_memory"] == before + 3
    store.delete(keys[6:7])  # this process removes one: the next match stops before it
    m = pool.match(keys)
    assert (m.remote, m.total) == (6, 6)
    pool.close()


def test_a_lookup_that_finds_a_key_gone_drops_it_whatever_the_counter(tmp_path):
    """A page removed without the counter moving (a kvtier older than the counter, say) is
    answered from memory only until a read of it misses."""
    index = open_index(tmp_path)
    keys = fill(index, NS_A, ["a", "b", "c"])
    assert index.present(NS_A, keys, PAGE) == [True] * 3
    db = sqlite3.connect(str(tmp_path / "index.sqlite3"))
    db.execute("DELETE FROM pages WHERE key = ?", (keys[1],))  # removed, counter untouched
    db.commit()
    db.close()
    assert index.present(NS_A, keys, PAGE) == [True] * 3  # stale: nothing said it moved
    assert index.lookup(NS_A, keys)[1] is None  # the read of the page misses
    assert index.present(NS_A, keys, PAGE) == [True, False, True]
    assert index.present(NS_A, keys[::2], PAGE) == [True, True]
    index.close()


def test_the_cache_holds_at_most_its_capacity(tmp_path):
    index = open_index(tmp_path)
    index.presence.capacity = 10
    keys = fill(index, NS_A, [f"k{i}" for i in range(25)])
    assert index.present(NS_A, keys[:8], PAGE) == [True] * 8
    assert index.present(NS_A, keys[:8], PAGE) == [True] * 8 and index.presence.hits == 1
    assert index.present(NS_A, keys[8:12], PAGE) == [True] * 4  # 12 > 10: emptied, then these 4
    assert index.present(NS_A, keys[8:12], PAGE) == [True] * 4 and index.presence.hits == 2
    assert index.present(NS_A, keys[:8], PAGE) == [True] * 8 and index.presence.hits == 2  # asked again
    assert index.present(NS_A, keys, PAGE) == [True] * 25  # more than it holds: nothing kept
    assert index.present(NS_A, keys[:1], PAGE) == [True] and index.presence.hits == 2
    assert index.presence._size <= 10
    index.close()
