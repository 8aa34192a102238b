"""The few CUDA driver calls the engine makes per transfer, through cuda.bindings.

Owns calling cuLaunchKernel (with a prepacked parameter block), cuStreamWaitValue32,
cuStreamWaitEvent, cuEventRecord, cuStreamQuery and event creation, and turning their error
codes into exceptions that name the call and its arguments. These are the calls a transfer
makes on the host's critical path, so each is one binding call with prebuilt handles: no
context manager, no per-call object beyond the stream handle the caller hands in.
A thread that has not touched this device yet has no current CUDA context; the call is then
retried once inside torch.cuda.device(...), which binds the device's primary context.
It must never decide what to launch or wait on.
"""

from __future__ import annotations

import torch

CU_STREAM_WAIT_VALUE_GEQ = 0x0
CU_EVENT_DISABLE_TIMING = 0x2


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
        """A CUfunction handle object for a CuPy kernel's `kernel.ptr`."""
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
