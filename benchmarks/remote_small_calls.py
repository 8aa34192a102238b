"""CPU cost of the remote store's small calls: get, set (put) and exists, per page.

What an engine pays on its own thread for a call of 1 or 128 tiny pages, the cost that
decides small-page latency: ``time.process_time`` (every thread of the process, so the
checksum and read threads' share counts too) around each call, median over ``--calls``
calls, divided by the pages of the call. Gets are timed alone (the destination's poisoning and
the check of every byte read back run outside the timing), twice: pages warm (just written,
so whatever the store left in the page cache) and cold (the page cache of the segment files
dropped before each call, so every read reaches the device). Each repeat opens a fresh store;
gets read pages the same run wrote.

Sets are timed twice: into a fresh store's never-written slots (the file system allocates each
record's blocks as its sync writes them back), and into slots freed by deleting the first
pages (``set reused``, after the store's reuse delay): what every set costs once a store has
filled and recycles its slots.

``--nixl-floor`` also times a bare NIXL read of one page (``--page-kib``) from a registered
file into registered memory through the POSIX backend (no index, no checksum): what any
NIXL-based path pays per request.

    python benchmarks/remote_small_calls.py --dir /tmp/small --json small.json --nixl-floor
"""

from __future__ import annotations

import argparse
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
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a source checkout too

from kvtier.index.keys import key_ids  # noqa: E402
from kvtier.tiers.remote import RemoteStore, load_nixl_api  # noqa: E402

NAMESPACE = "5a11ca11"
REUSE_WAIT_S = 2.1  # past RemoteStore's default reuse_delay_s (2 s)


def cpu_us(fn, calls: int) -> float:
    """Median CPU microseconds (all threads) of ``fn()`` over ``calls`` calls."""
    samples = []
    for _ in range(calls):
        start = time.process_time()
        fn()
        samples.append((time.process_time() - start) * 1e6)
    return statistics.median(samples)


def measure_store(directory: str, page_bytes: int, batch: int, calls: int) -> dict:
    """CPU µs per page of put, get and exists, batches of ``batch`` pages."""
    store = RemoteStore(directory, namespace=NAMESPACE, page_bytes=page_bytes,
                        segment_bytes=64 << 20, capacity_bytes=8 << 30, create=True)
    try:
        total = batch * (calls + 2)
        source = torch.randint(0, 256, (total, page_bytes), dtype=torch.uint8)
        dest = torch.zeros(batch, page_bytes, dtype=torch.uint8)
        store.register_host_memory(source)
        store.register_host_memory(dest)
        ids = key_ids(f"small-{i}" for i in range(total))
        groups = [list(range(s, s + batch)) for s in range(0, total, batch)]
        dest_pages = list(dest)

        def puts(keys: list[bytes]):
            """(one put of the next group of ``keys`` a call, the groups not put yet)."""
            position = iter(groups)

            def put() -> None:
                group = next(position)
                if not all(store.put_ids([keys[i] for i in group], [source[i] for i in group])):
                    raise RuntimeError("put failed")

            return put, position

        put, rest = puts(ids)
        put_us = cpu_us(put, calls)
        for group in rest:
            store.put_ids([ids[i] for i in group], [source[i] for i in group])
        segments = os.path.join(store.directory, "segments")

        def drop_cache() -> None:
            for name in os.listdir(segments):
                fd = os.open(os.path.join(segments, name), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)

        def get_us(cold: bool) -> float:
            """Median CPU µs of the get call alone: the poisoning, the cache drop (cold) and
            the check run outside the timing."""
            samples = []
            for group in groups[:calls]:
                dest.fill_(0)
                if cold:
                    drop_cache()
                start = time.process_time()
                found = store.get_ids([ids[i] for i in group], dest_pages)
                samples.append((time.process_time() - start) * 1e6)
                if not all(found):
                    raise RuntimeError("get missed")
                if not torch.equal(dest, source[group[0] : group[-1] + 1]):
                    raise RuntimeError("get returned other bytes than written")
            return statistics.median(samples)

        warm_us = get_us(cold=False)
        cold_us = get_us(cold=True)
        asked = iter(groups * 4)
        exists_us = cpu_us(lambda: store.contains_ids([ids[i] for i in next(asked)]), calls)
        # The same number of sets again, into the slots of the pages deleted now (the store
        # hands a freed slot out again after reuse_delay_s).
        store.delete_ids(ids)
        time.sleep(REUSE_WAIT_S)
        free_before = store.stats()["free_slots"]
        put_again, _ = puts(key_ids(f"again-{i}" for i in range(total)))
        reused_us = cpu_us(put_again, calls)
        stats = store.stats()
    finally:
        store.close()
    return {
        "put_us_per_page": put_us / batch,
        "put_reused_us_per_page": reused_us / batch,
        "free_slots_before_reuse": free_before,
        "free_slots_after_reuse": stats["free_slots"],
        "get_us_per_page": warm_us / batch,
        "cold_get_us_per_page": cold_us / batch,
        "exists_us_per_page": exists_us / batch,
        "stats": {k: v for k, v in stats.items() if isinstance(v, int)},
    }


