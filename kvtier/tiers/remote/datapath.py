"""The remote store's data path: a batch of records between caller memory and the medium.

Owns how a batch moves once the index has said where its records are: splitting it into NIXL
requests of ``pipeline_bytes``, sealing (CRC32C, headers, MAC) and checking records on the
checksum threads while the next request moves, which local memory NIXL knows (host regions
registered by the caller, and this module's own registered blocks: record headers, and the
aligned staging that ``O_DIRECT`` needs where caller memory is not 4 KiB aligned), and the
``O_DIRECT`` or buffered route of each descriptor (``segments.build_descriptors``). It must
never touch the index (which slot, visibility, eviction: the store decides), never return a
record it did not verify, and never register or deregister memory per call for its own
buffers.

Routes, per call: with direct I/O off (a file system that refuses it, tmpfs, the OBJ medium)
every piece moves zero-copy through the buffered descriptor, as NIXL's POSIX backend does
with any file. With direct I/O on, pages whose pieces are all 4 KiB aligned in address and
length, and no smaller than ``STAGED_PIECE_BYTES``, move zero-copy through the ``O_DIRECT``
descriptor (a pinned host pool, as SGLang allocates on a GPU machine); other pages move whole
slots through registered, aligned staging blocks (one per request, reused), copied to or from
the pieces on the checksum threads: a write copies then checksums the copy it writes; a read
checks the staged record and copies only verified bytes. (SGLang's NIXL backend does the same:
zero-copy when the host pool is page aligned, bounce buffers otherwise.) Headers (64 bytes)
always use the buffered descriptor. A request's records go in file order, and descriptors that
continue each other on both sides (neighbouring slots staged side by side, or pages contiguous
in one registered region) are merged: one large read or write instead of one per piece.

Requests in flight: buffered requests run one at a time (Linux AIO copies buffered reads and
writes inside the call that posts them). ``O_DIRECT`` requests queue only their own reads at
the device, so up to ``DIRECT_REQUESTS_IN_FLIGHT`` are posted before the oldest is waited
for; a request's pages are checked while the later ones move, and a large get is spread over
that many requests so that only the last one's pages are checked after the last byte arrived.
Every posted request is waited for before a call returns, errors included.
"""

from __future__ import annotations

import logging
import mmap
import os
import sqlite3
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional, Sequence

import numpy as np

from kvtier.tiers.remote.buffers import PageBuffers, block_address, view
from kvtier.tiers.remote.errors import TransferFailed
from kvtier.tiers.remote.nixl import NixlEngine
from kvtier.tiers.remote.records import HEADER_BYTES, SLOT_ALIGN, RecordCodec
from kvtier.tiers.remote.segments import Located, build_descriptors, merge_descriptors
from kvtier.tiers.remote.small_batches import SMALL_BATCH_PAGES, SmallReads, SmallWrites

logger = logging.getLogger(__name__)

PARALLEL_CHECKSUM_BYTES = 4 << 20
# With direct I/O, pages of pieces below this size move whole records through staging, and
# neighbouring records as one read or write. Measured on a 2-core VM's virtio disk, 128 pages
# of 16 pieces, steady state: 4 KiB pieces, get 14.8-18.4 -> 9.4-11.1 ms, put 24.7-36.7 ->
# 13.3-19.4 ms; 64 KiB pieces (8 pages) gained no read speed and their puts slowed from 8-11 to
# 14-16 ms (the copy into staging costs more than 64 KiB direct writes lose).
STAGED_PIECE_BYTES = 32 << 10
# A get of several requests' worth is spread over the requests in flight, none below this size
# (a request costs NIXL tens of µs of CPU): the first requests' pages are checked while the
# last move.
SPREAD_REQUEST_BYTES = 1 << 20
CHECKSUM_THREAD_PREFIX = "kvtier-remote-crc"
# Requests in flight at once with O_DIRECT (each keeps only its own reads queued at the device;
# buffered requests do their copies when posted, so one at a time).
DIRECT_REQUESTS_IN_FLIGHT = 4
_SMALL_REQUEST_ROWS = 8
_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
# What fails one request (its pages), not the call.
REQUEST_ERRORS = (TransferFailed, OSError, KeyError, sqlite3.Error)


