"""Engine-owned device KV on the CPU stand-in: pools over the serving engine's own tensors.

sglang hands per-layer `k_buffer` / `v_buffer` lists, vLLM per-layer `kv_caches` whose K and
V interleave per block (K = kv[:, 0], page stride twice the plane). These tests build such
tensors, write pages into them the way the engine would (through its own tensors, not the
tier), send them down through the host tier and back, and compare every byte, in the
engine's tensors, against what was written. They also check each refusal names the layer,
the plane and the mismatch. Nothing here needs CUDA.
"""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvtier import PageFormat, TieredPool, prefix_keys
from kvtier.tiers import DeviceTier

PAGES = 12


def _formats() -> list[PageFormat]:
    return [
        PageFormat(3, 2, 32, 4),
        PageFormat(2, 2, 16, 5, dtype="fp16", layout="hnd"),
        PageFormat(2, 3, 16, 4, dtype="fp8_e4m3", scale="per_page_head"),
        PageFormat(2, 2, 16, 3, dtype="fp8_e5m2", scale="per_token_head", layout="hnd"),
        PageFormat(2, 2, 16, 4, dtype="fp8_e4m3", scale="per_tensor"),
        PageFormat(2, 1, 40, 4, mla=True),
        PageFormat(2, 1, 24, 4, dtype="fp8_e4m3", scale="per_token_head", mla=True),
        PageFormat(2, 2, 32, 4, dtype="fp8_e4m3", scale="per_page_head", device_dtype="bf16"),
    ]


def _random_pages(fmt: PageFormat, shape: tuple, gen: torch.Generator) -> torch.Tensor:
    """Random contents in the device dtype: finite values for wide dtypes, finite fp8 codes."""
    values = (torch.rand(shape, generator=gen) * 2 - 1) * 8
    return values.to(fmt.device_torch_dtype)


def engine_tensors(fmt: PageFormat, layout: str, pages: int = PAGES):
    """(kv, scales, per-(layer, plane) page tensors, per-(layer, plane) scale tensors) as an engine holds them.

    layout: "stacked" ((num_layers, pages, *plane) per plane), "lists" (per-layer tensors),
    "interleaved" (vLLM: one (pages, planes, *plane) tensor per layer, K = kv[:, 0]).
    """
    dtype, planes = fmt.device_torch_dtype, fmt.planes
    if layout == "stacked":
        per_plane = [torch.empty((fmt.num_layers, pages, *fmt.plane_shape), dtype=dtype) for _ in range(planes)]
        views = [[per_plane[p][layer] for p in range(planes)] for layer in range(fmt.num_layers)]
        given = per_plane
    elif layout == "lists":
        views = [[torch.empty((pages, *fmt.plane_shape), dtype=dtype) for _ in range(planes)] for _ in range(fmt.num_layers)]
        given = [[views[layer][p] for layer in range(fmt.num_layers)] for p in range(planes)]
    else:
        blocks = [torch.empty((pages, planes, *fmt.plane_shape), dtype=dtype) for _ in range(fmt.num_layers)]
        views = [[blocks[layer][:, p] for p in range(planes)] for layer in range(fmt.num_layers)]
        given = [[views[layer][p] for layer in range(fmt.num_layers)] for p in range(planes)]
    kv = (given[0], None) if fmt.mla else (given[0], given[1])
    if not fmt.device_has_scales:
        return kv, None, views, None
    scale_views = [
        [torch.empty((pages, *fmt.scale_shape), dtype=torch.float32) for _ in range(planes)] for _ in range(fmt.num_layers)
    ]
    scale_given = [[scale_views[layer][p] for layer in range(fmt.num_layers)] for p in range(planes)]
    scales = (scale_given[0], None) if fmt.mla else (scale_given[0], scale_given[1])
    return kv, scales, views, scale_views


def _page(views, scale_views, slot: int) -> list[bytes]:
    out = [t[slot].contiguous().view(torch.uint8).numpy().tobytes() for row in views for t in row]
    if scale_views is not None:
        out += [t[slot].contiguous().numpy().tobytes() for row in scale_views for t in row]
    return out


