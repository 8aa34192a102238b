"""The CUDA engine's address arithmetic, checked on the CPU against TorchEngine.

The kernels in native/ only follow the strides cuda_engine computes from the PageFormat
(Region, PieceCopy, ScaleGroups). These tests replay those plans with numpy, exactly as the
kernels index memory, over CPU tiers and compare every byte with TorchEngine, so a wrong
offset, stride or scale group fails here, on a machine without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.format import FP8_MAX, PageFormat
from kvtier.tiers import DeviceTier, HostTier
from kvtier.transfer import TorchEngine
from kvtier.transfer.cuda_engine import (
    PieceCopy,
    convert_vector,
    copy_word_bytes,
    device_data_region,
    expand_copies,
    host_data_region,
    host_scale_region,
    merge_runs,
    passthrough_copies,
    scale_groups,
    slot_runs,
    team_size,
)
from tests.gpu.random_tiers import fill_random

PASSTHROUGH = [
    PageFormat(3, 2, 64, 16),
    PageFormat(2, 3, 37, 3, dtype="fp16", layout="hnd"),
    PageFormat(2, 1, 72, 4, mla=True),
    PageFormat(2, 2, 32, 4, dtype="fp8_e4m3", scale="per_tensor"),
    PageFormat(3, 3, 24, 3, dtype="fp8_e5m2", scale="per_page_head", layout="hnd"),
    PageFormat(2, 3, 24, 3, dtype="fp8_e4m3", scale="per_token_head"),
    PageFormat(2, 1, 40, 5, dtype="fp8_e4m3", scale="per_token_head", mla=True, layout="hnd"),
    PageFormat(2, 2, 16, 2, dtype="fp8_e4m3", allow_unscaled_fp8=True),
]
CONVERTING = [
    PageFormat(2, 2, 32, 4, dtype="fp8_e4m3", scale="per_tensor", device_dtype="bf16"),
    PageFormat(2, 3, 32, 4, dtype="fp8_e4m3", scale="per_page_head", device_dtype="bf16"),
    PageFormat(2, 3, 32, 4, dtype="fp8_e4m3", scale="per_page_head", layout="hnd", device_dtype="fp16"),
    PageFormat(2, 3, 16, 5, dtype="fp8_e5m2", scale="per_token_head", device_dtype="bf16"),
    PageFormat(2, 3, 16, 5, dtype="fp8_e5m2", scale="per_token_head", layout="hnd", device_dtype="fp16"),
    PageFormat(2, 3, 24, 3, dtype="fp8_e4m3", scale="per_token_head", device_dtype="bf16"),
    PageFormat(2, 3, 8, 4, dtype="fp8_e4m3", scale="per_page_head", device_dtype="bf16"),
    PageFormat(2, 1, 48, 3, dtype="fp8_e4m3", scale="per_token_head", mla=True, device_dtype="bf16"),
]


def _cpu_tiers(fmt: PageFormat, gen: torch.Generator, device_pages: int = 12, host_pages: int = 16):
    dev = DeviceTier(fmt, device_pages, "cpu")
    host = HostTier(fmt, host_pages, pin=False)
    fill_random(dev, host, gen)
    return dev, host


def _clone(dev: DeviceTier, host: HostTier):
    dev2 = DeviceTier(dev.fmt, dev.num_pages, "cpu")
    dev2.kv.copy_(dev.kv)
    if dev.scales is not None:
        dev2.scales.copy_(dev.scales)
    host2 = HostTier(host.fmt, host.num_pages, pin=False)
    host2.buffer.copy_(host.buffer)
    return dev2, host2


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(-1).view(torch.uint8).numpy()


def _slots(gen: torch.Generator, limit: int, count: int) -> np.ndarray:
    return torch.randperm(limit, generator=gen)[:count].numpy().astype(np.int64)


def _replay(copy: PieceCopy, src: np.ndarray, dst: np.ndarray, src_slots, dst_slots, merge: bool) -> None:
    """Do what copy_pages_w* or cudaMemcpyBatchAsync does with `copy`, on byte arrays (base 0)."""
    d, s, n = expand_copies(copy, 0, 0, src_slots, dst_slots)
    if merge:
        d, s, n = merge_runs(d, s, n)
    for dst_at, src_at, size in zip(d.tolist(), s.tolist(), n.tolist()):
        dst[dst_at : dst_at + size] = src[src_at : src_at + size]


def _device_buffer(dev: DeviceTier, copy: PieceCopy) -> np.ndarray:
    return _bytes(dev.scales) if copy.scales else _bytes(dev.kv)


@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("fmt", PASSTHROUGH, ids=lambda f: f.describe())
def test_passthrough_plans_match_torch_engine(fmt: PageFormat, merge: bool) -> None:
    gen = torch.Generator().manual_seed(hash(fmt.describe()) % 2**31)
    dev, host = _cpu_tiers(fmt, gen)
    ref_dev, ref_host = _clone(dev, host)
    for count in (1, 5, 12):
        dslots = _slots(gen, dev.num_pages, count)
        hslots = _slots(gen, host.num_pages, count)
        if merge:
            dslots, hslots = np.sort(dslots), np.arange(count, dtype=np.int64) + 2
        TorchEngine(ref_dev, ref_host).offload(dslots.tolist(), hslots.tolist())
        host_bytes = host.buffer.view(-1).numpy()
        for copy in passthrough_copies(fmt, dev.num_pages, range(fmt.num_layers), "offload"):
            _replay(copy, _device_buffer(dev, copy), host_bytes, dslots, hslots, merge)
        assert np.array_equal(host.buffer.numpy(), ref_host.buffer.numpy())

        dslots = _slots(gen, dev.num_pages, count)
        hslots = _slots(gen, host.num_pages, count)
        TorchEngine(ref_dev, ref_host).reload(hslots.tolist(), dslots.tolist())
        kv_bytes = dev.kv.view(-1).view(torch.uint8).numpy()
        scale_bytes = dev.scales.view(-1).view(torch.uint8).numpy() if dev.scales is not None else None
        for layer in range(fmt.num_layers):  # the engine reloads one layer per launch
            for copy in passthrough_copies(fmt, dev.num_pages, range(layer, layer + 1), "reload"):
                _replay(copy, host_bytes, scale_bytes if copy.scales else kv_bytes, hslots, dslots, merge)
        assert np.array_equal(_bytes(dev.kv), _bytes(ref_dev.kv))
        if dev.scales is not None:
            assert np.array_equal(_bytes(dev.scales), _bytes(ref_dev.scales))

        src = _slots(gen, dev.num_pages, min(count, dev.num_pages // 2))
        dst = np.setdiff1d(np.arange(dev.num_pages), src)[: src.size]
        TorchEngine(ref_dev, ref_host).device_copy(src.tolist(), dst.tolist())
        for copy in passthrough_copies(fmt, dev.num_pages, range(fmt.num_layers), "device"):
            buffer = scale_bytes if copy.scales else kv_bytes
            _replay(copy, buffer, buffer, src, dst, merge)
        assert np.array_equal(_bytes(dev.kv), _bytes(ref_dev.kv))
        if dev.scales is not None:
            assert np.array_equal(_bytes(dev.scales), _bytes(ref_dev.scales))


def _group_elements(fmt: PageFormat) -> np.ndarray:
    """(groups, elements) plane offsets of each scale group, as quantize_pages_* walks them."""
    g = scale_groups(fmt)
    seg = np.arange(g.seg_count)[:, None] * g.seg_stride + np.arange(g.seg_len)[None, :]
    return np.arange(g.groups_per_piece)[:, None] * g.group_stride + seg.reshape(1, -1)


@pytest.mark.parametrize("fmt", CONVERTING, ids=lambda f: f.describe())
def test_scale_groups_partition_the_plane(fmt: PageFormat) -> None:
    elements = _group_elements(fmt)
    assert elements.shape[0] == fmt.scales_per_plane
    assert np.array_equal(np.sort(elements.ravel()), np.arange(fmt.plane_elems))
    g = scale_groups(fmt)
    owner = np.empty(fmt.plane_elems, dtype=np.int64)
    owner[elements] = np.arange(elements.shape[0])[:, None]
    # The upcast kernel finds an element's scale by divmod; it must name the same group.
    assert np.array_equal((np.arange(fmt.plane_elems) // g.scale_div) % g.scale_mod, owner)


@pytest.mark.parametrize("fmt", CONVERTING, ids=lambda f: f.describe())
def test_quantize_plan_matches_torch_engine(fmt: PageFormat) -> None:
    gen = torch.Generator().manual_seed(7)
    dev, host = _cpu_tiers(fmt, gen)
    ref_dev, ref_host = _clone(dev, host)
    dslots = _slots(gen, dev.num_pages, 7)
    hslots = _slots(gen, host.num_pages, 7)
    TorchEngine(ref_dev, ref_host).offload(dslots.tolist(), hslots.tolist())

    elements = torch.from_numpy(_group_elements(fmt))
    fmax = np.float32(FP8_MAX[fmt.dtype])
    host_bytes = host.buffer.view(-1).numpy()
    data, scales = host_data_region(fmt, 0), host_scale_region(fmt, 0)
    dev_region = device_data_region(fmt, dev.num_pages, 0)
    flat = dev.kv.view(-1)
    for page, (d, h) in enumerate(zip(dslots.tolist(), hslots.tolist())):
        for piece in range(fmt.num_layers * fmt.planes):
            start = (dev_region.offset + d * dev_region.slot_stride + piece * dev_region.piece_stride) // fmt.device_elem_bytes
            plane = flat[start : start + fmt.plane_elems].float()
            grouped = plane[elements]
            amax = grouped.abs().amax(dim=1).numpy()
            scale = np.where(amax > 0, amax / fmax, np.float32(1)).astype(np.float32)  # IEEE, as the kernel
            q = (grouped / torch.from_numpy(scale)[:, None]).clamp(-float(fmax), float(fmax)).to(fmt.torch_dtype)
            codes = torch.empty(fmt.plane_elems, dtype=torch.uint8)
            codes[elements.ravel()] = q.view(torch.uint8).ravel()
            at = data.offset + h * data.slot_stride + piece * data.piece_stride
            host_bytes[at : at + fmt.plane_elems] = codes.numpy()
            at = scales.offset + h * scales.slot_stride + piece * scales.piece_stride
            host_bytes[at : at + fmt.plane_scale_bytes] = scale.view(np.uint8)
    assert np.array_equal(host.buffer.numpy(), ref_host.buffer.numpy())


@pytest.mark.parametrize("fmt", CONVERTING, ids=lambda f: f.describe())
def test_upcast_plan_matches_torch_engine(fmt: PageFormat) -> None:
    gen = torch.Generator().manual_seed(11)
    dev, host = _cpu_tiers(fmt, gen)
    ref_dev, ref_host = _clone(dev, host)
    dslots = _slots(gen, dev.num_pages, 6)
    hslots = _slots(gen, host.num_pages, 6)
    TorchEngine(ref_dev, ref_host).reload(hslots.tolist(), dslots.tolist())

    g = scale_groups(fmt)
    scale_index = torch.from_numpy((np.arange(fmt.plane_elems) // g.scale_div) % g.scale_mod)
    host_bytes = host.buffer.view(-1)
    flat = dev.kv.view(-1)
    for layer in range(fmt.num_layers):
        data, scales = host_data_region(fmt, layer), host_scale_region(fmt, layer)
        dev_region = device_data_region(fmt, dev.num_pages, layer)
        for d, h in zip(dslots.tolist(), hslots.tolist()):
            for piece in range(fmt.planes):
                at = data.offset + h * data.slot_stride + piece * data.piece_stride
                q = host_bytes[at : at + fmt.plane_elems].view(fmt.torch_dtype).float()
                at = scales.offset + h * scales.slot_stride + piece * scales.piece_stride
                s = host_bytes[at : at + fmt.plane_scale_bytes].view(torch.float32)
                out = (q * s[scale_index]).to(fmt.device_torch_dtype)
                start = (dev_region.offset + d * dev_region.slot_stride + piece * dev_region.piece_stride) // fmt.device_elem_bytes
                flat[start : start + fmt.plane_elems] = out
    assert np.array_equal(_bytes(dev.kv), _bytes(ref_dev.kv))


def test_vector_width_and_team_size() -> None:
    assert convert_vector(CONVERTING[0]) == 16
    assert convert_vector(CONVERTING[5]) == 1  # head_dim 24
    assert convert_vector(CONVERTING[6]) == 1  # head_dim 8
    assert [team_size(n) for n in (1, 2, 3, 8, 9, 32, 33, 1000)] == [1, 2, 4, 8, 16, 32, 32, 32]
    fmt = PASSTHROUGH[1]  # 37 x 3 fp16 elements: 222-byte planes
    copy = passthrough_copies(fmt, 4, range(fmt.num_layers), "offload")[0]
    assert copy_word_bytes(copy, 0, 0) == 2
    assert copy_word_bytes(passthrough_copies(PASSTHROUGH[0], 4, range(3), "offload")[0], 0, 4096) == 16
    assert copy_word_bytes(passthrough_copies(PASSTHROUGH[0], 4, range(3), "offload")[0], 0, 4100) == 4


def test_merge_runs_joins_only_contiguous_pairs() -> None:
    dst = np.array([300, 100, 200, 116], dtype=np.uint64)
    src = np.array([50, 0, 32, 16], dtype=np.uint64)
    sizes = np.array([16, 16, 16, 16], dtype=np.uint64)
    d, s, n = merge_runs(dst, src, sizes)
    assert d.tolist() == [100, 200, 300] and s.tolist() == [0, 32, 50] and n.tolist() == [32, 16, 16]
    assert slot_runs(np.array([4, 5, 6, 9, 3, 4])) == [(0, 4, 3), (3, 9, 1), (4, 3, 2)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_engine_without_cuda_says_so() -> None:
    from kvtier.transfer.cuda_engine import CudaEngine

    fmt = PASSTHROUGH[0]
    with pytest.raises(RuntimeError, match="needs CUDA"):
        CudaEngine(DeviceTier(fmt, 2, "cpu"), HostTier(fmt, 2, pin=False))


class _HostMemcpyRuntime:
    """cuda.bindings.runtime's cudaMemcpyBatchAsync, done with memmove on CPU addresses."""

    class cudaMemcpyAttributes:  # noqa: N801 - mirrors the cuda.bindings name
        srcAccessOrder = None
        flags = None

    class cudaMemcpySrcAccessOrder:  # noqa: N801
        cudaMemcpySrcAccessOrderStream = 1

    class cudaMemcpyFlags:  # noqa: N801
        cudaMemcpyFlagDefault = 0
        cudaMemcpyFlagPreferOverlapWithCompute = 1

    class cudaError_t:  # noqa: N801
        cudaSuccess = 0

    def __init__(self) -> None:
        self.calls = []

    def cudaMemcpyBatchAsync(self, dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, stream):  # noqa: N802
        import ctypes

        assert count == len(dsts) == len(srcs) == len(sizes) and attrs_idxs == [0] and num_attrs == 1
        self.calls.append((count, attrs[0].flags))
        for dst, src, size in zip(dsts, srcs, sizes):
            ctypes.memmove(dst, src, size)
        return (self.cudaError_t.cudaSuccess,)


