"""The CUDA engine's address arithmetic and chunk walk, checked on the CPU against TorchEngine.

The kernels in native/ only follow the plans kvtier.transfer.cuda.plans computes: the
per-(layer, plane) device table, host record offsets, scale groups and the chunks one launch
is cut into. These tests replay those plans with numpy, exactly as the kernels and the copy
engines index memory, over CPU tiers (pool-owned and engine-owned), and compare every byte
with TorchEngine, so a wrong offset, stride, scale group or chunk fails here, on a machine
without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.format import FP8_MAX, PageFormat
from kvtier.tiers import DeviceTier, HostTier
from kvtier.transfer import TorchEngine
from kvtier.transfer.cuda import plans
from kvtier.transfer.cuda.copy_engine_path import CopyEnginePath
from kvtier.transfer.cuda.torch_path import TorchPath
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
    """Pool-owned CPU copies of both tiers (any device tier layout)."""
    dev2 = DeviceTier(dev.fmt, dev.num_pages, "cpu")
    for layer in range(dev.fmt.num_layers):
        for plane in range(dev.fmt.planes):
            dev2.plane(layer, plane).copy_(dev.plane(layer, plane))
            if dev.has_scales:
                dev2.scale_plane(layer, plane).copy_(dev.scale_plane(layer, plane))
    host2 = HostTier(host.fmt, host.num_pages, pin=False)
    host2.buffer.copy_(host.buffer)
    return dev2, host2


def _device_state(dev: DeviceTier) -> bytes:
    fmt = dev.fmt
    parts = [dev.raw_plane(layer, plane).contiguous().numpy().tobytes() for layer in range(fmt.num_layers) for plane in range(fmt.planes)]
    if dev.has_scales:
        parts += [dev.scale_plane(l, p).contiguous().numpy().tobytes() for l in range(fmt.num_layers) for p in range(fmt.planes)]
    return b"".join(parts)


def _slots(gen: torch.Generator, limit: int, count: int) -> np.ndarray:
    return torch.randperm(limit, generator=gen)[:count].numpy().astype(np.int64)


def _replay(pieces: list[tuple], merge: bool) -> None:
    """Do what cudaMemcpyBatchAsync does with (dst, src, sizes) lists, on CPU addresses."""
    import ctypes

    for d, s, n in pieces:
        if merge:
            d, s, n = plans.merge_runs(d, s, n)
        for dst_at, src_at, size in zip(d.tolist(), s.tolist(), n.tolist()):
            ctypes.memmove(dst_at, src_at, size)


def _interleaved(fmt: PageFormat, pages: int, gen: torch.Generator) -> DeviceTier:
    """An engine-owned tier: per-layer (pages, planes, *plane) tensors, K = kv[:, 0] (vLLM's layout)."""
    blocks = [torch.empty((pages, fmt.planes, *fmt.plane_shape), dtype=fmt.device_torch_dtype) for _ in range(fmt.num_layers)]
    given = [[blocks[layer][:, p] for layer in range(fmt.num_layers)] for p in range(fmt.planes)]
    kv = (given[0], None) if fmt.mla else (given[0], given[1])
    scales = None
    if fmt.device_has_scales:
        per = [[torch.empty((pages, *fmt.scale_shape)) for _ in range(fmt.num_layers)] for _ in range(fmt.planes)]
        scales = (per[0], None) if fmt.mla else (per[0], per[1])
    dev = DeviceTier(fmt, kv=kv, scales=scales)
    fill_random(dev, HostTier(fmt, 1, pin=False), gen)
    return dev


@pytest.mark.parametrize("owned", ["pool", "engine"])
@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("fmt", PASSTHROUGH, ids=lambda f: f.describe())
def test_passthrough_plans_match_torch_engine(fmt: PageFormat, merge: bool, owned: str) -> None:
    gen = torch.Generator().manual_seed(len(fmt.describe()))
    dev, host = _cpu_tiers(fmt, gen)
    if owned == "engine":
        dev = _interleaved(fmt, dev.num_pages, gen)
    ref_dev, ref_host = _clone(dev, host)
    engine = CopyEnginePath(fmt, plans.device_table(dev), host.buffer.data_ptr(), runtime=None)
    for count in (1, 5, 12):
        dslots = _slots(gen, dev.num_pages, count)
        hslots = _slots(gen, host.num_pages, count)
        if merge:
            dslots, hslots = np.sort(dslots), np.arange(count, dtype=np.int64) + 2
        TorchEngine(ref_dev, ref_host).offload(dslots.tolist(), hslots.tolist())
        _replay(engine.pieces("offload", range(fmt.num_layers), dslots, hslots), merge)
        assert np.array_equal(host.buffer.numpy(), ref_host.buffer.numpy())

        dslots = _slots(gen, dev.num_pages, count)
        hslots = _slots(gen, host.num_pages, count)
        TorchEngine(ref_dev, ref_host).reload(hslots.tolist(), dslots.tolist())
        for layer in range(fmt.num_layers):
            _replay(engine.pieces("reload", range(layer, layer + 1), hslots, dslots), merge)
        assert _device_state(dev) == _device_state(ref_dev)

        src = _slots(gen, dev.num_pages, min(count, dev.num_pages // 2))
        dst = np.setdiff1d(np.arange(dev.num_pages), src)[: src.size]
        TorchEngine(ref_dev, ref_host).device_copy(src.tolist(), dst.tolist())
        _replay(engine.pieces("device", range(fmt.num_layers), src, dst), merge)
        assert _device_state(dev) == _device_state(ref_dev)


def _covered_units(chunks: plans.Chunks, units_per_layer: int, chunk_units: int, layers: int, data: bool) -> np.ndarray:
    """Units each chunk of the layer-major walk touches, as the kernels compute them: (layer, unit) counts."""
    seen = np.zeros((layers, units_per_layer), dtype=np.int64)
    total = chunks.per_layer * layers
    for chunk in range(total):
        layer, in_layer = divmod(chunk, chunks.per_layer)
        if (in_layer < chunks.data) != data:
            continue
        first = (in_layer if data else in_layer - chunks.data) * chunk_units
        units = np.arange(first, first + chunk_units)
        seen[layer, units[units < units_per_layer]] += 1
    return seen


@pytest.mark.parametrize("count", [1, 3, 16, 40])
@pytest.mark.parametrize("fmt", PASSTHROUGH + CONVERTING, ids=lambda f: f.describe())
def test_chunks_cover_every_unit_once_within_one_layer(fmt: PageFormat, count: int) -> None:
    if fmt.converts:
        vec = plans.convert_vector(fmt)
        up = plans.upcast_chunks(fmt, count, vec)
        units = count * fmt.planes * fmt.plane_elems // vec
        assert (_covered_units(up, units, plans.CONVERT_CHUNK, fmt.num_layers, True) == 1).all()
        groups = plans.scale_groups(fmt)
        team = plans.team_size(groups.seg_count * groups.seg_len // vec)
        quant = plans.quantize_chunks(fmt, count, team)
        units = count * fmt.planes * groups.groups_per_piece
        assert (_covered_units(quant, units, plans.THREADS // team, fmt.num_layers, True) == 1).all()
        return
    for width in (16, 4, 1):
        if fmt.device_plane_bytes % width:
            continue
        chunks = plans.copy_chunks(fmt, count, width, fmt.device_has_scales)
        units = count * fmt.planes * fmt.device_plane_bytes // width
        assert (_covered_units(chunks, units, plans.COPY_CHUNK, fmt.num_layers, True) == 1).all()
        if fmt.device_has_scales:
            units = count * fmt.planes * fmt.plane_scale_bytes // 4
            assert (_covered_units(chunks, units, plans.COPY_CHUNK, fmt.num_layers, False) == 1).all()
        else:
            assert chunks.per_layer == chunks.data


def _group_elements(fmt: PageFormat) -> np.ndarray:
    """(groups, elements) plane offsets of each scale group, as quantize_* walks them."""
    g = plans.scale_groups(fmt)
    seg = np.arange(g.seg_count)[:, None] * g.seg_stride + np.arange(g.seg_len)[None, :]
    return np.arange(g.groups_per_piece)[:, None] * g.group_stride + seg.reshape(1, -1)


@pytest.mark.parametrize("fmt", CONVERTING, ids=lambda f: f.describe())
def test_scale_groups_partition_the_plane(fmt: PageFormat) -> None:
    elements = _group_elements(fmt)
    assert elements.shape[0] == fmt.scales_per_plane
    assert np.array_equal(np.sort(elements.ravel()), np.arange(fmt.plane_elems))
    g = plans.scale_groups(fmt)
    owner = np.empty(fmt.plane_elems, dtype=np.int64)
    owner[elements] = np.arange(elements.shape[0])[:, None]
    # The upcast kernel finds an element's scale by divmod; it must name the same group.
    assert np.array_equal((np.arange(fmt.plane_elems) // g.scale_div) % g.scale_mod, owner)


def _device_elements(dev: DeviceTier, layer: int, plane: int, slot: int) -> tuple[torch.Tensor, int]:
    """(flat view of the device tier's storage, element offset of one page) via the table."""
    table = plans.device_table(dev)
    row = layer * dev.fmt.planes + plane
    tensor = dev.plane(layer, plane)
    base = tensor.data_ptr() - tensor.storage_offset() * dev.fmt.device_elem_bytes
    start = (int(table[0, row]) + slot * int(table[1, row]) - base) // dev.fmt.device_elem_bytes
    flat = torch.empty(0, dtype=tensor.dtype).set_(tensor.untyped_storage(), 0, (tensor.untyped_storage().nbytes() // dev.fmt.device_elem_bytes,))
    return flat, start


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
    for d, h in zip(dslots.tolist(), hslots.tolist()):
        for layer in range(fmt.num_layers):
            for plane in range(fmt.planes):
                row = layer * fmt.planes + plane
                flat, start = _device_elements(dev, layer, plane, d)
                grouped = flat[start : start + fmt.plane_elems].float()[elements]
                amax = grouped.abs().amax(dim=1).numpy()
                scale = np.where(amax > 0, amax / fmax, np.float32(1)).astype(np.float32)  # IEEE, as the kernel
                q = (grouped / torch.from_numpy(scale)[:, None]).clamp(-float(fmax), float(fmax)).to(fmt.torch_dtype)
                codes = torch.empty(fmt.plane_elems, dtype=torch.uint8)
                codes[elements.ravel()] = q.view(torch.uint8).ravel()
                at = h * fmt.page_bytes + row * fmt.plane_data_bytes
                host_bytes[at : at + fmt.plane_elems] = codes.numpy()
                at = h * fmt.page_bytes + fmt.data_bytes + row * fmt.plane_scale_bytes
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

    g = plans.scale_groups(fmt)
    scale_index = torch.from_numpy((np.arange(fmt.plane_elems) // g.scale_div) % g.scale_mod)
    host_bytes = host.buffer.view(-1)
    for layer in range(fmt.num_layers):
        for d, h in zip(dslots.tolist(), hslots.tolist()):
            for plane in range(fmt.planes):
                row = layer * fmt.planes + plane
                at = h * fmt.page_bytes + row * fmt.plane_data_bytes
                q = host_bytes[at : at + fmt.plane_elems].view(fmt.torch_dtype).float()
                at = h * fmt.page_bytes + fmt.data_bytes + row * fmt.plane_scale_bytes
                s = host_bytes[at : at + fmt.plane_scale_bytes].view(torch.float32)
                flat, start = _device_elements(dev, layer, plane, d)
                flat[start : start + fmt.plane_elems] = (q * s[scale_index]).to(fmt.device_torch_dtype)
    assert _device_state(dev) == _device_state(ref_dev)


def test_vector_width_team_size_and_words() -> None:
    assert plans.convert_vector(CONVERTING[0]) == 16
    assert plans.convert_vector(CONVERTING[5]) == 1  # head_dim 24
    assert plans.convert_vector(CONVERTING[6]) == 1  # head_dim 8
    table = np.array([[4096, 8192 + 16], [64, 64], [0, 0], [0, 0]], dtype=np.int64)
    assert plans.convert_vector(CONVERTING[0], table) == 1  # a device base only 16-aligned
    assert [plans.team_size(n) for n in (1, 2, 3, 8, 9, 32, 33, 1000)] == [1, 2, 4, 8, 16, 32, 32, 32]
    fmt = PASSTHROUGH[1]  # 37 x 3 fp16 elements: 222-byte planes
    assert plans.data_word_bytes(fmt, np.zeros((4, 4), dtype=np.int64), 0, "offload") == 2
    wide = PASSTHROUGH[0]
    table = np.full((4, wide.num_layers * 2), 4096, dtype=np.int64)
    assert plans.data_word_bytes(wide, table, 0, "offload") == 16
    assert plans.data_word_bytes(wide, table, 4100, "offload") == 4
    assert plans.data_word_bytes(wide, table, 4100, "device") == 16  # no host side
    table[0, 1] += 8
    assert plans.data_word_bytes(wide, table, 0, "reload") == 8
    with pytest.raises(ValueError, match="converts"):
        plans.data_word_bytes(CONVERTING[0], table, 0, "reload")


def test_argument_records_follow_the_c_structs() -> None:
    """The field lists are the C structs' members, in order (each 8 bytes)."""
    import re

    from kvtier.transfer import native

    for kind, struct in (("copy", "CopyArgs"), ("upcast", "UpcastArgs"), ("quantize", "QuantizeArgs")):
        module = "page_copy" if kind == "copy" else "page_convert"
        text = re.sub(r"//[^\n]*", "", native.source(module))
        signal = re.search(r"struct Signal \{(.*?)\};", text, re.S).group(1)
        body = re.search(rf"struct {struct} \{{(.*?)\}};", text, re.S).group(1)
        members = re.findall(r"^\s*([\w ]+?)\s+(\w+);", signal + body, re.M)
        names = [name for _, name in members if name != "signal"]
        assert tuple(names) == plans.ARG_FIELDS[kind], f"{struct} members differ from plans.{kind.upper()}_FIELDS"
        widths = {kind for kind, name in members if name != "signal"}
        assert widths <= {"long long", "unsigned long long"}, f"{struct} has fields not 8 bytes wide: {widths}"


def test_merge_runs_joins_only_contiguous_pairs() -> None:
    dst = np.array([300, 100, 200, 116], dtype=np.uint64)
    src = np.array([50, 0, 32, 16], dtype=np.uint64)
    sizes = np.array([16, 16, 16, 16], dtype=np.uint64)
    d, s, n = plans.merge_runs(dst, src, sizes)
    assert d.tolist() == [100, 200, 300] and s.tolist() == [0, 32, 50] and n.tolist() == [32, 16, 16]
    assert plans.slot_runs(np.array([4, 5, 6, 9, 3, 4])) == [(0, 4, 3), (3, 9, 1), (4, 3, 2)]


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
    gen = torch.Generator().manual_seed(21)
    dev, host = _cpu_tiers(fmt, gen)
    ref_dev, ref_host = _clone(dev, host)
    runtime = _HostMemcpyRuntime()
    engine = CopyEnginePath(fmt, plans.device_table(dev), host.buffer.data_ptr(), runtime)
    dslots, hslots = np.array([3, 4, 5, 11, 0]), np.array([7, 8, 9, 2, 15])  # runs to merge, and not
    engine.copy(0, engine.pieces("offload", range(fmt.num_layers), dslots, hslots))
    TorchEngine(ref_dev, ref_host).offload(dslots.tolist(), hslots.tolist())
    assert np.array_equal(host.buffer.numpy(), ref_host.buffer.numpy())
    for layer in range(fmt.num_layers):
        engine.copy(0, engine.pieces("reload", range(layer, layer + 1), hslots[::-1].copy(), dslots))
    TorchEngine(ref_dev, ref_host).reload(hslots[::-1].tolist(), dslots.tolist())
    assert _device_state(dev) == _device_state(ref_dev)
    assert all(flags == 1 for _, flags in runtime.calls)  # small copies prefer overlap


@pytest.mark.parametrize("fmt", PASSTHROUGH + CONVERTING, ids=lambda f: f.describe())
def test_torch_path_matches_torch_engine(fmt: PageFormat, monkeypatch) -> None:
    """The torch path's staging, record layout and chunking, run on CPU tensors."""
    from kvtier.transfer.cuda import torch_path

    monkeypatch.setattr(torch_path, "TORCH_STAGING_BYTES", 3 * fmt.page_bytes)  # chunks of 3 pages
    gen = torch.Generator().manual_seed(33)
    dev, host = _cpu_tiers(fmt, gen)
    ref_dev, ref_host = _clone(dev, host)
    path = TorchPath(dev, host, torch.device("cpu"))
    dslots, hslots = np.array([3, 4, 5, 11, 0, 7, 2]), np.array([7, 8, 9, 2, 15, 0, 1])
    _, failed = path.offload(torch.from_numpy(dslots), hslots)
    assert failed == []
    TorchEngine(ref_dev, ref_host).offload(dslots.tolist(), hslots.tolist())
    mask = torch.zeros(fmt.page_bytes, dtype=torch.bool)  # the torch path zeroes record padding
    for layer in range(fmt.num_layers):
        for plane in range(fmt.planes):
            mask[fmt.data_offset(layer, plane) : fmt.data_offset(layer, plane) + fmt.plane_elems * fmt.elem_bytes] = True
            mask[fmt.scale_offset(layer, plane) : fmt.scale_offset(layer, plane) + fmt.plane_scale_bytes] = True
    assert torch.equal(host.buffer[:, mask], ref_host.buffer[:, mask])
    untouched = np.setdiff1d(np.arange(host.num_pages), hslots)
    assert torch.equal(host.buffer[untouched], ref_host.buffer[untouched])

    landed = []
    path.reload(torch.from_numpy(dslots), hslots[::-1].copy(), [], landed.append)
    TorchEngine(ref_dev, ref_host).reload(hslots[::-1].tolist(), dslots.tolist())
    assert _device_state(dev) == _device_state(ref_dev)
    assert landed == list(range(fmt.num_layers))


@pytest.mark.parametrize("fmt", CONVERTING[:3], ids=lambda f: f.describe())
def test_offload_refuses_pages_that_cannot_be_encoded(fmt: PageFormat) -> None:
    """TorchEngine and the CUDA engine's torch path leave NaN/Inf pages out and name their positions."""
    gen = torch.Generator().manual_seed(41)
    dev, host = _cpu_tiers(fmt, gen)
    dslots, hslots = [2, 5, 8, 11], [1, 4, 9, 13]
    dev.plane(fmt.num_layers - 1, 0)[5].view(-1)[3] = float("inf")
    dev.plane(0, fmt.planes - 1)[11].view(-1)[0] = float("nan")
    ref_dev, ref_host = _clone(dev, host)
    before = host.buffer.clone()
    ticket = TorchEngine(dev, host).offload(dslots, hslots)
    assert ticket.failed_positions() == [1, 3]
    assert torch.equal(host.buffer[[4, 13]], before[[4, 13]]), "refused pages are not written"
    good_dev, good_host = _clone(ref_dev, ref_host)
    TorchEngine(good_dev, good_host).offload([2, 8], [1, 9])
    assert torch.equal(host.buffer, good_host.buffer)
    _, failed = TorchPath(ref_dev, ref_host, torch.device("cpu")).offload(torch.tensor(dslots), np.array(hslots))
    assert failed == [1, 3]
    mask = torch.zeros(fmt.page_bytes, dtype=torch.bool)
    for layer in range(fmt.num_layers):
        for plane in range(fmt.planes):
            mask[fmt.data_offset(layer, plane) : fmt.data_offset(layer, plane) + fmt.plane_elems] = True
    assert torch.equal(ref_host.buffer[[1, 9]][:, mask], good_host.buffer[[1, 9]][:, mask])
    assert torch.equal(ref_host.buffer[[4, 13]], before[[4, 13]])
    every = TorchEngine(*_clone(ref_dev, ref_host)).offload([5, 11], [0, 2])
    assert every.failed_positions() == [0, 1]
