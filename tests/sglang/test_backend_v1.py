"""The kvtier backend through SGLang's v1 zero-copy interface, on SGLang's own host pools."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

pytest.importorskip("nixl_cu13")
pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

import torch  # noqa: E402
from prometheus_client import REGISTRY, CollectorRegistry  # noqa: E402
from prometheus_client.multiprocess import MultiProcessCollector  # noqa: E402
from sglang.srt.observability.metrics_collector import StorageMetrics  # noqa: E402

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
from kvtier.adapters.sglang.backend import KvtierHiCacheStorage  # noqa: E402
from kvtier.adapters.sglang.namespace import record_kv_format  # noqa: E402

LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def attention_model(layers: int, k_scales, v_scales) -> torch.nn.Module:
    """A module tree of SGLang's own RadixAttention layers carrying per-layer k/v scales."""
    from sglang.srt.layers.radix_attention import RadixAttention

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList()
    for layer in range(layers):
        block = torch.nn.Module()
        block.attn = RadixAttention(4, 16, 0.25, 2, layer_id=layer)
        block.attn.k_scale_float = float(k_scales[layer])
        block.attn.v_scale_float = float(v_scales[layer])
        model.layers.append(block)
    return model


def record_fp8(kv_dtype=torch.float8_e4m3fn, k_scales=(0.5, 0.25, 2.0), v_scales=(1.0, 0.125, 4.0), role="target"):
    return record_kv_format(role, attention_model(len(k_scales), k_scales, v_scales), kv_dtype)


def counter(op: str, result: str, pool: str = "kv") -> float:
    value = REGISTRY.get_sample_value("kvtier_sglang_pages_total", {"pool": pool, "op": op, "result": result})
    return value or 0.0


@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_round_trip_is_bit_exact(tmp_path, gen, kind, layout, fp8):
    """Pages written from one set of host slots come back bit-exact into other (poisoned) slots,
    and SGLang's pointers cover exactly what indexing its buffer per layout gives."""
    if fp8:
        record_fp8()
    pool = make_host_pool(kind, layout, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    assert pool.dtype == (torch.uint8 if fp8 else torch.bfloat16)
    backend = make_backend(storage_config(tmp_path, mla=kind == "mla"), pool)
    assert isinstance(backend, KvtierHiCacheStorage)
    pages = 6
    src = pool.alloc(pages * PAGE)
    dst = pool.alloc(pages * PAGE)
    fill_pages(pool, src, gen)
    for start in page_starts(src):
        assert page_bytes(pool, start) == page_tensor_bytes(pool, start)
    poison_pages(pool, dst)
    neighbour = pool.alloc(PAGE)
    fill_pages(pool, neighbour, gen)
    neighbour_before = page_bytes(pool, int(neighbour[0]))
    keys = keys_for(f"{kind}-{layout}-{fp8}", pages)

    assert backend.batch_set_v1(keys, src) == [True] * pages
    assert backend.batch_exists(keys) == pages
    assert backend.batch_get_v1(keys, dst) == [True] * pages

    for a, b in zip(page_starts(src), page_starts(dst)):
        assert page_bytes(pool, b) == page_bytes(pool, a)
        assert page_tensor_bytes(pool, b) == page_tensor_bytes(pool, a)
    assert page_bytes(pool, int(neighbour[0])) == neighbour_before
    backend.close()


def test_asymmetric_heads_round_trip(tmp_path, gen):
    """The asymmetric MHA pool gives K and V pieces of unequal sizes; one record holds both."""
    pool = make_host_pool("mha", "page_first", v_head_dim=8)
    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(PAGE))
    assert len(ptrs) == 2 and sizes[0] != sizes[1]
    backend = make_backend(storage_config(tmp_path), pool)
    src, dst = pool.alloc(3 * PAGE), pool.alloc(3 * PAGE)
    fill_pages(pool, src, gen)
    poison_pages(pool, dst)
    keys = keys_for("asym", 3)
    assert backend.batch_set_v1(keys, src) == [True] * 3
    assert backend.batch_get_v1(keys, dst) == [True] * 3
    for a, b in zip(page_starts(src), page_starts(dst)):
        assert page_tensor_bytes(pool, b) == page_tensor_bytes(pool, a)
    backend.close()


