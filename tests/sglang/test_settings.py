"""The extra config speaks kvtier.config's vocabulary: ``remote``, ``remote_capacity_bytes`` with
human sizes, ``config`` (a kvtier TOML file), ``KVTIER_*`` variables; the old keys keep working.

Every backend here is built by SGLang's own factory over a real host pool and opens a real store."""

from __future__ import annotations

import pytest

pytest.importorskip("nixl_cu13")
pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from sglang_pools import PAGE, SGLANG_EXTRA, fill_pages, keys_for, make_backend, make_host_pool, page_bytes, page_starts, storage_config  # noqa: E402,E501

README_TOML = """
device = "cuda:0"
device_pages = 4096
host_bytes = "64GiB"
write_policy = "write_back"
model = "llama-3.1-8b"
rank = 0
remote = "{store}"
remote_capacity_bytes = "3GiB"

[format]
num_layers = 32
num_kv_heads = 8
head_dim = 128
page_size = 16
dtype = "fp8"
scale = "per_page_head"
device_dtype = "bf16"
"""


def backend_with(tmp_path, extra):
    config = storage_config(tmp_path)
    config.extra_config = {**SGLANG_EXTRA, **extra}
    pool = make_host_pool()
    return make_backend(config, pool), pool


def round_trip(backend, pool, gen, name):
    idx, dst = pool.alloc(2 * PAGE), pool.alloc(2 * PAGE)
    fill_pages(pool, idx, gen)
    keys = keys_for(name, 2)
    assert backend.batch_set_v1(keys, idx) == [True, True]
    assert backend.batch_get_v1(keys, dst) == [True, True]
    assert [page_bytes(pool, d) for d in page_starts(dst)] == [page_bytes(pool, s) for s in page_starts(idx)]


def test_the_readmes_kvtier_toml_configures_the_backend(tmp_path, gen, caplog):
    store = tmp_path / "store"
    store.mkdir()
    toml = tmp_path / "kvtier.toml"
    toml.write_text(README_TOML.format(store=store))
    caplog.set_level("INFO")
    backend, pool = backend_with(tmp_path, {"config": str(toml)})
    try:
        assert backend.settings.path == str(store)
        assert backend._anchor.store.capacity_bytes == 3 << 30
        assert "device" in backend.settings.left_to_sglang and "format" in backend.settings.left_to_sglang
        assert "SGLang's own flags decide" in caplog.text and "host_bytes" in caplog.text
        round_trip(backend, pool, gen, "toml")
        assert any(store.iterdir())
    finally:
        backend.close()


def test_inline_keys_override_the_environment_which_overrides_the_file(tmp_path, monkeypatch):
    store = tmp_path / "store"
    store.mkdir()
    toml = tmp_path / "kvtier.toml"
    toml.write_text(f'remote = "{store}"\nremote_capacity_bytes = "1GiB"\n')
    monkeypatch.setenv("KVTIER_REMOTE_CAPACITY_BYTES", "2GiB")
    backend, _ = backend_with(tmp_path, {"config": str(toml)})
    assert backend._anchor.store.capacity_bytes == 2 << 30
    backend.close()
    backend, _ = backend_with(tmp_path, {"config": str(toml), "remote_capacity_bytes": "1536MiB",
                                         "remote_timeout_s": 5})
    assert backend._anchor.store.capacity_bytes == 1536 << 20 and backend._anchor.store.timeout_s == 5
    backend.close()


def test_old_and_new_names_give_the_same_store(tmp_path, gen):
    old, pool = backend_with(tmp_path, {"path": str(tmp_path), "capacity_gb": 1.5, "timeout_s": 7,
                                        "nixl_backend": "POSIX"})
    new, _ = backend_with(tmp_path, {"remote": str(tmp_path), "remote_capacity_bytes": "1.5GiB",
                                     "remote_timeout_s": 7, "remote_backend": "POSIX"})
    try:
        assert old.settings == new.settings
        assert old._anchor.store.capacity_bytes == new._anchor.store.capacity_bytes == 3 << 29
        round_trip(old, pool, gen, "names")
        assert new.batch_exists(keys_for("names", 2)) == 2
    finally:
        old.close()
        new.close()


def test_a_store_whose_parent_is_missing_is_refused_unless_asked_to_create_it(tmp_path, gen):
    """A mistyped mount point stops the server (RemoteStore names the directory and the key);
    remote_create makes the parents."""
    from kvtier.tiers.remote.errors import StoreLocationError

    missing = tmp_path / "mnt" / "kv" / "store"
    with pytest.raises(StoreLocationError, match="remote_create|create=True"):
        backend_with(tmp_path, {"remote": str(missing)})
    assert not (tmp_path / "mnt").exists()
    backend, pool = backend_with(tmp_path, {"remote": str(missing), "remote_create": True})
    try:
        round_trip(backend, pool, gen, "create")
        assert missing.is_dir()
    finally:
        backend.close()


def test_pool_keys_given_inline_are_checked_and_left_to_sglang(tmp_path):
    extra = {"remote": str(tmp_path), "device": "cuda:0", "write_policy": "write_back",
             "format": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "page_size": 4, "dtype": "bf16"}}
    backend, _ = backend_with(tmp_path, extra)
    try:
        assert backend.settings.left_to_sglang == ("device", "format", "write_policy")
    finally:
        backend.close()
    with pytest.raises(ValueError, match="write_policy"):
        backend_with(tmp_path, {**extra, "write_policy": "write_sometimes"})
    with pytest.raises(ValueError, match="num_layers"):
        backend_with(tmp_path, {**extra, "format": {"num_layers": 0}})
