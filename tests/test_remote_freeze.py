"""A really stuck disk: the store on a loop-mounted ext4 frozen with ``fsfreeze`` (writes,
fsyncs and SQLite's shared-memory read marks sleep in the kernel until the thaw). No call the
engine makes waits past its timeout: index lookups give up as misses, writers time out, close
returns, and after the thaw every page stored before reads back bit for bit.

Needs root and a loop device (CI runs as root); skips with the reason otherwise."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

pytest.importorskip("nixl_cu13")

from kvtier import TieredPool, prefix_keys  # noqa: E402
from kvtier.tiers.remote import RemoteStore  # noqa: E402
from tests.conftest import small_format  # noqa: E402
from tests.conftest import write_pages  # noqa: E402
from tests.test_pool_faults import read_back  # noqa: E402
from tests.test_remote_store import PAGE, poisoned, random_pages, same  # noqa: E402

TIMEOUT_S = 1.0
BOUND_S = 8.0  # timeout plus grace plus a loaded 2-core machine; the freeze lasts far longer


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


pytestmark = pytest.mark.stress  # a frozen file system: a fault-injection run (make stress)


@pytest.fixture
def frozen_fs(tmp_path):
    """(mount point, freeze(), thaw()) of a fresh 256 MiB ext4 on a loop device."""
    if os.geteuid() != 0:
        pytest.skip("fsfreeze and loop mounts need root")
    if shutil.which("fsfreeze") is None or shutil.which("mkfs.ext4") is None:
        pytest.skip("fsfreeze or mkfs.ext4 is not installed")
    image, mount = tmp_path / "disk.img", tmp_path / "mnt"
    mount.mkdir()
    with open(image, "wb") as f:
        f.truncate(256 << 20)
    made = _run("mkfs.ext4", "-q", "-F", str(image))
    if made.returncode:
        pytest.skip(f"mkfs.ext4 failed: {made.stderr.strip()}")
    mounted = _run("mount", "-o", "loop", str(image), str(mount))
    if mounted.returncode:
        pytest.skip(f"mount -o loop refused here: {mounted.stderr.strip()}")
    frozen = [False]

    def freeze() -> None:
        assert _run("fsfreeze", "-f", str(mount)).returncode == 0
        frozen[0] = True

    def thaw() -> None:
        if frozen[0]:
            assert _run("fsfreeze", "-u", str(mount)).returncode == 0
            frozen[0] = False

    # A call that hangs despite all would hold the freeze, and the test, forever: thaw anyway.
    watchdog = threading.Timer(120, lambda: _run("fsfreeze", "-u", str(mount)))
    watchdog.daemon = True
    watchdog.start()
    try:
        yield mount, freeze, thaw
    finally:
        watchdog.cancel()
        thaw()
        _run("umount", "-l", str(mount))


def timed(fn, *args):
    start = time.monotonic()
    result = fn(*args)
    return result, time.monotonic() - start


def test_store_calls_and_close_return_on_a_frozen_disk(frozen_fs):
    mount, freeze, thaw = frozen_fs
    directory = mount / "store"
    store = RemoteStore(directory, namespace="aa", page_bytes=PAGE, timeout_s=TIMEOUT_S,
                        segment_bytes=64 * PAGE, capacity_bytes=64 << 20)
    keys = [f"k{i}" for i in range(32)]
    data = random_pages(32, seed=1)
    assert all(store.put(keys, data))
    writer_done = threading.Event()
    freeze()
    writer = threading.Thread(
        target=lambda: (store.put([f"w{i}" for i in range(8)], random_pages(8, seed=2)), writer_done.set()),
        daemon=True,
    )
    writer.start()  # holds the index's write lock inside the kernel until the thaw
    time.sleep(0.5)
    waits = {}
    try:
        _, waits["put"] = timed(store.put, ["x"], random_pages(1, seed=3))
        _, waits["contains"] = timed(store.contains_ids, [os.urandom(16) for _ in range(4)])
        out = poisoned(4)
        found, waits["get"] = timed(store.get, keys[:4], out)
        for ok, page, expected in zip(found, out, data):
            assert not ok or same([page], [expected])  # a miss or the right bytes, never other bytes
        _, waits["set_timeout"] = timed(store.set_timeout, TIMEOUT_S)
        _, waits["close"] = timed(store.close)
        assert max(waits.values()) < BOUND_S, waits
        assert not writer_done.is_set()  # the disk really was stuck
    finally:
        thaw()
    writer.join(60)
    with RemoteStore(directory, namespace="aa", page_bytes=PAGE, segment_bytes=64 * PAGE) as again:
        out = poisoned(32)
        assert again.get(keys, out) == [True] * 32 and same(out, data)


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_pool_calls_return_on_a_frozen_disk(frozen_fs, gen, policy):
    mount, freeze, thaw = frozen_fs
    pool = TieredPool(small_format(), registry=CollectorRegistry(), remote=str(mount / "store"),
                      model="m", device_pages=8, host_pages=16, write_policy=policy, remote_backoff_s=0.05)
    pool.remote.set_timeout(TIMEOUT_S)
    stored = prefix_keys(np.arange(8 * 16), 8, pool.namespace)
    truth: dict = {}
    for i in range(0, 16, 4):
        truth.update(write_pages(pool, stored[i : i + 4], gen))
    assert pool.flush() == 0
    pool.evict(tier="device")
    pool.evict(tier="host")
    freeze()
    longest = {"allocate+commit": 0.0, "match": 0.0}
    try:
        for batch in range(12):
            keys = prefix_keys(np.arange(10_000 + 32 * batch, 10_032 + 32 * batch), 8, pool.namespace)
            _, took = timed(write_pages, pool, keys, gen)
            longest["allocate+commit"] = max(longest["allocate+commit"], took)
            _, took = timed(pool.match, stored[:8])  # pages on neither device nor host
            longest["match"] = max(longest["match"], took)
        _, longest["close"] = timed(pool.close, 2.0)
        assert max(longest.values()) < BOUND_S, longest
    finally:
        thaw()
    again = TieredPool(small_format(), registry=CollectorRegistry(), remote=str(mount / "store"),
                       model="m", device_pages=8, host_pages=16)
    try:
        assert read_back(again, stored[:8]) == {k: truth[k] for k in stored[:8]}
    finally:
        again.close()


def test_slots_reserved_on_a_full_disk_are_released_once_it_has_room(frozen_fs):
    """A full file system fails the write and the index commit that would release its slots:
    the next put releases them, in the same process."""
    mount, _, _ = frozen_fs
    directory = mount / "store"
    store = RemoteStore(directory, namespace="aa", page_bytes=PAGE, timeout_s=5.0,
                        segment_bytes=64 * PAGE, capacity_bytes=64 << 20, reuse_delay_s=0.0)
    try:
        assert all(store.put([f"k{i}" for i in range(8)], random_pages(8, seed=4)))
        filler = mount / "filler"
        with open(filler, "wb") as f:  # every free block taken
            chunk = os.urandom(1 << 20)
            try:
                while True:
                    f.write(chunk)
                    f.flush()
            except OSError:
                pass
        failed = store.put([f"full{i}" for i in range(80)], random_pages(80, seed=5))
        assert not all(failed)
        os.unlink(filler)
        os.sync()
        assert all(store.put(["later"], random_pages(1, seed=6)))
        assert store.stats()["reserved_slots"] == 0
        out = poisoned(8)
        assert store.get([f"k{i}" for i in range(8)], out) == [True] * 8
        assert same(out, random_pages(8, seed=4))
    finally:
        store.close()
