"""The native/ kernels' own source, run on the CPU: every thread a host thread.

g++ compiles page_copy.cu and page_convert.cu as C++ with CUDA's built-ins defined on the
host: threadIdx/blockIdx per host thread, a block's 256 threads run at once, and warp
shuffles exchange values through a per-warp barrier. The inline-PTX conversions (the only
part with no host meaning: the span of page_convert.cu from `f16_to_float` to the reload
section) are replaced by round-to-nearest-even conversions that search every fp8 code. The
kernels are launched through CudaEngine's own argument marshalling (its kernel path, with
a launcher that calls the emulator), over CPU tiers, and compared byte for byte with
TorchEngine. What this proves: indexing, strides, vector packing, scale groups, team
reductions and grid-stride loops. What it cannot: the PTX conversions and real memory
ordering, which tests/gpu/test_cuda_engine.py checks on a GPU.
Skipped where no C++20 compiler is found.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch
from test_copy_plan import CONVERTING, PASSTHROUGH, _clone, _cpu_tiers

from kvtier.format import PageFormat
from kvtier.transfer import TorchEngine, native
from kvtier.transfer.cuda_engine import CudaEngine, LaunchShape, passthrough_copies

CXX = shutil.which("g++") or shutil.which("clang++")

HOST_PRELUDE = r"""
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
struct uint4 { unsigned int x, y, z, w; };
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
struct Dim { unsigned x; };
thread_local Dim threadIdx, blockIdx;
Dim blockDim, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(threads)
#define __restrict__ __restrict
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
static float warp_lanes[8][32];
static inline float __shfl_xor_sync(unsigned, float value, int offset) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    warp_lanes[warp][lane] = value;
    warp_barriers[warp]->arrive_and_wait();
    const float got = warp_lanes[warp][lane ^ offset];
    warp_barriers[warp]->arrive_and_wait();
    return got;
}
template <typename Kernel, typename... Args>
static void run_grid(Kernel kernel, int blocks, Args... args) {
    gridDim.x = blocks;
    blockDim.x = 256;
    for (int block = 0; block < blocks; ++block) {
        warp_barriers.clear();
        for (int w = 0; w < 8; ++w) warp_barriers.emplace_back(new std::barrier<>(32));
        std::vector<std::thread> threads;
        for (int t = 0; t < 256; ++t)
            threads.emplace_back([=] { blockIdx.x = block; threadIdx.x = t; kernel(args...); });
        for (auto& thread : threads) thread.join();
    }
}
"""

HOST_CONVERSIONS = r"""
static float fp8_decode(unsigned code, bool e4m3) {
    const unsigned sign = code >> 7;
    float value;
    if (e4m3) {
        const unsigned e = (code >> 3) & 15, m = code & 7;
        if (e == 15 && m == 7) return NAN;
        value = e == 0 ? std::ldexp((float)m, -9) : std::ldexp(1.0f + m / 8.0f, (int)e - 7);
    } else {
        const unsigned e = (code >> 2) & 31, m = code & 3;
        if (e == 31) return m ? NAN : (sign ? -INFINITY : INFINITY);
        value = e == 0 ? std::ldexp((float)m, -16) : std::ldexp(1.0f + m / 4.0f, (int)e - 15);
    }
    return sign ? -value : value;
}
static unsigned fp8_encode(float x, bool e4m3) {
    if (x == 0.0f) return std::signbit(x) ? 0x80u : 0u;
    unsigned best = 0;
    double best_distance = 1e300;
    for (unsigned code = 0; code < 256; ++code) {
        const float v = fp8_decode(code, e4m3);
        if (std::isnan(v) || std::isinf(v) || (v == 0.0f && std::signbit(v) != std::signbit(x))) continue;
        const double distance = std::fabs((double)v - (double)x);
        if (distance < best_distance || (distance == best_distance && (code & 1u) == 0)) {
            best_distance = distance;
            best = code;
        }
    }
    return best;
}
static unsigned short float_to_bf16(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
static unsigned short float_to_f16(float f) {
    const _Float16 h = (_Float16)f;
    unsigned short bits;
    std::memcpy(&bits, &h, 2);
    return bits;
}
static inline float f16_to_float(unsigned short bits) { _Float16 h; std::memcpy(&h, &bits, 2); return (float)h; }
template <bool IN_BF16>
static inline float wide_to_float(unsigned short bits) { return IN_BF16 ? bf16_to_float(bits) : f16_to_float(bits); }
template <bool OUT_BF16>
static inline unsigned int float2_to_wide2(float lo, float hi) {
    return OUT_BF16 ? (float_to_bf16(lo) | ((unsigned)float_to_bf16(hi) << 16))
                    : (float_to_f16(lo) | ((unsigned)float_to_f16(hi) << 16));
}
template <bool E4M3>
static inline unsigned int float2_to_fp8x2(float lo, float hi) { return fp8_encode(lo, E4M3) | (fp8_encode(hi, E4M3) << 8); }
template <bool E4M3>
static inline void fp8x2_to_float2(unsigned int two_bytes, float& lo, float& hi) {
    lo = fp8_decode(two_bytes & 0xFFu, E4M3);
    hi = fp8_decode((two_bytes >> 8) & 0xFFu, E4M3);
}
"""

# Argument lists of the three kernel families, as C casts of 8-byte slots (float: slot 18).
SIGNATURES = {
    "copy_pages_": ["const unsigned char*", "unsigned char*", "const long long*", "const long long*"] + ["long long"] * 7,
    "upcast_pages_": ["const unsigned char*", "const unsigned char*", "unsigned short*", "const long long*", "const long long*"]
    + ["long long"] * 10,
    "quantize_pages_": ["const unsigned short*", "unsigned char*", "unsigned char*", "const long long*", "const long long*"]
    + ["long long"] * 13
    + ["float"],
}


def emulator_source() -> str:
    copy_src = native.source("page_copy")
    convert_src = native.source("page_convert")
    start = convert_src.index("__device__ __forceinline__ float f16_to_float")
    end = convert_src.index("// ---- reload")
    convert_src = convert_src[:start] + HOST_CONVERSIONS + convert_src[end:]
    # Both files define the block size and unroll; each body keeps its own unroll.
    convert_src = convert_src.replace("#define KVTIER_THREADS 256", "").replace(
        "#define KVTIER_UNROLL 2", "#undef KVTIER_UNROLL\n#define KVTIER_UNROLL 2"
    )
    kernels = re.findall(r"^KVTIER_\w+_KERNEL\((\w+),", copy_src + convert_src, flags=re.M)
    lines = [
        'extern "C" int emulate(const char* name, int blocks, const uint64_t* slot) {',
        "    float real;",
        "    std::memcpy(&real, &slot[18], 4);",
    ]
    for kernel in kernels:
        types = next(t for prefix, t in SIGNATURES.items() if kernel.startswith(prefix))
        args = ", ".join("real" if t == "float" else f"({t})slot[{i}]" for i, t in enumerate(types))
        lines.append(f'    if (!std::strcmp(name, "{kernel}")) {{ run_grid({kernel}, blocks, {args}); return 0; }}')
    lines.append("    return 1;\n}")
    return HOST_PRELUDE + copy_src + convert_src + "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    if CXX is None:
        pytest.skip("no C++ compiler to emulate the kernels with")
    build = tmp_path_factory.mktemp("kernel_emulation")
    source, library = build / "emulated_kernels.cpp", build / "libemulated_kernels.so"
    source.write_text(emulator_source())
    result = subprocess.run(
        [CXX, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w", str(source), "-o", str(library)],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0 and ("barrier" in result.stderr or "_Float16" in result.stderr):
        pytest.skip(f"{CXX} lacks C++20 <barrier> or _Float16: {result.stderr[-300:]}")
    assert result.returncode == 0, result.stderr[-4000:]
    lib = ctypes.CDLL(str(library))
    lib.emulate.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_uint64)]
    return lib


def emulated_engine(lib, dev, host, max_blocks: int) -> CudaEngine:
    """A CudaEngine whose kernel launches run on the emulator, over CPU tiers."""
    engine = object.__new__(CudaEngine)
    engine.device_tier, engine.host_tier, engine.fmt = dev, host, dev.fmt
    engine.max_blocks, engine.sm_count = max_blocks, 132
    engine._host_device_pointer = host.buffer.data_ptr()  # on the CPU the host address is the address
    engine.kernels = set()

    def launch(stream, module, name, blocks_wanted, args):
        blocks = max(1, min(blocks_wanted, engine.max_blocks))
        slots = (ctypes.c_uint64 * 19)()
        for i, value in enumerate(args):
            if isinstance(value, np.float32):
                slots[18] = int(np.array([value], dtype=np.float32).view(np.uint32)[0])
            else:
                slots[i] = int(np.array([value]).view(np.uint64)[0])
        assert lib.emulate(name.encode(), blocks, slots) == 0, f"no emulated kernel {name}"
        engine.kernels.add(name)
        engine.last_launch = LaunchShape(name, blocks, 256, min(blocks, engine.sm_count))

    engine._launch = launch
    return engine


def _staged(first: np.ndarray, second: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.stack([first, second]).astype(np.int64))


@pytest.mark.parametrize("max_blocks", [1, 3])
@pytest.mark.parametrize("fmt", PASSTHROUGH + CONVERTING, ids=lambda f: f.describe())
def test_emulated_kernels_match_torch_engine(emulator, fmt: PageFormat, max_blocks: int) -> None:
    gen = torch.Generator().manual_seed(max_blocks)
    dev, host = _cpu_tiers(fmt, gen)
    ref_dev, ref_host = _clone(dev, host)
    engine = emulated_engine(emulator, dev, host, max_blocks)
    rng = np.random.default_rng(max_blocks)
    count = 9
    dslots, hslots = rng.permutation(dev.num_pages)[:count], rng.permutation(host.num_pages)[:count]
    engine._kernel_offload(None, _staged(dslots, hslots), count)
    TorchEngine(ref_dev, ref_host).offload(dslots.tolist(), hslots.tolist())
    assert torch.equal(host.buffer, ref_host.buffer), f"offload through {sorted(engine.kernels)}"

    dslots, hslots = rng.permutation(dev.num_pages)[:count], rng.permutation(host.num_pages)[:count]
    for layer in range(fmt.num_layers):
        engine._kernel_reload_layer(None, _staged(dslots, hslots), count, layer)
    TorchEngine(ref_dev, ref_host).reload(hslots.tolist(), dslots.tolist())
    assert torch.equal(dev.kv.view(torch.uint8), ref_dev.kv.view(torch.uint8)), f"reload through {sorted(engine.kernels)}"
    if dev.scales is not None:
        assert torch.equal(dev.scales, ref_dev.scales)

    # device_copy's kernel branch: the same launches over device-to-device strides.
    src, dst = rng.permutation(dev.num_pages)[: 2 * count // 3].reshape(2, -1)
    for copy in passthrough_copies(fmt, dev.num_pages, range(fmt.num_layers), "device"):
        base = engine._device_base(copy)
        engine._launch_copy(None, copy, base, base, torch.from_numpy(src), torch.from_numpy(dst), src.size)
    TorchEngine(ref_dev, ref_host).device_copy(src.tolist(), dst.tolist())
    assert torch.equal(dev.kv.view(torch.uint8), ref_dev.kv.view(torch.uint8)), "device copy"
    if dev.scales is not None:
        assert torch.equal(dev.scales, ref_dev.scales)
    assert engine.last_launch.blocks <= max_blocks
