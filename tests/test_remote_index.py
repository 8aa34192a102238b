"""RemoteIndex on a real SQLite file: bounded transactions, O(1) counters that stay exact, the
slot-state invariant, and refusal of an index of another schema."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import threading

import pytest

from kvtier.index.keys import key_ids
from kvtier.tiers.remote import StoreVersionMismatch
from kvtier.tiers.remote.index import RemoteIndex
from kvtier.tiers.remote.index_publish import PublishEntry
from kvtier.tiers.remote.index_reads import MAX_READERS
from kvtier.tiers.remote.index_slots import SlotRef
from kvtier.tiers.remote.index_transactions import ROWS_PER_TRANSACTION
from kvtier.tiers.remote.owners import make_owner
from kvtier.tiers.remote.records import namespace_fingerprint

PAGE = 4096
NS_A = namespace_fingerprint("aa")
NS_B = namespace_fingerprint("bb")


def open_index(tmp_path, owner="test", reuse_delay_s=0.0) -> RemoteIndex:
    return RemoteIndex(
        str(tmp_path / "index.sqlite3"), owner=make_owner(owner), reuse_delay_s=reuse_delay_s,
        reservation_lease_s=600.0, busy_timeout_s=10.0,
    )


def filled_elsewhere(tmp_path, count: int) -> list[bytes]:
    """Keys ``k0..`` published by another index on the same file (which then closes): an index
    remembers what it publishes itself, so only these make its reads ask SQLite."""
    writer = open_index(tmp_path, owner="writer")
    keys = fill(writer, NS_A, [f"k{i}" for i in range(count)])
    writer.close()
    return keys


def reserve(index, count, capacity=None, high=1.0, low=1.0):
    return index.reserve(
        count, length=PAGE, slot_stride=PAGE, slots_per_segment=1000, capacity_bytes=capacity,
        high_watermark=high, low_watermark=low, create_segment=lambda *a: None,
    )


def fill(index, ns, names):
    keys = key_ids(names)
    slots = reserve(index, len(keys)).slots
    assert index.publish(ns, [PublishEntry(k, s, PAGE, 7, 1) for k, s in zip(keys, slots)]) == [True] * len(keys)
    return keys


class Transactions:
    """Statements of the index's write connection, grouped by transaction."""

    def __init__(self, index: RemoteIndex):
        self.groups: list[list[str]] = []
        index._db.set_trace_callback(self._seen)

    def _seen(self, statement: str) -> None:
        if statement.startswith("BEGIN"):
            self.groups.append([])
        elif self.groups and statement != "COMMIT":
            self.groups[-1].append(statement)

    def rows(self, prefix: str) -> list[int]:
        """How many statements starting with ``prefix`` each transaction ran."""
        return [sum(s.startswith(prefix) for s in group) for group in self.groups]


def exact_counts(index: RemoteIndex, ns: bytes) -> dict[str, int]:
    """The counters, recounted the slow way."""
    db = index._db
    pages, used = db.execute("SELECT COUNT(*), COALESCE(SUM(length), 0) FROM pages WHERE ns = ?", (ns,)).fetchone()
    store_pages, store_used = db.execute("SELECT COUNT(*), COALESCE(SUM(length), 0) FROM pages").fetchone()
    return {
        "pages": pages, "used_bytes": used, "store_pages": store_pages, "store_used_bytes": store_used,
        "reserved_slots": db.execute("SELECT COUNT(*) FROM reservations").fetchone()[0],
        "free_slots": db.execute("SELECT COUNT(*) FROM free_slots").fetchone()[0],
        "segments": db.execute("SELECT COUNT(*) FROM segments").fetchone()[0],
    }


