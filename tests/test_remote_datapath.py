"""The remote store's data path on real NIXL and real files: reads that stop at the first page
the index lacks, pieces given as arrays, and failures of one request among several in flight
(direct I/O posts up to four before waiting)."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

pytest.importorskip("nixl_cu13")

from kvtier.index.keys import key_ids  # noqa: E402
from kvtier.tiers.remote.buffers import PageBuffers  # noqa: E402
from kvtier.tiers.remote.datapath import DIRECT_REQUESTS_IN_FLIGHT  # noqa: E402
from test_remote_direct_io import aligned_pages, fill_random, open_store, poison  # noqa: E402,F401

PAGE = 16 << 10


def test_a_prefix_read_stops_at_the_first_missing_page(open_store):
    store = open_store()
    _region, pages = aligned_pages(12, 64)
    fill_random(pages[:6], seed=3)
    keys = [f"p{i}" for i in range(6)]
    assert store.put([k for i, k in enumerate(keys) if i != 2], [p for i, p in enumerate(pages[:6]) if i != 2]) == [True] * 5
    poison(pages[6:])
    assert store.get(keys, pages[6:], prefix=True) == [True, True, False, False, False, False]
    assert all(torch.equal(pages[i], pages[6 + i]) for i in range(2))
    assert all(bool((pages[6 + i] == 0xA5).all()) for i in range(3, 6))  # never read
    assert store.stats()["bytes_read"] == 2 * PAGE
    assert store.get(keys, pages[6:]) == [True, True, False, True, True, True]
    assert all(torch.equal(pages[i], pages[6 + i]) for i in (3, 4, 5))


def test_pieces_as_arrays_round_trip_and_are_checked(open_store):
    store = open_store()
    region, _ = aligned_pages(8)
    base = np.frombuffer(region, dtype=np.uint8)
    flat = torch.frombuffer(region, dtype=torch.uint8)
    gen = torch.Generator().manual_seed(7)
    flat[: 4 * PAGE] = torch.randint(1, 256, (4 * PAGE,), dtype=torch.uint8, generator=gen)
    address = base.ctypes.data
    piece = PAGE // 4
    # Page i's 4 pieces lie in reverse order at the start of its slot: a gather, not a copy.
    ptrs = np.array([address + i * PAGE + (3 - k) * piece for i in range(4) for k in range(4)], dtype=np.uint64)
    lens = np.full(16, piece, dtype=np.uint64)
    ids = key_ids([f"arr{i}" for i in range(4)])
    assert store.put_ids(ids, PageBuffers.from_arrays(ptrs, lens, 4, PAGE)) == [True] * 4
    flat[4 * PAGE : 8 * PAGE] = 0xA5
    assert store.get_ids(ids, PageBuffers.from_arrays(ptrs + np.uint64(4 * PAGE), lens, 4, PAGE)) == [True] * 4
    assert torch.equal(flat[: 4 * PAGE], flat[4 * PAGE : 8 * PAGE])
    # The same record read back into one contiguous buffer holds the pieces in order.
    out = torch.full((PAGE,), 0xA5, dtype=torch.uint8)
    assert store.get_ids(ids[:1], [out]) == [True]
    expected = torch.cat([flat[(3 - k) * piece : (4 - k) * piece] for k in range(4)])
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="expected page_bytes=16384"):
        PageBuffers.from_arrays(ptrs, lens - np.uint64(1), 4, PAGE)
    with pytest.raises(ValueError, match="same number of pieces"):
        PageBuffers.from_arrays(ptrs[:15], lens[:15], 4, PAGE)
    with pytest.raises(ValueError, match="PageBuffers of 4 pages of 16384 bytes for 3 ids"):
        store.get_ids(ids[:3], PageBuffers.from_arrays(ptrs, lens, 4, PAGE))


@pytest.mark.parametrize("offset", [0, 64], ids=["aligned-zero-copy", "unaligned-staged"])
@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_one_failed_request_among_those_in_flight_fails_only_its_pages(open_store, offset, op):
    store = open_store(pipeline_bytes=2 * PAGE, segment_bytes=4 << 20)
    assert store.stats()["direct_io"] == 1
    count = 2 * (DIRECT_REQUESTS_IN_FLIGHT + 2)  # more requests of 2 pages than fit in flight
    _src_region, src = aligned_pages(count, offset)
    _dst_region, dst = aligned_pages(count, offset)
    fill_random(src, seed=offset + 11)
    keys = [f"f{i}" for i in range(count)]
    if op == "WRITE":
        store.put(keys[:2], src[:2])  # the first request succeeds
        store.faults.arm("error_after_io", count=1, op="WRITE")
        written = store.put(keys[2:], src[2:])
        assert written == [False, False] + [True] * (count - 4)
        expected = [True, True, False, False] + [True] * (count - 4)
    else:
        assert store.put(keys, src) == [True] * count
        store.faults.arm("error", count=1, op="READ")
        poison(dst)
        assert store.get(keys, dst) == [False, False] + [True] * (count - 2)
        expected = [False, False] + [True] * (count - 2)  # failed reads leave the index
    poison(dst)
    assert store.get(keys, dst) == expected
    assert all(torch.equal(a, b) for a, b, ok in zip(src, dst, expected) if ok)


def _moves(local: np.ndarray, remote: np.ndarray) -> set[tuple[int, int, int]]:
    """Every (device, file offset, local address) one byte of these descriptors moves."""
    return {
        (int(r[2]), int(r[0]) + k, int(l[0]) + k)
        for l, r in zip(local.tolist(), remote.tolist()) for k in range(int(l[1]))
    }


def test_descriptors_merge_only_where_both_sides_continue():
    """Random descriptors in file order with random breaks (another device, a gap in the file,
    a jump in memory, another registration): the merged rows move exactly the same bytes, and
    no merged row continues the one before it (the merge is complete)."""
    from kvtier.tiers.remote.segments import merge_descriptors

    rng = np.random.default_rng(17)
    for _ in range(200):
        n = int(rng.integers(1, 40))
        lens = rng.integers(1, 6, n).astype(np.uint64)
        local = np.zeros((n, 3), dtype=np.uint64)
        remote = np.zeros((n, 3), dtype=np.uint64)
        groups = np.zeros(n, dtype=np.int64)
        addr, off, dev, group = 1000, 0, 3, 0
        for i in range(n):
            kind = int(rng.integers(0, 6))  # 0-1: continue; 2: device; 3: file gap; 4: memory; 5: group
            if i and kind == 2:
                dev, off = dev + 1, 0
            elif i and kind == 3:
                off += int(rng.integers(1, 4))
            elif i and kind == 4:
                addr += int(rng.integers(1, 4))
            elif i and kind == 5:
                group += 1
            local[i] = (addr, lens[i], 0)
            remote[i] = (off, lens[i], dev)
            groups[i] = group
            addr, off = addr + int(lens[i]), off + int(lens[i])
        merged_local, merged_remote = merge_descriptors(local.copy(), remote.copy(), groups)
        assert _moves(merged_local, merged_remote) == _moves(local, remote)
        assert merged_local[:, 1].tolist() == merged_remote[:, 1].tolist()
        # rows of one group never merge with another's, and no two merged rows could merge
        starts = np.concatenate(([0], np.cumsum(merged_local[:, 1].astype(np.int64))[:-1]))
        merged_groups = groups[np.searchsorted(np.cumsum(lens.astype(np.int64)), starts, side="right")]
        for a, b, ga, gb in zip(merged_local[:-1], merged_local[1:], merged_groups[:-1], merged_groups[1:]):
            i = np.flatnonzero(merged_local[:, 0] == b[0])[0]
            continues = (
                merged_remote[i, 2] == merged_remote[i - 1, 2]
                and merged_remote[i, 0] == merged_remote[i - 1, 0] + merged_remote[i - 1, 1]
                and b[0] == a[0] + a[1]
            )
            assert not (continues and ga == gb)


def _spy_posts(store, monkeypatch) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """The (op, local, remote) descriptors of every NIXL request the store posts (the real
    post runs)."""
    posts: list[tuple[str, np.ndarray, np.ndarray]] = []
    engine = store._engine
    real = engine.post

    def post(op, local, remote, *args, **kwargs):
        posts.append((op, local.copy(), remote.copy()))
        return real(op, local, remote, *args, **kwargs)

    monkeypatch.setattr(engine, "post", post)
    return posts


def test_pages_of_small_aligned_pieces_move_as_one_direct_read(open_store, monkeypatch):
    """Pages of 4 KiB pieces laid out layer by layer (piece k of page i at (k * count + i) *
    4 KiB), all aligned: they move as whole records through staging, and the records of
    neighbouring slots as one O_DIRECT read and write, not one per piece. Bytes round-trip
    cold and exactly; memory between pieces is never written."""
    from kvtier.tiers.remote.datapath import STAGED_PIECE_BYTES
    from test_remote_direct_io import drop_cache, resident_bytes
    from test_remote_store import record_offsets

    piece, per_page, count = 4096, PAGE // 4096, 32
    assert piece < STAGED_PIECE_BYTES
    store = open_store(segment_bytes=4 << 20)
    assert store.stats()["direct_io"] == 1
    src_region = mmap.mmap(-1, per_page * count * piece)
    dst_region = mmap.mmap(-1, per_page * count * piece)
    src = torch.frombuffer(src_region, dtype=torch.uint8)
    dst = torch.frombuffer(dst_region, dtype=torch.uint8)
    src.copy_(torch.randint(0, 256, (len(src),), dtype=torch.uint8, generator=torch.Generator().manual_seed(41)))
    store.register_host_memory(src)
    store.register_host_memory(dst)

    def table(flat: torch.Tensor, pages: list[int]) -> PageBuffers:
        k = np.arange(per_page, dtype=np.uint64)[None, :] * np.uint64(count * piece)
        i = np.asarray(pages, dtype=np.uint64)[:, None] * np.uint64(piece)
        ptrs = (np.uint64(flat.data_ptr()) + k + i).reshape(-1)
        return PageBuffers.from_arrays(ptrs, np.full(len(ptrs), piece, dtype=np.uint64), len(pages), PAGE)

    ids = key_ids([f"small-pieces-{i}" for i in range(count)])
    posts = _spy_posts(store, monkeypatch)
    assert store.put_ids(ids, table(src, list(range(count)))) == [True] * count
    writes = [(local, remote) for op, local, remote in posts if op == "WRITE"]
    assert len(writes) == 1
    _local, remote = writes[0]
    payload = remote[:, 1] % np.uint64(4096) == 0
    assert remote[payload, 1].tolist() == [count * PAGE]  # one write of 32 records, not 128 pieces
    path, _, first = record_offsets(store, "small-pieces-0")
    drop_cache(path)
    dst.fill_(0xA5)
    half = list(range(count // 2, count)) + list(range(count // 2))  # asked out of file order
    posts.clear()
    found = store.get_ids([ids[i] for i in half], table(dst, list(range(count))))
    assert found == [True] * count
    reads = [(local, remote) for op, local, remote in posts if op == "READ"]
    assert len(reads) == 1
    _local, remote = reads[0]
    payload = remote[:, 1] % np.uint64(4096) == 0
    assert remote[payload, 1].tolist() == [count * PAGE]  # one read
    assert resident_bytes(path, first, count * PAGE) == 0  # with O_DIRECT
    want = torch.full_like(dst, 0xA5)
    for j, page in enumerate(half):  # dst page j holds src page half[j]
        for k in range(per_page):
            at, to = (k * count + page) * piece, (k * count + j) * piece
            want[to : to + piece] = src[at : at + piece]
    assert torch.equal(dst, want)


def test_merged_descriptors_stay_inside_one_registered_region(open_store, monkeypatch):
    """Pages contiguous in memory and in the file merge into one descriptor only inside one
    registered region: a pool registered as two halves moves as two runs, each inside its
    half, and its bytes round-trip."""
    store = open_store(segment_bytes=4 << 20)
    count = 8
    region, pages = aligned_pages(2 * count)
    flat = torch.frombuffer(region, dtype=torch.uint8)
    half = count // 2 * PAGE
    store.register_host_memory(flat[:half])
    store.register_host_memory(flat[half : 2 * half])
    store.register_host_memory(flat[2 * half : 4 * half])
    fill_random(pages[:count], seed=43)
    keys = [f"halves-{i}" for i in range(count)]
    posts = _spy_posts(store, monkeypatch)
    assert store.put(keys, pages[:count]) == [True] * count
    base = flat.data_ptr()
    (op, local, remote), = posts
    payload = local[:, 1] >= PAGE
    assert sorted((int(a) - base, int(n)) for a, n in local[payload, :2]) == [(0, half), (half, half)]
    poison(pages[count:])
    posts.clear()
    assert store.get(keys, pages[count:]) == [True] * count
    (op, local, remote), = posts
    payload = local[:, 1] >= PAGE
    assert [(int(a) - base, int(n)) for a, n in local[payload, :2]] == [(2 * half, 2 * half)]  # one region
    assert all(torch.equal(pages[i], pages[count + i]) for i in range(count))


def test_pages_of_one_piece_layout_match_the_checked_constructor():
    """``PageBuffers.of_layout`` (a layout checked once, then pointers only) describes the same
    pages as ``from_arrays``; a layout whose lengths do not make a page, or a pointer count
    that is not whole pages, is refused."""
    from kvtier.tiers.remote.buffers import PieceLayout

    rng = np.random.default_rng(3)
    lengths = [4096, 100, 8192 - 100, 4096]
    layout = PieceLayout(lengths, PAGE)
    for count in (1, 5):
        ptrs = rng.integers(1 << 20, 1 << 40, count * len(lengths), dtype=np.int64).astype(np.uint64)
        mine = PageBuffers.of_layout(ptrs.tolist(), layout, count)
        checked = PageBuffers.from_arrays(ptrs, np.tile(np.array(lengths, dtype=np.uint64), count), count, PAGE)
        for field in ("ptrs", "lens", "offsets", "first"):
            assert getattr(mine, field).tolist() == getattr(checked, field).tolist(), field
        assert (mine.count, mine.page_bytes, mine.single) == (count, PAGE, False)
    with pytest.raises(ValueError, match="summing to 16384"):
        PieceLayout([4096, 4096], PAGE)
    with pytest.raises(ValueError, match="summing to 16384"):
        PieceLayout([PAGE + 1, -1], PAGE)
    with pytest.raises(ValueError, match="7 piece pointers for 2 pages of 4 pieces"):
        PageBuffers.of_layout(list(range(1, 8)), layout, 2)


def test_header_read_ahead_covers_runs_of_headers_not_the_gaps_between_them(tmp_path, monkeypatch):
    """A get asks the kernel for its headers ahead in runs: neighbouring headers of one file in
    one call, a header far from the others (and one in another file) in a call of its own, so a
    scattered batch never reads the header table between its pages."""
    import os

    from kvtier.tiers.remote import segments
    from kvtier.tiers.remote.segments import Located, SegmentFiles

    first = os.open(tmp_path / "a", os.O_RDWR | os.O_CREAT, 0o600)
    second = os.open(tmp_path / "b", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        calls = []
        real = os.posix_fadvise
        monkeypatch.setattr(segments.os, "posix_fadvise", lambda fd, offset, length, advice: (
            calls.append((fd, offset, length, advice)), real(fd, offset, length, advice))[1])
        far = 4224 + segments._AHEAD_GAP + 64  # past the gap after the last of the first run
        devs = np.array([first, second, first, first, first], dtype=np.int64)
        headers = np.array([4160, 8192, far, 4096, 4224], dtype=np.int64)
        located = Located(devs, devs, headers, np.zeros(5, dtype=np.int64), {})
        SegmentFiles.read_ahead_headers(None, located, [0, 1, 2, 3, 4])
        willneed = os.POSIX_FADV_WILLNEED
        assert sorted(calls) == sorted([
            (first, 4096, 3 * 64, willneed), (first, far, 64, willneed), (second, 8192, 64, willneed),
        ])
        calls.clear()
        SegmentFiles.read_ahead_headers(None, located, [])
        assert calls == []
    finally:
        os.close(first)
        os.close(second)


@pytest.mark.parametrize("direct_io", [True, False])
def test_a_batch_this_process_published_is_read_without_an_index_lookup(open_store, direct_io):
    """Every key known (published here): the batch is read at the remembered locations through
    NIXL, with no SQLite read; a key the process does not know sends the batch to the index."""
    store = open_store(direct_io=direct_io)
    count = 3 * DIRECT_REQUESTS_IN_FLIGHT
    _region, pages = aligned_pages(2 * count)
    fill_random(pages[:count], seed=41)
    keys = [f"m{i}" for i in range(count)]
    assert store.put(keys, pages[:count]) == [True] * count
    lookups = []
    lookup = store._index.lookup
    store._index.lookup = lambda ns, ids: lookups.append(len(ids)) or lookup(ns, ids)
    poison(pages[count:])
    assert store.get(keys, pages[count:]) == [True] * count
    assert all(torch.equal(pages[i], pages[count + i]) for i in range(count))
    stats = store.stats()
    assert lookups == [] and stats["locations_from_memory"] == 1 and stats["small_batch_reads"] == 0
    poison(pages[count:])
    assert store.get(keys + ["unknown"], pages[count:] + [pages[0].clone()]) == [True] * count + [False]
    assert all(torch.equal(pages[i], pages[count + i]) for i in range(count))
    assert lookups == [count + 1] and store.stats()["locations_from_memory"] == 1


def test_a_batch_with_a_slot_reused_by_another_store_is_read_again_from_the_index(open_store):
    """One remembered location of a large batch went stale (another store moved the key and
    reused its slot): the batch is read again at the index's locations, never the old bytes."""
    mine = open_store(reuse_delay_s=0.0, presence_recheck_s=3600.0)
    other = open_store(reuse_delay_s=0.0)
    count = 2 * DIRECT_REQUESTS_IN_FLIGHT
    _region, pages = aligned_pages(2 * count + 2)
    fill_random(pages[: count + 2], seed=43)
    keys = [f"b{i}" for i in range(count)]
    assert mine.put(keys, pages[:count]) == [True] * count
    assert other.delete([keys[3]]) == [True]
    assert other.put(["j"], pages[count : count + 1]) == [True]  # into b3's old slot
    assert other.put([keys[3]], pages[count + 1 : count + 2]) == [True]  # b3 again, other bytes
    out = pages[count + 2 :]
    poison(out)
    assert mine.get(keys, out) == [True] * count
    want = pages[:count]
    want[3] = pages[count + 1]
    assert all(torch.equal(want[i], out[i]) for i in range(count))
    stats = mine.stats()
    assert stats["stale_locations"] == 1 and stats["corrupt_reads"] == 0 and stats["hits"] == count
