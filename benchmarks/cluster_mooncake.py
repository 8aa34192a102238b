"""The cluster tier against SGLang's own `mooncake` backend, through SGLang's controller calls.

One real mooncake_master on loopback (started here, TCP, its HTTP metadata server), one SGLang
MHA host pool (page_first) on the CPU, and per system a writer and a reader backend, each its own
Mooncake client lending its own segment, created by SGLang's StorageBackendFactory and registered
with the host pool as SGLang's cache controller does. Each batch of 1-512 pages is written by
`batch_set_v1` (fresh keys; the cluster is emptied between batch sizes), asked by `batch_exists` and read by `batch_get_v1` into poisoned host
pages by the reader, which then checks every page byte for byte. Reported: CPU time of the whole
process per page (Mooncake's transfer threads included), and wall time per call, medians.

Systems:
- sglang-mooncake: SGLang's HiCacheMooncake (one object for K and one for V of each page).
- kvtier-cluster: the kvtier backend whose lanes hold the cluster tier alone (one object per page:
  the kvtier record header, K and V; CRC32C checked on every read).
- kvtier-chain: the kvtier backend as KVTIER_CLUSTER configures it: its local store (NIXL files,
  fdatasync per batch) with the cluster behind it; the reader's local store is empty, so every
  read is a local miss served by the cluster.

Run in the SGLang harness: build/sglang-harness/venv/bin/python benchmarks/cluster_mooncake.py
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "sglang")]

import torch  # noqa: E402
from mooncake_master import Master  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang_pools import SGLANG_EXTRA, fill_pages, make_host_pool, poison_pages  # noqa: E402

BATCHES = (1, 4, 16, 64, 256, 512)


def config(extra: dict) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="bench/model", extra_config=extra,
    )


def backend(kind: str, pool, master: Master, segment: int, workdir: Path):
    if kind == "sglang-mooncake":
        extra = {"master_server_address": master.address, "metadata_server": master.metadata_server,
                 "protocol": "tcp", "device_name": "", "global_segment_size": segment, "local_hostname": "127.0.0.1"}
        made = StorageBackendFactory.create_backend("mooncake", config(extra), pool)
    else:
        os.environ.update({"KVTIER_CLUSTER": master.address, "KVTIER_CLUSTER_METADATA_SERVER": master.metadata_server,
                           "KVTIER_CLUSTER_LOCAL_HOSTNAME": "127.0.0.1", "KVTIER_CLUSTER_SEGMENT_BYTES": str(segment)})
        made = StorageBackendFactory.create_backend("dynamic", config({**SGLANG_EXTRA, "path": str(workdir)}), pool)
    made.register_mem_pool_host(pool)
    if hasattr(made, "on_host_pools_registered"):
        made.on_host_pools_registered()
    if kind == "kvtier-cluster":  # the lane keeps the cluster tier alone, without the local store
        lane = made._anchor
        lane.store.local.close()
        lane.store = lane.store.cluster
    return made


def timed(fn, reps: int) -> tuple[float, float]:
    """Median (CPU s, wall s) of `reps` calls of fn(rep)."""
    cpu, wall = [], []
    for rep in range(reps):
        c0, w0 = time.process_time(), time.perf_counter()
        fn(rep)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return statistics.median(cpu), statistics.median(wall)


def page_view(pool, index: torch.Tensor) -> bytes:
    ptrs, sizes = pool.get_page_buffer_meta(index)
    return b"".join(ctypes.string_at(p, s) for p, s in zip(ptrs, sizes))


def run_system(kind: str, master: Master, args, workdir: Path, janitor) -> list[dict]:
    page = args.page_tokens
    size = (max(BATCHES) + 8) * page
    pool_w = make_host_pool("mha", "page_first", layers=args.layers, heads=args.heads, head_dim=args.head_dim,
                            size=size, page=page)
    pool_r = make_host_pool("mha", "page_first", layers=args.layers, heads=args.heads, head_dim=args.head_dim,
                            size=size, page=page)
    writer = backend(kind, pool_w, master, args.segment_bytes, workdir / f"{kind}-w")
    reader = backend(kind, pool_r, master, args.segment_bytes, workdir / f"{kind}-r")
    src = pool_w.alloc(max(BATCHES) * page)
    dst = pool_r.alloc(max(BATCHES) * page)
    fill_pages(pool_w, src, torch.Generator().manual_seed(1))
    page_bytes = sum(pool_w.get_page_buffer_meta(src[:page])[1])
    rows = []
    for n in BATCHES:
        reps = max(3, min(args.reps, 2048 // n))
        names = [[f"{kind}/{n}/{rep}/{i}" for i in range(n)] for rep in range(reps)]
        idx_w, idx_r = src[: n * page], dst[: n * page]
        put_cpu, put_wall = timed(lambda rep: writer.batch_set_v1(names[rep], idx_w), reps)
        exists_cpu, exists_wall = timed(lambda rep: reader.batch_exists(names[rep]), reps)
        ok = []

        def get(rep):
            ok.append(reader.batch_get_v1(names[rep], idx_r))

        poison_pages(pool_r, idx_r)  # each get overwrites them; the check below reads the last
        get_cpu, get_wall = timed(get, reps)
        exact = all(all(r) for r in ok) and all(
            page_view(pool_r, idx_r[p * page : (p + 1) * page]) == page_view(pool_w, idx_w[p * page : (p + 1) * page])
            for p in range(n)
        )
        row = {"system": kind, "pages": n, "page_bytes": page_bytes, "reps": reps, "exact": exact,
               "put_cpu_us_per_page": put_cpu / n * 1e6, "get_cpu_us_per_page": get_cpu / n * 1e6,
               "exists_cpu_us_per_page": exists_cpu / n * 1e6, "put_wall_ms": put_wall * 1e3,
               "get_wall_ms": get_wall * 1e3, "exists_wall_ms": exists_wall * 1e3}
        rows.append(row)
        janitor.remove_all()  # every system starts each batch size on an empty cluster
        print(f"{kind:16} {n:4} pages  put {row['put_cpu_us_per_page']:8.1f}  get {row['get_cpu_us_per_page']:8.1f}  "
              f"exists {row['exists_cpu_us_per_page']:7.2f} µs CPU/page | wall put {row['put_wall_ms']:7.2f} "
              f"get {row['get_wall_ms']:7.2f} exists {row['exists_wall_ms']:6.2f} ms  exact={exact}", flush=True)
    for made in (writer, reader):
        made.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default="sglang-mooncake,kvtier-cluster,kvtier-chain")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--page-tokens", type=int, default=16)
    parser.add_argument("--segment-bytes", type=int, default=768 << 20)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2, help="systems alternate A/B/A/B this many times")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cluster_mooncake.json"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        master = Master(Path(tmp))
        master.start()
        from mooncake.store import MooncakeDistributedStore

        janitor = MooncakeDistributedStore()  # lends nothing; empties the cluster between runs
        assert janitor.setup("127.0.0.1", master.metadata_server, 0, 16 << 20, "tcp", "", master.address) == 0
        try:
            for round in range(args.rounds):
                for kind in args.systems.split(","):
                    for row in run_system(kind, master, args, Path(tmp) / f"r{round}", janitor):
                        rows.append({**row, "round": round})
        finally:
            janitor.close()
            master.stop()
    import mooncake
    import sglang

    medians = {}
    for row in rows:
        medians.setdefault((row["system"], row["pages"]), []).append(row)
    summary = []
    for (system, n), group in medians.items():
        summary.append({"system": system, "pages": n, "exact": all(r["exact"] for r in group),
                        **{k: statistics.median(r[k] for r in group) for k in group[0]
                           if k.endswith(("_us_per_page", "_ms"))}})
    print("\nmedians over rounds (µs CPU per page): pages | " + " | ".join(
        f"{s} put/get/exists" for s in args.systems.split(",")))
    for n in BATCHES:
        cells = []
        for s in args.systems.split(","):
            r = next(x for x in summary if x["system"] == s and x["pages"] == n)
            cells.append(f"{r['put_cpu_us_per_page']:.1f} / {r['get_cpu_us_per_page']:.1f} / {r['exists_cpu_us_per_page']:.2f}")
        print(f"{n:5} | " + " | ".join(cells))
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.platform(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "sglang": getattr(sglang, "__version__", "?"), "mooncake": getattr(mooncake, "__version__", "0.3.13.post1"),
            "args": vars(args)}
    Path(args.out).write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
