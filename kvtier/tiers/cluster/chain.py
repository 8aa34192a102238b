"""A local page store with the cluster behind it, driven by the pool's remote link as one store.

Owns the order in which the two are asked: reads and presence ask the local store first and the
cluster only for what it lacks (one cluster call per batch); writes go to the local store, which
decides what the pool sees (durability is local), then to the cluster, whose failures are the
cluster's own (its breaker, its counters) and never the pool's. Both calls run on the remote
link's threads, so neither waits in the engine's path.

It must never turn a cluster failure into a local one, nor serve a page neither store verified.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Sequence

from kvtier.tiers.cluster.settings import ClusterSettings
from kvtier.tiers.cluster.store import ClusterStore
from kvtier.tiers.remote.buffers import Buffer, PageBuffers

log = logging.getLogger(__name__)


def open_cluster(cluster: str | Mapping | ClusterSettings, local, owns_local: bool, *, namespace: str,
                 page_bytes: int):
    """The store a pool's remote link drives: the cluster alone, or behind `local` (a store
    the pool opened when `owns_local`, closed with the chain, or one its caller owns).
    `cluster` is the master's address, a mapping of ClusterSettings fields, or settings."""
    if isinstance(cluster, str):
        cluster = ClusterSettings(master=cluster)
    elif isinstance(cluster, Mapping):
        cluster = ClusterSettings(**cluster)
    elif not isinstance(cluster, ClusterSettings):
        raise TypeError(
            f"cluster of type {type(cluster).__name__}; expected a mooncake_master address 'host:port', "
            "a mapping of ClusterSettings fields, or ClusterSettings"
        )
    try:
        store = ClusterStore(cluster, namespace=namespace, page_bytes=page_bytes)
    except BaseException:
        if owns_local:
            local.close()
        raise
    return store if local is None else ChainedStore(local, store, owns_local)


class ChainedStore:
    def __init__(self, local, cluster: ClusterStore, owns_local: bool = True) -> None:
        if local.page_bytes != cluster.page_bytes or local.namespace != cluster.namespace:
            raise ValueError(
                f"local store of {local.page_bytes}-byte pages, namespace {local.namespace[:12]}…, and cluster "
                f"of {cluster.page_bytes}-byte pages, namespace {cluster.namespace[:12]}…; they must be the same"
            )
        self.local = local
        self.cluster = cluster
        self.owns_local = owns_local
        self.page_bytes = local.page_bytes
        self.namespace = local.namespace

    def contains_ids(self, ids: Sequence[bytes], fresh: bool = False) -> list[bool]:
        """Which ids the local store or the cluster holds (``fresh``: the local index itself,
        not this process's memory of it; the cluster is always asked)."""
        found = self.local.contains_ids(ids, fresh)
        rest = [i for i, hit in enumerate(found) if not hit]
        if rest:
            for i, hit in zip(rest, self.cluster.contains_ids([ids[i] for i in rest])):
                found[i] = hit
        return found

    def get_ids(self, ids: Sequence[bytes], buffers: Sequence[Buffer], prefix: bool = False) -> list[bool]:
        """Pages from the local store, the rest from the cluster; ``prefix``: only the leading
        pages up to the first that neither holds count (the caller discards what follows)."""
        if isinstance(buffers, PageBuffers):
            buffers = buffers.buffers()
        error = None
        try:
            found = self.local.get_ids(ids, buffers)
        except Exception as exc:  # the cluster may still have them
            error, found = exc, [False] * len(ids)
        rest = [i for i, hit in enumerate(found) if not hit]
        if rest:
            more = self.cluster.get_ids([ids[i] for i in rest], [buffers[i] for i in rest])
            for i, hit in zip(rest, more):
                found[i] = hit
        if error is not None and not any(found):
            raise error
        if prefix and False in found:
            first = found.index(False)
            found[first:] = [False] * (len(found) - first)
        return found

    def put_ids(self, ids: Sequence[bytes], buffers: Sequence[Buffer]) -> list[bool]:
        written = self.local.put_ids(ids, buffers)
        self.cluster.put_ids(ids, buffers)
        return written

    def delete_ids(self, ids: Sequence[bytes]) -> list[bool]:
        self.cluster.delete_ids(ids)
        return self.local.delete_ids(ids)

    def clear(self) -> int:
        """Empty the local store and this namespace's objects in the cluster; the local count."""
        self.cluster.clear()
        return self.local.clear()

    def register_host_memory(self, buffer) -> None:
        self.local.register_host_memory(buffer)
        self.cluster.register_host_memory(buffer)

    def unregister_host_memory(self, buffer) -> None:
        self.cluster.unregister_host_memory(buffer)
        self.local.unregister_host_memory(buffer)

    def set_timeout(self, seconds: float) -> None:
        if hasattr(self.local, "set_timeout"):
            self.local.set_timeout(seconds)

    def stats(self) -> dict:
        return {**self.local.stats(), **self.cluster.stats()}

    def close(self) -> None:
        try:
            if self.owns_local:
                self.local.close()
        finally:
            self.cluster.close()
