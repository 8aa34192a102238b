"""Namespaces: pages written under one KV format, geometry or rank never hit under another."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("nixl_cu13")
pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

import torch  # noqa: E402

from sglang_pools import (  # noqa: E402
    PAGE,
    fill_pages,
    keys_for,
    make_backend,
    make_host_pool,
    page_bytes,
    page_starts,
    storage_config,
)
from test_backend_v1 import attention_model, record_fp8  # noqa: E402
from kvtier.adapters.sglang.namespace import (  # noqa: E402
    kv_scale_fingerprint,
    pool_namespace,
    record_kv_format,
    resolve_kv_format,
)

SCALES_K, SCALES_V = (0.5, 0.25, 2.0), (1.0, 0.125, 4.0)


def write_pages(tmp_path, gen, pool, keys, **config):
    backend = make_backend(storage_config(tmp_path, **config), pool)
    idx = pool.alloc(len(keys) * PAGE)
    fill_pages(pool, idx, gen)
    assert backend.batch_set_v1(keys, idx) == [True] * len(keys)
    backend.close()
    return idx


def hits(tmp_path, pool, keys, **config) -> tuple[int, list[bool]]:
    backend = make_backend(storage_config(tmp_path, **config), pool)
    try:
        return backend.batch_exists(keys), backend.batch_get_v1(keys, pool.alloc(len(keys) * PAGE))
    finally:
        backend.close()


def test_same_format_hits_in_a_fresh_backend(tmp_path, gen):
    """The control for every test below: an equal namespace does hit, bytes and all."""
    pool = make_host_pool("mha", "page_first", dtype=torch.float8_e4m3fn)
    record_fp8()
    keys = keys_for("control", 3)
    src = write_pages(tmp_path, gen, pool, keys)
    record_fp8()
    backend = make_backend(storage_config(tmp_path), pool)
    dst = pool.alloc(3 * PAGE)
    assert backend.batch_exists(keys) == 3
    assert backend.batch_get_v1(keys, dst) == [True] * 3
    assert [page_bytes(pool, d) for d in page_starts(dst)] == [page_bytes(pool, s) for s in page_starts(src)]
    backend.close()


def test_other_fp8_dtype_misses(tmp_path, gen):
    """e4m3 and e5m2 pages are both uint8 in SGLang's pool; only the recorded dtype tells them apart."""
    pool = make_host_pool("mha", "page_first", dtype=torch.float8_e4m3fn)
    keys = keys_for("fp8-dtype", 3)
    record_fp8(kv_dtype=torch.float8_e4m3fn)
    write_pages(tmp_path, gen, pool, keys)
    record_fp8(kv_dtype=torch.float8_e5m2)
    assert hits(tmp_path, pool, keys) == (0, [False] * 3)


def test_other_scales_miss(tmp_path, gen):
    pool = make_host_pool("mla", "page_first", dtype=torch.float8_e4m3fn)
    keys = keys_for("fp8-scales", 3)
    record_fp8(k_scales=SCALES_K, v_scales=SCALES_V)
    write_pages(tmp_path, gen, pool, keys, mla=True)
    record_fp8(k_scales=SCALES_K, v_scales=(1.0, 0.125, 4.0000005))
    assert hits(tmp_path, pool, keys, mla=True) == (0, [False] * 3)
    record_fp8(k_scales=SCALES_K, v_scales=SCALES_V)
    assert hits(tmp_path, pool, keys, mla=True) == (3, [True] * 3)


def test_other_float_dtype_misses(tmp_path, gen):
    keys = keys_for("float-dtype", 2)
    write_pages(tmp_path, gen, make_host_pool(dtype=torch.bfloat16), keys)
    record_kv_format("target", torch.nn.Module(), torch.float16)
    assert hits(tmp_path, make_host_pool(dtype=torch.float16), keys) == (0, [False] * 2)


def test_other_layer_count_misses(tmp_path, gen):
    """layer_first pieces are per layer and of equal size: only the count differs."""
    keys = keys_for("layers", 2)
    write_pages(tmp_path, gen, make_host_pool(layout="layer_first", layers=3), keys)
    assert hits(tmp_path, make_host_pool(layout="layer_first", layers=4), keys) == (0, [False] * 2)
    assert hits(tmp_path, make_host_pool(layout="layer_first", layers=3), keys)[0] == 2


