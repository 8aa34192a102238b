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
