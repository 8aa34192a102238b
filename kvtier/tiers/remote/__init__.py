"""The remote tier: a durable page store shared by the processes of one host, on NIXL.

``RemoteStore`` (``store``) is the public face; ``index`` (SQLite slot index), ``datapath``
(a batch's records between caller memory and the medium: requests, checksums, direct I/O),
``segments`` (segment files and the OBJ medium), ``records`` (record format, checksums, MAC), ``buffers``
(caller memory as pages of pieces), ``nixl`` (the NIXL agent), ``paths`` (directory layout and
safety), ``faults`` (the test seam) and ``errors`` are its parts; ``tool`` checks a store and
rebuilds its index (imported on demand, not here).
"""

from kvtier.tiers.remote.errors import (
    RemoteUnavailable,
    StoreBusy,
    StoreCorrupt,
    StoreUnsafe,
    StoreVersionMismatch,
    TransferFailed,
)
from kvtier.tiers.remote.faults import FaultInjector
from kvtier.tiers.remote.nixl import INSTALL_HINT, load_nixl_api
from kvtier.tiers.remote.records import (
    FORMAT_VERSION,
    HEADER_BYTES,
    SLOT_ALIGN,
    namespace_fingerprint,
)
from kvtier.tiers.remote.store import RemoteStore

__all__ = [
    "FORMAT_VERSION",
    "FaultInjector",
    "HEADER_BYTES",
    "INSTALL_HINT",
    "RemoteStore",
    "RemoteUnavailable",
    "SLOT_ALIGN",
    "StoreBusy",
    "StoreCorrupt",
    "StoreUnsafe",
    "StoreVersionMismatch",
    "TransferFailed",
    "load_nixl_api",
    "namespace_fingerprint",
]