def test_other_tp_rank_misses_for_mha_and_hits_for_mla(tmp_path, gen):
    keys = keys_for("tp", 2)
    pool = make_host_pool("mha", "page_first")
    write_pages(tmp_path, gen, pool, keys, tp_rank=0, tp_size=2)
    assert hits(tmp_path, pool, keys, tp_rank=1, tp_size=2) == (0, [False] * 2)
    assert hits(tmp_path, pool, keys, tp_rank=0, tp_size=4) == (0, [False] * 2)
    mla = make_host_pool("mla", "page_first")
    write_pages(tmp_path, gen, mla, keys, mla=True, tp_rank=0, tp_size=2)
    assert hits(tmp_path, mla, keys, mla=True, tp_rank=1, tp_size=2) == (2, [True] * 2)


def test_other_model_layout_or_tag_misses(tmp_path, gen):
    keys = keys_for("model", 2)
    write_pages(tmp_path, gen, make_host_pool(layout="page_first"), keys)
    assert hits(tmp_path, make_host_pool(layout="page_first"), keys, model="org/other")[0] == 0
    assert hits(tmp_path, make_host_pool(layout="page_first_direct"), keys)[0] == 0
    assert hits(tmp_path, make_host_pool(layout="page_first"), keys, namespace_tag="v2")[0] == 0
    assert hits(tmp_path, make_host_pool(layout="page_first"), keys)[0] == 2


def test_scale_fingerprint_sees_every_scale_exactly():
    base, layers = kv_scale_fingerprint(attention_model(3, SCALES_K, SCALES_V))
    assert layers == 3
    assert kv_scale_fingerprint(attention_model(3, SCALES_K, SCALES_V))[0] == base
    for layer in range(3):
        k = list(SCALES_K)
        k[layer] = float(torch.nextafter(torch.tensor(k[layer], dtype=torch.float64), torch.tensor(9.0, dtype=torch.float64)))
        assert kv_scale_fingerprint(attention_model(3, k, SCALES_V))[0] != base
    swapped = attention_model(3, SCALES_V, SCALES_K)
    assert kv_scale_fingerprint(swapped)[0] != base


def test_scale_fingerprint_reads_loaded_parameters_when_no_float():
    """A layer whose scales were loaded as parameters but not folded into *_scale_float yet."""
    model = attention_model(2, (1.0, 1.0), (1.0, 1.0))
    for block in model.layers:
        block.attn.k_scale_float = None
        block.attn.v_scale_float = None
    default = kv_scale_fingerprint(model)[0]
    model.layers[1].attn.k_scale = torch.nn.Parameter(torch.tensor(0.5), requires_grad=False)
    assert kv_scale_fingerprint(model)[0] != default


def test_fp8_pool_without_a_record_is_refused():
    """A fresh process: no model runner recorded anything, so an fp8 (uint8) pool is refused
    with the cause named; a bf16 pool needs no record."""
    code = (
        "import torch\n"
        "from kvtier.adapters.sglang.namespace import resolve_kv_format\n"
        "assert resolve_kv_format('target', torch.bfloat16).kv_dtype == 'torch.bfloat16'\n"
        "try:\n"
        "    resolve_kv_format('target', torch.uint8)\n"
        "except ValueError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "torch.uint8" in out.stdout and "SGLANG_PLUGINS" in out.stdout


def test_fp8_record_without_attention_layers_is_refused():
    record_kv_format("target", torch.nn.Linear(2, 2), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="no attention layer"):
        resolve_kv_format("target", torch.uint8)


def test_record_that_does_not_match_the_pool_is_refused():
    record_kv_format("target", torch.nn.Module(), torch.bfloat16)
    with pytest.raises(ValueError, match="torch.bfloat16 .2 bytes. but the host pool stores torch.uint8"):
        resolve_kv_format("target", torch.uint8)


def test_namespace_fields_name_what_was_asked(tmp_path):
    pool = make_host_pool("mha", "layer_first")
    fmt = resolve_kv_format("target", pool.dtype)
    digest, fields = pool_namespace(
        pool=pool, pool_name="kv", storage_config=storage_config(tmp_path, tp_rank=1, tp_size=2),
        kv_format=fmt, replicated=False, piece_sizes=(128,) * 6,
    )
    assert len(digest) == 64
    assert fields["tp"] == [1, 2] and fields["layers"] == 3 and fields["layout"] == "layer_first"
    assert fields["geometry"] == {"kind": "mha", "head_num": 2, "head_dim": 16, "v_head_dim": 16}
    _, replicated = pool_namespace(
        pool=pool, pool_name="kv", storage_config=storage_config(tmp_path, tp_rank=1, tp_size=2),
        kv_format=fmt, replicated=True, piece_sizes=(128,) * 6,
    )
    assert replicated["tp"] is None
