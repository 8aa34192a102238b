"""Reads and writes of a few records with plain system calls on the segment descriptors,
beside NIXL.

A NIXL request has a fixed cost on the calling thread (descriptor lists, a transfer handle, its
posting, polls and release): a bare 16 KiB read through NIXL's POSIX backend cost 45-58 µs of
CPU here, a ``preadv`` 23 µs. For a batch of up to ``SMALL_BATCH_PAGES`` records that fixed
cost is most of a call, so such reads go straight to the segment files: the record header with
``pread`` on the buffered descriptor, the payload with ``preadv`` on the ``O_DIRECT``
descriptor (into the caller's pieces where they are 4 KiB aligned, else into an aligned block
of this thread, copied out once verified). Where the kernel refuses ``O_DIRECT`` for a read the
buffered descriptor is used.

Writes of up to ``SMALL_BATCH_PAGES`` records (``SmallWrites``) likewise skip the NIXL
request (and its sleeps between polls): each record's payload with ``pwritev`` on the
``O_DIRECT`` descriptor (from the caller's pieces where they are 4 KiB aligned, else from this
thread's aligned block, sealed there), its header with ``pwrite`` on the buffered one, then one
``fdatasync`` per touched file, all in one call: the records are durable when it returns, so
the store publishes them without a second sync. The write and the sync run on the caller's
thread: a stuck disk holds them as it holds a NIXL write's poll or ``fdatasync``, and the pool
runs every put on a thread of its own that it abandons after the store's timeout
(``pool/remote_link.py``).

Owns that route only. It must never touch the index, never hand a record to the caller
unverified (the same ``RecordCodec.verify`` as the NIXL path: header, CRC32C, MAC), never
report a record written before it is durable, and never run while a test has a fault armed
for its direction (the NIXL path carries the fault seam).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
from typing import Sequence


from kvtier.tiers.remote.buffers import PageBuffers, block_address, view
from kvtier.tiers.remote.records import HEADER_BYTES, SLOT_ALIGN, RecordCodec
from kvtier.tiers.remote.segments import Located

logger = logging.getLogger(__name__)

# Batches of at most this many pages are read with system calls (see the module docstring).
SMALL_BATCH_PAGES = 4


def _pieces(pages: PageBuffers, page: int) -> tuple[list[int], list[int]]:
    """(addresses, lengths) of one page's pieces as Python ints."""
    if pages.single:
        return [int(pages.ptrs[page])], [int(pages.lens[page])]
    lo, hi = int(pages.first[page]), int(pages.first[page + 1])
    return pages.ptrs[lo:hi].tolist(), pages.lens[lo:hi].tolist()


class SmallReads:
    """Reads up to ``SMALL_BATCH_PAGES`` records of one store. Thread-safe (aligned blocks are
    per thread)."""

    def __init__(self, codec: RecordCodec, page_bytes: int, slot_stride: int):
        self._codec = codec
        self.page_bytes = page_bytes
        self.slot_stride = slot_stride
        self._blocks = threading.local()

    def _block(self) -> tuple[memoryview, int, memoryview]:
        """This thread's aligned block of one slot: (view, address, view of its first
        ``page_bytes``)."""
        found = getattr(self._blocks, "block", None)
        if found is None:
            block = mmap.mmap(-1, self.slot_stride)  # page aligned, as O_DIRECT needs
            whole = memoryview(block)
            found = self._blocks.block = (block, whole, block_address(block), whole[: self.page_bytes])
        return found[1], found[2], found[3]

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
        ptrs, lens = _pieces(pages, page)
        if direct_fd == fd or not any((p | n) & (SLOT_ALIGN - 1) for p, n in zip(ptrs, lens)):
            # Into the caller's pieces: buffered, or O_DIRECT where every piece is aligned.
            views = [view(p, n) for p, n in zip(ptrs, lens)]
            self._preadv(fd, direct_fd, views, payload_off, self.page_bytes)
            return self._codec.verify(key, self.page_bytes, loc.token, loc.crc, header, views)
        block_view, address, payload = self._block()
        self._preadv(fd, direct_fd, [block_view], payload_off, self.page_bytes)
        if not self._codec.verify(key, self.page_bytes, loc.token, loc.crc, header, [payload]):
            return False
        if len(ptrs) == 1:
            ctypes.memmove(ptrs[0], address, self.page_bytes)
        else:
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


