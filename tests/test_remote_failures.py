"""RemoteStore failures on real files and real NIXL: corrupt records, lost or truncated segment
files, failed and timed-out requests, a writer killed before publication, raced reads.

Every failure is a counted miss that leaves the index at once, and nothing else is lost."""

from __future__ import annotations

import os
import sqlite3
import threading
import time

import pytest
import torch

pytest.importorskip("nixl_cu13")

from tests.test_remote_store import (  # noqa: E402
    PAGE,
    flip_byte,
    open_store,  # noqa: F401 (fixture)
    poisoned,
    random_pages,
    record_offsets,
    run_child,
    same,
)


def test_a_deleted_or_truncated_segment_unpublishes_what_it_lost_and_nothing_else(open_store):
    store = open_store(reuse_delay_s=0.0)  # 1 MiB segments: 63 slots of 16 KiB each
    keys = [f"k{i}" for i in range(100)]
    data = random_pages(100, seed=31)
    assert all(store.put(keys, data))
    segs = {}
    for key in keys:
        path, _, payload = record_offsets(store, key)
        segs.setdefault(path, []).append((key, payload))
    assert len(segs) == 2
    (first, in_first), (second, in_second) = sorted(segs.items())
    # Cut the first file inside the record of its 41st slot; delete the second.
    in_first.sort(key=lambda kp: kp[1])
    cut = in_first[40][1] + PAGE // 2
    os.truncate(first, cut)
    os.unlink(second)
    lost = {k for k, p in in_first if p + PAGE > cut} | {k for k, _ in in_second}
    assert len(lost) == len(in_first) - 40 + len(in_second)
    out = poisoned(100)
    found = store.get(keys, out)
    assert found == [k not in lost for k in keys]
    assert same([o for o, k in zip(out, keys) if k not in lost],
                [d for d, k in zip(data, keys) if k not in lost])
    assert store.contains(keys) == [k not in lost for k in keys]  # right after the failed get
    s = store.stats()
    assert (s["read_failures"], s["corrupt_reads"], s["pages"]) == (len(lost), 0, 100 - len(lost))
    other = open_store()  # another handle, which never had the files open, agrees
    assert other.contains(keys) == [k not in lost for k in keys]
    # Writes into the freed slots lay both files out again and the lost pages come back.
    lost_keys = sorted(lost)
    assert all(store.put(lost_keys, [data[keys.index(k)] for k in lost_keys]))
    out = poisoned(100)
    assert other.get(keys, out) == [True] * 100 and same(out, data)
    assert os.path.getsize(first) == os.path.getsize(second) > cut


