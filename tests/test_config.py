"""kvtier.config: real files (JSON, TOML, YAML), the real environment, real pools built from them."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvtier import PageFormat, TieredPool, prefix_keys
from kvtier.config import ConfigError, parse_size, pool_from_config, pool_kwargs
from tests.conftest import fill_random, poison, snapshot

FORMAT = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "page_size": 4, "dtype": "fp8", "scale": "per_page_head"}
PAGE_BYTES = PageFormat(**FORMAT).page_bytes

TOML = f"""
device = "cpu"
device_pages = 8
host_bytes = "{24 * PAGE_BYTES}"
write_policy = "write_back"
model = "llama"
rank = 3

[format]
num_layers = 2
num_kv_heads = 2
head_dim = 16
page_size = 4
dtype = "fp8"
scale = "per_page_head"
"""

YAML = f"""
device: cpu
device_pages: 8
host_bytes: {24 * PAGE_BYTES}
write_policy: write_back
model: llama
rank: 3
format:
  num_layers: 2
  num_kv_heads: 2
  head_dim: 16
  page_size: 4
  dtype: fp8
  scale: per_page_head
"""


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No KVTIER_* variable from the calling shell leaks into these tests."""
    for var in [v for v in os.environ if v.startswith("KVTIER_")]:
        monkeypatch.delenv(var)


def write_files(tmp_path):
    as_json = dict(
        device="cpu", device_pages=8, host_bytes=24 * PAGE_BYTES, write_policy="write_back", model="llama", rank=3, format=FORMAT
    )
    (tmp_path / "kv.json").write_text(json.dumps(as_json))
    (tmp_path / "kv.toml").write_text(TOML)
    (tmp_path / "kv.yaml").write_text(YAML)
    return [tmp_path / "kv.json", tmp_path / "kv.toml", tmp_path / "kv.yaml"]


def test_json_toml_and_yaml_describe_the_same_pool(tmp_path):
    files = write_files(tmp_path)
    kwargs = [pool_kwargs(path) for path in files]
    assert kwargs[0] == kwargs[1] == kwargs[2]
    assert kwargs[0]["fmt"] == PageFormat(**{**FORMAT, "dtype": "fp8_e4m3"})
    assert kwargs[0]["host_bytes"] == 24 * PAGE_BYTES and kwargs[0]["rank"] == 3


def test_a_pool_from_a_file_moves_pages_exactly(tmp_path, gen):
    (path,) = [p for p in write_files(tmp_path) if p.suffix == ".toml"]
    with pool_from_config(path, registry=CollectorRegistry()) as pool:
        assert isinstance(pool, TieredPool)
        assert pool.host_tier.num_pages == 24 and pool.device_tier.num_pages == 8
        assert pool.write_policy.name == "write_back" and pool.namespace.rank == 3
        keys = prefix_keys(list(range(4 * 20)), 4, pool.namespace)
        truth = {}
        for i in range(0, 20, 4):
            slots = pool.allocate(4)
            fill_random(pool, slots, gen)
            truth.update({k: snapshot(pool, s) for k, s in zip(keys[i : i + 4], slots)})
            pool.commit(keys[i : i + 4], slots)
            pool.release(slots)
        slots = pool.allocate(4)
        poison(pool, slots)
        pool.load(keys[:4], slots).wait()
        assert [snapshot(pool, s) for s in slots] == [truth[k] for k in keys[:4]]
        pool.release(slots)


def test_environment_overrides_the_file_and_keywords_override_both(tmp_path, monkeypatch):
    (path,) = [p for p in write_files(tmp_path) if p.suffix == ".yaml"]
    monkeypatch.setenv("KVTIER_HOST_BYTES", "1MiB")
    monkeypatch.setenv("KVTIER_WRITE_POLICY", "write_through")
    monkeypatch.setenv("KVTIER_FORMAT_DTYPE", "fp8_e5m2")
    monkeypatch.setenv("KVTIER_FORMAT_DEVICE_DTYPE", "bfloat16")
    kwargs = pool_kwargs(path)
    assert kwargs["host_bytes"] == 2**20 and kwargs["write_policy"] == "write_through"
    assert (kwargs["fmt"].dtype, kwargs["fmt"].device_dtype) == ("fp8_e5m2", "bf16")
    kwargs = pool_kwargs(path, host_bytes="2MiB", rank=0)
    assert kwargs["host_bytes"] == 2 * 2**20 and kwargs["rank"] == 0


def test_a_later_source_sizes_the_host_tier_by_the_other_key(tmp_path, monkeypatch):
    (path,) = [p for p in write_files(tmp_path) if p.suffix == ".toml"]  # host_bytes in the file
    monkeypatch.setenv("KVTIER_HOST_PAGES", "32")
    kwargs = pool_kwargs(path)
    assert kwargs["host_pages"] == 32 and "host_bytes" not in kwargs
    kwargs = pool_kwargs(path, host_bytes="64KiB")
    assert kwargs["host_bytes"] == 65536 and "host_pages" not in kwargs
    with pytest.raises(ConfigError, match="KVTIER_HOST_BYTES = 4096 and KVTIER_HOST_PAGES = 32 both size the host tier"):
        monkeypatch.setenv("KVTIER_HOST_BYTES", "4096")
        pool_kwargs(path)


