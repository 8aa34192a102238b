"""Where a cold multi-page ``RemoteStore.get_ids`` spends its CPU, on the store alone.

For each (page size, batch, memory) the script writes a batch of random pages under fresh keys,
drops the segment files from the page cache (``posix_fadvise(DONTNEED)``; records are clean after
the put's fsync), reads the batch back into memory poisoned with 0xA5 and compares every byte.
Per cold get it records wall time, process CPU time, the calling thread's own CPU time (the rest
ran on the checksum threads and NIXL's) and the NIXL polls the store made. Rounds alternate
paced polls (the default) and unpaced ones (the engine's learned pace cleared and not learned:
the back-off from 10 µs to 0.5 ms that the store used before pacing), in one process, so the two
are compared in the same minutes. Memory: ``aligned`` (page-aligned, registered with the store:
zero-copy under O_DIRECT) or ``unaligned`` (64 bytes off: staged through aligned blocks). Pages
are ``--pieces`` pieces each (2: K and V of a page_first SGLang page).

Each round also reads the same bytes from the same segment files with plain ``O_DIRECT``
``preadv`` calls (the pages' payloads, neighbouring slots merged, in reads of at most 8 MiB from
4 threads into page-aligned memory; cache dropped first): the disk's rate for those very bytes,
which a raw file written elsewhere need not share. ``raw / kvtier`` > 1 means kvtier's get took
less time than the raw reads; the two go first in turn.

    python benchmarks/remote_cold_get.py --dir /mnt/nvme/x --page-mib 1,2 --pages 8,64 --json out.json

Fail-soft: a configuration that fails is reported and the others still run. Stores are deleted
at the end. Writes JSON to ``--json`` (default ``$OUT/remote_cold_get.json`` when ``OUT`` is set).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import mmap
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a source checkout too

from concurrent.futures import ThreadPoolExecutor  # noqa: E402

from kvtier.index.keys import key_ids  # noqa: E402
from kvtier.tiers.remote import RemoteStore  # noqa: E402
from kvtier.tiers.remote.paths import segment_name  # noqa: E402
from kvtier.tiers.remote.segments import payload_offset  # noqa: E402

RAW_READ_BYTES = 8 << 20
RAW_THREADS = 4


def drop_cache(directory: str) -> None:
    for root, _, names in os.walk(directory):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class PollCounter:
    """Counts the NIXL polls of one store's engine (wraps its agent's ``check_xfer_state``)."""

    def __init__(self, store: RemoteStore):
        agent = store._engine.agent
        self.count = 0
        original = agent.check_xfer_state

        def counted(handle):
            self.count += 1
            return original(handle)

        agent.check_xfer_state = counted


def set_pacing(store: RemoteStore, on: bool, saved: dict) -> None:
    """Paced polls on (the learned pace back) or off (cleared, nothing learned)."""
    engine = store._engine
    if on:
        engine.__dict__.pop("_learn", None)
        engine._pace.update(saved)
    else:
        saved.update(engine._pace)
        engine._pace.clear()
        original = type(engine)._learn
        engine._learn = lambda op, since, inflight, done, learn: original(engine, op, since, inflight, done, False)


def raw_reader(store: RemoteStore, ids: list[bytes], into: mmap.mmap, pool: ThreadPoolExecutor):
    """A function reading the payloads of ``ids`` from the store's segment files with plain
    O_DIRECT ``preadv`` (runs of neighbouring slots merged, at most RAW_READ_BYTES a read) into
    ``into``; it returns its wall time. Opens the files now; close them with ``.close()``."""
    page, stride = store.page_bytes, store.slot_stride
    locations = store._index.lookup(store._ns_fp, ids)
    if any(loc is None for loc in locations):
        raise RuntimeError("the index lost pages just written")
    spots = sorted((loc.seg, payload_offset(stride, store.slots_per_segment, loc.slot)) for loc in locations)
    runs: list[list[int]] = []  # [seg, offset, length]
    for seg, at in spots:
        if runs and runs[-1][0] == seg and runs[-1][1] + runs[-1][2] == at and stride == page:
            runs[-1][2] += page
        else:
            runs.append([seg, at, page])
    fds = {seg: os.open(os.path.join(store.directory, "segments", segment_name(seg)), os.O_RDONLY | os.O_DIRECT)
           for seg in {r[0] for r in runs}}
    reads, filled = [], 0
    for seg, at, length in runs:
        for lo in range(0, length, RAW_READ_BYTES):
            n = min(RAW_READ_BYTES, length - lo)
            reads.append((fds[seg], memoryview(into)[filled : filled + n], at + lo))
            filled += n

    def one(read) -> None:
        fd, view, at = read
        if os.preadv(fd, [view], at) != len(view):
            raise RuntimeError("short O_DIRECT read")

    def run() -> float:
        start = time.perf_counter()
        list(pool.map(one, reads))
        return time.perf_counter() - start

    def close() -> None:
        for _, view, _ in reads:
            view.release()
        for fd in fds.values():
            os.close(fd)

    run.close = close
    return run


def run_config(root: str, page_bytes: int, batch: int, pieces: int, offset: int, rounds: int) -> dict:
    region = mmap.mmap(-1, 2 * batch * page_bytes + 4096)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region)) + offset
    flat = np.frombuffer((ctypes.c_ubyte * (2 * batch * page_bytes)).from_address(base), dtype=np.uint8)
    src, dst = flat[: batch * page_bytes], flat[batch * page_bytes:]
    src[:] = np.random.default_rng(batch).integers(0, 256, src.size, dtype=np.uint8)
    piece = page_bytes // pieces

    def buffers(first: int) -> list:
        return [[(base + (first + i) * page_bytes + k * piece, piece) for k in range(pieces)] for i in range(batch)]

    directory = tempfile.mkdtemp(prefix="remote-cold-get-", dir=root)
    store = RemoteStore(directory, namespace="c01d", page_bytes=page_bytes,
                        capacity_bytes=4 * batch * page_bytes + (64 << 20), create=True)
    samples: dict[str, list[dict]] = {"paced": [], "unpaced": []}
    raw_block = mmap.mmap(-1, batch * store.slot_stride)
    raw_pool = ThreadPoolExecutor(RAW_THREADS)
    try:
        if not offset:
            store.register_host_memory((base, 2 * batch * page_bytes))
        polls, saved = PollCounter(store), {}
        for n in range(2 * rounds + 1):  # round 0 warms up (files, registrations, threads)
            mode = "paced" if n % 2 == 0 else "unpaced"
            set_pacing(store, mode == "paced", saved)
            ids = key_ids([f"cold-{n}-{i}" for i in range(batch)])
            if not all(store.put_ids(ids, buffers(0))):
                raise RuntimeError("put failed")
            raw = raw_reader(store, ids, raw_block, raw_pool)
            try:
                if n % 4 >= 2:  # the raw read first in every other pair of rounds
                    drop_cache(directory)
                    raw_s = raw()
                dst.fill(0xA5)
                drop_cache(directory)
                before = polls.count
                own, cpu, wall = time.thread_time(), time.process_time(), time.perf_counter()
                found = store.get_ids(ids, buffers(batch))
                wall, cpu, own = time.perf_counter() - wall, time.process_time() - cpu, time.thread_time() - own
                if n % 4 < 2:
                    drop_cache(directory)
                    raw_s = raw()
            finally:
                raw.close()
            if not all(found) or not np.array_equal(src, dst):
                raise RuntimeError("pages read back differ from the pages written")
            store.delete_ids(ids)
            if n:
                samples[mode].append({"wall_s": wall, "cpu_s": cpu, "caller_cpu_s": own, "polls": polls.count - before,
                                      "raw_s": raw_s})
    finally:
        raw_pool.shutdown()
        raw_block.close()
        store.close()
        shutil.rmtree(directory, ignore_errors=True)
        del src, dst, flat
    out = {"page_bytes": page_bytes, "batch": batch, "pieces": pieces, "memory": "unaligned" if offset else "aligned"}
    for mode, rows in samples.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        out[mode] = {
            "wall_ms": med["wall_s"] * 1e3,
            "gib_s": batch * page_bytes / med["wall_s"] / 2**30,
            "cpu_us_page": med["cpu_s"] / batch * 1e6,
            "caller_cpu_us_page": med["caller_cpu_s"] / batch * 1e6,
            "polls": med["polls"],
            "raw_ms": med["raw_s"] * 1e3,
            "raw_over_kvtier": statistics.median(r["raw_s"] / r["wall_s"] for r in rows),
            "rounds": len(rows),
        }
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="where stores go (default: a temp dir under benchmarks/)")
    parser.add_argument("--page-mib", default="1,2")
    parser.add_argument("--pages", default="8,64")
    parser.add_argument("--pieces", type=int, default=2)
    parser.add_argument("--memory", default="aligned,unaligned")
    parser.add_argument("--rounds", type=int, default=5, help="cold gets per mode (paced, unpaced)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    root = args.dir or str(Path(__file__).parent)
    os.makedirs(root, exist_ok=True)
    rows, errors = [], []
    print("| page | pages | memory | mode | GiB/s | raw GiB/s (same bytes) | raw / kvtier | CPU us/page (caller) | polls a get |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mib in [float(x) for x in args.page_mib.split(",")]:
        for batch in [int(x) for x in args.pages.split(",")]:
            for memory in args.memory.split(","):
                try:
                    row = run_config(root, int(mib * 2**20), batch, args.pieces, 64 if memory == "unaligned" else 0, args.rounds)
                except Exception as exc:  # fail-soft: one configuration does not stop the rest
                    errors.append(f"{mib} MiB x{batch} {memory}: {exc!r}")
                    traceback.print_exc()
                    continue
                rows.append(row)
                for mode in ("paced", "unpaced"):
                    m = row[mode]
                    raw_gib = batch * int(mib * 2**20) / (m["raw_ms"] / 1e3) / 2**30
                    print(f"| {mib:g} MiB | {batch} | {memory} | {mode} | {m['gib_s']:.2f} | {raw_gib:.2f} "
                          f"| {m['raw_over_kvtier']:.2f}x | {m['cpu_us_page']:.0f} "
                          f"({m['caller_cpu_us_page']:.0f}) | {m['polls']:.0f} |", flush=True)
    out = args.json or (os.path.join(os.environ["OUT"], "remote_cold_get.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({
            "benchmark": "remote_cold_get",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs, kernel {platform.release()}",
            "rows": rows, "errors": errors,
        }, indent=1))
        print(f"JSON: {out}")
    if errors:
        sys.exit(1)


if __name__ == "__main__":
    main()
