"""Helpers of the SGLang harness: real SGLang pools, configs and backends on the CPU.

Builds real SGLang device pools on ``device="cpu"``, their host pools (``pin_memory=False``
inside ``host_memory_budget_scope``), real ``HiCacheStorageConfig`` objects, and backends through
SGLang's ``StorageBackendFactory`` ``dynamic`` path; reads and writes page bytes both through
SGLang's ``get_page_buffer_meta`` and by indexing the pool's buffer per layout.
"""

from __future__ import annotations

import ctypes
import hashlib

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

PAGE = 4
SGLANG_EXTRA = {
    "backend_name": "kvtier",
    "module_path": "kvtier.adapters.sglang.backend",
    "class_name": "KvtierHiCacheStorage",
    "interface_v1": 1,
}


def make_host_pool(kind="mha", layout="page_first", dtype=None, layers=3, heads=2, head_dim=16,
                   v_head_dim=None, size=256, page=PAGE):
    """A real SGLang host pool mirroring a real SGLang device pool, both on the CPU."""
    dtype = dtype or torch.bfloat16
    with host_memory_budget_scope(1 << 30):
        if kind == "mha":
            device = MHATokenToKVPool(
                size=size, page_size=page, dtype=dtype, head_num=heads, head_dim=head_dim,
                layer_num=layers, device="cpu", enable_memory_saver=False, v_head_dim=v_head_dim,
            )
            info = device.get_device_pool_infos()[0].buffer_info
            return get_mha_host_pool_cls(info)(
                info, 2.0, 0, page, layout, pin_memory=False, device="cpu",
                device_capacity_tokens=device.size, start_layer=device.start_layer, end_layer=device.end_layer,
            )
        device = MLATokenToKVPool(
            size=size, page_size=page, dtype=dtype, kv_lora_rank=head_dim, qk_rope_head_dim=8,
            layer_num=layers, device="cpu", enable_memory_saver=False,
        )
        info = device.get_device_pool_infos()[0].buffer_info
        return MLATokenToKVPoolHost(
            info, 2.0, 0, page, layout, pin_memory=False, device="cpu",
            device_capacity_tokens=device.size, start_layer=device.start_layer,
            end_layer=device.end_layer, target_layer_num=device.layer_num,
        )


def storage_config(path, *, mla=False, tp_rank=0, tp_size=1, model="org/model", metrics=False, **extra):
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=metrics, is_page_first_layout=True,
        model_name=model, extra_config={**SGLANG_EXTRA, "path": str(path), **extra},
    )


def make_backend(config, pool):
    """A backend through SGLang's factory (``dynamic``), registered with ``pool`` as SGLang's
    cache controller does (``managers/cache_controller.py:614``)."""
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


def page_bytes(pool, first_index: int) -> bytes:
    """The bytes of the page starting at host index ``first_index``, read through SGLang's own
    ``get_page_buffer_meta`` pointers, in piece order."""
    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(first_index, first_index + pool.page_size))
    return b"".join(ctypes.string_at(p, s) for p, s in zip(ptrs, sizes))


def page_tensor_bytes(pool, start: int) -> bytes:
    """The same page's bytes taken by indexing the pool's ``kv_buffer`` per layout, without
    ``get_page_buffer_meta``: K then V for MHA page-first layouts, K and V of each layer for MHA
    ``layer_first``, the row block for MLA, one block per layer for MLA ``layer_first``."""
    buf, page = pool.kv_buffer, pool.page_size
    if isinstance(buf, tuple):
        parts = [buf[0][start : start + page], buf[1][start : start + page]]
    elif hasattr(pool, "kv_lora_rank"):
        if pool.layout == "layer_first":
            parts = [buf[layer, start : start + page] for layer in range(pool.layer_num)]
        elif pool.layout == "page_first":
            parts = [buf[start : start + page]]
        else:
            parts = [buf[start // page]]
    elif pool.layout == "layer_first":
        parts = [buf[kv, layer, start : start + page] for layer in range(pool.layer_num) for kv in (0, 1)]
    elif pool.layout == "page_first":
        parts = [buf[0, start : start + page], buf[1, start : start + page]]
    else:
        parts = [buf[0, start // page], buf[1, start // page]]
    return b"".join(part.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for part in parts)


def fill_pages(pool, indices, gen) -> None:
    """Random bytes (1..255, never 0) in every piece of the pages at ``indices``."""
    ptrs, sizes = pool.get_page_buffer_meta(indices)
    for p, s in zip(ptrs, sizes):
        data = torch.randint(1, 256, (s,), dtype=torch.uint8, generator=gen)
        ctypes.memmove(p, data.data_ptr(), s)


def poison_pages(pool, indices) -> None:
    ptrs, sizes = pool.get_page_buffer_meta(indices)
    for p, s in zip(ptrs, sizes):
        ctypes.memset(p, 0, s)


def page_starts(indices, page=PAGE):
    return [int(i) for i in indices[::page]]


def keys_for(prefix: str, n: int) -> list[str]:
    return [hashlib.sha256(f"{prefix}-{i}".encode()).hexdigest() for i in range(n)]
