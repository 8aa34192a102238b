"""Where a prefetched decode step's reload loses bandwidth: 4,096 pages of the decode benchmark's
format (4 layers x 8 kv heads x 128, page 16, fp8 with per-token-head scales: 16 KiB data pieces
and 512 B scale pieces, the model's own per-layer tensors) moved host -> device

  pool.load       the pool's chunked load (bookkeeping between chunk launches)
  one call        engine.reload of every page at once
  chunks          engine.reload in the pool's chunk sizes, queued back to back
  data only       a bf16 format of the same data bytes (no scale pieces), one call

GB/s from CUDA events around the copies (the stream waits for a gate until everything is queued
where the host queues it), beside one contiguous pinned copy. Needs CUDA.

    PYTHONPATH=. python scripts/decode_reload_probe.py [--pages 4096] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier import TieredPool, prefix_keys  # noqa: E402
from kvtier.decode.model import DecoderConfig, PagedKV  # noqa: E402
from kvtier.index.keys import key_ids  # noqa: E402

DEVICE = "cuda"
CONFIG = DecoderConfig(vocab=32000, hidden=4096, layers=4, q_heads=32, kv_heads=8, head_dim=128, ffn=14336)


def timed(fn, repeats: int, setup=None) -> float:
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def probe(fmt, pages: int, repeats: int, label: str) -> None:
    kv = PagedKV(fmt, pages + 1, DEVICE)
    pool = TieredPool(fmt, host_pages=pages + 1, write_policy="write_through", registry=CollectorRegistry(),
                      **kv.pool_args())
    with pool:
        keys = prefix_keys(np.arange(pages * fmt.page_size), fmt.page_size, pool.namespace)
        slots = pool.allocate(pages)
        pool.commit(keys, slots)
        pool.release(slots)
        pool.flush()
        nbytes = pages * fmt.page_bytes
        engine = pool.engine

        def load():
            handle = pool.load(keys)
            handle.synchronize()
            pool.release(handle.slots)

        host_slots = pool._host.table.get_many(key_ids(keys))  # where the host tier holds each page
        rows = {}
        rows["pool.load"] = timed(load, repeats, setup=lambda: pool.evict(tier="device", keys=keys))
        if min(host_slots) >= 0:
            dev_slots = list(range(pages))
            rows["one call"] = timed(lambda: engine.reload(host_slots, dev_slots).synchronize(), repeats)

            def chunks():
                pos, size, tickets = 0, 32, []
                while pos < pages:
                    end = min(pages, pos + size)
                    tickets.append(engine.reload(host_slots[pos:end], dev_slots[pos:end]))
                    pos, size = end, min(size * 4, 512)
                for t in tickets:
                    t.synchronize()

            rows["chunks"] = timed(chunks, repeats)
            # Whole records by the copy engines into a device staging buffer, then the copy kernel
            # from there (transfer/cuda/staged_path.py), one call and in the pool's chunk sizes.
            from kvtier.transfer.cuda.staged_path import staged_reload

            def staged(size=None):
                events, keep, pos, step = [], [], 0, 32
                while pos < pages:
                    end = pages if size is None else min(pages, pos + step)
                    with torch.cuda.stream(engine.reload_stream):
                        events.append(staged_reload(engine, np.asarray(host_slots[pos:end], dtype=np.int64),
                                                    np.arange(pos, end, dtype=np.int64), None, keep)[-1])
                    pos, step = end, min(step * 4, 512)
                torch.cuda.current_stream().wait_event(events[-1])

            rows["staged"] = timed(staged, repeats)
            rows["staged chunks"] = timed(lambda: staged(512), repeats)
            # The same records in memory from cudaHostAlloc (torch's pinned allocator) instead of
            # the host tier's mmap + cudaHostRegister, moved by an engine over the same device tier.
            from types import SimpleNamespace

            from kvtier.transfer.cuda_engine import CudaEngine

            pinned = torch.empty(pool.host_tier.buffer.numel(), dtype=torch.uint8, pin_memory=True)
            pinned.copy_(pool.host_tier.buffer.view(-1))
            other = SimpleNamespace(fmt=fmt, num_pages=pool.host_tier.num_pages, pinned=True,
                                    buffer=pinned.view(pool.host_tier.num_pages, fmt.page_bytes))
            alloc_engine = CudaEngine(pool.device_tier, other)
            rows["hostalloc"] = timed(lambda: alloc_engine.reload(host_slots, dev_slots).synchronize(), repeats)
            alloc_engine.close()
            # ... and in mmap'd memory asked for transparent huge pages, touched, then registered.
            import mmap

            nbytes_all = pool.host_tier.buffer.numel()
            mapping = mmap.mmap(-1, nbytes_all, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            mapping.madvise(mmap.MADV_HUGEPAGE)
            huge_buf = torch.frombuffer(mapping, dtype=torch.uint8)
            huge_buf.copy_(pool.host_tier.buffer.view(-1))
            with open("/proc/meminfo") as meminfo:
                print(f"{label}: after touching the advised mapping "
                      f"{[line.strip() for line in meminfo if line.startswith('AnonHugePages')]}", flush=True)
            assert int(torch.cuda.cudart().cudaHostRegister(huge_buf.data_ptr(), nbytes_all, 0)) == 0
            other = SimpleNamespace(fmt=fmt, num_pages=pool.host_tier.num_pages, pinned=True,
                                    buffer=huge_buf.view(pool.host_tier.num_pages, fmt.page_bytes))
            huge_engine = CudaEngine(pool.device_tier, other)
            rows["thp+register"] = timed(lambda: huge_engine.reload(host_slots, dev_slots).synchronize(), repeats)
            huge_engine.close()
            torch.cuda.cudart().cudaHostUnregister(huge_buf.data_ptr())
            with open("/proc/meminfo") as meminfo:
                huge = [line.strip() for line in meminfo if line.startswith("AnonHugePages")]
            print(f"{label}: {huge}", flush=True)
        for name, seconds in rows.items():
            print(f"{label:<22} {name:<10} {seconds * 1e3:8.2f} ms {nbytes / seconds / 1e9:7.1f} GB/s "
                  f"(path {getattr(engine, 'last_path', engine.name)})", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    host = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    seconds = timed(lambda: dev.copy_(host, non_blocking=True), args.repeats)
    print(f"contiguous pinned H2D: {host.numel() / seconds / 1e9:.1f} GB/s")
    probe(CONFIG.page_format(16, dtype="fp8_e4m3", scale="per_token_head"), args.pages, args.repeats, "fp8 + token scales")
    probe(CONFIG.page_format(16, dtype="bf16"), args.pages // 2, args.repeats, "bf16 (no scales)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
