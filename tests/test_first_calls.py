"""A process's first data calls import nothing: every module a put, a get, a load or the
landing map needs is imported when kvtier is. A module imported lazily inside a call is a
stall of the first request that reaches it (numpy 2's `np.unique` imports `numpy.ma` on its
first call: 6-11 ms inside the first multi-page remote put, and inside the first load that
met a reload still landing). Each case runs in a fresh interpreter, on real objects."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_PRELUDE = """
import json, sys
import numpy as np
import torch
import kvtier
from kvtier import PageFormat, TieredPool, prefix_keys
from prometheus_client import CollectorRegistry

new = {}
def step(name, fn):
    before = set(sys.modules)
    fn()
    new[name] = sorted(set(sys.modules) - before)
"""


def _run(body: str, tmp_path: Path) -> dict:
    script = tmp_path / "first_calls.py"
    script.write_text(_PRELUDE + textwrap.dedent(body) + "\nprint(json.dumps(new))\n")
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=240,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_remote_stores_first_puts_and_gets_import_nothing(tmp_path):
    pytest.importorskip("nixl_cu13")
    new = _run(f"""
        from kvtier.index.keys import key_ids
        from kvtier.tiers.remote import RemoteStore
        page = 64 << 10
        src = torch.randint(1, 256, (40, page), dtype=torch.uint8)
        dst = torch.full((40, page), 0xA5, dtype=torch.uint8)
        store = RemoteStore({str(tmp_path / 'store')!r}, namespace="f1", page_bytes=page,
                            segment_bytes=16 << 20, capacity_bytes=1 << 30, create=True)
        store.register_host_memory(src)
        store.register_host_memory(dst)
        ids = key_ids(f"k{{i}}" for i in range(40))
        # 1 page: the system-call route; 12 and 24 pages: NIXL requests (several files' worth)
        for name, lo, hi in (("1", 0, 1), ("12", 1, 13), ("24", 13, 37)):
            step("put " + name, lambda: sys.exit("put failed") if not all(store.put_ids(ids[lo:hi], list(src[lo:hi]))) else None)
            step("get " + name, lambda: sys.exit("get failed") if not all(store.get_ids(ids[lo:hi], list(dst[lo:hi]))) else None)
        if not torch.equal(src[:37], dst[:37]):
            sys.exit("pages read back differ")
        step("exists", lambda: store.contains_ids(ids))
        store.close()
    """, tmp_path)
    assert set(new) == {"put 1", "get 1", "put 12", "get 12", "put 24", "get 24", "exists"}
    assert {name: mods for name, mods in new.items() if mods} == {}


def test_the_pools_first_calls_and_the_landing_map_import_nothing(tmp_path):
    new = _run("""
        from kvtier.pool.landing import Landing
        from kvtier.transfer import DoneTicket
        fmt = PageFormat(num_layers=2, num_kv_heads=2, head_dim=64, page_size=16, dtype="fp8_e4m3",
                         scale="per_page_head")
        pool = TieredPool(fmt, device="cpu", device_pages=300, host_pages=600, registry=CollectorRegistry())
        keys = prefix_keys(np.arange(16 * 200), 16, pool.namespace)
        def commit():
            slots = pool.allocate(200)
            pool.commit(keys, slots)
            pool.release(slots)
        def load():
            handle = pool.load(keys)
            handle.wait()
            pool.release(handle.slots)
        landing = Landing(64)
        first, second = DoneTicket(2), DoneTicket(2)
        def landing_calls():
            landing.mark([1, 2, 3], first)
            landing.mark([3, 4], second)
            if {id(t) for t in landing.tickets_of([2, 3, 4, 9])} != {id(first), id(second)}:
                sys.exit("tickets_of found other reloads")
        step("commit", commit)
        step("flush", pool.flush)
        step("evict", lambda: pool.evict(tier="device"))
        step("match", lambda: pool.match(keys))
        step("load", load)
        step("landing", landing_calls)
        pool.close()
    """, tmp_path)
    assert set(new) == {"commit", "flush", "evict", "match", "load", "landing"}
    assert {name: mods for name, mods in new.items() if mods} == {}