@pytest.mark.parametrize("layout", ["stacked", "lists", "interleaved"])
@pytest.mark.parametrize("fmt", _formats(), ids=lambda f: f.describe())
def test_round_trip_through_engine_owned_tensors(fmt: PageFormat, layout: str) -> None:
    kv, scales, views, scale_views = engine_tensors(fmt, layout)
    pool = TieredPool(fmt, device_kv=kv, device_scales=scales, host_pages=32, write_policy="write_back",
                      registry=CollectorRegistry())
    assert pool.device_tier.num_pages == PAGES and not pool.device_tier.pool_owned
    gen = torch.Generator().manual_seed(len(fmt.describe()) + len(layout))
    keys = prefix_keys(list(range(8 * fmt.page_size)), fmt.page_size, pool.namespace)
    slots = pool.allocate(8)
    for row, scale_row in zip(views, scale_views or [None] * len(views)):
        for p, tensor in enumerate(row):  # the engine writes its own tensors
            tensor[slots] = _random_pages(fmt, (len(slots), *fmt.plane_shape), gen)
            if scale_row is not None:
                scale_row[p][slots] = torch.rand((len(slots), *fmt.scale_shape), generator=gen) + 0.25
    if fmt.converts:  # what comes back is the codec's rounding of what was written
        expected = None
    else:
        expected = {key: _page(views, scale_views, slot) for key, slot in zip(keys, slots)}
    originals = [[t[slots].clone() for t in row] for row in views]
    pool.commit(keys, slots)
    pool.release(slots)
    assert pool.evict(tier="device") == 8
    back = pool.allocate(8)
    for row in views:
        for tensor in row:
            tensor[back].view(torch.uint8).fill_(0xFF)
    handle = pool.load(keys, back)
    handle.wait()
    for i, (key, slot) in enumerate(zip(keys, back)):
        if expected is not None:
            assert _page(views, scale_views, slot) == expected[key], f"page {i} differs in the engine's tensors"
    if fmt.converts:
        for layer, row in enumerate(views):
            for p, tensor in enumerate(row):
                error = (tensor[back].float() - originals[layer][p].float()).abs()
                assert error.max() <= originals[layer][p].float().abs().max() / 8, f"layer {layer} plane {p}"
                assert torch.isfinite(tensor[back].float()).all()
    pool.close()


def test_accessors_are_views_of_the_engine_memory() -> None:
    fmt = PageFormat(2, 2, 16, 4)
    kv, _, views, _ = engine_tensors(fmt, "interleaved")
    dev = DeviceTier(fmt, kv=kv)
    plane_bytes = fmt.device_plane_bytes
    assert dev.num_pages == PAGES and dev.device == torch.device("cpu")
    assert dev.page_stride_bytes(1, 1) == 2 * plane_bytes
    assert dev.data_ptr(1, 1) == views[1][1].data_ptr() == views[1][0].data_ptr() + plane_bytes
    assert dev.plane(1, 0) is views[1][0]
    raw = dev.raw_plane(1, 1)
    assert raw.shape == (PAGES, plane_bytes) and raw.stride() == (2 * plane_bytes, 1)
    raw[3] = 7  # a byte view of the same memory, not a copy
    assert (views[1][1][3].view(torch.uint8) == 7).all() and not (views[1][0][3].view(torch.uint8) == 7).all()
    assert dev.layer_kv(0)[0] is views[0][0] and dev.layer_scales(0) == (None, None)
    assert dev.nbytes == 2 * 2 * PAGES * plane_bytes
    with pytest.raises(AttributeError, match="plane\\(layer, plane\\)"):
        dev.kv
    with pytest.raises(IndexError, match="plane 2"):
        dev.plane(0, 2)
    owned = DeviceTier(fmt, 5)
    assert owned.pool_owned and owned.kv.shape == (2, 2, 5, *fmt.plane_shape) and owned.scales is None
    assert owned.plane(1, 1).data_ptr() == owned.kv[1, 1].data_ptr()


def _kv_for(fmt: PageFormat, pages: int = PAGES, dtype=None, shape=None):
    shape = shape or (fmt.num_layers, pages, *fmt.plane_shape)
    return torch.zeros(shape, dtype=dtype or fmt.device_torch_dtype)


