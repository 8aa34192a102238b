"""Run-time compiled CUDA kernels: the native/*.cu sources built by NVRTC through CuPy.

Owns finding the kernel sources, compiling each once per device with the options that keep
the fp8 conversions bit-exact (IEEE division, no flush to zero, no fused multiply-add), and
handing out kernel functions and CuPy views of torch streams. It must never launch a kernel,
allocate device memory or decide which kernel runs: kvtier.transfer.cuda does.

CuPy (>= 14, for Stream.from_external) is imported inside functions only, so kvtier imports
on machines without it. The
sources live in native/ beside the kvtier package (repository root); a wheel must ship them
at that same relative place.
"""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path

# A source checkout (or editable install) keeps native/ beside kvtier/; a wheel installs the
# sources as data files under <prefix>/share/kvtier/native.
NATIVE_DIRS = (Path(__file__).resolve().parents[2] / "native", Path(sys.prefix) / "share" / "kvtier" / "native")
COMPILE_OPTIONS = ("--ftz=false", "--prec-div=true", "--prec-sqrt=true", "--fmad=false")
MODULES = ("page_copy", "page_convert")
INCLUDE = re.compile(r'^#include "(\w+\.cu)"$')

_lock = threading.Lock()
_modules: dict[tuple[int, str], object] = {}
_kernels: dict[tuple[int, str, str], object] = {}


def cupy_available() -> bool:
    """True when CuPy imports and sees a CUDA device."""
    try:
        import cupy
    except ImportError:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except cupy.cuda.runtime.CUDARuntimeError:
        return False


def _read(name: str) -> str:
    for folder in NATIVE_DIRS:
        path = folder / name
        if path.is_file():
            return path.read_text()
    raise FileNotFoundError(f"kvtier CUDA source {name} is missing; looked in {[str(d) for d in NATIVE_DIRS]}")


def source(module: str) -> str:
    """The source of native/<module>.cu with its `#include "x.cu"` lines replaced by those files.

    Inlined here rather than found by NVRTC through an include path, so the text compiled is
    exactly what this returns (the CPU emulator compiles the same text).
    """
    if module not in MODULES:
        raise ValueError(f"native module must be one of {MODULES}, got {module!r}")
    lines = []
    for line in _read(f"{module}.cu").splitlines():
        match = INCLUDE.match(line)
        lines.append(_read(match.group(1)) if match else line)
    return "\n".join(lines) + "\n"


def kernel(device_index: int, module: str, name: str):
    """The CuPy RawKernel `name` of native/<module>.cu, compiled for device `device_index`."""
    import cupy

    key = (device_index, module, name)
    found = _kernels.get(key)
    if found is not None:
        return found
    with _lock:
        with cupy.cuda.Device(device_index):
            raw_module = _modules.get((device_index, module))
            if raw_module is None:
                raw_module = cupy.RawModule(code=source(module), options=COMPILE_OPTIONS, backend="nvrtc")
                _modules[(device_index, module)] = raw_module
            found = raw_module.get_function(name)
        _kernels[key] = found
    return found


class _StreamHandle:
    """A raw cudaStream_t offered through the CUDA stream protocol."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def cupy_stream(torch_stream):
    """A CuPy stream object for an existing torch CUDA stream (CuPy does not own it)."""
    import cupy

    return cupy.cuda.Stream.from_external(_StreamHandle(torch_stream.cuda_stream))
