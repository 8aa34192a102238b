"""A store holding pages of other formats says so: the pool logs which namespaces are there
(decoded) and how many pages, and `kvtier store check` lists them with page counts and bytes.
Real pools, a real store directory, the real store tool."""

from __future__ import annotations

import json
import logging

import pytest

from kvtier import PageFormat, TieredPool, prefix_keys
from tests.conftest import fill_random

pytest.importorskip("nixl_cu13")

BF16_16 = PageFormat(num_layers=3, num_kv_heads=2, head_dim=32, page_size=16, dtype="bf16")
FP8_32 = PageFormat(num_layers=3, num_kv_heads=2, head_dim=32, page_size=32, dtype="fp8", scale="per_page_head")


def fill(store, fmt, pages, gen, model="llama"):
    with TieredPool(fmt, device_pages=8, host_pages=16, remote=str(store), remote_capacity_bytes=64 << 20,
                    registry=None, model=model, write_policy="write_through") as pool:
        keys = prefix_keys(list(range(fmt.page_size * pages)), fmt.page_size, pool.namespace)
        for i in range(0, pages, 4):
            slots = pool.allocate(4)
            fill_random(pool, slots, gen)
            pool.commit(keys[i : i + 4], slots)
            pool.release(slots)
        assert pool.flush() == 0
        return pool.namespace


def test_a_pool_over_pages_of_another_format_logs_them_once_decoded(tmp_path, gen, caplog):
    store = tmp_path / "store"
    fill(store, BF16_16, 12, gen)
    with caplog.at_level(logging.INFO, logger="kvtier.tiers.remote.store"):
        with TieredPool(FP8_32, device_pages=8, host_pages=16, remote=str(store), remote_capacity_bytes=64 << 20,
                        registry=None, model="llama") as pool:
            keys = prefix_keys(list(range(32 * 4)), 32, pool.namespace)
            assert pool.match(keys).total == 0
    (record,) = [r for r in caplog.records if "other namespaces" in r.getMessage()]
    text = record.getMessage()
    assert record.levelno == logging.WARNING  # none of this pool's pages are there: the likely mistake
    assert f"remote store {store} holds 0 pages of this namespace (model llama, rank 0, fp8_e4m3 pages of 32 tokens" in text
    assert "12 pages of 1 other namespaces" in text
    assert "model llama, rank 0, bf16 pages of 16 tokens, 3 layers x 2 kv heads x 32: 12 pages" in text


def test_a_store_of_one_namespace_logs_nothing(tmp_path, gen, caplog):
    store = tmp_path / "store"
    fill(store, BF16_16, 4, gen)
    with caplog.at_level(logging.INFO, logger="kvtier.tiers.remote.store"):
        fill(store, BF16_16, 4, gen)
    assert not [r for r in caplog.records if "other namespaces" in r.getMessage()]


def test_store_check_lists_namespaces_decoded_with_pages_and_bytes(tmp_path, gen, capsys):
    from kvtier.cli import main

    store = tmp_path / "store"
    bf16 = fill(store, BF16_16, 8, gen)
    fp8 = fill(store, FP8_32, 4, gen, model="draft")
    assert main(["store", "check", str(store), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "model llama, rank 0, bf16 pages of 16 tokens, 3 layers x 2 kv heads x 32: 8 pages" in out
    assert "model draft, rank 0, fp8_e4m3 pages of 32 tokens, 3 layers x 2 kv heads x 32, scale per_page_head: 4 pages" in out
    assert main(["store", "check", str(store), "--json", "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    from kvtier.tiers.remote.records import namespace_fingerprint

    entries = {ns: report["namespaces"][namespace_fingerprint(n.digest).hex()] for ns, n in (("bf16", bf16), ("fp8", fp8))}
    assert (entries["bf16"]["pages"], entries["bf16"]["used_bytes"]) == (8, 8 * BF16_16.page_bytes)
    assert (entries["fp8"]["pages"], entries["fp8"]["used_bytes"]) == (4, 4 * FP8_32.page_bytes)
    assert entries["fp8"]["label"] == {"model": "draft", "rank": 0, "format": {
        "dtype": "fp8_e4m3", "device_dtype": "fp8_e4m3", "page_size": 32, "num_layers": 3, "num_kv_heads": 2,
        "head_dim": 32, "scale": "per_page_head", "layout": "nhd", "mla": False}}
