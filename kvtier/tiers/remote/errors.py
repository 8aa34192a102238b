"""Exceptions of the remote tier, in one place so every part raises the same types.

Owns nothing else; it must never import the other modules of the package.
"""


class RemoteUnavailable(RuntimeError):
    """NIXL, crc32c or the requested storage backend cannot be used on this machine."""


class TransferFailed(RuntimeError):
    """A NIXL transfer raised, reported an error, or timed out; it was released."""


class StoreCorrupt(RuntimeError):
    """The index file cannot be read as a kvtier index; ``kvtier store rebuild`` recovers it."""


class StoreVersionMismatch(RuntimeError):
    """The store was written by a kvtier with another index schema or record format."""


class StoreUnsafe(RuntimeError):
    """A path in the store is a symbolic link, or the store belongs to another user."""


class StoreBusy(RuntimeError):
    """The store is being rebuilt, or is open elsewhere while a rebuild was asked for."""


class StoreLocationError(OSError):
    """The store directory cannot be opened or created where it was asked for: a parent that
    is a file or does not exist, a read-only file system, a directory this process cannot
    write. ``errno`` is the system's; the message names the store directory and the fix."""
