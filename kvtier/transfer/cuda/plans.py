"""Address plans of the CUDA engine: where every byte of a transfer lies, as plain numpy.

Owns the arithmetic the kernels of native/ and the copy engines follow: the per-(layer,
plane) table of device bases and page strides (built once per engine from the DeviceTier
accessors, so engine-owned per-layer tensors and interleaved K/V work like the pool's own
allocation), host record offsets, access widths, scale groups, chunk counts, the kernels'
argument records, and the (dst, src, size) lists of the copy-engine path. Nothing here
touches a GPU: the CPU tests replay these plans over CPU tiers against TorchEngine.
It must never launch, allocate device memory or decide which pages move.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtier.format import FP8_MAX, PageFormat
from kvtier.tiers import DeviceTier

# Threads per block and units per thread of native/*.cu (KVTIER_THREADS, KVTIER_*_UNROLL):
# a chunk is one loop trip of every thread of a block.
THREADS = 256
COPY_CHUNK = THREADS * 4
CONVERT_CHUNK = THREADS * 2
SCALE_WORD = 4
DIRECTIONS = ("offload", "reload", "device")

# Kernel argument records: every field is 8 bytes, in the order of the C structs.
SIGNAL_FIELDS = ("flags", "arrived", "finished", "seq", "num_layers", "chunks_per_layer")
COPY_FIELDS = SIGNAL_FIELDS + (
    "table", "records", "src_slots", "dst_slots", "num_pages", "first_layer", "planes", "table_row",
    "record_bytes", "data_bytes", "plane_data_bytes", "piece_bytes", "scale_piece_bytes", "data_chunks",
)
UPCAST_FIELDS = SIGNAL_FIELDS + (
    "table", "records", "src_slots", "dst_slots", "num_pages", "first_layer", "planes", "table_row",
    "record_bytes", "data_bytes", "plane_data_bytes", "plane_scale_bytes", "plane_elems", "scale_div", "scale_mod",
)
QUANTIZE_FIELDS = SIGNAL_FIELDS + (
    "table", "records", "src_slots", "dst_slots", "failed", "num_pages", "first_layer", "planes", "table_row",
    "record_bytes", "data_bytes", "plane_data_bytes", "plane_scale_bytes", "groups_per_piece", "group_stride",
    "seg_count", "seg_len", "seg_stride", "team_size", "fp8_max",
)
ARG_FIELDS = {"copy": COPY_FIELDS, "upcast": UPCAST_FIELDS, "quantize": QUANTIZE_FIELDS}


def field(kind: str, name: str) -> int:
    """Index of field `name` in the argument record of kernel family `kind`."""
    return ARG_FIELDS[kind].index(name)


# --- the device table ------------------------------------------------------------------------
def device_table(dev: DeviceTier) -> np.ndarray:
    """(4, num_layers * planes) int64: data base, data page stride, scale base, scale page stride
    (bytes) of every (layer, plane), row = layer * planes + plane; scale rows 0 without scales."""
    fmt = dev.fmt
    table = np.zeros((4, fmt.num_layers * fmt.planes), dtype=np.int64)
    for layer in range(fmt.num_layers):
        for plane in range(fmt.planes):
            row = layer * fmt.planes + plane
            table[0, row] = dev.data_ptr(layer, plane)
            table[1, row] = dev.page_stride_bytes(layer, plane)
            scales = dev.scale_plane(layer, plane)
            if scales is not None:
                table[2, row] = scales.data_ptr()
                table[3, row] = scales.stride(0) * SCALE_WORD
    return table


def word_bytes(*values: int) -> int:
    """The widest access (16, 8, 4, 2 or 1 bytes) that divides every address, stride and size."""
    for width in (16, 8, 4, 2):
        if all(int(v) % width == 0 for v in values):
            return width
    return 1


def data_word_bytes(fmt: PageFormat, table: np.ndarray, records: int, direction: str) -> int:
    """Access width of a pass-through copy's data in `direction` (scales always move as 4 bytes)."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    values = [*table[0].tolist(), *table[1].tolist(), fmt.device_plane_bytes]
    if direction != "device":
        if fmt.converts:
            raise ValueError(f"{direction} of {fmt.describe()} converts dtypes; it has no pass-through copy")
        values += [records, fmt.page_bytes, fmt.plane_data_bytes]
    return word_bytes(*values)


# --- scale groups and conversion shapes ----------------------------------------------------------
@dataclass(frozen=True)
class ScaleGroups:
    """One plane's scale groups in elements (codec._reduce_dims, in scale_shape order).

    Group g starts at g * group_stride and is `seg_count` runs of `seg_len` contiguous
    elements, `seg_stride` apart. Element e of a plane belongs to group (e // scale_div) % scale_mod.
    """

    groups_per_piece: int
    group_stride: int
    seg_count: int
    seg_len: int
    seg_stride: int
    scale_div: int
    scale_mod: int


