"""Host tier memory: page records in (pinned, on CUDA machines) host memory.

Owns one uint8 buffer of `num_pages` records of `fmt.page_bytes` each, laid out as
kvtier.format.page_format describes: a record holds all layers' data and its scale block,
so one contiguous copy moves a page with its scales. On CUDA machines the buffer is an
anonymous mmap pinned with cudaHostRegister: torch's pinned allocator rounds sizes up to
a power of two, which would waste up to half of a large host tier.
It must never track which page is in which slot: that is the index's job.
"""

from __future__ import annotations

import errno
import mmap
import weakref

import torch

from kvtier.format import PageFormat
from kvtier.errors import TierSizeError
from kvtier.tiers.memory import check_fits, gib


class HostTier:
    """``num_pages`` page records of ``fmt``. ``size``: the pool keyword and value the caller
    sized the tier with, named when the machine cannot give the memory (default
    ``("host_pages", num_pages)``; a pool sized by bytes passes ``("host_bytes", value)``)."""

    def __init__(
        self, fmt: PageFormat, num_pages: int, pin: bool | None = None, size: tuple[str, object] | None = None
    ) -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
            raise ValueError(f"host_pages must be a positive int, got {num_pages!r}")
        key, value = size or ("host_pages", num_pages)
        self.fmt = fmt
        self.num_pages = num_pages
        self.pinned = torch.cuda.is_available() if pin is None else pin
        if self.pinned and not torch.cuda.is_available():
            raise ValueError("host tier pin=True needs CUDA; this machine has none")
        nbytes = num_pages * fmt.page_bytes
        check_fits(key, value, nbytes, fmt.page_bytes, torch.device("cpu"))
        try:
            mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError as err:
            if err.errno != errno.ENOMEM:
                raise
            raise TierSizeError(
                f"{key}={value!r}: the kernel refused to map {gib(nbytes)} ({nbytes} bytes) of host memory "
                f"({err.strerror}; see ulimit -v and vm.overcommit_memory): set {key} lower"
            ) from None
        self.buffer = torch.frombuffer(mapping, dtype=torch.uint8).view(num_pages, fmt.page_bytes)
        ptr = self.buffer.data_ptr()
        if self.pinned:
            cudart = torch.cuda.cudart()
            err = int(cudart.cudaHostRegister(ptr, nbytes, 0))
            if err != 0:
                cudart.cudaGetLastError()  # clear it, or torch reports it at its next launch
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes at {ptr:#x} failed with cudaError {err}")
        # Unregister before the mapping can go, even when nobody calls close(): an address
        # left registered makes the next mapping placed there fail to register.
        self._release = weakref.finalize(self, _release, mapping, ptr if self.pinned else None)
        self._release.atexit = False

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def page(self, slot: int) -> torch.Tensor:
        """The whole record of one slot as a 1-D uint8 tensor (for the remote tier)."""
        return self.buffer[slot]

    def raw_plane(self, layer: int, plane: int) -> torch.Tensor:
        """(num_pages, plane bytes without padding) uint8 view of one layer's plane data."""
        off = self.fmt.data_offset(layer, plane)
        return self.buffer[:, off : off + self.fmt.plane_elems * self.fmt.elem_bytes]

    def data_view(self, layer: int, plane: int) -> torch.Tensor:
        """(num_pages, *plane_shape) view of one layer's plane in the storage dtype."""
        return self.raw_plane(layer, plane).view(self.fmt.torch_dtype).view(self.num_pages, *self.fmt.plane_shape)

    def scale_view(self, layer: int, plane: int) -> torch.Tensor | None:
        """(num_pages, *scale_shape) fp32 view of one layer's plane scales (None without scales)."""
        if not self.fmt.has_scales:
            return None
        off = self.fmt.scale_offset(layer, plane)
        raw = self.buffer[:, off : off + self.fmt.plane_scale_bytes]
        return raw.view(torch.float32).view(self.num_pages, *self.fmt.scale_shape)

    def close(self) -> None:
        """Unregister the memory; the mapping goes when the last view of it is collected."""
        self._release()
        self.buffer = None


def _release(mapping: mmap.mmap, registered_ptr: int | None) -> None:
    """Unregister; `mapping` is an argument only so the finalizer keeps it mapped until now."""
    if registered_ptr is not None:
        torch.cuda.cudart().cudaHostUnregister(registered_ptr)
