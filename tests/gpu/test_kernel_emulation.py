"""The native/ kernels' own source, run on the CPU: every thread a host thread.

g++ compiles page_copy.cu and page_convert.cu (with page_signal.cu inlined, as NVRTC gets
them) as C++ with CUDA's built-ins defined on the host: threadIdx/blockIdx per host thread,
every block's 256 threads run at once, __syncthreads is a block barrier, warp shuffles
exchange values through a per-warp barrier, atomicAdd is an atomic fetch-add and the fences
are sequentially consistent fences. The inline-PTX conversions (the span of page_convert.cu
from `f16_to_float` to the reload section) are replaced by round-to-nearest-even
conversions that search every fp8 code. Kernels are launched through the engine's own
KernelPath (argument records, chunk counts, grids) and StreamLane over CPU tiers, and
compared byte for byte with TorchEngine. A watcher thread polls the lane's flags while the
blocks run and snapshots a layer's destination bytes the moment its flag reaches the
transfer's sequence number: a flag raised before its layer's bytes are all there shows as a
poisoned byte in the snapshot. What this proves: indexing, strides, vector packing, scale
groups, team reductions, the chunk walk, the counters and flags. What it cannot: the PTX
conversions and the GPU's memory ordering, which tests/gpu/test_cuda_engine.py checks on a GPU.
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
from test_engine_owned_kv import engine_tensors

from kvtier.format import PageFormat
from kvtier.tiers import DeviceTier, HostTier
from kvtier.transfer import TorchEngine, native
from kvtier.transfer.cuda import plans
from kvtier.transfer.cuda.kernel_path import KernelPath
from kvtier.transfer.cuda.tickets import FlagTicket, StreamLane
from tests.conftest import cpu_lane
from tests.gpu.random_tiers import fill_random

CXX = shutil.which("g++") or shutil.which("clang++")

HOST_PRELUDE = r"""
#include <atomic>
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
struct BlockSync {
    std::barrier<> block{256};
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    float lanes[8][32];
    BlockSync() { for (int w = 0; w < 8; ++w) warps.emplace_back(new std::barrier<>(32)); }
};
thread_local BlockSync* block_sync;
static inline void __syncthreads() { block_sync->block.arrive_and_wait(); }
static inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
static inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }
static inline int atomicAdd(int* address, int value) { return __atomic_fetch_add(address, value, __ATOMIC_SEQ_CST); }
static inline float __shfl_xor_sync(unsigned, float value, int offset) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    block_sync->lanes[warp][lane] = value;
    block_sync->warps[warp]->arrive_and_wait();
    const float got = block_sync->lanes[warp][lane ^ offset];
    block_sync->warps[warp]->arrive_and_wait();
    return got;
}
template <typename Kernel, typename Args>
static void run_grid(Kernel kernel, int blocks, const Args& args) {
    gridDim.x = blocks;
    blockDim.x = 256;
    std::vector<std::unique_ptr<BlockSync>> syncs;
    for (int block = 0; block < blocks; ++block) syncs.emplace_back(new BlockSync());
    std::vector<std::thread> threads;
    for (int block = 0; block < blocks; ++block)
        for (int t = 0; t < 256; ++t)
            threads.emplace_back([&, block, t] {
                blockIdx.x = block; threadIdx.x = t; block_sync = syncs[block].get(); kernel(args);
            });
    for (auto& thread : threads) thread.join();
}
// Polls flags[0..layers] while the grid runs; when flags[i] first reaches seq it copies the
// regions of layer i (rows of layer, address, length, offset into out) and notes the order.
static void watch(volatile int* flags, int layers, unsigned seq, const long long* regions, int count,
                  unsigned char* out, int* order, std::atomic<bool>* stop) {
    std::vector<bool> seen(layers + 1, false);
    int noted = 0;
    std::vector<bool> fresh(layers + 1);
    for (;;) {
        const bool last_pass = stop->load();
        // Last flag first: the kernel stores flags[layers] after every layer's flag, so a pass
        // that sees it also sees them, and notes them before it.
        for (int i = layers; i >= 0; --i)
            fresh[i] = !seen[i] && (int)((unsigned)flags[i] - seq) >= 0;
        for (int i = 0; i <= layers; ++i) {
            if (!fresh[i]) continue;
            seen[i] = true;
            order[noted++] = i;
            for (int r = 0; r < count; ++r)
                if (regions[4 * r] == i)
                    std::memcpy(out + regions[4 * r + 3], (const void*)regions[4 * r + 1], regions[4 * r + 2]);
        }
        if (noted == layers + 1 || last_pass) return;
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

FAMILIES = {"copy_": "CopyArgs", "upcast_": "UpcastArgs", "quantize_": "QuantizeArgs"}


def emulator_source() -> str:
    copy_src = native.source("page_copy")
    convert_src = native.source("page_convert")
    start = convert_src.index("__device__ __forceinline__ float f16_to_float")
    end = convert_src.index("// ---- reload")
    convert_src = convert_src[:start] + HOST_CONVERSIONS + convert_src[end:]
    kernels = re.findall(r"^KVTIER_\w+_KERNEL\((\w+),", copy_src + convert_src, flags=re.M)
    lines = [
        'extern "C" int emulate(const char* name, int blocks, const void* raw, int* flags, int layers, unsigned seq,',
        "                       const long long* regions, int count, unsigned char* out, int* order) {",
        "    std::atomic<bool> stop{false};",
        "    std::thread watcher;",
        "    if (flags) watcher = std::thread(watch, flags, layers, seq, regions, count, out, order, &stop);",
        "    int found = 1;",
    ]
    for kernel in kernels:
        struct = next(s for prefix, s in FAMILIES.items() if kernel.startswith(prefix))
        lines.append(
            f'    if (!std::strcmp(name, "{kernel}")) {{ {struct} a; std::memcpy(&a, raw, sizeof a); '
            f"run_grid({kernel}, blocks, a); found = 0; }}"
        )
    lines += ["    stop = true;", "    if (watcher.joinable()) watcher.join();", "    return found;", "}"]
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
    lib.emulate.argtypes = [
        ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint,
        ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
    ]
    return lib


class Emulated:
    """A KernelPath and three StreamLanes over CPU tiers whose launches run on the emulator.

    `watch` (a list of (layer, address, length)) makes the next signalled launch snapshot
    those bytes the moment each layer's flag lands; `snapshot` and `order` hold the result.
    """

    def __init__(self, lib, dev: DeviceTier, host: HostTier, max_blocks: int) -> None:
        self.lib, self.fmt = lib, dev.fmt
        self.table = plans.device_table(dev)
        self.table_tensor = torch.from_numpy(self.table)  # the kernels read it where it lies
        self.path = KernelPath(dev.fmt, self.table, self.table_tensor.data_ptr(), host.buffer.data_ptr(), self.launch, max_blocks, 132)
        self.lanes = {op: self.lane() for op in ("offload", "reload", "device")}
        self.kernels: set[str] = set()
        self.watch: list[tuple[int, int, int]] = []
        self.snapshot = b""
        self.order: list[int] = []

    def lane(self) -> StreamLane:
        return cpu_lane(self.fmt.num_layers)

    def launch(self, launch, blocks: int, lane: StreamLane) -> None:
        at = launch.index
        signalled = launch.args[at["flags"]] != 0
        regions = np.zeros((max(1, len(self.watch)), 4), dtype=np.int64)
        total = 0
        for i, (layer, address, length) in enumerate(self.watch):
            regions[i] = (layer, address, length, total)
            total += length
        out = np.zeros(max(1, total), dtype=np.uint8)
        order = np.full(self.fmt.num_layers + 1, -1, dtype=np.int32)
        seq = int(launch.args[at["seq"]]) & 0xFFFFFFFF
        flags = lane.flags_tensor.data_ptr() if signalled and self.watch else None
        code = self.lib.emulate(
            launch.name.encode(), blocks, launch.args.ctypes.data, flags, self.fmt.num_layers, seq,
            regions.ctypes.data, len(self.watch), out.ctypes.data, order.ctypes.data,
        )
        assert code == 0, f"no emulated kernel {launch.name}"
        self.kernels.add(launch.name)
        self.snapshot, self.order = out[:total].tobytes(), order.tolist()
        self.watch = []

    def transfer(self, op: str, src, dst) -> FlagTicket:
        """What CudaEngine's kernel path does for one transfer, on the lane of `op`."""
        lane, count = self.lanes[op], len(src)
        with lane.lock:
            buffer = lane.buffer(count)
            buffer.src[:count] = src
            buffer.dst[:count] = dst
            buffer.failed[:count] = 0
            seq = lane.next_seq()
            self.path.submit(op, lane, buffer, count, seq)
        return FlagTicket(lane, seq, buffer, count, op == "offload" and self.fmt.converts, torch.device("cpu"))


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _device_state(dev: DeviceTier) -> bytes:
    fmt = dev.fmt
    out = [_bytes(dev.raw_plane(layer, plane)) for layer in range(fmt.num_layers) for plane in range(fmt.planes)]
    if dev.has_scales:
        out += [_bytes(dev.scale_plane(layer, plane)) for layer in range(fmt.num_layers) for plane in range(fmt.planes)]
    return b"".join(out)


def _assert_lane_idle(emulated: Emulated, ticket: FlagTicket) -> None:
    """After a launch: every flag reached the ticket's sequence number and every counter is back to 0."""
    for lane in emulated.lanes.values():
        assert not lane.counters.any(), f"counters left at {lane.counters.tolist()}"
    assert ticket.done()


@pytest.mark.parametrize("max_blocks", [1, 3])
@pytest.mark.parametrize("fmt", PASSTHROUGH + CONVERTING, ids=lambda f: f.describe())
def test_emulated_kernels_match_torch_engine(emulator, fmt: PageFormat, max_blocks: int) -> None:
    gen = torch.Generator().manual_seed(max_blocks)
    dev, host = _cpu_tiers(fmt, gen)
    ref_dev, ref_host = _clone(dev, host)
    emulated = Emulated(emulator, dev, host, max_blocks)
    rng = np.random.default_rng(max_blocks)
    count = 9
    dslots, hslots = rng.permutation(dev.num_pages)[:count], rng.permutation(host.num_pages)[:count]
    ticket = emulated.transfer("offload", dslots, hslots)
    _assert_lane_idle(emulated, ticket)
    assert ticket.failed_positions() == []
    TorchEngine(ref_dev, ref_host).offload(dslots.tolist(), hslots.tolist())
    assert torch.equal(host.buffer, ref_host.buffer), f"offload through {sorted(emulated.kernels)}"

    dslots, hslots = rng.permutation(dev.num_pages)[:count], rng.permutation(host.num_pages)[:count]
    _assert_lane_idle(emulated, emulated.transfer("reload", hslots, dslots))
    TorchEngine(ref_dev, ref_host).reload(hslots.tolist(), dslots.tolist())
    assert _device_state(dev) == _device_state(ref_dev), f"reload through {sorted(emulated.kernels)}"

    src, dst = rng.permutation(dev.num_pages)[: 2 * count // 3].reshape(2, -1)
    _assert_lane_idle(emulated, emulated.transfer("device", src, dst))
    TorchEngine(ref_dev, ref_host).device_copy(src.tolist(), dst.tolist())
    assert _device_state(dev) == _device_state(ref_dev), "device copy"
    assert emulated.path.last_launch.blocks <= max_blocks


ENGINE_OWNED = [
    PageFormat(2, 2, 16, 4, dtype="fp8_e4m3", scale="per_page_head"),
    PageFormat(2, 2, 32, 4, dtype="fp8_e4m3", scale="per_token_head", device_dtype="bf16"),
    PageFormat(3, 1, 40, 2, mla=True),
]


@pytest.mark.parametrize("layout", ["lists", "interleaved"])
@pytest.mark.parametrize("fmt", ENGINE_OWNED, ids=lambda f: f.describe())
def test_emulated_kernels_over_engine_owned_tensors(emulator, fmt: PageFormat, layout: str) -> None:
    gen = torch.Generator().manual_seed(5)
    kv, scales, _, _ = engine_tensors(fmt, layout)
    dev, host = DeviceTier(fmt, kv=kv, scales=scales), HostTier(fmt, 16, pin=False)
    fill_random(dev, host, gen)
    ref_dev, ref_host = _clone(dev, host)
    emulated = Emulated(emulator, dev, host, 2)
    dslots, hslots = np.array([3, 0, 7, 11, 5]), np.array([9, 2, 15, 4, 1])
    emulated.transfer("offload", dslots, hslots).synchronize()
    TorchEngine(ref_dev, ref_host).offload(dslots.tolist(), hslots.tolist())
    assert torch.equal(host.buffer, ref_host.buffer)
    emulated.transfer("reload", hslots[::-1].copy(), np.array([1, 2, 4, 6, 10])).synchronize()
    TorchEngine(ref_dev, ref_host).reload(hslots[::-1].tolist(), [1, 2, 4, 6, 10])
    assert _device_state(dev) == _device_state(ref_dev)


def _poison_device(dev: DeviceTier, slots) -> None:
    fmt = dev.fmt
    for layer in range(fmt.num_layers):
        for plane in range(fmt.planes):
            dev.raw_plane(layer, plane)[torch.as_tensor(slots)] = 0xFF
            if dev.has_scales:
                dev.scale_plane(layer, plane)[torch.as_tensor(slots)] = float("nan")


@pytest.mark.parametrize("fmt", [PageFormat(4, 2, 64, 8), CONVERTING[1], PASSTHROUGH[5]], ids=lambda f: f.describe())
def test_each_layer_flag_lands_with_its_bytes(emulator, fmt: PageFormat) -> None:
    """Back-to-back reloads and offloads on one lane, sequence numbers across 2**32: at the moment a
    layer's flag reaches seq, every byte of that layer is already in place (snapshots, poisoned before)."""
    gen = torch.Generator().manual_seed(17)
    dev, host = _cpu_tiers(fmt, gen, device_pages=24, host_pages=24)
    emulated = Emulated(emulator, dev, host, 3)
    for lane in emulated.lanes.values():
        lane.seq = 2**32 - 3  # as if 2**32 - 3 transfers had landed: the fourth from here wraps to 0
        lane.flags[:] = -3
    rng = np.random.default_rng(3)
    seqs = []
    for trial in range(5):
        hslots, dslots = rng.permutation(24)[:10], rng.permutation(24)[:10]
        ref_dev, ref_host = _clone(dev, host)
        TorchEngine(ref_dev, ref_host).reload(hslots.tolist(), dslots.tolist())
        _poison_device(dev, dslots)
        watch, expected = [], []
        for layer in range(fmt.num_layers):
            for plane in range(fmt.planes):
                raw, ref = dev.raw_plane(layer, plane), ref_dev.raw_plane(layer, plane)
                for slot in dslots.tolist():
                    watch.append((layer, raw[slot].data_ptr(), fmt.device_plane_bytes))
                    expected.append(_bytes(ref[slot]))
        emulated.watch = watch
        ticket = emulated.transfer("reload", hslots, dslots)
        seqs.append(ticket._seq)
        assert sorted(emulated.order) == list(range(fmt.num_layers + 1)), f"flags seen: {emulated.order}"
        assert emulated.order[-1] == fmt.num_layers, f"{emulated.order}: the transfer's flag must come after every layer's"
        assert emulated.snapshot == b"".join(expected), f"trial {trial}: a layer flag landed before its bytes"
        _assert_lane_idle(emulated, ticket)

        dslots, hslots = rng.permutation(24)[:6], rng.permutation(24)[:6]
        ref_dev, ref_host = _clone(dev, host)
        TorchEngine(ref_dev, ref_host).offload(dslots.tolist(), hslots.tolist())
        host.buffer[torch.as_tensor(hslots)] = 0xFF
        watch, expected = [], []
        for layer in range(fmt.num_layers):
            for plane in range(fmt.planes):
                for slot in hslots.tolist():
                    at = fmt.data_offset(layer, plane)
                    watch.append((layer, host.buffer[slot].data_ptr() + at, fmt.plane_elems * fmt.elem_bytes))
                    expected.append(_bytes(ref_host.buffer[slot, at : at + fmt.plane_elems * fmt.elem_bytes]))
        emulated.watch = watch
        ticket = emulated.transfer("offload", dslots, hslots)
        assert emulated.snapshot == b"".join(expected), f"trial {trial}: an offload flag landed before its bytes"
        _assert_lane_idle(emulated, ticket)
    assert seqs == [2**32 - 2, 2**32 - 1, 0, 1, 2]


@pytest.mark.parametrize("fmt", [CONVERTING[1], CONVERTING[3], CONVERTING[5]], ids=lambda f: f.describe())
def test_quantize_refuses_pages_with_nan_or_inf(emulator, fmt: PageFormat) -> None:
    gen = torch.Generator().manual_seed(23)
    dev, host = _cpu_tiers(fmt, gen)
    dslots, hslots = [4, 1, 9, 6, 0], [3, 8, 12, 0, 5]
    dev.plane(1, fmt.planes - 1)[1].view(-1)[7] = float("nan")
    dev.plane(0, 0)[6].view(-1)[-1] = float("-inf")
    ref_dev, ref_host = _clone(dev, host)
    emulated = Emulated(emulator, dev, host, 2)
    ticket = emulated.transfer("offload", dslots, hslots)
    assert ticket.failed_positions() == [1, 3]
    twin = TorchEngine(ref_dev, ref_host).offload(dslots, hslots)
    assert twin.failed_positions() == [1, 3]
    good = [h for i, h in enumerate(hslots) if i not in (1, 3)]
    assert torch.equal(host.buffer[good], ref_host.buffer[good]), "pages that encode must still match the codec"
    untouched = sorted(set(range(host.num_pages)) - set(hslots))
    assert torch.equal(host.buffer[untouched], ref_host.buffer[untouched])
