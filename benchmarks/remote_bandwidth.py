"""Write and read bandwidth of the remote page store against the raw disk, in one run.

For each page size the same bytes go through two paths in the same directory:
- raw: a plain Python writer, one ``os.write`` per page into a fresh file and an ``fsync`` per
  batch; reads with one ``os.preadv`` per page;
- store: ``RemoteStore.put_ids`` / ``get_ids`` in batches of the same size (NIXL requests of
  ``--pipeline-mib``, CRC32C per page, ``fdatasync`` and index commits per put batch; header and
  CRC32C checked on read; with ``--mac`` also a keyed BLAKE2b-128 MAC per page, written and
  checked).

Reads are measured twice. "cold": after ``posix_fadvise(DONTNEED)`` on every file of both paths
(records are clean after fsync, so the kernel drops them and reads come from the device; a global
page-cache drop needs root and is not used). "warm": right after, from the page cache, for both
paths. On a VM the first read of freshly written blocks can be several times slower than later
ones whoever wrote them (measured here: 0.2-1.5 GB/s, then 1.7-1.9), so by default both paths are
read once, untimed, before the cold measurement (``--no-prime`` to skip). Writes always go to freshly created files (block allocation included for both). Cloud
disks change speed over a run (burst credits, discards), so each size is measured ``--repeat``
times, the path that goes first alternates, and medians are reported.

    python benchmarks/remote_bandwidth.py --dir /mnt/nvme/bench --total-mib 512 --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a source checkout too

from kvtier.index.keys import key_ids  # noqa: E402
from kvtier.tiers.remote import RemoteStore, load_nixl_api  # noqa: E402

try:
    from tqdm import tqdm
except ImportError:
    tqdm = None

NAMESPACE = "be9c4e1a"
MEASURES = ("write", "read_cold", "read_warm")


def progress(items: list, label: str) -> Iterable:
    if tqdm is not None:
        return tqdm(items, desc=label, leave=False)
    print(f"  {label}: {len(items)} batches", flush=True)
    return items


def drop_file_cache(paths: Iterable[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class RawPath:
    """A plain Python writer/reader: one os.write / os.preadv per page, fsync per batch."""

    name = "raw"

    def __init__(self, directory: str, page_bytes: int, source: torch.Tensor, dest: torch.Tensor):
        os.makedirs(directory)
        self.file = os.path.join(directory, "raw.bin")
        self.page_bytes = page_bytes
        self.source = memoryview(source.numpy())
        self.dest = memoryview(dest.numpy())
        self.stats = None

    def files(self) -> list[str]:
        return [self.file]

    def write(self, groups: list[range], label: str) -> None:
        size = self.page_bytes
        fd = os.open(self.file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for group in progress(groups, f"{label} raw write"):
                for i in group:
                    os.write(fd, self.source[i * size : (i + 1) * size])
                os.fsync(fd)
        finally:
            os.close(fd)

    def read(self, groups: list[range], label: str) -> None:
        size = self.page_bytes
        fd = os.open(self.file, os.O_RDONLY)
        try:
            for group in progress(groups, f"{label} raw read"):
                for i in group:
                    os.preadv(fd, [self.dest[i * size : (i + 1) * size]], i * size)
        finally:
            os.close(fd)

    def close(self) -> None:
        pass


class StorePath:
    """RemoteStore.put / get of the same pages, one call per batch."""

    name = "store"

    def __init__(self, directory: str, page_bytes: int, source: torch.Tensor, dest: torch.Tensor,
                 args: argparse.Namespace):
        count = source.numel() // page_bytes
        self.store = RemoteStore(
            directory,
            namespace=NAMESPACE,
            page_bytes=page_bytes,
            backend_params=args.backend_params,
            segment_bytes=args.segment_mib << 20,
            checksum_threads=args.checksum_threads,
            pipeline_bytes=args.pipeline_mib << 20,
            mac_key=os.urandom(32) if args.mac else None,
        )
        self.store.register_host_memory(source)
        self.store.register_host_memory(dest)
        self.source_pages = list(source[: count * page_bytes].view(count, page_bytes))
        self.dest_pages = list(dest[: count * page_bytes].view(count, page_bytes))
        self.ids = key_ids(f"page-{i}" for i in range(count))
        self.directory = directory
        self.stats = None

    def files(self) -> list[str]:
        segments = os.path.join(self.directory, "segments")
        return [os.path.join(segments, name) for name in sorted(os.listdir(segments))]

    def write(self, groups: list[range], label: str) -> None:
        for group in progress(groups, f"{label} store write"):
            ok = self.store.put_ids([self.ids[i] for i in group],
                                    [self.source_pages[i] for i in group])
            if not all(ok):
                raise RuntimeError(f"store put failed for {ok.count(False)} pages")

    def read(self, groups: list[range], label: str) -> None:
        for group in progress(groups, f"{label} store read"):
            ok = self.store.get_ids([self.ids[i] for i in group],
                                    [self.dest_pages[i] for i in group])
            if not all(ok):
                raise RuntimeError(f"store get missed {ok.count(False)} pages")

    def close(self) -> None:
        self.stats = self.store.stats()
        self.store.close()


def run_repeat(args, root: str, rep: int, page_bytes: int, source: torch.Tensor,
               dest: torch.Tensor) -> dict:
    """One measurement of both paths on fresh files; which path goes first alternates."""
    count = source.numel() // page_bytes
    per_batch = max(1, (args.batch_mib << 20) // page_bytes)
    groups = [range(s, min(s + per_batch, count)) for s in range(0, count, per_batch)]
    total = count * page_bytes
    label = f"{page_bytes >> 10} KiB"
    paths = [
        RawPath(os.path.join(root, f"raw-{rep}"), page_bytes, source, dest),
        StorePath(os.path.join(root, f"store-{rep}"), page_bytes, source, dest, args),
    ]
    if rep % 2:
        paths.reverse()
    seconds = {}
    for path in paths:
        seconds[f"{path.name}_write"] = timed(lambda: path.write(groups, label))
    files = [f for path in paths for f in path.files()]
    if args.prime:
        drop_file_cache(files)
        for path in paths:
            path.read(groups, f"{label} prime")
    drop_file_cache(files)
    for path in paths:
        dest.fill_(0)
        seconds[f"{path.name}_read_cold"] = timed(lambda: path.read(groups, label))
        if not torch.equal(dest[:total], source[:total]):
            raise RuntimeError(f"{path.name} read returned other bytes than written")
    for path in paths:
        seconds[f"{path.name}_read_warm"] = timed(lambda: path.read(groups, label))
    for path in paths:
        path.close()
    result = {f"{name}_gbps": total / s / 1e9 for name, s in seconds.items()}
    result["store_stats"] = next(p for p in paths if p.name == "store").stats
    return result


def run_size(args, page_bytes: int, source: torch.Tensor, dest: torch.Tensor) -> dict:
    count = source.numel() // page_bytes
    root = tempfile.mkdtemp(prefix=f"remote-bw-{page_bytes >> 10}k-", dir=args.dir)
    try:
        runs = [run_repeat(args, root, rep, page_bytes, source, dest)
                for rep in range(args.repeat)]
    finally:
        shutil.rmtree(root)
    result = {
        "page_bytes": page_bytes,
        "pages": count,
        "batch_pages": max(1, (args.batch_mib << 20) // page_bytes),
        "bytes": count * page_bytes,
        "repeats": args.repeat,
        "store_stats": runs[-1]["store_stats"],
    }
    for path in ("raw", "store"):
        for measure in MEASURES:
            name = f"{path}_{measure}_gbps"
            result[name] = statistics.median(r[name] for r in runs)
            result[f"{path}_{measure}_runs_gbps"] = [round(r[name], 3) for r in runs]
    for measure in MEASURES:
        result[f"{measure}_ratio"] = (
            result[f"store_{measure}_gbps"] / result[f"raw_{measure}_gbps"]
        )
    return result


def print_table(rows: list[dict]) -> None:
    print("GB/s, median of repeats; x = store / raw; "
          "cold = after fadvise(DONTNEED), warm = page cache")
    header = (f"{'page':>9} | {'raw wr':>7} {'store wr':>8} {'x':>5} | {'raw cold':>8} "
              f"{'store cold':>10} {'x':>5} | {'raw warm':>8} {'store warm':>10} {'x':>5}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['page_bytes'] >> 10:>5} KiB | {r['raw_write_gbps']:7.2f} "
              f"{r['store_write_gbps']:8.2f} {r['write_ratio']:5.2f} | "
              f"{r['raw_read_cold_gbps']:8.2f} {r['store_read_cold_gbps']:10.2f} "
              f"{r['read_cold_ratio']:5.2f} | {r['raw_read_warm_gbps']:8.2f} "
              f"{r['store_read_warm_gbps']:10.2f} {r['read_warm_ratio']:5.2f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=tempfile.gettempdir(),
                        help="directory on the disk to measure (a temporary subfolder is used)")
    parser.add_argument("--total-mib", type=int, default=512, help="bytes per page size")
    parser.add_argument("--batch-mib", type=int, default=64, help="bytes per put/get batch")
    parser.add_argument("--page-kib", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--segment-mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3, help="runs per size; median reported")
    parser.add_argument("--checksum-threads", type=int, default=None,
                        help="RemoteStore checksum_threads (default: its own)")
    parser.add_argument("--pipeline-mib", type=int, default=8, help="RemoteStore pipeline_bytes")
    parser.add_argument("--no-prime", dest="prime", action="store_false",
                        help="measure cold reads on the first read of freshly written files")
    parser.add_argument("--posix-queue", choices=["default", "aio", "uring", "posix_aio"],
                        default="default", help="NIXL POSIX backend I/O queue")
    parser.add_argument("--mac", action="store_true",
                        help="give the store a mac_key: every record carries a keyed BLAKE2b MAC")
    parser.add_argument("--json", help="write results to this JSON file")
    args = parser.parse_args(argv)
    args.backend_params = (
        {} if args.posix_queue == "default" else {f"use_{args.posix_queue}": "true"}
    )
    total = args.total_mib << 20
    source = torch.randint(1, 256, (total,), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0))
    dest = torch.zeros(total, dtype=torch.uint8)
    rows = []
    for page_kib in args.page_kib:
        rows.append(run_size(args, page_kib << 10, source, dest))
        if tqdm is None:
            print_table(rows[-1:])
    print_table(rows)
    if args.json:
        nixl_module = load_nixl_api().__name__.split(".")[0]
        report = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "host": platform.node(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "nixl": f"{nixl_module} {importlib.metadata.version(nixl_module.replace('_', '-'))}",
            "args": {k: v for k, v in vars(args).items()},
            "results": rows,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
