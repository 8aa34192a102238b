"""Reads and writes of a few records with plain system calls on the segment descriptors,
beside NIXL.

A NIXL request has a fixed cost on the calling thread (descriptor lists, a transfer handle, its
posting, polls and release): a bare 16 KiB read through NIXL's POSIX backend cost 45-58 µs of
CPU here, a ``preadv`` 23 µs. For a batch of up to ``SMALL_BATCH_PAGES`` records that fixed
cost is most of a call, so such reads and writes go straight to the segment files.

Writes (``SmallWrites``): each record's payload with ``pwritev`` from the caller's pieces and
its header with ``pwrite``, both on the buffered descriptor, then one ``fdatasync`` per touched
file, all in one call: the records are durable when it returns, so the store publishes them
without a second sync. The payload goes through the page cache on purpose: on the 2-vCPU VM a
16 KiB ``pwritev`` + ``fdatasync`` cost the same CPU buffered as with ``O_DIRECT`` (the sync
writes the header's page anyway), and the page stays cached for the reads that often follow a
small write. Pages of ``SMALL_DIRECT_WRITE_BYTES`` and more whose pieces are 4 KiB aligned are
written with ``O_DIRECT`` instead: copying 2 MiB into the cache and writing it back cost 697 µs
of CPU against 199 direct (into a fresh slot; 268 against 130 over an old one). Bulk writes
(NIXL, ``O_DIRECT``) keep large batches out of the page cache. The
write and the sync run on the caller's thread: a stuck disk holds them as it holds a NIXL
write's poll or ``fdatasync``, and the pool runs every put on a thread of its own that it
abandons after the store's timeout (``pool/remote_link.py``).

Reads (``SmallReads``): the record header with ``pread`` on the buffered descriptor, and the
payload from the page cache where it holds the whole payload (asked with ``cachestat``, Linux
6.5, which does no I/O; a ``RWF_NOWAIT`` read would start readahead on a miss), with ``preadv``
on the buffered descriptor into the caller's pieces; else, or when the cached bytes do not
verify, from the device with ``preadv`` on the ``O_DIRECT`` descriptor (into the caller's
pieces where they are 4 KiB aligned, else into an aligned block of this thread, copied out
once verified); then the header's block is asked for (``POSIX_FADV_WILLNEED``) before the
payload's read and read after it, so the two device reads overlap (a cold 16 KiB get: 230-248
-> 195-202 µs on the VM). Where the kernel refuses ``O_DIRECT`` for a read the buffered
descriptor is used. A cached 16 KiB read cost 3 µs of CPU here, a direct one 20-45 µs, and a blocking read
leaves the rest of the call running on cold caches (a whole 1-page get: about 45 µs against
105-140).

Mixing the two routes on one block is safe: a direct read first writes back cached dirty
pages of its range (a small write's pages are clean once synced), a direct write drops the
cached pages of its range, and every record read either way is verified.

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
# Small writes of pages from this size on, whose pieces are 4 KiB aligned, go O_DIRECT.
SMALL_DIRECT_WRITE_BYTES = 256 << 10


class _CacheRange(ctypes.Structure):
    _fields_ = [("offset", ctypes.c_uint64), ("length", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted",
    )]


# cachestat(2) (Linux 6.5): how much of a file range the page cache holds, without I/O.
_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 16  # pieces a call takes
_NR_CACHESTAT = 451 if os.uname().machine in ("x86_64", "aarch64") else None
_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


def _pieces(pages: PageBuffers, page: int) -> tuple[list[int], list[int]]:
    """(addresses, lengths) of one page's pieces as Python ints."""
    if pages.single:
        return [int(pages.ptrs[page])], [int(pages.lens[page])]
    lo, hi = int(pages.first[page]), int(pages.first[page + 1])
    return pages.ptrs[lo:hi].tolist(), pages.lens[lo:hi].tolist()


def _aligned(ptrs: list[int], lens: list[int]) -> bool:
    """Whether every piece starts and ends on a ``SLOT_ALIGN`` boundary (what ``O_DIRECT`` needs)."""
    return not any((p | n) & (SLOT_ALIGN - 1) for p, n in zip(ptrs, lens))


def _read_header(fd: int, offset: int) -> bytes:
    header = os.pread(fd, HEADER_BYTES, offset)
    if len(header) != HEADER_BYTES:
        raise OSError(errno.EIO, f"record header cut short at {len(header)} bytes")
    return header


