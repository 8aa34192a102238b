"""The copy engines' batch call through ctypes (driver.BatchMemcpy), checked on the CPU.

A small C library stands in for libcuda: it exports cuMemcpyBatchAsync_v2 (CUDA 13's
arguments) and cuMemcpyBatchAsync (CUDA 12.8's, with failIdx) with the header's C types and
does each copy with memcpy on host addresses, after checking what the driver checks (one
attribute, index 0, stream-ordered source access). So the argument order, the widths, the
CUmemcpyAttributes layout and the numpy arrays handed to C are exercised for real, and the
copy engine path's pieces land byte for byte where TorchEngine puts them.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
import torch

from kvtier.format import PageFormat
from kvtier.transfer import TorchEngine
from kvtier.transfer.cuda import plans
from kvtier.transfer.cuda.copy_engine_path import CopyEnginePath
from kvtier.transfer.cuda.driver import BatchMemcpy, MemcpyAttributes, batch_memcpy_function
from tests.gpu.test_copy_plan import PASSTHROUGH, _clone, _cpu_tiers, _device_state

STAND_IN = r"""
#include <stddef.h>
#include <string.h>
typedef unsigned long long CUdeviceptr;
typedef struct { int type; int id; } CUmemLocation;
typedef struct { int srcAccessOrder; CUmemLocation srcLocHint; CUmemLocation dstLocHint; unsigned int flags; } CUmemcpyAttributes;
typedef void *CUstream;

unsigned int last_flags = 99;
unsigned long long last_stream = 0, last_count = 0, calls_v2 = 0, calls_v1 = 0;

static int copy_all(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count, CUmemcpyAttributes *attrs,
                    size_t *attrsIdxs, size_t numAttrs, CUstream stream) {
    if (numAttrs != 1 || attrsIdxs[0] != 0 || attrs[0].srcAccessOrder != 1) return 1; /* CUDA_ERROR_INVALID_VALUE */
    if (attrs[0].srcLocHint.type != 0 || attrs[0].dstLocHint.type != 0) return 1;
    for (size_t i = 0; i < count; i++) memcpy((void *)dsts[i], (const void *)srcs[i], sizes[i]);
    last_flags = attrs[0].flags; last_stream = (unsigned long long)stream; last_count = count;
    return 0;
}

int cuMemcpyBatchAsync_v2(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count, CUmemcpyAttributes *attrs,
                          size_t *attrsIdxs, size_t numAttrs, CUstream stream) {
    calls_v2++;
    return copy_all(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, stream);
}

int cuMemcpyBatchAsync(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count, CUmemcpyAttributes *attrs,
                       size_t *attrsIdxs, size_t numAttrs, size_t *failIdx, CUstream stream) {
    calls_v1++;
    int code = copy_all(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, stream);
    *failIdx = code ? 0 : (size_t)-1;
    return code;
}
"""


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs a C compiler for the libcuda stand-in")
    root = tmp_path_factory.mktemp("libcuda")
    (root / "stand_in.c").write_text(STAND_IN)
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(root / "stand_in.so"), str(root / "stand_in.c")], check=True)
    return str(root / "stand_in.so")


class _Raising:
    """Driver._direct's contract: call, raise on a non-zero code (naming the call and `of`)."""

    def __init__(self) -> None:
        self.whats = []

    def __call__(self, what, function, *args, of=None):
        self.whats.append((what, of))
        code = function(*args)
        if code:
            raise RuntimeError(f"{what} of {of} failed: {code}")


def _lib(path: str, only_v1: bool = False):
    lib = ctypes.CDLL(path)
    if only_v1:
        class _OldDriver:  # a CUDA 12.8-12.9 driver: no _v2 entry point
            cuMemcpyBatchAsync = lib.cuMemcpyBatchAsync
            calls_v1 = lib.calls_v1
        return lib, _OldDriver()
    return lib, lib


def test_attributes_have_the_c_layout() -> None:
    assert ctypes.sizeof(MemcpyAttributes) == 24
    assert MemcpyAttributes.flags.offset == 20 and MemcpyAttributes.dst_location_type.offset == 12


