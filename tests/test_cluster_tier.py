"""The cluster tier on a real mooncake_master on loopback: hosts are processes, each with its own
pool, local store and Mooncake client; pages are compared by the SHA-256 of their exact bytes."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import fill_random, poison, small_format, snapshot
from mooncake_master import Master, mooncake_master  # noqa: F401  (the fixture)

from kvtier import TieredPool
from kvtier.config import ConfigError, pool_kwargs
from kvtier.index.keys import key_ids
from kvtier.metrics import exposition

HERE = Path(__file__).resolve().parent
FORMAT = {"num_layers": 3, "num_kv_heads": 2, "head_dim": 32, "page_size": 8, "dtype": "fp8_e4m3", "scale": "per_page_head"}


class Host:
    """A host process (tests/cluster_host.py) driven one command at a time."""

    def __init__(self, settings: dict, local: Path | None) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
        self.process = subprocess.Popen(
            [sys.executable, str(HERE / "cluster_host.py"), json.dumps(settings), str(local or "")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        assert self._answer() == ["ready"]

    def _answer(self) -> list[str]:
        line = self.process.stdout.readline()
        if not line:
            self.process.wait(30)
            raise AssertionError(f"host exited with {self.process.returncode}: {self.process.stderr.read()[-3000:]}")
        return line.split()

    def ask(self, command: str) -> list[str]:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self._answer()

    def commit(self, name: str, first: int, count: int, seed: int) -> list[str]:
        return self.ask(f"commit {name} {first} {count} {seed}")

    def load(self, name: str, first: int, count: int) -> tuple[int, list[str]]:
        remote, *digests = self.ask(f"load {name} {first} {count}")
        return int(remote.removeprefix("remote=")), digests

    def stats(self) -> dict:
        return json.loads(self.ask("stats")[0])

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write("exit\n")
            self.process.stdin.flush()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        assert self.process.returncode == 0, self.process.stderr.read()[-3000:]


def test_a_prefix_one_host_committed_is_served_to_the_next_and_its_write_back_to_a_third(mooncake_master, tmp_path):
    hosts = [Host(mooncake_master.settings(), tmp_path / f"local{i}") for i in range(3)]
    try:
        prefix = hosts[0].commit("chat", 0, 12, seed=1)
        remote, got = hosts[1].load("chat", 0, 12)
        assert (remote, got) == (12, prefix)
        more = hosts[1].commit("chat", 12, 6, seed=2)  # host 2 extends the prefix it was served
        remote, got = hosts[2].load("chat", 0, 18)
        assert (remote, got) == (18, prefix + more)
        assert hosts[2].stats()["hits"] == 18
        assert hosts[1].stats()["pages_written"] == 6
        assert all(h.stats()["corrupt_reads"] == 0 for h in hosts)
    finally:
        for host in hosts:
            host.close()


def test_cluster_alone_without_a_local_store(mooncake_master):
    writer, reader = Host(mooncake_master.settings(), None), Host(mooncake_master.settings(), None)
    try:
        pages = writer.commit("solo", 0, 9, seed=3)
        assert reader.load("solo", 0, 9) == (9, pages)
    finally:
        writer.close()
        reader.close()


def _pool(master: Master, registry=None, **settings) -> TieredPool:
    pool = TieredPool(small_format(), device_pages=64, host_pages=64, cluster=master.settings(**settings), registry=registry)
    assert pool.remote.client.wait_connected(30), pool.remote.client.last_error
    return pool


def _commit(pool: TieredPool, keys: list[str], seed: int) -> list[tuple[bytes, bytes]]:
    slots = pool.allocate(len(keys))
    fill_random(pool, slots, torch.Generator().manual_seed(seed))
    pool.commit(keys, slots)
    pages = [snapshot(pool, s) for s in slots]
    pool.release(slots)
    return pages


def _load(pool: TieredPool, keys: list[str]) -> list[tuple[bytes, bytes]]:
    slots = pool.allocate(len(keys))
    poison(pool, slots)
    pool.load(keys, slots).wait()
    pages = [snapshot(pool, s) for s in slots]
    pool.release(slots)
    return pages


def _samples(registry) -> dict:
    text = generate_latest(registry).decode()
    assert text == exposition(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.stress
def test_master_killed_mid_run_degrades_to_local_tiers_and_recovers_after_restart(mooncake_master, caplog):
    registry = CollectorRegistry()
    writer, reader = _pool(mooncake_master, registry), _pool(mooncake_master)
    try:
        before = [f"before/{i}" for i in range(8)]
        _commit(writer, before, seed=4)
        assert writer.flush() == 0
        assert reader.match(before).remote == 8
        mooncake_master.kill()
        during = [f"during/{i}" for i in range(8)]
        during_pages = _commit(writer, during, seed=5)
        writer.flush()
        assert _load(writer, during) == during_pages  # the host tier still serves them
        found = reader.match(before + during)  # no exception, no page it cannot serve
        assert found.total == 0
        with pytest.raises(KeyError):
            reader.load(before[:1]).wait()
        stats = writer.remote.stats()["cluster"]
        assert stats["breaker_opens"] >= 1 and stats["breaker_state"] != "closed"
        assert stats["write_failures"] + stats["skipped_writes"] >= 1
        assert "cluster tier unavailable" in caplog.text
        samples = _samples(registry)
        labels = (("model", "default"), ("pool", writer.name), ("rank", "0"), ("tier", "cluster"))
        assert samples[("kvtier_tier_breaker_opens_total", labels)] == stats["breaker_opens"]
        assert samples[("kvtier_tier_breaker_state", labels)] in (1, 2)
        assert samples[("kvtier_tier_writes_total", tuple(sorted(labels + (("outcome", "written"),))))] == 8
        mooncake_master.start()  # a restarted master holds nothing: old pages are misses
        after = [f"after/{i}" for i in range(8)]
        deadline = time.monotonic() + 60
        while True:  # the client reconnects by itself; the breaker probes on the next write
            after_pages = _commit(writer, after, seed=6)
            writer.flush()
            if reader.match(after).remote == 8 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
            after = [f"{k}x" for k in after]
        assert reader.match(after).remote == 8
        assert _load(reader, after) == after_pages
        assert reader.match(before).total == 0
        assert writer.remote.stats()["cluster"]["breaker_state"] == "closed"
    finally:
        writer.close()
        reader.close()


@pytest.mark.stress
def test_pool_opens_before_the_master_and_joins_it_when_it_starts(tmp_path):
    master = Master(tmp_path)
    pool = TieredPool(small_format(), device_pages=16, host_pages=16, cluster=master.settings(), registry=None)
    try:
        keys = [f"early/{i}" for i in range(4)]
        _commit(pool, keys, seed=7)
        pool.flush()
        assert pool.match(keys).total == 4  # from its own tiers
        assert not pool.remote.client.connected
        master.start()
        assert pool.remote.client.wait_connected(60), pool.remote.client.last_error
        deadline = time.monotonic() + 30
        for round in itertools.count():  # the breaker lets a write through once its back-off ends
            late = [f"late/{round}/{i}" for i in range(4)]
            _commit(pool, late, seed=8)
            pool.flush()
            if pool.remote.contains_ids(key_ids(late)) == [True] * 4 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert pool.remote.contains_ids(key_ids(late)) == [True] * 4
        assert pool.remote.stats()["cluster"]["skipped_writes"] + pool.remote.stats()["cluster"]["write_failures"] >= 4
    finally:
        pool.close()
        master.stop()


def _raw_client(master: Master, segment_bytes: int = 16 << 20):
    from mooncake.store import MooncakeDistributedStore

    raw = MooncakeDistributedStore()
    assert raw.setup("127.0.0.1", master.metadata_server, segment_bytes, 16 << 20, "tcp", "", master.address) == 0
    return raw


def test_removed_objects_and_those_of_a_host_that_left_are_misses(mooncake_master):
    """Mooncake keeps objects in the memory its clients lend: when the host that held them
    leaves, they are gone from the cluster, and so are objects removed through its client."""
    storage = Host(mooncake_master.settings(segment_bytes=64 << 20), None)  # lends the only memory
    writer, reader = _pool(mooncake_master, segment_bytes=0), _pool(mooncake_master, segment_bytes=0)
    raw = _raw_client(mooncake_master, segment_bytes=0)
    try:
        keys = [f"gone/{i}" for i in range(16)]
        pages = _commit(writer, keys, seed=9)
        assert writer.flush() == 0
        cluster, ids = reader.remote, key_ids(keys)
        assert cluster.contains_ids(ids) == [True] * 16
        assert raw.remove(cluster.object_key(ids[0]), True) == 0
        assert reader.match(keys).total == 0  # the prefix starts with a removed page
        assert _load(reader, keys[1:]) == pages[1:]
        storage.process.kill()
        storage.process.wait()
        deadline = time.monotonic() + 60
        while any(cluster.contains_ids(ids)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert cluster.contains_ids(ids) == [False] * 16
        late = _pool(mooncake_master, segment_bytes=0)
        assert late.match(keys[1:]).total == 0
        late.close()
        out = [torch.full((cluster.page_bytes,), 0xAB, dtype=torch.uint8) for _ in ids]
        assert cluster.get_ids(ids, out) == [False] * 16
        assert cluster.stats()["cluster"]["corrupt_reads"] == 0
    finally:
        writer.close()
        reader.close()
        raw.close()


# Staged (objects assembled in registered memory, the default), staged in chunks of 3 pages,
# and zero-copy (header and page as slices of one object).
STAGING = [32 << 20, 3 * (64 + small_format().page_bytes), 0]


@pytest.mark.parametrize("staging", STAGING, ids=["staged", "staged-chunks", "zero-copy"])
def test_pages_round_trip_bit_exact_however_they_move(mooncake_master, staging):
    writer, reader = _pool(mooncake_master, staging_bytes=staging), _pool(mooncake_master, staging_bytes=staging)
    try:
        keys = [f"trip/{i}" for i in range(20)]
        pages = _commit(writer, keys, seed=12)
        assert writer.flush() == 0
        assert reader.match(keys).remote == 20
        assert _load(reader, keys) == pages
        assert reader.remote.stats()["cluster"]["hits"] == 20
    finally:
        writer.close()
        reader.close()


@pytest.mark.parametrize("staging", STAGING, ids=["staged", "staged-chunks", "zero-copy"])
def test_garbage_foreign_and_stale_objects_under_a_key_are_misses_and_removed(mooncake_master, staging):
    writer = _pool(mooncake_master, staging_bytes=staging)
    other_model = TieredPool(small_format(), device_pages=16, host_pages=16, model="other",
                             cluster=mooncake_master.settings(), registry=None)
    raw = _raw_client(mooncake_master)
    try:
        assert other_model.remote.client.wait_connected(30)
        keys = [f"bad/{i}" for i in range(4)]
        _commit(writer, keys, seed=10)
        _commit(other_model, keys, seed=11)
        assert writer.flush() == 0 and other_model.flush() == 0
        cluster, ids = writer.remote, key_ids(keys)
        size = cluster.object_bytes
        buf = np.empty((3, size), dtype=np.uint8)
        assert raw.register_buffer(buf.ctypes.data, buf.nbytes) == 0
        # Garbage, a record of another namespace, and a record of another key, each under a key.
        buf[0] = np.random.default_rng(1).integers(0, 255, size=size, dtype=np.uint8)
        assert raw.batch_get_into([other_model.remote.object_key(ids[1]), cluster.object_key(ids[3])],
                                  [buf.ctypes.data + size, buf.ctypes.data + 2 * size], [size, size]) == [size, size]
        victims = [cluster.object_key(k) for k in ids[:3]]
        assert raw.batch_remove(victims, True) == [0, 0, 0]
        assert raw.batch_put_from(victims, [buf.ctypes.data + i * size for i in range(3)], [size] * 3) == [0, 0, 0]
        assert cluster.contains_ids(ids) == [True] * 4
        out = [torch.full((cluster.page_bytes,), 0xAB, dtype=torch.uint8) for _ in ids]
        assert cluster.get_ids(ids, out) == [False, False, False, True]
        if cluster.staged:  # a page that fails its check never reaches the caller's memory
            assert all(bool((page == 0xAB).all()) for page in out[:3])
        assert cluster.stats()["cluster"]["corrupt_reads"] == 3
        assert cluster.contains_ids(ids) == [False, False, False, True]  # removed: a good write can take the key
    finally:
        writer.close()
        other_model.close()
        raw.close()


def test_cluster_keys_come_from_files_and_environment(monkeypatch):
    monkeypatch.setenv("KVTIER_CLUSTER", "10.0.0.5:50051")
    monkeypatch.setenv("KVTIER_CLUSTER_SEGMENT_BYTES", "1GiB")
    kwargs = pool_kwargs({"format": FORMAT, "cluster_protocol": "tcp", "cluster_metadata_server": "P2PHANDSHAKE"})
    assert kwargs["cluster"] == {"master": "10.0.0.5:50051", "segment_bytes": 1 << 30, "protocol": "tcp",
                                 "metadata_server": "P2PHANDSHAKE"}
    monkeypatch.delenv("KVTIER_CLUSTER")
    with pytest.raises(ConfigError, match="cluster_segment_bytes is set but 'cluster'"):
        pool_kwargs({"format": FORMAT})
    with pytest.raises(ConfigError, match="did you mean 'cluster_protocol'"):
        pool_kwargs({"format": FORMAT, "cluster": "h:1", "cluster_protcol": "tcp"})


def test_a_chain_reads_page_tables_stops_at_a_prefix_gap_and_asks_fresh(mooncake_master, tmp_path):
    """The store the SGLang backend drives (local store + cluster): a batch given as one
    PageBuffers of two pieces a page, a prefix read that stops at the first page neither tier
    holds, and ``contains_ids(fresh=True)`` asking the local index itself."""
    from kvtier.tiers.cluster import open_cluster
    from kvtier.tiers.remote import RemoteStore
    from kvtier.tiers.remote.buffers import PageBuffers

    namespace, page = "ab" * 16, 8192
    settings = mooncake_master.settings()

    def chain(name):
        local = RemoteStore(tmp_path / name, namespace=namespace, page_bytes=page)
        store = open_cluster(settings, local, True, namespace=namespace, page_bytes=page)
        assert store.cluster.client.wait_connected(30), store.cluster.client.last_error
        return store

    writer, reader = chain("writer"), chain("reader")
    try:
        ids = key_ids([f"chain/{i}" for i in range(6)])
        gen = torch.Generator().manual_seed(31)
        pages = torch.randint(0, 256, (6, page), dtype=torch.uint8, generator=gen)
        stored = [0, 1, 2, 4, 5]  # page 3 is never written: the prefix ends there
        assert writer.put_ids([ids[i] for i in stored], [pages[i] for i in stored]) == [True] * 5
        assert reader.contains_ids(ids, fresh=True) == [True, True, True, False, True, True]
        dst = torch.full((6, page), 0xA5, dtype=torch.uint8)  # poisoned
        halves = dst.view(6, 2, page // 2)
        ptrs = np.array([halves[i, j].data_ptr() for i in range(6) for j in range(2)], dtype=np.uint64)
        table = PageBuffers.from_arrays(ptrs, np.full(12, page // 2, dtype=np.uint64), 6, page)
        assert reader.get_ids(ids, table, prefix=True) == [True, True, True, False, False, False]
        assert torch.equal(dst[:3], pages[:3])  # served by the cluster: the reader's local store is empty
        assert reader.local.stats()["pages"] == 0 and reader.cluster.counters["hits"] >= 3
        assert reader.get_ids(ids, table) == [True, True, True, False, True, True]
        assert torch.equal(dst[4:], pages[4:])
    finally:
        writer.close()
        reader.close()


def test_the_readmes_cluster_metric_names_are_exported(mooncake_master):
    """The kvtier_tier_* names the README gives are what a pool with the cluster tier exports."""
    import re

    registry = CollectorRegistry()
    pool = _pool(mooncake_master, registry=registry)
    try:
        text = generate_latest(registry).decode()
    finally:
        pool.close()
    exported = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    readme = (HERE.parent / "README.md").read_text()
    named = set(re.findall(r"`(kvtier_tier_[a-z_]*[a-z])[{`]", readme))
    assert named and named <= exported, sorted(named - exported)
