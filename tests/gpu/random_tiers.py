"""Random tier contents shared by the GPU tests, the copy-plan tests and the sanitizer driver."""

import torch

from kvtier.format import FP8_MAX
from kvtier.tiers import DeviceTier, HostTier


def fill_random(dev: DeviceTier, host: HostTier, gen: torch.Generator) -> None:
    """Random, never-zero contents on CPU tiers: values for wide dtypes, valid fp8 codes, scales > 0."""
    fmt = dev.fmt
    if fmt.device_dtype in ("bf16", "fp16"):
        magnitude = torch.rand(dev.kv.shape, generator=gen) * 3 + 0.01
        sign = torch.randint(0, 2, dev.kv.shape, generator=gen) * 2 - 1
        dev.kv.copy_((magnitude * sign).to(dev.kv.dtype))
    else:
        dev.kv.view(torch.uint8).copy_(torch.randint(0, 256, dev.kv.shape, generator=gen, dtype=torch.uint8))
    if dev.scales is not None:
        dev.scales.copy_(torch.rand(dev.scales.shape, generator=gen) + 0.5)
    host.buffer.copy_(torch.randint(0, 256, host.buffer.shape, generator=gen, dtype=torch.uint8))
    if fmt.has_scales:
        fmax = FP8_MAX[fmt.dtype]
        for layer in range(fmt.num_layers):
            for plane in range(fmt.planes):
                view = host.data_view(layer, plane)
                view.copy_(((torch.rand(view.shape, generator=gen) * 2 - 1) * fmax).to(fmt.torch_dtype))
                scales = host.scale_view(layer, plane)
                # fp16 pages overflow past 65504: keep q * scale inside the range for e5m2.
                top = 1.0 if fmt.dtype == "fp8_e5m2" else 4.0
                scales.copy_(torch.rand(scales.shape, generator=gen) * top + 1e-3)