class HostRegions:
    """Host memory registered with NIXL for good (the caller's pools, this module's blocks):
    requests whose local ranges lie inside skip registration."""

    def __init__(self, engine: NixlEngine):
        self._engine = engine
        self._lock = threading.Lock()
        self._regions: list[tuple[int, int, object]] = []
        self._starts = np.empty(0, dtype=np.uint64)
        self._ends = np.empty(0, dtype=np.uint64)

    def add(self, ptr: int, nbytes: int) -> None:
        registration = self._engine.register([(ptr, nbytes, 0, "")], "DRAM")
        with self._lock:
            self._regions.append((ptr, ptr + nbytes, registration))
            self._refresh()

    def remove(self, ptr: int, nbytes: int, deregister: bool) -> None:
        with self._lock:
            for entry in self._regions:
                if entry[:2] == (ptr, ptr + nbytes):
                    self._regions.remove(entry)
                    self._refresh()
                    break
            else:
                raise ValueError(
                    f"host memory [{ptr:#x}, +{nbytes}) was not registered; registered: "
                    f"{[(hex(s), e - s) for s, e, _ in self._regions]}"
                )
        if deregister:
            self._engine.deregister(entry[2])

    def _refresh(self) -> None:
        self._starts = np.array([s for s, _, _ in self._regions], dtype=np.uint64)
        self._ends = np.array([e for _, e, _ in self._regions], dtype=np.uint64)

    def region_ids(self, local: np.ndarray) -> np.ndarray:
        """Per local row, the index of the region holding it whole, or -1 (rows no region
        covers are registered for their request as merged ranges: ``register_uncovered``)."""
        starts, ends = self._starts, self._ends
        if not len(starts):
            return np.full(len(local), -1, dtype=np.int64)
        lo = local[:, 0]
        hi = lo + local[:, 1]
        inside = (lo[:, None] >= starts[None, :]) & (hi[:, None] <= ends[None, :])
        return np.where(inside.any(axis=1), inside.argmax(axis=1), -1)

    def register_uncovered(self, local: np.ndarray):
        """Register, for one request, the local ranges no region covers (None if all are)."""
        starts, ends = self._starts, self._ends
        if len(local) <= _SMALL_REQUEST_ROWS:  # a small call: plain Python beats array setup
            regions = list(zip(starts.tolist(), ends.tolist()))
            rows = [
                (start, start + length) for start, length in local[:, :2].tolist()
                if not any(s <= start and start + length <= e for s, e in regions)
            ]
            if not rows:
                return None
            return self._engine.register([(s, e - s, 0, "") for s, e in sorted(rows)], "DRAM")
        lo = local[:, 0]
        hi = lo + local[:, 1]
        if len(starts):
            inside = ((lo[:, None] >= starts[None, :]) & (hi[:, None] <= ends[None, :])).any(axis=1)
            if inside.all():
                return None
            lo, hi = lo[~inside], hi[~inside]
        order = np.argsort(lo, kind="stable")
        merged: list[list[int]] = []
        for start, end in zip(lo[order].tolist(), hi[order].tolist()):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        return self._engine.register([(s, e - s, 0, "") for s, e in merged], "DRAM")

    def close(self) -> None:
        with self._lock:
            regions, self._regions = self._regions, []
            self._refresh()
        for _, _, registration in regions:
            self._engine.deregister(registration)


class Blocks:
    """Page-aligned host blocks of ``nbytes``, registered once when first made and reused: a
    request takes one and gives it back; as many exist as requests ever ran at once."""

    def __init__(self, regions: HostRegions, nbytes: int):
        self.nbytes = nbytes
        self._regions = regions
        self._lock = threading.Lock()
        self._free: list[mmap.mmap] = []
        self._all: list[mmap.mmap] = []

    def take(self) -> tuple[mmap.mmap, int]:
        """(block, its address)."""
        with self._lock:
            block = self._free.pop() if self._free else None
        if block is None:
            block = mmap.mmap(-1, self.nbytes)
            self._regions.add(block_address(block), self.nbytes)
            with self._lock:
                self._all.append(block)
        return block, block_address(block)

    def give(self, block: mmap.mmap) -> None:
        with self._lock:
            self._free.append(block)

    def close(self) -> None:
        """Forget the blocks (``HostRegions.close`` deregisters them); they are unmapped when the
        last reference goes."""
        with self._lock:
            self._free.clear()
            self._all.clear()


