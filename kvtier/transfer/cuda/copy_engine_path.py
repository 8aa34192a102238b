"""The copy-engine path: cudaMemcpyBatchAsync of every (page, layer, plane) piece, no SM used.

Owns submitting pass-through copies to the GPU's copy engines through cuMemcpyBatchAsync
(libcuda through ctypes over numpy arrays, driver.BatchMemcpy; cuda.bindings' runtime wrapper
over Python lists where libcuda cannot be opened by name) on a created stream (it rejects the
legacy default stream): one call per transfer for offloads and device copies, one per layer
for reloads (each followed by that layer's event, so layers become ready one by one). Address
plans (the per-(layer, plane) bases and strides of both sides) are built once per engine and
direction; a transfer only broadcasts its slots against them and merges pieces adjacent on
both sides. It never slows the model, but it needs large pieces to reach PCIe speed and costs
the host about 0.9 us per piece in the driver (1.2 through the list wrapper) plus one call and
one event per layer, which is why the engine takes it only for large transfers of large
pieces (path_choice.py, COPY_ENGINE_*).
It must never convert dtypes or choose which pages move.
"""

from __future__ import annotations

import importlib.util
import re
import sys

import numpy as np

from kvtier.format import PageFormat
from kvtier.transfer.cuda import plans

# cudaMemcpyFlagPreferOverlapWithCompute pays off only for small copies: cudf measured the
# crossover at 128 KiB on GB300, GB10 and an RTX PRO GPU (cudf pull request #23675). Not yet
# measured on the H200: the bandwidth benchmark's copy_engine rows are where to check it.
PREFER_OVERLAP_MAX_COPY = 128 * 1024


def batch_memcpy_available() -> bool:
    """Whether batch_memcpy_runtime() would return the runtime, found without importing it where
    it is not imported yet: cuda-bindings 12.8 or later (the first with cudaMemcpyBatchAsync) with
    a runtime module. Importing cuda.bindings.runtime loads libcudart through cuda.pathfinder,
    0.1 s of a fresh process on a 2-core VM that a first pool on the kernel path need not pay."""
    if "cuda.bindings.runtime" in sys.modules:
        return batch_memcpy_runtime() is not None
    try:
        import cuda.bindings
    except ImportError:
        return False
    version = tuple(int(part) for part in re.findall(r"\d+", getattr(cuda.bindings, "__version__", ""))[:2])
    try:
        found = importlib.util.find_spec("cuda.bindings.runtime") is not None
    except (ImportError, ValueError):
        found = False
    return version >= (12, 8) and found


def batch_memcpy_runtime():
    """cuda.bindings' runtime module when it has cudaMemcpyBatchAsync, else None."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        return None
    return runtime if hasattr(runtime, "cudaMemcpyBatchAsync") else None


class CopyEnginePath:
    """Batched copy-engine copies over one engine's tiers (runtime: cuda.bindings.runtime)."""

    def __init__(self, fmt: PageFormat, table: np.ndarray, records: int, runtime, batch=None) -> None:
        self.fmt = fmt
        self.runtime = runtime
        # driver.BatchMemcpy (libcuda through ctypes, numpy address arrays), else cuda.bindings'
        # runtime wrapper over Python lists.
        self.batch = batch
        self._plans = {
            direction: plans.piece_plans(fmt, table, records, direction)
            for direction in (("device",) if fmt.converts else plans.DIRECTIONS)
        }
        self._attributes: dict[bool, object] = {}

    def pieces(self, direction: str, layers: range, src: np.ndarray, dst: np.ndarray) -> list[tuple]:
        """(dst, src, sizes) of every piece of `layers`, one entry per plan (data, scales)."""
        planes = self.fmt.planes
        return [plans.expand_pieces(plan, planes, layers, src, dst) for plan in self._plans[direction]]

    def copy(self, stream_handle: int, expanded: list[tuple]) -> None:
        runtime = self.runtime
        # Runs merge within one plan only: a run across the pages and the scales could
        # straddle two allocations, which cudaMemcpyBatchAsync rejects.
        merged = [plans.merge_runs(*part) for part in expanded]
        dst, src, sizes = (np.concatenate(column) for column in zip(*merged))
        prefer_overlap = int(sizes.max()) <= PREFER_OVERLAP_MAX_COPY
        if self.batch is not None:
            self.batch(stream_handle, dst, src, sizes, prefer_overlap)
            return
        attributes = self._attributes.get(prefer_overlap)
        if attributes is None:
            attributes = runtime.cudaMemcpyAttributes()
            attributes.srcAccessOrder = runtime.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
            attributes.flags = (
                runtime.cudaMemcpyFlags.cudaMemcpyFlagPreferOverlapWithCompute
                if prefer_overlap
                else runtime.cudaMemcpyFlags.cudaMemcpyFlagDefault
            )
            self._attributes[prefer_overlap] = attributes
        count = int(dst.size)
        result = runtime.cudaMemcpyBatchAsync(
            dst.tolist(), src.tolist(), sizes.tolist(), count, [attributes], [0], 1, stream_handle
        )
        error = result[0]
        if error != runtime.cudaError_t.cudaSuccess:
            _, text = runtime.cudaGetErrorString(error)
            raise RuntimeError(
                f"cudaMemcpyBatchAsync of {count} copies on stream {stream_handle:#x} failed: "
                f"{error.name} ({text.decode()})"
            )
