"""Where records live: segment files of fixed slots (FILE medium) or one object per slot (OBJ).

Owns the segment file layout, creating, opening, checking and syncing segment files, their
NIXL file registrations, and the NIXL descriptors that pair caller pieces with a record's
header and payload. It must never decide which slot a page goes to (the index does), never
move page bytes itself (NIXL does, or ``small_batches``' system calls; ``pwrite`` here writes a
segment's superblock only;
``ftruncate``, ``fdatasync`` and ``sync_file_range`` only manage files), and never follow a
symbolic link in the store.

Segment file, format version 3::

    [0, 4096)            superblock: "KVTS", version, segment id, slot stride, slot count, CRC32C
    [4096, 4096 + H)     header table, 64 bytes per slot; H = slots * 64 rounded up to 4 KiB
    4096 + H + i*stride  payload of slot i

A segment holds ``nslots`` slots of one ``slot_stride`` (``page_bytes`` rounded up to 4 KiB,
so payloads stay 4 KiB aligned for O_DIRECT and GDS). Segments are created sparse at their full
size, opened once per process, kept open and registered with NIXL once: a batch costs no
``open`` or registration, and slots are reused in place. (SGLang's NIXL backend keeps one file
per key and opens and registers it per transfer.) Headers live in a table rather than next to
each payload so a record costs 64 bytes, not a 4 KiB block, and payloads keep their alignment;
a second descriptor for the header stream was measured and gave nothing (kernel readahead
copes). The superblock lets ``tool.rebuild_index`` find every record without the index.

Direct I/O: each segment is opened twice, buffered and with ``O_DIRECT`` (both registered
with NIXL once), unless the file system refuses ``O_DIRECT`` or keeps its files in memory
(tmpfs, ramfs: direct I/O there is a copy through the same page cache), which is probed once
per store (``direct_io_refusal``), logged once and reported by ``RemoteStore.stats()``.
Payload descriptors whose memory address, length and file offset are all multiples of
``SLOT_ALIGN`` go to the ``O_DIRECT`` descriptor, everything else (record headers of 64 bytes,
unaligned pieces; the data path stages pages with unaligned pieces, so with direct I/O on
that is the headers) to the buffered one: no 4 KiB block is reached through both, and the
kernel keeps the two coherent for distinct blocks (a direct read writes back dirty cached
pages of its range first, a direct write invalidates them). ``fdatasync`` of either descriptor
makes the whole file durable. The system-call route for a few records (``small_batches``)
writes payloads through the buffered descriptor and reads them from the page cache when it
holds them: the same kernel coherence covers those blocks, and every read is verified.

A segment file is never truncated or laid out again unless the index names it or it holds no
record: a file at a new segment's name that holds records (an index deleted, or that lost its
last commits, or a rebuild killed midway) is left for ``kvtier store rebuild`` and the index
takes the next id; never-used slots the index hands out are checked to hold no record header
(``unused_slots_empty``) for the same reason.

A segment file that was deleted or truncated under a running store is found by one ``fstat``
per segment per batch: the pages it lost (all of a deleted file, those past the end of a
truncated one) fail to read and leave the index, the others are served, and the next write
into it lays the file out at full size again.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import random
import struct
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from kvtier.tiers.remote.buffers import PageBuffers
from kvtier.tiers.remote.index_slots import SlotRef
from kvtier.tiers.remote.nixl import NixlEngine
from kvtier.tiers.remote.paths import (
    Modes,
    SEGMENTS_DIRNAME,
    create_file,
    open_no_follow,
    open_segments_directory,
    segment_name,
)
from kvtier.tiers.remote.records import FORMAT_VERSION, HEADER_BYTES, SLOT_ALIGN, crc32c

logger = logging.getLogger(__name__)

SEGMENT_MAGIC = b"KVTS"
SUPERBLOCK_BYTES = SLOT_ALIGN
_SUPERBLOCK = struct.Struct("<4sHHQQQ")
_SUPERBLOCK_CRC = struct.Struct("<I")
_ZERO_CHECK_BYTES = 1 << 16
_SMALL_LOCATE = 4  # slots located in plain Python
# Headers further apart than this are read ahead as separate runs (``read_ahead_headers``).
_AHEAD_GAP = 64 << 10


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def header_table_bytes(nslots: int) -> int:
    return _round_up(nslots * HEADER_BYTES, SLOT_ALIGN)


def segment_file_bytes(slot_stride: int, nslots: int) -> int:
    return SUPERBLOCK_BYTES + header_table_bytes(nslots) + nslots * slot_stride


def header_offset(slot: int) -> int:
    return SUPERBLOCK_BYTES + slot * HEADER_BYTES


def payload_offset(slot_stride: int, nslots: int, slot: int) -> int:
    return SUPERBLOCK_BYTES + header_table_bytes(nslots) + slot * slot_stride


def pack_superblock(seg: int, slot_stride: int, nslots: int) -> bytes:
    body = _SUPERBLOCK.pack(SEGMENT_MAGIC, FORMAT_VERSION, 0, seg, slot_stride, nslots)
    return body + _SUPERBLOCK_CRC.pack(crc32c.crc32c(body))


@dataclass(frozen=True)
class Superblock:
    version: int
    seg: int
    slot_stride: int
    nslots: int


def parse_superblock(raw: bytes) -> Optional[Superblock]:
    """The superblock at the start of ``raw``, or None if absent or damaged."""
    size = _SUPERBLOCK.size
    if len(raw) < size + 4 or raw[:4] != SEGMENT_MAGIC:
        return None
    (check,) = _SUPERBLOCK_CRC.unpack_from(raw, size)
    if crc32c.crc32c(raw[:size]) != check:
        return None
    _, version, _, seg, stride, nslots = _SUPERBLOCK.unpack_from(raw)
    return Superblock(version, seg, stride, nslots)


_TMPFS_MAGIC = 0x01021994
_RAMFS_MAGIC = 0x858458F6
_STATFS_BYTES = 256


def direct_io_refusal(dir_fd: int, path: str, modes: Modes) -> Optional[str]:
    """Why segment files in ``path`` cannot use ``O_DIRECT`` (None: they can): a file system
    that keeps files in memory, or one that refuses to open or write a probe file with it."""
    if not hasattr(os, "O_DIRECT"):
        return "this platform has no O_DIRECT"
    kind = _file_system_magic(path)
    if kind in (_TMPFS_MAGIC, _RAMFS_MAGIC):
        return f"{path} is on {'tmpfs' if kind == _TMPFS_MAGIC else 'ramfs'} (files in memory)"
    name = f".direct-probe-{os.getpid()}-{random.getrandbits(32):08x}"
    block = mmap.mmap(-1, SLOT_ALIGN)
    try:
        fd = create_file(dir_fd, name, os.path.join(path, name), modes)
        try:
            direct = os.open(name, os.O_RDWR | os.O_DIRECT | os.O_NOFOLLOW, dir_fd=dir_fd)
            try:
                os.pwritev(direct, [block], 0)
                os.preadv(direct, [block], 0)
            finally:
                os.close(direct)
        finally:
            os.close(fd)
            os.unlink(name, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            return f"{path} refuses O_DIRECT ({exc.strerror})"
        raise
    finally:
        block.close()
    return None


def _file_system_magic(path: str) -> Optional[int]:
    statfs = getattr(ctypes.CDLL(None, use_errno=True), "statfs", None)
    if statfs is None:
        return None
    buffer = ctypes.create_string_buffer(_STATFS_BYTES)
    if statfs(os.fsencode(path), buffer) != 0:
        return None
    return ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF


def holds_no_record(fd: int, nslots: int) -> bool:
    """Whether segment file ``fd`` certainly holds no record: empty, or every byte of its header
    table zero (the table's size from its superblock, else from ``nslots``), and its superblock
    valid or zero. Reads stop at the first non-zero header byte."""
    size = os.fstat(fd).st_size
    if size == 0:
        return True
    head = os.pread(fd, SUPERBLOCK_BYTES, 0)
    superblock = parse_superblock(head)
    if superblock is None and head.count(0) != len(head):
        return False
    table = header_table_bytes(superblock.nslots if superblock is not None else nslots)
    end = min(size, SUPERBLOCK_BYTES + table)
    offset = SUPERBLOCK_BYTES
    while offset < end:
        chunk = os.pread(fd, min(_ZERO_CHECK_BYTES, end - offset), offset)
        if not chunk:
            break
        if chunk.count(0) != len(chunk):
            return False
        offset += len(chunk)
    return True


@dataclass
class Located:
    """Where each page of a batch lives: descriptor device (fd or object id), the ``O_DIRECT``
    device (the same as ``devs`` where direct I/O is off), header and payload offsets; ``bad``
    maps pages that cannot be moved to the reason."""

    devs: np.ndarray
    direct_devs: np.ndarray
    header_offs: np.ndarray
    payload_offs: np.ndarray
    bad: dict[int, str]


def build_descriptors(
    located: Located, pages: Sequence[int], buffers: PageBuffers, source_pages: Sequence[int],
    header_ptr: int, staging: Optional[tuple[int, int]] = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Paired local/remote (addr, len, dev) descriptors: every payload piece, then every header.

    ``pages`` index ``located``; ``source_pages`` index ``buffers``; header ``j`` lies at
    ``header_ptr + 64 j``. Pieces of one page go to consecutive ranges of its record's
    payload, each through the ``O_DIRECT`` device where its address, length and offset are
    aligned. With ``staging`` = (address, slot stride), page ``j``'s payload instead moves
    whole, through the ``O_DIRECT`` device, from or to ``address + j * stride`` (aligned
    memory the caller copies to or from the pieces)."""
    pages = np.asarray(pages, dtype=np.int64)
    count = len(pages)
    if staging is not None:
        start, stride = staging
        local = np.empty((2 * count, 3), dtype=np.uint64)
        remote = np.empty((2 * count, 3), dtype=np.uint64)
        local[:count, 0] = start + np.arange(count, dtype=np.uint64) * np.uint64(stride)
        local[:count, 1] = stride
        remote[:count, 0] = located.payload_offs[pages]
        remote[:count, 1] = stride
        remote[:count, 2] = located.direct_devs[pages]
        npieces = count
    else:
        pieces = buffers.pieces_of(source_pages)
        owner = (
            pages if buffers.single
            else np.repeat(pages, np.diff(buffers.first)[np.asarray(source_pages, dtype=np.int64)])
        )
        npieces = len(pieces)
        local = np.empty((npieces + count, 3), dtype=np.uint64)
        remote = np.empty((npieces + count, 3), dtype=np.uint64)
        ptrs, lens = buffers.ptrs[pieces], buffers.lens[pieces]
        offsets = located.payload_offs[owner] + buffers.offsets[pieces]
        local[:npieces, 0] = ptrs
        local[:npieces, 1] = lens
        remote[:npieces, 0] = offsets
        remote[:npieces, 1] = lens
        aligned = ((ptrs | lens | offsets) & np.uint64(SLOT_ALIGN - 1)) == 0
        remote[:npieces, 2] = np.where(aligned, located.direct_devs[owner], located.devs[owner])
    local[npieces:, 0] = header_ptr + np.arange(count, dtype=np.uint64) * np.uint64(HEADER_BYTES)
    local[npieces:, 1] = HEADER_BYTES
    local[:, 2] = 0
    remote[npieces:, 0] = located.header_offs[pages]
    remote[npieces:, 1] = HEADER_BYTES
    remote[npieces:, 2] = located.devs[pages]
    return local, remote


def merge_descriptors(
    local: np.ndarray, remote: np.ndarray, groups: Optional[np.ndarray] = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Paired descriptors (in file order) with every row that continues the row before it on
    both sides (the same file descriptor, the next offset, the next local address and, with
    ``groups``, the same local registration) folded into it: the same bytes move in fewer,
    larger reads or writes. Aligned rows stay aligned, so ``O_DIRECT`` rows stay valid."""
    if len(local) < 2:
        return local, remote
    goes_on = (
        (remote[1:, 2] == remote[:-1, 2])
        & (remote[1:, 0] == remote[:-1, 0] + remote[:-1, 1])
        & (local[1:, 0] == local[:-1, 0] + local[:-1, 1])
    )
    if groups is not None:
        goes_on &= groups[1:] == groups[:-1]
    if not goes_on.any():
        return local, remote
    starts = np.flatnonzero(np.concatenate(([True], ~goes_on)))
    lengths = np.add.reduceat(local[:, 1], starts)
    local, remote = local[starts], remote[starts]
    local[:, 1] = lengths
    remote[:, 1] = lengths
    return local, remote


class SegmentFiles:
    """FILE medium: segment files of fixed slots, opened and registered once per process."""

    mem_type = "FILE"
    whole_records = False

    def __init__(
        self,
        engine: NixlEngine,
        directory: str,
        store_fd: int,
        modes: Modes,
        segment_shape: Callable[[int], tuple[int, int]],
        direct_io: bool = True,
    ):
        self._engine = engine
        self._segment_shape = segment_shape
        self._modes = modes
        self.path = os.path.join(directory, SEGMENTS_DIRNAME)
        self._dir_fd = open_segments_directory(store_fd, directory, modes)
        self._lock = threading.Lock()
        self._open: dict[int, tuple[int, int, int, int, list]] = {}
        self.direct_io = False
        if direct_io:
            try:
                refusal = direct_io_refusal(self._dir_fd, self.path, modes)
            except OSError:
                os.close(self._dir_fd)
                raise
            if refusal is None:
                self.direct_io = True
            else:
                logger.warning("remote store segments: %s; using buffered I/O", refusal)

    def _file(self, seg: int) -> str:
        return os.path.join(self.path, segment_name(seg))

    def create(self, seg: int, slot_stride: int, nslots: int) -> None:
        """Create segment ``seg``'s file, sparse, at full size (called inside the index
        transaction that allocates the segment, so it exists before anyone can use it).

        A file already at that name is laid out afresh only when it holds no record (left by a
        creation whose index transaction rolled back). One that holds records is a segment the
        index does not know (an index deleted, or that lost its last commits, or a rebuild cut
        short): its records may be the only copy of durable pages, so it is left untouched and
        FileExistsError tells the index to take another id; ``kvtier store rebuild`` brings
        them back."""
        try:
            fd = create_file(self._dir_fd, segment_name(seg), self._file(seg), self._modes)
        except FileExistsError:
            fd = open_no_follow(self._dir_fd, segment_name(seg), os.O_RDWR, self._file(seg))
            try:
                if not holds_no_record(fd, nslots):
                    raise FileExistsError(
                        errno.EEXIST,
                        f"segment file {self._file(seg)} holds records the store index does not "
                        f"know; left untouched (`kvtier store rebuild {os.path.dirname(self.path)}` "
                        "brings them back)",
                    )
            except BaseException:
                os.close(fd)
                raise
        try:
            self._lay_out(fd, seg, slot_stride, nslots)
        finally:
            os.close(fd)
        os.fsync(self._dir_fd)  # the new name survives a power loss before any record does

    def unused_slots_empty(self, seg: int, first: int, count: int) -> bool:
        """Whether slots ``[first, first + count)`` of ``seg`` hold no record header (the index
        asks before handing out slots it believes never used). Read with a plain descriptor of
        its own, or with the store's buffered one where the segment is open already (a put into
        an open segment then opens no file)."""
        with self._lock:  # held so that the descriptor is not closed meanwhile
            found = self._open.get(seg)
            if found is not None and os.fstat(found[0]).st_nlink:
                raw = os.pread(found[0], count * HEADER_BYTES, header_offset(first))
                return raw.count(0) == len(raw)
        try:
            fd = open_no_follow(self._dir_fd, segment_name(seg), os.O_RDONLY, self._file(seg))
        except FileNotFoundError:
            return True  # nothing there to overwrite; the write lays the file out again
        try:
            raw = os.pread(fd, count * HEADER_BYTES, header_offset(first))
        finally:
            os.close(fd)
        return raw.count(0) == len(raw)

    @staticmethod
    def _lay_out(fd: int, seg: int, slot_stride: int, nslots: int) -> None:
        os.ftruncate(fd, 0)
        os.ftruncate(fd, segment_file_bytes(slot_stride, nslots))
        os.pwrite(fd, pack_superblock(seg, slot_stride, nslots), 0)
        os.fsync(fd)

    def _segment(self, seg: int) -> tuple[int, int, int, int]:
        """(fd, O_DIRECT fd or fd, slot_stride, nslots) of ``seg``, opening and registering it
        once."""
        with self._lock:
            found = self._open.get(seg)
            if found is None:
                slot_stride, nslots = self._segment_shape(seg)
                size = segment_file_bytes(slot_stride, nslots)
                fds: list[int] = []
                registrations: list = []
                try:
                    fds.append(open_no_follow(self._dir_fd, segment_name(seg), os.O_RDWR, self._file(seg)))
                    if self.direct_io:
                        # The name was just opened without following links: the second open
                        # reaches the same file unless it was replaced meanwhile (fstat tells).
                        fds.append(open_no_follow(
                            self._dir_fd, segment_name(seg), os.O_RDWR | os.O_DIRECT, self._file(seg)
                        ))
                        first, second = os.fstat(fds[0]), os.fstat(fds[1])
                        if (first.st_dev, first.st_ino) != (second.st_dev, second.st_ino):
                            raise FileNotFoundError(f"segment file {self._file(seg)} was replaced while opened")
                    for fd in fds:
                        registrations.append(self._engine.register([(0, size, fd, "")], "FILE"))
                except BaseException:
                    for registration in registrations:
                        self._engine.deregister(registration)
                    for fd in fds:
                        os.close(fd)
                    raise
                found = self._open[seg] = (fds[0], fds[-1], slot_stride, nslots, registrations)
        return found[:4]

    def _forget(self, seg: int) -> None:
        with self._lock:
            found = self._open.pop(seg, None)
        if found is not None:
            self._close_segment(found)

    def _close_segment(self, found: tuple) -> None:
        fd, direct, _, _, registrations = found
        for registration in registrations:
            self._engine.deregister(registration)
        os.close(fd)
        if direct != fd:
            os.close(direct)

    def _state(self, seg: int) -> tuple[Optional[str], int]:
        """(why ``seg``'s open file can hold none of its records, or None; its size)."""
        fd = self._segment(seg)[0]
        info = os.fstat(fd)
        if info.st_nlink == 0:
            return f"segment file {self._file(seg)} was deleted", 0
        return None, info.st_size

    def _repair(self, seg: int, reason: str) -> None:
        """Give a deleted, missing or truncated segment its full layout again so writes can use
        it; records that were lost with it fail to read (and leave the index)."""
        logger.warning("%s; laying it out again for new records", reason)
        self._forget(seg)
        slot_stride, nslots = self._segment_shape(seg)
        full = segment_file_bytes(slot_stride, nslots)
        try:
            fd = create_file(self._dir_fd, segment_name(seg), self._file(seg), self._modes)
        except FileExistsError:
            fd = open_no_follow(self._dir_fd, segment_name(seg), os.O_RDWR, self._file(seg))
        try:
            if os.fstat(fd).st_size < full:
                os.ftruncate(fd, full)
            os.pwrite(fd, pack_superblock(seg, slot_stride, nslots), 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.fsync(self._dir_fd)

    def _usable(self, seg: int, for_write: bool) -> tuple[Optional[str], int]:
        """(None, file size) if ``seg`` can be used, else (why not, 0). For a write, a deleted,
        missing or truncated file is laid out again first."""
        for attempt in range(2):
            try:
                reason, size = self._state(seg)
            except FileNotFoundError:
                reason, size = f"segment file {self._file(seg)} is missing", 0
            except KeyError as exc:
                return str(exc), 0
            except OSError as exc:
                self._forget(seg)
                return f"segment file {self._file(seg)}: {exc}", 0
            if reason is None and for_write:
                slot_stride, nslots = self._segment(seg)[2:]  # as opened: no index read per put
                if size < segment_file_bytes(slot_stride, nslots):
                    reason = f"segment file {self._file(seg)} is {size} bytes, short of its layout"
            if reason is None:
                return None, size
            self._forget(seg)
            if not for_write or attempt:
                return reason, 0
            try:
                self._repair(seg, reason)
            except OSError as exc:
                return f"{reason}; laying it out again failed: {exc}", 0
        return reason, 0

    def locate(self, slots: Sequence[SlotRef], length: int, for_write: bool) -> Located:
        """Descriptor devices and offsets of ``slots``; pages that cannot be moved are in
        ``bad``: a deleted or missing segment file, or (reads) a record past the end of a
        truncated one."""
        count = len(slots)
        if count <= _SMALL_LOCATE:
            return self._locate_few(slots, length, for_write)
        segs = np.fromiter((s.seg for s in slots), dtype=np.int64, count=count)
        slot_ids = np.fromiter((s.slot for s in slots), dtype=np.uint64, count=count)
        devs = np.zeros(count, dtype=np.uint64)
        direct_devs = np.zeros(count, dtype=np.uint64)
        payload_offs = np.zeros(count, dtype=np.uint64)
        bad: dict[int, str] = {}
        distinct = {s.seg for s in slots}
        for seg in distinct:
            mask = segs == seg if len(distinct) > 1 else slice(None)
            reason, size = self._usable(seg, for_write)
            if reason is not None:
                bad.update((int(i), reason) for i in np.arange(count)[mask])
                continue
            fd, direct, slot_stride, nslots = self._segment(seg)
            devs[mask] = fd
            direct_devs[mask] = direct
            payload_offs[mask] = (
                SUPERBLOCK_BYTES + header_table_bytes(nslots) + slot_ids[mask] * np.uint64(slot_stride)
            )
            if size < segment_file_bytes(slot_stride, nslots):
                short = np.flatnonzero((segs == seg) & (payload_offs + length > size))
                reason = f"segment file {self._file(seg)} is cut short at {size} bytes"
                bad.update((int(i), reason) for i in short)
        header_offs = np.uint64(SUPERBLOCK_BYTES) + slot_ids * np.uint64(HEADER_BYTES)
        return Located(devs, direct_devs, header_offs, payload_offs, bad)

    def _locate_few(self, slots: Sequence[SlotRef], length: int, for_write: bool) -> Located:
        """``locate`` for a few slots: the same answer, in plain Python (array setup costs more
        than the work here). A segment already open and whole takes one ``fstat`` and no lock;
        any other goes through ``_usable`` (which repairs, forgets, reports)."""
        rows = []
        bad: dict[int, str] = {}
        states: dict[int, tuple] = {}
        for i, ref in enumerate(slots):
            state = states.get(ref.seg)
            if state is None:
                state = states[ref.seg] = self._few_state(ref.seg, for_write)
            reason, size, fd, direct, slot_stride, nslots, full = state
            if reason is not None:
                bad[i] = reason
                rows.append((fd, direct, SUPERBLOCK_BYTES + ref.slot * HEADER_BYTES, 0))
                continue
            payload = SUPERBLOCK_BYTES + header_table_bytes(nslots) + ref.slot * slot_stride
            if size < full and payload + length > size:
                bad[i] = f"segment file {self._file(ref.seg)} is cut short at {size} bytes"
            rows.append((fd, direct, SUPERBLOCK_BYTES + ref.slot * HEADER_BYTES, payload))
        columns = np.array(rows, dtype=np.uint64).T  # one array, its rows contiguous
        return Located(columns[0], columns[1], columns[2], columns[3], bad)

    def _few_state(self, seg: int, for_write: bool) -> tuple:
        """(why ``seg`` cannot be used or None, file size, fd, O_DIRECT fd, slot_stride, nslots,
        full file size) for ``_locate_few``."""
        found = self._open.get(seg)  # a dict read: the lock guards opening and closing
        if found is not None:
            fd, direct, slot_stride, nslots = found[:4]
            full = segment_file_bytes(slot_stride, nslots)
            try:
                info = os.fstat(fd)
            except OSError:
                info = None
            if info is not None and info.st_nlink and info.st_size >= full:
                return None, info.st_size, fd, direct, slot_stride, nslots, full
        reason, size = self._usable(seg, for_write)
        if reason is not None:
            return reason, 0, 0, 0, 0, 0, 0
        fd, direct, slot_stride, nslots = self._segment(seg)
        return None, size, fd, direct, slot_stride, nslots, segment_file_bytes(slot_stride, nslots)

    def read_ahead_headers(self, located: Located, items: Sequence[int]) -> None:
        """Start reading the record headers of ``items`` into the page cache and return at once
        (``POSIX_FADV_WILLNEED``, one call per run of headers in a file, a run ending where the
        next header lies more than ``_AHEAD_GAP`` further: a scattered batch does not read the
        header table between its pages). Headers go through the buffered descriptor, whose
        read NIXL does inside the post: uncached, the first request's post waited for the disk
        before the later requests could be posted (1.4-2.1 ms of an 8-page cold read on a
        virtio disk). Advisory: errors are ignored."""
        if not len(items):
            return
        at = np.asarray(items, dtype=np.int64)
        devs, offsets = located.devs[at], located.header_offs[at]
        order = np.lexsort((offsets, devs))
        devs, offsets = devs[order], offsets[order]
        breaks = np.flatnonzero((devs[1:] != devs[:-1]) | (offsets[1:] - offsets[:-1] > _AHEAD_GAP)) + 1
        starts = np.concatenate(([0], breaks)).tolist()
        ends = np.concatenate((breaks, [len(offsets)])).tolist()
        for lo_at, hi_at in zip(starts, ends):
            lo, hi = int(offsets[lo_at]), int(offsets[hi_at - 1]) + HEADER_BYTES
            try:
                os.posix_fadvise(int(devs[lo_at]), lo, hi - lo, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass

    def start_writeback(self, remote: np.ndarray) -> None:
        """Ask the kernel to start writing the byte range a request just dirtied, per file, so
        the device works while the next request is checksummed and copied (RocksDB's
        ``bytes_per_sync``); ``make_durable`` then mostly waits. Advisory: errors are ignored."""
        if _sync_file_range is None:
            return
        if len(remote) <= 8:  # a small request: plain Python beats array setup
            spans: dict[int, tuple[int, int]] = {}
            for offset, length, fd in remote.tolist():
                start, end = spans.get(fd, (offset, offset + length))
                spans[fd] = (min(start, offset), max(end, offset + length))
            for fd, (start, end) in spans.items():
                _sync_file_range(fd, start, end - start, _SYNC_FILE_RANGE_WRITE)
            return
        for fd in set(remote[:, 2].tolist()):  # (np.unique's first call imports numpy.ma: 6-11 ms)
            rows = remote[remote[:, 2] == fd]
            start = int(rows[:, 0].min())
            end = int((rows[:, 0] + rows[:, 1]).max())
            _sync_file_range(fd, start, end - start, _SYNC_FILE_RANGE_WRITE)

    def make_durable(self, segs: set[int]) -> None:
        for seg in sorted(segs):
            os.fdatasync(self._segment(seg)[0])  # the file's data, through either descriptor

    def close(self) -> None:
        with self._lock:
            for found in self._open.values():
                self._close_segment(found)
            self._open.clear()
        os.close(self._dir_fd)


class SlotObjects:
    """OBJ medium: one object per slot (header then payload), keys ``<prefix><seg>/<slot>``.

    NIXL's OBJ backend writes whole objects only, so a record is staged contiguously before
    upload (``whole_records``); reads take the header and the payload (at offset 64) in place.
    Untested: the nixl-cu13 1.5.1 wheel's OBJ plugin needs ``libcuobjclient.so.1`` (CUDA)."""

    mem_type = "OBJ"
    whole_records = True
    direct_io = False

    def __init__(self, engine: NixlEngine, prefix: str):
        self._engine = engine
        self._prefix = prefix
        self._lock = threading.Lock()
        self._registered: dict[int, object] = {}

    def create(self, seg: int, slot_stride: int, nslots: int) -> None:
        """Objects come into being when written; nothing to create."""

    def unused_slots_empty(self, seg: int, first: int, count: int) -> bool:
        """Not checked for objects (see RELIABILITY.md's limits)."""
        return True

    def _device(self, slot: SlotRef, length: int) -> int:
        dev = (slot.seg << 32) | slot.slot
        with self._lock:
            if dev not in self._registered:
                self._registered[dev] = self._engine.register(
                    [(0, HEADER_BYTES + length, dev, f"{self._prefix}{slot.seg}/{slot.slot}")],
                    "OBJ",
                )
        return dev

    def locate(self, slots: Sequence[SlotRef], length: int, for_write: bool) -> Located:
        devs = np.array([self._device(s, length) for s in slots], dtype=np.uint64)
        return Located(
            devs,
            devs,
            np.zeros(len(slots), dtype=np.uint64),
            np.full(len(slots), HEADER_BYTES, dtype=np.uint64),
            {},
        )

    @staticmethod
    def stage(
        located: Located, pages: Sequence[int], buffers: PageBuffers, source_pages: Sequence[int],
        headers: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One contiguous record per page (header, then the pieces in order) and its
        descriptors; the staging array must outlive the request."""
        record = HEADER_BYTES + buffers.page_bytes
        staging = np.empty((len(pages), record), dtype=np.uint8)
        staging[:, :HEADER_BYTES] = headers
        for row, page in enumerate(source_pages):
            lo, hi = int(buffers.first[page]), int(buffers.first[page + 1])
            for k in range(lo, hi):
                start = HEADER_BYTES + int(buffers.offsets[k])
                ctypes.memmove(
                    staging[row, start:].ctypes.data, int(buffers.ptrs[k]), int(buffers.lens[k])
                )
        local = np.empty((len(pages), 3), dtype=np.uint64)
        remote = np.empty((len(pages), 3), dtype=np.uint64)
        local[:, 0] = staging.ctypes.data + np.arange(len(pages), dtype=np.uint64) * record
        local[:, 1] = record
        local[:, 2] = 0
        remote[:, 0] = 0
        remote[:, 1] = record
        remote[:, 2] = located.devs[np.asarray(pages, dtype=np.int64)]
        return local, remote, staging

    def read_ahead_headers(self, located: Located, items: Sequence[int]) -> None:
        """Headers travel inside each object's payload."""

    def start_writeback(self, remote: np.ndarray) -> None:
        """Objects are written when the request completes."""

    def make_durable(self, segs: set[int]) -> None:
        """A completed PUT is durable."""

    def close(self) -> None:
        with self._lock:
            for registration in self._registered.values():
                self._engine.deregister(registration)
            self._registered.clear()


def _libc_sync_file_range() -> Optional[Callable[[int, int, int, int], int]]:
    function = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        function.restype = ctypes.c_int
    return function


_sync_file_range = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2
