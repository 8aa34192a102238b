"""Remote tier: a durable, shared page store whose bytes move through NIXL.

Owns a store directory: page records in segment files, moved by a NIXL storage backend between
the caller's host memory and the files, and the slot index (``remote_index.RemoteIndex``, SQLite)
that says which slot holds which page. Pages are fixed-size records of ``page_bytes`` addressed by
(namespace, key); the namespace is a hex fingerprint of model, page format and rank, so pages
written under another format are never served.

It must never: move page bytes other than through NIXL (``os.ftruncate``, ``os.fdatasync`` and
``sync_file_range`` only manage files); return a page whose record header or checksum does not
match (a miss, counted); make a page visible before its record is durable; remove another
namespace's pages except by capacity eviction; hold the index lock while bytes move.

Layout of a directory::

    index.sqlite3 (+ -wal, -shm)   slot index, shared by every process (WAL mode)
    segments/00000001.seg          segment file: a header table, then fixed slots
    segments/00000002.seg ...

A segment holds ``nslots`` slots of one ``slot_stride`` (``page_bytes`` rounded up to 4 KiB, so
payloads stay 4 KiB aligned for O_DIRECT and GDS). Bytes ``[0, H)`` are the header table, 64 bytes
per slot, ``H`` = ``nslots * 64`` rounded up to 4 KiB; slot ``i``'s payload starts at
``H + i * slot_stride``. Segments are created sparse at ``segment_bytes`` (default 1 GiB), opened
once per process, kept open and registered with NIXL once: a batch costs no ``open`` or
registration of files, and slots are reused in place. (SGLang's NIXL backend keeps one file per
key and opens and registers it per transfer.) Headers live in a table rather than next to each
payload so a record costs 64 bytes, not a 4 KiB block, and payloads keep their alignment; a
second descriptor for the header stream was measured and gave nothing (kernel readahead copes).

Record header (64 bytes, little endian): magic ``KVTP``, format version, header size, namespace
fingerprint (blake2b-128), key digest (blake2b-128), payload length, write token (random 63-bit,
also in the index), payload CRC32C, CRC32C of the header. A read moves each header into a staging
array and each payload straight into the caller's buffer, then checks every header field against
the index and the CRC32C of the caller's buffer. Any mismatch is a miss: ``corrupt_reads`` if the
index still names that record (which is then unpublished), ``raced_reads`` if the key was
rewritten or removed meanwhile. On a miss the caller's buffer content is unspecified.

Data path and measured choices (2 vCPU VM, virtio disk of about 1.5 GB/s write and 1.9 GB/s
read; ``benchmarks/remote_bandwidth.py``):
- A batch moves in NIXL requests of up to ``pipeline_bytes`` (default 8 MiB), never one per page:
  the checksum threads seal request k+1 (CRC32C, headers) while request k moves, and check request
  k while k+1 moves. The crc32c package (CPU CRC instructions) runs at about 15 GB/s a core and
  releases the GIL, and so does NIXL while it moves bytes. One request per 64 MiB batch read 64 KiB pages cold at 0.88 GB/s,
  8 MiB requests at 1.32 GB/s (4 MiB: the same; 16 MiB: 1.17).
- After each write request, ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` starts writeback of the
  bytes it dirtied (RocksDB's ``bytes_per_sync``), so the device works while the next request is
  sealed and copied; the ``fdatasync`` per batch then mostly waits. This took 256 KiB-4 MiB page
  writes from 0.6-0.75x to 0.95-1.1x of a plain ``write`` + ``fsync`` loop.
- The POSIX backend's queues (Linux AIO, NIXL's default; io_uring; POSIX AIO) measured within
  noise of each other here. With Linux AIO on buffered files a poll of the request performs the
  copies itself, so a poll that did work is followed at once by the next (sleeping between
  them cost a quarter of warm-read speed).
- Per page the Python bookkeeping on the calling thread costs about 7 us (index lookup 2-4 us,
  buffer checks, descriptors), which is what separates 64 KiB pages from large ones.
- Checksums: zlib's crc32 (2.3 GB/s a core) held warm reads to 0.30-0.40x of the raw baseline,
  which copies at 6 GB/s and checks nothing. CRC32C (format version 2) lifted them to 0.54-0.74x
  and cold reads from 0.68-0.92x to 0.73-0.98x.
Result on 2026-12-02 (512 MiB per size, medians of 3, store / plain Python): writes 0.98-1.28x;
cold reads 0.73x at 64 KiB, 0.91-0.98x from 256 KiB to 4 MiB; warm reads 0.54-0.74x.

Write protocol: reserve slots (index transaction; evicts if over the high watermark), move the
records, ``fdatasync`` each touched segment, then publish (index transaction). A writer killed
before publishing leaves only a reservation, which ``RemoteIndex.reclaim`` frees once its owner is
dead (pid + start time on this host; a lease for other hosts): the half-written slot is never
visible. Two writers of one key each write a fresh slot; the later publication wins and frees the
earlier page's slot.

Reader versus slot reuse: a freed slot is handed out again only after ``reuse_delay_s`` (default
2 s), far longer than the gap between a reader's lookup and its transfer; a slower reader reads a
record whose token, key digest or CRC32C no longer match, which is a miss, never wrong bytes.

Capacity: ``capacity_bytes`` bounds the payload bytes published in the whole directory. The disk
is shared, so eviction is store-wide LRU and may evict other namespaces' pages. When a put would
pass ``high_watermark * capacity_bytes``, least recently used pages are evicted down to
``low_watermark * capacity_bytes``. Freed slots wait ``reuse_delay_s``, so files may briefly hold
more than the capacity. ``clear()`` removes only this namespace.

Failures: a request that raises, reports an error, or does not finish within ``timeout_s`` is
released (NIXL aborts it) and fails the pages it carried, nothing else: ``get`` returns misses and
counts ``read_failures``; ``put`` returns False, counts ``write_failures`` and frees the slots
after the reuse delay (an aborted write may still land). No retry: the caller decides.
``timeout_s`` is checked between polls; with Linux AIO on buffered files a poll does the I/O
itself, so a device that hangs inside one I/O holds that poll (``use_uring`` gives hard timeouts).
``faults`` (``FaultInjector``) is a seam in this code path: tests make the next requests fail,
time out, or pause before publication.

Backends: ``POSIX`` (pass ``backend_params`` such as ``{"use_uring": "true"}``); ``GDS`` and
``GDS_MT`` are tried with a 4 KiB write and read-back and fall back to POSIX with one log line if
the plugin cannot be created, register a file, or move host memory (the nixl-cu13 1.5.1 wheel
cannot load them without ``libcufile``); ``OBJ`` (S3 and compatibles) takes ``backend_params``
through to NIXL and keeps one object per slot under ``object_prefix`` (NIXL's OBJ backend cannot
write at an offset, so a record is staged contiguously before upload), with the index in the
local directory. OBJ is untested: the wheel's OBJ plugin needs ``libcuobjclient.so.1`` (CUDA).

Sharing: processes on one host share a directory (SQLite WAL needs shared memory, so not over a
network file system). Open a store in each process after any fork; a store object is thread-safe.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import logging
import os
import random
import re
import sqlite3
import struct
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from types import ModuleType
from typing import Callable, Optional, Sequence, Union

import numpy as np
import torch

try:
    import crc32c  # hardware CRC32C: about 15 GB/s a core against zlib crc32's 2.3
except ImportError:  # reported when a store is opened, like a missing NIXL
    crc32c = None

from kvtier.tiers.remote_index import PageLocation, RemoteIndex, SlotRef, make_owner

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install --no-deps nixl-cu13==1.5.1 numpy crc32c"
NIXL_MODULES = ("nixl_cu13._api", "nixl_cu12._api")
BACKENDS = ("POSIX", "GDS", "GDS_MT", "OBJ")
MAGIC = b"KVTP"
# 2: CRC32C (Castagnoli, SSE4.2 / ARMv8 CRC instructions) instead of zlib's crc32.
FORMAT_VERSION = 2
HEADER_BYTES = 64
SLOT_ALIGN = 4096
_HEADER_BODY = struct.Struct("<4sHH16s16sQQI")
_HEADER_CRC = struct.Struct("<I")
_PARALLEL_CHECKSUM_BYTES = 4 << 20
_POLL_WORK_S = 50e-6
_CHECKSUM_THREAD_PREFIX = "kvtier-remote-crc"
_POLL_MAX_PAUSE_S = 5e-4
_NAMESPACE = re.compile(r"[0-9a-fA-F]+")

Key = Union[str, bytes]
Buffer = Union[torch.Tensor, tuple]


class RemoteUnavailable(RuntimeError):
    """NIXL (or the requested storage backend) cannot be used on this machine."""


class TransferFailed(RuntimeError):
    """A NIXL transfer raised, reported an error, or timed out; it was released."""


def load_nixl_api() -> ModuleType:
    """The NIXL Python API module: ``nixl_cu13._api``, else ``nixl_cu12._api``."""
    if crc32c is None:
        raise RemoteUnavailable(f"the remote tier checks pages with crc32c, which is not installed; install it with: {INSTALL_HINT}")
    errors = []
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise RemoteUnavailable(
        f"NIXL is not importable ({'; '.join(errors)}); install it with: {INSTALL_HINT}"
    )


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _store_directory(location: Union[str, os.PathLike]) -> str:
    if isinstance(location, os.PathLike):
        return os.fspath(location)
    parsed = urllib.parse.urlparse(location)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(
                f"store location {location!r} names host {parsed.netloc!r}; expected "
                "file:///absolute/path (mount a shared file system to share a store)"
            )
        return urllib.request.url2pathname(parsed.path)
    if parsed.scheme == "":
        return location
    raise ValueError(
        f"store location {location!r} has scheme {parsed.scheme!r}; expected file:// or a path"
    )


def _key_bytes(key: Key) -> bytes:
    if isinstance(key, bytes):
        return key
    if isinstance(key, str):
        return key.encode("utf-8")
    raise TypeError(f"key {key!r} is a {type(key).__name__}; expected str or bytes")


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _view(ptr: int, nbytes: int) -> ctypes.Array:
    return (ctypes.c_ubyte * nbytes).from_address(ptr)


def _libc_sync_file_range() -> Optional[Callable[[int, int, int, int], int]]:
    function = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        function.restype = ctypes.c_int
    return function


_sync_file_range = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def _crc32_all(views: Sequence[ctypes.Array]) -> list[int]:
    return [crc32c.crc32c(v) for v in views]


class FaultInjector:
    """Seam at the backend boundary, used by tests; inert unless armed.

    ``arm(mode, count, op)`` makes the next ``count`` transfers of ``op`` ("READ", "WRITE" or
    None for both) fail as ``mode``:
    - ``"error"``: raise before anything is posted to NIXL (a backend that refuses the request);
    - ``"error_after_io"``: the real transfer runs to completion, then is reported failed (an I/O
      error after some bytes moved);
    - ``"timeout"``: the real transfer is posted but treated as in progress until ``timeout_s``
      passes, then released through the same path as a real timeout.
    ``before_publish(keys)``, when set, runs after a put's records are durable and before they are
    published (tests kill the process there).
    """

    MODES = ("error", "error_after_io", "timeout")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: list[list] = []
        self.before_publish: Optional[Callable[[list[bytes]], None]] = None

    def arm(self, mode: str, count: int = 1, op: Optional[str] = None) -> None:
        """Fail the next ``count`` transfers of ``op`` as ``mode``."""
        if mode not in self.MODES:
            raise ValueError(f"fault mode {mode!r}; expected one of {self.MODES}")
        if op not in ("READ", "WRITE", None):
            raise ValueError(f"fault op {op!r}; expected 'READ', 'WRITE' or None")
        with self._lock:
            self._armed.append([mode, op, count])

    def disarm(self) -> None:
        """Forget every armed fault."""
        with self._lock:
            self._armed.clear()

    def take(self, op: str) -> Optional[str]:
        """The fault mode for this transfer, if one is armed for ``op``."""
        with self._lock:
            for entry in self._armed:
                mode, wanted, remaining = entry
                if wanted in (None, op) and remaining > 0:
                    entry[2] -= 1
                    if entry[2] == 0:
                        self._armed.remove(entry)
                    return mode
        return None


class _NixlEngine:
    """One NIXL agent with one storage backend. Registers memory and runs transfers."""

    def __init__(
        self, api: ModuleType, backend: str, backend_params: dict, directory: str, faults
    ):
        self.faults = faults
        config = api.nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            backends=[],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
        )
        name = f"kvtier-remote-{os.getpid()}-{random.getrandbits(32):08x}"
        self.agent = api.nixl_agent(name, config)
        self.backend = self._create_backend(backend, backend_params, directory)

    def _create_backend(self, backend: str, params: dict, directory: str) -> str:
        if backend in ("GDS", "GDS_MT"):
            try:
                self.agent.create_backend(backend, params)
                self._probe_file_transfer(backend, directory)
                return backend
            except Exception as exc:
                logger.warning(
                    "NIXL %s backend unavailable (%s: %s); falling back to POSIX",
                    backend, type(exc).__name__, exc,
                )
                backend, params = "POSIX", {}
        try:
            self.agent.create_backend(backend, params)
        except Exception as exc:
            raise RemoteUnavailable(
                f"NIXL cannot create backend {backend!r} with params {params!r}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        return backend

    def _probe_file_transfer(self, backend: str, directory: str) -> None:
        """Register a scratch file and host buffer with ``backend`` and move 4 KiB both ways:
        GDS plugins that load may still be unable to register files (cuFile error 5027 on file
        systems without GPU-direct support) or to move host memory."""
        path = os.path.join(directory, f".gds-probe-{os.getpid()}-{random.getrandbits(32):08x}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, SLOT_ALIGN)
            probe = np.full(SLOT_ALIGN, 0x5A, dtype=np.uint8)
            back = np.zeros(SLOT_ALIGN, dtype=np.uint8)
            rows = [(probe.ctypes.data, SLOT_ALIGN, 0, ""), (back.ctypes.data, SLOT_ALIGN, 0, "")]
            registrations = [
                self.agent.register_memory([(0, SLOT_ALIGN, fd, "")], "FILE", backends=[backend]),
                self.agent.register_memory(rows, "DRAM", backends=[backend]),
            ]
            try:
                for op, buffer in (("WRITE", probe), ("READ", back)):
                    handle = self.agent.initialize_xfer(
                        op,
                        self.agent.get_xfer_descs([(buffer.ctypes.data, SLOT_ALIGN, 0)], "DRAM"),
                        self.agent.get_xfer_descs([(0, SLOT_ALIGN, fd)], "FILE"),
                        self.agent.name,
                        backends=[backend],
                    )
                    try:
                        self._wait(handle, op, 1, 30.0, forced_timeout=False)
                    finally:
                        self._release(handle)
                if not np.array_equal(probe, back):
                    raise TransferFailed(f"{backend} read back other bytes than it wrote")
            finally:
                for registration in registrations:
                    self.agent.deregister_memory(registration, backends=[backend])
        finally:
            os.close(fd)
            os.unlink(path)

    def register(self, rows: list[tuple], mem_type: str):
        """Register (addr, len, dev, meta) rows of ``mem_type`` with the backend."""
        try:
            return self.agent.register_memory(rows, mem_type, backends=[self.backend])
        except Exception as exc:
            raise TransferFailed(
                f"NIXL {self.backend} could not register {len(rows)} {mem_type} regions: {exc!r}"
            ) from exc

    def deregister(self, registration) -> None:
        self.agent.deregister_memory(registration, backends=[self.backend])

    def transfer(
        self, op: str, local: np.ndarray, remote: np.ndarray, remote_mem: str, timeout_s: float
    ) -> None:
        """Move bytes for one batch: one NIXL request of Nx3 (addr, len, dev) descriptors."""
        fault = self.faults.take(op)
        if fault == "error":
            raise TransferFailed(f"{op} of {len(local)} descriptors: injected error")
        try:
            handle = self.agent.initialize_xfer(
                op,
                self.agent.get_xfer_descs(local, "DRAM"),
                self.agent.get_xfer_descs(remote, remote_mem),
                self.agent.name,
                backends=[self.backend],
            )
        except Exception as exc:
            raise TransferFailed(f"{op}: NIXL refused the request: {exc!r}") from exc
        try:
            self._wait(handle, op, len(local), timeout_s, forced_timeout=fault == "timeout")
        finally:
            self._release(handle)
        if fault == "error_after_io":
            raise TransferFailed(f"{op} of {len(local)} descriptors: injected error after I/O")

    def _wait(self, handle, op: str, count: int, timeout_s: float, forced_timeout: bool) -> None:
        """Poll until done. With Linux AIO on buffered files a poll submits the next I/Os and
        copies synchronously, so a poll that took time is followed at once by the next; quick
        polls (io_uring, POSIX AIO: the kernel or a thread does the work) back off to 0.5 ms."""
        deadline = time.monotonic() + timeout_s
        pause = 0.0
        try:
            state = self.agent.transfer(handle)
            while state == "PROC" or forced_timeout:
                now = time.monotonic()
                if now >= deadline:
                    raise TransferFailed(
                        f"{op} of {count} descriptors not done after {timeout_s} s "
                        f"(timeout_s={timeout_s}); released"
                    )
                if pause:
                    time.sleep(pause)
                    now = time.monotonic()
                state = self.agent.check_xfer_state(handle)
                worked = time.monotonic() - now > _POLL_WORK_S
                pause = 0.0 if worked else min(max(2 * pause, 1e-5), _POLL_MAX_PAUSE_S)
        except TransferFailed:
            raise
        except Exception as exc:
            raise TransferFailed(f"{op} of {count} descriptors: NIXL error {exc!r}") from exc
        if state != "DONE":
            raise TransferFailed(f"{op} of {count} descriptors: NIXL state {state!r}, expected DONE")

    def _release(self, handle) -> None:
        """Release a request; one still running is aborted by NIXL. If NIXL cannot abort it, wait
        for it: returning while the backend may still write into caller memory is not safe."""
        try:
            handle.release()
            return
        except Exception as exc:
            logger.error("NIXL could not abort a transfer (%r); waiting for it to finish", exc)
        while True:
            try:
                if self.agent.check_xfer_state(handle) != "PROC":
                    break
            except Exception:
                break
            time.sleep(1e-3)
        try:
            handle.release()
        except Exception as exc:
            logger.error("NIXL could not release a finished transfer: %r", exc)

    def close(self) -> None:
        self.agent = None


class _SegmentFiles:
    """FILE medium: segment files of fixed slots, opened and registered once per process."""

    mem_type = "FILE"

    def __init__(self, engine: _NixlEngine, directory: str, index: RemoteIndex):
        self._engine = engine
        self._index = index
        self._dir = os.path.join(directory, "segments")
        os.makedirs(self._dir, exist_ok=True)
        self._lock = threading.Lock()
        self._open: dict[int, tuple[int, int, int, object]] = {}

    def _path(self, seg: int) -> str:
        return os.path.join(self._dir, f"{seg:08d}.seg")

    @staticmethod
    def _header_table_bytes(nslots: int) -> int:
        return _round_up(nslots * HEADER_BYTES, SLOT_ALIGN)

    def create(self, seg: int, slot_stride: int, nslots: int) -> None:
        """Create segment ``seg``'s file, sparse, at full size (called inside the index
        transaction that allocates the segment)."""
        fd = os.open(self._path(seg), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, self._header_table_bytes(nslots) + nslots * slot_stride)
            os.fsync(fd)
        finally:
            os.close(fd)
        directory = os.open(self._dir, os.O_RDONLY)
        try:
            os.fsync(directory)  # the new name survives a power loss before any record does
        finally:
            os.close(directory)

    def _segment(self, seg: int) -> tuple[int, int, int]:
        """(fd, slot_stride, header table bytes) of ``seg``, opening and registering it once."""
        with self._lock:
            found = self._open.get(seg)
            if found is None:
                slot_stride, nslots = self._index.segment(seg)
                table = self._header_table_bytes(nslots)
                fd = os.open(self._path(seg), os.O_RDWR)
                try:
                    registration = self._engine.register(
                        [(0, table + nslots * slot_stride, fd, "")], "FILE"
                    )
                except Exception:
                    os.close(fd)
                    raise
                found = self._open[seg] = (fd, slot_stride, table, registration)
        return found[:3]

    def read_descriptors(
        self, slots: Sequence[SlotRef], headers: np.ndarray, payload_ptrs: Sequence[int], length: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Paired local/remote descriptors: every payload, then every header."""
        count = len(slots)
        segs = np.fromiter((s.seg for s in slots), dtype=np.int64, count=count)
        slot_ids = np.fromiter((s.slot for s in slots), dtype=np.uint64, count=count)
        fds = np.empty(count, dtype=np.uint64)
        strides = np.empty(count, dtype=np.uint64)
        tables = np.empty(count, dtype=np.uint64)
        for seg in {s.seg for s in slots}:
            mask = segs == seg
            fds[mask], strides[mask], tables[mask] = self._segment(seg)
        local = np.empty((2 * count, 3), dtype=np.uint64)
        remote = np.empty((2 * count, 3), dtype=np.uint64)
        local[:count, 0] = payload_ptrs
        local[count:, 0] = headers.ctypes.data + np.arange(count, dtype=np.uint64) * HEADER_BYTES
        local[:count, 1] = length
        local[count:, 1] = HEADER_BYTES
        local[:, 2] = 0
        remote[:count, 0] = tables + slot_ids * strides
        remote[count:, 0] = slot_ids * HEADER_BYTES
        remote[:count, 1] = length
        remote[count:, 1] = HEADER_BYTES
        remote[:count, 2] = fds
        remote[count:, 2] = fds
        return local, remote

    def write_descriptors(
        self, slots: Sequence[SlotRef], headers: np.ndarray, payload_ptrs: Sequence[int], length: int
    ) -> tuple[np.ndarray, np.ndarray, None]:
        """Same pairs as a read: payloads go from the caller's buffers, no staging."""
        return (*self.read_descriptors(slots, headers, payload_ptrs, length), None)

    def start_writeback(self, remote: np.ndarray) -> None:
        """Ask the kernel to start writing the byte range a request just dirtied, per file, so
        the device works while the next request is checksummed and copied (RocksDB's
        ``bytes_per_sync``); ``make_durable`` then mostly waits. Advisory: errors are ignored."""
        if _sync_file_range is None:
            return
        for fd in np.unique(remote[:, 2]).tolist():
            rows = remote[remote[:, 2] == fd]
            start = int(rows[:, 0].min())
            end = int((rows[:, 0] + rows[:, 1]).max())
            _sync_file_range(fd, start, end - start, _SYNC_FILE_RANGE_WRITE)

    def make_durable(self, segs: set[int]) -> None:
        for seg in sorted(segs):
            os.fdatasync(self._segment(seg)[0])

    def close(self) -> None:
        with self._lock:
            for fd, _, _, registration in self._open.values():
                self._engine.deregister(registration)
                os.close(fd)
            self._open.clear()


