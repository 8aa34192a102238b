"""NIXL for the remote store: finding the API, one agent with one storage backend, requests.

Owns the NIXL agent of a store, its backend (with the GDS probe and fallback to POSIX),
memory registration, and running one request to completion, failure or timeout. It must never
decide what moves where (the store builds descriptors) nor look at bytes it moves, and it must
never return while a request it posted may still write into caller memory.

Logging: nixl-cu13 1.5.1 configures its Python logger ``nixl`` at import (INFO, to stdout)
and reads ``NIXL_LOG_LEVEL`` there; its agent and backend creation log at INFO. Unless the
user set ``NIXL_LOG_LEVEL``, the store sets that logger to WARNING after import, so opening
a store prints nothing; the variable is not set for the process (child processes keep
NIXL's own default).
"""

from __future__ import annotations

import errno
import importlib
import logging
import os
import random
import threading
import time
from types import ModuleType
from typing import Callable, Optional

import numpy as np

from kvtier.tiers.remote.errors import RemoteUnavailable, TransferFailed
from kvtier.tiers.remote.faults import FaultInjector
from kvtier.tiers.remote.paths import Modes, create_file

logger = logging.getLogger(__name__)

NIXL_MODULES = ("nixl_cu13._api", "nixl_cu12._api")
INSTALL_HINT = (
    "pip install --no-deps nixl-cu13==1.5.1 (CUDA 13, or a machine without CUDA), or "
    "pip install --no-deps nixl-cu12==1.5.1 (CUDA 12)"
)
BACKENDS = ("POSIX", "GDS", "GDS_MT", "OBJ")
_PROBE_BYTES = 4096
_POLL_WORK_S = 50e-6
_POLL_MAX_PAUSE_S = 5e-4
# Pacing of polls (see ``NixlEngine._wait``): the first sleep ends at this share of the predicted
# service time; a sleep is never longer than _PACE_MAX_SLEEP_S (a lowered timeout still applies
# soon); the predicted seconds per byte follow finished requests (EWMA of weight _PACE_WEIGHT
# toward faster waits, a quarter of it toward slower ones).
_PACE_EARLY = 0.9
_PACE_MAX_SLEEP_S = 0.02
_PACE_WEIGHT = 0.5


def load_nixl_api() -> ModuleType:
    """The NIXL Python API module: ``nixl_cu13._api``, else ``nixl_cu12._api``."""
    errors = []
    for name in NIXL_MODULES:
        try:
            api = importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        if "NIXL_LOG_LEVEL" not in os.environ:
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return api
    raise RemoteUnavailable(
        f"NIXL is not importable ({'; '.join(errors)}); install it with: {INSTALL_HINT}"
    )


class Posted:
    """A request started by ``NixlEngine.post``: its handle, what it carries, its first state."""

    __slots__ = ("handle", "op", "count", "fault", "start", "state", "error", "nbytes", "paced")

    def __init__(
        self, handle, op: str, count: int, fault: Optional[str], start: float, nbytes: int = 0,
        paced: bool = False,
    ):
        self.handle = handle
        self.op = op
        self.count = count
        self.fault = fault
        self.start = start
        self.state = "PROC"
        self.error: Optional[Exception] = None
        self.nbytes = nbytes  # local bytes it moves (for the pacing of polls)
        self.paced = paced


