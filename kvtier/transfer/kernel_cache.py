"""The on-disk cache of compiled native/ kernels (cubins), shared by every process of a user.

Owns where the cache lives, how an entry is named, and reading and writing entries safely:
the name is the sha256 of everything the compiled bytes depend on (the source text, the
compile options, the GPU architecture, the toolchain's versions and this format's version), an
entry carries the sha256 of its payload and is read back only when it matches (a torn or
corrupt file counts as missing and is compiled again), and a writer writes a temporary file
in the cache directory and renames it over the entry (os.replace), so concurrent processes
compiling the same kernels each end with a whole entry and readers never see half of one.

Why: NVRTC took 1.7-3.0 s on the H200's host (10.5 s on a 2-core VM) to compile native/ in
every fresh process; a cached cubin loads in milliseconds.

The directory is KVTIER_KERNEL_CACHE when set (an empty value or "off" turns the cache off),
else $XDG_CACHE_HOME/kvtier/kernels, else ~/.cache/kvtier/kernels. Where it cannot be
created or written, kernels are compiled in memory and one warning names the directory and
the variable that moves it. It must never compile, load a module or touch a GPU: callers
hand it the compile function.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import warnings
from pathlib import Path
from typing import Callable

from kvtier.cache_dir import cache_directory

ENV = "KVTIER_KERNEL_CACHE"
FORMAT_VERSION = 1
MAGIC = b"kvtier-cubin\n"
DIGEST_BYTES = 32
SUFFIX = ".cubin"

_warned: set[str] = set()


def default_directory() -> Path | None:
    """The cache directory this process uses (None: the cache is off)."""
    return cache_directory(ENV, "kernels")


def entry_key(source: str, options: tuple[str, ...], arch: str, toolchain: str) -> str:
    """The hex name of the entry for `source` compiled with `options` for `arch` by `toolchain`."""
    digest = hashlib.sha256()
    for part in (f"format {FORMAT_VERSION}", arch, toolchain, "\0".join(options), source):
        data = part.encode("utf-8")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def encode(payload: bytes) -> bytes:
    return MAGIC + hashlib.sha256(payload).digest() + payload


def decode(data: bytes) -> bytes | None:
    """The payload of an entry's bytes, or None where they are not a whole, intact entry."""
    head = len(MAGIC) + DIGEST_BYTES
    if len(data) < head or not data.startswith(MAGIC):
        return None
    payload = data[head:]
    return payload if hashlib.sha256(payload).digest() == data[len(MAGIC):head] else None


class KernelCache:
    """Compiled kernels on disk under `directory` (None: compile every time, keep nothing)."""

    def __init__(self, directory: Path | str | None) -> None:
        self.directory = None if directory is None else Path(directory)
        self.hits = 0
        self.compiles = 0

    def path(self, key: str) -> Path:
        return self.directory / f"{key}{SUFFIX}"

    def read(self, key: str) -> bytes | None:
        """The cached payload of `key`, or None (absent, unreadable, torn or corrupt)."""
        if self.directory is None:
            return None
        try:
            data = self.path(key).read_bytes()
        except OSError:
            return None
        return decode(data)

    def write(self, key: str, payload: bytes) -> bool:
        """Store `payload` as `key` (temporary file, then rename); False where the directory is unwritable."""
        if self.directory is None:
            return False
        temp = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            handle, temp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=self.directory)
            with os.fdopen(handle, "wb") as file:
                file.write(encode(payload))
            os.replace(temp, self.path(key))
            return True
        except OSError as error:
            if temp is not None:
                try:
                    os.unlink(temp)
                except OSError:
                    pass
            where = str(self.directory)
            if where not in _warned:
                _warned.add(where)
                warnings.warn(
                    f"kvtier cannot write its kernel cache at {where} ({error}); native kernels are compiled "
                    f"in every process. Set {ENV} to a writable directory (or to 'off' to silence this).",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return False

    def get(self, key: str, compile: Callable[[], bytes]) -> bytes:
        """The payload of `key`: from the cache, else compile() stored for the next process."""
        payload = self.read(key)
        if payload is not None:
            self.hits += 1
            return payload
        payload = compile()
        self.compiles += 1
        self.write(key, payload)
        return payload
