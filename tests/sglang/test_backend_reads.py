"""The kvtier backend's read path under SGLang's own pools: pages after the first miss of a
read are not read (SGLang keeps only the leading hits), and layer_first pages of many pieces
come back bit-exact into poisoned slots through direct I/O and through buffered I/O."""

from __future__ import annotations

import atexit
import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("nixl_cu13")
pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from sglang_pools import (  # noqa: E402
    PAGE,
    fill_pages,
    keys_for,
    make_backend,
    make_host_pool,
    page_bytes,
    page_starts,
    page_tensor_bytes,
    poison_pages,
    storage_config,
)

SHM = Path("/dev/shm")


def request_cleanup(path: Path) -> None:
    atexit.register(shutil.rmtree, path, ignore_errors=True)


def test_a_read_stops_at_the_first_missing_page(tmp_path, gen):
    pool = make_host_pool()
    backend = make_backend(storage_config(tmp_path), pool)
    keys = keys_for("gap", 6)
    src = pool.alloc(6 * PAGE)
    fill_pages(pool, src, gen)
    for i in (0, 1, 3, 4, 5):
        assert backend.batch_set_v1([keys[i]], src[i * PAGE : (i + 1) * PAGE]) == [True]
    dst = pool.alloc(6 * PAGE)
    poison_pages(pool, dst)
    poisoned_after_gap = [page_bytes(pool, start) for start in page_starts(dst)[3:]]
    store = backend.store_stats()["kv"]
    assert backend.batch_get_v1(keys, dst) == [True, True, False, False, False, False]
    for a, b in zip(page_starts(src)[:2], page_starts(dst)[:2]):
        assert page_bytes(pool, b) == page_bytes(pool, a)
    assert [page_bytes(pool, start) for start in page_starts(dst)[3:]] == poisoned_after_gap
    after = backend.store_stats()["kv"]
    assert after["bytes_read"] - store["bytes_read"] == 2 * backend._anchor.page_bytes
    assert backend.batch_exists(keys[3:]) == 3  # the pages after the gap are still stored
    backend.close()


@pytest.mark.parametrize("direct_io", [True, False], ids=["direct-disk", "buffered-tmpfs"])
def test_layer_first_pages_round_trip(tmp_path, gen, direct_io):
    """2 pieces per layer (K, V) per page, read through one array of pieces; on tmpfs the store
    falls back to buffered I/O."""
    if direct_io:
        location = tmp_path
    else:
        if not SHM.is_dir():
            pytest.skip("no /dev/shm")
        location = SHM / f"kvtier-test-{os.getpid()}-{tmp_path.name}"
        request_cleanup(location)
    pool = make_host_pool("mha", "layer_first", layers=5, heads=2, head_dim=64)
    backend = make_backend(storage_config(location), pool)
    assert backend.store_stats()["kv"]["direct_io"] == int(direct_io)
    pages = 7
    src, dst = pool.alloc(pages * PAGE), pool.alloc(pages * PAGE)
    fill_pages(pool, src, gen)
    poison_pages(pool, dst)
    keys = keys_for(f"layer-first-{direct_io}", pages)
    assert backend.batch_set_v1(keys, src) == [True] * pages
    assert backend.batch_get_v1(keys, dst) == [True] * pages
    for a, b in zip(page_starts(src), page_starts(dst)):
        assert page_tensor_bytes(pool, b) == page_tensor_bytes(pool, a)
    backend.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_mha_pieces_are_computed_as_the_pool_gives_them(tmp_path, gen, layout):
    """For MHA pools the backend computes a batch's pieces with array operations; they equal
    the pool's own get_page_buffer_meta for scattered pages, and a partly present batch writes
    only its missing pages, whose bytes read back."""
    import torch

    pool = make_host_pool("mha", layout, layers=4, heads=2, head_dim=64)
    backend = make_backend(storage_config(tmp_path), pool)
    lane = backend._all_lanes()[0]
    assert lane._layout is not None
    free = pool.alloc(9 * PAGE).reshape(9, PAGE)
    order = torch.randperm(9, generator=gen)
    indices = free[order[:6]].reshape(-1)
    table = lane.page_table(indices, 6)
    ptrs, sizes = pool.get_page_buffer_meta(indices)
    assert table.ptrs.tolist() == list(ptrs) and table.lens.tolist() == list(sizes)
    computed = lane._computed(lane._layout, layout, indices, 6)  # what batches of many pieces use
    assert computed[0].tolist() == list(ptrs) and computed[1].tolist() == list(sizes)
    assert lane._computed_few(lane._layout, indices, 6) == (list(ptrs), list(sizes))  # and of a few
    fill_pages(pool, indices, gen)
    keys = keys_for(f"computed-{layout}", 6)
    assert backend.batch_set_v1(keys[::2], free[order[:6:2]].reshape(-1)) == [True] * 3
    assert backend.batch_set_v1(keys, indices) == [True] * 6  # three present, three written
    dst = free[order[6:]].reshape(-1)
    for start in (0, 3):
        poison_pages(pool, dst)
        assert backend.batch_get_v1(keys[start : start + 3], dst) == [True] * 3
        for a, b in zip(page_starts(indices)[start : start + 3], page_starts(dst)):
            assert page_tensor_bytes(pool, b) == page_tensor_bytes(pool, a)
    backend.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("pages", [2, 20], ids=["few-pieces", "many-pieces"])
def test_computed_pieces_are_checked_per_page_against_the_pool(tmp_path, gen, layout, pages):
    """Computed MHA pieces are described without a check per piece: a page is inside the pool
    when its first index is at least 0 and its last below pool.size. The pool's last pages are
    accepted (and equal the pool's own pieces, lengths, offsets and page bounds included, and
    round-trip); a page that starts one index too late, or before 0, is refused, alone or among
    good pages, and such a batch is a miss."""
    import numpy as np
    import torch

    from kvtier.tiers.remote.buffers import PageBuffers

    pool = make_host_pool("mha", layout, layers=4, heads=2, head_dim=64)
    backend = make_backend(storage_config(tmp_path), pool)
    lane = backend._all_lanes()[0]
    assert lane._layout is not None
    last = torch.arange(pool.size - pages * PAGE, pool.size, dtype=torch.int64)  # the last pages
    table = lane.page_table(last, pages)
    ptrs, sizes = pool.get_page_buffer_meta(last)
    reference = PageBuffers.from_arrays(np.asarray(ptrs, dtype=np.uint64), np.asarray(sizes, dtype=np.uint64), pages, lane.page_bytes)
    for field in ("ptrs", "lens", "offsets", "first"):
        assert getattr(table, field).tolist() == getattr(reference, field).tolist(), field
    assert (table.count, table.page_bytes, table.single) == (reference.count, reference.page_bytes, reference.single)
    fill_pages(pool, last, gen)
    keys = keys_for(f"last-{layout}-{pages}", pages)
    assert backend.batch_set_v1(keys, last) == [True] * pages
    saved = [page_tensor_bytes(pool, a) for a in page_starts(last)]
    poison_pages(pool, last)
    assert backend.batch_get_v1(keys, last) == [True] * pages
    assert [page_tensor_bytes(pool, a) for a in page_starts(last)] == saved
    for bad in (last + 1, last - last[0] - 1, torch.cat([last[PAGE:], torch.arange(pool.size, pool.size + PAGE)])):
        with pytest.raises(ValueError, match="lies outside the host pool's memory"):
            lane.page_table(bad, pages)
        assert backend.batch_get_v1(keys, bad) == [False] * pages
    backend.close()
