"""The few CUDA driver calls the engine makes per transfer.

Owns calling cuLaunchKernel (with a prepacked parameter block), cuStreamWaitValue32,
cuStreamWaitEvent, cuEventRecord, cuStreamQuery and event creation, and turning their error
codes into exceptions that name the call and its arguments. These are the calls a transfer
makes on the host's critical path: the four made per transfer (launch, the two waits, event
record) go straight to libcuda through ctypes with integer handles, which took 5-40 µs off the
engine's submit on the H200's host against cuda.bindings' wrappers (BENCHMARKS.md); so does
cuMemcpyBatchAsync, whose address lists pass as numpy arrays (cuda.bindings' runtime wrapper
converts every element of Python lists, about 0.3 µs a piece); the rest, and every call where
libcuda cannot be opened by name, go through cuda.bindings.
A thread that has not touched this device yet has no current CUDA context; the call is then
retried once inside torch.cuda.device(...), which binds the device's primary context.
It must never decide what to launch or wait on.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

CU_STREAM_WAIT_VALUE_GEQ = 0x0
CU_EVENT_DISABLE_TIMING = 0x2
CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 0x1
CU_MEMCPY_FLAG_DEFAULT = 0x0
CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 0x1


class MemcpyAttributes(ctypes.Structure):
    """CUmemcpyAttributes: the source access order, two CUmemLocation hints (type, id) and flags."""

    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_location_type", ctypes.c_int),
        ("src_location_id", ctypes.c_int),
        ("dst_location_type", ctypes.c_int),
        ("dst_location_id", ctypes.c_int),
        ("flags", ctypes.c_uint),
    ]


class BatchMemcpy:
    """cuMemcpyBatchAsync through a ctypes function: (dst, src, size) uint64 arrays, one attribute
    (stream-ordered source access; PreferOverlapWithCompute or the default flag) for every copy.

    `function` takes the CUDA 13 arguments (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs,
    stream), or with `fail_index` the CUDA 12.8-12.9 ones (a size_t* failIdx before the stream).
    `call(what, function, *args)` makes the call and raises on an error code (Driver._direct)."""

    def __init__(self, function, fail_index: bool, call) -> None:
        self._function = function
        self._fail_index = fail_index
        self._call = call
        self._attributes = {
            overlap: MemcpyAttributes(
                src_access_order=CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                flags=CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE if overlap else CU_MEMCPY_FLAG_DEFAULT,
            )
            for overlap in (False, True)
        }
        self._attribute_index = (ctypes.c_size_t * 1)(0)
        self._failed_at = ctypes.c_size_t(0)

    def __call__(self, stream: int, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, prefer_overlap: bool) -> None:
        """Queue dst[i] <- src[i] (sizes[i] bytes) for every i on `stream`; the arrays are read
        during the call only."""
        count = int(dst.size)
        if not (src.size == sizes.size == count):
            raise ValueError(f"a batch copy needs as many sources and sizes as destinations, got {count}, {src.size}, {sizes.size}")
        if count == 0:
            return
        dst, src, sizes = (np.ascontiguousarray(a, dtype=np.uint64) for a in (dst, src, sizes))
        attributes = ctypes.byref(self._attributes[bool(prefer_overlap)])
        head = (dst.ctypes.data, src.ctypes.data, sizes.ctypes.data, count, attributes, self._attribute_index, 1)
        if self._fail_index:
            head += (ctypes.byref(self._failed_at),)
        self._call("cuMemcpyBatchAsync", self._function, *head, int(stream), of=f"{count} copies")


def batch_memcpy_function(lib):
    """(function, fail_index) for libcuda's cuMemcpyBatchAsync with its C signature, or None where
    the driver has none (before CUDA 12.8). CUDA 13 drivers export the new signature as
    cuMemcpyBatchAsync_v2 and keep cuMemcpyBatchAsync with failIdx for older binaries."""
    handle, size = ctypes.c_void_p, ctypes.c_size_t
    # CUdeviceptr* dsts, CUdeviceptr* srcs, size_t* sizes, size_t count, CUmemcpyAttributes* attrs,
    # size_t* attrsIdxs, size_t numAttrs[, size_t* failIdx], CUstream
    head = (handle, handle, handle, size, handle, handle, size)
    for name, fail_index in (("cuMemcpyBatchAsync_v2", False), ("cuMemcpyBatchAsync", True)):
        function = getattr(lib, name, None)
        if function is None:
            continue
        function.argtypes = head + ((handle,) if fail_index else ()) + (handle,)
        function.restype = ctypes.c_int
        return function, fail_index
    return None


def available() -> bool:
    """True when cuda.bindings imports (the kernel path's launches and waits need it)."""
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return False
    return True


class Driver:
    """Driver calls bound to one device."""

    def __init__(self, device: torch.device) -> None:
        from cuda.bindings import driver

        self._cu = driver
        self.device = device
        self._success = driver.CUresult.CUDA_SUCCESS
        self._not_ready = driver.CUresult.CUDA_ERROR_NOT_READY
        self._no_context = (driver.CUresult.CUDA_ERROR_INVALID_CONTEXT, driver.CUresult.CUDA_ERROR_CONTEXT_IS_DESTROYED)
        self._no_context_codes = tuple(int(code) for code in self._no_context)
        self._lib = _libcuda()
        if self._lib is not None:
            self.launch = self._launch_direct
            self.wait_value = self._wait_value_direct
            self.wait_event = self._wait_event_direct
            self.record_event = self._record_event_direct
        found = None if self._lib is None else batch_memcpy_function(self._lib)
        # cuMemcpyBatchAsync straight from libcuda (None: use cuda.bindings' runtime wrapper).
        self.batch_memcpy = None if found is None else BatchMemcpy(*found, self._direct)

    def _direct(self, what: str, function, *args, of: str | None = None) -> None:
        """A libcuda call through ctypes: 0 is success; a thread without this device's context
        binds it and retries once; anything else raises, named by cuda.bindings (`of`: what
        the call was for, put in the message only then)."""
        code = function(*args)
        if code in self._no_context_codes:
            with torch.cuda.device(self.device):
                code = function(*args)
        if code:
            self._check((self._cu.CUresult(code),), what if of is None else f"{what} of {of}", args)

    def _launch_direct(self, function, blocks: int, threads: int, stream, params: int, name: str) -> None:
        self._direct("cuLaunchKernel", self._lib.cuLaunchKernel, int(function), blocks, 1, 1, threads, 1, 1, 0,
                     int(stream), params, None, of=name)

    def _wait_value_direct(self, stream, address: int, value: int) -> None:
        self._direct("cuStreamWaitValue32", self._lib.cuStreamWaitValue32_v2, int(stream), address, value,
                     CU_STREAM_WAIT_VALUE_GEQ)

    def _wait_event_direct(self, stream, event) -> None:
        self._direct("cuStreamWaitEvent", self._lib.cuStreamWaitEvent, int(stream), int(event), 0)

    def _record_event_direct(self, event, stream) -> None:
        self._direct("cuEventRecord", self._lib.cuEventRecord, int(event), int(stream))

    def _check(self, result, what: str, args: tuple = ()):
        error = result[0]
        if error == self._success:
            return result[1] if len(result) > 1 else None
        _, name = self._cu.cuGetErrorName(error)
        shown = ", ".join(hex(a) if isinstance(a, int) else repr(a) for a in args)
        raise RuntimeError(f"{what}({shown}) failed: {name.decode() if name else int(error)}")

    def _call(self, what: str, function, *args):
        result = function(*args)
        if result[0] in self._no_context:
            with torch.cuda.device(self.device):
                result = function(*args)
        if result[0] == self._success:
            return result[1] if len(result) > 1 else None
        return self._check(result, what, args)

    def function(self, handle: int):
        """A CUfunction handle object for a kernel handle from kvtier.transfer.native.function."""
        return self._cu.CUfunction(handle)

    def stream(self, handle: int):
        return self._cu.CUstream(handle)

    def launch(self, function, blocks: int, threads: int, stream, params: int, name: str) -> None:
        """cuLaunchKernel of `function` with the void** parameter block at address `params`."""
        result = self._cu.cuLaunchKernel(function, blocks, 1, 1, threads, 1, 1, 0, stream, params, 0)
        if result[0] in self._no_context:
            with torch.cuda.device(self.device):
                result = self._cu.cuLaunchKernel(function, blocks, 1, 1, threads, 1, 1, 0, stream, params, 0)
        if result[0] != self._success:
            self._check(result, f"cuLaunchKernel of {name}", (blocks, threads, params))

    def wait_value(self, stream: int, address: int, value: int) -> None:
        """Order `stream` after (int32)(*address - value) >= 0."""
        self._call("cuStreamWaitValue32", self._cu.cuStreamWaitValue32, stream, address, value, CU_STREAM_WAIT_VALUE_GEQ)

    def wait_event(self, stream, event: int) -> None:
        self._call("cuStreamWaitEvent", self._cu.cuStreamWaitEvent, stream, event, 0)

    def record_event(self, event, stream: int) -> None:
        self._call("cuEventRecord", self._cu.cuEventRecord, event, stream)

    def create_event(self):
        return self._call("cuEventCreate", self._cu.cuEventCreate, CU_EVENT_DISABLE_TIMING)

    def destroy_event(self, event) -> None:
        self._cu.cuEventDestroy(event)

    def stream_idle(self, stream) -> bool:
        """True when every launch queued on `stream` has finished; raises on a failed launch."""
        result = self._cu.cuStreamQuery(stream)
        if result[0] == self._not_ready:
            return False
        self._check(result, "cuStreamQuery")
        return True

    def host_device_pointer(self, host: int) -> int:
        """The device alias of CUDA-registered (pinned) host memory at `host`."""
        return int(self._call("cuMemHostGetDevicePointer", self._cu.cuMemHostGetDevicePointer, host, 0))


_LIB: list = []


def _libcuda():
    """libcuda's four per-transfer entry points with their C signatures, or None (the library
    cannot be opened by name, or lacks one of them)."""
    if _LIB:
        return _LIB[0]
    lib = None
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        handle, uint = ctypes.c_void_p, ctypes.c_uint
        signatures = {
            # CUfunction, grid xyz, block xyz, shared bytes, CUstream, void** params, void** extra
            "cuLaunchKernel": (handle, uint, uint, uint, uint, uint, uint, uint, handle, handle, handle),
            # CUstream, CUdeviceptr, cuuint32_t value, flags
            "cuStreamWaitValue32_v2": (handle, ctypes.c_uint64, ctypes.c_uint32, uint),
            "cuStreamWaitEvent": (handle, handle, uint),  # CUstream, CUevent, flags
            "cuEventRecord": (handle, handle),  # CUevent, CUstream
        }
        for name, argtypes in signatures.items():
            function = getattr(lib, name)
            function.argtypes = argtypes
            function.restype = ctypes.c_int
    except (OSError, AttributeError):
        lib = None
    _LIB.append(lib)
    return lib