@pytest.mark.parametrize("fmt", PASSTHROUGH, ids=lambda f: f.describe())
def test_copy_engine_batches_match_torch_engine(fmt: PageFormat) -> None:
    from kvtier.transfer.cuda_engine import CudaEngine

    gen = torch.Generator().manual_seed(21)
    dev, host = _cpu_tiers(fmt, gen)
    ref_dev, ref_host = _clone(dev, host)
    engine = object.__new__(CudaEngine)  # the copy-engine path's own methods, over CPU memory
    engine.device_tier, engine.host_tier, engine.fmt = dev, host, fmt
    engine._runtime, engine._memcpy_attributes = _HostMemcpyRuntime(), {}
    engine._host_device_pointer = host.buffer.data_ptr()

    class Stream:
        cuda_stream = 0

    dslots, hslots = np.array([3, 4, 5, 11, 0]), np.array([7, 8, 9, 2, 15])  # runs to merge, and not
    engine._batch_copy(Stream, engine._offload_copies(range(fmt.num_layers), dslots, hslots))
    TorchEngine(ref_dev, ref_host).offload(dslots.tolist(), hslots.tolist())
    assert np.array_equal(host.buffer.numpy(), ref_host.buffer.numpy())
    for layer in range(fmt.num_layers):
        engine._batch_copy(Stream, engine._reload_copies(range(layer, layer + 1), dslots, hslots[::-1].copy()))
    TorchEngine(ref_dev, ref_host).reload(hslots[::-1].tolist(), dslots.tolist())
    assert np.array_equal(_bytes(dev.kv), _bytes(ref_dev.kv))
    if dev.scales is not None:
        assert np.array_equal(_bytes(dev.scales), _bytes(ref_dev.scales))
    assert all(flags == 1 for _, flags in engine._runtime.calls)  # small copies prefer overlap


