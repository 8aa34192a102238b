"""Device tier memory: the pages the attention kernel reads.

Owns the per-(layer, plane) page tensors of the device tier (K and V, or the single MLA
latent plane) and, when the device keeps fp8 bytes as stored, their fp32 scales. The memory
is either the pool's own, one allocation of every layer (`kv[layer, plane]` is a contiguous
(num_pages, *plane_shape) tensor), or the serving engine's: sglang's per-layer
`k_buffer` / `v_buffer` lists, vLLM's per-layer `kv_caches` whose K and V interleave per
block. Either way a page of one plane is contiguous in memory, and the page stride may be
larger than the page (interleaved K/V). Engines reach pages only through the accessors
(`plane`, `scale_plane`, `raw_plane`, `data_ptr`, `page_stride_bytes`), never through the
pool's allocation, so they work on either. On a machine without CUDA a CPU tensor stands
in, so the pool runs and is tested anywhere.
It must never track which page is in which slot (that is the index's job), and never copy
or reallocate engine-owned tensors: the engine's kernels read those very tensors.
"""

from __future__ import annotations

import difflib
import math

import torch

from kvtier.format import PageFormat
from kvtier.errors import DeviceError, TierSizeError
from kvtier.tiers.memory import check_fits, gib

PLANE_NAMES = ("K", "V")
DEVICE_TYPES = ("cpu", "cuda")
# Names people reach for that torch spells otherwise.
_DEVICE_ALIASES = {"gpu": "cuda", "nvidia": "cuda", "cuda0": "cuda:0", "host": "cpu"}


def resolve_device(device: str | torch.device) -> torch.device:
    """The torch device ``device`` names, if the device tier can live there on this machine;
    DeviceError naming the value, what is there (the CUDA build and devices) and the fix."""
    if isinstance(device, torch.device):
        found = device
    elif isinstance(device, str):
        try:
            found = torch.device(device)
        except RuntimeError:
            word = device.strip().lower()
            near = _DEVICE_ALIASES.get(word) or next(iter(difflib.get_close_matches(word, DEVICE_TYPES, 1, 0.5)), None)
            hint = f"did you mean {near!r}? " if near else ""
            raise DeviceError(
                f"device={device!r} is not a device name: {hint}expected 'cpu', 'cuda' or 'cuda:N'"
            ) from None
    else:
        raise DeviceError(
            f"device={device!r}: expected 'cpu', 'cuda', 'cuda:N' or a torch.device, got {type(device).__name__}"
        )
    if found.type not in DEVICE_TYPES:
        raise DeviceError(f"device={device!r}: kvtier's device tier runs on 'cpu' or 'cuda', not {found.type!r}")
    if found.type == "cuda":
        if torch.version.cuda is None:
            raise DeviceError(
                f"device={device!r} needs CUDA, but this torch {torch.__version__} is a CPU-only build: install a "
                "CUDA build (pip install torch --index-url https://download.pytorch.org/whl/cu130) or use device='cpu'"
            )
        count = torch.cuda.device_count()
        if count == 0:
            raise DeviceError(
                f"device={device!r} needs a GPU, but torch {torch.__version__} (CUDA {torch.version.cuda}) sees none: "
                "check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES, or use device='cpu'"
            )
        if found.index is not None and found.index >= count:
            raise DeviceError(
                f"device={device!r}: this machine has {count} visible GPU{'s' if count > 1 else ''} "
                f"(cuda:0 to cuda:{count - 1}); pick one of those"
            )
    return found


