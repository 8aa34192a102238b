"""CUDA kernels of native/*.cu: shipped prebuilt, else built by NVRTC and cached on disk.

Owns finding the kernel sources, finding a module's cubin (prebuilt in the package, then the
on-disk cache, then an NVRTC compile with the options that keep the fp8 conversions bit-exact:
IEEE division, no flush to zero, no fused multiply-add), keeping a compiled cubin in
kvtier.transfer.kernel_cache so that later processes load it in milliseconds instead of
compiling for seconds, loading it into the device's primary context (the one torch uses) and
handing out kernel function handles.

Prebuilt cubins (kvtier/native/prebuilt/, built by scripts/build_prebuilt_cubins.py with
NVRTC PREBUILT_NVRTC, compressed) cover PREBUILT_ARCHS, so a fresh machine with one of those
GPUs never runs NVRTC. A file's name holds the sha256 of the source text, the options, the
architecture and PREBUILT_NVRTC, so editing a .cu (or an option) leaves no file under the new
name and the module is compiled as before until the set is rebuilt (tests/test_prebuilt_cubins.py
fails in CI meanwhile). They are tried first, before the disk cache: the name does not depend
on torch's or cuda-bindings' versions (a cubin's validity depends only on the GPU architecture
and the driver), so an upgrade of either keeps them, and reading one writes nothing. A cubin
built by NVRTC 13.0 loads on any driver of CUDA 13.0 or later (CUDA's minor version
compatibility holds for cubins, not for PTX); with an older driver, KVTIER_PREBUILT_KERNELS=off,
a missing, torn or corrupt file, or a failed load, the module comes from the cache or NVRTC.
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

import os
import re
import threading
import warnings
import zlib
from importlib import resources

from kvtier.transfer import kernel_cache

NATIVE_DIR = resources.files("kvtier") / "native"
COMPILE_OPTIONS = ("--ftz=false", "--prec-div=true", "--prec-sqrt=true", "--fmad=false")
MODULES = ("page_copy", "page_convert")
INCLUDE = re.compile(r'^#include "(\w+\.cu)"$')

PREBUILT_DIR = NATIVE_DIR / "prebuilt"
# The NVRTC (major, minor) that builds the prebuilt set; drivers of this CUDA version or later load it.
PREBUILT_NVRTC = (13, 0)
# Ada (L4, L40, RTX 40), Hopper (H100, H200), Blackwell (B200, RTX 50); page_convert.cu's fp8
# conversions need sm_89 or later, so Ampere has no set (NVRTC cannot build it there either).
PREBUILT_ARCHS = ("sm_89", "sm_90", "sm_100", "sm_120")
PREBUILT_ENV = "KVTIER_PREBUILT_KERNELS"
PREBUILT_SUFFIX = ".cubin.z"
EM_CUDA = 190

_lock = threading.Lock()
_modules: dict[tuple[int, str], object] = {}
_functions: dict[tuple[int, str, str], int] = {}
_cache: list[kernel_cache.KernelCache] = []
# Where each loaded module's cubin came from: "prebuilt", "cache" or "nvrtc", keyed (device index, module).
loaded_from: dict[tuple[int, str], str] = {}
_warned: set[str] = set()
_prebuilt_read: dict[str, bytes] = {}  # decoded prebuilt images by file name, until loaded


def kernels_available(device_index: int = 0) -> bool:
    """True when cuda.bindings imports, a CUDA device is visible, and native/ is either loaded
    already, prebuilt for device `device_index` (and its driver takes them), in the kernel cache
    for it, or NVRTC's library loads to compile it."""
    if all((device_index, module) in _modules for module in MODULES):
        return True
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
    if _driver_takes_prebuilt(driver) and all(read_prebuilt(module, _arch(capability)) is not None for module in MODULES):
        return True
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


def _arch(capability: tuple[int, int]) -> str:
    return f"sm_{capability[0]}{capability[1]}"


def prebuilt_toolchain() -> str:
    major, minor = PREBUILT_NVRTC
    return f"prebuilt; nvrtc {major}.{minor}"


def prebuilt_name(module: str, arch: str) -> str:
    """The file name of native/<module>'s prebuilt cubin for `arch`, from the current sources.

    The key is kernel_cache.entry_key of the source text, the options, the architecture and
    the NVRTC version that builds the set; torch's and cuda-bindings' versions are left out
    (they do not change what a cubin is nor where it loads)."""
    key = kernel_cache.entry_key(source(module), COMPILE_OPTIONS, arch, prebuilt_toolchain())
    return f"{module}.{arch}.{key}{PREBUILT_SUFFIX}"


