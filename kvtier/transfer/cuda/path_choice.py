"""Which copy path a CUDA transfer takes: pure decisions, tested on the CPU.

Owns the rules behind CudaEngine's `path` setting (see engine.py for the paths themselves):
what "auto" picks from the transfer's shape, and the errors for a forced path this machine
cannot run. It must never look at a GPU, a stream or a ticket: the engine hands it what it
knows (Abilities, the transfer's counts).

"auto" without traffic the other way: the copy engines where the transfer passes bytes
through, every piece is at least COPY_ENGINE_MIN_PIECE bytes and their host cost (one call
and one event per layer on reload, about 1 us a piece) is below the bytes' PCIe time;
else the kernel; torch where the kernel path cannot run.

"auto" is the same while the opposite direction (offload against reload) is in flight. Putting
the two directions on different mechanisms was measured and lost (H200, 2026-12-03,
kvtier/bench/both_directions.py, GB/s of both directions against the 94.6 limit): from 256 KiB
pieces both on the copy engines 98-101 (1.04-1.07x), both on the SM kernel 78 (0.82x), one on
each 55-63 (0.61-0.67x); at 64 KiB both on the kernel 77 (0.82x), both on the copy engines 57.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.format import PageFormat

PATHS = ("auto", "kernel", "copy_engine", "staged", "torch")
# Measured on the H200 (BENCHMARKS.md, 2026-12-02): from 128 KiB pieces the copy engines
# move 55 GB/s against the SM kernel's 52. Queueing a piece costs the host about 0.9 us in
# libcuda's cuMemcpyBatchAsync (H100 host, 2026-12-06, scripts/both_directions_sweep.py; 1.2 us
# through cuda.bindings' list wrapper, which the engine no longer uses where libcuda opens by
# name): below 128 KiB that is more than the bytes' own time once both directions queue from
# one thread, so the kernel keeps smaller pieces. COPY_ENGINE_CALL_S is the fixed host cost of
# one batch call plus its event (benchmarks/engine_host_cost.py measures it); PCIE_BYTES_PER_S
# the contiguous pinned rate.
COPY_ENGINE_MIN_PIECE = 128 * 1024
COPY_ENGINE_PIECE_S = 1.0e-6
COPY_ENGINE_CALL_S = 10e-6
PCIE_BYTES_PER_S = 55e9
FP8_CONVERT_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class Abilities:
    """What this machine can run: the kernel path (NVRTC and cuda-bindings), the copy engines
    (cudaMemcpyBatchAsync), and the GPU's compute capability."""

    kernels: bool
    copy_engine: bool
    capability: tuple[int, int]


def copy_engine_keeps_up(fmt: PageFormat, count: int, calls: int, piece_bytes: int) -> bool:
    """The copy engines' host queueing of this transfer is no slower than its bytes' PCIe time."""
    pieces = count * fmt.num_layers * fmt.planes * (2 if fmt.device_has_scales else 1)
    host_s = calls * COPY_ENGINE_CALL_S + pieces * COPY_ENGINE_PIECE_S
    return piece_bytes >= COPY_ENGINE_MIN_PIECE and host_s <= count * fmt.page_bytes / PCIE_BYTES_PER_S


def choose(
    setting: str,
    fmt: PageFormat,
    can: Abilities,
    *,
    converts: bool,
    count: int,
    calls: int,
    staged_ok: bool = False,
    piece_bytes: int | None = None,
) -> str:
    """The path a transfer of `count` pages takes under `setting`.

    calls: batch calls the copy engines would need (1, or one per layer on reload); staged_ok:
    the transfer is a reload (the only one "staged" applies to); piece_bytes: the size of each
    contiguous piece (default: one plane of one layer of a page).
    """
    fp8_ok = can.capability >= FP8_CONVERT_CAPABILITY
    kernel_ok = can.kernels and (fp8_ok or not converts)
    piece_bytes = fmt.plane_elems * fmt.elem_bytes if piece_bytes is None else piece_bytes
    if setting == "staged" and staged_ok and converts:
        if not can.copy_engine or not kernel_ok:
            raise RuntimeError("path='staged' needs cudaMemcpyBatchAsync (cuda-bindings >= 12.8), NVRTC and an sm_89+ GPU")
        return "staged"
    if setting in ("auto", "staged"):
        if not converts and can.copy_engine and copy_engine_keeps_up(fmt, count, calls, piece_bytes):
            return "copy_engine"
        return "kernel" if kernel_ok else "torch"
    if setting == "kernel":
        if not can.kernels:
            raise RuntimeError(
                "path='kernel' needs cuda-bindings with NVRTC's library and a visible CUDA device "
                "(pip install cuda-bindings nvidia-cuda-nvrtc)"
            )
        if converts and not fp8_ok:
            raise RuntimeError(
                f"path='kernel' converts fp8 with sm_89+ instructions; this GPU is sm_{can.capability[0]}{can.capability[1]}"
            )
    if setting == "copy_engine":
        if converts:
            raise ValueError(
                f"path='copy_engine' moves bytes as they are, but {fmt.describe()} converts dtypes; use 'kernel' or 'torch'"
            )
        if not can.copy_engine:
            raise RuntimeError("path='copy_engine' needs cudaMemcpyBatchAsync from cuda-bindings >= 12.8 (pip install cuda-bindings)")
    return setting