def test_refusals_name_layer_plane_and_mismatch() -> None:
    fmt = PageFormat(2, 2, 16, 4)
    k, v = _kv_for(fmt), _kv_for(fmt)
    with pytest.raises(ValueError, match=r"kv V layer 0 has dtype torch.float16, expected torch.bfloat16"):
        DeviceTier(fmt, kv=(k, _kv_for(fmt, dtype=torch.float16)))
    with pytest.raises(ValueError, match=r"K stacked tensor must be \(num_layers=2"):
        DeviceTier(fmt, kv=(_kv_for(fmt, shape=(3, PAGES, *fmt.plane_shape)), v))
    with pytest.raises(ValueError, match=r"V layer 1 must be \(num_pages, \*\(4, 2, 16\)\), got shape \(12, 4, 2, 8\)"):
        DeviceTier(fmt, kv=([k[0], k[1]], [v[0], torch.zeros(PAGES, 4, 2, 8, dtype=torch.bfloat16)]))
    with pytest.raises(ValueError, match=r"K must list num_layers=2 tensors, got 1"):
        DeviceTier(fmt, kv=([k[0]], [v[0], v[1]]))
    strided = torch.zeros(fmt.num_layers, PAGES, 2, 4, 16, dtype=torch.bfloat16).transpose(2, 3)  # heads before tokens
    with pytest.raises(ValueError, match=r"K layer 0: a page must be contiguous, expected page strides \(32, 16, 1\)"):
        DeviceTier(fmt, kv=(strided, v))
    overlapping = torch.zeros(PAGES * 64 + 128, dtype=torch.bfloat16).as_strided((PAGES, 4, 2, 16), (64, 32, 16, 1))
    with pytest.raises(ValueError, match=r"V layer 1: pages overlap, page stride 64 elements < 128"):
        DeviceTier(fmt, kv=([k[0], k[1]], [v[0], overlapping]))
    with pytest.raises(ValueError, match=r"device kv K layer 1 holds 11 pages, expected 12"):
        DeviceTier(fmt, kv=([k[0], k[1, :11]], [v[0], v[1]]))
    with pytest.raises(ValueError, match=r"device_pages=10 conflicts with the device kv tensors, which hold 12 pages"):
        DeviceTier(fmt, 10, kv=(k, v))
    with pytest.raises(ValueError, match=r"kv V layer 0 starts at the same address as kv K layer 0"):
        DeviceTier(fmt, kv=(k, k))
    with pytest.raises(ValueError, match=r"must be a pair \(K, V\), got tuple of length 1"):
        DeviceTier(fmt, kv=(k,))
    with pytest.raises(ValueError, match=r"device='meta': kvtier's device tier runs on 'cpu' or 'cuda'"):
        DeviceTier(fmt, device="meta", kv=(k, v))
    with pytest.raises(ValueError, match=r"kv V layer 1 is on meta, expected cpu like layer 0"):
        DeviceTier(fmt, kv=([k[0], k[1]], [v[0], torch.empty(PAGES, 4, 2, 16, dtype=torch.bfloat16, device="meta")]))
    with pytest.raises(ValueError, match="keeps no scales on the device"):
        DeviceTier(fmt, kv=(k, v), scales=(torch.ones(2, PAGES), torch.ones(2, PAGES)))
    with pytest.raises(ValueError, match="scales were given without device kv"):
        DeviceTier(fmt, 4, scales=(torch.ones(2, PAGES), torch.ones(2, PAGES)))
    with pytest.raises(ValueError, match="device_pages is required"):
        DeviceTier(fmt)

    fp8 = PageFormat(2, 2, 16, 4, dtype="fp8_e4m3", scale="per_page_head")
    k8, v8 = _kv_for(fp8), _kv_for(fp8)
    with pytest.raises(ValueError, match="pass device scales"):
        DeviceTier(fp8, kv=(k8, v8))
    with pytest.raises(ValueError, match=r"scales V layer 0 must be \(num_pages, \*\(2,\)\), got shape \(12, 3\)"):
        DeviceTier(fp8, kv=(k8, v8), scales=(torch.ones(2, PAGES, 2), [torch.ones(PAGES, 3), torch.ones(PAGES, 2)]))
    with pytest.raises(ValueError, match=r"scales K layer 0 has dtype torch.float16, expected torch.float32"):
        DeviceTier(fp8, kv=(k8, v8), scales=(torch.ones(2, PAGES, 2, dtype=torch.float16), torch.ones(2, PAGES, 2)))
    with pytest.raises(ValueError, match=r"device scales V layer 1 holds 11 pages, expected 12"):
        DeviceTier(fp8, kv=(k8, v8), scales=(torch.ones(2, PAGES, 2), [torch.ones(PAGES, 2), torch.ones(11, 2)]))

    mla = PageFormat(2, 1, 16, 4, mla=True)
    latent = _kv_for(mla)
    with pytest.raises(ValueError, match=r"\(latent, None\): the second entry must be None"):
        DeviceTier(mla, kv=(latent, latent))
    with pytest.raises(ValueError, match=r"device_pages=4 conflicts"):
        TieredPool(fmt, device_pages=4, device_kv=(k, v), registry=CollectorRegistry())


def test_mla_latent_accessors() -> None:
    mla = PageFormat(2, 1, 16, 4, mla=True)
    latent = _kv_for(mla)
    dev = DeviceTier(mla, kv=(latent, None))
    first, second = dev.layer_kv(1)
    assert second is None and first.data_ptr() == latent[1].data_ptr() and first.shape == latent[1].shape
