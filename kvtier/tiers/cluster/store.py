"""The cluster tier: pages in Mooncake Store objects, shared by every host of a fleet.

Owns object naming, the records inside objects, the cluster's circuit breaker and its counters.
``ClusterStore`` answers the remote-store calls the pool's remote link makes (``put_ids``,
``get_ids``, ``contains_ids``), so it serves as a pool's remote tier alone or behind a local
store (chain.py).

Objects: the key is ``<object_prefix>/<namespace>/<key id hex>``: the namespace (model, page
format fingerprint, rank) is in the name, so a pool never even asks for another format's page.
The object is a 64-byte kvtier record header (records.py: key id, namespace fingerprint or
MAC, length, write token, payload CRC32C) followed by the page. Two ways to move it
(``ClusterSettings.staging_bytes``): staged (the default) assembles each object in a registered
staging area and moves it as one buffer, a page read being verified there before it is copied
into the caller's memory; zero-copy (0) hands Mooncake the header (from a small registered
array) and the page's pieces as slices of one object (multi-buffer calls). On TCP a slice costs
Mooncake more than copying it: 512 pages of 64 KiB (K and V pieces) cost 170 / 141 µs of CPU a
page to put / get as [header, K, V] slices, 109-120 / 73-87 as one contiguous buffer, and a
64 KiB copy costs a few µs (2-core VM, 2026-12-03). On RDMA the zero-copy calls are the ones to
measure first. A read that finds an
object of the wrong size, a header of another key, namespace or format version, a payload
whose CRC32C or MAC does not match is a miss, never data; the object is removed at once, so a
good write can take its key again (Mooncake objects are immutable: a put of a key that exists
leaves the old object).

Failures: a whole call that fails (master down, restarting, unreachable; not connected yet)
opens the breaker (kvtier.pool.breaker): while it is open, writes are skipped and reads and
presence answer "absent" without a round trip, each counted; the first failure of an outage
is logged, and so is the recovery. No call raises into the pool for the cluster's sake.

It must never return a page it has not verified, nor block a caller on the connection.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from typing import Sequence

import numpy as np

from kvtier.pool.breaker import BreakerState, CircuitBreaker
from kvtier.tiers.cluster.client import BUFFER_TOO_SMALL, OBJECT_NOT_FOUND, ClusterUnavailable, MooncakeClient
from kvtier.tiers.cluster.settings import ClusterSettings
from kvtier.tiers.remote.buffers import Buffer, PageBuffers, pointer, view
from kvtier.tiers.remote.records import (
    FORMAT_VERSION,
    HEADER_BYTES,
    RecordCodec,
    namespace_fingerprint,
    new_tokens,
    parse_header,
    require_crc32c,
)

log = logging.getLogger(__name__)

CHUNK_PAGES = 1024  # pages a Mooncake call carries at most (the registered header arrays' rows)
COUNTERS = (
    "hits", "misses", "corrupt_reads", "read_failures", "write_failures", "skipped_writes",
    "skipped_reads", "pages_written", "bytes_written", "bytes_read", "exists_calls", "breaker_opens",
)


class _Area:
    """Registered host memory for one direction's calls, used by one call at a time: rows of
    `stride` bytes (a record header each, or a whole object when staged)."""

    def __init__(self, client: MooncakeClient, rows: int, stride: int) -> None:
        self.array = np.zeros(rows * stride, dtype=np.uint8)
        self.view = memoryview(self.array)
        self.base = self.array.ctypes.data
        self.stride = stride
        self.lock = threading.Lock()
        client.register(self.base, self.array.nbytes)

    def row(self, row: int) -> int:
        return self.base + row * self.stride


class ClusterStore:
    """Pages of one namespace in a Mooncake Store cluster (see the module docstring)."""

    def __init__(self, settings: ClusterSettings, *, namespace: str, page_bytes: int,
                 backoff_s: float = 0.1, backoff_max_s: float = 30.0) -> None:
        require_crc32c()
        if isinstance(page_bytes, bool) or not isinstance(page_bytes, int) or page_bytes <= 0:
            raise ValueError(f"page_bytes={page_bytes!r}; expected an int > 0")
        self.settings = settings
        self.namespace = namespace
        self.page_bytes = page_bytes
        self.object_bytes = HEADER_BYTES + page_bytes
        self._codec = RecordCodec(namespace_fingerprint(namespace), settings.mac_key)
        self._prefix = f"{settings.object_prefix}/{namespace}/"
        self.client = MooncakeClient(settings)
        self.staged = settings.staging_bytes > 0
        if self.staged:
            self.chunk_pages = max(1, min(CHUNK_PAGES, settings.staging_bytes // self.object_bytes))
            stride = self.object_bytes
        else:
            self.chunk_pages, stride = CHUNK_PAGES, HEADER_BYTES
        self._put_area = _Area(self.client, self.chunk_pages, stride)
        self._get_area = _Area(self.client, self.chunk_pages, stride)
        self._breaker = CircuitBreaker(backoff_s, backoff_max_s)
        self._breaker_lock = threading.Lock()
        self._outage_logged = False
        # Bumped from the pool's reader and writer threads (and a caller's): under one lock.
        self._stats_lock = threading.Lock()
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.seconds = {"get": 0.0, "put": 0.0, "exists": 0.0}

    # --- naming ---------------------------------------------------------------------------------
    def object_key(self, key_id: bytes) -> str:
        return self._prefix + key_id.hex()

    # --- breaker ----------------------------------------------------------------------------------
    def _allow(self) -> bool:
        if self._breaker.state is BreakerState.CLOSED:  # the common case needs no lock
            return True
        with self._breaker_lock:
            return self._breaker.allow()

    def _outcome(self, error: BaseException | None) -> None:
        if error is None and self._breaker.state is BreakerState.CLOSED:
            return  # healthy and still so: nothing to record
        with self._breaker_lock:
            was_healthy = self._breaker.healthy
            self._breaker.record(error is None, None if error is None else str(error))
            if error is not None and was_healthy:
                self._add(self.counters, "breaker_opens", 1)
                if not self._outage_logged:
                    self._outage_logged = True
                    log.warning("cluster tier unavailable (%s); pages stay in the local tiers until it answers", error)
            elif error is None and not was_healthy:
                self._outage_logged = False
                log.warning("cluster tier answers again")

    @property
    def breaker_state(self) -> str:
        return self._breaker.state.name.lower()

    # --- the remote-store calls ---------------------------------------------------------------------
    def contains_ids(self, ids: Sequence[bytes], fresh: bool = False) -> list[bool]:
        """Which ids the cluster holds now: one Mooncake call, none while the breaker is open
        (every answer is fresh: nothing is remembered, so ``fresh`` changes nothing)."""
        if not ids or not self._allow():
            return [False] * len(ids)
        start = time.perf_counter()
        try:
            codes = self.client.exists([self.object_key(k) for k in ids])
        except ClusterUnavailable as exc:
            self._outcome(exc)
            return [False] * len(ids)
        self._outcome(None)
        self._add(self.counters, "exists_calls", 1)
        self._add(self.seconds, "exists", time.perf_counter() - start)
        return [c == 1 for c in codes]

    def put_ids(self, ids: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        """Write pages as records; False for a page not written (counted), never an exception."""
        pages = self._page_pieces(buffers, len(ids))
        if not ids:
            return []
        if not self._allow():
            self._add(self.counters, "skipped_writes", len(ids))
            return [False] * len(ids)
        start = time.perf_counter()
        out: list[bool] = []
        try:
            for lo in range(0, len(ids), self.chunk_pages):
                out += self._put_chunk(ids, pages, lo, min(len(ids), lo + self.chunk_pages))
        except ClusterUnavailable as exc:
            self._outcome(exc)
            self._add(self.counters, "write_failures", len(ids) - len(out))
            return out + [False] * (len(ids) - len(out))
        self._outcome(None)
        self._add(self.seconds, "put", time.perf_counter() - start)
        return out

    def _put_chunk(self, ids, pages: list, lo: int, hi: int) -> list[bool]:
        area, keys = self._put_area, [self.object_key(k) for k in ids[lo:hi]]
        with area.lock:
            if self.staged:  # header and page bytes side by side: one buffer an object
                for row, (page, token) in enumerate(zip(range(lo, hi), new_tokens(hi - lo))):
                    at = row * area.stride
                    offset = area.base + at + HEADER_BYTES
                    for ptr, nbytes in pages[page]:
                        ctypes.memmove(offset, ptr, nbytes)
                        offset += nbytes
                    payload = area.view[at + HEADER_BYTES : at + area.stride]
                    _, header = self._codec.seal(ids[page], self.page_bytes, token, [payload])
                    area.view[at : at + HEADER_BYTES] = header
                codes = self.client.put_flat(keys, [area.row(r) for r in range(hi - lo)], [area.stride] * (hi - lo))
            else:  # zero-copy: the header and the page's pieces are slices of one object
                ptrs, sizes = [], []
                for row, (page, token) in enumerate(zip(range(lo, hi), new_tokens(hi - lo))):
                    _, header = self._codec.seal(ids[page], self.page_bytes, token, [view(p, n) for p, n in pages[page]])
                    area.view[row * HEADER_BYTES : (row + 1) * HEADER_BYTES] = header
                    pieces = pages[page]
                    ptrs.append([area.row(row), *(p for p, _ in pieces)])
                    sizes.append([HEADER_BYTES, *(n for _, n in pieces)])
                codes = self.client.put(keys, ptrs, sizes)
        ok = [c == 0 for c in codes]
        written = sum(ok)
        self._add(self.counters, "pages_written", written)
        self._add(self.counters, "bytes_written", written * self.object_bytes)
        self._add(self.counters, "write_failures", len(ok) - written)
        return ok

    def _page_pieces(self, buffers: Sequence[Buffer], count: int) -> list[list[tuple[int, int]]]:
        """Per page, its (address, bytes) pieces, checked as buffers.PageBuffers checks them;
        plain lists, cheaper than its arrays for the small batches a cluster call carries."""
        if isinstance(buffers, PageBuffers):
            buffers = buffers.buffers()
        if len(buffers) != count:
            raise ValueError(f"{len(buffers)} buffers for {count} keys; expected one per key")
        out = []
        for i, buffer in enumerate(buffers):
            pieces = ([pointer(piece, f"buffer {i} piece {j}") for j, piece in enumerate(buffer)]
                      if isinstance(buffer, list) else [pointer(buffer, f"buffer {i}")])
            if sum(n for _, n in pieces) != self.page_bytes:
                raise ValueError(f"buffer {i}: {len(pieces)} pieces of {sum(n for _, n in pieces)} bytes in all; "
                                 f"expected page_bytes={self.page_bytes}")
            out.append(pieces)
        return out

    def get_ids(self, ids: Sequence[bytes], buffers: Sequence[Buffer], prefix: bool = False) -> list[bool]:
        """Read pages into `buffers`; True only for a page whose record checks out. ``prefix``:
        pages after the first miss count as misses (the caller discards them)."""
        pages = self._page_pieces(buffers, len(ids))
        if not ids:
            return []
        if not self._allow():
            self._add(self.counters, "skipped_reads", len(ids))
            return [False] * len(ids)
        start = time.perf_counter()
        out: list[bool] = []
        try:
            for lo in range(0, len(ids), self.chunk_pages):
                out += self._get_chunk(ids, pages, lo, min(len(ids), lo + self.chunk_pages))
        except ClusterUnavailable as exc:
            self._outcome(exc)
            self._add(self.counters, "read_failures", len(ids) - len(out))
            return out + [False] * (len(ids) - len(out))
        self._outcome(None)
        self._add(self.seconds, "get", time.perf_counter() - start)
        if prefix and False in out:
            first = out.index(False)
            out[first:] = [False] * (len(out) - first)
        return out

    def _get_chunk(self, ids, pages: list, lo: int, hi: int) -> list[bool]:
        area, keys = self._get_area, [self.object_key(k) for k in ids[lo:hi]]
        with area.lock:
            if self.staged:
                codes = self.client.get_flat(keys, [area.row(r) for r in range(hi - lo)], [area.stride] * (hi - lo))
            else:
                ptrs, sizes = [], []
                for row, page in enumerate(range(lo, hi)):
                    pieces = pages[page]
                    ptrs.append([area.row(row), *(p for p, _ in pieces)])
                    sizes.append([HEADER_BYTES, *(n for _, n in pieces)])
                codes = self.client.get(keys, ptrs, sizes)
            ok, bad = [], []
            for row, (page, code) in enumerate(zip(range(lo, hi), codes)):
                at = row * area.stride
                raw = area.view[at : at + HEADER_BYTES].tobytes()
                if self.staged:
                    views = [area.view[at + HEADER_BYTES : at + area.stride]]
                    good = code == self.object_bytes and self._verify(ids[page], raw, views)
                    if good:  # verified in the staging area: only then copied out
                        offset = area.base + at + HEADER_BYTES
                        for ptr, nbytes in pages[page]:
                            ctypes.memmove(ptr, offset, nbytes)
                            offset += nbytes
                else:
                    good = code == self.object_bytes and self._verify(ids[page], raw, [view(p, n) for p, n in pages[page]])
                if not good and (code >= 0 or code == BUFFER_TOO_SMALL):  # an object, but not ours
                    bad.append(keys[row])
                elif not good and code != OBJECT_NOT_FOUND:
                    self._add(self.counters, "read_failures", 1)
                ok.append(good)
        hits = sum(ok)
        self._add(self.counters, "hits", hits)
        self._add(self.counters, "misses", sum(1 for c in codes if c == OBJECT_NOT_FOUND))
        self._add(self.counters, "corrupt_reads", len(bad))
        self._add(self.counters, "bytes_read", hits * self.object_bytes)
        if bad:
            log.warning("cluster tier: %d objects failed their record check (first %s); removed", len(bad), bad[0])
            self.client.remove(bad)
        return ok

    def _verify(self, key_id: bytes, raw: bytes, views) -> bool:
        header = parse_header(raw)
        if header is None or header.version != FORMAT_VERSION or header.flags != self._codec.flags:
            return False
        if header.key_id != key_id or header.length != self.page_bytes:
            return False
        return self._codec.verify(key_id, self.page_bytes, header.token, header.crc, raw, views)

    def delete_ids(self, ids: Sequence[bytes]) -> list[bool]:
        """Remove pages from the cluster (every host's view of them)."""
        codes = self.client.remove([self.object_key(k) for k in ids])
        return [c == 0 for c in codes]

    def clear(self) -> int:
        """Remove every object of this namespace from the cluster; how many went."""
        return max(0, self.client.remove_prefix(self._prefix))

    # --- memory, stats, closing ---------------------------------------------------------------------
    def register_host_memory(self, buffer) -> None:
        self.client.register(*pointer(buffer, "host memory"))

    def unregister_host_memory(self, buffer) -> None:
        self.client.unregister(pointer(buffer, "host memory")[0])

    def _add(self, table: dict, name: str, amount) -> None:
        with self._stats_lock:
            table[name] += amount

    def stats(self) -> dict:
        """The cluster's counters under "cluster" (beside a local store's own in a chain)."""
        with self._stats_lock:
            counters, seconds = dict(self.counters), dict(self.seconds)
        return {"cluster": {**counters, "get_seconds": seconds["get"], "put_seconds": seconds["put"],
                "exists_seconds": seconds["exists"], "breaker_state": self.breaker_state,
                "breaker_code": int(self._breaker.state),
                "connected": int(self.client.connected)}}

    def close(self) -> None:
        self.client.close()
