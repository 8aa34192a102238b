"""kvtier against SGLang's own ``file`` and ``nixl`` storage backends, driven by SGLang's controller.

SGLang 0.5.23's ``HiCacheController`` methods run unchanged over one ``MHATokenToKVPoolHost``
on the CPU: ``_page_backup`` (write), ``_storage_hit_query`` (exists) and ``_page_transfer``
(read, cold and warm). The controller is built without its threads, distributed groups and
device pool (``HiCacheController.__new__`` plus the attributes those three methods read); it
picks the zero-copy v1 calls for ``nixl`` and for ``dynamic`` with ``interface_v1`` and the
copying calls for ``file``, as ``attach_storage_backend`` does. Backends: ``kvtier`` (the
``dynamic`` plugin path), SGLang's ``file``, SGLang's ``nixl`` (POSIX plugin, O_DIRECT as its
default; SGLang imports NIXL as ``nixl``, the nixl-cu13 wheel installs ``nixl_cu13``: this
script aliases the module for SGLang, kvtier imports ``nixl_cu13`` itself), and ``raw``: one
O_DIRECT file of the same bytes written with ``pwritev`` + ``fsync`` and read with ``preadv``
in 8 MiB calls into aligned memory from 4 threads (the disk through a plain path, 4 requests
queued).

Each backend first writes and reads one page untimed (what it sets up once belongs to no
cell). Per cell (page format, layout, batch of pages): every backend writes the same random pages
under fresh keys, then "exists", then a cold read (``posix_fadvise(DONTNEED)`` on every file of
the backend's directory first: records are clean after the write's fsync; no global cache drop,
the machine is shared), then a warm read. Reads go into other host pages poisoned with 0xA5 and
are compared with the written bytes; a wrong byte stops the run. Backends run interleaved
(the order rotates per run); medians over ``--runs``. "set+fsync" adds, for ``file`` and
``nixl`` (which do not sync), an ``fsync`` of every file the write created; kvtier syncs inside
its write. CPU time is ``time.process_time`` (all threads of the process); torch runs one
intra-op thread, as OpenMP workers spinning between SGLang's copies would count as CPU. A second
table splits each cold get's CPU into the calling thread's and the other threads' (kvtier's
checksum threads, the raw reader's), gives speeds against the raw reader, whether the host
pool's pieces are 4 KiB aligned (zero-copy under O_DIRECT) and what kvtier waited on (``bound``).

    PYTHONPATH=. build/sglang-harness/venv/bin/python benchmarks/sglang_backends.py [--quick]

Writes a table to stdout and JSON to ``--json`` (default benchmarks/results/sglang_backends_<date>.json).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import importlib
import importlib.metadata
import json
import logging
import mmap
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from queue import Queue

import numpy as np
import torch

# A source checkout's kvtier unless PYTHONPATH names another (an A/B against an older tree).
sys.path.append(str(Path(__file__).resolve().parents[1]))


def _alias_nixl() -> None:
    """SGLang imports ``nixl._api``; the installed wheel is ``nixl_cu13``."""
    try:
        importlib.import_module("nixl._api")
        return
    except ImportError:
        pass
    for name in ("nixl_cu13", "nixl_cu12"):
        try:
            package = importlib.import_module(name)
            api = importlib.import_module(f"{name}._api")
        except ImportError:
            continue
        sys.modules["nixl"] = package
        sys.modules["nixl._api"] = api
        return


_alias_nixl()

from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation, StorageOperation  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
try:  # SGLang 0.5.23; 0.5.17 (the newest on the GPU machine's torch) has no host budget
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope  # noqa: E402
except ImportError:
    def host_memory_budget_scope(_bytes):
        return contextlib.nullcontext()
from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
try:
    from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402
except ImportError:  # SGLang 0.5.17: the same page hashes under their older name
    from sglang.srt.mem_cache.utils import get_hash_str as get_storage_hash_str  # noqa: E402

import kvtier  # noqa: E402
from kvtier.adapters.sglang.namespace import record_kv_format  # noqa: E402

PAGE = 64
BACKENDS = ("kvtier", "file", "nixl", "raw")
KVTIER_EXTRA = {
    "backend_name": "kvtier",
    "module_path": "kvtier.adapters.sglang.backend",
    "class_name": "KvtierHiCacheStorage",
    "interface_v1": 1,
}
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
POISON = 0xA5
RAW_CHUNK = 8 << 20
RAW_THREADS = 4


def record_format(dtype: torch.dtype, layers: int) -> None:
    """What kvtier's SGLang plugin records from the model runner in a server: the KV dtype and,
    for fp8, each attention layer's k/v scales (SGLang's own ``RadixAttention`` modules)."""
    from sglang.srt.layers.radix_attention import RadixAttention

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList()
    for layer in range(layers):
        block = torch.nn.Module()
        block.attn = RadixAttention(8, 128, 0.125, 8, layer_id=layer)
        block.attn.k_scale_float = block.attn.v_scale_float = 0.5
        model.layers.append(block)
    record_kv_format("target", model, dtype)


def host_pool(dtype: torch.dtype, layout: str, layers: int, heads: int, head_dim: int, pages: int,
              pin_memory: bool):
    with host_memory_budget_scope(1 << 40):
        device = MHATokenToKVPool(
            size=pages * PAGE, page_size=PAGE, dtype=dtype, head_num=heads, head_dim=head_dim,
            layer_num=layers, device="cpu", enable_memory_saver=False,
        )
        if hasattr(device, "get_device_pool_infos"):
            info = device.get_device_pool_infos()[0].buffer_info
            pool = get_mha_host_pool_cls(info)(
                info, 1.0, 0, PAGE, layout, pin_memory=pin_memory, device="cpu",
                device_capacity_tokens=device.size, start_layer=device.start_layer, end_layer=device.end_layer,
            )
        else:  # SGLang 0.5.17: the host pool takes (and keeps) the device pool itself
            pool = get_mha_host_pool_cls(device)(device, 1.0, 0, PAGE, layout, pin_memory=pin_memory, device="cpu")
    del device
    return pool


def page_views(pool, first_page: int, count: int) -> list[np.ndarray]:
    """uint8 views of every piece of ``count`` pages from ``first_page``, through SGLang's
    ``get_page_buffer_meta``."""
    indices = torch.arange(first_page * PAGE, (first_page + count) * PAGE, dtype=torch.int64)
    ptrs, sizes = pool.get_page_buffer_meta(indices)
    return [np.ctypeslib.as_array((ctypes.c_ubyte * s).from_address(p)) for p, s in zip(ptrs, sizes)]


def pieces_aligned(pool, pages: int) -> bool:
    """Whether every piece of the first ``pages`` pages starts and ends on 4 KiB (what
    ``O_DIRECT`` needs for a zero-copy read into the pool)."""
    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(pages * PAGE, dtype=torch.int64))
    return all((int(p) | int(s)) % 4096 == 0 for p, s in zip(ptrs, sizes))


def fill(views: list[np.ndarray], rng: np.random.Generator) -> None:
    for v in views:
        v[:] = rng.integers(1, 256, size=v.size, dtype=np.uint8)


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b))


def storage_config(backend: str, path: str, layout: str, model: str) -> HiCacheStorageConfig:
    extra = {**KVTIER_EXTRA, "path": path} if backend == "kvtier" else {}
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=layout != "layer_first",
        model_name=model, extra_config=extra,
    )


def controller(backend_name: str, path: str, pool, layout: str, model: str) -> HiCacheController:
    """SGLang's controller around a backend, without threads (see the module docstring)."""
    factory_name = "dynamic" if backend_name == "kvtier" else backend_name
    if backend_name == "file":
        os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = path
    if backend_name == "nixl":
        os.environ["SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR"] = path
        os.environ["SGLANG_HICACHE_NIXL_BACKEND_PLUGIN"] = "POSIX"
    config = storage_config(backend_name, path, layout, model)
    backend = StorageBackendFactory.create_backend(factory_name, config, pool)
    backend.register_mem_pool_host(pool)
    if hasattr(backend, "on_host_pools_registered"):
        backend.on_host_pools_registered()
    ctrl = HiCacheController.__new__(HiCacheController)
    ctrl.storage_backend = backend
    ctrl.storage_backend_type = factory_name
    ctrl.storage_config = config
    ctrl.mem_pool_host = ctrl.storage_host_pool = pool
    ctrl.page_size = PAGE
    ctrl.prefetch_sync_queue = Queue()
    # SGLang 0.5.17 also writes and reads a draft model's pages beside the target's when it has one
    ctrl.has_draft = False
    ctrl.get_hash_str = get_storage_hash_str  # 0.5.17 hashes pages through this attribute
    ctrl.mem_pool_host_draft = ctrl.draft_page_get_func = ctrl.draft_page_set_func = None
    zero_copy = factory_name == "nixl" or (factory_name == "dynamic" and config.extra_config.get("interface_v1"))
    ctrl.page_get_func = ctrl._page_get_zero_copy if zero_copy else ctrl._generic_page_get
    ctrl.page_set_func = ctrl._page_set_zero_copy if zero_copy else ctrl._generic_page_set
    return ctrl


