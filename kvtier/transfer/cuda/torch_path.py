"""The torch path: a device staging buffer laid out as host records, moved by plain copies.

Owns the CUDA engine's fallback where NVRTC or cuda-bindings is missing, and a second
reference in the tests: offload gathers pages into a device staging buffer with
index_select (quantizing through the codec), then one cudaMemcpyAsync per run of
consecutive host slots; reload is the reverse. Staging is bounded (TORCH_STAGING_BYTES);
larger batches go through it in chunks. Its quantize checks for NaN and infinity with a
sync on the offload stream: a fallback, not the hot path.
It must never choose which pages move.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.format import dequantize, quantize
from kvtier.tiers import DeviceTier, HostTier
from kvtier.transfer.cuda.plans import slot_runs
from kvtier.transfer.torch_engine import encodable_pages

# Device staging of the torch path is bounded; larger batches go through it in chunks.
TORCH_STAGING_BYTES = 256 * 1024 * 1024


class TorchPath:
    def __init__(self, device_tier: DeviceTier, host_tier: HostTier, device: torch.device) -> None:
        self.device_tier = device_tier
        self.host_tier = host_tier
        self.fmt = device_tier.fmt
        self.device = device

    def _staging_chunk(self) -> int:
        return max(1, TORCH_STAGING_BYTES // self.fmt.page_bytes)

    def offload(self, device_slots: torch.Tensor, host_idx: np.ndarray) -> tuple[list[torch.Tensor], list[int]]:
        """Queue the offload on the current stream; (staging to keep alive, failed positions)."""
        fmt, dev, host = self.fmt, self.device_tier, self.host_tier
        failed = []
        if fmt.converts:
            ok = encodable_pages(dev, device_slots).cpu()
            failed = (~ok).nonzero().flatten().tolist()
            if failed:
                keep = ok.nonzero().flatten()
                device_slots, host_idx = device_slots[keep.to(device_slots.device)], host_idx[keep.numpy()]
        chunk = self._staging_chunk()
        staged = []
        for start in range(0, host_idx.size, chunk):
            di = device_slots[start : start + chunk]
            count = di.numel()
            # Zeros, not empty: the padding of a record then holds no stale device bytes.
            staging = torch.zeros((count, fmt.page_bytes), dtype=torch.uint8, device=self.device)
            for layer in range(fmt.num_layers):
                for plane in range(fmt.planes):
                    data_at = fmt.data_offset(layer, plane)
                    data = slice(data_at, data_at + fmt.plane_elems * fmt.elem_bytes)
                    scale_at = fmt.scale_offset(layer, plane)
                    scale = slice(scale_at, scale_at + fmt.plane_scale_bytes)
                    if fmt.converts:
                        q, s = quantize(dev.plane(layer, plane).index_select(0, di), fmt.dtype, fmt.scale, fmt.layout)
                        staging[:, data] = q.view(torch.uint8).reshape(count, -1)
                        staging[:, scale] = s.reshape(count, -1).view(torch.uint8)
                        continue
                    staging[:, data] = dev.raw_plane(layer, plane).index_select(0, di)
                    if fmt.has_scales:
                        scales = dev.scale_plane(layer, plane).index_select(0, di)
                        staging[:, scale] = scales.reshape(count, -1).view(torch.uint8)
            for first, slot, run in slot_runs(host_idx[start : start + chunk]):
                host.buffer[slot : slot + run].copy_(staging[first : first + run], non_blocking=True)
            staged.append(staging)
        return staged, failed

    def reload(self, device_slots: torch.Tensor, host_idx: np.ndarray, keep: list, land_layer, layers: range | None = None) -> list:
        """Queue the reload of `layers` (None: all) on the current stream; land_layer(layer) after
        each layer's last chunk."""
        fmt, dev, host = self.fmt, self.device_tier, self.host_tier
        layers = range(fmt.num_layers) if layers is None else layers
        chunk = self._staging_chunk()
        starts = list(range(0, host_idx.size, chunk))
        events = []
        for start in starts:
            di = device_slots[start : start + chunk]
            count = di.numel()
            staging = torch.empty((count, fmt.page_bytes), dtype=torch.uint8, device=self.device)
            for first, slot, run in slot_runs(host_idx[start : start + chunk]):
                staging[first : first + run].copy_(host.buffer[slot : slot + run], non_blocking=True)
            keep.append(staging)
            for layer in layers:
                for plane in range(fmt.planes):
                    data_at = fmt.data_offset(layer, plane)
                    raw = staging[:, data_at : data_at + fmt.plane_elems * fmt.elem_bytes]
                    scale_at = fmt.scale_offset(layer, plane)
                    scale_raw = staging[:, scale_at : scale_at + fmt.plane_scale_bytes]
                    if fmt.converts:
                        q = raw.view(fmt.torch_dtype).view(count, *fmt.plane_shape)
                        s = scale_raw.view(torch.float32).view(count, *fmt.scale_shape)
                        pages = dequantize(q, s, fmt.scale, fmt.layout, fmt.device_torch_dtype)
                        dev.plane(layer, plane).index_copy_(0, di, pages)
                        continue
                    dev.raw_plane(layer, plane).index_copy_(0, di, raw)
                    if fmt.device_has_scales:
                        s = scale_raw.view(torch.float32).view(count, *fmt.scale_shape)
                        dev.scale_plane(layer, plane).index_copy_(0, di, s)
                # A layer has landed once the last chunk wrote it.
                if start == starts[-1]:
                    events.append(land_layer(layer))
        return events

    def device_copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        fmt, dev = self.fmt, self.device_tier
        for layer in range(fmt.num_layers):
            for plane in range(fmt.planes):
                raw = dev.raw_plane(layer, plane)  # bytes: index_copy_ has no fp8 kernels
                raw.index_copy_(0, dst, raw.index_select(0, src))
                if dev.has_scales:
                    scales = dev.scale_plane(layer, plane)
                    scales.index_copy_(0, dst, scales.index_select(0, src))
