"""The v2 interface: a speculative draft's sidecar host pool, and a logical anchor pool."""

from __future__ import annotations

import pytest

pytest.importorskip("nixl_cu13")
pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLAHostAllocation, MLATokenToKVPoolHost  # noqa: E402

from sglang_pools import (  # noqa: E402
    PAGE,
    fill_pages,
    keys_for,
    make_backend,
    make_host_pool,
    page_bytes,
    page_starts,
    poison_pages,
    storage_config,
)
from test_backend_v1 import record_fp8  # noqa: E402


def draft_setup(tmp_path, fp8=False):
    """A target KV host pool and an EAGLE-style one-layer draft pool over the same host indices
    (``SidecarPoolSpec(DRAFT, indices_from_pool=KV)``, ``hybrid_pool_assembler.py:1652``)."""
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    if fp8:
        record_fp8(role="target")
        record_fp8(role="draft", k_scales=(0.75,), v_scales=(1.5,))
    kv = make_host_pool("mha", "page_first", dtype=dtype, layers=3)
    draft = make_host_pool("mha", "page_first", dtype=dtype, layers=1)
    assert draft.size == kv.size
    backend = make_backend(storage_config(tmp_path), kv)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    backend.register_mem_host_pool_v2(draft, PoolName.DRAFT)
    backend.on_host_pools_registered()
    return kv, draft, backend


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_draft_sidecar_round_trip(tmp_path, gen, fp8):
    kv, draft, backend = draft_setup(tmp_path, fp8)
    n = 5
    src, dst = kv.alloc(n * PAGE), kv.alloc(n * PAGE)
    fill_pages(kv, src, gen)
    fill_pages(draft, src, gen)
    poison_pages(kv, dst)
    poison_pages(draft, dst)
    keys = keys_for("draft", n)

    assert backend.batch_set_v1(keys, src) == [True] * n
    written = backend.batch_set_v2([PoolTransfer(name=PoolName.DRAFT, host_indices=src, keys=keys)])
    assert written == {PoolName.DRAFT: [True] * n}

    query = backend.batch_exists_v2(keys, [PoolTransfer(name=PoolName.DRAFT, indices_from_pool=PoolName.KV)])
    assert query.kv_hit_pages == n
    assert query.extra_pool_hit_pages == {PoolName.KV: n, PoolName.DRAFT: n}
    assert query.restorable_prefix_pages == list(range(1, n + 1))

    assert backend.batch_get_v1(keys, dst) == [True] * n
    got = backend.batch_get_v2([PoolTransfer(name=PoolName.DRAFT, host_indices=dst, keys=keys)])
    assert got == {PoolName.DRAFT: [True] * n}
    for a, b in zip(page_starts(src), page_starts(dst)):
        assert page_bytes(kv, b) == page_bytes(kv, a)
        assert page_bytes(draft, b) == page_bytes(draft, a)
    assert page_bytes(draft, page_starts(dst)[0]) != page_bytes(kv, page_starts(dst)[0])
    backend.close()


def test_missing_draft_pages_shorten_the_usable_prefix(tmp_path, gen):
    kv, draft, backend = draft_setup(tmp_path)
    n = 6
    idx = kv.alloc(n * PAGE)
    fill_pages(kv, idx, gen)
    fill_pages(draft, idx, gen)
    keys = keys_for("draft-short", n)
    assert backend.batch_set_v1(keys, idx) == [True] * n
    assert backend.batch_set_v2([PoolTransfer(name=PoolName.DRAFT, host_indices=idx[: 4 * PAGE], keys=keys[:4])]) == {
        PoolName.DRAFT: [True] * 4
    }
    query = backend.batch_exists_v2(keys, [PoolTransfer(name=PoolName.DRAFT)])
    assert query.kv_hit_pages == 4
    assert query.extra_pool_hit_pages == {PoolName.KV: 6, PoolName.DRAFT: 4}

    trailing = backend.batch_exists_v2(
        keys, [PoolTransfer(name=PoolName.DRAFT, keys=keys[-2:], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    )
    assert trailing.restorable_prefix_pages == [1, 2, 3, 4]
    assert trailing.kv_hit_pages == 4
    backend.close()


def test_unregistered_pool_is_a_miss_not_an_error(tmp_path, gen):
    kv = make_host_pool()
    backend = make_backend(storage_config(tmp_path), kv)
    idx = kv.alloc(2 * PAGE)
    fill_pages(kv, idx, gen)
    keys = keys_for("unregistered", 2)
    assert backend.batch_set_v1(keys, idx) == [True, True]
    transfer = PoolTransfer(name=PoolName.DRAFT, host_indices=idx, keys=keys)
    assert backend.batch_set_v2([transfer]) == {PoolName.DRAFT: [False, False]}
    assert backend.batch_get_v2([transfer]) == {PoolName.DRAFT: [False, False]}
    assert backend.batch_exists_v2(keys, [transfer]).kv_hit_pages == 0
    backend.close()


def test_logical_anchor_defers_to_its_sidecars(tmp_path, gen):
    """A KV anchor without kv_buffer (DeepSeek V4's allocator-only pool) holds no bytes: v1 is all
    True, and the usable prefix is what the v2 pools hold (as SGLang's Mooncake backend does)."""
    allocation = MLAHostAllocation(
        dtype=torch.bfloat16, kv_lora_rank=16, qk_rope_head_dim=8, kv_cache_dim=24, size_per_token=24 * 2 * 3,
    )
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    with host_memory_budget_scope(1 << 30):
        anchor = MLATokenToKVPoolHost(
            allocation, 2.0, 0, PAGE, "page_first", pin_memory=False, device="cpu",
            device_capacity_tokens=128, start_layer=0, end_layer=2, target_layer_num=3,
        )
    assert anchor.kv_buffer is None
    side = make_host_pool("mha", "page_first", layers=1, size=128)
    backend = make_backend(storage_config(tmp_path), anchor)
    backend.register_mem_host_pool_v2(side, PoolName.SWA)
    keys = keys_for("anchor", 3)
    idx = anchor.alloc(3 * PAGE)
    fill_pages(side, idx, gen)
    assert backend.batch_set_v1(keys, idx) == [True] * 3
    assert backend.batch_get_v1(keys, idx) == [True] * 3
    assert backend.batch_exists(keys) == 0
    assert backend.batch_set_v2([PoolTransfer(name=PoolName.SWA, host_indices=idx[: 2 * PAGE], keys=keys[:2])]) == {
        PoolName.SWA: [True, True]
    }
    query = backend.batch_exists_v2(keys, [PoolTransfer(name=PoolName.SWA)])
    assert query.kv_hit_pages == 2
    with pytest.raises(ValueError, match="has no kv_buffer"):
        backend.register_mem_host_pool_v2(anchor, PoolName.DRAFT)
    assert backend.batch_get_v2([PoolTransfer(name=PoolName.DRAFT, host_indices=idx, keys=keys)]) == {
        PoolName.DRAFT: [False] * 3
    }, "a pool without bytes is never answered True outside the KV anchor"
    backend.close()
