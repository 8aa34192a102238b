"""Two processes (the rank-0 schedulers of two engines serving one MLA model) share one store."""

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

from sglang_pools import PAGE, fill_pages, keys_for, make_backend, make_host_pool, page_bytes, page_starts, storage_config  # noqa: E402

HERE = Path(__file__).resolve().parent
PAGES = 24

CHILD = """
import sys, time, torch
from sglang_pools import PAGE, fill_pages, keys_for, make_backend, make_host_pool, page_bytes, page_starts, storage_config
path, tp_rank = sys.argv[1], int(sys.argv[2])
pool = make_host_pool("mla", "layer_first", size=512)
backend = make_backend(storage_config(path, mla=True, tp_rank=tp_rank, tp_size=2), pool)
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
backend.close()
print("child ok")
""".format(pages=PAGES)


def test_two_processes_write_and_read_each_others_pages(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(CHILD), str(tmp_path), "0"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        pool = make_host_pool("mla", "layer_first", size=512)
        backend = make_backend(storage_config(tmp_path, mla=True, tp_rank=0, tp_size=2), pool)
        src = pool.alloc(PAGES * PAGE)
        fill_pages(pool, src, torch.Generator().manual_seed(8))
        assert backend.batch_set_v1(keys_for("parent", PAGES), src) == [True] * PAGES
        theirs = keys_for("child", PAGES)
        deadline = time.monotonic() + 120
        while backend.batch_exists(theirs) < PAGES:
            assert child.poll() is None or child.returncode == 0, child.communicate()
            assert time.monotonic() < deadline, "the child's pages never appeared"
            time.sleep(0.05)
        expected = pool.alloc(PAGES * PAGE)
        fill_pages(pool, expected, torch.Generator().manual_seed(7))
        got = pool.alloc(PAGES * PAGE)
        assert backend.batch_get_v1(theirs, got) == [True] * PAGES
        assert [page_bytes(pool, g) for g in page_starts(got)] == [page_bytes(pool, e) for e in page_starts(expected)]
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, out + err[-3000:]
        assert "child ok" in out
        backend.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
