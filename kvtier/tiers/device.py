"""Device tier memory: the pages the attention kernel reads.

Owns one tensor of every layer's K and V (or MLA latent) pages and, when the device keeps
fp8 bytes as stored, their scales. Layer-major: `kv[layer, plane]` is one contiguous
(num_pages, *plane_shape) tensor, the per-layer view paged attention kernels take.
On a machine without CUDA a CPU tensor stands in, so the pool runs and is tested anywhere.
It must never track which page is in which slot: that is the index's job.
"""

from __future__ import annotations

import torch

from kvtier.format import PageFormat


class DeviceTier:
    def __init__(self, fmt: PageFormat, num_pages: int, device: str | torch.device = "cpu") -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
            raise ValueError(f"device_pages must be a positive int, got {num_pages!r}")
        self.fmt = fmt
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.kv = torch.empty(
            (fmt.num_layers, fmt.planes, num_pages, *fmt.plane_shape),
            dtype=fmt.device_torch_dtype,
            device=self.device,
        )
        self.scales = (
            torch.empty((fmt.num_layers, fmt.planes, num_pages, *fmt.scale_shape), dtype=torch.float32, device=self.device)
            if fmt.device_has_scales
            else None
        )

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        self._check_layer(layer)
        if self.fmt.mla:
            return self.kv[layer, 0], None
        return self.kv[layer, 0], self.kv[layer, 1]

    def layer_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        self._check_layer(layer)
        if self.scales is None:
            return None, None
        if self.fmt.mla:
            return self.scales[layer, 0], None
        return self.scales[layer, 0], self.scales[layer, 1]

    def raw_plane(self, layer: int, plane: int) -> torch.Tensor:
        """(num_pages, device_plane_bytes) uint8 view of one layer's plane."""
        return self.kv[layer, plane].view(self.num_pages, -1).view(torch.uint8)

    def raw_pages(self) -> torch.Tensor:
        """(num_layers, planes, num_pages, device_plane_bytes) uint8 view of every page."""
        fmt = self.fmt
        return self.kv.view(fmt.num_layers, fmt.planes, self.num_pages, -1).view(torch.uint8)

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + (self.scales.nbytes if self.scales is not None else 0)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.fmt.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.fmt.num_layers})")
