"""One small run of every CUDA engine kernel, for compute-sanitizer (memcheck, racecheck).

Each format below selects different kernels of native/: copy widths 16/8/4/2/1 bytes,
fused upcast and quantize with 16 and 1 elements per thread, e4m3 and e5m2, bf16 and fp16,
nhd and hnd, MLA, and device-to-device copies, each as one all-layer launch with its flags
and counters. The extra cases run engine-owned interleaved K/V, a quantize that refuses a
NaN page, per-layer launches (a reload with a user transform) and the staged reload. Every copy is checked against TorchEngine
on CPU twins, so a kernel that runs clean but writes wrong bytes still fails. Run it as
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python tests/gpu/sanitize_case.py
(without the caching allocator every tensor is its own allocation, so memcheck sees an
access one byte past a tensor). Exits non-zero on a mismatch; it is not a pytest module.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvtier.format import PageFormat  # noqa: E402
from kvtier.tiers import DeviceTier, HostTier  # noqa: E402
from kvtier.transfer import TorchEngine  # noqa: E402
from kvtier.transfer.cuda_engine import CudaEngine  # noqa: E402
from tests.gpu.random_tiers import fill_random  # noqa: E402

FORMATS = [
    PageFormat(2, 2, 64, 4),  # copy w16
    PageFormat(1, 3, 24, 3, dtype="fp8_e4m3", scale="per_token_head"),  # w8 data, w4 scales
    PageFormat(2, 1, 37, 3, dtype="fp16", layout="hnd"),  # w2
    PageFormat(1, 1, 7, 3, dtype="fp8_e5m2", allow_unscaled_fp8=True),  # w1
    PageFormat(2, 1, 576, 2, mla=True),
    PageFormat(2, 2, 32, 4, dtype="fp8_e4m3", scale="per_page_head", device_dtype="bf16"),  # v16
    PageFormat(2, 2, 32, 4, dtype="fp8_e5m2", scale="per_tensor", layout="hnd", device_dtype="fp16"),
    PageFormat(2, 3, 24, 3, dtype="fp8_e4m3", scale="per_token_head", device_dtype="fp16"),  # v1
    PageFormat(2, 2, 8, 3, dtype="fp8_e5m2", scale="per_page_head", device_dtype="bf16"),  # v1, strided groups
]
DEVICE_PAGES, HOST_PAGES = 10, 12


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().contiguous().view(-1).view(torch.uint8), b.cpu().contiguous().view(-1).view(torch.uint8))


def run(fmt: PageFormat) -> list[str]:
    gen = torch.Generator().manual_seed(3)
    cpu_dev, cpu_host = DeviceTier(fmt, DEVICE_PAGES, "cpu"), HostTier(fmt, HOST_PAGES, pin=False)
    fill_random(cpu_dev, cpu_host, gen)
    dev, host = DeviceTier(fmt, DEVICE_PAGES, "cuda"), HostTier(fmt, HOST_PAGES, pin=True)
    dev.kv.copy_(cpu_dev.kv)
    if dev.scales is not None:
        dev.scales.copy_(cpu_dev.scales)
    host.buffer.copy_(cpu_host.buffer)
    engine, twin = CudaEngine(dev, host, path="kernel"), TorchEngine(cpu_dev, cpu_host)
    failures = []
    # The last device and host slots take part, so an access past a tier's end shows.
    engine.offload([9, 0, 4], [11, 3, 0], ready=engine.record_ready()).synchronize()
    twin.offload([9, 0, 4], [11, 3, 0])
    if not same(host.buffer, cpu_host.buffer):
        failures.append("offload")
    engine.reload([2, 11, 7], [9, 1, 5]).synchronize()
    twin.reload([2, 11, 7], [9, 1, 5])
    if not same(dev.kv, cpu_dev.kv) or (dev.scales is not None and not same(dev.scales, cpu_dev.scales)):
        failures.append("reload")
    engine.device_copy([9, 1], [0, 8]).synchronize()
    twin.device_copy([9, 1], [0, 8])
    if not same(dev.kv, cpu_dev.kv):
        failures.append("device_copy")
    engine.close()
    host.close()
    cpu_host.close()
    return failures


def run_extra() -> list[str]:
    failures = []
    fmt = PageFormat(2, 2, 32, 4, dtype="fp8_e4m3", scale="per_page_head")
    blocks = [torch.empty((DEVICE_PAGES, 2, *fmt.plane_shape), dtype=fmt.device_torch_dtype, device="cuda") for _ in range(2)]
    kv = ([b[:, 0] for b in blocks], [b[:, 1] for b in blocks])
    scales = tuple([torch.rand(DEVICE_PAGES, 2, device="cuda") + 0.5 for _ in range(2)] for _ in range(2))
    dev, host = DeviceTier(fmt, kv=kv, scales=scales), HostTier(fmt, HOST_PAGES, pin=True)
    for b in blocks:
        b.view(torch.uint8).copy_(torch.randint(0, 120, b.shape, dtype=torch.uint8))
    engine = CudaEngine(dev, host, path="kernel")
    engine.offload([9, 0, 4], [11, 3, 0], ready=engine.record_ready()).synchronize()
    engine.reload([11, 3, 0], [1, 2, 3]).synchronize()
    engine.device_copy([1, 2], [8, 9]).synchronize()
    if not torch.equal(dev.raw_plane(1, 1)[[8, 9]], dev.raw_plane(1, 1)[[1, 2]]):
        failures.append("engine-owned round trip")
    engine.close()
    host.close()

    fmt = PageFormat(2, 2, 32, 4, dtype="fp8_e4m3", scale="per_token_head", device_dtype="bf16")
    dev, host = DeviceTier(fmt, DEVICE_PAGES, "cuda"), HostTier(fmt, HOST_PAGES, pin=True)
    dev.kv.uniform_(-2, 2)
    dev.kv[1, 0, 4, 0, 0, 0] = float("nan")
    engine = CudaEngine(dev, host, path="kernel")
    ticket = engine.offload([9, 4, 0], [11, 3, 0], ready=engine.record_ready())
    ticket.synchronize()
    if ticket.failed_positions() != [1]:
        failures.append(f"nan page reported as {ticket.failed_positions()}")
    engine.close()
    engine = CudaEngine(dev, host, transform=lambda layer, plane, pages, slots: None, path="kernel")
    engine.reload([11, 0], [2, 5]).synchronize()  # per-layer launches
    engine.close()
    engine = CudaEngine(dev, host, path="staged")
    engine.reload([11, 0, 3], [2, 5, 9]).synchronize()
    engine.close()
    host.close()
    return failures


def main() -> int:
    if not torch.cuda.is_available():
        print("sanitize_case: no CUDA device", file=sys.stderr)
        return 1
    bad = 0
    for fmt in FORMATS:
        failures = run(fmt)
        print(f"{'FAIL' if failures else 'ok  '} {fmt.describe()} {' '.join(failures)}")
        bad += bool(failures)
    failures = run_extra()
    print(f"{'FAIL' if failures else 'ok  '} engine-owned, NaN page, per-layer, staged {' '.join(failures)}")
    bad += bool(failures)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
