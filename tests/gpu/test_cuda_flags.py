"""The kernel path's one-launch transfers on a real GPU: engine-owned KV, per-layer flags, failed pages.

Each transfer is one launch that signals layer by layer through pinned flags. These tests
check, against TorchEngine over CPU twins holding the same bytes (destinations poisoned):
engine-owned device tensors (stacked, per-layer lists, vLLM-style interleaved K/V) on every
path; that a reader on another stream ordered by wait_layer(i) alone sees layer i complete
while later layers of a large transfer may still be landing; many transfers in flight on
one lane, tickets dropped before done; and pages holding NaN or infinity reported by
failed_positions() while the rest of the batch is encoded. Skipped without CUDA.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.format import PageFormat
from kvtier.tiers import DeviceTier, HostTier
from kvtier.transfer import TorchEngine, native
from kvtier.transfer.cuda import driver as cuda_driver
from kvtier.transfer.cuda.copy_engine_path import batch_memcpy_runtime
from kvtier.transfer.cuda_engine import CudaEngine
from tests.gpu.random_tiers import fill_random

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HAS_KERNELS = torch.cuda.is_available() and native.kernels_available() and cuda_driver.available()
HAS_COPY_ENGINE = torch.cuda.is_available() and batch_memcpy_runtime() is not None
CAN_CONVERT = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
needs_kernels = pytest.mark.skipif(not (HAS_KERNELS and CAN_CONVERT), reason="kernel path needs NVRTC, cuda-bindings, sm_89+")
PAGES = 24


def _owned(fmt: PageFormat, layout: str, device: str, pages: int = PAGES):
    """(kv, scales) an engine would hand over, in `layout`, on `device` (see test_engine_owned_kv)."""
    dtype, planes = fmt.device_torch_dtype, fmt.planes
    if layout == "stacked":
        given = [torch.empty((fmt.num_layers, pages, *fmt.plane_shape), dtype=dtype, device=device) for _ in range(planes)]
    elif layout == "lists":
        given = [[torch.empty((pages, *fmt.plane_shape), dtype=dtype, device=device) for _ in range(fmt.num_layers)] for _ in range(planes)]
    else:
        blocks = [torch.empty((pages, planes, *fmt.plane_shape), dtype=dtype, device=device) for _ in range(fmt.num_layers)]
        given = [[blocks[layer][:, p] for layer in range(fmt.num_layers)] for p in range(planes)]
    scales = None
    if fmt.device_has_scales:
        per = [[torch.empty((pages, *fmt.scale_shape), device=device) for _ in range(fmt.num_layers)] for _ in range(planes)]
        scales = (per[0], None) if fmt.mla else (per[0], per[1])
    return ((given[0], None) if fmt.mla else (given[0], given[1])), scales


def _state(dev: DeviceTier) -> torch.Tensor:
    fmt = dev.fmt
    parts = [dev.raw_plane(l, p).cpu().reshape(-1) for l in range(fmt.num_layers) for p in range(fmt.planes)]
    if dev.has_scales:
        parts += [dev.scale_plane(l, p).cpu().reshape(-1).view(torch.uint8) for l in range(fmt.num_layers) for p in range(fmt.planes)]
    return torch.cat(parts)


def _twins(fmt: PageFormat, layout: str, seed: int):
    """GPU tiers over engine-owned tensors and CPU twins with the same bytes."""
    gen = torch.Generator().manual_seed(seed)
    cpu_dev = DeviceTier(fmt, *_owned_args(fmt, layout, "cpu"))
    cpu_host = HostTier(fmt, 32, pin=False)
    fill_random(cpu_dev, cpu_host, gen)
    dev = DeviceTier(fmt, *_owned_args(fmt, layout, "cuda"))
    for layer in range(fmt.num_layers):
        for plane in range(fmt.planes):
            dev.plane(layer, plane).copy_(cpu_dev.plane(layer, plane))
            if dev.has_scales:
                dev.scale_plane(layer, plane).copy_(cpu_dev.scale_plane(layer, plane))
    host = HostTier(fmt, 32, pin=True)
    host.buffer.copy_(cpu_host.buffer)
    torch.cuda.synchronize()
    return dev, host, cpu_dev, cpu_host


def _owned_args(fmt, layout, device):
    kv, scales = _owned(fmt, layout, device)
    return None, None, kv, scales


OWNED_FORMATS = [
    PageFormat(3, 2, 64, 8, dtype="fp8_e4m3", scale="per_page_head"),
    PageFormat(2, 2, 128, 8, dtype="fp8_e4m3", scale="per_token_head", device_dtype="bf16"),
    PageFormat(2, 1, 576, 4, mla=True),
]


@pytest.mark.parametrize("path", ["kernel", "copy_engine", "torch"])
@pytest.mark.parametrize("layout", ["stacked", "lists", "interleaved"])
@pytest.mark.parametrize("fmt", OWNED_FORMATS, ids=lambda f: f.describe())
def test_engine_owned_tensors_on_every_path(fmt: PageFormat, layout: str, path: str) -> None:
    if path == "kernel" and not (HAS_KERNELS and CAN_CONVERT):
        pytest.skip("kernel path needs NVRTC, cuda-bindings and sm_89+")
    if path == "copy_engine" and (fmt.converts or not HAS_COPY_ENGINE):
        pytest.skip("copy engines move bytes as they are (and need cuda-bindings >= 12.8)")
    dev, host, cpu_dev, cpu_host = _twins(fmt, layout, seed=len(layout))
    engine = CudaEngine(dev, host, path=path)
    rng = np.random.default_rng(1)
    dslots, hslots = rng.permutation(PAGES)[:10].tolist(), rng.permutation(32)[:10].tolist()
    engine.offload(dslots, hslots, ready=engine.record_ready()).synchronize()
    TorchEngine(cpu_dev, cpu_host).offload(dslots, hslots)
    if not (fmt.converts and path == "torch"):  # the torch path quantizes on the GPU: checked elsewhere
        assert torch.equal(host.buffer[hslots], cpu_host.buffer[hslots]), f"{path} offload from {layout} tensors"
    dslots = rng.permutation(PAGES)[:10].tolist()
    for layer in range(fmt.num_layers):
        for plane in range(fmt.planes):
            dev.raw_plane(layer, plane)[dslots] = 0xFF
    ticket = engine.reload(hslots[::-1], dslots, ready=engine.record_ready())
    ticket.wait()
    TorchEngine(cpu_dev, cpu_host).reload(hslots[::-1], dslots)
    assert torch.equal(_state(dev), _state(cpu_dev)), f"{path} reload into {layout} tensors"
    engine.close()
    host.close()


@needs_kernels
def test_reader_on_another_stream_sees_each_layer_after_wait_layer() -> None:
    """A 192 MiB reload; a side stream reads layer i right after wait_layer(i), 5 times over."""
    fmt = PageFormat(12, 8, 128, 64)  # 128 KiB planes, 256 KiB per layer of a page
    pages = 64
    dev, host = DeviceTier(fmt, pages, "cuda"), HostTier(fmt, pages, pin=True)
    host.buffer.copy_(torch.randint(0, 256, host.buffer.shape, dtype=torch.uint8))
    expected = [[host.raw_plane(layer, plane).clone() for plane in range(2)] for layer in range(fmt.num_layers)]
    engine = CudaEngine(dev, host, path="kernel")
    side = torch.cuda.Stream()
    order = list(range(pages))[::-1]
    for trial in range(5):
        torch.cuda.synchronize()
        dev.kv.view(torch.uint8).fill_(0xFF)
        torch.cuda.synchronize()
        ticket = engine.reload(order, list(range(pages)))
        seen = []
        with torch.cuda.stream(side):
            for layer in range(fmt.num_layers):
                ticket.wait_layer(layer)
                seen.append([dev.raw_plane(layer, plane).clone() for plane in range(2)])
        side.synchronize()
        assert ticket.done()
        for layer in range(fmt.num_layers):
            for plane in range(2):
                got = seen[layer][plane].cpu()
                assert torch.equal(got, expected[layer][plane][order]), f"trial {trial}: layer {layer} read before it landed"
    engine.close()
    host.close()


@needs_kernels
def test_many_transfers_in_flight_and_dropped_tickets() -> None:
    fmt = PageFormat(4, 2, 64, 16)
    pages = 256
    dev, host = DeviceTier(fmt, pages, "cuda"), HostTier(fmt, pages, pin=True)
    host.buffer.copy_(torch.randint(0, 256, host.buffer.shape, dtype=torch.uint8))
    engine = CudaEngine(dev, host, path="kernel")
    dev.kv.view(torch.uint8).fill_(0xFF)
    tickets = [engine.reload([i], [pages - 1 - i]) for i in range(pages)]  # 256 launches queued at once
    kept = [t for i, t in enumerate(tickets) if i % 3]
    del tickets  # a third dropped before done: their slot buffers must outlive their launches
    more = [engine.reload([i], [pages - 1 - i]) for i in range(0, pages, 5)]  # reuses recycled buffers
    for ticket in kept + more:
        ticket.synchronize()
    torch.cuda.synchronize()
    for layer in range(fmt.num_layers):
        for plane in range(2):
            assert torch.equal(dev.raw_plane(layer, plane).cpu(), host.raw_plane(layer, plane).flip(0)), f"layer {layer}"
    lane = engine.reload_lane
    assert int(lane.flags[fmt.num_layers]) == lane.seq == pages + len(more)
    assert not lane.counters.any().item(), "every launch leaves its counters at zero"
    engine.close()
    host.close()


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_offload_reports_pages_with_nan_or_inf(path: str) -> None:
    if path == "kernel" and not (HAS_KERNELS and CAN_CONVERT):
        pytest.skip("kernel path needs NVRTC, cuda-bindings and sm_89+")
    fmt = PageFormat(3, 2, 128, 16, dtype="fp8_e4m3", scale="per_token_head", device_dtype="bf16")
    dev, host = DeviceTier(fmt, 16, "cuda"), HostTier(fmt, 16, pin=True)
    cpu_dev, cpu_host = DeviceTier(fmt, 16, "cpu"), HostTier(fmt, 16, pin=False)
    fill_random(cpu_dev, cpu_host, torch.Generator().manual_seed(3))
    cpu_dev.plane(2, 1)[5].view(-1)[100] = float("nan")
    cpu_dev.plane(0, 0)[9].view(-1)[0] = float("inf")
    dev.kv.copy_(cpu_dev.kv)
    host.buffer.copy_(cpu_host.buffer)
    engine = CudaEngine(dev, host, path=path)
    dslots, hslots = [1, 5, 7, 9, 12], [0, 3, 6, 9, 12]
    ticket = engine.offload(dslots, hslots, ready=engine.record_ready())
    ticket.synchronize()
    assert ticket.failed_positions() == [1, 3]
    twin = TorchEngine(cpu_dev, cpu_host).offload(dslots, hslots)
    assert twin.failed_positions() == [1, 3]
    if path == "kernel":  # the torch path quantizes with the codec on the GPU, not bit-matched to the CPU
        good = [0, 6, 12]
        assert torch.equal(host.buffer[good], cpu_host.buffer[good])
    again = engine.offload([1, 7], [2, 4], ready=engine.record_ready())
    again.synchronize()
    assert again.failed_positions() == []  # the marks of the previous transfer do not leak into this one
    engine.close()
    host.close()


@needs_kernels
def test_a_failing_launch_names_its_kernel() -> None:
    """The launch path builds no message unless the launch fails; then it names the kernel."""
    from kvtier.transfer.cuda.plans import THREADS

    fmt = PageFormat(2, 2, 64, 16)
    dev, host = DeviceTier(fmt, 8, "cuda"), HostTier(fmt, 8, pin=True)
    engine = CudaEngine(dev, host, path="kernel")
    engine.reload([0], [1]).synchronize()  # compiles and loads the reload kernel
    name, function = next(iter(engine._functions.items()))
    with pytest.raises(RuntimeError, match=f"cuLaunchKernel of {name}"):
        engine.driver.launch(function, 0, THREADS, engine.reload_lane.cu_stream, 0, name)  # an empty grid is invalid
    engine.reload([1], [2]).synchronize()  # the engine still works after the refused launch
    torch.cuda.synchronize()
    assert torch.equal(dev.raw_plane(0, 0)[2].cpu(), host.raw_plane(0, 0)[1])
    engine.close()
    host.close()
