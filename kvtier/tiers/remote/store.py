"""Remote tier: a durable page store in a directory, shared by processes; bytes move through NIXL.

Owns ``RemoteStore``: the data path (put, get, contains, delete by key or by key id), its
counters, its threads, and the order of every step that makes a page durable, visible,
readable or gone (the steps of a put and a get are in ``store_steps``, which ``RemoteStore``
inherits). The pieces it drives live beside it: ``index`` (SQLite: which slot holds
which page), ``datapath`` (moving a batch's records: requests, checksum pipeline, registered
blocks, direct I/O routes), ``small_batches`` (reads and writes of up to four records with
system calls, beside NIXL), ``presence`` (published keys and their locations this process knows),
``segments`` (segment files, the OBJ medium, descriptors), ``records`` (header, CRC32C, MAC),
``nixl`` (the agent and its requests), ``paths`` (directory safety), ``faults``.

It must never: move page bytes other than through NIXL (or, for reads and writes of a few
records, ``small_batches``' system calls on the same segment files); return a page whose record header,
checksum or MAC does not match (a miss, counted, and the page leaves the index); make a page
visible before its record is durable; remove another namespace's pages except by capacity
eviction; hold the index lock while bytes move; let a bad key reach the worker threads.

Layout of a directory::

    index.sqlite3 (+ -wal, -shm)   slot index, shared by every process (WAL mode)
    segments/00000001.seg          segment file: superblock, header table, fixed slots
    segments/00000002.seg ...

Keys: the key methods (``contains``, ``exists``, ``get``, ``put``, ``delete``) turn keys into
ids with ``kvtier.index.keys.key_ids`` before anything else, so a bad key raises TypeError or
ValueError naming it and its position with nothing changed. The id methods (``contains_ids``,
``get_ids``, ``put_ids``, ``delete_ids``) take 16-byte ids as the pool keeps them, with no
hashing. ``"abc"`` and ``b"abc"`` are two keys and two pages.

Buffers: per key, a contiguous CPU tensor or ``(ptr, nbytes)`` tuple of ``page_bytes``, or a
list of ``(ptr, nbytes)`` pieces summing to ``page_bytes``; or, for the whole batch, one
``buffers.PageBuffers`` (``PageBuffers.from_arrays``: pieces as arrays, no Python work per
piece) (scatter/gather: the pieces are one
record, one checksum, one slot; NIXL pairs several local descriptors with consecutive ranges
of the record). A page is visible only once all its pieces are durable, since its pieces always
travel in one NIXL request.

Data path and measured choices (2 vCPU VM, virtio disk of about 1.5 GB/s write and 1.9 GB/s
read; ``benchmarks/remote_bandwidth.py``):
- A batch moves in NIXL requests of up to ``pipeline_bytes`` (default 8 MiB), never one per
  page; with direct I/O up to four requests are in flight at once (``datapath``: an
  ``O_DIRECT`` request keeps only its own reads queued at the device):
  the checksum threads seal request k+1 (CRC32C, headers) while request k moves, and check
  request k while k+1 moves. The crc32c package (CPU CRC instructions) runs at about 15 GB/s a
  core and releases the GIL, and so does NIXL while it moves bytes. One request per 64 MiB batch
  read 64 KiB pages cold at 0.88 GB/s, 8 MiB requests at 1.32 GB/s (4 MiB: the same; 16 MiB:
  1.17).
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

Write protocol: reserve slots (index transactions; evicts if over the high watermark), move the
records, ``fdatasync`` each touched segment, then publish (index transactions). A writer killed
before publishing leaves only reservations, which ``RemoteIndex.reclaim`` frees once its owner
is dead (pid + start time on this host; a lease for other hosts): the half-written slot is never
visible. Two writers of one key each write a fresh slot; the later publication wins and frees
the earlier page's slot. A put of up to four pages (``small_batches``) writes its records with
``pwritev`` through the page cache and syncs them with one ``fdatasync`` per file in the same
call (a small get then finds them in the page cache), publishes them in one short transaction
(``RemoteIndex._publish_small``), and takes its slots
from up to ``SPARE_SLOTS`` that an earlier small put reserved in its own reservation transaction
(at most 1/64 of the capacity; never evicting or adding a segment for them; released at close,
after ``SPARE_MAX_AGE_S``, or by ``reclaim`` once this process is dead): one index transaction
per put, its publication. ``stats()`` counts them as ``spare_slots``, not ``reserved_slots``.

Reads: a page whose read fails for any reason (the request failed or timed out, its segment
file is missing, deleted or short, its header, CRC32C or MAC does not match) leaves the index at
once, so ``contains`` stops promising it, and is counted: ``read_failures`` (the request or the
file), ``corrupt_reads`` (the record), or ``raced_reads`` (the key was rewritten or removed
while it was read; nothing is dropped then). On a miss the caller's buffer content is
unspecified. A freed slot is handed out again only after ``reuse_delay_s`` (default 2 s), far
longer than the gap between a reader's lookup and its transfer; a slower reader reads a record
whose token, key id or checksum no longer match, which is a miss, never wrong bytes. A get of
up to four pages whose locations this process remembers (``presence``: from its reads and
publications) reads no index row (``locations_from_memory``); a page not where it was
remembered sends the whole batch through the index again (``stale_locations``).

Capacity: ``capacity_bytes`` bounds the payload bytes published in the whole directory. By
default (None) it is half the file system's free space at open plus what the store already
holds (logged once at INFO); it is computed by each process that opens the store. The disk is
shared, so eviction is store-wide LRU and may evict other namespaces' pages. When a put would
pass ``high_watermark * capacity_bytes``, least recently used pages are evicted down to
``low_watermark * capacity_bytes``. Freed slots wait ``reuse_delay_s``, so files may briefly
hold more than the capacity. ``clear()`` removes only this namespace.

Failures: a request that raises, reports an error, or does not finish within ``timeout_s`` is
released (NIXL aborts it) and fails the pages it carried, nothing else: ``get`` returns misses
(and unpublishes them, as above); ``put`` returns False, counts ``write_failures`` and frees
the slots after the reuse delay (an aborted write may still land). No retry: the caller
decides. ``timeout_s`` is checked between polls; with Linux AIO on buffered files a poll does
the I/O itself, so a device that hangs inside one I/O holds that poll (``use_uring`` gives
hard timeouts). ``set_timeout`` changes it for requests already waiting too, and it also bounds
how long a call waits for the index's write lock and for an index read, which then is a miss (a
stuck disk can hold a SQLite read in the kernel; see RELIABILITY.md). ``close`` waits for calls in flight at
most ``timeout_s`` plus half a second (their bookkeeping after the request). ``faults`` (``FaultInjector``) is a seam in this code path: tests make the
next requests fail, time out, or pause before publication.

Security: files are created 0600 and directories 0700 (0660 / 0770 with ``shared_group=True``),
whatever the umask; symbolic links inside the store are refused; a directory owned by another
user is refused unless ``allow_foreign_owner=True``. CRC32C detects corruption, not forgery:
anyone who can write the files can write a matching checksum. With ``mac_key`` (16-64 bytes)
every record carries a keyed BLAKE2b-128 MAC, checked on every read; records written without
the key or with another key are misses. The MAC costs what BLAKE2b costs: about 0.6 GB/s a core
here against CRC32C's 20. Measured with ``benchmarks/remote_bandwidth.py --total-mib 128
--page-kib 64 1024 [--mac]`` back to back (2 vCPUs, load 7-10): 1 MiB pages wrote at 1.32
GB/s without and 0.64 with, read warm at 3.54 and 0.93, cold at 1.57 and 0.81; 64 KiB pages
wrote at 0.44 and 0.43, read warm at 1.82 and 0.75.

Backends: ``POSIX`` (pass ``backend_params`` such as ``{"use_uring": "true"}``); ``GDS`` and
``GDS_MT`` are tried with a 4 KiB write and read-back and fall back to POSIX with one log line if
the plugin cannot be created, register a file, or move host memory (the nixl-cu13 1.5.1 wheel
cannot load them without ``libcufile``); ``OBJ`` (S3 and compatibles) takes ``backend_params``
through to NIXL and keeps one object per slot under ``object_prefix`` (NIXL's OBJ backend cannot
write at an offset, so a record is staged contiguously before upload), with the index in the
local directory. OBJ is untested: the wheel's OBJ plugin needs ``libcuobjclient.so.1`` (CUDA).

Sharing: processes on one host share a directory (SQLite WAL needs shared memory, so not over a
network file system). Open a store in each process after any fork; a store object is
thread-safe.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import sqlite3
import threading
import time
import urllib.parse
import urllib.request
from typing import Iterator, Mapping, Optional, Sequence, Union

from kvtier.errors import SettingError
from kvtier.index import native
from kvtier.index.keys import KEY_ID_BYTES, key_ids
from kvtier.tiers.remote import labels, records
from kvtier.tiers.remote.buffers import Buffer, PageBuffers, pointer
from kvtier.tiers.remote.datapath import DataPath
from kvtier.tiers.remote.faults import FaultInjector
from kvtier.tiers.remote.presence import RECHECK_S as PRESENCE_RECHECK_S
from kvtier.tiers.remote.index import RemoteIndex
from kvtier.tiers.remote.index_slots import SlotRef
from kvtier.tiers.remote.owners import make_owner
from kvtier.tiers.remote.nixl import BACKENDS, NixlEngine, load_nixl_api
from kvtier.tiers.remote.paths import (
    Modes,
    lock_shared,
    open_store_directory,
    prepare_index_files,
)
from kvtier.tiers.remote.records import SLOT_ALIGN, RecordCodec
from kvtier.tiers.remote.segments import SegmentFiles, SlotObjects
from kvtier.tiers.remote.store_steps import SPARE_MAX_AGE_S, StoreSteps

logger = logging.getLogger(__name__)

DEFAULT_FREE_SPACE_SHARE = 0.5
CLOSE_GRACE_S = 0.5
_NAMESPACE = re.compile(r"[0-9a-fA-F]+")

Key = Union[str, bytes]
_COUNTERS = (
    "hits", "misses", "corrupt_reads", "raced_reads", "read_failures", "write_failures",
    "rejected_writes", "evictions", "bytes_written", "bytes_read", "locations_from_memory",
    "stale_locations",
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


def check_ids(ids: Sequence[bytes]) -> list[bytes]:
    """``ids`` as a list, each 16 bytes; TypeError / ValueError naming the first bad one."""
    if isinstance(ids, (bytes, str)):
        raise TypeError(f"ids must be a sequence of {KEY_ID_BYTES}-byte ids, got a single {type(ids).__name__}")
    ids = list(ids)
    if all(type(i) is bytes and len(i) == KEY_ID_BYTES for i in ids):
        return ids
    for position, i in enumerate(ids):
        if not isinstance(i, bytes):
            raise TypeError(
                f"id {position} is a {type(i).__name__} ({i!r:.60}); expected {KEY_ID_BYTES} bytes "
                "from kvtier.index.keys.key_ids"
            )
        if len(i) != KEY_ID_BYTES:
            raise ValueError(
                f"id {position} is {len(i)} bytes; expected {KEY_ID_BYTES} (kvtier.index.keys.key_ids)"
            )
    return ids


class RemoteStore(StoreSteps):
    """A durable page store in a directory, shared by processes; bytes move through NIXL.

    ``location`` is a directory path or ``file:///path``. ``namespace`` is a hex fingerprint of
    model, page format and rank; ``page_bytes`` the size of every page. Keys are non-empty str
    or bytes (``"k"`` and ``b"k"`` are two keys); ids are their 16-byte ``key_ids``. Buffers:
    see the module docstring. Thread-safe; ``close`` once the other calls are done.

    Tuning: ``capacity_bytes`` (None: half the free space, see the module docstring);
    ``timeout_s`` per NIXL request (``set_timeout`` changes it later); ``segment_bytes`` per
    segment file; ``reuse_delay_s`` before a freed slot is rewritten; ``reservation_lease_s``
    after which another host's unpublished reservation is reclaimed; ``checksum_threads``
    (default ``min(4, cpus)``); ``pipeline_bytes`` per NIXL request; ``direct_io``: segment I/O with ``O_DIRECT`` where the file system
    allows it (see ``segments``); ``backend_params`` passed to
    the NIXL backend; ``object_prefix`` names objects for ``backend="OBJ"``;
    ``presence_recheck_s``: ``contains`` answers keys it found published from memory while no
    process has removed pages, and reads the index's removal counter at least this often, so a
    page another process removed is reported present for at most this long (0: always ask the
    index; pages this process removes are never reported). ``create``: make missing parent
    directories of ``location`` too (without it only the store directory itself is created,
    so a mistyped mount point is refused). ``namespace_label``: what the namespace is, for people
    (the pool passes its model, rank and page format; see ``labels``): kept in the index, and
    the store logs once at open which other namespaces it holds pages of. Security:
    ``shared_group``, ``allow_foreign_owner``, ``mac_key`` (see the module docstring).
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
        shared_group: bool = False,
        allow_foreign_owner: bool = False,
        mac_key: Optional[bytes] = None,
        presence_recheck_s: float = PRESENCE_RECHECK_S,
        create: bool = False,
        namespace_label: Optional[Mapping[str, object]] = None,
        direct_io: bool = True,
    ):
        if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
            raise ValueError(f"namespace {namespace!r}; expected a non-empty hex string")
        if isinstance(page_bytes, bool) or not isinstance(page_bytes, int) or page_bytes <= 0:
            raise ValueError(f"page_bytes {page_bytes!r}; expected a positive int")
        if capacity_bytes is not None and capacity_bytes < _round_up(page_bytes, SLOT_ALIGN):
            raise SettingError(
                f"capacity_bytes {capacity_bytes!r} holds no page: expected None or at least one slot of "
                f"{_round_up(page_bytes, SLOT_ALIGN)} bytes ({page_bytes}-byte pages)"
            )
        if not 0.0 < low_watermark <= high_watermark <= 1.0:
            raise ValueError(
                f"watermarks low={low_watermark!r} high={high_watermark!r}; "
                "expected 0 < low <= high <= 1"
            )
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r}; expected one of {BACKENDS}")
        self._check_timeout(timeout_s)
        if checksum_threads is None:
            checksum_threads = min(4, os.cpu_count() or 1)
        if checksum_threads < 1:
            raise ValueError(f"checksum_threads {checksum_threads!r}; expected >= 1")
        if pipeline_bytes <= 0:
            raise ValueError(f"pipeline_bytes {pipeline_bytes!r}; expected > 0")
        if isinstance(presence_recheck_s, bool) or not isinstance(presence_recheck_s, (int, float)) or not (
                presence_recheck_s >= 0):
            raise ValueError(f"presence_recheck_s {presence_recheck_s!r}; expected a number >= 0")
        self.namespace = namespace
        self.page_bytes = page_bytes
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
        self.faults = FaultInjector()
        self._ns_fp = records.namespace_fingerprint(namespace)
        self._codec = RecordCodec(self._ns_fp, mac_key)
        records.require_crc32c()
        api = load_nixl_api()
        modes = Modes.for_store(shared_group)
        self._dir_fd = open_store_directory(self.directory, modes, allow_foreign_owner, create)
        self._index = self._engine = self._medium = None
        try:
            lock_shared(self._dir_fd, self.directory)
            index_path = prepare_index_files(self._dir_fd, self.directory, modes)
            self._engine = NixlEngine(
                api, backend, dict(backend_params or {}), self._dir_fd, modes, self.faults, timeout_s
            )
            self._index = RemoteIndex(
                index_path,
                owner=make_owner(f"{random.getrandbits(64):016x}"),
                reuse_delay_s=reuse_delay_s,
                reservation_lease_s=reservation_lease_s,
                busy_timeout_s=timeout_s,
                presence_recheck_s=presence_recheck_s,
            )
            self._index.reclaim()
            if self._engine.backend == "OBJ":
                self._medium = SlotObjects(self._engine, object_prefix)
            else:
                self._medium = SegmentFiles(
                    self._engine, self.directory, self._dir_fd, modes, self._index.segment,
                    direct_io=direct_io,
                )
            self._index.watch_unused_slots(self._medium.unused_slots_empty)
            self.capacity_bytes = (
                capacity_bytes if capacity_bytes is not None else self._default_capacity()
            )
            label = {} if namespace_label is None else labels.decode(labels.encode(namespace_label))
            if namespace_label is not None:
                self._index.set_label(self._ns_fp, labels.encode(namespace_label))
            self._log_other_namespaces(label)
        except BaseException:
            self._release_resources()
            raise
        self.pipeline_bytes = pipeline_bytes
        native.start()  # the key ids' C path: loaded if built before, else built in a thread
        self._path = DataPath(
            self._engine, self._medium, self._codec, page_bytes, self.slot_stride, pipeline_bytes,
            checksum_threads,
        )
        self._stats_lock = threading.Lock()
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._calls = threading.Condition()
        self._in_flight = 0
        self._closed = False
        self._spare_lock = threading.Lock()
        self._spares: list[SlotRef] = []
        self._spares_at = 0.0
        # Spares are reservations like any other: kept well inside the lease after which
        # another host may reclaim them.
        self._spare_age_s = min(SPARE_MAX_AGE_S, reservation_lease_s / 4)

    def _log_other_namespaces(self, label: dict) -> None:
        """Say once, at open, which other namespaces (formats, models, ranks) the store holds
        pages of: their pages never hit this one's keys, which is silent otherwise. A warning
        when this namespace has no pages here, else information."""
        rows = self._index.namespaces()
        others = [row for row in rows if row[0] != self._ns_fp]
        if not others:
            return
        own = next((row[1] for row in rows if row[0] == self._ns_fp), 0)
        listed = "; ".join(
            f"{labels.describe(labels.decode(text), ns)}: {pages} pages ({labels.size(used)})"
            for ns, pages, used, text in others
        )
        logger.log(
            logging.WARNING if own == 0 else logging.INFO,
            "remote store %s holds %d pages of this namespace (%s) and %d pages of %d other namespaces, "
            "which never hit here (another page format, model or rank): %s",
            self.directory, own, labels.describe(label, self._ns_fp), sum(row[1] for row in others),
            len(others), listed,
        )

    def _default_capacity(self) -> int:
        fs = os.statvfs(self.directory)
        free = fs.f_bavail * fs.f_frsize
        held = self._index.stats(self._ns_fp)["store_used_bytes"]
        capacity = max(self.slot_stride, int(DEFAULT_FREE_SPACE_SHARE * free) + held)
        logger.info(
            "remote store %s: capacity_bytes not given; using %.1f GiB (%d%% of the %.1f GiB "
            "free on its file system, plus the %.1f GiB it holds)",
            self.directory, capacity / 2**30, DEFAULT_FREE_SPACE_SHARE * 100, free / 2**30,
            held / 2**30,
        )
        return capacity

    @property
    def backend(self) -> str:
        """The NIXL backend in use (after any GDS to POSIX fallback)."""
        return self._engine.backend

    @staticmethod
    def _check_timeout(seconds: float) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise ValueError(f"timeout_s {seconds!r}; expected a number of seconds > 0")

    def set_timeout(self, seconds: float) -> None:
        """Bound every NIXL request (those already waiting too), every wait for the index's
        write lock (another thread's or process's) and every index read (then a miss) by
        ``seconds``; ``close`` waits at most this long (plus ``CLOSE_GRACE_S``) for calls in
        flight. A pool shortens it before closing; it may be called while ``close`` waits, and
        never waits itself (not even on a stuck disk)."""
        self._check_timeout(seconds)
        self.timeout_s = seconds
        self._engine.timeout_s = seconds
        with contextlib.suppress(sqlite3.ProgrammingError):  # the index closed meanwhile
            self._index.set_busy_timeout(seconds)

    # ----------------------------------------------------------------- queries
    def contains(self, keys: Sequence[Key]) -> list[bool]:
        """Whether each key has a published page in this namespace (index only, no I/O)."""
        return self.contains_ids(key_ids(keys))

    def contains_ids(self, ids: Sequence[bytes], fresh: bool = False) -> list[bool]:
        """``contains`` by 16-byte key ids; ``fresh`` asks the index itself, never what this
        process remembers (which may be up to ``presence_recheck_s`` behind another process's
        removal): for a writer that skips pages it finds present."""
        ids = check_ids(ids)
        with self._call():
            return self._index.present(self._ns_fp, ids, self.page_bytes, fresh)

    def exists(self, keys: Sequence[Key]) -> int:
        """Number of leading keys present, as SGLang's ``batch_exists``."""
        present = self.contains(keys)
        return present.index(False) if False in present else len(present)

    def stats(self) -> dict[str, int]:
        """Counters of this object, and page counts of this namespace and of the whole store
        (kept by the index's writes: a few rows read, whatever the store holds)."""
        with self._call():
            with self._stats_lock:
                counters = dict(self._counters)
            counters.update(self._index.stats(self._ns_fp))
            with self._spare_lock:
                counters["spare_slots"] = len(self._spares)
            counters["reserved_slots"] -= counters["spare_slots"]  # writes in progress
        counters["capacity_bytes"] = self.capacity_bytes
        counters["direct_io"] = int(self._path.direct_io)
        counters["contains_from_memory"] = self._index.presence.hits
        counters["small_batch_reads"] = self._path.small_batch_reads
        counters["small_batch_writes"] = self._path.small_batch_writes
        return counters

    # ----------------------------------------------------------------- data path
    def put(self, keys: Sequence[Key], buffers: Sequence[Buffer]) -> list[bool]:
        """``put_ids`` by keys."""
        return self.put_ids(key_ids(keys), buffers)

    def put_ids(self, ids: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        """Store pages; True where the page is durable and published.

        The batch moves in NIXL requests of up to ``pipeline_bytes``; the checksum threads seal
        the next request's pages (CRC32C, record headers) while one moves. Then one
        ``fdatasync`` per touched segment and the index commits. A failed request fails the
        pages it carried (``write_failures``); pages beyond what the capacity can hold even
        after eviction are False (``rejected_writes``)."""
        ids = check_ids(ids)
        pages = self._pages(buffers, len(ids))
        if not ids:
            return []
        with self._call():
            return self._put(ids, pages)

    def get(self, keys: Sequence[Key], buffers: Sequence[Buffer], prefix: bool = False) -> list[bool]:
        """``get_ids`` by keys."""
        return self.get_ids(key_ids(keys), buffers, prefix=prefix)

    def get_ids(self, ids: Sequence[bytes], buffers: Sequence[Buffer], prefix: bool = False) -> list[bool]:
        """Fill buffers with pages; True where the page was found and verified.

        The batch moves in NIXL requests of up to ``pipeline_bytes``; the checksum threads check
        a request's pages (CRC32C, record headers, MAC) while the next one moves. A page that is
        absent, of another size, unreadable, fails its check, or was carried by a failed
        request is a miss (and leaves the index unless a writer replaced it meanwhile); its
        buffer content is then unspecified. With ``prefix``, the pages after the first one the
        index does not hold are not read (misses): an engine that keeps only a leading run of
        hits (SGLang) would discard them."""
        ids = check_ids(ids)
        pages = self._pages(buffers, len(ids))
        if not ids:
            return []
        with self._call():
            return self._get(ids, pages, prefix)

    def delete(self, keys: Sequence[Key]) -> list[bool]:
        """``delete_ids`` by keys."""
        return self.delete_ids(key_ids(keys))

    def delete_ids(self, ids: Sequence[bytes]) -> list[bool]:
        """Remove pages of this namespace; True where one existed."""
        ids = check_ids(ids)
        with self._call():
            return self._index.delete(self._ns_fp, ids)

    def clear(self) -> int:
        """Remove every page of this namespace (never another's); returns how many."""
        with self._call():
            return self._index.clear(self._ns_fp)

    # ----------------------------------------------------------------- host memory
    def register_host_memory(self, buffer) -> None:
        """Register a long-lived host region (e.g. a host page pool) with NIXL once, so batches
        of buffers inside it skip the per-call registration."""
        ptr, nbytes = pointer(buffer)
        with self._call():
            self._path.host.add(ptr, nbytes)

    def unregister_host_memory(self, buffer) -> None:
        """Undo ``register_host_memory`` for the same buffer."""
        ptr, nbytes = pointer(buffer)
        self._path.host.remove(ptr, nbytes, deregister=not self._closed)

    # ----------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Wait for calls in flight (at most ``timeout_s``, which bounds their NIXL requests,
        plus ``CLOSE_GRACE_S`` for what a call does after its request), write buffered LRU hits,
        release files and NIXL registrations. New calls raise at once."""
        with self._calls:
            if self._closed:
                return
            self._closed = True
            deadline = time.monotonic() + self.timeout_s + CLOSE_GRACE_S
            while self._in_flight and time.monotonic() < deadline:
                self._calls.wait(deadline - time.monotonic())
            stuck = self._in_flight
        self._path.shutdown(wait=not stuck)
        if stuck:
            logger.error(
                "remote store %s closed with %d calls still in flight after timeout_s=%s; its "
                "files and NIXL registrations are left to the process's exit",
                self.directory, stuck, self.timeout_s,
            )
            return
        self._index.set_busy_timeout(max(1e-3, deadline - time.monotonic()))
        self._release_spares()
        self._path.close()
        self._release_resources()

    def _release_resources(self) -> None:
        try:
            if self._index is not None:
                try:
                    self._index.close()
                except sqlite3.Error as exc:
                    logger.warning("remote store %s: LRU hits not written at close: %r", self.directory, exc)
        finally:
            if self._medium is not None:
                self._medium.close()
            if self._engine is not None:
                self._engine.close()
            os.close(self._dir_fd)

    def __enter__(self) -> "RemoteStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------------- internals
    @contextlib.contextmanager
    def _call(self) -> Iterator[None]:
        """Context of one public call: refused once closing, counted while it runs."""
        with self._calls:
            if self._closed:
                raise RuntimeError(f"RemoteStore at {self.directory!r} is closed")
            self._in_flight += 1
        try:
            yield
        finally:
            with self._calls:
                self._in_flight -= 1
                if self._closed:  # only close waits for calls to end
                    self._calls.notify_all()

    def _pages(self, buffers: Union[Sequence[Buffer], PageBuffers], count: int) -> PageBuffers:
        if not isinstance(buffers, PageBuffers):
            return PageBuffers(buffers, count, self.page_bytes)
        if (buffers.count, buffers.page_bytes) != (count, self.page_bytes):
            raise ValueError(
                f"PageBuffers of {buffers.count} pages of {buffers.page_bytes} bytes for {count} ids; "
                f"expected {count} pages of page_bytes={self.page_bytes}"
            )
        return buffers

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                self._counters[name] += delta