def test_a_large_eviction_runs_in_bounded_transactions(tmp_path):
    index = open_index(tmp_path)
    fill(index, NS_A, [f"a{i}" for i in range(700)])
    trace = Transactions(index)
    result = reserve(index, 1, capacity=800 * PAGE, high=0.8, low=0.5)  # 701 > 640: down to 399
    assert result.evicted == 700 - 399 and len(result.slots) == 1
    per_transaction = [n for n in trace.rows("DELETE FROM pages") if n]
    assert sum(per_transaction) == 301
    assert len(per_transaction) >= -(-301 // ROWS_PER_TRANSACTION) >= 2
    assert max(per_transaction) <= ROWS_PER_TRANSACTION
    assert index.stats(NS_A)["pages"] == 399


@pytest.mark.parametrize("operation", ["publish", "delete", "clear", "flush_touches", "release"])
def test_every_batch_operation_touches_a_bounded_number_of_rows_per_transaction(tmp_path, operation):
    index = open_index(tmp_path)
    names = [f"k{i}" for i in range(3 * ROWS_PER_TRANSACTION + 5)]
    if operation == "publish":
        keys = key_ids(names)
        slots = reserve(index, len(keys)).slots
        trace = Transactions(index)
        index.publish(NS_A, [PublishEntry(k, s, PAGE, 7, 1) for k, s in zip(keys, slots)])
        counted = trace.rows("INSERT INTO pages")
    elif operation == "release":
        trace = Transactions(index)
        slots = reserve(index, len(names)).slots
        index.release(slots)
        counted = trace.rows("INSERT INTO free_slots")
        assert max(trace.rows("INSERT INTO reservations")) <= ROWS_PER_TRANSACTION
    else:
        keys = fill(index, NS_A, names)
        trace = Transactions(index)
        if operation == "delete":
            assert index.delete(NS_A, keys) == [True] * len(keys)
        elif operation == "clear":
            assert index.clear(NS_A) == len(keys)
        else:
            index.touch(NS_A, keys)
            index.flush_touches()
        counted = trace.rows("UPDATE pages" if operation == "flush_touches" else "DELETE FROM pages")
    assert sum(counted) == len(names)
    assert max(counted) <= ROWS_PER_TRANSACTION
    assert exact_counts(index, NS_A) == index.stats(NS_A)


def test_touch_asks_for_one_flush_until_a_flush_takes_the_hits(tmp_path, monkeypatch):
    monkeypatch.setattr("kvtier.tiers.remote.index.TOUCH_FLUSH_PAGES", 4)
    index = open_index(tmp_path)
    keys = fill(index, NS_A, [f"k{i}" for i in range(12)])

    def last_access() -> dict[bytes, int]:
        return dict(index._db.execute("SELECT key, last_access FROM pages WHERE ns = ?", (NS_A,)))

    before = last_access()
    asked = [index.touch(NS_A, [key]) for key in keys[:9]]
    # The 4th hit asks; the hits after it ride on that flush instead of asking again.
    assert asked == [False, False, False, True, False, False, False, False, False]
    index.flush_touches()
    after = last_access()
    assert all(after[k] > before[k] for k in keys[:9])
    assert all(after[k] == before[k] for k in keys[9:])
    # Once a flush took them, the next due batch asks again.
    assert [index.touch(NS_A, [key]) for key in keys[9:]] + [index.touch(NS_A, [keys[0]])] == [False, False, False, True]
    index.close()


def test_touches_from_many_threads_all_land_with_few_flushes(tmp_path, monkeypatch):
    monkeypatch.setattr("kvtier.tiers.remote.index.TOUCH_FLUSH_PAGES", 16)
    index = open_index(tmp_path)
    keys = fill(index, NS_A, [f"k{i}" for i in range(400)])
    before = dict(index._db.execute("SELECT key, last_access FROM pages WHERE ns = ?", (NS_A,)))
    asked = []
    barrier = threading.Barrier(4)

    def hits(part: list[bytes]) -> None:
        barrier.wait()
        for key in part:
            if index.touch(NS_A, [key]):
                asked.append(key)
                index.flush_touches_later()

    threads = [threading.Thread(target=hits, args=(keys[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    index.flush_touches()
    index._background.submit(lambda: None).result()  # flushes queued before this one have run
    after = dict(index._db.execute("SELECT key, last_access FROM pages WHERE ns = ?", (NS_A,)))
    assert all(after[k] > before[k] for k in keys)  # every hit was written
    # At most one request per 16 hits (one per flush that took hits), never one per hit.
    assert 1 <= len(asked) <= len(keys) // 16
    index.close()


def test_stats_read_counters_only_and_they_stay_exact(tmp_path):
    index = open_index(tmp_path)
    a = fill(index, NS_A, [f"a{i}" for i in range(300)])
    b = fill(index, NS_B, [f"b{i}" for i in range(200)])
    index.delete(NS_A, a[:50])
    index.publish(NS_B, [PublishEntry(b[0], reserve(index, 1).slots[0], PAGE, 9, 2)])  # overwrite
    assert index.drop_current(NS_B, [(b[1], 1), (b[2], 99)]) == [True, False]
    reserve(index, 40, capacity=500 * PAGE, high=0.9, low=0.6)  # evicts across namespaces
    dead = open_index(tmp_path, owner="dead")
    dead.reserve(
        5, length=PAGE, slot_stride=PAGE, slots_per_segment=1000, capacity_bytes=None,
        high_watermark=1.0, low_watermark=1.0, create_segment=lambda *a: None,
    )
    dead.owner = dead.owner.replace(f"|{os.getpid()}|", "|999999999|")  # its writer is gone
    with index._transaction() as db:
        db.execute("UPDATE reservations SET owner = ? WHERE owner LIKE '%|dead'", (dead.owner,))
    assert index.reclaim() == 5
    index.clear(NS_A)
    seen: list[str] = []
    index._reader.set_trace_callback(seen.append)
    for ns in (NS_A, NS_B):
        assert index.stats(ns) == exact_counts(index, ns)
    assert seen and not any("FROM pages" in s for s in seen), seen
    s = index.stats(NS_B)
    assert s["store_pages"] == s["pages"] > 0
    dead.close()
    index.close()


def test_an_index_of_another_schema_is_refused_with_the_path_and_what_to_do(tmp_path):
    path = tmp_path / "index.sqlite3"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL)")
    db.execute("INSERT INTO meta VALUES ('schema_version', 1)")
    db.commit()
    db.close()
    with pytest.raises(StoreVersionMismatch) as raised:
        open_index(tmp_path)
    message = str(raised.value)
    assert str(path) in message and "schema 1" in message and "schema 2" in message
    assert "Move or delete" in message


def test_an_old_store_is_refused_by_remote_store_too(tmp_path):
    pytest.importorskip("nixl_cu13")
    from kvtier.tiers.remote import RemoteStore

    test_an_index_of_another_schema_is_refused_with_the_path_and_what_to_do(tmp_path)
    with pytest.raises(StoreVersionMismatch, match=str(tmp_path)):
        RemoteStore(tmp_path, namespace="ab", page_bytes=PAGE)
    # Nothing was created or changed by the refused open.
    assert sorted(os.listdir(tmp_path)) == ["index.sqlite3"]


def run_in_child(tmp_path, body: str) -> None:
    """Run `body` in a child Python process with the repository importable and `directory` (a
    pathlib.Path) set to tmp_path."""
    code = "import sys, os, pathlib\nsys.path.insert(0, sys.argv[2])\ndirectory = pathlib.Path(sys.argv[1])\n" + body
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code, str(tmp_path), repo], check=True)


def test_reservations_of_a_killed_process_are_reclaimed(tmp_path):
    run_in_child(tmp_path, (
        "from tests.test_remote_index import open_index, reserve\n"
        "index = open_index(directory, owner='child')\n"
        "reserve(index, 7)\n"
        "os._exit(0)\n"
    ))
    index = open_index(tmp_path)
    assert index.stats(NS_A)["reserved_slots"] == 7
    assert index.reclaim() == 7
    assert index.stats(NS_A) == exact_counts(index, NS_A)
    assert exact_counts(index, NS_A)["free_slots"] == 7
    assert reserve(index, 7).slots == [SlotRef(1, i) for i in range(7)]  # reused, no new slots


def test_a_read_in_progress_does_not_hold_up_another_threads_read(tmp_path):
    """A match asks the index beside a loader's lookups: a read stalled inside SQLite (a progress
    handler that waits) leaves other threads' reads free to run on a reader connection of their own."""
    import threading

    keys = filled_elsewhere(tmp_path, 64)  # this index must read them: it did not publish them
    index = open_index(tmp_path)
    entered, release = threading.Event(), threading.Event()
    stalled = []

    def stall():  # reads run on the index's read threads: the first read to get here stalls
        if not entered.is_set():
            entered.set()
            release.wait(30)
        return 0

    index._reader.set_progress_handler(stall, 1)
    reader = threading.Thread(target=lambda: stalled.append(index.present(NS_A, keys, PAGE)), name="stalled-reader")
    reader.start()
    try:
        assert entered.wait(30), "the first read never reached SQLite"
        answers = []
        other = threading.Thread(target=lambda: answers.append((
            index.present(NS_A, keys[:16], PAGE), index.lookup(NS_A, keys[:4]), index.stats(NS_A)["pages"])))
        other.start()
        other.join(30)
        assert not other.is_alive(), "a read waited for another thread's read"
        present, located, pages = answers[0]
        assert present == [True] * 16 and all(loc is not None for loc in located) and pages == 64
        assert not stalled  # the first read is still inside SQLite
    finally:
        release.set()
        reader.join(30)
    assert stalled == [[True] * 64]
    assert len(index._all_readers) == 2  # one more connection, kept for later reads
    index._reader.set_progress_handler(None, 1)
    index.close()


def test_readers_on_many_threads_beside_a_writer_see_every_published_page(tmp_path):
    import threading

    index = open_index(tmp_path)
    stable = fill(index, NS_A, [f"s{i}" for i in range(200)])
    stop, wrong, reads = threading.Event(), [], [0]

    def read():
        while not stop.is_set():
            if index.present(NS_A, stable, PAGE) != [True] * len(stable):
                wrong.append("present")
            if any(loc is None for loc in index.lookup(NS_A, stable[:32])):
                wrong.append("lookup")
            reads[0] += 1

    threads = [threading.Thread(target=read) for _ in range(6)]
    for t in threads:
        t.start()
    for round_ in range(20):
        fill(index, NS_B, [f"w{round_}-{i}" for i in range(50)])
    stop.set()
    for t in threads:
        t.join(60)
    assert not wrong and reads[0] > 0
    assert index.stats(NS_B)["pages"] == 1000
    # Six reading threads and the writer's stats share at most MAX_READERS connections.
    assert 1 <= len(index._all_readers) <= MAX_READERS and None not in index._all_readers
    index.close()


def test_reads_beyond_max_readers_wait_for_a_free_connection(tmp_path):
    """MAX_READERS connections bound the index's memory (each caches up to CACHE_KIB): with all of
    them held by reads in progress, one more read waits, and runs once one comes free."""
    import contextlib
    import threading

    keys = filled_elsewhere(tmp_path, 32)
    index = open_index(tmp_path)
    release = threading.Event()
    holding = threading.Barrier(MAX_READERS + 1)

    def hold():
        with index._reading():
            holding.wait(30)
            release.wait(30)

    holders = [threading.Thread(target=hold) for _ in range(MAX_READERS)]
    for t in holders:
        t.start()
    holding.wait(30)
    answers = []
    late = threading.Thread(target=lambda: answers.append(index.present(NS_A, keys, PAGE)))
    late.start()
    late.join(0.5)
    try:
        assert late.is_alive() and not answers, "a read past MAX_READERS opened another connection"
        assert len(index._all_readers) == MAX_READERS
    finally:
        release.set()
        for t in holders:
            t.join(30)
        late.join(30)
    assert answers == [[True] * 32]
    assert len(index._all_readers) == MAX_READERS
    with contextlib.closing(index):
        assert index.present(NS_A, keys[:3], PAGE) == [True] * 3


def test_a_release_the_database_refuses_is_done_by_the_next_reserve(tmp_path):
    """A commit refused (here another process holds SQLite's write lock past the busy timeout,
    as a full disk refuses one) leaves the slots reserved; the next reserve releases them, in
    the same process."""
    import sqlite3

    index = open_index(tmp_path)
    held = reserve(index, 5).slots
    index.set_busy_timeout(0.05)
    other = sqlite3.connect(tmp_path / "index.sqlite3", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    with pytest.raises(sqlite3.OperationalError):
        index.release(held)
    other.execute("ROLLBACK")
    other.close()
    assert index.stats(NS_A)["reserved_slots"] == 5
    index.set_busy_timeout(10.0)
    again = reserve(index, 2).slots
    assert index.stats(NS_A)["reserved_slots"] == 2
    assert index.stats(NS_A) == exact_counts(index, NS_A)
    index.release(again)
    index.close()


def test_a_small_publication_replaces_frees_and_skips_exactly_as_a_large_one(tmp_path):
    """Publications of a few pages take their own short transaction: a key published before
    gives its previous slot back, a reservation this writer no longer owns is not published,
    and the counters, the LRU clock and the slot states stay exact."""
    index = open_index(tmp_path)
    keys = fill(index, NS_A, [f"p{i}" for i in range(3)])
    before = {key: index.lookup(NS_A, [key])[0] for key in keys}
    fresh = key_ids(["fresh"])[0]
    slots = reserve(index, 3).slots
    with index._transaction() as db:  # the third reservation was reclaimed meanwhile
        db.execute("DELETE FROM reservations WHERE seg = ? AND slot = ?", tuple(slots[2]))
        index._free(db, [tuple(slots[2])], 0.0)
    clock = index._meta(index._db, "clock")
    entries = [
        PublishEntry(keys[0], slots[0], PAGE, 11, 5),  # replaces p0
        PublishEntry(fresh, slots[1], PAGE, 12, 6),
        PublishEntry(keys[1], slots[2], PAGE, 13, 7),  # not ours any more: p1 stays as it was
    ]
    assert index.publish(NS_A, entries) == [True, True, False]
    assert index.lookup(NS_A, [keys[0], fresh, keys[1], keys[2]]) == [
        (slots[0].seg, slots[0].slot, PAGE, 11, 5), (slots[1].seg, slots[1].slot, PAGE, 12, 6),
        before[keys[1]], before[keys[2]],
    ]
    db = index._db
    free = set(db.execute("SELECT seg, slot FROM free_slots"))
    assert (before[keys[0]].seg, before[keys[0]].slot) in free
    accesses = dict(db.execute("SELECT key, last_access FROM pages WHERE key IN (?, ?)", (keys[0], fresh)))
    assert sorted(accesses.values()) == [clock + 1, clock + 2]
    assert index._meta(db, "clock") == clock + 2
    assert index.stats(NS_A) == exact_counts(index, NS_A)
    counts = exact_counts(index, NS_A)
    used = db.execute("SELECT SUM(next_unused) FROM segments").fetchone()[0]
    assert used == counts["store_pages"] + counts["reserved_slots"] + counts["free_slots"]
    index.close()
