"""Settings this machine cannot honour get kvtier's own errors, naming the key, the value, what
there is and the fix: real torch devices, real memory figures from /proc/meminfo, real store
directories (a file in the path, missing parents, an immutable directory, a read-only mount)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtier import DeviceError, SettingError, TieredPool, TierSizeError
from kvtier.tiers.memory import gib, host_memory
from tests.conftest import small_format

ROOT = Path(__file__).resolve().parents[1]
FMT = small_format()


def pool(**kw):
    sizes = {"device_pages": 4} if "host_bytes" in kw else {"device_pages": 4, "host_pages": 8}
    return TieredPool(FMT, registry=None, background_copies=False, **{**sizes, **kw})


def run_python(code: str, env: dict | None = None, prefix: list[str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*(prefix or []), sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


# --- device -------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: device='cuda' is valid here")
def test_cuda_without_cuda_names_the_torch_build_and_the_fix():
    with pytest.raises(DeviceError) as err:
        pool(device="cuda")
    text = str(err.value)
    assert "device='cuda'" in text and torch.__version__ in text
    assert "device='cpu'" in text and "download.pytorch.org/whl/cu" in text


def test_a_gpu_index_past_the_visible_gpus_is_refused():
    with pytest.raises(DeviceError, match=r"device='cuda:99'"):
        pool(device="cuda:99")


@pytest.mark.parametrize("device, words", [("gpu", ["did you mean 'cuda'?"]), ("cpuu", ["did you mean 'cpu'?"]),
                                           ("meta", ["'cpu' or 'cuda'", "'meta'"]), (3, ["torch.device", "int"])])
def test_device_names_kvtier_cannot_use(device, words):
    with pytest.raises(DeviceError) as err:
        pool(device=device)
    assert isinstance(err.value, ValueError) and f"device={device!r}" in str(err.value)
    for word in words:
        assert word in str(err.value)


# --- memory -------------------------------------------------------------------------------------
@pytest.mark.skipif(host_memory() is None, reason="no /proc/meminfo: kvtier cannot tell the memory there is")
@pytest.mark.parametrize("key", ["host_bytes", "host_pages", "device_pages"])
def test_a_tier_larger_than_the_machine_names_key_size_and_memory(key):
    available, total = host_memory()
    pages = 2 * total // FMT.page_bytes + 1  # more than the machine has, whatever is free meanwhile
    value = pages * FMT.page_bytes if key == "host_bytes" else pages
    with pytest.raises(TierSizeError) as err:
        pool(**{key: value})
    text = str(err.value)
    assert f"{key}={value}" in text and gib(pages * FMT.page_bytes) in text
    assert f"available of {gib(total)}" in text and "/proc/meminfo MemAvailable" in text
    assert f"set {key} to at most" in text


def test_host_pages_and_host_bytes_together_are_refused():
    with pytest.raises(SettingError, match=r"host_pages=8 and host_bytes=65536 both size the host tier; give one"):
        TieredPool(FMT, registry=None, device_pages=4, host_pages=8, host_bytes=65536)
    with TieredPool(FMT, registry=None, device_pages=4, host_bytes=16 * FMT.page_bytes) as sized:
        assert sized.host_tier.num_pages == 16
    with TieredPool(FMT, registry=None, device_pages=4) as default:
        assert default.host_tier.num_pages == 4096


def test_device_pages_of_a_billion():
    with pytest.raises(TierSizeError, match=r"device_pages=1000000000 asks for .* set device_pages to at most"):
        pool(device_pages=10**9)


# --- copy paths ---------------------------------------------------------------------------------
def test_copy_path_typo_gets_a_suggestion():
    with pytest.raises(SettingError, match=r"copy_path='kernal'.*did you mean 'kernel'"):
        pool(copy_path="kernal")


@pytest.mark.parametrize("kw, why", [({"device": "cpu"}, "device is 'cpu'"), ({"engine": "torch"}, "engine='torch'")])
@pytest.mark.parametrize("copy_path", ["kernel", "copy_engine", "staged"])
def test_a_cuda_copy_path_that_would_never_run_is_refused(copy_path, kw, why):
    with pytest.raises(SettingError) as err:
        pool(copy_path=copy_path, **kw)
    assert f"copy_path={copy_path!r} moves bytes with CUDA, but {why}" in str(err.value)
    assert "copy_path='auto'" in str(err.value)


# --- the remote store's directory -----------------------------------------------------------------
def open_store(location, **kw):
    pytest.importorskip("nixl_cu13")
    from kvtier.tiers.remote import RemoteStore

    return RemoteStore(location, namespace="ab12", page_bytes=4096, **{"capacity_bytes": 1 << 20, **kw})


def test_a_store_path_under_a_file(tmp_path):
    from kvtier.tiers.remote.errors import StoreLocationError

    (tmp_path / "hostname").write_text("not a directory")
    with pytest.raises(StoreLocationError) as err:
        open_store(tmp_path / "hostname" / "store")
    assert isinstance(err.value, OSError)
    assert f"store directory {tmp_path}/hostname/store: {tmp_path}/hostname is a file" in str(err.value)


def test_missing_parents_are_refused_unless_creation_is_asked_for(tmp_path):
    from kvtier.tiers.remote.errors import StoreLocationError

    location = tmp_path / "mnt" / "nvme0" / "kv"
    with pytest.raises(StoreLocationError) as err:
        open_store(location)
    assert f"its parent {tmp_path}/mnt/nvme0 does not exist ({tmp_path} is the nearest" in str(err.value)
    assert "create=True" in str(err.value) and "remote_create" in str(err.value)
    assert not (tmp_path / "mnt").exists()
    open_store(location, create=True).close()
    assert location.is_dir()
    other = tmp_path / "srv" / "kv"
    with pytest.raises(StoreLocationError, match="remote_create"):
        pool(remote=other)
    with pool(remote=other, remote_create=True, remote_capacity_bytes=1 << 20) as created:
        assert created.remote is not None and other.is_dir()


def test_a_store_capacity_below_one_page(tmp_path):
    with pytest.raises(SettingError, match=r"capacity_bytes 100 holds no page: .* 4096 bytes"):
        open_store(tmp_path / "store", capacity_bytes=100)


def test_an_immutable_store_directory_names_the_directory(tmp_path):
    from kvtier.tiers.remote.errors import StoreLocationError

    location = tmp_path / "store"
    open_store(location).close()
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(location)]).returncode != 0:
        pytest.skip("chattr +i is not available on this file system: no way to make a directory unwritable for root")
    try:
        with pytest.raises(StoreLocationError) as err:
            open_store(location)
    finally:
        subprocess.run(["chattr", "-i", str(location)], check=True)
    assert str(err.value).startswith(f"[Errno 13] store directory {location} is not writable")
    assert "may not write" in str(err.value)


def test_a_read_only_mount_names_the_directory_and_the_mount(tmp_path):
    pytest.importorskip("nixl_cu13")
    location = tmp_path / "store"
    open_store(location).close()
    code = (
        "from kvtier.tiers.remote import RemoteStore\n"
        "from kvtier.tiers.remote.errors import StoreLocationError\n"
        "try:\n"
        f"    RemoteStore({str(location)!r}, namespace='ab12', page_bytes=4096, capacity_bytes=1 << 20)\n"
        "except StoreLocationError as err:\n"
        "    print('ERR', err.errno, err)\n"
    )
    mount = f"mount --bind {location} {location} && mount -o remount,bind,ro {location} && exec \"$0\" \"$@\""
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "true"],
                           capture_output=True, text=True) if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        pytest.skip(f"a read-only bind mount needs unshare and CAP_SYS_ADMIN: {probe and probe.stderr.strip()}")
    out = run_python(code, prefix=["unshare", "--mount", "--propagation", "private", "sh", "-c", mount])
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"ERR 30 [Errno 30] store directory {location} is not writable: "), out.stdout
    assert f"{location} is on a read-only file system (mounted at {location})" in out.stdout


# --- the environment and the layers --------------------------------------------------------------
def test_kvtier_log_level_sets_kvtier_loggers_only():
    code = ("import logging, kvtier\n"
            "logging.getLogger('kvtier.pool').debug('kvtier debug line')\n"
            "logging.getLogger('other').debug('other debug line')\n"
            "print(logging.getLevelName(logging.getLogger('kvtier').level))")
    out = run_python(code, {"KVTIER_LOG_LEVEL": "debug"})
    assert out.stdout.strip() == "DEBUG" and "DEBUG kvtier.pool: kvtier debug line" in out.stderr
    assert "other debug line" not in out.stderr
    out = run_python(code, {"KVTIER_LOG_LEVEL": "loud"})
    assert out.returncode == 0 and out.stdout.strip() == "NOTSET"
    assert "KVTIER_LOG_LEVEL='loud' is not a log level: expected one of debug, info" in out.stderr


def test_the_pool_never_imports_the_config_layer():
    code = ("import sys\nfrom kvtier import TieredPool, PageFormat\n"
            "fmt = PageFormat(num_layers=1, num_kv_heads=1, head_dim=16, page_size=4, dtype='bf16')\n"
            "TieredPool(fmt, device_pages=2, host_pages=2, registry=None).close()\n"
            "print(sorted(m for m in sys.modules if m.startswith('kvtier.config')))")
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
