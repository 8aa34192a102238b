"""kvtier.transfer.kernel_cache on real files and real processes: keys, hits, corrupt and torn
entries compiled again, concurrent writers, an unwritable directory, and the directory chosen
from the environment. The compile function is a plain function of the source here (NVRTC
needs CUDA's library; the GPU tests load what it compiles)."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import random
import stat
import warnings
from pathlib import Path

import pytest

from kvtier.transfer import kernel_cache, native
from kvtier.transfer.kernel_cache import KernelCache, entry_key


def fake_cubin(source: str, size: int = 200_000) -> bytes:
    """Deterministic bytes standing for a compiled image of `source` (large enough that a write is not atomic)."""
    seed = hashlib.sha256(source.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def test_key_depends_on_every_part_and_nothing_else():
    source = native.source("page_copy")
    key = entry_key(source, native.COMPILE_OPTIONS, "sm_90", "nvrtc 13.0")
    assert key == entry_key(source, native.COMPILE_OPTIONS, "sm_90", "nvrtc 13.0")
    others = {
        entry_key(source + " ", native.COMPILE_OPTIONS, "sm_90", "nvrtc 13.0"),
        entry_key(source, native.COMPILE_OPTIONS[:-1], "sm_90", "nvrtc 13.0"),
        entry_key(source, (*native.COMPILE_OPTIONS, "-lineinfo"), "sm_90", "nvrtc 13.0"),
        entry_key(source, native.COMPILE_OPTIONS, "sm_100", "nvrtc 13.0"),
        entry_key(source, native.COMPILE_OPTIONS, "compute_90", "nvrtc 13.0"),
        entry_key(source, native.COMPILE_OPTIONS, "sm_90", "nvrtc 13.1"),
        entry_key(native.source("page_convert"), native.COMPILE_OPTIONS, "sm_90", "nvrtc 13.0"),
    }
    assert key not in others and len(others) == 7
    # Parts are length-prefixed: moving text across a boundary changes the key.
    assert entry_key("ab", ("c",), "sm_90", "x") != entry_key("a", ("bc",), "sm_90", "x")


def test_compiles_once_then_reads_from_disk_in_a_new_cache(tmp_path):
    calls = []

    def compile():
        calls.append(1)
        return fake_cubin("one")

    first = KernelCache(tmp_path)
    assert first.get("k1", compile) == fake_cubin("one")
    assert (first.compiles, first.hits, len(calls)) == (1, 0, 1)
    again = KernelCache(tmp_path)  # a later process
    assert again.get("k1", compile) == fake_cubin("one")
    assert (again.compiles, again.hits, len(calls)) == (0, 1, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k1.cubin"]


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "foreign"])
def test_a_corrupt_entry_is_compiled_again_and_replaced(tmp_path, damage):
    cache = KernelCache(tmp_path)
    payload = fake_cubin("two")
    cache.get("k2", lambda: payload)
    path = cache.path("k2")
    data = bytearray(path.read_bytes())
    if damage == "flip":
        at = random.Random(7).randrange(len(kernel_cache.MAGIC) + 40, len(data))
        data[at] ^= 0x10
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "empty":
        data = bytearray()
    else:
        data = bytearray(payload)  # bytes without the header, as another tool might leave
    path.write_bytes(bytes(data))
    fresh = KernelCache(tmp_path)
    assert fresh.read("k2") is None
    assert fresh.get("k2", lambda: payload) == payload
    assert fresh.compiles == 1
    assert KernelCache(tmp_path).read("k2") == payload


def _writer(directory: str, key: str, source: str, calls: str, start) -> None:
    start.wait()
    cache = KernelCache(directory)

    def compile():
        with open(calls, "a") as log:
            log.write(f"{os.getpid()}\n")
        return fake_cubin(source, 2_000_000)

    for _ in range(5):
        assert cache.get(key, compile) == fake_cubin(source, 2_000_000)
        # Rewrite it anyway: readers in other processes must never see half of an entry.
        cache.write(key, fake_cubin(source, 2_000_000))


def test_concurrent_processes_each_end_with_a_whole_entry(tmp_path):
    context = multiprocessing.get_context("spawn")
    start = context.Event()
    calls = tmp_path / "calls.log"
    directory = tmp_path / "cache"
    workers = [
        context.Process(target=_writer, args=(str(directory), "shared", "three", str(calls), start)) for _ in range(4)
    ]
    for worker in workers:
        worker.start()
    start.set()
    for worker in workers:
        worker.join(120)
    assert [worker.exitcode for worker in workers] == [0, 0, 0, 0]
    assert KernelCache(directory).read("shared") == fake_cubin("three", 2_000_000)
    assert sorted(p.name for p in directory.iterdir()) == ["shared.cubin"]  # no temporary file left
    assert 1 <= len(calls.read_text().split()) <= 4


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes through directory permissions")
def test_an_unwritable_directory_warns_once_and_still_compiles(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        _check_unwritable(KernelCache(locked / "kernels"), locked / "kernels")
    finally:
        locked.chmod(stat.S_IRWXU)


def test_a_directory_under_a_file_warns_once_and_still_compiles(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_bytes(b"x")
    _check_unwritable(KernelCache(blocker / "kernels"), blocker / "kernels")


def _check_unwritable(cache: KernelCache, where: Path) -> None:
    kernel_cache._warned.discard(str(where))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cache.get("k4", lambda: fake_cubin("four")) == fake_cubin("four")
        assert cache.get("k5", lambda: fake_cubin("five")) == fake_cubin("five")
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1
    assert str(where) in messages[0] and kernel_cache.ENV in messages[0]
    assert cache.compiles == 2


def test_the_directory_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(kernel_cache.ENV, str(tmp_path / "mine"))
    assert kernel_cache.default_directory() == tmp_path / "mine"
    for off in ("", "off"):
        monkeypatch.setenv(kernel_cache.ENV, off)
        assert kernel_cache.default_directory() is None
    monkeypatch.delenv(kernel_cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernel_cache.default_directory() == tmp_path / "xdg" / "kvtier" / "kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert kernel_cache.default_directory() == Path.home() / ".cache" / "kvtier" / "kernels"


def test_a_cache_that_is_off_compiles_every_time(tmp_path):
    cache = KernelCache(None)
    assert cache.get("k6", lambda: b"six") == b"six"
    assert cache.get("k6", lambda: b"six") == b"six"
    assert (cache.compiles, cache.hits) == (2, 0)
    assert not cache.write("k6", b"six")