def scale_groups(fmt: PageFormat) -> ScaleGroups:
    tokens, heads, dim = fmt.page_size, fmt.num_kv_heads, fmt.head_dim
    if fmt.scale == "per_tensor":
        return ScaleGroups(1, 0, 1, fmt.plane_elems, 0, fmt.plane_elems, 1)
    if fmt.scale == "per_token_head":
        return ScaleGroups(tokens * heads, dim, 1, dim, 0, dim, tokens * heads)
    if fmt.scale == "per_page_head":
        if fmt.layout == "nhd":
            return ScaleGroups(heads, dim, tokens, dim, heads * dim, dim, heads)
        return ScaleGroups(heads, tokens * dim, 1, tokens * dim, 0, tokens * dim, heads)
    raise ValueError(f"scale groups need a format with scales, got scale={fmt.scale!r}")


def convert_vector(fmt: PageFormat, table: np.ndarray | None = None) -> int:
    """Elements per thread of the converting kernels: 16 when every run, plane, device base and
    page stride allows 16-element (32-byte device, 16-byte record) accesses, else 1."""
    groups = scale_groups(fmt)
    aligned = (fmt.plane_elems, groups.group_stride, groups.seg_len, groups.seg_stride, groups.scale_div)
    if not all(v % 16 == 0 for v in aligned):
        return 1
    if table is not None and not all(int(v) % 32 == 0 for v in (*table[0].tolist(), *table[1].tolist())):
        return 1
    return 16


def team_size(runs_per_group: int) -> int:
    """Lanes that share one scale group in the quantize kernel: a power of two, at most a warp."""
    team = 1
    while team < runs_per_group and team < 32:
        team *= 2
    return team


# --- chunks -------------------------------------------------------------------------------------
def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Chunks:
    """How one launch's work per layer is cut: `per_layer` chunks, the first `data` of them data."""

    per_layer: int
    data: int