class DeviceTier:
    """Pages of every layer on one device.

    kv: None (the tier allocates `num_pages` pages) or the engine's tensors: `(K, V)`, or
    `(latent, None)` under MLA, each a stacked (num_layers, num_pages, *plane_shape) tensor
    or a list of num_layers (num_pages, *plane_shape) tensors in `fmt.device_torch_dtype`.
    scales: the same structure of (num_pages, *scale_shape) fp32 tensors, given exactly when
    `fmt.device_has_scales` and kv is given. num_pages and device default to the tensors'.
    """

    def __init__(
        self,
        fmt: PageFormat,
        num_pages: int | None = None,
        device: str | torch.device | None = None,
        kv=None,
        scales=None,
    ) -> None:
        if num_pages is not None and (isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0):
            raise ValueError(f"device_pages must be a positive int, got {num_pages!r}")
        self.fmt = fmt
        self._kv: torch.Tensor | None = None
        self._scales: torch.Tensor | None = None
        if kv is None:
            if scales is not None:
                raise ValueError("device scales were given without device kv; pass both or neither")
            if num_pages is None:
                raise ValueError("device_pages is required when the tier allocates its own pages (kv=None)")
            self._allocate(num_pages, resolve_device("cpu" if device is None else device))
            return
        planes = _planes_of(fmt, kv, "kv", fmt.plane_shape, fmt.device_torch_dtype)
        self.num_pages = _pages_of(fmt, planes, "kv", num_pages)
        self.device = _device_of(fmt, planes, "kv", device)
        _check_distinct(fmt, planes, "kv")
        self._planes = planes
        if fmt.device_has_scales:
            if scales is None:
                raise ValueError(
                    f"{fmt.describe()} keeps fp8 with scales on the device: pass device scales "
                    "alongside the device kv"
                )
            self._scale_planes = _planes_of(fmt, scales, "scales", fmt.scale_shape, torch.float32)
            _pages_of(fmt, self._scale_planes, "scales", self.num_pages)
            _device_of(fmt, self._scale_planes, "scales", self.device)
            _check_distinct(fmt, self._scale_planes, "scales")
        elif scales is not None:
            raise ValueError(f"{fmt.describe()} keeps no scales on the device, but device scales were given")
        else:
            self._scale_planes = None

    def _allocate(self, num_pages: int, device: torch.device) -> None:
        fmt = self.fmt
        self.num_pages = num_pages
        self.device = device
        per_page = fmt.num_layers * fmt.planes * (
            fmt.device_plane_bytes + (fmt.plane_scale_bytes if fmt.device_has_scales else 0)
        )
        check_fits("device_pages", num_pages, num_pages * per_page, per_page, device)
        try:
            self._allocate_tensors(num_pages, device)
        except torch.OutOfMemoryError as err:  # the check raced another allocation
            raise TierSizeError(
                f"device_pages={num_pages} ({gib(num_pages * per_page)}) could not be allocated on {device}: "
                f"{str(err).splitlines()[0]}; set device_pages lower"
            ) from None
        self.device = self._kv.device

    def _allocate_tensors(self, num_pages: int, device: torch.device) -> None:
        fmt = self.fmt
        self._kv = torch.empty(
            (fmt.num_layers, fmt.planes, num_pages, *fmt.plane_shape), dtype=fmt.device_torch_dtype, device=device
        )
        self._planes = [[self._kv[layer, plane] for plane in range(fmt.planes)] for layer in range(fmt.num_layers)]
        self._scale_planes = None
        if fmt.device_has_scales:
            self._scales = torch.empty(
                (fmt.num_layers, fmt.planes, num_pages, *fmt.scale_shape), dtype=torch.float32, device=device
            )
            self._scale_planes = [
                [self._scales[layer, plane] for plane in range(fmt.planes)] for layer in range(fmt.num_layers)
            ]

    # --- the pool's own allocation ---------------------------------------------------------
    @property
    def pool_owned(self) -> bool:
        """True when the tier allocated its pages itself (one tensor of every layer)."""
        return self._kv is not None

    @property
    def kv(self) -> torch.Tensor:
        """The pool-owned allocation (num_layers, planes, num_pages, *plane_shape)."""
        if self._kv is None:
            raise AttributeError(
                "DeviceTier.kv exists only when the tier allocates its pages; this tier holds the "
                "engine's tensors: use plane(layer, plane)"
            )
        return self._kv

    @property
    def scales(self) -> torch.Tensor | None:
        """The pool-owned scale allocation (num_layers, planes, num_pages, *scale_shape), or None."""
        if self._kv is None and self._scale_planes is not None:
            raise AttributeError(
                "DeviceTier.scales exists only when the tier allocates its pages; this tier holds the "
                "engine's tensors: use scale_plane(layer, plane)"
            )
        return self._scales

    def raw_pages(self) -> torch.Tensor:
        """The pool-owned allocation as (num_layers, planes, num_pages, device_plane_bytes) uint8."""
        fmt = self.fmt
        return self.kv.view(fmt.num_layers, fmt.planes, self.num_pages, -1).view(torch.uint8)

    # --- accessors every engine uses ----------------------------------------------------------
    def plane(self, layer: int, plane: int) -> torch.Tensor:
        """(num_pages, *plane_shape) pages of one layer's plane, in the device dtype."""
        self._check(layer, plane)
        return self._planes[layer][plane]

    def scale_plane(self, layer: int, plane: int) -> torch.Tensor | None:
        """(num_pages, *scale_shape) fp32 scales of one layer's plane (None without device scales)."""
        self._check(layer, plane)
        return None if self._scale_planes is None else self._scale_planes[layer][plane]

    def raw_plane(self, layer: int, plane: int) -> torch.Tensor:
        """(num_pages, device_plane_bytes) uint8 view of one layer's plane; row stride = page stride."""
        pages = self.plane(layer, plane)
        return pages.view(torch.uint8).view(self.num_pages, self.fmt.device_plane_bytes)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        self._check(layer, 0)
        if self.fmt.mla:
            return self._planes[layer][0], None
        return self._planes[layer][0], self._planes[layer][1]

    def layer_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        self._check(layer, 0)
        if self._scale_planes is None:
            return None, None
        if self.fmt.mla:
            return self._scale_planes[layer][0], None
        return self._scale_planes[layer][0], self._scale_planes[layer][1]

    def data_ptr(self, layer: int, plane: int) -> int:
        """Address of page 0 of one layer's plane."""
        return self.plane(layer, plane).data_ptr()

    def page_stride_bytes(self, layer: int, plane: int) -> int:
        """Bytes from one page of a layer's plane to the next (>= device_plane_bytes)."""
        return self.plane(layer, plane).stride(0) * self.fmt.device_elem_bytes

    @property
    def has_scales(self) -> bool:
        return self._scale_planes is not None

    @property
    def nbytes(self) -> int:
        """Bytes of page data and scales the tier holds (gaps between interleaved pages left out)."""
        fmt = self.fmt
        per_page = fmt.device_plane_bytes + (fmt.plane_scale_bytes if self.has_scales else 0)
        return fmt.num_layers * fmt.planes * self.num_pages * per_page

    def _check(self, layer: int, plane: int) -> None:
        if not 0 <= layer < self.fmt.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.fmt.num_layers})")
        if not 0 <= plane < self.fmt.planes:
            raise IndexError(f"plane {plane} out of range [0, {self.fmt.planes})")