def test_a_cuda_copy_path_is_kept_for_a_cuda_device():
    kwargs = pool_kwargs({"format": FORMAT, "device": "cuda:0", "copy_path": "kernel"})
    assert (kwargs["device"], kwargs["copy_path"]) == ("cuda:0", "kernel")


def test_kvtier_config_names_the_file_when_none_is_given(tmp_path, monkeypatch):
    (path,) = [p for p in write_files(tmp_path) if p.suffix == ".json"]
    monkeypatch.setenv("KVTIER_CONFIG", str(path))
    assert pool_kwargs() == pool_kwargs(path)


def test_the_environment_alone_with_a_format_object():
    fmt = PageFormat(**FORMAT)
    assert pool_kwargs(fmt=fmt, host_pages="32") == {"fmt": fmt, "host_pages": 32}


def test_remote_tier_from_config_and_turned_off_by_an_empty_variable(tmp_path, monkeypatch):
    pytest.importorskip("nixl_cu13")
    store = tmp_path / "store"
    config = {"format": FORMAT, "device_pages": 4, "host_pages": 8, "remote": f"file://{store}", "remote_capacity_bytes": "64MiB"}
    with pool_from_config(config, registry=CollectorRegistry()) as pool:
        assert pool.remote is not None and pool.remote.capacity_bytes == 64 * 2**20
    assert store.is_dir()
    monkeypatch.setenv("KVTIER_REMOTE", "")
    with pool_from_config(config, registry=CollectorRegistry()) as pool:
        assert pool.remote is None


