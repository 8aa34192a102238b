"""Run-time compiled CUDA kernels: the native/*.cu sources built by NVRTC, cached on disk.

Owns finding the kernel sources, compiling each module once per GPU architecture with the
options that keep the fp8 conversions bit-exact (IEEE division, no flush to zero, no fused
multiply-add), keeping the compiled cubin in kvtier.transfer.kernel_cache so that later
processes load it in milliseconds instead of compiling for seconds, loading it into the
device's primary context (the one torch uses) and handing out kernel function handles.
It must never launch a kernel, allocate device memory or decide which kernel runs:
kvtier.transfer.cuda does.

NVRTC and the driver are reached through cuda.bindings (NVRTC's library from the
nvidia-cuda-nvrtc wheel that CUDA builds of torch bring, or a CUDA toolkit); CuPy is not
needed (its import alone took 0.8 s of a fresh process on a 2-core VM). Both are imported
inside functions only, so kvtier imports on machines without them. The sources are package
data, `kvtier/native/*.cu` (in a checkout a link to native/ at the repository root), read
through importlib.resources so that every install mode finds them: wheel, --user, --target,
editable, or a checkout on PYTHONPATH.
"""

from __future__ import annotations

import re
import threading
from importlib import resources

from kvtier.transfer import kernel_cache

NATIVE_DIR = resources.files("kvtier") / "native"
COMPILE_OPTIONS = ("--ftz=false", "--prec-div=true", "--prec-sqrt=true", "--fmad=false")
MODULES = ("page_copy", "page_convert")
INCLUDE = re.compile(r'^#include "(\w+\.cu)"$')

_lock = threading.Lock()
_modules: dict[tuple[int, str], object] = {}
_functions: dict[tuple[int, str, str], int] = {}
_cache: list[kernel_cache.KernelCache] = []


def kernels_available(device_index: int = 0) -> bool:
    """True when cuda.bindings imports, a CUDA device is visible, and native/ is either in the
    kernel cache for device `device_index` or NVRTC's library loads to compile it."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return False
    try:
        error, = driver.cuInit(0)
        if error != driver.CUresult.CUDA_SUCCESS:
            return False
        error, count = driver.cuDeviceGetCount()
    except Exception:  # noqa: BLE001 - no libcuda on this machine
        return False
    if error != driver.CUresult.CUDA_SUCCESS or count <= device_index:
        return False
    import torch

    capability = torch.cuda.get_device_capability(device_index)
    if all(cache().read(entry_key(module, capability)) is not None for module in MODULES):
        return True
    return _nvrtc_loads()


def _nvrtc_loads() -> bool:
    try:
        from cuda.bindings import nvrtc

        error, _, _ = nvrtc.nvrtcVersion()
    except Exception:  # noqa: BLE001 - not installed, or its library not found (cuda.pathfinder's own errors)
        return False
    return error == nvrtc.nvrtcResult.NVRTC_SUCCESS


def entry_key(module: str, capability: tuple[int, int]) -> str:
    """The kernel cache's name for native/<module> on a GPU of `capability`.

    Besides the source and options it names the CUDA version torch was built for and
    cuda-bindings' version (NVRTC is installed with them), but not NVRTC's own version: reading
    that means loading NVRTC (0.2 s of a fresh process on a 2-core VM), which a cache hit avoids.
    A cubin of an older NVRTC for the same GPU stays valid.
    """
    import cuda.bindings
    import torch

    toolchain = f"cuda {torch.version.cuda}; cuda-bindings {cuda.bindings.__version__}"
    return kernel_cache.entry_key(source(module), COMPILE_OPTIONS, f"sm_{capability[0]}{capability[1]}", toolchain)


def cache() -> kernel_cache.KernelCache:
    """This process's kernel cache (its directory read from the environment at first use)."""
    if not _cache:
        _cache.append(kernel_cache.KernelCache(kernel_cache.default_directory()))
    return _cache[0]


def _read(name: str) -> str:
    path = NATIVE_DIR / name
    if not path.is_file():
        raise FileNotFoundError(
            f"kvtier CUDA source {name} is missing from {NATIVE_DIR}: the install lacks its package data"
        )
    return path.read_text(encoding="utf-8")


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


def _nvrtc_check(nvrtc, result, what: str, program=None):
    error = result[0]
    if error == nvrtc.nvrtcResult.NVRTC_SUCCESS:
        return result[1:]
    log = ""
    if program is not None:
        _, size = nvrtc.nvrtcGetProgramLogSize(program)
        text = b" " * size
        nvrtc.nvrtcGetProgramLog(program, text)
        log = text.rstrip(b"\0 ").decode(errors="replace")
    raise RuntimeError(f"{what} failed: {error.name}{': ' + log if log else ''}")


