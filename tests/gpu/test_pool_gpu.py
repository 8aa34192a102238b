"""TieredPool on a real GPU: the pool's ordering with the CUDA engine, end to end."""

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvtier import PageFormat, TieredPool, dequantize, prefix_keys, quantize

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make_pool(fmt, **kw):
    kw.setdefault("device_pages", 64)
    kw.setdefault("host_pages", 512)
    return TieredPool(fmt, device="cuda", registry=CollectorRegistry(), **kw)


def produce(pool, slots, seed):
    """Write random pages on the current stream, as an attention layer's KV write would."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    idx = torch.as_tensor(slots, device="cuda")
    dev = pool.device_tier
    for layer in range(pool.fmt.num_layers):
        for plane in range(pool.fmt.planes):
            vals = torch.randn((len(slots), *pool.fmt.plane_shape), generator=g, device="cuda") * 3
            dev.raw_plane(layer, plane).index_copy_(0, idx, vals.to(dev.kv.dtype).view(len(slots), -1).view(torch.uint8))
            if dev.scales is not None:
                dev.scales[layer, plane].index_copy_(0, idx, torch.rand((len(slots), *pool.fmt.scale_shape), generator=g, device="cuda") + 0.01)


def snap(pool, slots):
    dev = pool.device_tier
    data = dev.raw_pages()[:, :, slots].cpu()
    scales = None if dev.scales is None else dev.scales[:, :, slots].cpu()
    return data, scales


@pytest.mark.parametrize(
    "dtype, scale", [("bf16", "none"), ("fp8_e4m3", "per_page_head"), ("fp8_e5m2", "per_token_head"), ("fp8_e4m3", "per_tensor")]
)
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_write_evict_reload_is_bit_exact(dtype, scale, policy):
    fmt = PageFormat(num_layers=4, num_kv_heads=4, head_dim=128, page_size=16, dtype=dtype, scale=scale)
    pool = make_pool(fmt, write_policy=policy)
    keys = prefix_keys(list(range(16 * 200)), 16, pool.namespace)
    truth = {}
    for i in range(0, 200, 20):  # 200 pages through 64 device slots: constant eviction
        slots = pool.allocate(20)
        produce(pool, slots, seed=i)
        data, scales = snap(pool, slots)
        for j, k in enumerate(keys[i : i + 20]):
            truth[k] = (data[:, :, j], None if scales is None else scales[:, :, j])
        pool.commit(keys[i : i + 20], slots)  # offload (write_through) starts at once, on its stream
        pool.release(slots)
    for i in range(0, 200, 25):
        batch = keys[i : i + 25]
        slots = pool.allocate(len(batch))
        pool.device_tier.raw_pages()[:, :, slots] = 0xFF  # poison
        handle = pool.load(batch, slots)
        for layer in range(fmt.num_layers):
            handle.wait_layer(layer)
        handle.wait()
        data, scales = snap(pool, slots)
        for j, k in enumerate(batch):
            assert torch.equal(data[:, :, j], truth[k][0]), f"page {i + j} data"
            if scales is not None:
                assert torch.equal(scales[:, :, j], truth[k][1]), f"page {i + j} scales"
        pool.release(slots)
    pool.close()


def test_upcast_on_reload_delivers_bf16_matching_float64_reference():
    fmt = PageFormat(num_layers=3, num_kv_heads=8, head_dim=128, page_size=16, dtype="fp8_e4m3", scale="per_token_head", device_dtype="bf16")
    pool = make_pool(fmt, write_policy="write_back")
    keys = prefix_keys(list(range(16 * 32)), 16, pool.namespace)
    slots = pool.allocate(32)
    produce(pool, slots, seed=5)
    original = pool.device_tier.kv[:, :, slots].clone()
    pool.commit(keys, slots)
    pool.release(slots)
    pool.evict(tier="device")
    handle = pool.load(keys)
    handle.wait()
    got = pool.device_tier.kv[:, :, handle.slots]
    for layer in range(3):
        for plane in range(2):
            q, s = quantize(original[layer, plane].cpu(), "fp8_e4m3", "per_token_head", "nhd")
            ref = dequantize(q, s, "per_token_head", "nhd", torch.float64).to(torch.bfloat16)
            assert torch.equal(got[layer, plane].cpu(), ref)
    pool.close()