@pytest.mark.parametrize(
    "text, expected",
    [
        ("64GiB", 64 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("4096", 4096),
        (4096, 4096),
        (" 2 kb ", 2000),
        ("1.5KiB", 1536),
        ("3TB", 3 * 10**12),
        ("1pib", 2**50),
        (2.5e9, 2_500_000_000),
    ],
)
def test_human_sizes(text, expected):
    assert parse_size(text, "host_bytes") == expected


@pytest.mark.parametrize("bad", ["64G", "64 gigs", "-1GB", "0", "0.5B", "1.0001KB", "1e3", "GiB", "", True, None, [64]])
def test_bad_sizes_name_the_option_and_the_value(bad):
    with pytest.raises(ConfigError, match="host_bytes") as err:
        parse_size(bad, "host_bytes")
    assert repr(bad) in str(err.value)


@pytest.mark.parametrize(
    "config, words",
    [
        ({"host_byte": 1}, ["'host_byte'", "did you mean 'host_bytes'"]),
        ({"format": {**FORMAT, "page_sise": 4}}, ["'format.page_sise'", "did you mean 'page_size'"]),
        ({"format": {**FORMAT, "dtype": "fp8_inc"}}, ["'format.dtype'", "'fp8_inc'", "fp8_e4m3"]),
        ({"format": {**FORMAT, "scale": "per_block"}}, ["'format'", "PageFormat.scale", "per_block"]),
        ({"format": {"num_layers": 2}}, ["'format'", "missing", "num_kv_heads"]),
        ({"format": FORMAT, "write_policy": "write-back"}, ["'write_policy'", "did you mean 'write_back'"]),
        ({"format": FORMAT, "rank": -1}, ["'rank'", "-1"]),
        ({"format": FORMAT, "device_pages": "many"}, ["'device_pages'", "'many'"]),
        ({"format": FORMAT, "host_bytes": "64G"}, ["'host_bytes'", "'64G'"]),
        ({"format": FORMAT, "registry": "x"}, ["'registry'", "Python object"]),
        ({"format": FORMAT, "remote_timeout_s": 3}, ["'remote_timeout_s'", "RemoteStore takes 'timeout_s'"]),
        ({"format": FORMAT, "remote_bogus": 3}, ["'remote_bogus'", "unknown key"]),
        ({"format": FORMAT, "engine": "gpu"}, ["'engine'", "'gpu'"]),
        ({"host_pages": 4}, ["'format' is missing"]),
        ({"format": FORMAT, "copy_path": "kernal"}, ["'copy_path'", "'kernal'", "did you mean 'kernel'"]),
        ({"format": FORMAT, "copy_path": "kernel"}, ["'copy_path' = 'kernel'", "CUDA", "'cpu' (the default)", "copy_path = 'auto'"]),
        ({"format": FORMAT, "copy_path": "staged", "device": "cpu"}, ["'staged'", "device = 'cpu' is not a CUDA device"]),
        ({"format": FORMAT, "copy_path": "copy_engine", "device": "cuda", "engine": "torch"}, ["engine = 'torch'"]),
        ({"format": FORMAT, "host_bytes": "1MiB", "host_pages": 4}, ["'host_bytes' = 1048576", "'host_pages' = 4", "give one"]),
        ({"format": FORMAT, "remote_capacity_bytes": 100}, ["'remote_capacity_bytes' = 100", "holds no page", f"{PAGE_BYTES} bytes"]),
    ],
)
def test_errors_name_the_key(config, words):
    with pytest.raises(ConfigError) as err:
        pool_kwargs(config)
    for word in words:
        assert word in str(err.value)


def test_unknown_environment_variables_are_warned_once_and_errors_when_strict(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr("kvtier.config._warned", set())
    monkeypatch.setenv("KVTIER_HOST_BYTE", "1GiB")
    monkeypatch.setenv("KVTIER_FORMAT_PAGESIZE", "16")
    with caplog.at_level("WARNING", logger="kvtier.config"):
        first = pool_kwargs({"format": FORMAT})
        assert pool_kwargs({"format": FORMAT}) == first  # ignored, so nothing changed
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2, warnings  # once a variable, not once a call
    assert "KVTIER_HOST_BYTE (did you mean 'KVTIER_HOST_BYTES'" in warnings[1]
    assert "KVTIER_FORMAT_PAGESIZE (did you mean 'KVTIER_FORMAT_PAGE_SIZE'" in warnings[0]
    assert "host_bytes" not in first
    # Strict from the mapping, from KVTIER_STRICT, or as a keyword: the same variables are errors.
    with pytest.raises(ConfigError, match="KVTIER_FORMAT_PAGESIZE.*KVTIER_FORMAT_PAGE_SIZE.*strict"):
        pool_kwargs({"format": FORMAT, "strict": True})
    (tmp_path / "kv.toml").write_text(TOML + "\n")
    with pytest.raises(ConfigError, match="KVTIER_FORMAT_PAGESIZE"):
        pool_kwargs(tmp_path / "kv.toml", strict="yes")
    monkeypatch.delenv("KVTIER_FORMAT_PAGESIZE")
    monkeypatch.setenv("KVTIER_STRICT", "1")
    with pytest.raises(ConfigError, match="KVTIER_HOST_BYTE.*did you mean 'KVTIER_HOST_BYTES'"):
        pool_kwargs({"format": FORMAT})
    with pytest.raises(ConfigError, match="KVTIER_HOST_BYTE"):  # the environment wins over the mapping
        pool_kwargs({"format": FORMAT, "strict": False})
    monkeypatch.delenv("KVTIER_STRICT")
    monkeypatch.delenv("KVTIER_HOST_BYTE")
    monkeypatch.setenv("KVTIER_HOST_BYTES", "lots")
    with pytest.raises(ConfigError, match="KVTIER_HOST_BYTES: expected a size .* got 'lots'"):
        pool_kwargs({"format": FORMAT})


def test_variables_kvtier_reads_elsewhere_are_not_unknown(monkeypatch, caplog):
    monkeypatch.setattr("kvtier.config._warned", set())
    for var in ("KVTIER_LOG_LEVEL", "KVTIER_REQUIRE_SGLANG", "KVTIER_STRICT"):
        monkeypatch.setenv(var, "1" if var != "KVTIER_LOG_LEVEL" else "debug")
    with caplog.at_level("WARNING", logger="kvtier.config"):
        pool_kwargs({"format": FORMAT})
    assert not caplog.records


def test_keyword_overrides_are_checked_and_objects_pass_through():
    registry = CollectorRegistry()
    kwargs = pool_kwargs({"format": FORMAT}, registry=registry, engine=lambda dev, host: None)
    assert kwargs["registry"] is registry and callable(kwargs["engine"])
    with pytest.raises(ConfigError, match="keyword 'host_pagess'.*did you mean 'host_pages'"):
        pool_kwargs({"format": FORMAT}, host_pagess=4)
    with pytest.raises(ConfigError, match="'format' and the keyword fmt"):
        pool_kwargs({"format": FORMAT}, fmt=PageFormat(**FORMAT))


def test_dtype_objects_in_a_mapping():
    kwargs = pool_kwargs({"format": {**FORMAT, "dtype": torch.float8_e4m3fn, "device_dtype": torch.bfloat16}})
    assert (kwargs["fmt"].dtype, kwargs["fmt"].device_dtype) == ("fp8_e4m3", "bf16")


def test_file_errors(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="does not exist"):
        pool_kwargs(tmp_path / "missing.toml")
    (tmp_path / "kv.ini").write_text("[x]")
    with pytest.raises(ConfigError, match=r"\.ini"):
        pool_kwargs(tmp_path / "kv.ini")
    (tmp_path / "bad.json").write_text("{host_pages: 4")
    with pytest.raises(ConfigError, match="bad.json.*not valid JSON"):
        pool_kwargs(tmp_path / "bad.json")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping at the top, got list"):
        pool_kwargs(tmp_path / "list.yaml")
    (tmp_path / "bad.toml").write_text("host_pages = = 4")
    with pytest.raises(ConfigError, match="not valid TOML"):
        pool_kwargs(tmp_path / "bad.toml")
    monkeypatch.setitem(sys.modules, "yaml", None)  # PyYAML not installed
    (tmp_path / "kv.yaml").write_text(YAML)
    with pytest.raises(ConfigError, match=r"needs PyYAML: pip install 'kvtier\[yaml\]'"):
        pool_kwargs(tmp_path / "kv.yaml")