def test_corrupt_payload_or_header_is_a_counted_miss_and_dropped(open_store):
    store = open_store()
    data = random_pages(4, seed=5)
    keys = ["k0", "k1", "k2", "k3"]
    store.put(keys, data)
    path, _, payload = record_offsets(store, "k1")
    flip_byte(path, payload + PAGE // 2)
    path, header, _ = record_offsets(store, "k2")
    flip_byte(path, header)  # the magic
    out = poisoned(4)
    assert store.get(keys, out) == [True, False, False, True]
    assert same([out[0], out[3]], [data[0], data[3]])
    s = store.stats()
    assert (s["corrupt_reads"], s["raced_reads"], s["pages"]) == (2, 0, 2)
    assert store.contains(keys) == [True, False, False, True]
    assert store.put(["k1"], [data[1]]) == [True]  # rewritten into a fresh slot
    assert store.get(["k1"], out[:1]) == [True] and torch.equal(out[0], data[1])


def test_a_writer_killed_before_publishing_leaves_nothing_visible(open_store, tmp_path):
    directory = tmp_path / "store"
    marker = tmp_path / "durable"
    child = run_child("crash", directory, marker)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert child.poll() is None, child.communicate()[0]
        assert time.monotonic() < deadline, "the child never reached publication"
        time.sleep(0.05)
    child.kill()
    child.wait()
    store = open_store(reuse_delay_s=0.0)  # opening reclaims the dead writer's slots
    keys = [f"crash-{i}" for i in range(8)]
    written = random_pages(8, seed=7)
    segment = (directory / "segments" / "00000001.seg").read_bytes()
    assert written[0].numpy().tobytes() in segment  # the bytes were durable, not published
    assert store.contains(keys) == [False] * 8
    assert store.get(keys, poisoned(8)) == [False] * 8
    s = store.stats()
    assert (s["reserved_slots"], s["free_slots"], s["pages"]) == (0, 8, 0)
    data = random_pages(8, seed=8)
    assert all(store.put(keys, data))
    assert store.stats()["free_slots"] == 0  # the reclaimed slots were reused
    out = poisoned(8)
    assert store.get(keys, out) == [True] * 8 and same(out, data)


def test_injected_errors_and_timeouts_fail_cleanly(open_store):
    store = open_store(timeout_s=0.3)
    base = random_pages(4, seed=9)
    keys = ["a", "b", "c", "d"]
    assert all(store.put(keys, base))
    other = random_pages(4, seed=10)
    for mode in ("error", "error_after_io", "timeout"):
        store.faults.arm(mode, op="WRITE")
        start = time.monotonic()
        assert store.put(keys, other) == [False] * 4  # an overwrite that must not land
        if mode == "timeout":
            assert time.monotonic() - start >= 0.3
        assert store.put(["new"], other[:1]) == [True]  # the fault was spent
        store.delete(["new"])
    assert store.stats()["write_failures"] == 12
    out = poisoned(4)
    assert store.get(keys, out) == [True] * 4 and same(out, base)  # no failed write landed
    for mode in ("error", "error_after_io", "timeout"):
        store.faults.arm(mode, op="READ")
        assert store.get(keys, poisoned(4)) == [False] * 4
        assert store.contains(keys) == [False] * 4  # a failed read leaves the index at once
        assert all(store.put(keys, base))
        out = poisoned(4)
        assert store.get(keys, out) == [True] * 4 and same(out, base)
    s = store.stats()
    assert (s["read_failures"], s["corrupt_reads"], s["reserved_slots"]) == (12, 0, 0)
    assert (s["pages"], s["write_failures"]) == (4, 12)
    store.faults.arm("error", count=5)
    store.faults.disarm()
    assert store.put(["after"], other[:1]) == [True]


def test_a_read_racing_slot_reuse_is_a_miss_not_corruption(open_store, monkeypatch):
    reader = open_store(reuse_delay_s=0.0)
    # a capacity too small for spare slots: the slot "k" frees is the next one handed out
    writer = open_store(reuse_delay_s=0.0, capacity_bytes=32 * PAGE)
    assert writer.stats()["spare_slots"] == 0
    v1, v2, v3 = random_pages(3, seed=15)
    writer.put(["k"], [v1])
    looked_up = reader._index.lookup

    def lookup_then_race(ns, keys):
        found = looked_up(ns, keys)
        writer.put(["k"], [v2])  # frees k's old slot...
        writer.put(["other"], [v3])  # ...which is reused at once
        return found

    monkeypatch.setattr(reader._index, "lookup", lookup_then_race)
    assert reader.get(["k"], poisoned(1)) == [False]
    monkeypatch.undo()
    s = reader.stats()
    assert (s["raced_reads"], s["corrupt_reads"]) == (1, 0)
    out = poisoned(1)
    assert reader.get(["k"], out) == [True] and torch.equal(out[0], v2)


@pytest.mark.timeout(120)  # a watchdog: without set_timeout the request below waits an hour
def test_set_timeout_shortens_a_hung_request_and_close_waits_for_it(open_store):
    store = open_store(timeout_s=3600.0)
    data = random_pages(2, seed=51)
    assert all(store.put(["a", "b"], data))
    posted = threading.Event()
    store.faults.arm("timeout", op="READ")  # the request is posted and never reported done
    store.faults.mid_request = lambda op: posted.set()
    results = []
    reader = threading.Thread(target=lambda: results.append(store.get(["a", "b"], poisoned(2))))
    reader.start()
    posted.wait()
    store.set_timeout(0.2)
    store.close()
    assert results == [[False, False]]  # close returned only after the call in flight ended
    reader.join()
    with pytest.raises(RuntimeError, match="closed"):
        store.get(["a"], poisoned(1))
    with pytest.raises(ValueError, match="timeout_s 0; expected a number of seconds > 0"):
        store.set_timeout(0)


@pytest.mark.timeout(120)
def test_a_held_index_lock_fails_a_put_within_the_store_timeout(open_store):
    store = open_store(timeout_s=0.2)
    other = sqlite3.connect(os.path.join(store.directory, "index.sqlite3"), isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process holds SQLite's write lock
    try:
        assert store.put(["a"], random_pages(1, seed=52)) == [False]
    finally:
        other.execute("ROLLBACK")
        other.close()
    s = store.stats()
    assert (s["write_failures"], s["reserved_slots"], s["pages"]) == (1, 0, 0)
    assert store.put(["a"], random_pages(1, seed=52)) == [True]