def target(capability: tuple[int, int]) -> tuple[str, bool]:
    """(architecture option value, True for a cubin) for a GPU of `capability`: its own sm_XY
    where NVRTC knows it, else PTX of the newest architecture NVRTC knows below it (the driver
    compiles that for the GPU when loading)."""
    from cuda.bindings import nvrtc

    wanted = capability[0] * 10 + capability[1]
    count, = _nvrtc_check(nvrtc, nvrtc.nvrtcGetNumSupportedArchs(), "nvrtcGetNumSupportedArchs")
    archs, = _nvrtc_check(nvrtc, nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")
    archs = list(archs)[:count]
    if wanted in archs:
        return f"sm_{wanted}", True
    lower = [arch for arch in archs if arch <= wanted]
    if not lower:
        raise RuntimeError(f"NVRTC supports architectures {archs}, none at or below this GPU's sm_{wanted}")
    return f"compute_{max(lower)}", False


def compile_module(module: str, arch: str, cubin: bool) -> bytes:
    """native/<module>.cu compiled by NVRTC for `arch`: a cubin, or PTX text where cubin is False."""
    from cuda.bindings import nvrtc

    program, = _nvrtc_check(
        nvrtc, nvrtc.nvrtcCreateProgram(source(module).encode(), f"{module}.cu".encode(), 0, [], []), "nvrtcCreateProgram"
    )
    try:
        options = [f"--gpu-architecture={arch}".encode(), *(option.encode() for option in COMPILE_OPTIONS)]
        _nvrtc_check(nvrtc, nvrtc.nvrtcCompileProgram(program, len(options), options), f"compiling {module}.cu for {arch}", program)
        size_call, get_call = (nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN) if cubin else (nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX)
        size, = _nvrtc_check(nvrtc, size_call(program), "reading the compiled size")
        image = b" " * size
        _nvrtc_check(nvrtc, get_call(program, image), "reading the compiled image")
        return image
    finally:
        nvrtc.nvrtcDestroyProgram(program)


def _compile_for(module: str, capability: tuple[int, int]) -> bytes:
    """A cubin for the GPU, or NUL-terminated PTX where NVRTC does not know it (cuModuleLoadData takes either)."""
    arch, cubin = target(capability)
    image = compile_module(module, arch, cubin)
    return image if cubin else image.rstrip(b"\0 ") + b"\0"


def _driver_check(driver, result, what: str):
    if result[0] != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(result[0])
        raise RuntimeError(f"{what} failed: {name.decode() if name else int(result[0])}")
    return result[1] if len(result) > 1 else None


def _load(device_index: int, module: str):
    """native/<module> loaded into the primary context of device `device_index` (compiled or from the cache)."""
    import numpy as np
    import torch
    from cuda.bindings import driver

    capability = torch.cuda.get_device_capability(device_index)
    image = cache().get(entry_key(module, capability), lambda: _compile_for(module, capability))
    _driver_check(driver, driver.cuInit(0), "cuInit")
    device = _driver_check(driver, driver.cuDeviceGet(device_index), f"cuDeviceGet({device_index})")
    # The primary context is the one torch's runtime calls use, so handles loaded here launch on
    # torch's streams; retained once per module for the life of the process.
    context = _driver_check(driver, driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
    _driver_check(driver, driver.cuCtxPushCurrent(context), "cuCtxPushCurrent")
    try:
        buffer = np.frombuffer(image, dtype=np.uint8)
        return _driver_check(driver, driver.cuModuleLoadData(buffer.ctypes.data), f"cuModuleLoadData of {module} (sm_{capability[0]}{capability[1]})")
    finally:
        driver.cuCtxPopCurrent()


def function(device_index: int, module: str, name: str) -> int:
    """The CUfunction handle (an int) of kernel `name` of native/<module>.cu on device `device_index`."""
    key = (device_index, module, name)
    found = _functions.get(key)
    if found is not None:
        return found
    from cuda.bindings import driver

    with _lock:
        loaded = _modules.get((device_index, module))
        if loaded is None:
            loaded = _modules[(device_index, module)] = _load(device_index, module)
        found = int(_driver_check(driver, driver.cuModuleGetFunction(loaded, name.encode()), f"cuModuleGetFunction({name!r})"))
        _functions[key] = found
    return found