def copy_chunks(fmt: PageFormat, num_pages: int, width: int, scales: bool) -> Chunks:
    data = _ceil(num_pages * fmt.planes * (fmt.device_plane_bytes // width), COPY_CHUNK)
    scale = _ceil(num_pages * fmt.planes * (fmt.plane_scale_bytes // SCALE_WORD), COPY_CHUNK) if scales else 0
    return Chunks(data + scale, data)


def upcast_chunks(fmt: PageFormat, num_pages: int, vec: int) -> Chunks:
    per_layer = _ceil(num_pages * fmt.planes * (fmt.plane_elems // vec), CONVERT_CHUNK)
    return Chunks(per_layer, per_layer)


def quantize_chunks(fmt: PageFormat, num_pages: int, team: int) -> Chunks:
    per_layer = _ceil(num_pages * fmt.planes * scale_groups(fmt).groups_per_piece, THREADS // team)
    return Chunks(per_layer, per_layer)


# --- argument records ---------------------------------------------------------------------------
def copy_args(fmt: PageFormat, table_ptr: int, records: int, moves_scales: bool) -> np.ndarray:
    """The copy kernels' record with every field fixed for the engine's life filled in."""
    args = np.zeros(len(COPY_FIELDS), dtype=np.int64)
    fixed = {
        "table": table_ptr, "records": records, "planes": fmt.planes, "table_row": fmt.num_layers * fmt.planes,
        "record_bytes": fmt.page_bytes, "data_bytes": fmt.data_bytes, "plane_data_bytes": fmt.plane_data_bytes,
        "piece_bytes": fmt.device_plane_bytes, "scale_piece_bytes": fmt.plane_scale_bytes if moves_scales else 0,
    }
    for name, value in fixed.items():
        args[COPY_FIELDS.index(name)] = value
    return args


def upcast_args(fmt: PageFormat, table_ptr: int, records: int) -> np.ndarray:
    groups = scale_groups(fmt)
    args = np.zeros(len(UPCAST_FIELDS), dtype=np.int64)
    fixed = {
        "table": table_ptr, "records": records, "planes": fmt.planes, "table_row": fmt.num_layers * fmt.planes,
        "record_bytes": fmt.page_bytes, "data_bytes": fmt.data_bytes, "plane_data_bytes": fmt.plane_data_bytes,
        "plane_scale_bytes": fmt.plane_scale_bytes, "plane_elems": fmt.plane_elems,
        "scale_div": groups.scale_div, "scale_mod": groups.scale_mod,
    }
    for name, value in fixed.items():
        args[UPCAST_FIELDS.index(name)] = value
    return args


def quantize_args(fmt: PageFormat, table_ptr: int, records: int, vec: int) -> np.ndarray:
    groups = scale_groups(fmt)
    args = np.zeros(len(QUANTIZE_FIELDS), dtype=np.int64)
    fixed = {
        "table": table_ptr, "records": records, "planes": fmt.planes, "table_row": fmt.num_layers * fmt.planes,
        "record_bytes": fmt.page_bytes, "data_bytes": fmt.data_bytes, "plane_data_bytes": fmt.plane_data_bytes,
        "plane_scale_bytes": fmt.plane_scale_bytes, "groups_per_piece": groups.groups_per_piece,
        "group_stride": groups.group_stride, "seg_count": groups.seg_count, "seg_len": groups.seg_len,
        "seg_stride": groups.seg_stride, "team_size": team_size(groups.seg_count * groups.seg_len // vec),
        "fp8_max": int(FP8_MAX[fmt.dtype]),
    }
    for name, value in fixed.items():
        args[QUANTIZE_FIELDS.index(name)] = value
    return args


# --- copy-engine address lists -------------------------------------------------------------------
@dataclass(frozen=True)
class PieceSide:
    """Where piece (layer, plane) of slot s lies on one side: base[row] + s * stride[row] (bytes)."""

    base: np.ndarray  # uint64 (num_layers * planes,)
    stride: np.ndarray  # uint64 (num_layers * planes,)


@dataclass(frozen=True)
class PiecePlan:
    """Every (layer, plane) piece of `piece_bytes` of a pass-through copy, source and destination side."""

    src: PieceSide
    dst: PieceSide
    piece_bytes: int


def _device_side(table: np.ndarray, scales: bool) -> PieceSide:
    return PieceSide(table[2 if scales else 0].astype(np.uint64), table[3 if scales else 1].astype(np.uint64))


def _host_side(fmt: PageFormat, records: int, scales: bool) -> PieceSide:
    rows = np.arange(fmt.num_layers * fmt.planes, dtype=np.uint64)
    if scales:
        base = np.uint64(records + fmt.data_bytes) + rows * np.uint64(fmt.plane_scale_bytes)
    else:
        base = np.uint64(records) + rows * np.uint64(fmt.plane_data_bytes)
    return PieceSide(base, np.full(rows.shape, fmt.page_bytes, dtype=np.uint64))


def piece_plans(fmt: PageFormat, table: np.ndarray, records: int, direction: str) -> list[PiecePlan]:
    """The piece plans of a pass-through copy in `direction`: data, then device scales if any."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if fmt.converts and direction != "device":
        raise ValueError(f"{direction} of {fmt.describe()} converts dtypes; it has no pass-through copies")
    sides = [(False, fmt.device_plane_bytes)]
    if fmt.device_has_scales:
        sides.append((True, fmt.plane_scale_bytes))
    plans = []
    for scales, size in sides:
        device = _device_side(table, scales)
        if direction == "device":
            plans.append(PiecePlan(device, device, size))
        elif direction == "offload":
            plans.append(PiecePlan(device, _host_side(fmt, records, scales), size))
        else:
            plans.append(PiecePlan(_host_side(fmt, records, scales), device, size))
    return plans


def expand_pieces(
    plan: PiecePlan, planes: int, layers: range, src_slots: np.ndarray, dst_slots: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dst, src, sizes) uint64 of every piece of `layers`, layer-major, then plane, then page."""
    rows = slice(layers.start * planes, layers.stop * planes)
    src = plan.src.base[rows, None] + src_slots.astype(np.uint64)[None, :] * plan.src.stride[rows, None]
    dst = plan.dst.base[rows, None] + dst_slots.astype(np.uint64)[None, :] * plan.dst.stride[rows, None]
    return dst.ravel(), src.ravel(), np.full(dst.size, plan.piece_bytes, dtype=np.uint64)


def merge_runs(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Copies sorted by destination, those contiguous on both sides merged into one."""
    if dst.size == 0:
        return dst, src, sizes
    order = np.argsort(dst, kind="stable")
    dst, src, sizes = dst[order], src[order], sizes[order]
    joins = (dst[:-1] + sizes[:-1] == dst[1:]) & (src[:-1] + sizes[:-1] == src[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return dst[starts], src[starts], np.add.reduceat(sizes, starts)


def slot_runs(slots: np.ndarray) -> list[tuple[int, int, int]]:
    """(batch index, first slot, count) of each run of consecutive slots in batch order."""
    if slots.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [slots.size]))
    return [(int(s), int(slots[s]), int(e - s)) for s, e in zip(starts, ends)]
