"""Opening what a pool is built on: its copy engine and its remote tier (a local page store, a
cluster tier, or both), from the arguments `TieredPool` was given. It must never hold pool state.
"""

from __future__ import annotations

import os

from kvtier.format import PageFormat
from kvtier.index import Namespace
from kvtier.pool.checks import check_copy_path_runs
from kvtier.tiers import DeviceTier, HostTier
from kvtier.transfer import TorchEngine


def make_engine(kind, device_tier: DeviceTier, host_tier: HostTier, transform, copy_path: str):
    if callable(kind):
        return kind(device_tier, host_tier)
    check_copy_path_runs(copy_path, kind, device_tier.device)
    if kind == "auto":
        kind = "cuda" if device_tier.device.type == "cuda" else "torch"
    if kind == "torch":
        return TorchEngine(device_tier, host_tier, transform=transform)
    if kind == "cuda":
        from kvtier.transfer.cuda_engine import CudaEngine

        return CudaEngine(device_tier, host_tier, transform=transform, path=copy_path)
    raise ValueError(f"engine must be 'auto', 'torch', 'cuda' or a callable, got {kind!r}")


def open_remote(remote, fmt: PageFormat, namespace: Namespace, capacity_bytes, create: bool, cluster):
    """(store, owned): the local store, the cluster tier (kvtier.tiers.cluster) behind it when
    `cluster` is given, or the cluster alone without `remote`."""
    store, owned = (None, False) if remote is None else open_local(remote, fmt, namespace, capacity_bytes, create)
    if cluster is None:
        return store, owned
    from kvtier.tiers.cluster import open_cluster

    return open_cluster(cluster, store, owned, namespace=namespace.digest, page_bytes=fmt.page_bytes), True


def open_local(remote, fmt: PageFormat, namespace: Namespace, capacity_bytes, create: bool):
    """(store, owned): open a directory or file:// URL, or check a caller's RemoteStore."""
    if isinstance(remote, (str, os.PathLike)):
        from kvtier.tiers.remote import RemoteStore
        from kvtier.tiers.remote.labels import format_fields

        store = RemoteStore(os.fspath(remote), namespace=namespace.digest, page_bytes=fmt.page_bytes,
                            capacity_bytes=capacity_bytes, create=create,
                            namespace_label={"model": namespace.model, "rank": namespace.rank,
                                             "format": format_fields(fmt)})
        return store, True
    if not all(hasattr(remote, name) for name in ("put_ids", "get_ids", "contains_ids", "page_bytes", "namespace")):
        raise TypeError(
            f"remote must be a directory path, a file:// URL or a kvtier RemoteStore, got {type(remote).__name__} {remote!r}"
        )
    if remote.page_bytes != fmt.page_bytes or remote.namespace != namespace.digest:
        raise ValueError(
            f"remote store holds {remote.page_bytes}-byte pages of namespace {remote.namespace[:12]}…; "
            f"this pool needs {fmt.page_bytes}-byte pages of namespace {namespace.digest[:12]}…"
        )
    return remote, False
