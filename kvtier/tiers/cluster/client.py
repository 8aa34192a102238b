"""The Mooncake Store client: one connection to a cluster, made in the background.

Owns loading ``mooncake.store``, the connection (``setup`` against the master), the host memory
registered with it, and the translation of Mooncake's return codes. A master whose port
answers is joined in the constructor (``setup`` takes tens of ms); otherwise the connection is
made on a thread of its own, retried with back-off: Mooncake's ``setup`` waits about 90 s for a
master that is down, and a pool must open at once. Until it is
connected every call raises ``ClusterUnavailable``. Once connected, Mooncake's client reconnects
by itself after the master restarts (its heartbeat; about a second here).

It must never interpret object contents (store.py does), nor retry a failed call: the cluster
store's breaker decides when to try again.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
from typing import Sequence

from kvtier.tiers.cluster.settings import ClusterSettings

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 (CPU hosts; the CUDA hosts' wheel is "
    "mooncake-transfer-engine), and the RDMA verbs library its binaries link (Debian: apt-get install libibverbs1)"
)
# Mooncake's error codes (mooncake-store/include/types.h) that say the cluster, not one object,
# failed: a call that returns one of them for any key failed as a whole.
RPC_FAILED = -900
OBJECT_NOT_FOUND = -704
BUFFER_TOO_SMALL = -600  # the object is larger than the buffers given
_WHOLE_CALL_FAILURES = frozenset({-900, -901, -1000, -1010, -1011, -1012})
_RETRY_MAX_S = 10.0


class ClusterUnavailable(RuntimeError):
    """The cluster cannot be asked now (not connected yet, or the master does not answer)."""


def load_store_class():
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise ClusterUnavailable(f"the cluster tier needs Mooncake Store, which does not import ({exc}); {INSTALL_HINT}") from exc
    return MooncakeDistributedStore


class MooncakeClient:
    def __init__(self, settings: ClusterSettings) -> None:
        self.settings = settings
        self._cls = load_store_class()
        self._store = None
        self._lock = threading.Lock()  # guards _store, _buffers and the connection's state
        self._buffers: dict[int, int] = {}  # address -> bytes, registered on every connection
        self._closed = threading.Event()
        self.connects = 0
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._connect_loop, name="kvtier-cluster-connect", daemon=True)
        if not self._attempt():  # a master that is up is joined at once; one that is not, later
            self._thread.start()

    # --- connection --------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self._store is not None

    def wait_connected(self, timeout_s: float) -> bool:
        """Wait until connected (tests, tools); False after `timeout_s`."""
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        return self.connected

    def _master_answers(self) -> bool:
        host, port = self.settings.master_host_port()
        try:
            with socket.create_connection((host, port), timeout=self.settings.connect_timeout_s):
                return True
        except OSError as exc:
            self.last_error = f"master {host}:{port} does not answer: {exc}"
            return False

    def _attempt(self) -> bool:
        """One connection attempt: setup only once the master's port answers."""
        if not self._master_answers():
            return False
        store = self._cls()
        s = self.settings
        rc = store.setup(s.hostname(), s.metadata_server, s.segment_bytes, s.local_buffer_bytes,
                         s.protocol, s.device_name, s.master_address())
        if rc != 0:
            self.last_error = f"mooncake setup against {s.master_address()} returned {rc}"
            return False
        with self._lock:
            if self._closed.is_set():
                store.close()
                return True
            for ptr, nbytes in self._buffers.items():
                self._register(store, ptr, nbytes)
            self._store = store
            self.connects += 1
        log.info("cluster tier connected to mooncake_master %s", s.master_address())
        return True

    def _connect_loop(self) -> None:
        wait = 0.05
        log.warning("cluster tier not connected yet (%s); retrying in the background", self.last_error)
        while not self._closed.wait(wait) and not self._attempt():
            wait = min(_RETRY_MAX_S, wait * 2)

    def _live(self):
        store = self._store
        if store is None:
            raise ClusterUnavailable(f"not connected to mooncake_master {self.settings.master}: {self.last_error}")
        return store

    # --- host memory -------------------------------------------------------------------------
    @staticmethod
    def _register(store, ptr: int, nbytes: int) -> None:
        rc = store.register_buffer(ptr, nbytes)
        if rc != 0:
            raise ClusterUnavailable(f"mooncake register_buffer of {nbytes} bytes at {ptr:#x} returned {rc}")

    def register(self, ptr: int, nbytes: int) -> None:
        """Register host memory for zero-copy transfers, now and on the connection to come."""
        with self._lock:
            self._buffers[ptr] = nbytes
            if self._store is not None:
                self._register(self._store, ptr, nbytes)

    def unregister(self, ptr: int) -> None:
        with self._lock:
            if self._buffers.pop(ptr, None) is not None and self._store is not None:
                self._store.unregister_buffer(ptr)

    # --- data path: one Mooncake call each ----------------------------------------------------
    @staticmethod
    def _check(codes: Sequence[int], what: str) -> list[int]:
        failed = next((c for c in codes if c in _WHOLE_CALL_FAILURES), None)
        if failed is not None:
            raise ClusterUnavailable(f"mooncake {what} failed as a whole (code {failed})")
        return list(codes)

    def put(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        """0 per object written (or already there: Mooncake objects are immutable), < 0 else."""
        return self._check(self._live().batch_put_from_multi_buffers(keys, ptrs, sizes), "batch_put_from_multi_buffers")

    def get(self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        """Bytes read per object, < 0 for a miss."""
        return self._check(self._live().batch_get_into_multi_buffers(keys, ptrs, sizes), "batch_get_into_multi_buffers")

    def put_flat(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        """`put` with one buffer an object."""
        return self._check(self._live().batch_put_from(keys, ptrs, sizes), "batch_put_from")

    def get_flat(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        """`get` with one buffer an object."""
        return self._check(self._live().batch_get_into(keys, ptrs, sizes), "batch_get_into")

    def exists(self, keys: list[str]) -> list[int]:
        """1 per object present, 0 absent."""
        codes = self._live().batch_is_exist(keys)
        if any(c < 0 for c in codes):
            raise ClusterUnavailable(f"mooncake batch_is_exist failed (codes {sorted(set(c for c in codes if c < 0))})")
        return list(codes)

    def remove(self, keys: list[str]) -> list[int]:
        """Remove objects now, leases notwithstanding (a record found bad must go at once)."""
        return list(self._live().batch_remove(keys, True))

    def remove_prefix(self, prefix: str) -> int:
        """Remove every object whose key starts with `prefix`; how many (< 0: Mooncake's error)."""
        return int(self._live().remove_by_regex("^" + re.escape(prefix), True))

    def close(self) -> None:
        self._closed.set()
        # A setup in progress against a master that went away can take Mooncake's own 90 s: the
        # thread is left to finish it and sees `_closed` then.
        if self._thread.is_alive():
            self._thread.join(self.settings.connect_timeout_s)
        with self._lock:
            store, self._store = self._store, None
            if store is not None:
                for ptr in self._buffers:
                    store.unregister_buffer(ptr)
                store.close()
            self._buffers.clear()