def measure_nixl_floor(directory: str, page_bytes: int, calls: int) -> float:
    """CPU µs of one bare NIXL POSIX read of ``page_bytes`` (O_DIRECT file, registered once)."""
    api = load_nixl_api()
    config = api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[])
    agent = api.nixl_agent(f"floor-{os.getpid()}", config)
    agent.create_backend("POSIX", {})
    path = os.path.join(directory, "floor.bin")
    with open(path, "wb") as f:
        f.write(os.urandom(page_bytes * 16))
        f.flush()
        os.fsync(f.fileno())
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    except OSError:
        fd = os.open(path, os.O_RDWR)
    block = mmap.mmap(-1, page_bytes)
    import ctypes
    address = ctypes.addressof(ctypes.c_char.from_buffer(block))
    mem = agent.register_memory([(address, page_bytes, 0, "")], "DRAM")
    files = agent.register_memory([(0, page_bytes * 16, fd, "")], "FILE")
    local = agent.get_xfer_descs([(address, page_bytes, 0)], "DRAM")
    remote = agent.get_xfer_descs([(page_bytes, page_bytes, fd)], "FILE")
    name = agent.name

    def read() -> None:
        handle = agent.initialize_xfer("READ", local, remote, name)
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL read ended {state}")
        agent.release_xfer_handle(handle)

    try:
        return cpu_us(read, calls)
    finally:
        agent.deregister_memory(files)
        agent.deregister_memory(mem)
        os.close(fd)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", help="directory for the stores (default: a temporary one)")
    parser.add_argument("--page-kib", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 128])
    parser.add_argument("--calls", type=int, default=200, help="calls per measurement (128-page batches: a tenth)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--nixl-floor", action="store_true", help="also time a bare NIXL read of one page")
    parser.add_argument("--json", help="write results to this JSON file")
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="kvtier-small-", dir=args.dir)
    page_bytes = args.page_kib << 10
    results: dict = {"runs": {}}
    try:
        for batch in args.batches:
            calls = max(10, args.calls // 10) if batch > 16 else args.calls
            runs = [
                measure_store(os.path.join(root, f"b{batch}-r{rep}"), page_bytes, batch, calls)
                for rep in range(args.repeat)
            ]
            results["runs"][str(batch)] = runs
        if args.nixl_floor:
            results["nixl_floor_read_us"] = statistics.median(
                measure_nixl_floor(root, page_bytes, args.calls) for _ in range(args.repeat)
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"CPU µs per page, {args.page_kib} KiB pages, median of {args.repeat} runs")
    print(f"{'batch':>6} {'get':>8} {'set':>8} {'set reused':>11} {'exists':>8} {'cold get':>9}")
    summary = {}
    for batch, runs in results["runs"].items():
        row = {name: statistics.median(r[f"{name}_us_per_page"] for r in runs)
               for name in ("get", "put", "put_reused", "exists", "cold_get")}
        summary[batch] = row
        print(f"{batch:>6} {row['get']:8.1f} {row['put']:8.1f} {row['put_reused']:11.1f} {row['exists']:8.2f} "
              f"{row['cold_get']:9.1f}")
    if "nixl_floor_read_us" in results:
        print(f"bare NIXL {args.page_kib} KiB read: {results['nixl_floor_read_us']:.1f} µs CPU")
    results["summary"] = summary
    results["environment"] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "page_kib": args.page_kib,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
