"""What a pool needs to know to join a Mooncake Store cluster: addresses, protocol, sizes.

Owns the cluster tier's settings and their checks. Field names are the configuration keys
after ``cluster_`` (``kvtier.config`` reads them from this class: ``cluster_protocol``,
``KVTIER_CLUSTER_SEGMENT_BYTES``, ...); ``master`` is the ``cluster`` key itself. It must never
import Mooncake nor open a connection.
"""

from __future__ import annotations

import dataclasses
import socket
from typing import Optional

DEFAULT_PORT = 50051  # mooncake_master's usual RPC port


@dataclasses.dataclass(frozen=True)
class ClusterSettings:
    """master: the mooncake_master RPC address, ``host:port`` (``mooncake://host:port`` too).
    metadata_server: the transfer engine's metadata service: ``P2PHANDSHAKE`` (none needed),
    the master's own HTTP one (``http://host:port/metadata``, master flag
    ``-enable_http_metadata_server``) or etcd (``etcd://host:port``).
    protocol: ``tcp`` (works everywhere) or ``rdma`` (with ``device_name``).
    local_hostname: this process's address as other hosts reach it; empty: the address the
    route to the master leaves from.
    segment_bytes: host memory this process lends to the cluster (Mooncake keeps objects in
    the segments its clients lend; 0 lends none, for a process that only reads and writes).
    local_buffer_bytes: Mooncake's own staging buffer (zero-copy transfers barely use it).
    staging_bytes: registered memory (per direction) in which objects are assembled and
    checked, so that each moves as one buffer; 0 moves them zero-copy as slices (store.py says
    which wins where).
    object_prefix: first part of every object key, before the namespace.
    connect_timeout_s: how long one attempt to reach the master may take.
    mac_key: bytes that key the record MAC (as RemoteStore's); every host of one cluster
    namespace needs the same key.
    """

    master: str
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device_name: str = ""
    local_hostname: str = ""
    segment_bytes: int = 512 << 20
    local_buffer_bytes: int = 16 << 20
    staging_bytes: int = 32 << 20
    object_prefix: str = "kvtier"
    connect_timeout_s: float = 2.0
    mac_key: Optional[bytes] = None

    def __post_init__(self) -> None:
        host, port = self.master_host_port()
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"cluster protocol {self.protocol!r}; expected 'tcp' or 'rdma'")
        for name in ("segment_bytes", "local_buffer_bytes", "staging_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"cluster {name}={value!r}; expected a byte count >= 0")
        if not self.object_prefix or "/" in self.object_prefix:
            raise ValueError(f"cluster object_prefix={self.object_prefix!r}; expected a non-empty word without '/'")
        if not self.connect_timeout_s > 0:
            raise ValueError(f"cluster connect_timeout_s={self.connect_timeout_s!r}; expected seconds > 0")

    def master_host_port(self) -> tuple[str, int]:
        address = self.master.removeprefix("mooncake://")
        host, sep, port = address.rpartition(":")
        if not sep:
            host, port = address, str(DEFAULT_PORT)
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                f"cluster master {self.master!r}; expected 'host:port' of a mooncake_master, e.g. '10.0.0.5:50051'"
            )
        return host, int(port)

    def master_address(self) -> str:
        host, port = self.master_host_port()
        return f"{host}:{port}"

    def hostname(self) -> str:
        """local_hostname, or the local address of the route to the master (no packet is sent)."""
        if self.local_hostname:
            return self.local_hostname
        host, port = self.master_host_port()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect((host, port))
                return probe.getsockname()[0]
            except OSError:
                return "127.0.0.1"
