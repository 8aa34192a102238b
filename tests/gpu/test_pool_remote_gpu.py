"""TieredPool on a GPU with the NIXL remote tier: pinned host pages also registered with NIXL."""

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvtier import PageFormat, TieredPool, dequantize, prefix_keys, quantize

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("nixl_cu13")


@pytest.mark.parametrize("device_dtype", ["fp8_e4m3", "bf16"])
def test_pages_spill_to_the_remote_store_and_come_back(tmp_path, device_dtype):
    fmt = PageFormat(num_layers=4, num_kv_heads=4, head_dim=128, page_size=16, dtype="fp8_e4m3",
                     scale="per_page_head", device_dtype=device_dtype)
    pool = TieredPool(fmt, device="cuda", device_pages=32, host_pages=48, write_policy="write_back",
                      remote=str(tmp_path), registry=CollectorRegistry())
    keys = prefix_keys(list(range(16 * 160)), 16, pool.namespace)
    truth = {}
    g = torch.Generator(device="cuda").manual_seed(11)
    dev = pool.device_tier
    for i in range(0, 160, 16):  # 160 pages through 32 device and 48 host slots
        slots = pool.allocate(16)
        idx = torch.as_tensor(slots, device="cuda")
        for layer in range(fmt.num_layers):
            for plane in range(2):
                vals = torch.randn((16, *fmt.plane_shape), generator=g, device="cuda") * 3
                dev.kv[layer, plane].view(torch.uint8).view(dev.num_pages, -1).index_copy_(
                    0, idx, vals.to(dev.kv.dtype).view(16, -1).view(torch.uint8))
                if dev.scales is not None:
                    dev.scales[layer, plane].index_copy_(0, idx, torch.rand((16, 4), generator=g, device="cuda") + 0.01)
        for j, key in enumerate(keys[i : i + 16]):
            if dev.scales is not None:
                truth[key] = (dev.raw_pages()[:, :, slots[j]].cpu(), dev.scales[:, :, slots[j]].cpu())
            else:  # quantized on the way down, upcast on the way up: the codec says to what
                q, s = quantize(dev.kv[:, :, slots[j]].cpu(), "fp8_e4m3", "per_page_head", "nhd")
                truth[key] = (dequantize(q, s, "per_page_head", "nhd", torch.bfloat16), None)
        pool.commit(keys[i : i + 16], slots)
        pool.release(slots)
    assert pool.stats()["pages_moved"]["host_to_remote"] > 0
    m = pool.match(keys)
    assert m.total == 160 and m.remote > 0
    for i in range(0, 160, 20):
        handle = pool.load(keys[i : i + 20])
        handle.wait()
        for key, slot in zip(keys[i : i + 20], handle.slots):
            data, scales = truth[key]
            if device_dtype == "fp8_e4m3":  # pass-through: every byte and scale as written
                assert torch.equal(dev.raw_pages()[:, :, slot].cpu(), data)
                assert torch.equal(dev.scales[:, :, slot].cpu(), scales)
            else:
                assert torch.equal(dev.kv[:, :, slot].cpu(), data)
        pool.release(handle.slots)
    assert pool.stats()["pages_moved"]["remote_to_host"] > 0
    assert pool.flush() == 0
    pool.close()
