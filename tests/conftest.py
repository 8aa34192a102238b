"""Shared helpers: random page contents and exact snapshots of device pages."""

from __future__ import annotations

import itertools

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvtier import PageFormat

DTYPE_SCALES = [
    ("bf16", "none"),
    ("fp16", "none"),
    ("fp8_e4m3", "per_tensor"),
    ("fp8_e4m3", "per_page_head"),
    ("fp8_e4m3", "per_token_head"),
    ("fp8_e5m2", "per_tensor"),
    ("fp8_e5m2", "per_page_head"),
    ("fp8_e5m2", "per_token_head"),
]


def small_format(dtype="fp8_e4m3", scale="per_page_head", **kw) -> PageFormat:
    base = dict(num_layers=3, num_kv_heads=2, head_dim=32, page_size=8, dtype=dtype, scale=scale)
    base.update(kw)
    return PageFormat(**base)


def fill_random(pool, slots, gen: torch.Generator) -> None:
    """Write random pages (and positive random scales) into device `slots`, as an engine would."""
    dev = pool.device_tier
    idx = torch.as_tensor(slots, dtype=torch.int64, device=dev.device)
    shape = (len(slots), *pool.fmt.plane_shape)
    for layer, plane in itertools.product(range(pool.fmt.num_layers), range(pool.fmt.planes)):
        values = torch.randn(shape, generator=gen) * 4
        raw = values.to(pool.fmt.device_torch_dtype).view(len(slots), -1).view(torch.uint8)
        dev.raw_plane(layer, plane).index_copy_(0, idx, raw.to(dev.device))
        if dev.has_scales:
            scales = torch.rand((len(slots), *pool.fmt.scale_shape), generator=gen) + 0.01
            dev.scale_plane(layer, plane).index_copy_(0, idx, scales.to(dev.device))


def snapshot(pool, slot: int) -> tuple[bytes, bytes]:
    """Exact bytes of one device page: data of every layer and plane, and its scales."""
    dev, fmt = pool.device_tier, pool.fmt
    planes = list(itertools.product(range(fmt.num_layers), range(fmt.planes)))
    data = b"".join(dev.raw_plane(layer, plane)[slot].cpu().numpy().tobytes() for layer, plane in planes)
    scales = b""
    if dev.has_scales:
        scales = b"".join(dev.scale_plane(layer, plane)[slot].cpu().numpy().tobytes() for layer, plane in planes)
    return data, scales


def write_pages(pool, keys, gen: torch.Generator) -> dict:
    """Allocate, fill with random bytes and scales, commit and release a page per key; returns
    each key's exact bytes (snapshot)."""
    slots = pool.allocate(len(keys))
    fill_random(pool, slots, gen)
    expected = {k: snapshot(pool, s) for k, s in zip(keys, slots)}
    pool.commit(keys, slots)
    pool.release(slots)
    return expected


def poison(pool, slots) -> None:
    """Fill device slots with 0xFF bytes (NaN in every float dtype) before a copy lands."""
    dev, fmt = pool.device_tier, pool.fmt
    idx = torch.as_tensor(slots, dtype=torch.int64, device=dev.device)
    for layer, plane in itertools.product(range(fmt.num_layers), range(fmt.planes)):
        dev.raw_plane(layer, plane)[idx] = 0xFF
        if dev.has_scales:
            dev.scale_plane(layer, plane)[idx] = float("nan")


def cpu_lane(num_layers: int):
    """A CUDA engine's StreamLane over CPU tensors: flags and counters a test (or a CPU emulation
    of the copy kernels) raises itself, and slot buffers in ordinary memory."""
    from kvtier.transfer.cuda.tickets import StreamLane

    flags = torch.zeros(32, dtype=torch.int32)
    counters = torch.zeros(num_layers + 1, dtype=torch.int32)

    def pinned(capacity):
        tensor = torch.zeros((3, capacity), dtype=torch.int32)
        return tensor, tensor.data_ptr()

    return StreamLane(None, num_layers, flags, flags.data_ptr(), counters, pinned, None)


@pytest.fixture(scope="session", autouse=True)
def host_index_paths():
    """The index's C paths (kvtier.index.native) loaded before any test runs, as a pool's first
    call loads them where they were built before: every test then sees one path throughout, not
    the Python twins until a background build ends. Tests of the twins turn C off themselves
    (`python_index_paths`)."""
    from kvtier.index import native

    native.start(wait=True)


def python_index_paths(monkeypatch) -> None:
    """Run the index's Python twins (numpy and one-at-a-time paths) instead of its C paths for
    the rest of a test."""
    from kvtier.index import native

    monkeypatch.setattr(native, "_module", None)


@pytest.fixture
def registry():
    return CollectorRegistry()


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)