@pytest.mark.parametrize("old_driver", [False, True], ids=["cuda13", "cuda12.8"])
@pytest.mark.parametrize("fmt", PASSTHROUGH[:4], ids=lambda f: f.describe())
def test_copy_engine_through_ctypes_matches_torch_engine(stand_in, fmt: PageFormat, old_driver: bool) -> None:
    lib, exported = _lib(stand_in, only_v1=old_driver)
    function, fail_index = batch_memcpy_function(exported)
    assert fail_index == old_driver
    call = _Raising()
    gen = torch.Generator().manual_seed(25)
    dev, host = _cpu_tiers(fmt, gen)
    ref_dev, ref_host = _clone(dev, host)
    host.buffer.view(torch.uint8).fill_(0x5A)  # poisoned destination
    ref_host.buffer.view(torch.uint8).fill_(0x5A)
    engine = CopyEnginePath(fmt, plans.device_table(dev), host.buffer.data_ptr(), runtime=None,
                            batch=BatchMemcpy(function, fail_index, call))
    dslots, hslots = np.array([3, 4, 5, 11, 0]), np.array([7, 8, 9, 2, 15])  # runs to merge, and not
    engine.copy(0xABC0, engine.pieces("offload", range(fmt.num_layers), dslots, hslots))
    TorchEngine(ref_dev, ref_host).offload(dslots.tolist(), hslots.tolist())
    assert np.array_equal(host.buffer.numpy(), ref_host.buffer.numpy())
    assert ctypes.c_ulonglong.in_dll(lib, "last_stream").value == 0xABC0
    assert ctypes.c_uint.in_dll(lib, "last_flags").value == 1  # small copies prefer overlap
    for layer in range(fmt.num_layers):
        engine.copy(0xABC8, engine.pieces("reload", range(layer, layer + 1), hslots[::-1].copy(), dslots))
    TorchEngine(ref_dev, ref_host).reload(hslots[::-1].tolist(), dslots.tolist())
    assert _device_state(dev) == _device_state(ref_dev)
    counted = "calls_v1" if old_driver else "calls_v2"
    assert ctypes.c_ulonglong.in_dll(lib, counted).value >= 1 + fmt.num_layers
    assert {what for what, _ in call.whats} == {"cuMemcpyBatchAsync"}


def test_large_copies_take_the_default_flag_and_errors_raise(stand_in) -> None:
    lib, exported = _lib(stand_in)
    batch = BatchMemcpy(*batch_memcpy_function(exported), _Raising())
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, 3 << 20, dtype=np.uint8)
    dst = np.full_like(src, 0xA5)
    base_d, base_s = dst.ctypes.data, src.ctypes.data
    sizes = np.array([1 << 20, 2 << 20], dtype=np.uint64)
    # dst[2M:3M] <- src[0:1M] and dst[0:2M] <- src[1M:3M]
    batch(7, np.array([base_d + (2 << 20), base_d], dtype=np.uint64), np.array([base_s, base_s + (1 << 20)], dtype=np.uint64),
          sizes, prefer_overlap=False)
    assert np.array_equal(dst[2 << 20:], src[: 1 << 20])
    assert np.array_equal(dst[: 2 << 20], src[1 << 20:])
    assert ctypes.c_uint.in_dll(lib, "last_flags").value == 0
    assert ctypes.c_ulonglong.in_dll(lib, "last_count").value == 2
    with pytest.raises(ValueError, match="as many sources and sizes"):
        batch(7, np.zeros(2, dtype=np.uint64), np.zeros(1, dtype=np.uint64), sizes, prefer_overlap=True)
    bad = BatchMemcpy(*batch_memcpy_function(exported), _Raising())
    bad._attributes[True].src_access_order = 3  # what the stand-in (like the driver) refuses
    with pytest.raises(RuntimeError, match="cuMemcpyBatchAsync of 1 copies failed"):
        bad(7, np.array([base_d], dtype=np.uint64), np.array([base_s], dtype=np.uint64), np.array([16], dtype=np.uint64), True)


def test_no_entry_point_means_none() -> None:
    class _Old:
        pass

    assert batch_memcpy_function(_Old()) is None
