"""The CUDA engine's copy-path rules (kvtier.transfer.cuda.path_choice) on the CPU: what "auto"
picks from a transfer's shape and the refusals of forced paths a machine cannot run. The GPU tests check that
the engine hands these rules what it sees (tests/gpu/test_cuda_engine.py)."""

from __future__ import annotations

import pytest

from kvtier.format import PageFormat
from kvtier.transfer.cuda import path_choice
from kvtier.transfer.cuda.path_choice import Abilities, choose, copy_engine_keeps_up

H200 = Abilities(kernels=True, copy_engine=True, capability=(9, 0))
BIG = PageFormat(4, 8, 128, 128)  # 256 KiB planes
SMALL = PageFormat(4, 8, 128, 16)  # 32 KiB planes
CONVERTING = PageFormat(4, 8, 128, 128, dtype="fp8_e4m3", scale="per_token_head", device_dtype="bf16")


def offload(fmt, can=H200, setting="auto", count=64):
    return choose(setting, fmt, can, converts=fmt.converts, count=count, calls=1)


def reload(fmt, can=H200, setting="auto", count=64):
    return choose(setting, fmt, can, converts=fmt.converts, count=count, calls=fmt.num_layers, staged_ok=True)


@pytest.mark.parametrize("direction", [offload, reload])
def test_auto_alone_follows_the_piece_size(direction):
    assert direction(BIG) == "copy_engine"
    assert direction(SMALL) == "kernel"
    assert direction(CONVERTING) == "kernel"


def test_without_kernels_or_fp8_conversion_auto_falls_back():
    no_kernels = Abilities(kernels=False, copy_engine=True, capability=(9, 0))
    assert offload(BIG, no_kernels) == "copy_engine"
    assert offload(SMALL, no_kernels) == "torch"
    old_gpu = Abilities(kernels=True, copy_engine=True, capability=(8, 0))
    assert reload(CONVERTING, old_gpu) == "torch"


def test_forced_paths_are_kept():
    for setting in ("kernel", "copy_engine", "torch"):
        assert offload(BIG, setting=setting) == setting
        assert reload(BIG, setting=setting) == setting
    assert reload(CONVERTING, setting="staged") == "staged"
    # "staged" on a pass-through transfer acts as "auto".
    assert reload(BIG, setting="staged") == "copy_engine"


def test_host_cost_against_pcie_time():
    fmt = PageFormat(1, 8, 128, 128)  # two 256 KiB planes a page: 9.5 us of PCIe
    piece = fmt.plane_elems * fmt.elem_bytes
    # One page: one call (10 us) and two pieces (3.6 us) outlast its bytes.
    assert not copy_engine_keeps_up(fmt, 1, 1, piece)
    # Eight pages: 10 + 16 x 1.8 = 38.8 us of queueing against 76 us of PCIe.
    assert copy_engine_keeps_up(fmt, 8, 1, piece)
    assert offload(fmt, count=1) == "kernel" and offload(fmt, count=8) == "copy_engine"
    # Below the minimum piece the copy engines are never taken, however long the transfer.
    assert not copy_engine_keeps_up(fmt, 4096, 1, path_choice.COPY_ENGINE_MIN_PIECE - 1)
    # A reload calls once per layer: 92 calls for 92 layers of one page cost more than one call.
    deep = PageFormat(92, 8, 128, 128)
    assert copy_engine_keeps_up(deep, 4, 1, piece) and not copy_engine_keeps_up(deep, 1, 92, piece)


def test_refusals_name_what_is_missing():
    nothing = Abilities(kernels=False, copy_engine=False, capability=(9, 0))
    with pytest.raises(RuntimeError, match="NVRTC"):
        offload(SMALL, nothing, setting="kernel")
    with pytest.raises(RuntimeError, match="cudaMemcpyBatchAsync"):
        offload(SMALL, nothing, setting="copy_engine")
    with pytest.raises(ValueError, match="converts dtypes"):
        offload(CONVERTING, setting="copy_engine")
    with pytest.raises(RuntimeError, match="sm_80"):
        reload(CONVERTING, Abilities(kernels=True, copy_engine=True, capability=(8, 0)), setting="kernel")
    with pytest.raises(RuntimeError, match="staged"):
        reload(CONVERTING, Abilities(kernels=False, copy_engine=True, capability=(9, 0)), setting="staged")


def test_copy_engine_availability_without_importing_the_runtime():
    """batch_memcpy_available() (what CudaEngine tells path_choice before the copy engines' first
    use) agrees with importing the runtime (batch_memcpy_runtime(), the copy engines' first use),
    asked in a fresh process so the first answer is given before any import of the runtime."""
    import subprocess
    import sys

    code = ("import sys; from kvtier.transfer.cuda.copy_engine_path import batch_memcpy_available, batch_memcpy_runtime; "
            "imported = 'cuda.bindings.runtime' in sys.modules; first = batch_memcpy_available(); "
            "print(first, batch_memcpy_runtime() is not None, imported)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    first, actual, _ = done.stdout.split()
    assert first == actual
