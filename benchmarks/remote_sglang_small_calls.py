"""CPU cost of kvtier's SGLang backend on 1-page and small batches: batch_set_v1, batch_get_v1
and batch_exists through ``KvtierHiCacheStorage`` over a real ``MHATokenToKVPoolHost`` (the
``make test-sglang`` harness), what an engine pays per call on its thread.

``time.process_time`` (all threads) around each call, median over ``--calls``; writes use fresh
keys, reads the pages just written (bytes compared after every read, poisoned before). One
page is ``--layers`` x 2 (K, V) x 64 tokens x ``--heads`` x 128 x bf16.

    PYTHONPATH=. build/sglang-harness/venv/bin/python benchmarks/remote_sglang_small_calls.py
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))
sys.path.append(str(ROOT / "tests" / "sglang"))

import torch  # noqa: E402

from sglang_pools import PAGE, fill_pages, keys_for, make_backend, make_host_pool, storage_config  # noqa: E402


def page_bytes(pool, indices) -> bytes:
    ptrs, sizes = pool.get_page_buffer_meta(indices)
    return b"".join(ctypes.string_at(p, s) for p, s in zip(ptrs, sizes))


def measure(directory: str, layout: str, layers: int, heads: int, pages: int, calls: int) -> dict:
    torch.set_num_threads(1)
    pool = make_host_pool("mha", layout, layers=layers, heads=heads, head_dim=128)
    backend = make_backend(storage_config(directory), pool)
    try:
        src, dst = pool.alloc(pages * PAGE), pool.alloc(pages * PAGE)
        fill_pages(pool, src, torch.Generator().manual_seed(7))
        expected = page_bytes(pool, src)
        keys = keys_for(f"{layout}-{pages}", pages * (calls + 10))
        groups = [keys[i : i + pages] for i in range(0, len(keys), pages)]
        for group in groups[:10]:  # what is set up once (segments, blocks) belongs to no call
            backend.batch_set_v1(group, src)
        sets, gets, exists = [], [], []
        for group in groups[10:]:
            start = time.process_time()
            ok = backend.batch_set_v1(group, src)
            sets.append(time.process_time() - start)
            if ok != [True] * pages:
                raise RuntimeError("set failed")
        for group in groups[10:]:
            ptrs, sizes = pool.get_page_buffer_meta(dst)
            for p, s in zip(ptrs, sizes):
                ctypes.memset(p, 0xA5, s)
            start = time.process_time()
            ok = backend.batch_get_v1(group, dst)
            gets.append(time.process_time() - start)
            if ok != [True] * pages or page_bytes(pool, dst) != expected:
                raise RuntimeError("get missed or returned other bytes")
            start = time.process_time()
            found = backend.batch_exists(group)
            exists.append(time.process_time() - start)
            if found != pages:
                raise RuntimeError("exists missed")
    finally:
        backend.close()
    us = lambda samples: statistics.median(samples) * 1e6 / pages  # noqa: E731
    return {"set": us(sets), "get": us(gets), "exists": us(exists)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", help="directory for the stores (default: a temporary one)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--pages", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--layouts", nargs="+", default=["page_first", "layer_first"])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="kvtier-sgsmall-", dir=args.dir)
    rows = []
    try:
        for layout in args.layouts:
            for pages in args.pages:
                runs = [
                    measure(os.path.join(root, f"{layout}-{pages}-{r}"), layout, args.layers, args.heads, pages, args.calls)
                    for r in range(args.repeat)
                ]
                row = {"layout": layout, "pages": pages,
                       **{k: statistics.median(run[k] for run in runs) for k in ("set", "get", "exists")}}
                rows.append(row)
                print(f"{layout:12s} x{pages:<4d} CPU us/page  set {row['set']:8.1f}  get {row['get']:7.1f}  "
                      f"exists {row['exists']:6.1f}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "args": vars(args)}, f, indent=2)


if __name__ == "__main__":
    main()
