"""FP8 codec: quantize bf16/fp16 pages to fp8 with fp32 scales, and dequantize back.

Owns the torch reference of the conversion, on any device. The fused CUDA kernels in
native/ must match it bit for bit on the quantized bytes and scales. It must never pick a
granularity or dtype itself: the page format says which.

Tensors carry pages in their trailing three dims (`plane_shape` of the layout); scales
carry the matching trailing dims of `scale_shape`. scale = amax / fp8 max over each group
(e4m3fn max 448, e5m2 max 57344); a group whose amax is zero gets scale 1. Dequantizing
multiplies by the scale, so power-of-two scales round-trip exactly.
"""

from __future__ import annotations

import torch

from kvtier.format.page_format import DTYPES, FP8_DTYPES, FP8_MAX, LAYOUTS

GRANULARITIES = ("per_tensor", "per_page_head", "per_token_head")


def _check(dtype: str, scale: str, layout: str) -> None:
    if dtype not in FP8_DTYPES:
        raise ValueError(f"fp8 dtype must be one of {FP8_DTYPES}, got {dtype!r}")
    if scale not in GRANULARITIES:
        raise ValueError(f"scale granularity must be one of {GRANULARITIES}, got {scale!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _reduce_dims(scale: str, layout: str) -> tuple[int, ...]:
    """Dims of a (..., a, b, head_dim) page reduced into one scale group."""
    if scale == "per_tensor":
        return (-3, -2, -1)
    if scale == "per_token_head":
        return (-1,)
    return (-3, -1) if layout == "nhd" else (-2, -1)


def expand_scales(scales: torch.Tensor, scale: str, layout: str) -> torch.Tensor:
    """Scales reshaped to broadcast against (..., *plane_shape)."""
    if scale == "per_tensor":
        return scales[..., None, None, None]
    if scale == "per_token_head":
        return scales[..., None]
    return scales[..., None, :, None] if layout == "nhd" else scales[..., :, None, None]


def compute_scales(x: torch.Tensor, dtype: str, scale: str, layout: str) -> torch.Tensor:
    amax = x.abs().float().amax(dim=_reduce_dims(scale, layout))
    # Divide by a tensor, not a Python float: on CUDA torch turns `t / float` into a multiply
    # by the fp32 reciprocal, which differs from the exact quotient in the last bit. The divisor
    # is filled on the device (new_full), not copied from the host (new_tensor copies from
    # pageable memory and so synchronizes the stream: a forward pass writing its pages would
    # block its host thread until everything queued before, prefetched pages included, landed).
    scales = amax / amax.new_full((), FP8_MAX[dtype])
    return torch.where(amax > 0, scales, torch.ones_like(scales))


def quantize(
    x: torch.Tensor, dtype: str, scale: str, layout: str = "nhd", scales: torch.Tensor | None = None,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 pages, fp32 scales) of bf16/fp16/fp32 pages `x` (..., *plane_shape).

    `scales`, when given, are used as they are (a checkpoint's per-tensor scale, say);
    values beyond the fp8 range then saturate to +-max.
    check_finite: refuse NaN / Inf in `x` (ValueError). The check reads a result back from
    the device, a sync per call; a model's forward pass that writes its own pages turns it
    off (a NaN or Inf there then reads back as NaN from its page: never a finite wrong value).
    """
    _check(dtype, scale, layout)
    if x.dim() < 3:
        raise ValueError(f"quantize needs pages with 3 trailing dims, got shape {tuple(x.shape)}")
    if check_finite and not torch.isfinite(x).all():
        bad = (~torch.isfinite(x)).sum().item()
        raise ValueError(f"quantize input holds {bad} NaN/Inf values; refusing to encode them")
    if scales is None:
        scales = compute_scales(x, dtype, scale, layout)
    elif not (scales > 0).all() or not torch.isfinite(scales).all():
        raise ValueError("quantize scales must be finite and > 0")
    fmax = FP8_MAX[dtype]
    q = (x.float() / expand_scales(scales, scale, layout)).clamp_(-fmax, fmax).to(DTYPES[dtype])
    return q, scales.float()


def dequantize(
    q: torch.Tensor, scales: torch.Tensor, scale: str, layout: str = "nhd", out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Pages `q` (fp8, (..., *plane_shape)) times their scales, in `out_dtype`."""
    if scale not in GRANULARITIES:
        raise ValueError(f"scale granularity must be one of {GRANULARITIES}, got {scale!r}")
    return (q.float() * expand_scales(scales.float(), scale, layout)).to(out_dtype)
