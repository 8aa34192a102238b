"""The torch copy engine: the CPU twin of the CUDA engine and the reference it is tested against.

Owns page copies between a DeviceTier and a HostTier done with plain torch indexing, one
(layer, plane) at a time through the tier's accessors (so pool- and engine-owned device
memory alike), synchronously. Pass-through copies move raw bytes (uint8 views), so fp8
data and fp32 scales round-trip bit for bit; converting formats quantize on offload and
upcast on reload with kvtier.format.codec; a page holding a NaN or an infinity is left out
of a quantizing offload and reported by its ticket. It must never keep state between calls.
"""

from __future__ import annotations

import torch

from kvtier.format import dequantize, quantize
from kvtier.tiers import DeviceTier, HostTier
from kvtier.transfer.engine import DoneTicket, ReloadTransform, Ticket, TransferEngine, check_layers


class TorchEngine(TransferEngine):
    name = "torch"

    def __init__(self, device_tier: DeviceTier, host_tier: HostTier, transform: ReloadTransform | None = None) -> None:
        self.device_tier = device_tier
        self.host_tier = host_tier
        self.fmt = device_tier.fmt
        self.transform = transform

    def _index(self, slots: list[int], device: torch.device) -> torch.Tensor:
        return torch.as_tensor(slots, dtype=torch.int64, device=device)

    def offload(self, device_slots: list[int], host_slots: list[int], ready: object | None = None) -> Ticket:
        fmt, dev, host = self.fmt, self.device_tier, self.host_tier
        di = self._index(device_slots, dev.device)
        hi = self._index(host_slots, host.buffer.device)
        failed = []
        if fmt.converts:
            failed = encodable_pages(dev, di).logical_not().nonzero().flatten().tolist()
            if failed:
                keep = self._index(sorted(set(range(len(device_slots))) - set(failed)), dev.device)
                di, hi = di[keep], hi[keep.to(hi.device)]
            if di.numel() == 0:
                return DoneTicket(fmt.num_layers, failed)
        for layer in range(fmt.num_layers):
            for plane in range(fmt.planes):
                if fmt.converts:
                    pages = dev.plane(layer, plane).index_select(0, di)
                    q, s = quantize(pages, fmt.dtype, fmt.scale, fmt.layout)
                    host.raw_plane(layer, plane)[hi] = q.view(torch.uint8).reshape(len(hi), -1).to(host.buffer.device)
                    host.scale_view(layer, plane)[hi] = s.to(host.buffer.device)
                    continue
                host.raw_plane(layer, plane)[hi] = dev.raw_plane(layer, plane).index_select(0, di).to(host.buffer.device)
                if fmt.has_scales:
                    host.scale_view(layer, plane)[hi] = dev.scale_plane(layer, plane).index_select(0, di).to(host.buffer.device)
        return DoneTicket(fmt.num_layers, failed)

    reloads_layers = True

    def reload(self, host_slots: list[int], device_slots: list[int], ready: object | None = None) -> Ticket:
        return self._reload_pages(host_slots, device_slots, range(self.fmt.num_layers))

    def reload_layers(self, host_slots: list[int], device_slots: list[int], layers: range, ready: object | None = None) -> Ticket:
        check_layers(layers, self.fmt.num_layers)
        return self._reload_pages(host_slots, device_slots, layers)

    def _reload_pages(self, host_slots: list[int], device_slots: list[int], layers: range) -> Ticket:
        fmt, dev, host = self.fmt, self.device_tier, self.host_tier
        di = self._index(device_slots, dev.device)
        hi = self._index(host_slots, host.buffer.device)
        for layer in layers:
            for plane in range(fmt.planes):
                if fmt.converts:
                    q = host.data_view(layer, plane).index_select(0, hi)
                    s = host.scale_view(layer, plane).index_select(0, hi)
                    pages = dequantize(q, s, fmt.scale, fmt.layout, fmt.device_torch_dtype)
                    dev.plane(layer, plane).index_copy_(0, di, pages.to(dev.device))
                else:
                    dev.raw_plane(layer, plane).index_copy_(0, di, host.raw_plane(layer, plane).index_select(0, hi).to(dev.device))
                    if fmt.device_has_scales:
                        dev.scale_plane(layer, plane).index_copy_(0, di, host.scale_view(layer, plane).index_select(0, hi).to(dev.device))
                if self.transform is not None:
                    self.transform(layer, plane, dev.plane(layer, plane), di)
        return DoneTicket(fmt.num_layers)

    def device_copy(self, src_slots: list[int], dst_slots: list[int]) -> Ticket:
        dev = self.device_tier
        si = self._index(src_slots, dev.device)
        di = self._index(dst_slots, dev.device)
        for layer in range(self.fmt.num_layers):
            for plane in range(self.fmt.planes):
                raw = dev.raw_plane(layer, plane)  # bytes: index_copy_ has no fp8 kernels
                raw.index_copy_(0, di, raw.index_select(0, si))
                if dev.has_scales:
                    scales = dev.scale_plane(layer, plane)
                    scales.index_copy_(0, di, scales.index_select(0, si))
        return DoneTicket(self.fmt.num_layers)


def encodable_pages(dev: DeviceTier, slots: torch.Tensor) -> torch.Tensor:
    """Bool per entry of `slots`: the page holds no NaN or infinity in any layer or plane."""
    fmt = dev.fmt
    ok = torch.ones(slots.numel(), dtype=torch.bool, device=dev.device)
    for layer in range(fmt.num_layers):
        for plane in range(fmt.planes):
            ok &= torch.isfinite(dev.plane(layer, plane).index_select(0, slots)).flatten(1).all(dim=1)
    return ok
