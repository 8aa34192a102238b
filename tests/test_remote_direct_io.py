"""The remote store's direct I/O on real files and the real NIXL POSIX backend: O_DIRECT
segment reads and writes for aligned memory (zero-copy) and unaligned memory (registered
staging), the buffered fallback on tmpfs, coherence between buffered and direct access to
one store, and no NIXL registration per call once warm."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("nixl_cu13")

from kvtier.tiers.remote import SLOT_ALIGN  # noqa: E402
from test_remote_store import NS, flip_byte, record_offsets  # noqa: E402

PAGE = 16 << 10
SHM = Path("/dev/shm")


def aligned_pages(count: int, offset: int = 0) -> tuple[mmap.mmap, list[torch.Tensor]]:
    """``count`` page tensors in page-aligned memory, shifted by ``offset`` bytes."""
    region = mmap.mmap(-1, count * PAGE + SLOT_ALIGN)
    flat = torch.frombuffer(region, dtype=torch.uint8)
    return region, [flat[offset + i * PAGE : offset + (i + 1) * PAGE] for i in range(count)]


def fill_random(pages: list[torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for page in pages:
        page.copy_(torch.randint(1, 256, (PAGE,), dtype=torch.uint8, generator=gen))


def poison(pages: list[torch.Tensor]) -> None:
    for page in pages:
        page.fill_(0xA5)


def resident_bytes(path: Path, start: int, length: int) -> int:
    """Bytes of ``path`` in [start, start + length) held in the page cache (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        first, last = start // mmap.PAGESIZE, -(-(start + length) // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * (last - first))()
        assert libc.mincore(ctypes.c_void_p(address + first * mmap.PAGESIZE),
                            ctypes.c_size_t((last - first) * mmap.PAGESIZE), vec) == 0
        return sum(v & 1 for v in vec) * mmap.PAGESIZE
    finally:
        mapped.close()


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.fixture
def open_store(tmp_path):
    from kvtier.tiers.remote import RemoteStore

    stores = []

    def make(location=None, **kw):
        kw.setdefault("namespace", NS)
        kw.setdefault("page_bytes", PAGE)
        kw.setdefault("segment_bytes", 1 << 20)
        store = RemoteStore(location or tmp_path / "store", **kw)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


@pytest.mark.parametrize("offset", [0, 64], ids=["aligned-zero-copy", "unaligned-staged"])
def test_direct_io_round_trip_bypasses_the_page_cache(open_store, offset):
    store = open_store()
    assert store.stats()["direct_io"] == 1
    _src_region, src = aligned_pages(8, offset)
    _dst_region, dst = aligned_pages(8, offset)
    fill_random(src, seed=offset + 1)
    keys = [f"page-{i}" for i in range(8)]
    assert store.put(keys, src) == [True] * 8
    for key in keys:
        path, _, payload = record_offsets(store, key)
        assert resident_bytes(path, payload, PAGE) == 0  # written with O_DIRECT
    poison(dst)
    assert store.get(keys, dst) == [True] * 8
    assert all(torch.equal(a, b) for a, b in zip(src, dst))
    path, _, payload = record_offsets(store, keys[0])
    assert resident_bytes(path, payload, PAGE) == 0  # read with O_DIRECT


def test_pieces_of_odd_sizes_are_one_staged_record(open_store):
    """Pieces of odd sizes beside aligned ones: the page moves whole through staging, one
    record, and comes back into the same pieces."""
    store = open_store()
    _region, flat = aligned_pages(4)
    sizes = [SLOT_ALIGN, 100, SLOT_ALIGN - 100, SLOT_ALIGN, SLOT_ALIGN]
    assert sum(sizes) == PAGE

    def pieces(page: torch.Tensor) -> list[tuple[int, int]]:
        out, at = [], page.data_ptr()
        for size in sizes:
            out.append((at, size))
            at += size
        return out

    fill_random(flat[:2], seed=5)
    assert store.put(["a", "b"], [pieces(flat[0]), pieces(flat[1])]) == [True, True]
    poison(flat[2:])
    assert store.get(["b", "a"], [pieces(flat[2]), pieces(flat[3])]) == [True, True]
    assert torch.equal(flat[2], flat[1]) and torch.equal(flat[3], flat[0])


@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm")
def test_tmpfs_falls_back_to_buffered_io_and_says_so_once(open_store, tmp_path, caplog):
    location = SHM / f"kvtier-test-{os.getpid()}-{tmp_path.name}"
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier.tiers.remote.segments"):
            store = open_store(location)
            _src_region, src = aligned_pages(6, 64)
            _dst_region, dst = aligned_pages(6, 0)
            fill_random(src, seed=9)
            keys = [f"shm-{i}" for i in range(6)]
            assert store.put(keys, src) == [True] * 6
            poison(dst)
            assert store.get(keys, dst) == [True] * 6
            assert store.get(keys, dst) == [True] * 6
        assert all(torch.equal(a, b) for a, b in zip(src, dst))
        assert store.stats()["direct_io"] == 0
        said = [r.getMessage() for r in caplog.records if "buffered I/O" in r.getMessage()]
        assert len(said) == 1 and "tmpfs" in said[0]
    finally:
        shutil.rmtree(location, ignore_errors=True)


def test_buffered_and_direct_stores_share_records_exactly(open_store, tmp_path):
    """A writer with direct I/O off and a reader with it on (and back) see the same bytes:
    the kernel keeps buffered and direct access to distinct blocks coherent."""
    buffered = open_store(direct_io=False)
    direct = open_store()
    assert (buffered.stats()["direct_io"], direct.stats()["direct_io"]) == (0, 1)
    _region, pages = aligned_pages(8)
    fill_random(pages[:4], seed=13)
    assert buffered.put(["x0", "x1"], pages[:2]) == [True, True]
    assert direct.put(["y0", "y1"], pages[2:4]) == [True, True]
    poison(pages[4:])
    assert direct.get(["x0", "x1"], pages[4:6]) == [True, True]
    assert buffered.get(["y0", "y1"], pages[6:8]) == [True, True]
    assert all(torch.equal(pages[i], pages[i + 4]) for i in range(4))


@pytest.mark.parametrize("offset", [0, 64], ids=["aligned-zero-copy", "unaligned-staged"])
def test_a_flipped_byte_under_direct_io_is_a_miss(open_store, offset):
    store = open_store()
    _region, pages = aligned_pages(2, offset)
    fill_random(pages[:1], seed=17)
    assert store.put(["k"], pages[:1]) == [True]
    path, _, payload = record_offsets(store, "k")
    drop_cache(path)
    flip_byte(path, payload + PAGE - 1)  # a buffered write the direct read must see
    poison(pages[1:])
    assert store.get(["k"], pages[1:]) == [False]
    assert store.stats()["corrupt_reads"] == 1
    assert store.contains(["k"]) == [False]


def test_warm_calls_register_no_memory_with_nixl(open_store, monkeypatch):
    """Header blocks, staging and the host pool are registered once; a warm 1-page get or put
    asks NIXL for no registration."""
    store = open_store()
    region, pages = aligned_pages(4, 64)
    store.register_host_memory(torch.frombuffer(region, dtype=torch.uint8))
    fill_random(pages[:2], seed=19)
    assert store.put(["w0"], pages[:1]) == [True]
    assert store.get(["w0"], pages[2:3]) == [True]
    calls = []
    engine = store._engine
    real = engine.register
    monkeypatch.setattr(engine, "register", lambda *a, **k: calls.append(a) or real(*a, **k))
    assert store.put(["w1"], pages[1:2]) == [True]
    assert store.get(["w1"], pages[3:4]) == [True]
    assert store.get(["w0"], pages[2:3]) == [True]
    assert calls == []
    assert torch.equal(pages[3], pages[1]) and torch.equal(pages[2], pages[0])


@pytest.mark.parametrize("page_bytes", [PAGE, PAGE - 3 * 1024], ids=["stride-equal", "stride-gap"])
def test_pages_of_many_equal_pieces_are_staged_in_one_copy_and_read_back(open_store, page_bytes):
    """Unaligned pages of many equal pieces interleaved as an SGLang layer_first pool lays them
    out (piece k of page i at k * pages * length + i * length) move through staging blocks in
    one array copy each way: bytes round-trip exactly, the memory between pieces is never
    written, and a corrupt record is a miss while the rest of its request is copied out."""
    from kvtier.tiers.remote.buffers import PageBuffers

    pieces, count = 8, 12
    length = page_bytes // pieces
    store = open_store(page_bytes=page_bytes)
    gap = 64  # bytes between one page's piece and the next page's, kept poisoned

    def table(flat: torch.Tensor) -> PageBuffers:
        base = flat.data_ptr() + 64  # not 4 KiB aligned: staged
        k = torch.arange(pieces, dtype=torch.int64)[None, :] * (count * (length + gap))
        i = torch.arange(count, dtype=torch.int64)[:, None] * (length + gap)
        ptrs = (base + k + i).reshape(-1).numpy().astype("uint64")
        return PageBuffers.from_arrays(ptrs, [length] * (count * pieces), count, page_bytes)

    size = 64 + pieces * count * (length + gap)
    src = torch.randint(1, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(31))
    dst = torch.full((size,), 0xA5, dtype=torch.uint8)
    keys = [f"many-{i}" for i in range(count)]
    assert store.put(keys, table(src)) == [True] * count
    assert store.get(keys, table(dst)) == [True] * count
    inside = torch.zeros(size, dtype=torch.bool)
    for p in table(src).ptrs.tolist():
        inside[p - src.data_ptr() : p - src.data_ptr() + length] = True
    assert torch.equal(dst[inside], src[inside])
    assert bool((dst[~inside] == 0xA5).all())  # nothing outside the pieces was written
    path, _, payload = record_offsets(store, keys[5])
    flip_byte(path, payload + 7)
    drop_cache(path)
    dst.fill_(0xA5)
    found = store.get(keys, table(dst))
    assert found == [i != 5 for i in range(count)]
    for i in range(count):
        page_inside = torch.zeros(size, dtype=torch.bool)
        for p in table(src).ptrs.tolist()[i * pieces : (i + 1) * pieces]:
            page_inside[p - src.data_ptr() : p - src.data_ptr() + length] = True
        if i == 5:
            continue  # a miss: its content is unspecified
        assert torch.equal(dst[page_inside], src[page_inside])
    assert bool((dst[~inside] == 0xA5).all())


@pytest.mark.timeout(120)
def test_paced_waits_are_hints_only(open_store):
    """O_DIRECT requests learn a pace (seconds per byte in flight) from their waits and sleep
    toward the predicted end; the pace never decides an outcome: reads of many requests stay
    bit-exact, and an absurd pace only stretches a wait to the capped sleep, never past it."""
    store = open_store(pipeline_bytes=PAGE)  # one NIXL request per page
    engine = store._engine
    _src_region, src = aligned_pages(16)
    _dst_region, dst = aligned_pages(16)
    fill_random(src, seed=11)
    keys = [f"paced-{i}" for i in range(16)]
    assert store.put(keys, src) == [True] * 16
    for round_ in range(3):
        poison(dst)
        assert store.get(keys, dst) == [True] * 16, round_
        assert all(torch.equal(a, b) for a, b in zip(src, dst))
    engine._pace["READ"] = 1.0  # a second per byte: every wait would sleep for days uncapped
    poison(dst)
    assert store.get(keys[:12], dst[:12]) == [True] * 12
    assert all(torch.equal(a, b) for a, b in zip(src[:12], dst[:12]))
    assert engine._inflight_bytes == 0  # every posted request was waited for


@pytest.mark.parametrize("offset", [0, 64], ids=["aligned-zero-copy", "unaligned-staged"])
@pytest.mark.parametrize("cpus", [1, 64], ids=["threads-only", "caller-shares"])
def test_a_large_last_request_is_checked_in_shares(open_store, monkeypatch, offset, cpus):
    """The last request of a get (over PARALLEL_CHECKSUM_BYTES) is checked in shares on the
    checksum threads, and on the caller too where a core is free: every page is still verified
    (a flipped byte in the first share and in the caller's last share are misses), and only
    verified pages are delivered."""
    from kvtier.tiers.remote import datapath

    monkeypatch.setattr(datapath, "_CPUS", cpus)
    # a get spreads over DIRECT_REQUESTS_IN_FLIGHT requests: each must still pass the threshold
    count = datapath.DIRECT_REQUESTS_IN_FLIGHT * (datapath.PARALLEL_CHECKSUM_BYTES // PAGE + 10)
    store = open_store(segment_bytes=64 << 20)
    _src_region, src = aligned_pages(count, offset)
    _dst_region, dst = aligned_pages(count, offset)
    fill_random(src, seed=23 + cpus)
    keys = [f"share-{i}" for i in range(count)]
    assert store.put(keys, src) == [True] * count
    for bad in (0, count - 1):
        path, _, payload = record_offsets(store, keys[bad])
        drop_cache(path)
        flip_byte(path, payload + PAGE // 2)
    poison(dst)
    found = store.get(keys, dst)
    assert found == [i not in (0, count - 1) for i in range(count)]
    assert all(torch.equal(src[i], dst[i]) for i in range(1, count - 1))
    if offset:  # staged: a page that failed its check is never copied out
        assert all(bool((dst[i] == 0xA5).all()) for i in (0, count - 1))


def test_a_cold_get_asks_for_its_headers_before_its_first_post(open_store, monkeypatch):
    """Record headers are read through the buffered descriptor inside NIXL's post: a cold get
    first asks the kernel to read the span of its headers ahead (without waiting), so they are
    in the page cache, or on their way, before the first request is posted; bytes round-trip."""
    import time

    from kvtier.tiers.remote.segments import SegmentFiles

    store = open_store(segment_bytes=4 << 20)
    _src_region, src = aligned_pages(16)
    _dst_region, dst = aligned_pages(16)
    fill_random(src, seed=47)
    keys = [f"ahead-{i}" for i in range(16)]
    assert store.put(keys, src) == [True] * 16
    path, first_header, _ = record_offsets(store, keys[0])
    _, last_header, _ = record_offsets(store, keys[-1])
    span = last_header + 64 - first_header
    drop_cache(path)
    assert resident_bytes(path, first_header, span) == 0
    events: list[str] = []
    real_ahead, real_post = SegmentFiles.read_ahead_headers, store._engine.post

    def ahead(medium, located, items):
        real_ahead(medium, located, items)
        deadline = time.monotonic() + 5
        while resident_bytes(path, first_header, span) == 0 and time.monotonic() < deadline:
            time.sleep(0.001)  # WILLNEED only starts the read: wait here to observe it land
        events.append(f"ahead:{len(items)}:{resident_bytes(path, first_header, span) > 0}")

    def post(op, *args, **kwargs):
        events.append(op)
        return real_post(op, *args, **kwargs)

    monkeypatch.setattr(SegmentFiles, "read_ahead_headers", ahead)
    monkeypatch.setattr(store._engine, "post", post)
    poison(dst)
    assert store.get(keys, dst) == [True] * 16
    assert events[0] == "ahead:16:True" and set(events[1:]) == {"READ"}
    assert all(torch.equal(a, b) for a, b in zip(src, dst))