def test_batch_exists_counts_leading_hits(tmp_path, gen):
    pool = make_host_pool()
    backend = make_backend(storage_config(tmp_path), pool)
    keys = keys_for("prefix", 6)
    idx = pool.alloc(6 * PAGE)
    fill_pages(pool, idx, gen)
    stored = [0, 1, 2, 4]
    for i in stored:
        assert backend.batch_set_v1([keys[i]], idx[i * PAGE : (i + 1) * PAGE]) == [True]
    assert backend.batch_exists(keys) == 3
    assert backend.batch_exists(keys[3:]) == 0
    assert backend.batch_exists(keys[4:5]) == 1
    assert backend.exists(keys[4]) and not backend.exists(keys[5])
    assert backend.batch_exists([]) == 0
    # SGLang keeps only the leading hits of a read, so the page after the gap is not read.
    assert backend.batch_get_v1(keys, pool.alloc(6 * PAGE)) == [True, True, True, False, False, False]
    backend.close()


def test_rewriting_a_stored_page_is_skipped_and_counted(tmp_path, gen):
    """A page already stored is not written again (SGLang may back up a prefix twice)."""
    pool = make_host_pool()
    backend = make_backend(storage_config(tmp_path), pool)
    idx = pool.alloc(4 * PAGE)
    fill_pages(pool, idx, gen)
    keys = keys_for("twice", 4)
    present_before = counter("write", "present")
    written_before = counter("write", "written")
    assert backend.batch_set_v1(keys[:2], idx[: 2 * PAGE]) == [True, True]
    assert backend.batch_set_v1(keys, idx) == [True] * 4
    assert counter("write", "present") - present_before == 2
    assert counter("write", "written") - written_before == 4
    assert backend.store_stats()["kv"]["bytes_written"] == 4 * backend._anchor.page_bytes
    backend.close()


def test_a_set_skips_no_page_another_handle_just_removed(tmp_path, gen):
    """The presence cache still says the pages are stored (another handle cleared them 1 ms
    ago): batch_set asks the index itself, writes them again, and True means stored."""
    pool = make_host_pool()
    writer = make_backend(storage_config(tmp_path), pool)
    other = make_backend(storage_config(tmp_path), pool)
    keys = keys_for("removed", 8)
    idx = pool.alloc(8 * PAGE)
    fill_pages(pool, idx, gen)
    expected = [page_bytes(pool, int(idx[i * PAGE])) for i in range(8)]
    assert writer.batch_set_v1(keys, idx) == [True] * 8
    assert writer.batch_exists(keys) == 8  # now in the writer's presence cache
    assert other.clear()
    assert writer.batch_set_v1(keys, idx) == [True] * 8
    out = pool.alloc(8 * PAGE)
    poison_pages(pool, out)
    assert other.batch_get_v1(keys, out) == [True] * 8
    assert [page_bytes(pool, int(out[i * PAGE])) for i in range(8)] == expected
    writer.close()
    other.close()


def test_only_the_storage_writer_writes_replicated_mla(tmp_path, gen):
    """MLA KV is replicated across TP: rank 1 is not the writer, answers True, stores nothing."""
    pool = make_host_pool("mla", "page_first")
    reader = make_backend(storage_config(tmp_path, mla=True, tp_rank=1, tp_size=2), pool)
    assert not reader.storage_config.is_storage_writer
    idx = pool.alloc(3 * PAGE)
    fill_pages(pool, idx, gen)
    keys = keys_for("mla-writer", 3)
    assert reader.batch_set_v1(keys, idx) == [True] * 3
    assert reader.batch_exists(keys) == 0
    writer = make_backend(storage_config(tmp_path, mla=True, tp_rank=0, tp_size=2), pool)
    assert writer.batch_set_v1(keys, idx) == [True] * 3
    assert reader.batch_exists(keys) == 3, "MLA pages are shared by every TP rank"
    reader.close()
    writer.close()