class NixlEngine:
    """One NIXL agent with one storage backend. Registers memory and runs requests.

    ``timeout_s`` bounds every request, including the GDS probe; it is read at every poll, so
    lowering it (``RemoteStore.set_timeout``) also shortens requests already waiting."""

    def __init__(
        self,
        api: ModuleType,
        backend: str,
        backend_params: dict,
        directory_fd: int,
        modes: Modes,
        faults: FaultInjector,
        timeout_s: float,
    ):
        self.faults = faults
        self.timeout_s = timeout_s
        config = api.nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            backends=[],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
        )
        name = f"kvtier-remote-{os.getpid()}-{random.getrandbits(32):08x}"
        self.agent = api.nixl_agent(name, config)
        self.backend = self._create_backend(backend, backend_params, directory_fd, modes)
        # Poll pacing (hints only: nothing depends on them but how long a wait sleeps between
        # polls): per op, the device's seconds per byte while it works through the requests in
        # flight; those requests (posted, not yet waited for: their bytes and post times); when
        # a wait last saw a request finish.
        self._pace: dict[str, float] = {}
        self._pace_lock = threading.Lock()
        self._inflight: dict[Posted, float] = {}
        self._inflight_bytes = 0
        self._last_done = 0.0

    def _create_backend(self, backend: str, params: dict, directory_fd: int, modes: Modes) -> str:
        if backend in ("GDS", "GDS_MT"):
            try:
                self.agent.create_backend(backend, params)
                self._probe_file_transfer(backend, directory_fd, modes)
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

    def _probe_file_transfer(self, backend: str, directory_fd: int, modes: Modes) -> None:
        """Register a scratch file and host buffer with ``backend`` and move 4 KiB both ways:
        GDS plugins that load may still be unable to register files (cuFile error 5027 on file
        systems without GPU-direct support) or to move host memory."""
        name = f".gds-probe-{os.getpid()}-{random.getrandbits(32):08x}"
        fd = create_file(directory_fd, name, name, modes)
        try:
            os.ftruncate(fd, _PROBE_BYTES)
            probe = np.full(_PROBE_BYTES, 0x5A, dtype=np.uint8)
            back = np.zeros(_PROBE_BYTES, dtype=np.uint8)
            rows = [(probe.ctypes.data, _PROBE_BYTES, 0, ""), (back.ctypes.data, _PROBE_BYTES, 0, "")]
            registrations = [
                self.agent.register_memory([(0, _PROBE_BYTES, fd, "")], "FILE", backends=[backend]),
                self.agent.register_memory(rows, "DRAM", backends=[backend]),
            ]
            try:
                for op, buffer in (("WRITE", probe), ("READ", back)):
                    handle = self.agent.initialize_xfer(
                        op,
                        self.agent.get_xfer_descs([(buffer.ctypes.data, _PROBE_BYTES, 0)], "DRAM"),
                        self.agent.get_xfer_descs([(0, _PROBE_BYTES, fd)], "FILE"),
                        self.agent.name,
                        backends=[backend],
                    )
                    posted = Posted(handle, op, 1, None, time.monotonic())
                    posted.state = self.agent.transfer(handle)
                    try:
                        self._wait(posted, forced_timeout=False)
                    finally:
                        self._release(handle)
                if not np.array_equal(probe, back):
                    raise TransferFailed(f"{backend} read back other bytes than it wrote")
            finally:
                for registration in registrations:
                    self.agent.deregister_memory(registration, backends=[backend])
        finally:
            os.close(fd)
            os.unlink(name, dir_fd=directory_fd)

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

    def transfer(self, op: str, local: np.ndarray, remote: np.ndarray, remote_mem: str) -> None:
        """Move bytes for one request of Nx3 (addr, len, dev) descriptor pairs."""
        self.wait(self.post(op, local, remote, remote_mem))

    def post(
        self, op: str, local: np.ndarray, remote: np.ndarray, remote_mem: str, paced: bool = False,
    ) -> "Posted":
        """Start one request; ``wait`` must follow, whatever happens meanwhile (the backend may
        write into ``local`` memory until then). ``paced``: the kernel moves its bytes without
        the polls' help (``O_DIRECT``), so its wait may sleep toward a predicted end (``_wait``)."""
        fault = self.faults.take(op)
        if fault == "error":
            raise TransferFailed(f"{op} of {len(local)} descriptors: injected error")
        if fault == "enospc":
            raise TransferFailed(
                f"{op} of {len(local)} descriptors: injected {os.strerror(errno.ENOSPC)}"
            )
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
        posted = Posted(
            handle, op, len(local), fault, time.monotonic(), int(local[:, 1].sum()) if len(local) else 0, paced,
        )
        with self._pace_lock:
            self._inflight[posted] = posted.start
            self._inflight_bytes += posted.nbytes
        try:
            posted.state = self.agent.transfer(handle)
        except Exception as exc:
            posted.error = exc
        return posted

    def _in_flight(self) -> tuple[float, int]:
        """(since when the device has been working through the requests now in flight: the
        oldest one's post or the last finish seen, whichever is later; their bytes)."""
        with self._pace_lock:
            oldest = min(self._inflight.values(), default=time.monotonic())
            return max(oldest, self._last_done), self._inflight_bytes

    def _learn(self, op: str, since: float, inflight: int, done: float, learn: bool) -> None:
        """A wait saw its request finish at ``done``; with ``learn`` (it took more than one
        poll, so ``done`` is close), fold ``inflight`` bytes moved from ``since`` to ``done``
        into ``op``'s pace."""
        with self._pace_lock:
            self._last_done = max(self._last_done, done)
            if not learn or inflight <= 0 or done <= since:
                return
            sample = (done - since) / inflight
            pace = self._pace.get(op)
            # quick to speed up, slow to slow down: the pace follows the faster waits, so a
            # slow one costs a few more polls rather than a sleep past the next fast one
            weight = _PACE_WEIGHT if pace is None or sample < pace else _PACE_WEIGHT / 4
            self._pace[op] = sample if pace is None else pace + weight * (sample - pace)

    def wait(self, posted: "Posted") -> None:
        """Wait for a posted request to finish (or fail, or time out), then release it."""
        try:
            if posted.error is not None:
                raise TransferFailed(
                    f"{posted.op} of {posted.count} descriptors: NIXL error {posted.error!r}"
                ) from posted.error
            self._wait(posted, forced_timeout=posted.fault == "timeout",
                       mid_request=self.faults.mid_request)
        finally:
            with self._pace_lock:
                if self._inflight.pop(posted, None) is not None:
                    self._inflight_bytes -= posted.nbytes
            self._release(posted.handle)
        if posted.fault == "error_after_io":
            raise TransferFailed(f"{posted.op} of {posted.count} descriptors: injected error after I/O")

    def _wait(
        self,
        posted: "Posted",
        forced_timeout: bool,
        mid_request: Optional[Callable[[str], None]] = None,
    ) -> None:
        """Poll until done. With Linux AIO on buffered files a poll submits the next I/Os and
        copies synchronously, so a poll that took time is followed at once by the next; quick
        polls (io_uring, POSIX AIO, O_DIRECT: the kernel or a thread does the work) back off to
        0.5 ms. A paced request (``post``) whose op has a pace sleeps after its first quick poll to
        just before its predicted end (``_PACE_EARLY`` of it, at most ``_PACE_MAX_SLEEP_S`` a
        sleep), then backs off from a hundredth of the predicted wait: a sleep and a poll cost
        CPU (30-40 µs on a VM), and a wait of milliseconds took 20-40 of them. The prediction:
        the device works through the bytes in flight (posted, not yet waited for) from the
        oldest one's post or the last finish a wait saw, whichever is later, at the op's pace,
        learned from the waits that needed more than one poll. It holds whether the device
        serves requests in turn or together, and whether a post returns at once or only after
        most of its bytes moved (a buffered header read behind the payload's)."""
        op, count, handle, start = posted.op, posted.count, posted.handle, posted.start
        pause = backoff = 0.0
        since, inflight = self._in_flight()
        pace = self._pace.get(op) if posted.paced and not forced_timeout else None
        if pace is not None:
            service = inflight * pace
            first_pause = max(service / 100, 1e-5)
            max_pause = max(first_pause, _POLL_MAX_PAUSE_S)
            wake = since + _PACE_EARLY * service
        polls = 0
        try:
            state = posted.state
            if mid_request is not None:
                mid_request(op)
            while state == "PROC" or forced_timeout:
                now = time.monotonic()
                if now - start >= self.timeout_s:
                    raise TransferFailed(
                        f"{op} of {count} descriptors not done after {now - start:.3f} s "
                        f"(timeout_s={self.timeout_s}); released"
                    )
                if pause:
                    time.sleep(pause)
                    now = time.monotonic()
                state = self.agent.check_xfer_state(handle)
                polls += 1
                if time.monotonic() - now > _POLL_WORK_S:  # the poll did the work: poll again
                    pause = 0.0
                elif pace is not None and now < wake:  # early: sleep to just before the predicted end
                    pause = min(wake - now, _PACE_MAX_SLEEP_S)
                elif pace is not None:
                    pause = backoff = min(2 * backoff, max_pause) if backoff else first_pause
                else:
                    pause = min(max(2 * pause, 1e-5), _POLL_MAX_PAUSE_S)
            if not forced_timeout:
                self._learn(op, since, inflight, time.monotonic(), learn=polls > 1 and posted.paced)
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
