"""What the kvtier SGLang backend adds to the store's own time, per batch of 128 pages.

Runs in the SGLang harness venv (``make test-sglang`` builds it) on the CPU: sglang's own host
pools, kvtier's store on NIXL (POSIX) in a temporary directory. For each layout it times, median
of ``--repeats`` (the adapter's and the store's calls interleaved): the adapter's bookkeeping alone (key ids, ``get_page_buffer_meta``, piece and
bounds checks), then ``batch_set_v1`` / ``batch_get_v1`` against the store's ``put_ids`` /
``get_ids`` on the same pieces. Prints a table; ``--json`` writes the numbers.

    build/sglang-harness/venv/bin/python examples/sglang/adapter_overhead.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "sglang"))

from sglang_pools import fill_pages, keys_for, make_backend, make_host_pool, storage_config  # noqa: E402

from kvtier.index.keys import key_ids  # noqa: E402

BATCH = 128


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(kind: str, layout: str, layers: int, heads: int, head_dim: int, page: int, repeats: int) -> dict:
    pool = make_host_pool(kind, layout, layers=layers, heads=heads, head_dim=head_dim, page=page,
                          size=2 * BATCH * page)
    with tempfile.TemporaryDirectory() as directory:
        backend = make_backend(storage_config(directory, mla=kind == "mla"), pool)
        lane = backend._anchor
        idx = pool.alloc(BATCH * page)
        fill_pages(pool, idx, torch.Generator().manual_seed(0))
        row = {"pool": kind, "layout": layout, "pieces": len(lane.piece_sizes), "page_kib": lane.page_bytes / 1024}
        keys = keys_for(f"{kind}-{layout}", BATCH)
        row["bookkeeping_ms"] = median_ms(lambda: (key_ids(keys), lane.page_buffers(idx, BATCH)), repeats)
        buffers = lane.page_buffers(idx, BATCH)
        sets, puts = [], []
        for r in range(repeats):
            fresh = keys_for(f"{kind}-{layout}-set-{r}", BATCH)
            start = time.perf_counter()
            assert backend.batch_set_v1(fresh, idx) == [True] * BATCH
            sets.append((time.perf_counter() - start) * 1e3)
            fresh = keys_for(f"{kind}-{layout}-put-{r}", BATCH)
            start = time.perf_counter()
            assert lane.store.put_ids(key_ids(fresh), buffers) == [True] * BATCH
            puts.append((time.perf_counter() - start) * 1e3)
        row["batch_set_v1_ms"], row["store_put_ms"] = statistics.median(sets), statistics.median(puts)
        stored = keys_for(f"{kind}-{layout}-set-0", BATCH)
        ids = key_ids(stored)
        gets, store_gets = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            assert backend.batch_get_v1(stored, idx) == [True] * BATCH
            gets.append((time.perf_counter() - start) * 1e3)
            start = time.perf_counter()
            assert lane.store.get_ids(ids, buffers) == [True] * BATCH
            store_gets.append((time.perf_counter() - start) * 1e3)
        row["batch_get_v1_ms"], row["store_get_ms"] = statistics.median(gets), statistics.median(store_gets)
        backend.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cases = [
        ("mha", "page_first", 8, 8, 128, 16),
        ("mha", "layer_first", 8, 8, 128, 16),
        ("mla", "page_first", 8, 1, 512, 16),
        ("mla", "layer_first", 8, 1, 512, 16),
    ]
    rows = [measure(*case, repeats=args.repeats) for case in cases]
    columns = ["pool", "layout", "pieces", "page_kib", "bookkeeping_ms", "batch_set_v1_ms", "store_put_ms",
               "batch_get_v1_ms", "store_get_ms"]
    print(f"batch of {BATCH} pages, median of {args.repeats} (ms)")
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(f"{row[c]:.2f}" if isinstance(row[c], float) else str(row[c]) for c in columns))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
