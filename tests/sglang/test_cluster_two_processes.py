"""Two processes running SGLang's host pools through the kvtier backend, each with its own local
store directory, share KV through the cluster tier (a real mooncake_master on loopback): one
configured by KVTIER_CLUSTER* variables, the other by the same keys in SGLang's extra config."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("nixl_cu13")
pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

import torch  # noqa: E402

from mooncake_master import mooncake_master  # noqa: E402,F401  (the fixture)
from sglang_pools import PAGE, fill_pages, keys_for, make_backend, make_host_pool, page_bytes, page_starts, storage_config  # noqa: E402

HERE = Path(__file__).resolve().parent
PAGES = 24

CHILD = """
import sys, time, torch
from sglang_pools import PAGE, fill_pages, keys_for, make_backend, make_host_pool, page_bytes, page_starts, storage_config
path = sys.argv[1]
pool = make_host_pool("mha", "page_first", size=512)
backend = make_backend(storage_config(path), pool)
src = pool.alloc({pages} * PAGE)
fill_pages(pool, src, torch.Generator().manual_seed(7))
assert backend.batch_set_v1(keys_for("child", {pages}), src) == [True] * {pages}
deadline = time.monotonic() + 120
theirs = keys_for("parent", {pages})
while backend.batch_exists(theirs) < {pages}:
    assert time.monotonic() < deadline, "the parent's pages never appeared"
    time.sleep(0.05)
expected = pool.alloc({pages} * PAGE)
fill_pages(pool, expected, torch.Generator().manual_seed(8))
got = pool.alloc({pages} * PAGE)
assert backend.batch_get_v1(theirs, got) == [True] * {pages}
assert [page_bytes(pool, g) for g in page_starts(got)] == [page_bytes(pool, e) for e in page_starts(expected)]
print("child ok", flush=True)
sys.stdin.readline()  # the parent reads this process's pages, which live in the memory it lends
backend.close()
""".format(pages=PAGES)


def test_two_processes_with_separate_local_stores_share_pages_through_the_cluster(mooncake_master, tmp_path):
    settings = mooncake_master.settings()
    cluster = {"cluster": settings["master"], "cluster_metadata_server": settings["metadata_server"],
               "cluster_local_hostname": "127.0.0.1", "cluster_segment_bytes": "64MiB"}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
               **{f"KVTIER_{key.upper()}": value for key, value in cluster.items()})
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(CHILD), str(tmp_path / "child")],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        pool = make_host_pool("mha", "page_first", size=512)
        backend = make_backend(storage_config(tmp_path / "parent", **cluster), pool)
        src = pool.alloc(PAGES * PAGE)
        fill_pages(pool, src, torch.Generator().manual_seed(8))
        assert backend.batch_set_v1(keys_for("parent", PAGES), src) == [True] * PAGES
        theirs = keys_for("child", PAGES)
        deadline = time.monotonic() + 120
        while backend.batch_exists(theirs) < PAGES:
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "the child's pages never appeared"
            time.sleep(0.05)
        expected = pool.alloc(PAGES * PAGE)
        fill_pages(pool, expected, torch.Generator().manual_seed(7))
        got = pool.alloc(PAGES * PAGE)
        assert backend.batch_get_v1(theirs, got) == [True] * PAGES
        assert [page_bytes(pool, g) for g in page_starts(got)] == [page_bytes(pool, e) for e in page_starts(expected)]
        assert child.stdout.readline().strip() == "child ok", child.stderr.read()[-3000:] if child.poll() is not None else ""
        (lane,) = backend.store_stats().values()
        assert lane["cluster"]["hits"] == PAGES and lane["cluster"]["corrupt_reads"] == 0
        assert lane["hits"] == 0  # the local store never had them: the cluster served every page
        out, err = child.communicate("done\n", timeout=300)
        assert child.returncode == 0, out + err[-3000:]
        backend.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
