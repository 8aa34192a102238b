"""A real mooncake_master on loopback for the cluster tier's tests: free ports, start, kill, restart.

The master's own HTTP metadata server is the transfer engine's metadata service. Tests skip,
naming the install step, only where the Mooncake wheel is not installed (the Makefile installs
it, and Debian's libibverbs1 that its binaries link).
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest


def master_binary() -> Path:
    try:
        import mooncake
        from mooncake.store import MooncakeDistributedStore  # noqa: F401  (the client must load too)
    except ImportError as exc:
        from kvtier.tiers.cluster import INSTALL_HINT

        pytest.skip(f"Mooncake Store does not import ({exc}); {INSTALL_HINT}")
    return Path(mooncake.__file__).parent / "mooncake_master"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Master:
    """One mooncake_master process; `kill` and `start` again keep its ports."""

    def __init__(self, log_dir: Path) -> None:
        self.binary = master_binary()
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.log_path = log_dir / "mooncake_master.log"
        self.process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def settings(self, **overrides) -> dict:
        """Cluster settings of a host joining this master (ClusterSettings fields)."""
        return {"master": self.address, "metadata_server": self.metadata_server, "local_hostname": "127.0.0.1",
                "segment_bytes": 64 << 20, **overrides}

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [str(self.binary), f"-rpc_port={self.rpc_port}", "-rpc_address=127.0.0.1",
                 "-enable_http_metadata_server=true", "-http_metadata_server_host=127.0.0.1",
                 f"-http_metadata_server_port={self.http_port}", f"-metrics_port={self.metrics_port}",
                 "-default_kv_lease_ttl=100", "-client_ttl=2", "-logtostderr"],
                stdout=log, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.process.returncode}; see {self.log_path}:\n"
                                   + self.log_path.read_text()[-2000:])
            try:
                socket.create_connection(("127.0.0.1", self.rpc_port), timeout=0.2).close()
                socket.create_connection(("127.0.0.1", self.http_port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"mooncake_master did not listen on {self.address} within 30 s; see {self.log_path}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def mooncake_master(tmp_path):
    master = Master(tmp_path)
    master.start()
    try:
        yield master
    finally:
        master.stop()