class _SlotObjects:
    """OBJ medium: one object per slot (header then payload), keys ``<prefix><seg>/<slot>``.

    NIXL's OBJ backend writes whole objects only, so a record is staged contiguously before
    upload; reads take the header and the payload (at offset 64) in place. Untested: see the
    module docstring."""

    mem_type = "OBJ"

    def __init__(self, engine: _NixlEngine, prefix: str):
        self._engine = engine
        self._prefix = prefix
        self._lock = threading.Lock()
        self._registered: dict[int, object] = {}

    def create(self, seg: int, slot_stride: int, nslots: int) -> None:
        """Objects come into being when written; nothing to create."""

    def _device(self, slot: SlotRef, length: int) -> int:
        dev = (slot.seg << 32) | slot.slot
        with self._lock:
            if dev not in self._registered:
                self._registered[dev] = self._engine.register(
                    [(0, HEADER_BYTES + length, dev, f"{self._prefix}{slot.seg}/{slot.slot}")],
                    "OBJ",
                )
        return dev

    def write_descriptors(
        self, slots: Sequence[SlotRef], headers: np.ndarray, payload_ptrs: Sequence[int], length: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        record = HEADER_BYTES + length
        staging = np.empty((len(slots), record), dtype=np.uint8)
        staging[:, :HEADER_BYTES] = headers
        local = np.empty((len(slots), 3), dtype=np.uint64)
        remote = np.empty((len(slots), 3), dtype=np.uint64)
        for i, slot in enumerate(slots):
            ctypes.memmove(staging[i, HEADER_BYTES:].ctypes.data, payload_ptrs[i], length)
            local[i] = (staging[i].ctypes.data, record, 0)
            remote[i] = (0, record, self._device(slot, length))
        return local, remote, staging

    def read_descriptors(
        self, slots: Sequence[SlotRef], headers: np.ndarray, payload_ptrs: Sequence[int], length: int
    ) -> tuple[np.ndarray, np.ndarray]:
        count = len(slots)
        local = np.empty((2 * count, 3), dtype=np.uint64)
        remote = np.empty((2 * count, 3), dtype=np.uint64)
        for i, slot in enumerate(slots):
            dev = self._device(slot, length)
            local[i] = (payload_ptrs[i], length, 0)
            remote[i] = (HEADER_BYTES, length, dev)
            local[count + i] = (headers.ctypes.data + i * HEADER_BYTES, HEADER_BYTES, 0)
            remote[count + i] = (0, HEADER_BYTES, dev)
        return local, remote

    def start_writeback(self, remote: np.ndarray) -> None:
        """Objects are written when the request completes."""

    def make_durable(self, segs: set[int]) -> None:
        """A completed PUT is durable."""

    def close(self) -> None:
        with self._lock:
            for registration in self._registered.values():
                self._engine.deregister(registration)
            self._registered.clear()


class RemoteStore:
    """A durable page store in a directory, shared by processes; bytes move through NIXL.

    ``location`` is a directory path or ``file:///path``. ``namespace`` is a hex fingerprint of
    model, page format and rank; ``page_bytes`` the size of every page. Keys are str (UTF-8) or
    bytes; ``"k"`` and ``b"k"`` are the same key. Buffers are contiguous CPU tensors of
    ``page_bytes`` bytes or ``(ptr, nbytes)`` tuples of host memory. Thread-safe; ``close`` once
    the other calls are done.

    Tuning: ``timeout_s`` per NIXL request; ``segment_bytes`` per segment file; ``reuse_delay_s``
    before a freed slot is rewritten; ``reservation_lease_s`` after which another host's
    unpublished reservation is reclaimed; ``checksum_threads`` (default ``min(4, cpus)``);
    ``pipeline_bytes`` per NIXL request; ``backend_params`` passed to the NIXL backend;
    ``object_prefix`` names objects for ``backend="OBJ"``.
    """

    def __init__(
        self,
        location: Union[str, os.PathLike],
        *,
        namespace: str,
        page_bytes: int,
        capacity_bytes: Optional[int] = None,
        backend: str = "POSIX",
        backend_params: Optional[dict[str, str]] = None,
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
        timeout_s: float = 30.0,
        segment_bytes: int = 1 << 30,
        reuse_delay_s: float = 2.0,
        reservation_lease_s: float = 600.0,
        object_prefix: str = "kvtier/",
        checksum_threads: Optional[int] = None,
        pipeline_bytes: int = 8 << 20,
    ):
        if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
            raise ValueError(f"namespace {namespace!r}; expected a non-empty hex string")
        if not isinstance(page_bytes, int) or page_bytes <= 0:
            raise ValueError(f"page_bytes {page_bytes!r}; expected a positive int")
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes {capacity_bytes!r}; expected None or > 0")
        if not 0.0 < low_watermark <= high_watermark <= 1.0:
            raise ValueError(
                f"watermarks low={low_watermark!r} high={high_watermark!r}; "
                "expected 0 < low <= high <= 1"
            )
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r}; expected one of {BACKENDS}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s {timeout_s!r}; expected > 0")
        if checksum_threads is None:
            checksum_threads = min(4, os.cpu_count() or 1)
        if checksum_threads < 1:
            raise ValueError(f"checksum_threads {checksum_threads!r}; expected >= 1")
        if pipeline_bytes <= 0:
            raise ValueError(f"pipeline_bytes {pipeline_bytes!r}; expected > 0")
        self.namespace = namespace
        self.page_bytes = page_bytes
        self.capacity_bytes = capacity_bytes
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.timeout_s = timeout_s
        self.slot_stride = _round_up(page_bytes, SLOT_ALIGN)
        if segment_bytes < self.slot_stride:
            raise ValueError(
                f"segment_bytes {segment_bytes}; expected at least one slot ({self.slot_stride})"
            )
        self.slots_per_segment = segment_bytes // self.slot_stride
        self.directory = _store_directory(location)
        os.makedirs(self.directory, exist_ok=True)
        self.faults = FaultInjector()
        self._ns_fingerprint = _digest(b"kvtier-namespace:" + namespace.encode())
        api = load_nixl_api()
        self._engine = _NixlEngine(
            api, backend, dict(backend_params or {}), self.directory, self.faults
        )
        self._index = RemoteIndex(
            self.directory,
            owner=make_owner(f"{random.getrandbits(64):016x}"),
            reuse_delay_s=reuse_delay_s,
            reservation_lease_s=reservation_lease_s,
        )
        self._index.reclaim()
        if self._engine.backend == "OBJ":
            self._medium = _SlotObjects(self._engine, object_prefix)
        else:
            self._medium = _SegmentFiles(self._engine, self.directory, self._index)
        self._checksum_threads = checksum_threads
        self.pipeline_bytes = pipeline_bytes
        self._checksum_pool = ThreadPoolExecutor(checksum_threads, _CHECKSUM_THREAD_PREFIX)
        self._host_lock = threading.Lock()
        self._host_memory: list[tuple[int, int, object]] = []
        self._stats_lock = threading.Lock()
        self._counters = dict.fromkeys(
            (
                "hits", "misses", "corrupt_reads", "raced_reads", "read_failures",
                "write_failures", "rejected_writes", "evictions", "bytes_written", "bytes_read",
            ),
            0,
        )
        self._closed = False

    @property
    def backend(self) -> str:
        """The NIXL backend in use (after any GDS to POSIX fallback)."""
        return self._engine.backend

    # ----------------------------------------------------------------- queries
    def contains(self, keys: Sequence[Key]) -> list[bool]:
        """Whether each key has a published page in this namespace (index only, no I/O)."""
        self._check_open()
        locations = self._index.lookup(self.namespace, [_key_bytes(k) for k in keys])
        return [loc is not None and loc.length == self.page_bytes for loc in locations]

    def exists(self, keys: Sequence[Key]) -> int:
        """Number of leading keys present, as SGLang's ``batch_exists``."""
        present = self.contains(keys)
        return present.index(False) if False in present else len(present)

    def stats(self) -> dict[str, int]:
        """Counters of this object, page counts of this namespace and of the whole store."""
        self._check_open()
        with self._stats_lock:
            counters = dict(self._counters)
        counters.update(self._index.stats(self.namespace))
        counters["capacity_bytes"] = self.capacity_bytes or 0
        return counters

    # ----------------------------------------------------------------- data path
    def put(self, keys: Sequence[Key], buffers: Sequence[Buffer]) -> list[bool]:
        """Store pages; True where the page is durable and published.

        The batch moves in NIXL requests of up to ``pipeline_bytes``; the checksum threads seal
        the next request's pages (CRC32C, record headers) while one moves. Then one
        ``fdatasync`` per touched segment and one index commit. A failed request fails the
        pages it carried (``write_failures``); pages beyond what the capacity can hold even
        after eviction are False (``rejected_writes``)."""
        self._check_open()
        names = [_key_bytes(k) for k in keys]
        ptrs = self._buffer_pointers(buffers, len(names))
        if not names:
            return []
        try:
            reservation = self._index.reserve(
                len(names),
                length=self.page_bytes,
                slot_stride=self.slot_stride,
                slots_per_segment=self.slots_per_segment,
                capacity_bytes=self.capacity_bytes,
                high_watermark=self.high_watermark,
                low_watermark=self.low_watermark,
                create_segment=self._medium.create,
            )
        except (sqlite3.Error, OSError) as exc:
            logger.warning("remote put of %d pages could not reserve slots: %r", len(names), exc)
            self._count(write_failures=len(names))
            return [False] * len(names)
        slots = reservation.slots
        self._count(evictions=reservation.evicted, rejected_writes=len(names) - len(slots))
        if not slots:
            return [False] * len(names)
        tokens = [random.getrandbits(63) for _ in slots]
        chunks = self._chunks(len(slots))
        # The first request's seal has nothing to overlap with: it runs now, split across the
        # threads; the others queue behind it and overlap the moves.
        seals = [
            self._job(
                self._seal,
                (names[c.start : c.stop], tokens[c.start : c.stop], ptrs[c.start : c.stop]),
                pipelined=c.start > 0,
            )
            for c in chunks
        ]
        crcs: list[int] = []
        moved: list[int] = []
        for chunk, seal in zip(chunks, seals):
            chunk_crcs, headers = seal.result()
            crcs.extend(chunk_crcs)
            try:
                local, remote, staging = self._medium.write_descriptors(
                    slots[chunk.start : chunk.stop], headers, ptrs[chunk.start : chunk.stop],
                    self.page_bytes,
                )
                self._move("WRITE", local, remote)
                del staging  # OBJ records staged contiguously must outlive the transfer
                self._medium.start_writeback(remote)
                moved.extend(chunk)
            except (TransferFailed, OSError, KeyError, sqlite3.Error) as exc:
                logger.warning("remote put of %d pages failed: %s", len(chunk), exc)
        published = [False] * len(names)
        try:
            if moved:
                self._medium.make_durable({slots[i].seg for i in moved})
                if self.faults.before_publish is not None:
                    self.faults.before_publish([names[i] for i in moved])
                outcome = self._index.publish(
                    self.namespace,
                    [(names[i], slots[i], self.page_bytes, crcs[i], tokens[i]) for i in moved],
                )
                for i, ok in zip(moved, outcome):
                    published[i] = ok
        except (OSError, sqlite3.Error) as exc:
            logger.warning("remote put of %d pages failed to sync or publish: %r", len(moved), exc)
        self._release_quietly([slots[i] for i in range(len(slots)) if not published[i]])
        written = sum(published)
        self._count(
            write_failures=len(slots) - written, bytes_written=written * self.page_bytes
        )
        return published

    def get(self, keys: Sequence[Key], buffers: Sequence[Buffer]) -> list[bool]:
        """Fill buffers with pages; True where the page was found and verified.

        The batch moves in NIXL requests of up to ``pipeline_bytes``; the checksum threads check
        a request's pages (CRC32C, record headers) while the next one moves. A page that is
        absent, of another size, fails its check, or was carried by a failed request is a miss;
        its buffer content is then unspecified."""
        self._check_open()
        names = [_key_bytes(k) for k in keys]
        ptrs = self._buffer_pointers(buffers, len(names))
        if not names:
            return []
        locations = self._index.lookup(self.namespace, names)
        wanted = [
            i for i, loc in enumerate(locations)
            if loc is not None and loc.length == self.page_bytes
        ]
        headers = np.zeros((len(wanted), HEADER_BYTES), dtype=np.uint8)
        chunks = self._chunks(len(wanted))
        checks: list[tuple[list[int], Future]] = []
        for chunk in chunks:
            pages = [wanted[j] for j in chunk]
            try:
                local, remote = self._medium.read_descriptors(
                    [SlotRef(locations[i].seg, locations[i].slot) for i in pages],
                    headers[chunk.start : chunk.stop],
                    [ptrs[i] for i in pages],
                    self.page_bytes,
                )
                self._move("READ", local, remote)
            except (TransferFailed, OSError, KeyError, sqlite3.Error) as exc:
                logger.warning("remote get of %d pages failed: %s", len(pages), exc)
                self._count(read_failures=len(pages))
                continue
            args = (
                [names[i] for i in pages], [locations[i] for i in pages],
                headers[chunk.start : chunk.stop], [ptrs[i] for i in pages],
            )
            last = chunk.stop == len(wanted)  # nothing left to overlap: check it now, split
            checks.append((pages, self._job(self._check, args, pipelined=not last)))
        found = [False] * len(names)
        for pages, check in checks:
            for i, ok in zip(pages, check.result()):
                found[i] = ok
        self._classify_bad_reads(
            [(names[i], locations[i]) for pages, _ in checks for i in pages if not found[i]]
        )
        hits = [names[i] for i in range(len(names)) if found[i]]
        if hits and self._index.touch(self.namespace, hits):
            self._checksum_pool.submit(self._flush_touches)
        self._count(
            hits=len(hits),
            misses=len(names) - len(hits),
            bytes_read=len(hits) * self.page_bytes,
        )
        return found

    def delete(self, keys: Sequence[Key]) -> list[bool]:
        """Remove pages of this namespace; True where one existed."""
        self._check_open()
        return self._index.delete(self.namespace, [_key_bytes(k) for k in keys])

    def clear(self) -> int:
        """Remove every page of this namespace (never another's); returns how many."""
        self._check_open()
        return self._index.clear(self.namespace)

    # ----------------------------------------------------------------- host memory
    def register_host_memory(self, buffer: Buffer) -> None:
        """Register a long-lived host region (e.g. a host page pool) with NIXL once, so batches
        of buffers inside it skip the per-call registration."""
        self._check_open()
        ptr, nbytes = self._pointer(buffer)
        registration = self._engine.register([(ptr, nbytes, 0, "")], "DRAM")
        with self._host_lock:
            self._host_memory.append((ptr, ptr + nbytes, registration))

    def unregister_host_memory(self, buffer: Buffer) -> None:
        """Undo ``register_host_memory`` for the same buffer."""
        ptr, nbytes = self._pointer(buffer)
        with self._host_lock:
            for entry in self._host_memory:
                if entry[:2] == (ptr, ptr + nbytes):
                    self._host_memory.remove(entry)
                    break
            else:
                raise ValueError(
                    f"host memory [{ptr:#x}, +{nbytes}) was not registered; registered: "
                    f"{[(hex(s), e - s) for s, e, _ in self._host_memory]}"
                )
        self._engine.deregister(entry[2])

    # ----------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Write buffered LRU hits, release files and NIXL registrations."""
        if self._closed:
            return
        self._closed = True
        self._checksum_pool.shutdown()
        self._index.close()
        self._medium.close()
        with self._host_lock:
            for _, _, registration in self._host_memory:
                self._engine.deregister(registration)
            self._host_memory.clear()
        self._engine.close()

    def __enter__(self) -> "RemoteStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------------- internals
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"RemoteStore at {self.directory!r} is closed")

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                self._counters[name] += delta

    def _pointer(self, buffer: Buffer) -> tuple[int, int]:
        if isinstance(buffer, torch.Tensor):
            if buffer.device.type != "cpu":
                raise ValueError(f"buffer on {buffer.device}; expected a CPU tensor")
            if not buffer.is_contiguous():
                raise ValueError(f"buffer of strides {buffer.stride()}; expected contiguous")
            return buffer.data_ptr(), buffer.numel() * buffer.element_size()
        if isinstance(buffer, tuple) and len(buffer) == 2:
            ptr, nbytes = int(buffer[0]), int(buffer[1])
            if ptr == 0:
                raise ValueError(f"buffer pointer {ptr:#x}; expected host memory")
            return ptr, nbytes
        raise TypeError(
            f"buffer of type {type(buffer).__name__}; expected a CPU torch.Tensor or (ptr, nbytes)"
        )

    def _buffer_pointers(self, buffers: Sequence[Buffer], count: int) -> list[int]:
        if len(buffers) != count:
            raise ValueError(f"{len(buffers)} buffers for {count} keys; expected one per key")
        ptrs = []
        for buffer in buffers:
            ptr, nbytes = self._pointer(buffer)
            if nbytes != self.page_bytes:
                raise ValueError(f"buffer of {nbytes} bytes; expected page_bytes={self.page_bytes}")
            ptrs.append(ptr)
        return ptrs

    def _chunks(self, count: int) -> list[range]:
        """Split ``count`` pages into runs of up to ``pipeline_bytes``, one NIXL request each."""
        per_request = max(1, self.pipeline_bytes // self.page_bytes)
        return [range(s, min(s + per_request, count)) for s in range(0, count, per_request)]

    def _job(self, fn: Callable, args: tuple, pipelined: bool) -> Future:
        """Run ``fn(*args)`` on the checksum threads when another request of the batch can move
        meanwhile, else now (where it splits its CRC32C work across the threads)."""
        if pipelined:
            return self._checksum_pool.submit(fn, *args)
        job: Future = Future()
        job.set_result(fn(*args))
        return job

    def _checksums(self, ptrs: Sequence[int]) -> list[int]:
        """CRC32C of pages; on a caller thread, large work is split across the checksum threads
        (crc32c releases the GIL on large buffers). On a checksum thread it runs there: that is
        the pipeline."""
        views = [_view(p, self.page_bytes) for p in ptrs]
        if (
            threading.current_thread().name.startswith(_CHECKSUM_THREAD_PREFIX)
            or len(views) * self.page_bytes < _PARALLEL_CHECKSUM_BYTES
            or self._checksum_threads == 1
        ):
            return _crc32_all(views)
        step = -(-len(views) // self._checksum_threads)
        parts = [
            self._checksum_pool.submit(_crc32_all, views[i : i + step])
            for i in range(0, len(views), step)
        ]
        return [crc for part in parts for crc in part.result()]

    def _seal(
        self, names: Sequence[bytes], tokens: Sequence[int], ptrs: Sequence[int]
    ) -> tuple[list[int], np.ndarray]:
        """CRC32C and record headers of pages about to be written."""
        crcs = self._checksums(ptrs)
        packed = bytearray(b"".join(map(self._header, names, tokens, crcs)))
        return crcs, np.frombuffer(packed, dtype=np.uint8).reshape(len(names), HEADER_BYTES)

    def _check(
        self,
        names: Sequence[bytes],
        locations: Sequence[PageLocation],
        headers: np.ndarray,
        ptrs: Sequence[int],
    ) -> list[bool]:
        """Whether each page just read has the record header and CRC32C the index promises."""
        crcs = self._checksums(ptrs)
        got = headers.tobytes()
        return [
            crc == loc.crc
            and got[j * HEADER_BYTES : (j + 1) * HEADER_BYTES]
            == self._header(name, loc.token, loc.crc)
            for j, (name, loc, crc) in enumerate(zip(names, locations, crcs))
        ]

    def _header(self, key: bytes, token: int, crc: int) -> bytes:
        body = _HEADER_BODY.pack(
            MAGIC, FORMAT_VERSION, HEADER_BYTES, self._ns_fingerprint, _digest(key),
            self.page_bytes, token, crc,
        )
        return body + _HEADER_CRC.pack(crc32c.crc32c(body))

    def _classify_bad_reads(self, bad: list[tuple[bytes, PageLocation]]) -> None:
        """A bad record the index still names is corrupt (unpublish it); one whose key moved
        on meanwhile was raced by a writer."""
        for key, location in bad:
            if self._index.drop_if_current(self.namespace, key, location.token):
                logger.warning(
                    "remote page %r in segment %d slot %d failed its header/CRC32C check; dropped",
                    key, location.seg, location.slot,
                )
                self._count(corrupt_reads=1)
            else:
                self._count(raced_reads=1)

    def _move(self, op: str, local: np.ndarray, remote: np.ndarray) -> None:
        """One NIXL request; registers the local ranges not covered by host registrations for
        its duration. Descriptors go in file order so the backend sees sequential I/O."""
        order = np.lexsort((remote[:, 0], remote[:, 2]))
        local, remote = local[order], remote[order]
        registration = self._register_local(local)
        try:
            self._engine.transfer(op, local, remote, self._medium.mem_type, self.timeout_s)
        finally:
            if registration is not None:
                self._engine.deregister(registration)

    def _register_local(self, local: np.ndarray):
        starts = local[:, 0]
        ends = starts + local[:, 1]
        order = np.argsort(starts, kind="stable")
        merged: list[list[int]] = []
        for start, end in zip(starts[order].tolist(), ends[order].tolist()):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        with self._host_lock:
            covered = [(s, e) for s, e, _ in self._host_memory]
        rows = [
            (start, end - start, 0, "")
            for start, end in merged
            if not any(s <= start and end <= e for s, e in covered)
        ]
        return self._engine.register(rows, "DRAM") if rows else None

    def _flush_touches(self) -> None:
        """Write buffered LRU hits off the reading thread; a failure only delays them."""
        try:
            self._index.flush_touches()
        except sqlite3.Error as exc:
            logger.warning("could not record LRU hits yet: %r", exc)

    def _release_quietly(self, slots: Sequence[SlotRef]) -> None:
        if not slots:
            return
        try:
            self._index.release(slots)
        except sqlite3.Error as exc:
            logger.error("could not release %d reserved slots (reclaimed when this process "
                         "exits): %r", len(slots), exc)