class _Done:
    """Verdicts known at once, with the ``result()`` of a future (a ``Future`` costs a
    condition variable)."""

    __slots__ = ("_value",)

    def __init__(self, value):
        self._value = value

    def result(self):
        return self._value


class _InFlight:
    """A posted request and what it holds until it is finished."""

    __slots__ = ("request", "header_block", "staging", "pages", "crcs", "remote", "record_staging")

    def __init__(self, request, header_block, staging, pages, crcs=None, remote=None, record_staging=None):
        self.request = request
        self.header_block = header_block
        self.staging = staging
        self.pages = pages
        self.crcs = crcs
        self.remote = remote
        self.record_staging = record_staging


class DataPath:
    """Moves batches of records for one store (see the module docstring). Thread-safe."""

    def __init__(
        self,
        engine: NixlEngine,
        medium,
        codec: RecordCodec,
        page_bytes: int,
        slot_stride: int,
        pipeline_bytes: int,
        checksum_threads: int,
    ):
        self._engine = engine
        self._medium = medium
        self._codec = codec
        self.page_bytes = page_bytes
        self.slot_stride = slot_stride
        self.per_request = max(1, pipeline_bytes // page_bytes)
        self._checksum_threads = checksum_threads
        self._pool = ThreadPoolExecutor(checksum_threads, CHECKSUM_THREAD_PREFIX)
        self.host = HostRegions(engine)
        self._headers = Blocks(self.host, -(-self.per_request * HEADER_BYTES // SLOT_ALIGN) * SLOT_ALIGN)
        self._staging = Blocks(self.host, self.per_request * slot_stride)
        self.window = DIRECT_REQUESTS_IN_FLIGHT if medium.direct_io else 1
        self._small = SmallReads(codec, page_bytes, slot_stride)
        self._small_writes = SmallWrites(codec, page_bytes, slot_stride)
        self._small_lock = threading.Lock()
        self.small_batch_reads = 0
        self.small_batch_writes = 0

    @property
    def direct_io(self) -> bool:
        return bool(self._medium.direct_io)

    def _staged(self, pages: PageBuffers) -> bool:
        """Whether this call's pages go through staging: direct I/O is on and some piece is not
        4 KiB aligned in address or length, or pages come in pieces smaller than
        ``STAGED_PIECE_BYTES`` (one read or write of a whole record, and of neighbouring
        records at once, instead of one small direct I/O per piece)."""
        if not self.direct_io:
            return False
        if not pages.single and int(pages.lens.min()) < STAGED_PIECE_BYTES:
            return True
        return bool(((pages.ptrs | pages.lens) & np.uint64(SLOT_ALIGN - 1)).any())

    @staticmethod
    def _in_file_order(located: Located, items: list[int]) -> list[int]:
        """``items`` (positions in ``located``) sorted by segment and offset, so a request's
        records, and their staging slots, follow the files and neighbouring records merge into
        one descriptor (``merge_descriptors``)."""
        if len(items) < 2:
            return items
        at = np.asarray(items, dtype=np.int64)
        order = np.lexsort((located.payload_offs[at], located.direct_devs[at]))
        return at[order].tolist()

    # ----------------------------------------------------------------- reads
    def read(
        self, ids: Sequence[bytes], located: Located, wanted: list[int], readable: list[int],
        expected: Sequence, pages: PageBuffers,
    ) -> tuple[list[int], list[tuple[list[int], Future]]]:
        """Read the records of ``readable`` (positions in ``wanted``, which maps them to pages
        of the call) and check each against ``expected[page]`` (its index location).

        Returns (pages whose request failed, [(pages, future of their verdicts)]). A few
        records on segment files are read with system calls instead (``small_batches``)."""
        if (
            len(readable) <= SMALL_BATCH_PAGES
            and not self._medium.whole_records
            and self._engine.faults.quiet("READ")
        ):
            failed, verdicts = self._small.read(ids, located, wanted, readable, expected, pages)
            with self._small_lock:
                self.small_batch_reads += 1
            return failed, [([page for page, _ in verdicts], _Done([ok for _, ok in verdicts]))]
        failed: list[int] = []
        checks: list[tuple[list[int], Future]] = []
        staged = self._staged(pages)
        inflight: deque = deque()
        self._medium.read_ahead_headers(located, readable)
        try:
            for chunk in self._chunks(self._in_file_order(located, readable), spread=True):
                sources = [wanted[j] for j in chunk]
                header_block, header_ptr = self._headers.take()
                staging = self._staging.take() if staged else None
                try:
                    local, remote = build_descriptors(
                        located, chunk, pages, sources, header_ptr,
                        (staging[1], self.slot_stride) if staging else None,
                    )
                    request = self._post("READ", local, remote, headers=len(chunk))
                except BaseException as exc:
                    self._give(header_block, staging)
                    if not isinstance(exc, REQUEST_ERRORS):
                        raise
                    logger.warning("remote get of %d pages failed: %s", len(chunk), exc)
                    failed.extend(sources)
                    continue
                inflight.append(_InFlight(request, header_block, staging, sources))
                if len(inflight) >= self.window:
                    self._finish_read(inflight.popleft(), ids, expected, pages, failed, checks, last=False)
            while inflight:
                entry = inflight.popleft()
                # the last request has nothing left to overlap: check it now, split
                self._finish_read(entry, ids, expected, pages, failed, checks, last=not inflight)
        finally:
            self._drain(inflight)
        return failed, checks

    def _finish_read(self, entry: "_InFlight", ids, expected, pages, failed, checks, last: bool) -> None:
        try:
            self._finish(entry.request)
        except REQUEST_ERRORS as exc:
            self._give(entry.header_block, entry.staging)
            logger.warning("remote get of %d pages failed: %s", len(entry.pages), exc)
            failed.extend(entry.pages)
            return
        sources = entry.pages
        args = (sources, [expected[i] for i in sources], ids, entry.header_block, entry.staging, pages)
        checks.append((sources, self._job(self._check, args, pipelined=not last)))

    def _check(self, sources, locations, ids, header_block, staging, pages: PageBuffers) -> list[bool]:
        """Whether each page just read has the record header, CRC32C (and MAC) the index
        promises; staged pages are copied to their pieces once verified."""
        try:
            got = bytes(header_block[: len(sources) * HEADER_BYTES])

            # pages of many pieces are copied out in one array operation once verified
            scattered = bool(staging) and not pages.single

            def verify(j: int) -> bool:
                loc = locations[j]
                views = (
                    [view(staging[1] + j * self.slot_stride, self.page_bytes)] if staging
                    else pages.views(sources[j])
                )
                ok = self._codec.verify(
                    ids[sources[j]], self.page_bytes, loc.token, loc.crc,
                    got[j * HEADER_BYTES : (j + 1) * HEADER_BYTES], views,
                )
                if ok and staging and not scattered:
                    pages.scatter(sources[j], staging[1] + j * self.slot_stride)
                return ok

            verdicts = self._parallel(verify, len(sources))
            if scattered:
                good = [j for j, ok in enumerate(verdicts) if ok]
                if len(good) == len(sources):
                    pages.copy_pages(sources, staging[1], self.slot_stride, into_block=False)
                else:  # verified pages only, each from its own place in the block
                    for j in good:
                        pages.scatter(sources[j], staging[1] + j * self.slot_stride)
            return verdicts
        finally:
            self._give(header_block, staging)

    # ----------------------------------------------------------------- writes
    def write_durable(
        self, ids: Sequence[bytes], tokens: Sequence[int], located: Located, writable: list[int],
        pages: PageBuffers,
    ) -> Optional[tuple[list[int], dict[int, int]]]:
        """Write a few records with system calls and make them durable (``small_batches``):
        (pages durable, their CRC32C); None where this route does not apply (more than
        ``SMALL_BATCH_PAGES`` pages, the OBJ medium, a fault armed for writes): then ``write``
        and the medium's ``make_durable``."""
        if (
            len(writable) > SMALL_BATCH_PAGES
            or self._medium.whole_records
            or not self._engine.faults.quiet("WRITE")
        ):
            return None
        result = self._small_writes.write(ids, tokens, located, writable, pages)
        with self._small_lock:
            self.small_batch_writes += 1
        return result

    def write(
        self, ids: Sequence[bytes], tokens: Sequence[int], located: Located, writable: list[int],
        pages: PageBuffers,
    ) -> tuple[list[int], dict[int, int]]:
        """Write the records of pages ``writable`` (sealed on the checksum threads, the next
        request's seal overlapping this one's move); returns (pages moved, their CRC32C)."""
        staged = self._staged(pages)
        chunks = self._chunks(writable if self._medium.whole_records else self._in_file_order(located, writable))
        # The first request's seal has nothing to overlap with: it runs now, split across the
        # threads; the others queue behind it and overlap the moves.
        seals = [
            self._job(self._seal, (ids, tokens, pages, chunk, staged), pipelined=n > 0)
            for n, chunk in enumerate(chunks)
        ]
        crcs: dict[int, int] = {}
        moved: list[int] = []
        inflight: deque = deque()
        try:
            for chunk, seal in zip(chunks, seals):
                chunk_crcs, header_block, header_ptr, staging = seal.result()
                try:
                    if self._medium.whole_records:
                        headers = np.frombuffer(header_block, dtype=np.uint8, count=len(chunk) * HEADER_BYTES)
                        local, remote, record_staging = self._medium.stage(
                            located, chunk, pages, chunk, headers.reshape(len(chunk), HEADER_BYTES)
                        )
                        header_rows = 0
                    else:
                        local, remote = build_descriptors(
                            located, chunk, pages, chunk, header_ptr,
                            (staging[1], self.slot_stride) if staging else None,
                        )
                        record_staging, header_rows = None, len(chunk)
                    request = self._post("WRITE", local, remote, headers=header_rows)
                except BaseException as exc:
                    self._give(header_block, staging)
                    if not isinstance(exc, REQUEST_ERRORS):
                        raise
                    logger.warning("remote put of %d pages failed: %s", len(chunk), exc)
                    continue
                # OBJ records staged contiguously must outlive the transfer: kept with it
                inflight.append(_InFlight(request, header_block, staging, chunk, chunk_crcs, remote, record_staging))
                if len(inflight) >= self.window:
                    self._finish_write(inflight.popleft(), moved, crcs)
            while inflight:
                self._finish_write(inflight.popleft(), moved, crcs)
        finally:
            self._drain(inflight)
        return moved, crcs

    def _finish_write(self, entry: "_InFlight", moved: list[int], crcs: dict[int, int]) -> None:
        try:
            self._finish(entry.request)
            self._medium.start_writeback(entry.remote)
        except REQUEST_ERRORS as exc:
            logger.warning("remote put of %d pages failed: %s", len(entry.pages), exc)
            return
        finally:
            self._give(entry.header_block, entry.staging)
        crcs.update(zip(entry.pages, entry.crcs))
        moved.extend(entry.pages)

    def _seal(self, ids, tokens, pages: PageBuffers, chunk: list[int], staged: bool):
        """CRC32C and record headers of pages about to be written, headers into a registered
        block; staged pages are first copied into a staging block, and the copy is sealed."""
        header_block, header_ptr = self._headers.take()
        staging = self._staging.take() if staged else None
        # pages of many pieces are gathered in one array operation first; others per page
        # (which the threads split)
        gathered = bool(staging) and not pages.single
        if gathered:
            pages.copy_pages(chunk, staging[1], self.slot_stride, into_block=True)

        def seal(j: int) -> tuple[int, bytes]:
            page = chunk[j]
            if staging:
                at = staging[1] + j * self.slot_stride
                if not gathered:
                    pages.gather(page, at)
                views = [view(at, self.page_bytes)]
            else:
                views = pages.views(page)
            return self._codec.seal(ids[page], self.page_bytes, tokens[page], views)

        sealed = self._parallel(seal, len(chunk))
        header_block[: len(chunk) * HEADER_BYTES] = b"".join(header for _, header in sealed)
        return [crc for crc, _ in sealed], header_block, header_ptr, staging

    # ----------------------------------------------------------------- requests
    def _post(self, op: str, local: np.ndarray, remote: np.ndarray, headers: int) -> tuple:
        """Start one NIXL request; registers the local ranges no host region covers until it
        is finished. Descriptors go in file order so the backend sees sequential I/O, payloads
        before the last ``headers`` rows (record headers, through the buffered descriptor,
        whose read can hold up the submission it is part of)."""
        if len(remote) > 2:
            split = len(remote) - headers
            order = np.concatenate([
                np.lexsort((remote[:split, 0], remote[:split, 2])),
                split + np.lexsort((remote[split:, 0], remote[split:, 2])),
            ])
            local, remote = local[order], remote[order]
            if len(remote) > _SMALL_REQUEST_ROWS and not self._medium.whole_records:
                local, remote = merge_descriptors(local, remote, self.host.region_ids(local))
        registration = self.host.register_uncovered(local)
        try:
            return self._engine.post(op, local, remote, self._medium.mem_type, paced=self.direct_io), registration
        except BaseException:
            if registration is not None:
                self._engine.deregister(registration)
            raise

    def _finish(self, request: tuple) -> None:
        posted, registration = request
        try:
            self._engine.wait(posted)
        finally:
            if registration is not None:
                self._engine.deregister(registration)

    def _drain(self, inflight: deque) -> None:
        """After an unexpected error: wait for the requests still posted (the backend may write
        their memory until then) and give their blocks back."""
        while inflight:
            entry = inflight.popleft()
            try:
                self._finish(entry.request)
            except Exception as exc:
                logger.warning("remote request abandoned after an error: %r", exc)
            finally:
                self._give(entry.header_block, entry.staging)

    def _give(self, header_block, staging) -> None:
        self._headers.give(header_block)
        if staging:
            self._staging.give(staging[0])

    def _chunks(self, items: list[int], spread: bool = False) -> list[list[int]]:
        """Split pages into runs of up to ``pipeline_bytes``, one NIXL request each; with
        ``spread``, into up to ``DIRECT_REQUESTS_IN_FLIGHT`` runs of at least
        ``SPREAD_REQUEST_BYTES``, so the pages of the first requests are checked while the
        later ones move (a call of one request checks all of its pages after its last byte
        arrived)."""
        step = self.per_request
        if spread:
            least = max(1, SPREAD_REQUEST_BYTES // self.page_bytes)
            step = min(step, max(least, -(-len(items) // DIRECT_REQUESTS_IN_FLIGHT)))
        return [items[s : s + step] for s in range(0, len(items), step)]

    def _job(self, fn: Callable, args: tuple, pipelined: bool) -> Future:
        """Run ``fn(*args)`` on the checksum threads when another request of the batch can move
        meanwhile, else now (where it splits its checksum work across the threads)."""
        if pipelined:
            return self._pool.submit(fn, *args)
        job: Future = Future()
        job.set_result(fn(*args))
        return job

    def _parallel(self, fn: Callable[[int], object], count: int) -> list:
        """``[fn(j) for j in range(count)]``; on a caller thread, large work is split across
        the checksum threads and the caller (crc32c and hashlib release the GIL on large
        buffers). On a checksum thread it runs there: that is the pipeline."""
        if (
            count * self.page_bytes < PARALLEL_CHECKSUM_BYTES
            or self._checksum_threads == 1
            or threading.current_thread().name.startswith(CHECKSUM_THREAD_PREFIX)
        ):
            return [fn(j) for j in range(count)]
        # where a core is free for it, the caller takes the last share rather than wait idle
        # (on as many cores as threads, its share would only queue behind theirs)
        caller = _CPUS > self._checksum_threads
        step = -(-count // (self._checksum_threads + caller))

        def share(lo: int) -> list:
            return [fn(j) for j in range(lo, min(lo + step, count))]

        starts = list(range(0, count, step))
        own = starts.pop() if caller else None
        parts = [self._pool.submit(share, lo) for lo in starts]
        try:
            mine = share(own) if own is not None else []
        except BaseException:
            for part in parts:  # the shares may use memory the caller frees once this raises
                part.exception()
            raise
        return [result for part in parts for result in part.result()] + mine

    def shutdown(self, wait: bool) -> None:
        self._pool.shutdown(wait=wait)

    def close(self) -> None:
        """Deregister host regions and blocks (after ``shutdown``)."""
        self._headers.close()
        self._staging.close()
        self.host.close()

