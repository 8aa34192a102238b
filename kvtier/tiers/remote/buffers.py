"""Caller memory as pages: each page one contiguous buffer or an ordered list of pieces.

Owns the checking of the buffers handed to the data path and their flattening into arrays of
pieces (pointer, length, offset inside the page) that descriptors are built from. It must
never read or write the memory it describes, beyond handing out views for checksums and
copying whole pages to or from staging memory the data path hands it.

A buffer per page is one of: a contiguous CPU tensor of ``page_bytes``; a ``(ptr, nbytes)``
tuple of host memory; or a list of such tuples or tensors (pieces) whose sizes sum to
``page_bytes``. Pieces are one record, written in order and read back into the same pieces
(an SGLang host pool gives K and V of a page, or one piece per layer, at separate addresses).
"""

from __future__ import annotations

import ctypes
from typing import Sequence, Union

import numpy as np
import torch

Piece = Union[torch.Tensor, tuple]
Buffer = Union[torch.Tensor, tuple, list]


def view(ptr: int, nbytes: int) -> ctypes.Array:
    return (ctypes.c_ubyte * nbytes).from_address(ptr)


def block_address(block) -> int:
    """Address of a writable buffer such as an ``mmap.mmap`` block."""
    return ctypes.addressof(ctypes.c_char.from_buffer(block))


def pointer(buffer: Piece, what: str = "buffer") -> tuple[int, int]:
    """(address, bytes) of a contiguous CPU tensor or a ``(ptr, nbytes)`` tuple."""
    if isinstance(buffer, torch.Tensor):
        if buffer.device.type != "cpu":
            raise ValueError(f"{what} on {buffer.device}; expected a CPU tensor")
        if not buffer.is_contiguous():
            raise ValueError(f"{what} of strides {buffer.stride()}; expected contiguous")
        return buffer.data_ptr(), buffer.numel() * buffer.element_size()
    if isinstance(buffer, tuple) and len(buffer) == 2:
        ptr, nbytes = int(buffer[0]), int(buffer[1])
        if ptr <= 0:
            raise ValueError(f"{what} pointer {ptr:#x}; expected an address of host memory")
        if nbytes <= 0:
            raise ValueError(f"{what} of {nbytes} bytes; expected > 0")
        return ptr, nbytes
    raise TypeError(
        f"{what} of type {type(buffer).__name__}; expected a CPU torch.Tensor, a (ptr, nbytes) "
        "tuple, or a list of (ptr, nbytes) pieces"
    )


# Pieces spread over more address space than this are copied page by page (a window view
# over the span is only an address range, never touched outside the pieces, but keep it sane).
_MAX_WINDOW_SPAN = 1 << 44
# Larger pieces are copied one memmove each: their copy dwarfs the Python around it.
_MAX_WINDOW_PIECE = 32 << 10


# Batch sizes whose tiled piece lengths and offsets a PieceLayout keeps.
_TILED_SIZES = 64


