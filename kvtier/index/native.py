"""The index's batch paths in C (native/host_index.c), built at first use and kept on disk.

Owns finding, building and loading that extension, nothing else: kvtier.index's keys (ids and
the id cache's fill), key_table (the compact table's probes), slot_list (the eviction and dirty
lists' links) and tier_index (state changes, holds, unpins) call it where it is loaded and run
their Python twins where it is not, with the same results (tests/test_index_native.py runs both
on the same inputs; `make test` runs the pool's tests once more with KVTIER_HOST_CACHE=off).

Building: the system C compiler (``$CC``, else ``cc``) with Python's headers, once per source
text, Python version and machine, into the directory ``KVTIER_HOST_CACHE`` names (``off`` or an
empty value: not built, Python only), else ``$XDG_CACHE_HOME/kvtier/host``, else
``~/.cache/kvtier/host``. The build writes a temporary file there and renames it over the entry,
so concurrent processes each end with a whole library. The first process on a machine builds in
a background thread and runs the Python paths until the library is loaded (a pool's first call
never waits for a compiler); later processes load the kept library when they first ask. Where no
compiler, no headers or no writable directory is found, one log line says so and everything stays
in Python.

Why: the index's batch paths were Python per page or tens of numpy calls per batch (1-2 µs each
whatever its size); in C a fresh key's id costs 0.13 µs against 0.21 through hashlib, a probe of
the key table 7-19 ns against 100-210, and a 16-page load's bookkeeping about half its time
(BENCHMARKS.md, "The index's C paths").
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path

from kvtier.cache_dir import cache_directory

log = logging.getLogger("kvtier.index.native")

ENV = "KVTIER_HOST_CACHE"
MODULE = "_kvtier_host"
SOURCE = "host_index.c"
CFLAGS = ("-O3", "-shared", "-fPIC", "-fno-strict-aliasing", "-std=c11")
BUILD_TIMEOUT_S = 120

_module = None  # the loaded extension, once loaded
_state = "unstarted"  # unstarted, building, loaded, unavailable
_lock = threading.Lock()
_built = threading.Event()


def directory() -> Path | None:
    """Where built libraries are kept (None: building is off)."""
    return cache_directory(ENV, "host")


def source_text() -> str:
    # kvtier/native/ beside this package's modules (a plain path: no import at first use)
    return (Path(__file__).resolve().parents[1] / "native" / SOURCE).read_text()


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CC") or "cc")


def library_path(folder: Path, source: str) -> Path:
    """The library of `source` for this Python and machine in `folder`."""
    digest = hashlib.sha256()
    for part in (source, sys.version, sysconfig.get_platform(), " ".join(_compiler() + list(CFLAGS))):
        digest.update(part.encode() + b"\0")
    return folder / f"{MODULE}.{digest.hexdigest()[:24]}{importlib.machinery.EXTENSION_SUFFIXES[0]}"


def build(path: Path, source: str) -> Path:
    """Compile `source` into `path` (from library_path; atomically) unless it is there; the path."""
    if path.exists():
        return path
    folder = path.parent
    folder.mkdir(parents=True, exist_ok=True)
    include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(include, "Python.h")):
        raise OSError(f"no Python.h under {include} (install Python's development headers)")
    fd, tmp_src = tempfile.mkstemp(prefix=".host_index.", suffix=".c", dir=folder)
    with os.fdopen(fd, "w") as f:
        f.write(source)
    fd, tmp_lib = tempfile.mkstemp(prefix=".host_index.", suffix=".so", dir=folder)
    os.close(fd)
    try:
        cmd = _compiler() + list(CFLAGS) + [f"-I{include}", tmp_src, "-o", tmp_lib]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise OSError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[-800:]}")
        os.replace(tmp_lib, path)
    finally:
        for leftover in (tmp_src, tmp_lib):
            try:
                os.unlink(leftover)
            except FileNotFoundError:
                pass
    return path


def _load(path: Path):
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _build_and_load(path: Path, source: str) -> None:
    global _module, _state
    try:
        _module = _load(build(path, source))
        _state = "loaded"
    except Exception as exc:  # a compiler or headers missing, a build failing: Python paths, said once
        log.warning("kvtier's C index paths are not built (%s); the Python paths serve", exc)
        _state = "unavailable"
    finally:
        _built.set()


def start(wait: bool = False):
    """Load the kept library, else start building it: in a thread, or here with `wait` (which
    also waits for a build another thread started). The module, or None while it is not loaded
    (or cannot be)."""
    global _state
    with _lock:
        if _state == "unstarted":
            folder = directory()
            try:
                source = source_text()
            except Exception as exc:  # (unreadable, missing from an install)
                log.warning("kvtier's C index source is missing (%s); the Python paths serve", exc)
                source = None
            if folder is None or source is None:
                _state = "unavailable"
                _built.set()
            else:
                _state = "building"
                path = library_path(folder, source)
                if wait or path.exists():
                    _build_and_load(path, source)
                else:
                    threading.Thread(target=_build_and_load, args=(path, source), name="kvtier-host-build",
                                     daemon=True).start()
    if wait:
        _built.wait()
    return _module


def attach(owner, kind: str, *buffers):
    """`owner`'s C view of its own arrays (`owner._c`): the extension's `kind` (Table, Links,
    States) over `buffers`, made once the library is loaded; None before."""
    if owner._c is None and _module is not None:
        owner._c = getattr(_module, kind)(*buffers)
    return owner._c


def module():
    """The loaded extension, or None (Python paths). Cheap: callers ask per call."""
    return _module