def encode_prebuilt(cubin: bytes) -> bytes:
    """A prebuilt file's bytes: the disk cache's header (magic, sha256) over the zlib-compressed cubin."""
    return kernel_cache.encode(zlib.compress(cubin, 9))


def decode_prebuilt(data: bytes, arch: str | None = None) -> bytes | None:
    """The cubin in a prebuilt file's bytes, or None where they are torn, corrupt, not a CUDA
    ELF image, or (given `arch`) built for another architecture."""
    packed = kernel_cache.decode(data)
    if packed is None:
        return None
    try:
        cubin = zlib.decompress(packed)
    except zlib.error:
        return None
    found = cubin_arch(cubin)
    if found is None or (arch is not None and found != arch):
        return None
    return cubin


def cubin_arch(image: bytes) -> str | None:
    """"sm_XY" of a CUDA ELF image (cubin), or None where `image` is not one.

    64-bit little-endian ELF, machine EM_CUDA; the architecture is bits 8-15 of e_flags from
    ELF ABI version 8 on (what NVRTC 13 writes), bits 0-7 before."""
    if len(image) < 64 or image[:4] != b"\x7fELF" or image[4] != 2 or image[5] != 1:
        return None
    if int.from_bytes(image[18:20], "little") != EM_CUDA:
        return None
    flags = int.from_bytes(image[48:52], "little")
    number = (flags >> 8) & 0xFF if image[8] >= 8 else flags & 0xFF
    return f"sm_{number}" if number else None


def prebuilt_enabled() -> bool:
    return os.environ.get(PREBUILT_ENV, "").strip().lower() not in ("0", "off", "false", "no")


def read_prebuilt(module: str, arch: str, directory=None) -> bytes | None:
    """The shipped cubin of native/<module> for `arch` built from the current source, or None
    (turned off, not shipped for this architecture or this source, or a torn or corrupt file)."""
    if not prebuilt_enabled() or module not in MODULES:
        return None
    name = prebuilt_name(module, arch)
    if directory is None and name in _prebuilt_read:
        return _prebuilt_read[name]
    path = (PREBUILT_DIR if directory is None else directory) / name
    try:
        data = path.read_bytes()
    except OSError:
        return None
    cubin = decode_prebuilt(data, arch)
    if cubin is None:
        _warn_once(f"corrupt {path}", f"kvtier's prebuilt kernel {path} is damaged; compiling {module}.cu instead")
    elif directory is None:
        # kernels_available() reads them first; the load that follows takes the image from here.
        _prebuilt_read[name] = cubin
    return cubin


def _driver_takes_prebuilt(driver) -> bool:
    """True when the driver is of CUDA PREBUILT_NVRTC or later (cuInit done)."""
    try:
        error, version = driver.cuDriverGetVersion()
    except Exception:  # noqa: BLE001 - no libcuda
        return False
    major, minor = PREBUILT_NVRTC
    return error == driver.CUresult.CUDA_SUCCESS and version >= major * 1000 + minor * 10


def _warn_once(what: str, message: str) -> None:
    if what not in _warned:
        _warned.add(what)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


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
    """native/<module> loaded into the primary context of device `device_index`: its prebuilt
    cubin where one is shipped for this GPU and loads, else from the disk cache or NVRTC."""
    import numpy as np
    import torch
    from cuda.bindings import driver

    capability = torch.cuda.get_device_capability(device_index)
    _driver_check(driver, driver.cuInit(0), "cuInit")
    device = _driver_check(driver, driver.cuDeviceGet(device_index), f"cuDeviceGet({device_index})")
    # The primary context is the one torch's runtime calls use, so handles loaded here launch on
    # torch's streams; retained once per module for the life of the process.
    context = _driver_check(driver, driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
    _driver_check(driver, driver.cuCtxPushCurrent(context), "cuCtxPushCurrent")
    try:
        image = read_prebuilt(module, _arch(capability)) if _driver_takes_prebuilt(driver) else None
        if image is not None:
            buffer = np.frombuffer(image, dtype=np.uint8)
            error, loaded = driver.cuModuleLoadData(buffer.ctypes.data)
            if error == driver.CUresult.CUDA_SUCCESS:
                loaded_from[(device_index, module)] = "prebuilt"
                _prebuilt_read.pop(prebuilt_name(module, _arch(capability)), None)
                return loaded
            _warn_once(f"load {module}", f"kvtier's prebuilt {module} cubin did not load ({error.name}); compiling it instead")
        kernels = cache()
        compiles = kernels.compiles
        image = kernels.get(entry_key(module, capability), lambda: _compile_for(module, capability))
        loaded_from[(device_index, module)] = "nvrtc" if kernels.compiles > compiles else "cache"
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