class PieceLayout:
    """The pieces every page of one pool has: their lengths (positive, summing to
    ``page_bytes``), checked once, for ``PageBuffers.of_layout``."""

    __slots__ = ("lens", "offsets", "page_bytes", "_tiled")

    def __init__(self, lengths: Sequence[int], page_bytes: int):
        given = [int(n) for n in lengths]
        if not given or min(given) <= 0 or sum(given) != page_bytes:
            raise ValueError(f"piece lengths {given}; expected positive lengths summing to {page_bytes}")
        lens = np.array(given, dtype=np.uint64)
        self.lens = lens
        self.offsets = np.cumsum(lens) - lens
        self.page_bytes = page_bytes
        self._tiled: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def tiled(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(lengths, offsets) of ``count`` pages, shared read-only arrays kept per batch size
        (a few sizes recur: an engine's batches)."""
        found = self._tiled.get(count)
        if found is None:
            lens, offsets = np.tile(self.lens, count), np.tile(self.offsets, count)
            lens.flags.writeable = offsets.flags.writeable = False
            found = (lens, offsets)
            if len(self._tiled) < _TILED_SIZES:
                self._tiled[count] = found
        return found


class PageBuffers:
    """The pieces of a batch of pages, flattened: page ``i`` owns pieces
    ``first[i] .. first[i + 1]``; ``offsets`` are where each piece starts inside its page."""

    __slots__ = ("count", "page_bytes", "ptrs", "lens", "offsets", "first", "single")

    def __init__(self, buffers: Sequence[Buffer], count: int, page_bytes: int):
        if len(buffers) != count:
            raise ValueError(f"{len(buffers)} buffers for {count} keys; expected one per key")
        self.count = count
        self.page_bytes = page_bytes
        ptrs: list[int] = []
        lens: list[int] = []
        first = [0]
        for i, buffer in enumerate(buffers):
            if isinstance(buffer, list):
                if not buffer:
                    raise ValueError(f"buffer {i} is an empty list; expected pieces summing to page_bytes={page_bytes}")
                total = 0
                for j, piece in enumerate(buffer):
                    ptr, nbytes = pointer(piece, f"buffer {i} piece {j}")
                    ptrs.append(ptr)
                    lens.append(nbytes)
                    total += nbytes
                if total != page_bytes:
                    raise ValueError(
                        f"buffer {i}: {len(buffer)} pieces of {total} bytes in all; expected "
                        f"page_bytes={page_bytes}"
                    )
            else:
                ptr, nbytes = pointer(buffer, f"buffer {i}")
                if nbytes != page_bytes:
                    raise ValueError(f"buffer {i} of {nbytes} bytes; expected page_bytes={page_bytes}")
                ptrs.append(ptr)
                lens.append(nbytes)
            first.append(len(ptrs))
        self.ptrs = np.array(ptrs, dtype=np.uint64)
        self.lens = np.array(lens, dtype=np.uint64)
        self.first = np.array(first, dtype=np.int64)
        self.single = len(ptrs) == count
        if self.single:
            self.offsets = np.zeros(len(ptrs), dtype=np.uint64)
        else:
            page_start = np.repeat(self.first[:-1], np.diff(self.first))
            ends = np.cumsum(self.lens)
            self.offsets = ends - self.lens - np.concatenate(([0], ends))[page_start].astype(np.uint64)

    @classmethod
    def from_arrays(cls, ptrs: np.ndarray, lens: np.ndarray, count: int, page_bytes: int) -> "PageBuffers":
        """Pages of equal piece counts given as flat arrays (page 0's pieces, then page 1's, ...),
        checked and laid out with array operations only: no Python work per piece."""
        ptrs = np.ascontiguousarray(ptrs, dtype=np.uint64)
        lens = np.ascontiguousarray(lens, dtype=np.uint64)
        if count <= 0 or len(ptrs) != len(lens) or len(ptrs) % count:
            raise ValueError(
                f"{len(ptrs)} piece pointers and {len(lens)} sizes for {count} pages; expected the "
                "same number of pieces for every page"
            )
        per_page = len(ptrs) // count
        if not (ptrs > 0).all() or not (lens > 0).all():
            raise ValueError("piece pointers and sizes must be > 0")
        totals = lens.reshape(count, per_page).sum(axis=1)
        if (totals != page_bytes).any():
            bad = int(np.flatnonzero(totals != page_bytes)[0])
            raise ValueError(
                f"buffer {bad}: {per_page} pieces of {int(totals[bad])} bytes in all; expected "
                f"page_bytes={page_bytes}"
            )
        self = cls.__new__(cls)
        self.count = count
        self.page_bytes = page_bytes
        self.ptrs = ptrs
        self.lens = lens
        self.first = np.arange(0, len(ptrs) + 1, per_page, dtype=np.int64)
        self.single = per_page == 1
        within = np.cumsum(lens.reshape(count, per_page), axis=1) - lens.reshape(count, per_page)
        self.offsets = within.reshape(-1).astype(np.uint64)
        return self

    @classmethod
    def of_layout(cls, ptrs: Sequence[int], layout: "PieceLayout", count: int) -> "PageBuffers":
        """``count`` pages that all have ``layout``'s pieces, at ``ptrs`` (page 0's pieces, then
        page 1's, ...): the lengths, offsets and page bounds come from the layout, checked once
        when it was made, so a batch costs two array constructions whatever its piece count.
        The caller vouches for the pointers (computed inside memory it owns)."""
        per_page = len(layout.lens)
        if count <= 0 or len(ptrs) != count * per_page:
            raise ValueError(f"{len(ptrs)} piece pointers for {count} pages of {per_page} pieces")
        self = cls.__new__(cls)
        self.count = count
        self.page_bytes = layout.page_bytes
        self.ptrs = np.array(ptrs, dtype=np.uint64)
        self.lens, self.offsets = layout.tiled(count)
        self.first = np.arange(0, count * per_page + 1, per_page, dtype=np.int64)
        self.single = per_page == 1
        return self

    def take(self, pages: Sequence[int]) -> "PageBuffers":
        """The pages ``pages`` of this batch, in that order, as a batch of their own (array
        operations only where every page has the same number of pieces)."""
        pages = np.asarray(pages, dtype=np.int64)
        per_page = np.diff(self.first)
        if len(pages) and len(per_page) and (per_page == per_page[0]).all():
            pieces = self.pieces_of(pages)
            return PageBuffers.from_arrays(self.ptrs[pieces], self.lens[pieces], len(pages), self.page_bytes)
        everything = self.buffers()
        return PageBuffers([everything[i] for i in pages.tolist()], len(pages), self.page_bytes)

    def buffers(self) -> list:
        """The pages as plain buffers again: ``(ptr, nbytes)`` for a one-piece page, a list of
        them otherwise (for a caller that picks pages out, such as the cluster tier's chain)."""
        ptrs, lens, first = self.ptrs.tolist(), self.lens.tolist(), self.first.tolist()
        if self.single:
            return list(zip(ptrs, lens))
        return [list(zip(ptrs[first[i]:first[i + 1]], lens[first[i]:first[i + 1]])) for i in range(self.count)]

    def pieces_of(self, pages: Sequence[int]) -> np.ndarray:
        """Indices of the pieces of ``pages``, page by page, in order."""
        if self.single:
            return np.asarray(pages, dtype=np.int64)
        per_page = np.diff(self.first)
        if len(per_page) and (per_page == per_page[0]).all():
            pages = np.asarray(pages, dtype=np.int64)
            return (self.first[pages][:, None] + np.arange(per_page[0])[None, :]).reshape(-1)
        return np.concatenate(
            [np.arange(self.first[p], self.first[p + 1]) for p in pages]
        ) if len(pages) else np.empty(0, dtype=np.int64)

    def gather(self, page: int, destination: int) -> None:
        """Copy one page's pieces, in order, to contiguous memory at ``destination``."""
        lo, hi = int(self.first[page]), int(self.first[page + 1])
        for ptr, nbytes, offset in zip(
            self.ptrs[lo:hi].tolist(), self.lens[lo:hi].tolist(), self.offsets[lo:hi].tolist()
        ):
            ctypes.memmove(destination + offset, ptr, nbytes)

    def scatter(self, page: int, source: int) -> None:
        """Copy contiguous memory at ``source`` into one page's pieces, in order."""
        lo, hi = int(self.first[page]), int(self.first[page + 1])
        for ptr, nbytes, offset in zip(
            self.ptrs[lo:hi].tolist(), self.lens[lo:hi].tolist(), self.offsets[lo:hi].tolist()
        ):
            ctypes.memmove(ptr, source + offset, nbytes)

    def copy_pages(self, pages: Sequence[int], block: int, stride: int, into_block: bool) -> None:
        """Copy the pieces of ``pages`` to (``into_block``) or from contiguous memory at
        ``block + j * stride`` (the ``j``-th of ``pages``), in order: ``gather`` / ``scatter``
        of many pages at once. Where every piece of these pages has one length (up to
        ``_MAX_WINDOW_PIECE``) and there are several per page, each page's pieces move in one
        array operation (a window view over the address span of the pieces, rows taken or put
        at their offsets: no Python work per piece, and no byte outside a piece is read or
        written); otherwise one ``memmove`` per piece."""
        pages = list(pages)
        if not pages:
            return
        pieces = self.pieces_of(pages)
        lens = self.lens[pieces]
        if (
            self.single or len(pieces) < 2 * len(pages) or (lens != lens[0]).any()
            or int(lens[0]) > _MAX_WINDOW_PIECE
        ):
            move = self.gather if into_block else self.scatter
            for j, page in enumerate(pages):
                move(page, block + j * stride)
            return
        length = int(lens[0])
        ptrs = self.ptrs[pieces]
        lo = int(ptrs.min())
        span = int(ptrs.max()) + length - lo
        if span > _MAX_WINDOW_SPAN:
            move = self.gather if into_block else self.scatter
            for j, page in enumerate(pages):
                move(page, block + j * stride)
            return
        memory = np.frombuffer((ctypes.c_ubyte * span).from_address(lo), dtype=np.uint8)
        windows = np.lib.stride_tricks.as_strided(memory, shape=(span - length + 1, length), strides=(1, 1))
        rows = (ptrs - np.uint64(lo)).astype(np.int64)
        per_page = len(pieces) // len(pages)
        staged_bytes = (len(pages) - 1) * stride + per_page * length
        staged = np.lib.stride_tricks.as_strided(
            np.frombuffer((ctypes.c_ubyte * staged_bytes).from_address(block), dtype=np.uint8),
            shape=(len(pages), per_page, length), strides=(stride, length, 1),
        )
        rows = rows.reshape(len(pages), per_page)
        # A page at a time: its rows are one page of temporary memory (indexing the window view
        # as a whole array, as np.take would, would copy the whole span).
        for j in range(len(pages)):
            if into_block:
                staged[j] = windows[rows[j]]
            else:
                windows[rows[j]] = staged[j]

    def views(self, page: int) -> list[ctypes.Array]:
        """Views of one page's pieces, for checksums."""
        lo, hi = int(self.first[page]), int(self.first[page + 1])
        return [view(int(p), int(n)) for p, n in zip(self.ptrs[lo:hi], self.lens[lo:hi])]