def files_under(path: str) -> list[str]:
    return [os.path.join(root, name) for root, _, names in os.walk(path) for name in names]


def drop_cache(path: str) -> None:
    for name in files_under(path):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fsync_new(path: str, before: set[str]) -> None:
    for name in files_under(path):
        if name not in before:
            fd = os.open(name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def timed(fn) -> tuple[float, float, object]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, result


def timed_split(fn) -> tuple[float, float, float, object]:
    """``timed`` plus the calling thread's own CPU time (the rest ran on other threads: kvtier's
    checksum threads, NIXL's, the raw reader's)."""
    own = time.thread_time()
    wall, cpu, result = timed(fn)
    return wall, cpu, time.thread_time() - own, result


class Raw:
    """The disk through a plain path: one O_DIRECT file, 8 MiB ``pwritev``/``preadv`` calls
    from ``RAW_THREADS`` threads at once (that many requests queued at the device), one fsync."""

    def __init__(self, path: str, nbytes: int):
        self.path = os.path.join(path, "raw.bin")
        self.nbytes = nbytes
        self.buffers = [mmap.mmap(-1, RAW_CHUNK) for _ in range(RAW_THREADS)]  # page aligned
        for buffer in self.buffers:
            buffer.write(os.urandom(RAW_CHUNK))
        self.offsets = list(range(0, nbytes, RAW_CHUNK))

    def _each(self, fd: int, call) -> None:
        def run(lane: int) -> None:
            view = memoryview(self.buffers[lane])
            for off in self.offsets[lane::RAW_THREADS]:
                call(fd, [view[: min(RAW_CHUNK, self.nbytes - off)]], off)

        with ThreadPoolExecutor(RAW_THREADS) as pool:
            list(pool.map(run, range(RAW_THREADS)))

    def write(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            self._each(fd, os.pwritev)
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self) -> None:
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
        try:
            self._each(fd, os.preadv)
        finally:
            os.close(fd)


def run_cell(name: str, ctrl, raw: Raw, pool, batch: int, tokens: list[int], src: list[np.ndarray],
             dst: list[np.ndarray], path: str) -> dict:
    """One backend, one batch: set, exists, cold get, warm get; bytes checked."""
    out: dict = {}
    if name == "raw":
        out["set_s"], out["set_cpu_s"], _ = timed(raw.write)
        out["set_fsync_s"] = out["set_s"]
        for mode in ("cold", "warm"):
            if mode == "cold":
                drop_cache(path)
            out[f"get_{mode}_s"], out[f"get_{mode}_cpu_s"], out[f"get_{mode}_caller_cpu_s"], _ = timed_split(raw.read)
        return out
    hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
    backup = StorageOperation(torch.arange(0, batch * PAGE, dtype=torch.int64), tokens, hash_value=hashes)
    before = set(files_under(path))
    out["set_s"], out["set_cpu_s"], _ = timed(lambda: ctrl._page_backup(backup))
    if backup.completed_tokens != batch * PAGE:
        raise RuntimeError(f"{name}: wrote {backup.completed_tokens} of {batch * PAGE} tokens")
    sync_s = 0.0
    if name != "kvtier":
        sync_s, _, _ = timed(lambda: fsync_new(path, before))
    out["set_fsync_s"] = out["set_s"] + sync_s
    query = PrefetchOperation(f"bench-{name}", tokens)
    out["exists_s"], out["exists_cpu_s"], found = timed(lambda: ctrl._storage_hit_query(query))
    if found[1] != batch * PAGE:
        raise RuntimeError(f"{name}: exists found {found[1]} of {batch * PAGE} tokens")
    for mode in ("cold", "warm"):
        for v in dst:
            v.fill(POISON)
        if mode == "cold":
            drop_cache(path)
        read = PrefetchOperation(f"bench-{name}", tokens)
        read.host_indices = torch.arange(batch * PAGE, 2 * batch * PAGE, dtype=torch.int64)
        read.hash_value = hashes
        out[f"get_{mode}_s"], out[f"get_{mode}_cpu_s"], out[f"get_{mode}_caller_cpu_s"], got = timed_split(
            lambda: ctrl._page_transfer(read))
        while not ctrl.prefetch_sync_queue.empty():
            ctrl.prefetch_sync_queue.get_nowait()
        if got is None:  # SGLang 0.5.17 returns nothing: count the completed tokens
            got = read.completed_tokens // PAGE
        if got != batch:
            raise RuntimeError(f"{name}: read {got} of {batch} pages ({mode})")
        if not same(src, dst):
            raise RuntimeError(f"{name}: pages read back ({mode}) differ from the pages written")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a subset in under 2 minutes")
    parser.add_argument("--dir", default=None, help="store directory (default: a temp dir under benchmarks/)")
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--json", default=None)
    parser.add_argument("--pin-memory", action="store_true",
                        help="pinned (page-aligned) host pool, as SGLang allocates with CUDA; needs CUDA")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("sglang").setLevel(logging.ERROR)
    logging.getLogger("nixl").setLevel(logging.ERROR)
    backends = args.backends.split(",")
    if args.quick:
        cells = [("bf16", "page_first", 8, 8, [1, 8, 64]), ("fp8", "layer_first", 8, 8, [1, 8, 64])]
        runs = args.runs or 1
    else:
        cells = [(d, l, 8, 8, [1, 8, 64, 512]) for d in ("bf16", "fp8") for l in ("page_first", "layer_first")]
        cells.append(("bf16", "page_first", 32, 8, [1, 8, 64]))
        runs = args.runs or 3
    # Tiny pages (1 kv head of 32: 64 KiB a page, 4 KiB pieces layer_first): the fixed cost of a call.
    cells += [("bf16", "page_first", 8, 1, [1, 128]), ("bf16", "layer_first", 8, 1, [1, 128])]
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="sglang-backends-", dir=Path(__file__).parent))
    rng = np.random.default_rng(0)
    rows = []
    print(f"kvtier from {Path(kvtier.__file__).parent}; dir {base}; crc32c in hardware: {_crc32c_hardware()}",
          flush=True)
    try:
        for dtype, layout, layers, heads, batches in cells:
            record_format(DTYPES[dtype], layers)
            head_dim = 128 if heads == 8 else 32
            pool = host_pool(DTYPES[dtype], layout, layers, heads, head_dim, 2 * max(batches) + 1, args.pin_memory)
            page_bytes = sum(int(s) for s in pool.get_page_buffer_meta(torch.arange(PAGE))[1])
            aligned = pieces_aligned(pool, 2 * max(batches))
            print(f"{dtype} {layout} L{layers} H{heads}: host pool pieces 4 KiB aligned: {aligned} "
                  f"(kvtier {'zero-copy' if aligned else 'stages through aligned blocks'} under O_DIRECT)", flush=True)
            model = f"bench-{dtype}-{layout}-{layers}-{heads}"
            ctrls = {}
            for name in backends:
                path = str(base / f"{model}-{name}")
                os.makedirs(path, exist_ok=True)
                ctrls[name] = (controller(name, path, pool, layout, model) if name != "raw" else None, path)
            # One untimed page per backend first: files, registrations and threads that a
            # backend makes once belong to no cell.
            src, dst = page_views(pool, 0, 1), page_views(pool, 1, 1)
            fill(src, rng)
            for name in backends:
                ctrl, path = ctrls[name]
                raw = Raw(path, page_bytes) if name == "raw" else None
                run_cell(name, ctrl, raw, pool, 1, rng.integers(1, 1 << 30, size=PAGE).tolist(), src, dst, path)
            for batch in batches:
                src, dst = page_views(pool, 0, batch), page_views(pool, batch, batch)
                fill(src, rng)
                samples: dict[str, list[dict]] = {name: [] for name in backends}
                for run in range(runs):
                    order = backends[run % len(backends):] + backends[: run % len(backends)]
                    for name in order:
                        ctrl, path = ctrls[name]
                        tokens = rng.integers(1, 1 << 30, size=batch * PAGE).tolist()
                        raw = Raw(path, batch * page_bytes) if name == "raw" else None
                        samples[name].append(run_cell(name, ctrl, raw, pool, batch, tokens, src, dst, path))
                for name in backends:
                    med = {k: statistics.median(s[k] for s in samples[name]) for k in samples[name][0]}
                    row = {"backend": name, "dtype": dtype, "layout": layout, "layers": layers, "kv_heads": heads,
                           "batch": batch, "page_bytes": page_bytes, "runs": runs, "pool_aligned": aligned, **med}
                    rows.append(row)
                    print(format_row(row), flush=True)
            for ctrl, path in ctrls.values():
                if ctrl is not None and hasattr(ctrl.storage_backend, "close"):
                    ctrl.storage_backend.close()
                # a format's pages (GBs at 512 x 2 MiB per backend) go before the next format's
                shutil.rmtree(path, ignore_errors=True)
            del pool, ctrls
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    print()
    print(ratio_table(rows))
    print()
    print(cold_table(rows))
    result = {
        "benchmark": "sglang_backends",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs, kernel {platform.release()}",
        "versions": {p: _version(p) for p in ("sglang", "torch", "nixl-cu13", "kvtier", "crc32c")},
        "crc32c_hardware": _crc32c_hardware(),
        "kvtier_path": str(Path(kvtier.__file__).parent),
        "quick": args.quick,
        "pin_memory": args.pin_memory,
        "rows": rows,
    }
    out = Path(args.json) if args.json else (
        Path(__file__).parent / "results" / f"sglang_backends_{datetime.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\nJSON: {out}")


