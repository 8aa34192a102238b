"""Reads of a few records with plain system calls on the segment descriptors, beside NIXL.

A NIXL request has a fixed cost on the calling thread (descriptor lists, a transfer handle, its
posting, polls and release): a bare 16 KiB read through NIXL's POSIX backend cost 45-58 µs of
CPU here, a ``preadv`` 23 µs. For a batch of up to ``SMALL_BATCH_PAGES`` records that fixed
cost is most of a call, so such reads go straight to the segment files: the record header with
``pread`` on the buffered descriptor, the payload with ``preadv`` on the ``O_DIRECT``
descriptor (into the caller's pieces where they are 4 KiB aligned, else into an aligned block
of this thread, copied out once verified). Where the kernel refuses ``O_DIRECT`` for a read the
buffered descriptor is used.

Owns that route only. It must never touch the index, never hand a record to the caller
unverified (the same ``RecordCodec.verify`` as the NIXL path: header, CRC32C, MAC), and never
run while a test has a fault armed for reads (the NIXL path carries the fault seam).
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from typing import Sequence

import numpy as np

from kvtier.tiers.remote.buffers import PageBuffers, block_address, view
from kvtier.tiers.remote.records import HEADER_BYTES, SLOT_ALIGN, RecordCodec
from kvtier.tiers.remote.segments import Located

# Batches of at most this many pages are read with system calls (see the module docstring).
SMALL_BATCH_PAGES = 4


class SmallReads:
    """Reads up to ``SMALL_BATCH_PAGES`` records of one store. Thread-safe (aligned blocks are
    per thread)."""

    def __init__(self, codec: RecordCodec, page_bytes: int, slot_stride: int):
        self._codec = codec
        self.page_bytes = page_bytes
        self.slot_stride = slot_stride
        self._blocks = threading.local()

    def _block(self) -> tuple[memoryview, int]:
        """This thread's aligned block of one slot: (view, address)."""
        found = getattr(self._blocks, "block", None)
        if found is None:
            block = mmap.mmap(-1, self.slot_stride)  # page aligned, as O_DIRECT needs
            found = self._blocks.block = (block, memoryview(block), block_address(block))
        return found[1], found[2]

    def read(
        self, ids: Sequence[bytes], located: Located, wanted: list[int], readable: list[int],
        expected: Sequence, pages: PageBuffers,
    ) -> tuple[list[int], list[tuple[int, bool]]]:
        """Read and verify the records of ``readable`` (positions in ``wanted``, which maps them
        to pages of the call) against ``expected[page]``.

        Returns (pages whose read failed, [(page, verified)])."""
        failed: list[int] = []
        verdicts: list[tuple[int, bool]] = []
        devs, direct_devs = located.devs, located.direct_devs
        for j in readable:
            page = wanted[j]
            loc = expected[page]
            try:
                ok = self._read_one(
                    ids[page], loc, int(devs[j]), int(direct_devs[j]),
                    int(located.header_offs[j]), int(located.payload_offs[j]), pages, page,
                )
            except OSError:
                failed.append(page)
                continue
            verdicts.append((page, ok))
        return failed, verdicts

    def _read_one(
        self, key: bytes, loc, fd: int, direct_fd: int, header_off: int, payload_off: int,
        pages: PageBuffers, page: int,
    ) -> bool:
        header = os.pread(fd, HEADER_BYTES, header_off)
        if len(header) != HEADER_BYTES:
            raise OSError(errno.EIO, f"record header cut short at {len(header)} bytes")
        lo, hi = int(pages.first[page]), int(pages.first[page + 1])
        ptrs, lens = pages.ptrs[lo:hi], pages.lens[lo:hi]
        if direct_fd == fd or not ((ptrs | lens) & np.uint64(SLOT_ALIGN - 1)).any():
            # Into the caller's pieces: buffered, or O_DIRECT where every piece is aligned.
            views = [view(p, n) for p, n in zip(ptrs.tolist(), lens.tolist())]
            self._preadv(fd, direct_fd, views, payload_off, self.page_bytes)
            return self._codec.verify(key, self.page_bytes, loc.token, loc.crc, header, views)
        block_view, address = self._block()
        self._preadv(fd, direct_fd, [block_view], payload_off, self.page_bytes)
        if not self._codec.verify(
            key, self.page_bytes, loc.token, loc.crc, header, [view(address, self.page_bytes)]
        ):
            return False
        pages.scatter(page, address)
        return True

    @staticmethod
    def _preadv(fd: int, direct_fd: int, views: list, offset: int, length: int) -> None:
        """Read ``length`` bytes at ``offset`` into ``views``: through the ``O_DIRECT``
        descriptor, or the buffered one where the kernel refuses it."""
        if direct_fd != fd:
            try:
                got = os.preadv(direct_fd, views, offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                got = os.preadv(fd, views, offset)
        else:
            got = os.preadv(fd, views, offset)
        if got < length:
            raise OSError(errno.EIO, f"record payload cut short at {got} of {length} bytes")
