"""Failures of the store or of SGLang's arguments are misses or False, never exceptions."""

from __future__ import annotations

import logging
import os

import pytest

pytest.importorskip("nixl_cu13")
pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer  # noqa: E402

from sglang_pools import (  # noqa: E402
    PAGE,
    fill_pages,
    keys_for,
    make_backend,
    make_host_pool,
    storage_config,
)
from test_backend_v1 import counter  # noqa: E402


@pytest.fixture
def stored(tmp_path, gen):
    pool = make_host_pool()
    backend = make_backend(storage_config(tmp_path), pool)
    idx = pool.alloc(4 * PAGE)
    fill_pages(pool, idx, gen)
    keys = keys_for("stored", 4)
    assert backend.batch_set_v1(keys, idx) == [True] * 4
    yield pool, backend, keys, idx
    backend.close()


def test_failed_reads_are_misses(stored):
    pool, backend, keys, _ = stored
    store = backend._anchor.store
    failed_before = store.stats()["read_failures"]
    misses_before = counter("read", "miss")
    store.faults.arm("error", count=2, op="READ")
    assert backend.batch_get_v1(keys, pool.alloc(4 * PAGE)) == [False] * 4
    assert store.stats()["read_failures"] - failed_before == 4
    assert counter("read", "miss") - misses_before == 4


def test_failed_writes_are_false_and_stop_nothing_else(stored, gen):
    pool, backend, _, _ = stored
    store = backend._anchor.store
    idx = pool.alloc(3 * PAGE)
    fill_pages(pool, idx, gen)
    keys = keys_for("write-fault", 3)
    failed_before = counter("write", "failed")
    store.faults.arm("error_after_io", count=1, op="WRITE")
    assert backend.batch_set_v1(keys, idx) == [False] * 3
    assert counter("write", "failed") - failed_before == 3
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v1(keys, idx) == [True] * 3, "the next batch is written"


def test_timeouts_are_misses(stored):
    pool, backend, keys, _ = stored
    store = backend._anchor.store
    store.set_timeout(0.2)
    store.faults.arm("timeout", count=1, op="READ")
    assert backend.batch_get_v1(keys, pool.alloc(4 * PAGE)) == [False] * 4


def test_corrupt_records_are_misses(stored, tmp_path):
    """Invert every written byte of the segment files: every read fails its checks and misses."""
    pool, backend, keys, idx = stored
    for path in (tmp_path / "segments").iterdir():
        fd = os.open(path, os.O_RDWR)
        try:
            end, offset = os.fstat(fd).st_size, 0
            while offset < end:
                try:
                    start = os.lseek(fd, offset, os.SEEK_DATA)
                except OSError:
                    break
                stop = os.lseek(fd, start, os.SEEK_HOLE)
                data = bytes(b ^ 0xFF for b in os.pread(fd, stop - start, start))
                os.pwrite(fd, data, start)
                offset = stop
        finally:
            os.close(fd)
    dst = pool.alloc(4 * PAGE)
    assert backend.batch_get_v1(keys, dst) == [False] * 4


def test_bad_arguments_from_the_caller_are_misses_logged_once(stored, caplog):
    pool, backend, keys, idx = stored
    with caplog.at_level(logging.WARNING, logger="kvtier.adapters.sglang.backend"):
        for _ in range(3):
            assert backend.batch_get_v1(keys, idx[: 3 * PAGE]) == [False] * 4
    assert len(caplog.records) == 1 and "12 host indices for 4 pages" in caplog.records[0].getMessage()
    assert backend.batch_set_v1(keys, idx[:-1]) == [False] * 4
    outside = torch.arange(pool.size, pool.size + 4 * PAGE)
    assert backend.batch_get_v1(keys, outside) == [False] * 4
    assert backend.batch_set_v1(["", *keys[1:]], idx) == [False] * 4
    assert backend.batch_exists([keys[0], 7]) == 0


def test_closed_backend_answers_misses(stored):
    pool, backend, keys, idx = stored
    backend.close()
    backend.close()
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, idx) == [False] * 4
    assert backend.batch_set_v1(keys, idx) == [False] * 4
    assert backend.batch_get_v2([PoolTransfer(name=PoolName.DRAFT, host_indices=idx, keys=keys)]) == {
        PoolName.DRAFT: [False] * 4
    }


def test_store_closed_underneath_is_a_miss(stored):
    pool, backend, keys, idx = stored
    backend._anchor.store.close()
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, idx) == [False] * 4
    assert backend.batch_set_v1(keys, idx) == [False] * 4
    assert backend.clear() is False


def test_generic_interface_is_refused_quietly(stored):
    pool, backend, keys, _ = stored
    assert backend.get(keys[0], torch.empty(8)) is None
    assert backend.batch_get(keys, [torch.empty(8)] * 4) == [None] * 4
    assert backend.set(keys[0], torch.empty(8)) is False
    assert backend.batch_set(keys, [torch.empty(8)] * 4) is False


def test_clear_removes_only_this_namespace(tmp_path, gen):
    pool = make_host_pool()
    ours = make_backend(storage_config(tmp_path, tp_rank=0, tp_size=2), pool)
    theirs = make_backend(storage_config(tmp_path, tp_rank=1, tp_size=2), pool)
    idx = pool.alloc(2 * PAGE)
    fill_pages(pool, idx, gen)
    keys = keys_for("clear", 2)
    assert ours.batch_set_v1(keys, idx) == [True, True]
    assert theirs.batch_set_v1(keys, idx) == [True, True]
    assert ours.clear() is True
    assert ours.batch_exists(keys) == 0
    assert theirs.batch_exists(keys) == 2
    ours.close()
    theirs.close()


def test_settings_errors_name_the_key(tmp_path):
    pool = make_host_pool()
    with pytest.raises(ValueError, match="unknown key 'pth'"):
        make_backend(storage_config(tmp_path, pth="/x"), pool)
    config = storage_config(tmp_path)
    del config.extra_config["interface_v1"]
    with pytest.raises(ValueError, match="interface_v1"):
        make_backend(config, pool)
    with pytest.raises(ValueError, match="capacity_gb"):
        make_backend(storage_config(tmp_path, capacity_gb=-1), pool)
    with pytest.raises(ValueError, match="nixl_backend"):
        make_backend(storage_config(tmp_path, nixl_backend="FILE"), pool)
    config = storage_config(tmp_path)
    config.extra_config["path"] = ""
    with pytest.raises(ValueError, match="path"):
        make_backend(config, pool)
    assert not os.path.exists(tmp_path / "segments")
