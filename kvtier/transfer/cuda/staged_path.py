"""The staged reload: copy engines bring whole fp8 records into HBM, the upcast kernel converts them there.

Owns the converting reload that trades layer-by-layer readiness for bandwidth: SMs read host
memory at about 51 GB/s, the copy engines at 55, so moving records with the copy engines
(cudaMemcpyBatchAsync, one per chunk of pages, on the staging stream) and upcasting them
from a device staging buffer delivers more bf16 bytes per second. The records go in
STAGED_CHUNKS chunks: the upcast of one (every layer, on the reload stream) overlaps the DMA
of the next, so only the last chunk's upcast is not hidden behind PCIe. Every layer is
ready only once the last chunk is converted, so it suits bulk prefetch ahead of need; its
completion is per-layer torch events like the other event paths.
It must never choose which pages move.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.transfer.cuda.tickets import SlotBuffer

STAGED_CHUNKS = 8


class SlotView:
    """Entries [first, first + count) of a slot buffer, as the kernels read them."""

    __slots__ = ("src_ptr", "dst_ptr", "failed_ptr")

    def __init__(self, buffer: SlotBuffer, first: int) -> None:
        self.src_ptr = buffer.src_ptr + 4 * first
        self.dst_ptr = buffer.dst_ptr + 4 * first
        self.failed_ptr = buffer.failed_ptr + 4 * first


def staged_reload(engine, host_idx: np.ndarray, dev_idx: np.ndarray, ready, keep: list) -> list:
    """Queue the staged reload of `engine` (a CudaEngine); returns one event per layer."""
    fmt, count = engine.fmt, host_idx.size
    stream, staging_stream, lane = engine.reload_stream, engine.staging_stream, engine.reload_lane
    # Allocated on the staging stream, so its DMA waits for nothing but `ready`: like every
    # other path, nothing of a reload starts before the work the caller queued before it.
    if ready is not None:
        engine.wait_ready(staging_stream, None, ready)
    with torch.cuda.stream(staging_stream):
        staging = torch.empty((count, fmt.page_bytes), dtype=torch.uint8, device=engine.device)
    staging.record_stream(stream)
    base = staging.data_ptr()
    chunk = -(-count // min(STAGED_CHUNKS, count))
    with lane.lock:
        buffer = lane.buffer(count)
        buffer.src[:count] = np.arange(count)
        buffer.dst[:count] = dev_idx
        keep.extend((staging, buffer))
        page = np.uint64(fmt.page_bytes)
        for first in range(0, count, chunk):
            rows = np.arange(first, min(first + chunk, count), dtype=np.uint64)
            dst = np.uint64(base) + rows * page
            src = np.uint64(engine.records) + host_idx[first : first + rows.size].astype(np.uint64) * page
            engine.copy_engine.copy(staging_stream.cuda_stream, [(dst, src, np.full(rows.size, page, dtype=np.uint64))])
            landed = torch.cuda.Event()
            landed.record(staging_stream)
            keep.append(landed)
            stream.wait_event(landed)
            engine.kernels.submit(
                "reload", lane, SlotView(buffer, first), rows.size, 0, layers=range(fmt.num_layers), records=base
            )
    return [engine.land_layer(stream, layer, dev_idx) for layer in range(fmt.num_layers)]
