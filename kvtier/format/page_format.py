"""Page format: what one KV page is, byte for byte.

Owns the description of a page (layers, heads, head dim, tokens per page, dtype, scale
granularity, MLA, in-page layout), the sizes derived from it, the byte layout of a page in
the host and remote tiers, and the fingerprint that goes into every key namespace.
It must never allocate memory or touch a device.

Host / remote page record (one contiguous byte range, so one copy moves data and scales):

    [ data: for layer in layers, for plane in planes: plane_data_bytes ] (padded to 16)
    [ scales: for layer in layers, for plane in planes: scales_per_plane fp32 ] (padded to 16)

A plane is K or V (or the single latent plane under MLA). Inside a plane the elements are in
`layout` order: "nhd" = (page_size, num_kv_heads, head_dim), "hnd" = (num_kv_heads,
page_size, head_dim). Scales of a plane: per_tensor () , per_page_head (num_kv_heads,),
per_token_head (page_size, num_kv_heads) for nhd and (num_kv_heads, page_size) for hnd.

The device tier keeps one tensor per (layer, plane) of shape (device_pages, *plane_shape)
in `device_dtype`, and a scale tensor (device_pages, *scale_shape) when the device dtype
is fp8 and the format has scales.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass, field

import torch

DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
# The names engines use for the same dtypes (vLLM and SGLang kv_cache_dtype, torch), matched
# without regard to case and a leading "torch.". Bare "fp8" is e4m3, as in vLLM and SGLang.
DTYPE_ALIASES = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "fp8": "fp8_e4m3",
    "fp8_e4m3": "fp8_e4m3",
    "fp8_e4m3fn": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2",
    "float8_e5m2": "fp8_e5m2",
}
FP8_DTYPES = ("fp8_e4m3", "fp8_e5m2")
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
SCALES = ("none", "per_tensor", "per_page_head", "per_token_head")
LAYOUTS = ("nhd", "hnd")
ALIGN = 16
SCALE_BYTES = 4  # fp32

# Bump when the byte layout above changes: old stores must then miss, never decode garbage.
LAYOUT_VERSION = 1


def _align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def canonical_dtype(value: str | torch.dtype, field: str = "dtype") -> str:
    """kvtier's name ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2") of a dtype name or torch dtype.

    `field` names the option in the error raised for anything else.
    """
    if isinstance(value, torch.dtype):
        for name, dtype in DTYPES.items():
            if dtype == value:
                return name
    elif isinstance(value, str):
        key = value.strip().lower()
        found = DTYPE_ALIASES.get(key.removeprefix("torch."))
        if found is not None:
            return found
    aliases = sorted(set(DTYPE_ALIASES) - set(DTYPES))
    raise ValueError(
        f"{field} must be one of {list(DTYPES)}, an engine's name for one {aliases}, "
        f"or one of {[str(d) for d in DTYPES.values()]}; got {value!r}"
    )


@dataclass(frozen=True)
class PageFormat:
    """A KV page: `page_size` tokens of every layer, K and V (or one MLA latent plane).

    `dtype` is what the host and remote tiers store; `device_dtype` (default: `dtype`) is
    what the attention kernel is handed on the device. With fp8 storage and a bf16 device
    dtype, pages are upcast on reload and quantized (lossy) on offload. Both take kvtier's
    names, the names engines use ("fp8" for e4m3, "fp8_e4m3fn", "bfloat16", "half", ...) or a
    torch dtype, and hold kvtier's name afterwards.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str | torch.dtype = "bf16"
    scale: str = "none"
    mla: bool = False
    layout: str = "nhd"
    device_dtype: str | torch.dtype | None = None
    allow_unscaled_fp8: bool = False
    planes: int = field(init=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"PageFormat.{name} must be a positive int, got {value!r}")
        # Stored under kvtier's own names, so the fingerprint and equality do not depend on
        # which spelling the engine used.
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype, "PageFormat.dtype"))
        if self.device_dtype is None:
            object.__setattr__(self, "device_dtype", self.dtype)
        object.__setattr__(self, "device_dtype", canonical_dtype(self.device_dtype, "PageFormat.device_dtype"))
        if self.scale not in SCALES:
            raise ValueError(f"PageFormat.scale must be one of {SCALES}, got {self.scale!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"PageFormat.layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.dtype in FP8_DTYPES:
            if self.scale == "none" and not self.allow_unscaled_fp8:
                raise ValueError(
                    f"PageFormat.scale='none' with dtype={self.dtype!r} stores fp8 without scales; "
                    "pass allow_unscaled_fp8=True if that is really meant"
                )
        elif self.scale != "none":
            raise ValueError(
                f"PageFormat.scale must be 'none' for dtype={self.dtype!r} (scales belong to fp8), "
                f"got {self.scale!r}"
            )
        if self.device_dtype != self.dtype:
            if self.device_dtype in FP8_DTYPES:
                raise ValueError(
                    f"PageFormat.device_dtype={self.device_dtype!r} differs from dtype={self.dtype!r}: "
                    "the device may hold a wider dtype than storage (fp8 -> bf16), never fp8 over another"
                )
            if self.dtype not in FP8_DTYPES:
                raise ValueError(
                    f"PageFormat.device_dtype={self.device_dtype!r} with dtype={self.dtype!r}: "
                    "conversion between tiers is defined for fp8 storage only"
                )
            if self.scale == "none":
                raise ValueError(
                    "PageFormat.scale='none' cannot convert fp8 storage to "
                    f"device_dtype={self.device_dtype!r}: quantizing needs scales"
                )
        if self.mla and self.num_kv_heads != 1:
            raise ValueError(f"PageFormat.num_kv_heads must be 1 with mla=True, got {self.num_kv_heads}")
        object.__setattr__(self, "planes", 1 if self.mla else 2)

    # --- sizes -------------------------------------------------------------------------
    # The record sizes are computed once per format (the fields are frozen): the pool and the
    # engines read page_bytes on every transfer.
    @property
    def elem_bytes(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def device_elem_bytes(self) -> int:
        return DTYPES[self.device_dtype].itemsize

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def device_torch_dtype(self) -> torch.dtype:
        return DTYPES[self.device_dtype]

    @property
    def has_scales(self) -> bool:
        return self.scale != "none"

    @property
    def device_has_scales(self) -> bool:
        """The device keeps scales only when it keeps the stored fp8 bytes as they are."""
        return self.has_scales and self.device_dtype == self.dtype

    @property
    def converts(self) -> bool:
        """Pages change dtype between device and host (quantize down, upcast up)."""
        return self.device_dtype != self.dtype

    @property
    def plane_shape(self) -> tuple[int, int, int]:
        if self.layout == "nhd":
            return (self.page_size, self.num_kv_heads, self.head_dim)
        return (self.num_kv_heads, self.page_size, self.head_dim)

    @property
    def scale_shape(self) -> tuple[int, ...]:
        if self.scale in ("none", "per_tensor"):
            return ()
        if self.scale == "per_page_head":
            return (self.num_kv_heads,)
        if self.layout == "nhd":
            return (self.page_size, self.num_kv_heads)
        return (self.num_kv_heads, self.page_size)

    @property
    def plane_elems(self) -> int:
        return self.page_size * self.num_kv_heads * self.head_dim

    @property
    def scales_per_plane(self) -> int:
        return 0 if self.scale == "none" else math.prod(self.scale_shape)

    @functools.cached_property
    def plane_data_bytes(self) -> int:
        """Bytes of one (layer, plane) in storage dtype, padded so every plane starts aligned."""
        return _align(self.plane_elems * self.elem_bytes)

    @property
    def plane_scale_bytes(self) -> int:
        return self.scales_per_plane * SCALE_BYTES

    @functools.cached_property
    def data_bytes(self) -> int:
        return self.num_layers * self.planes * self.plane_data_bytes

    @functools.cached_property
    def scale_bytes(self) -> int:
        return _align(self.num_layers * self.planes * self.plane_scale_bytes)

    @functools.cached_property
    def page_bytes(self) -> int:
        """Bytes of one page record in the host and remote tiers: data, then scales."""
        return self.data_bytes + self.scale_bytes

    @property
    def device_plane_bytes(self) -> int:
        return self.plane_elems * self.device_elem_bytes

    def data_offset(self, layer: int, plane: int) -> int:
        return (layer * self.planes + plane) * self.plane_data_bytes

    def scale_offset(self, layer: int, plane: int) -> int:
        return self.data_bytes + (layer * self.planes + plane) * self.plane_scale_bytes

    # --- identity ----------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        """sha256 (hex) of every field that defines the stored bytes, plus the layout version.

        `device_dtype` is left out on purpose: it says how pages are delivered to one engine's
        kernel, not what the stored bytes mean, so engines with different kernels share pages.
        """
        text = (
            f"kvtier-page-v{LAYOUT_VERSION}|layers={self.num_layers}|heads={self.num_kv_heads}"
            f"|head_dim={self.head_dim}|page_size={self.page_size}|dtype={self.dtype}"
            f"|scale={self.scale}|mla={int(self.mla)}|layout={self.layout}"
            f"|page_bytes={self.page_bytes}"
        )
        return hashlib.sha256(text.encode()).hexdigest()

    def describe(self) -> str:
        kind = "mla" if self.mla else "kv"
        conv = f"->{self.device_dtype}" if self.converts else ""
        return (
            f"{self.num_layers}L x {kind} x {self.num_kv_heads}h x {self.head_dim}d x {self.page_size}t "
            f"{self.dtype}{conv} scale={self.scale} layout={self.layout}: {self.page_bytes} B/page"
        )