def _crc32c_hardware():
    """Whether the crc32c module checksums with the CPU's CRC32 instructions (kvtier's checks
    cost several times more without them)."""
    try:
        import crc32c
    except ImportError:
        return None
    return bool(getattr(crc32c, "hardware_based", False))


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "source"


def format_row(row: dict) -> str:
    n, mib = row["batch"], row["batch"] * row["page_bytes"] / 2**20
    parts = [f"{row['backend']:>6} {row['dtype']} {row['layout']:<11} L{row['layers']:<2} H{row['kv_heads']} x{n:<4}"]
    for op in ("set", "get_cold", "get_warm"):
        parts.append(f"{op} {mib / row[op + '_s'] / 1024:5.2f} GiB/s")
    parts.append(f"set+fsync {mib / row['set_fsync_s'] / 1024:5.2f}")
    for op in ("set", "exists", "get_cold", "get_warm"):
        if f"{op}_cpu_s" in row:
            parts.append(f"{op} {row[op + '_cpu_s'] / n * 1e6:7.1f} us/pg")
    return "  ".join(parts)


def ratio_table(rows: list[dict]) -> str:
    """kvtier / peer speed (wall) and CPU per page (warm get), per cell."""
    by = {(r["dtype"], r["layout"], (r["layers"], r["kv_heads"]), r["batch"], r["backend"]): r for r in rows}
    lines = ["| cell | pages | get cold kvtier/nixl | /file | /raw | get warm /nixl | set+fsync /nixl | /file "
             "| CPU us/page get kvtier, file, nixl | set | exists |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (dtype, layout, layers, batch, backend), r in by.items():
        if backend != "kvtier":
            continue
        peer = {b: by.get((dtype, layout, layers, batch, b)) for b in ("file", "nixl", "raw")}

        def speed(b, op):
            p = peer[b]
            return f"{p[op] / r[op]:.2f}x" if p else "-"

        def cpu(op):
            vals = [r] + [peer[b] for b in ("file", "nixl")]
            return ", ".join(f"{v[op + '_cpu_s'] / batch * 1e6:.0f}" if v else "-" for v in vals)

        lines.append(
            f"| {dtype} {layout} L{layers[0]} H{layers[1]} {r['page_bytes'] >> 10} KiB | {batch} | {speed('nixl', 'get_cold_s')} | {speed('file', 'get_cold_s')} "
            f"| {speed('raw', 'get_cold_s')} | {speed('nixl', 'get_warm_s')} | {speed('nixl', 'set_fsync_s')} "
            f"| {speed('file', 'set_fsync_s')} | {cpu('get_warm')} | {cpu('set')} | {cpu('exists')} |"
        )
    return "\n".join(lines)


def bound(kvtier: dict, raw: dict | None) -> str:
    """What a cold kvtier get waited on (a heuristic): ``disk`` within 10% of the raw O_DIRECT
    reader's time; else ``cpu`` where the calling thread was busy half the wall time or more;
    else ``gaps`` (neither: waits between requests, the last request's checks, queueing)."""
    if raw and raw["get_cold_s"] >= 0.9 * kvtier["get_cold_s"]:
        return "disk"
    if kvtier.get("get_cold_caller_cpu_s", 0.0) >= 0.5 * kvtier["get_cold_s"]:
        return "cpu"
    return "gaps"


def cold_table(rows: list[dict]) -> str:
    """Cold get per cell: speeds against the raw O_DIRECT reader, CPU per page split into the
    calling thread and the others, and what kvtier waited on (``bound``)."""
    by = {(r["dtype"], r["layout"], (r["layers"], r["kv_heads"]), r["batch"], r["backend"]): r for r in rows}
    lines = ["| cell | pages | pool 4K-aligned | raw GiB/s | kvtier / raw | nixl / raw | kvtier / nixl "
             "| cold CPU us/page kvtier caller + others | nixl caller + others | kvtier bound |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (dtype, layout, layers, batch, backend), r in by.items():
        if backend != "kvtier":
            continue
        raw, nixl = by.get((dtype, layout, layers, batch, "raw")), by.get((dtype, layout, layers, batch, "nixl"))
        mib = batch * r["page_bytes"] / 2**20

        def split(v):
            if not v or "get_cold_caller_cpu_s" not in v:
                return "-"
            caller = v["get_cold_caller_cpu_s"] / batch * 1e6
            # the two clocks tick apart (process time in 10 ms steps on some kernels): not below 0
            return f"{caller:.0f} + {max(0.0, v['get_cold_cpu_s'] / batch * 1e6 - caller):.0f}"

        def ratio(num, den):
            return f"{num['get_cold_s'] / den['get_cold_s']:.2f}x" if num and den else "-"

        raw_speed = f"{mib / 1024 / raw['get_cold_s']:.2f}" if raw else "-"
        lines.append(
            f"| {dtype} {layout} L{layers[0]} H{layers[1]} {r['page_bytes'] >> 10} KiB | {batch} "
            f"| {r.get('pool_aligned', '-')} | {raw_speed} | {ratio(raw, r)} | {ratio(raw, nixl)} "
            f"| {ratio(nixl, r)} | {split(r)} | {split(nixl)} | {bound(r, raw)} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