class SmallReads:
    """Reads up to ``SMALL_BATCH_PAGES`` records of one store. Thread-safe (aligned blocks are
    per thread)."""

    def __init__(self, codec: RecordCodec, page_bytes: int, slot_stride: int):
        self._codec = codec
        self.page_bytes = page_bytes
        self.slot_stride = slot_stride
        self._blocks = threading.local()
        self._cached = _NR_CACHESTAT is not None  # reads from the page cache where it holds them
        self.cached_reads = 0  # records served from the page cache (approximate across threads)

    def _block(self) -> tuple[memoryview, int, memoryview]:
        """This thread's aligned block of one slot: (view, address, view of its first
        ``page_bytes``)."""
        found = getattr(self._blocks, "block", None)
        if found is None:
            block = mmap.mmap(-1, self.slot_stride)  # page aligned, as O_DIRECT needs
            whole = memoryview(block)
            found = self._blocks.block = (block, whole, block_address(block), whole[: self.page_bytes])
        return found[1], found[2], found[3]

    def _resident(self, fd: int, offset: int) -> bool:
        """Whether the page cache holds all of the payload at ``offset`` (``cachestat``: no
        I/O, unlike a ``RWF_NOWAIT`` read, which starts readahead on a miss). False, and never
        asked again, where the kernel has no ``cachestat``."""
        found = getattr(self._blocks, "cachestat", None)
        if found is None:
            found = self._blocks.cachestat = (_CacheRange(0, self.page_bytes), _CacheStat())
        span, stat = found
        span.offset = offset
        if _syscall(_NR_CACHESTAT, fd, ctypes.byref(span), ctypes.byref(stat), 0) != 0:
            if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP):
                self._cached = False
            return False
        return stat.nr_cache * mmap.PAGESIZE >= self.page_bytes

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
        ptrs, lens = _pieces(pages, page)
        header = None
        if direct_fd != fd and self._cached and self._resident(fd, payload_off):
            # From the page cache, which holds the whole payload (a small write leaves it
            # there); when the cached bytes do not verify, from the device below.
            header = _read_header(fd, header_off)
            if len(ptrs) <= _IOV_MAX:
                views = [view(p, n) for p, n in zip(ptrs, lens)]
                if os.preadv(fd, views, payload_off) == self.page_bytes and self._codec.verify(
                    key, self.page_bytes, loc.token, loc.crc, header, views
                ):
                    self.cached_reads += 1
                    return True
            else:  # more pieces than one system call takes: through this thread's block
                _, address, payload = self._block()
                if os.preadv(fd, [payload], payload_off) == self.page_bytes and self._codec.verify(
                    key, self.page_bytes, loc.token, loc.crc, header, [payload]
                ):
                    pages.scatter(page, address)
                    self.cached_reads += 1
                    return True
        if header is None and direct_fd != fd:
            # The payload comes from the device: its header's block (through the buffered
            # descriptor) starts reading now, beside the payload's read, instead of after it.
            try:
                os.posix_fadvise(fd, header_off, HEADER_BYTES, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
        if direct_fd == fd or _aligned(ptrs, lens):
            # Into the caller's pieces: buffered, or O_DIRECT where every piece is aligned.
            views = [view(p, n) for p, n in zip(ptrs, lens)]
            self._preadv(fd, direct_fd, views, payload_off, self.page_bytes)
            if header is None:
                header = _read_header(fd, header_off)
            return self._codec.verify(key, self.page_bytes, loc.token, loc.crc, header, views)
        block_view, address, payload = self._block()
        self._preadv(fd, direct_fd, [block_view], payload_off, self.page_bytes)
        if header is None:
            header = _read_header(fd, header_off)
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
    Thread-safe."""

    def __init__(self, codec: RecordCodec, page_bytes: int, slot_stride: int):
        self._codec = codec
        self.page_bytes = page_bytes
        self.slot_stride = slot_stride
        self._blocks = threading.local()

    def _block(self) -> tuple[int, memoryview]:
        """This thread's block of one page: (address, view)."""
        found = getattr(self._blocks, "block", None)
        if found is None:
            block = mmap.mmap(-1, self.page_bytes)
            found = self._blocks.block = (block, block_address(block), memoryview(block))
        return found[1], found[2]

    def write(
        self, ids: Sequence[bytes], tokens: Sequence[int], located: Located, writable: list[int],
        pages: PageBuffers,
    ) -> tuple[list[int], dict[int, int]]:
        """Write the records of pages ``writable`` and ``fdatasync`` their files; returns (pages
        durable, their CRC32C). A page whose write fails is left out; when a sync fails no page
        of that file is reported."""
        written: list[tuple[int, int]] = []
        crcs: dict[int, int] = {}
        devs, direct_devs = located.devs, located.direct_devs
        for page in writable:
            fd = int(devs[page])
            try:
                crcs[page] = self._write_one(
                    ids[page], tokens[page], fd, int(direct_devs[page]), int(located.header_offs[page]),
                    int(located.payload_offs[page]), pages, page,
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
        if len(ptrs) <= _IOV_MAX:
            views = [view(p, n) for p, n in zip(ptrs, lens)]
        else:  # more pieces than one system call takes: gathered into this thread's block
            address, payload = self._block()
            pages.gather(page, address)
            views = [payload]
            ptrs, lens = [address], [self.page_bytes]
        crc, header = self._codec.seal(key, self.page_bytes, token, views)
        # Through the page cache (see the module docstring), except large pages that can go
        # O_DIRECT: copying them into the cache and writing them back costs more than the
        # direct write (2 MiB into a fresh slot on the VM: 697 µs of CPU buffered, 199 direct).
        direct = (
            direct_fd != fd and self.page_bytes >= SMALL_DIRECT_WRITE_BYTES
            and _aligned(ptrs, lens)
        )
        got = os.pwritev(direct_fd if direct else fd, views, payload_off)
        if got < self.page_bytes:
            raise OSError(errno.EIO, f"record payload written short at {got} of {self.page_bytes} bytes")
        if os.pwrite(fd, header, header_off) != HEADER_BYTES:
            raise OSError(errno.EIO, "record header written short")
        return crc