def test_metrics_and_sglang_storage_stats(tmp_path, gen):
    pool = make_host_pool()
    backend = make_backend(storage_config(tmp_path, metrics=True), pool)
    idx = pool.alloc(5 * PAGE)
    fill_pages(pool, idx, gen)
    keys = keys_for("metrics", 5)
    hits_before, misses_before = counter("read", "hit"), counter("read", "miss")
    bytes_before = REGISTRY.get_sample_value("kvtier_sglang_bytes_total", {"pool": "kv", "op": "read"}) or 0.0
    assert backend.batch_set_v1(keys[:3], idx[: 3 * PAGE]) == [True] * 3
    assert backend.batch_get_v1(keys, pool.alloc(5 * PAGE)) == [True, True, True, False, False]
    assert counter("read", "hit") - hits_before == 3
    assert counter("read", "miss") - misses_before == 2
    read_bytes = REGISTRY.get_sample_value("kvtier_sglang_bytes_total", {"pool": "kv", "op": "read"})
    assert read_bytes - bytes_before == 3 * backend._anchor.page_bytes
    stats = backend.get_stats()
    assert isinstance(stats, StorageMetrics)
    assert stats.backup_pgs == [3] and stats.prefetch_pgs == [3]
    assert len(stats.prefetch_bandwidth) == 1 and stats.prefetch_bandwidth[0] > 0
    assert backend.get_stats().prefetch_pgs == [], "stats are drained by each call"
    backend.close()


def test_concurrent_backup_prefetch_and_exists_threads(tmp_path, gen):
    """SGLang calls set, get and exists from its backup, prefetch and query threads at once."""
    pool = make_host_pool(size=1024)
    backend = make_backend(storage_config(tmp_path), pool)
    batches = 12
    sources = [pool.alloc(4 * PAGE) for _ in range(batches)]
    for idx in sources:
        fill_pages(pool, idx, gen)
    keys = [keys_for(f"thread-{b}", 4) for b in range(batches)]
    written = [threading.Event() for _ in range(batches)]
    errors: list[BaseException] = []

    def backup():
        try:
            for b in range(batches):
                assert backend.batch_set_v1(keys[b], sources[b]) == [True] * 4
                written[b].set()
        except BaseException as exc:
            errors.append(exc)

    def prefetch(batch_ids):
        try:
            for b in batch_ids:
                assert written[b].wait(60)
                assert backend.batch_exists(keys[b]) == 4
                dst = dsts[b]
                assert backend.batch_get_v1(keys[b], dst) == [True] * 4
        except BaseException as exc:
            errors.append(exc)

    dsts = [pool.alloc(4 * PAGE) for _ in range(batches)]
    for dst in dsts:
        poison_pages(pool, dst)
    threads = [threading.Thread(target=backup)] + [
        threading.Thread(target=prefetch, args=(range(r, batches, 3),)) for r in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for b in range(batches):
        for a, d in zip(page_starts(sources[b]), page_starts(dsts[b])):
            assert page_bytes(pool, d) == page_bytes(pool, a)
    backend.close()


def test_counters_reach_sglang_multiprocess_scrape(tmp_path):
    """SGLang serves /metrics in prometheus-client's multiprocess mode: counters a scheduler
    process bumps are read back from PROMETHEUS_MULTIPROC_DIR by the server's collector."""
    metrics_dir = tmp_path / "prom"
    metrics_dir.mkdir()
    code = textwrap.dedent(f"""
        import torch
        from sglang_pools import PAGE, fill_pages, keys_for, make_backend, make_host_pool, storage_config
        pool = make_host_pool()
        backend = make_backend(storage_config({str(tmp_path / 'store')!r}), pool)
        idx = pool.alloc(3 * PAGE)
        fill_pages(pool, idx, torch.Generator().manual_seed(1))
        assert backend.batch_set_v1(keys_for("scrape", 3), idx) == [True] * 3
        assert backend.batch_get_v1(keys_for("scrape", 4), pool.alloc(4 * PAGE)) == [True, True, True, False]
        backend.close()
    """)
    here = str(Path(__file__).resolve().parent)
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(metrics_dir), PYTHONPATH=here)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(metrics_dir))
    assert registry.get_sample_value("kvtier_sglang_pages_total", {"pool": "kv", "op": "read", "result": "hit"}) == 3
    assert registry.get_sample_value("kvtier_sglang_pages_total", {"pool": "kv", "op": "read", "result": "miss"}) == 1
    assert registry.get_sample_value("kvtier_sglang_pages_total", {"pool": "kv", "op": "write", "result": "written"}) == 3
