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

from kvtier.index.keys import key_ids  # noqa: E402
from kvtier.tiers.remote import RemoteStore  # noqa: E402


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
            dst.fill(0xA5)
            drop_cache(directory)
            before = polls.count
            own, cpu, wall = time.thread_time(), time.process_time(), time.perf_counter()
            found = store.get_ids(ids, buffers(batch))
            wall, cpu, own = time.perf_counter() - wall, time.process_time() - cpu, time.thread_time() - own
            if not all(found) or not np.array_equal(src, dst):
                raise RuntimeError("pages read back differ from the pages written")
            store.delete_ids(ids)
            if n:
                samples[mode].append({"wall_s": wall, "cpu_s": cpu, "caller_cpu_s": own, "polls": polls.count - before})
    finally:
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
    print("| page | pages | memory | mode | GiB/s | CPU us/page (caller) | polls a get |")
    print("|---|---|---|---|---|---|---|")
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
                    print(f"| {mib:g} MiB | {batch} | {memory} | {mode} | {m['gib_s']:.2f} | {m['cpu_us_page']:.0f} "
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