# --- validation of engine-owned tensors ------------------------------------------------------
def _plane_name(fmt: PageFormat, plane: int) -> str:
    return "latent" if fmt.mla else PLANE_NAMES[plane]


def _planes_of(fmt: PageFormat, given, what: str, page_shape: tuple, dtype: torch.dtype) -> list[list[torch.Tensor]]:
    """[layer][plane] tensors of `given` ((K, V) or (latent, None)), each checked."""
    if not isinstance(given, (tuple, list)) or len(given) != 2:
        expected = "(latent, None)" if fmt.mla else "(K, V)"
        raise ValueError(f"device {what} must be a pair {expected}, got {type(given).__name__} of {_length(given)}")
    if fmt.mla and given[1] is not None:
        raise ValueError(f"device {what} under MLA is (latent, None): the second entry must be None, got {type(given[1]).__name__}")
    per_plane = []
    for plane in range(fmt.planes):
        entry, name = given[plane], f"{what} {_plane_name(fmt, plane)}"
        if isinstance(entry, torch.Tensor):
            if entry.dim() != len(page_shape) + 2 or entry.shape[0] != fmt.num_layers:
                raise ValueError(
                    f"device {name} stacked tensor must be (num_layers={fmt.num_layers}, num_pages, "
                    f"*{tuple(page_shape)}), got shape {tuple(entry.shape)}"
                )
            layers = [entry[layer] for layer in range(fmt.num_layers)]
        elif isinstance(entry, (tuple, list)):
            if len(entry) != fmt.num_layers:
                raise ValueError(f"device {name} must list num_layers={fmt.num_layers} tensors, got {len(entry)}")
            layers = list(entry)
        else:
            raise ValueError(f"device {name} must be a tensor or a list of tensors, got {type(entry).__name__}")
        for layer, tensor in enumerate(layers):
            _check_pages(tensor, f"device {name} layer {layer}", page_shape, dtype)
        per_plane.append(layers)
    return [[per_plane[plane][layer] for plane in range(fmt.planes)] for layer in range(fmt.num_layers)]