@pytest.mark.parametrize("fmt", PASSTHROUGH + CONVERTING, ids=lambda f: f.describe())
def test_torch_path_matches_torch_engine(fmt: PageFormat, monkeypatch) -> None:
    """The torch path's staging, record layout and chunking, run on CPU tensors."""
    from kvtier.transfer import cuda_engine

    monkeypatch.setattr(cuda_engine, "TORCH_STAGING_BYTES", 3 * fmt.page_bytes)  # chunks of 3 pages
    gen = torch.Generator().manual_seed(33)
    dev, host = _cpu_tiers(fmt, gen)
    ref_dev, ref_host = _clone(dev, host)
    engine = object.__new__(cuda_engine.CudaEngine)
    engine.device_tier, engine.host_tier, engine.fmt = dev, host, fmt
    engine.device = torch.device("cpu")
    landed = []
    engine._land_layer = lambda stream, layer, slots: landed.append((layer, slots.tolist()))
    engine.reload_stream = None

    dslots, hslots = np.array([3, 4, 5, 11, 0, 7, 2]), np.array([7, 8, 9, 2, 15, 0, 1])
    engine._torch_offload(torch.from_numpy(dslots), hslots)
    TorchEngine(ref_dev, ref_host).offload(dslots.tolist(), hslots.tolist())
    mask = torch.zeros(fmt.page_bytes, dtype=torch.bool)  # the torch path zeroes record padding
    for layer in range(fmt.num_layers):
        for plane in range(fmt.planes):
            mask[fmt.data_offset(layer, plane) : fmt.data_offset(layer, plane) + fmt.plane_elems * fmt.elem_bytes] = True
            mask[fmt.scale_offset(layer, plane) : fmt.scale_offset(layer, plane) + fmt.plane_scale_bytes] = True
    assert torch.equal(host.buffer[:, mask], ref_host.buffer[:, mask])
    untouched = np.setdiff1d(np.arange(host.num_pages), hslots)
    assert torch.equal(host.buffer[untouched], ref_host.buffer[untouched])

    engine._torch_reload(torch.from_numpy(dslots), hslots[::-1].copy(), [])
    TorchEngine(ref_dev, ref_host).reload(hslots[::-1].tolist(), dslots.tolist())
    assert np.array_equal(_bytes(dev.kv), _bytes(ref_dev.kv))
    if dev.scales is not None:
        assert np.array_equal(_bytes(dev.scales), _bytes(ref_dev.scales))
    assert landed == [(layer, dslots.tolist()) for layer in range(fmt.num_layers)]