class SmallWrites:
    """Writes up to ``SMALL_BATCH_PAGES`` records of one store and makes them durable.
    Thread-safe (aligned blocks are per thread)."""

    def __init__(self, codec: RecordCodec, page_bytes: int, slot_stride: int):
        self._codec = codec
        self.page_bytes = page_bytes
        self.slot_stride = slot_stride
        self._blocks = threading.local()

    def _block(self) -> tuple[memoryview, int, memoryview]:
        """This thread's aligned block of one slot, zeroed past ``page_bytes``: (view, address,
        view of its first ``page_bytes``)."""
        found = getattr(self._blocks, "block", None)
        if found is None:
            block = mmap.mmap(-1, self.slot_stride)  # page aligned and zeroed, as O_DIRECT needs
            whole = memoryview(block)
            found = self._blocks.block = (block, whole, block_address(block), whole[: self.page_bytes])
        return found[1], found[2], found[3]

    def write(
        self, ids: Sequence[bytes], tokens: Sequence[int], located: Located, writable: list[int],
        pages: PageBuffers,
    ) -> tuple[list[int], dict[int, int]]:
        """Write the records of pages ``writable`` and ``fdatasync`` their files; returns (pages
        durable, their CRC32C). A page whose write fails is left out; when a sync fails no page
        of that file is reported."""
        written: list[tuple[int, int]] = []
        crcs: dict[int, int] = {}
        devs = located.devs
        for page in writable:
            fd = int(devs[page])
            try:
                crcs[page] = self._write_one(
                    ids[page], tokens[page], fd, int(located.direct_devs[page]),
                    int(located.header_offs[page]), int(located.payload_offs[page]), pages, page,
                )
            except OSError as exc:
                logger.warning("remote put of 1 page failed: %r", exc)
                continue
            written.append((page, fd))
        synced: dict[int, bool] = {}
        for _, fd in written:
            if fd not in synced:
                try:
                    os.fdatasync(fd)  # the file's data, through either descriptor
                    synced[fd] = True
                except OSError as exc:
                    logger.warning("remote put: fdatasync of a segment failed: %r", exc)
                    synced[fd] = False
        moved = [page for page, fd in written if synced[fd]]
        return moved, {page: crcs[page] for page in moved}

    def _write_one(
        self, key: bytes, token: int, fd: int, direct_fd: int, header_off: int, payload_off: int,
        pages: PageBuffers, page: int,
    ) -> int:
        ptrs, lens = _pieces(pages, page)
        if direct_fd == fd or not any((p | n) & (SLOT_ALIGN - 1) for p, n in zip(ptrs, lens)):
            # From the caller's pieces: buffered, or O_DIRECT where every piece is aligned.
            views = [view(p, n) for p, n in zip(ptrs, lens)]
            crc, header = self._codec.seal(key, self.page_bytes, token, views)
            self._pwritev(fd, direct_fd, views, payload_off, self.page_bytes)
        else:
            block_view, address, payload = self._block()
            if len(ptrs) == 1:
                ctypes.memmove(address, ptrs[0], self.page_bytes)
            else:
                pages.gather(page, address)
            crc, header = self._codec.seal(key, self.page_bytes, token, [payload])
            self._pwritev(fd, direct_fd, [block_view], payload_off, self.page_bytes)
        if os.pwrite(fd, header, header_off) != HEADER_BYTES:
            raise OSError(errno.EIO, "record header written short")
        return crc

    @staticmethod
    def _pwritev(fd: int, direct_fd: int, views: list, offset: int, length: int) -> None:
        """Write ``views`` at ``offset`` through the ``O_DIRECT`` descriptor, or the buffered
        one where the kernel refuses it."""
        if direct_fd != fd:
            try:
                got = os.pwritev(direct_fd, views, offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                got = os.pwritev(fd, views, offset)
        else:
            got = os.pwritev(fd, views, offset)
        if got < length:
            raise OSError(errno.EIO, f"record payload written short at {got} of {length} bytes")
