"""Random tier contents shared by the GPU tests, the copy-plan tests and the sanitizer driver."""

import torch

from kvtier.format import FP8_MAX
from kvtier.tiers import DeviceTier, HostTier


def fill_random(dev: DeviceTier, host: HostTier, gen: torch.Generator) -> None:
    """Random, never-zero contents on CPU tiers: values for wide dtypes, valid fp8 codes, scales > 0.

    Goes through the tier's accessors, so pool-owned and engine-owned device tiers fill alike.
    """
    fmt = dev.fmt
    for layer in range(fmt.num_layers):
        for plane in range(fmt.planes):
            pages = dev.plane(layer, plane)
            if fmt.device_dtype in ("bf16", "fp16"):
                magnitude = torch.rand(pages.shape, generator=gen) * 3 + 0.01
                sign = torch.randint(0, 2, pages.shape, generator=gen) * 2 - 1
                pages.copy_((magnitude * sign).to(pages.dtype))
            else:
                pages.view(torch.uint8).copy_(torch.randint(0, 256, pages.shape, generator=gen, dtype=torch.uint8))
            if dev.has_scales:
                scales = dev.scale_plane(layer, plane)
                scales.copy_(torch.rand(scales.shape, generator=gen) + 0.5)
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
