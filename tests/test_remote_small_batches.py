"""Small calls of the remote store: batches of up to SMALL_BATCH_PAGES records read with system
calls on the segment files, at locations this process remembers (no SQLite read). Real
segment files and real NIXL; bytes compared exactly, destinations poisoned first."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("nixl_cu13")

from kvtier.tiers.remote.small_batches import SMALL_BATCH_PAGES  # noqa: E402
from test_remote_direct_io import PAGE, aligned_pages, fill_random, open_store, poison  # noqa: E402,F401


def segment_files(store) -> list[str]:
    directory = os.path.join(store.directory, "segments")
    return [os.path.join(directory, name) for name in sorted(os.listdir(directory))]


@pytest.mark.parametrize("direct_io", [True, False])
@pytest.mark.parametrize("offset", [0, 64])  # aligned pages go zero-copy, others through a block
def test_small_reads_round_trip_without_nixl_or_sqlite(open_store, direct_io, offset):
    store = open_store(direct_io=direct_io)
    _region, pages = aligned_pages(2 * SMALL_BATCH_PAGES, offset)
    fill_random(pages[:SMALL_BATCH_PAGES], seed=11)
    keys = [f"s{i}" for i in range(SMALL_BATCH_PAGES)]
    assert store.put(keys, pages[:SMALL_BATCH_PAGES]) == [True] * SMALL_BATCH_PAGES
    out = pages[SMALL_BATCH_PAGES:]
    for count in (1, SMALL_BATCH_PAGES):
        poison(out)
        assert store.get(keys[:count], out[:count]) == [True] * count
        assert all(torch.equal(pages[i], out[i]) for i in range(count))
    stats = store.stats()
    assert stats["small_batch_reads"] == 2 and stats["locations_from_memory"] == 2
    assert stats["hits"] == 1 + SMALL_BATCH_PAGES and stats["stale_locations"] == 0


def test_pieces_of_a_page_are_read_back_in_order(open_store):
    store = open_store()
    source = torch.randint(0, 256, (PAGE,), dtype=torch.uint8)
    assert store.put(["k"], [source]) == [True]
    dest = torch.full((PAGE + 3,), 0xA5, dtype=torch.uint8)
    pieces = [dest[0:1000], dest[1001:PAGE // 2 + 1], dest[PAGE // 2 + 3 : PAGE + 3]]
    lengths = [p.numel() for p in pieces]
    assert sum(lengths) == PAGE
    assert store.get(["k"], [pieces]) == [True]
    assert torch.equal(torch.cat(pieces), source)
    assert int(dest[1000]) == 0xA5 and int(dest[PAGE // 2 + 1]) == 0xA5  # gaps untouched
    assert store.stats()["small_batch_reads"] == 1


@pytest.mark.parametrize("direct_io", [True, False])
def test_a_corrupt_record_read_from_memory_is_a_miss_and_leaves_the_index(open_store, direct_io):
    store = open_store(direct_io=direct_io)
    _region, pages = aligned_pages(2)
    fill_random(pages[:1], seed=5)
    assert store.put(["c"], pages[:1]) == [True]
    (path,) = segment_files(store)
    with open(path, "r+b") as f:  # flip one payload byte of the only record
        data = f.read()
        at = data.index(bytes(pages[0][:64].numpy()))
        f.seek(at + 100)
        f.write(bytes([data[at + 100] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    poison(pages[1:])
    assert store.get(["c"], pages[1:]) == [False]
    stats = store.stats()
    assert stats["stale_locations"] == 1 and stats["corrupt_reads"] == 1 and stats["hits"] == 0
    assert store.contains(["c"]) == [False]


def test_a_slot_reused_by_another_process_is_read_again_from_the_index(open_store, tmp_path):
    mine = open_store(reuse_delay_s=0.0, presence_recheck_s=3600.0)
    other = open_store(reuse_delay_s=0.0)
    _region, pages = aligned_pages(4)
    fill_random(pages[:3], seed=9)
    assert mine.put(["k"], pages[:1]) == [True]  # remembered with its location
    assert other.delete(["k"]) == [True]
    assert other.put(["j"], pages[1:2]) == [True]  # into k's old slot
    assert other.put(["k"], pages[2:3]) == [True]  # k again, elsewhere, other bytes
    poison(pages[3:])
    assert mine.get(["k"], pages[3:]) == [True]
    assert torch.equal(pages[3], pages[2])  # the current page, never j's nor k's old bytes
    stats = mine.stats()
    assert stats["stale_locations"] == 1 and stats["corrupt_reads"] == 0 and stats["raced_reads"] == 0
    assert other.get(["j"], pages[3:]) == [True] and torch.equal(pages[3], pages[1])


@pytest.mark.parametrize("direct_io", [True, False])
@pytest.mark.parametrize("offset", [0, 64])  # aligned pages go zero-copy, others through a block
def test_small_writes_are_durable_and_read_back_through_nixl_and_a_new_store(open_store, direct_io, offset):
    """Puts of up to SMALL_BATCH_PAGES pages go through pwritev + fdatasync: a batch read
    through NIXL (more than SMALL_BATCH_PAGES pages) and a store opened afterwards read every
    byte back."""
    store = open_store(direct_io=direct_io)
    total = 3 * SMALL_BATCH_PAGES
    _region, pages = aligned_pages(2 * total, offset)
    fill_random(pages[:total], seed=23)
    keys = [f"w{i}" for i in range(total)]
    for start, count in ((0, 1), (1, SMALL_BATCH_PAGES), (1 + SMALL_BATCH_PAGES, total - 1 - SMALL_BATCH_PAGES)):
        assert store.put(keys[start : start + count], pages[start : start + count]) == [True] * count
    stats = store.stats()
    assert stats["small_batch_writes"] == 2 and stats["write_failures"] == 0
    out = pages[total:]
    poison(out)
    assert store.get(keys, out) == [True] * total  # one NIXL batch
    assert all(torch.equal(pages[i], out[i]) for i in range(total))
    directory = store.directory
    store.close()
    again = open_store(directory, direct_io=direct_io)
    poison(out)
    assert again.get(keys, out) == [True] * total
    assert all(torch.equal(pages[i], out[i]) for i in range(total))


def test_pieces_of_a_page_are_written_in_order(open_store):
    store = open_store()
    dest = torch.randint(0, 256, (PAGE + 3,), dtype=torch.uint8)
    pieces = [dest[0:1000], dest[1001 : PAGE // 2 + 1], dest[PAGE // 2 + 3 : PAGE + 3]]
    assert store.put(["p"], [pieces]) == [True]
    assert store.stats()["small_batch_writes"] == 1
    out = torch.full((SMALL_BATCH_PAGES + 1, PAGE), 0xA5, dtype=torch.uint8)
    filler = torch.randint(0, 256, (SMALL_BATCH_PAGES, PAGE), dtype=torch.uint8)
    assert all(store.put([f"f{i}" for i in range(SMALL_BATCH_PAGES)], list(filler)))
    found = store.get(["p"] + [f"f{i}" for i in range(SMALL_BATCH_PAGES)], list(out))  # through NIXL
    assert found == [True] * (SMALL_BATCH_PAGES + 1)
    assert torch.equal(out[0], torch.cat(pieces)) and torch.equal(out[1:], filler)


def test_a_write_fault_sends_a_small_put_through_nixl(open_store):
    store = open_store()
    store.faults.arm("error", count=1, op="WRITE")
    assert store.put(["x"], [torch.randint(0, 256, (PAGE,), dtype=torch.uint8)]) == [False]
    stats = store.stats()
    assert (stats["small_batch_writes"], stats["write_failures"], stats["reserved_slots"]) == (0, 1, 0)


def test_small_puts_take_spare_reservations_and_close_gives_them_back(open_store):
    """A small put reserves SPARE_SLOTS more slots in its reservation's transaction; the next
    small puts use them (one index transaction each); close releases what is left."""
    from kvtier.tiers.remote.store_steps import SPARE_SLOTS

    store = open_store(capacity_bytes=1 << 30)
    count = SPARE_SLOTS + 3
    source = torch.randint(0, 256, (count, PAGE), dtype=torch.uint8)
    keys = [f"sp{i}" for i in range(count)]
    assert store.put(keys[:1], [source[0]]) == [True]
    stats = store.stats()
    assert (stats["spare_slots"], stats["reserved_slots"]) == (SPARE_SLOTS, 0)
    for i in range(1, count):
        assert store.put([keys[i]], [source[i]]) == [True]
    stats = store.stats()
    assert (stats["pages"], stats["reserved_slots"], stats["write_failures"]) == (count, 0, 0)
    assert stats["spare_slots"] == 2 * SPARE_SLOTS + 2 - count
    out = torch.full((count, PAGE), 0xA5, dtype=torch.uint8)
    assert store.get(keys, list(out)) == [True] * count and torch.equal(out, source)
    directory = store.directory
    store.close()
    again = open_store(directory, capacity_bytes=1 << 30)
    stats = again.stats()
    assert (stats["reserved_slots"], stats["spare_slots"], stats["pages"]) == (0, 0, count)
    assert stats["free_slots"] == 2 * SPARE_SLOTS + 2 - count  # the spares went back


@pytest.mark.parametrize("offset", [0, 64])
def test_a_small_put_stays_in_the_page_cache_and_a_small_get_reads_it_there_or_from_the_device(open_store, offset):
    """A small put writes through the page cache (its payload stays resident); a small get
    reads it back exactly from there, and once the cache is dropped from the device with
    O_DIRECT (which leaves nothing resident)."""
    from test_remote_direct_io import drop_cache, resident_bytes
    from test_remote_store import record_offsets

    store = open_store()
    assert store.stats()["direct_io"] == 1
    _region, pages = aligned_pages(2, offset)
    fill_random(pages[:1], seed=41)
    assert store.put(["cached"], pages[:1]) == [True]
    path, _, payload = record_offsets(store, "cached")
    assert resident_bytes(path, payload, PAGE) == PAGE
    for dropped in (False, True):
        if dropped:
            drop_cache(path)
            assert resident_bytes(path, payload, PAGE) == 0
        poison(pages[1:])
        assert store.get(["cached"], pages[1:]) == [True]
        assert torch.equal(pages[0], pages[1])
    assert resident_bytes(path, payload, PAGE) == 0  # the device read went around the cache
    assert store.stats()["small_batch_reads"] == 2


def test_a_page_of_more_pieces_than_one_system_call_takes_round_trips_through_the_small_route(open_store):
    """A page of more pieces than IOV_MAX is gathered into (and scattered from) one block:
    written, read from the page cache and read from the device, every byte in place."""
    from test_remote_direct_io import drop_cache
    from test_remote_store import record_offsets

    store = open_store()
    count = 2 * os.sysconf("SC_IOV_MAX")
    size = PAGE // count
    source = torch.randint(0, 256, (PAGE,), dtype=torch.uint8)
    dest = torch.empty(2 * PAGE, dtype=torch.uint8)
    pieces = [source[i * size : (i + 1) * size] for i in range(count)]
    assert store.put(["many"], [pieces]) == [True]
    for dropped in (False, True):
        if dropped:
            drop_cache(record_offsets(store, "many")[0])
        dest.fill_(0xA5)
        into = [dest[2 * i * size : (2 * i + 1) * size] for i in range(count)]  # gaps stay poisoned
        assert store.get(["many"], [into]) == [True]
        assert torch.equal(torch.cat(into), source)
        assert all(bool((dest[(2 * i + 1) * size : (2 * i + 2) * size] == 0xA5).all()) for i in range(count))
    assert store.stats()["small_batch_writes"] == 1 and store.stats()["small_batch_reads"] == 2


@pytest.mark.parametrize("offset", [0, 64])  # into the pieces, or through this thread's block
def test_a_cold_small_read_asks_for_its_header_before_reading_the_payload(open_store, monkeypatch, offset):
    """A record read from the device has its header's block asked for (WILLNEED, no wait)
    before the payload's O_DIRECT read, and read after it, so the two device reads overlap;
    the page still verifies and round-trips, and a warm read asks for nothing."""
    from kvtier.tiers.remote import small_batches
    from test_remote_direct_io import drop_cache
    from test_remote_store import record_offsets

    store = open_store()
    _region, pages = aligned_pages(2, offset)
    fill_random(pages[:1], seed=53)
    assert store.put(["cold"], pages[:1]) == [True]
    path, header_off, payload_off = record_offsets(store, "cold")
    events: list[tuple] = []
    real = os.posix_fadvise, os.preadv, os.pread

    class Spy:  # the module's os, with its reads and advice recorded
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def posix_fadvise(fd, offset, length, advice):
            events.append(("advise", offset, advice))
            return real[0](fd, offset, length, advice)

        @staticmethod
        def preadv(fd, buffers, offset, *args):
            events.append(("preadv", offset))
            return real[1](fd, buffers, offset, *args)

        @staticmethod
        def pread(fd, length, offset):
            events.append(("pread", offset))
            return real[2](fd, length, offset)

    monkeypatch.setattr(small_batches, "os", Spy())
    drop_cache(path)
    poison(pages[1:])
    assert store.get(["cold"], pages[1:]) == [True]
    assert torch.equal(pages[0], pages[1])
    assert events == [
        ("advise", header_off, os.POSIX_FADV_WILLNEED), ("preadv", payload_off), ("pread", header_off),
    ]
    fill_random(pages[:1], seed=59)
    assert store.put(["warm"], pages[:1]) == [True]  # a small put leaves its page in the cache
    _, warm_header, warm_payload = record_offsets(store, "warm")
    events.clear()
    poison(pages[1:])
    assert store.get(["warm"], pages[1:]) == [True]
    assert torch.equal(pages[0], pages[1])
    assert events == [("pread", warm_header), ("preadv", warm_payload)]  # from the cache, no advice


@pytest.mark.parametrize("offset", [0, 64], ids=["aligned-direct", "unaligned-buffered"])
def test_a_small_put_of_a_large_page_goes_direct_where_its_pieces_are_aligned(open_store, offset):
    """Small puts of pages from SMALL_DIRECT_WRITE_BYTES on write their payload with O_DIRECT
    when every piece is 4 KiB aligned (nothing of it left in the page cache) and through the
    page cache otherwise; either way the record is durable, verified and reads back exactly,
    through this store and a second one."""
    import mmap

    from kvtier.tiers.remote import RemoteStore
    from kvtier.tiers.remote.small_batches import SMALL_DIRECT_WRITE_BYTES
    from test_remote_direct_io import drop_cache, resident_bytes
    from test_remote_store import NS, record_offsets

    page = SMALL_DIRECT_WRITE_BYTES
    store = open_store(page_bytes=page, segment_bytes=8 << 20)
    region = mmap.mmap(-1, 2 * page + 4096)
    flat = torch.frombuffer(region, dtype=torch.uint8)
    src, dst = flat[offset : offset + page], flat[offset + page : offset + 2 * page]
    src.copy_(torch.randint(0, 256, (page,), dtype=torch.uint8, generator=torch.Generator().manual_seed(61)))
    assert store.put(["large"], [src]) == [True]
    assert store.stats()["small_batch_writes"] == 1
    path, _, payload = record_offsets(store, "large")
    cached = resident_bytes(path, payload, page)
    assert cached == (0 if offset == 0 else page)
    dst.fill_(0xA5)
    assert store.get(["large"], [dst]) == [True] and torch.equal(src, dst)
    drop_cache(path)
    other = RemoteStore(store.directory, namespace=NS, page_bytes=page, segment_bytes=8 << 20)
    try:
        dst.fill_(0xA5)
        assert other.get(["large"], [dst]) == [True] and torch.equal(src, dst)
    finally:
        other.close()