def _check_distinct(fmt: PageFormat, planes: list[list[torch.Tensor]], what: str) -> None:
    """No two (layer, plane) tensors start at one address (the same tensor passed twice)."""
    seen: dict[int, str] = {}
    for layer, row in enumerate(planes):
        for plane, tensor in enumerate(row):
            name = f"{what} {_plane_name(fmt, plane)} layer {layer}"
            if tensor.data_ptr() in seen:
                raise ValueError(f"device {name} starts at the same address as {seen[tensor.data_ptr()]}: planes must not share memory")
            seen[tensor.data_ptr()] = name


def _length(value) -> str:
    return f"length {len(value)}" if isinstance(value, (tuple, list)) else "no length"


def _check_pages(tensor, name: str, page_shape: tuple, dtype: torch.dtype) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != len(page_shape) + 1 or tuple(tensor.shape[1:]) != tuple(page_shape):
        raise ValueError(f"{name} must be (num_pages, *{tuple(page_shape)}), got shape {tuple(tensor.shape)}")
    if tensor.dtype != dtype:
        raise ValueError(f"{name} has dtype {tensor.dtype}, expected {dtype}")
    if tensor.shape[0] == 0:
        raise ValueError(f"{name} has no pages (shape {tuple(tensor.shape)})")
    expected = _contiguous_strides(page_shape)
    got = tensor.stride()[1:]
    if any(size != 1 and s != e for size, s, e in zip(page_shape, got, expected)):
        raise ValueError(f"{name}: a page must be contiguous, expected page strides {expected}, got {tuple(got)}")
    elems = math.prod(page_shape)
    if tensor.shape[0] > 1 and tensor.stride(0) < elems:
        raise ValueError(f"{name}: pages overlap, page stride {tensor.stride(0)} elements < {elems} per page")


def _contiguous_strides(shape: tuple) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _pages_of(fmt: PageFormat, planes: list[list[torch.Tensor]], what: str, expected: int | None) -> int:
    first = planes[0][0].shape[0]
    for layer, row in enumerate(planes):
        for plane, tensor in enumerate(row):
            if tensor.shape[0] != first:
                raise ValueError(
                    f"device {what} {_plane_name(fmt, plane)} layer {layer} holds {tensor.shape[0]} pages, "
                    f"expected {first} like layer 0"
                )
    if expected is not None and expected != first:
        raise ValueError(f"device_pages={expected} conflicts with the device {what} tensors, which hold {first} pages")
    return first


def _device_of(fmt: PageFormat, planes: list[list[torch.Tensor]], what: str, device) -> torch.device:
    found = planes[0][0].device
    for layer, row in enumerate(planes):
        for plane, tensor in enumerate(row):
            if tensor.device != found:
                raise ValueError(
                    f"device {what} {_plane_name(fmt, plane)} layer {layer} is on {tensor.device}, "
                    f"expected {found} like layer 0"
                )
    if device is not None:
        wanted = resolve_device(device)
        if wanted.type == "cuda" and wanted.index is None and found.type == "cuda":
            wanted = torch.device("cuda", torch.cuda.current_device())
        if wanted != found:
            raise ValueError(f"device {what} tensors are on {found}, expected device={wanted}")
    return found
