"""``KvtierHiCacheStorage``: SGLang's HiCache storage backend over kvtier's remote store.

Owns the mapping between SGLang's storage calls and kvtier's ``RemoteStore``: one store object
(one namespace, one page size) per registered host pool ("lane"), pages addressed by SGLang's
page hashes, every page moved zero-copy between the host pool's memory and the store as one
record of several pieces. It must never raise on the data path (a failure is a miss or False,
counted and logged once per cause), write pages that are not this rank's to write, or let a
page written under another namespace (model, KV dtype and scales, layout, geometry, ranks)
hit. Configuration errors raise when SGLang constructs the backend or registers a pool.

Facts it relies on, read from sglang 0.5.23 (paths under ``sglang/srt/``):
- ``dynamic`` backends are constructed as ``cls(storage_config, kwargs)`` with the kwargs dict
  passed positionally (``mem_cache/storage/backend_factory.py:165``); the host pool arrives
  after, through ``register_mem_pool_host`` (``managers/cache_controller.py:617``).
- The zero-copy v1 calls are used for ``dynamic`` only when the extra config sets
  ``interface_v1`` (``managers/cache_controller.py:664``); a backup stops at the first batch
  whose ``batch_set_v1`` is not all True (``managers/cache_controller.py:1410,1432``).
- ``batch_exists`` returns the number of leading keys present; batches hold at most
  ``STORAGE_BATCH_SIZE`` = 128 keys for v1 (``mem_cache/hicache_storage.py:24``); v2 sidecar
  writes carry a whole operation (``mem_cache/hybrid_cache/hybrid_cache_controller.py:1711``).
- ``get_page_buffer_meta(indices)`` gives, per page, 2 pointers (K then V, each
  L·P·H·D·itemsize bytes) for MHA ``page_first`` / ``page_first_direct``, 2L (each P·H·D·itemsize,
  K and V of each layer) for MHA ``layer_first``, 1 for MLA ``page_first`` /
  ``page_first_direct``, L for MLA ``layer_first``, and K, V of unequal sizes for the asymmetric
  MHA pool (``mem_cache/pool_host/mha.py:817,1608``, ``mem_cache/pool_host/mla.py:1213``).
  kvtier stores the pieces of a page, in that order, as one record.
- Only the storage writer writes (``HiCacheStorageConfig.is_storage_writer``: for MLA one rank
  per DCP shard, ``mem_cache/hicache_storage.py:69``); other ranks' writes return True.
- A KV anchor without a ``kv_buffer`` is a logical pool (DeepSeek V4): its reads and writes are
  all True and its data travels in v2 pools, as SGLang's Mooncake backend does
  (``mem_cache/storage/mooncake_store/mooncake_store.py:1390``). Any other pool without one, or
  without MHA/MLA geometry (Mamba state, indexers), is refused when it is registered.
- Extra host pools (a standalone EAGLE/EAGLE3 draft is ``PoolName.DRAFT``) arrive through
  ``register_mem_host_pool_v2`` and move through ``batch_exists_v2`` / ``batch_get_v2`` /
  ``batch_set_v2`` (``mem_cache/hybrid_cache/hybrid_cache_controller.py:356,1438,1651,1711``).
- SGLang's fault-injection wrapper calls ``close()`` unconditionally
  (``mem_cache/hicache_storage.py:724``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, List, Optional, Sequence

import numpy as np
import torch

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.observability.metrics_collector import StorageMetrics

from kvtier.adapters.sglang import metrics
from kvtier.adapters.sglang.namespace import pool_namespace, resolve_kv_format
from kvtier.adapters.sglang.settings import BackendSettings
from kvtier.index.keys import key_ids
from kvtier.tiers.cluster import open_cluster
from kvtier.tiers.remote import RemoteStore
from kvtier.tiers.remote.buffers import PageBuffers, PieceLayout

logger = logging.getLogger(__name__)

_GENERIC = "the generic (copying) interface is not served: kvtier needs interface_v1"


# Batches of at most this many pieces are described in plain Python (the pool's own list,
# checked without arrays); larger ones with array operations.
_FEW_PIECES = 32
# MHA pieces of batches of more than this many are computed with arrays, fewer in Python.
_COMPUTED_IN_ARRAYS = 128


def _pool_regions(pool: Any) -> list[torch.Tensor]:
    """The host pool's page memory: ``kv_buffer`` (one tensor, or a tuple of tensors for the
    asymmetric MHA pool)."""
    buffer = getattr(pool, "kv_buffer", None)
    if buffer is None:
        return []
    tensors = list(buffer) if isinstance(buffer, (tuple, list)) else [buffer]
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(
                f"host pool {type(pool).__name__}: kv_buffer part of type {type(tensor).__name__} "
                f"on {getattr(tensor, 'device', None)}; expected contiguous CPU tensors"
            )
    return tensors


def _namespace_label(fields: dict) -> dict:
    """What ``kvtier store check`` and other pools show for this namespace (labels.describe)."""
    geometry = fields.get("geometry") or {}
    return {
        "model": fields.get("model"),
        "rank": (fields.get("tp") or [None])[0],
        "format": {"dtype": fields.get("kv_dtype", "").replace("torch.", ""), "page_size": fields.get("page_size"),
                   "num_layers": fields.get("layers"), "num_kv_heads": geometry.get("head_num"),
                   "head_dim": geometry.get("head_dim") or geometry.get("kv_lora_rank"),
                   "mla": geometry.get("kind") == "mla", "layout": fields.get("layout")},
        "sglang": {"pool": fields.get("pool"), "tag": fields.get("tag"), "pieces": fields.get("piece_bytes")},
    }


def _is_storage_writer(config: HiCacheStorageConfig) -> bool:
    """SGLang's ``is_storage_writer`` (0.5.23); sglang 0.5.17's config has none, and there an MLA
    page is written by TP rank 0 alone, as its Mooncake backend does."""
    writer = getattr(config, "is_storage_writer", None)
    return writer if writer is not None else (not config.is_mla_model or config.tp_rank == 0)


class _Lane:
    """One host pool and the store holding its pages: how a batch of page indices becomes the
    (pointer, size) pieces of each page."""

    def __init__(self, name: str, pool: Any, store: Optional[RemoteStore], piece_sizes: tuple[int, ...],
                 replicated: bool, regions: list[torch.Tensor]):
        self.name = name
        self.pool = pool
        self.store = store
        self.piece_sizes = piece_sizes
        self.page_bytes = sum(piece_sizes)
        self.replicated = replicated
        self.indices_per_page = int(getattr(pool, "logical_page_size", pool.page_size))
        bounds = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in regions]
        self._starts = np.array([b[0] for b in bounds], dtype=np.int64)
        self._ends = np.array([b[1] for b in bounds], dtype=np.int64)
        self._regions = bounds
        self._layout = self._mha_layout() if store is not None else None
        self._piece_layout = PieceLayout(piece_sizes, self.page_bytes) if self._layout is not None else None

    def _mha_layout(self) -> Optional[tuple[int, int, int, int]]:
        """(kv_buffer address, bytes per token row, bytes per layer, V offset) where the pool
        is an MHA pool of one ``kv_buffer`` (K and V halves) in ``layer_first`` or
        ``page_first`` layout and the pieces computed from them equal what
        ``get_page_buffer_meta`` gives for its first pages: then a batch's pieces are computed
        with array operations (``get_page_buffer_meta`` builds a Python list, one entry per
        piece). None otherwise: the pool is asked every time."""
        pool = self.pool
        try:
            layout = pool.layout
            if layout not in ("layer_first", "page_first") or len(self.piece_sizes) not in (2, 2 * pool.layer_num):
                return None
            itemsize = pool.dtype.itemsize
            row = pool.head_num * pool.head_dim * itemsize
            per_layer = pool.size * row
            v_offset = pool.layer_num * per_layer
            found = (pool.kv_buffer.data_ptr(), row, per_layer, v_offset)
            probe_pages = min(2, pool.size // self.indices_per_page - 1)  # pages 1 and 2
            if probe_pages < 1:
                return None
            probe = torch.arange(
                self.indices_per_page, (probe_pages + 1) * self.indices_per_page, dtype=torch.int64
            )[: probe_pages * self.indices_per_page]
            ptrs, sizes = pool.get_page_buffer_meta(probe)
            mine, my_sizes = self._computed(found, layout, probe, probe_pages)
        except Exception:  # an attribute missing, another pool class: ask the pool
            return None
        if list(ptrs) != mine.tolist() or list(sizes) != my_sizes.tolist():
            return None
        # the check of ``_computed_inside`` holds only if the pool's last page lies inside its
        # memory too
        last = torch.arange(pool.size - self.indices_per_page, pool.size, dtype=torch.int64)
        ends, end_sizes = self._computed(found, layout, last, 1)
        if self._outside(ends.tolist(), end_sizes.tolist()):
            return None
        return found

    def _computed_few(self, found: tuple, host_indices: torch.Tensor, pages: int) -> tuple[list, list]:
        """``_computed`` as Python lists, for a few pieces (array setup costs more)."""
        firsts = host_indices[:: self.indices_per_page].tolist()
        return self._computed_few_ptrs(found, firsts), list(self.piece_sizes) * pages

    def _computed_few_ptrs(self, found: tuple, firsts: list[int]) -> list[int]:
        """``_computed_ptrs`` as a Python list, for the pages whose first indices are ``firsts``."""
        base, row, per_layer, v_offset = found
        if self.pool.layout == "layer_first":
            layers = range(len(self.piece_sizes) // 2)
            ptrs = [
                p for first in firsts for layer in layers
                for k in (base + first * row + layer * per_layer,) for p in (k, k + v_offset)
            ]
        else:
            scale = row * self.pool.layer_num
            ptrs = [p for first in firsts for k in (base + first * scale,) for p in (k, k + v_offset)]
        return ptrs

    def _computed(self, found: tuple, layout: str, host_indices: torch.Tensor, pages: int):
        """(pointers, sizes) of the pieces of ``pages`` pages, as ``get_page_buffer_meta``
        orders them (per page: K then V of each layer, or K then V)."""
        first = host_indices.reshape(pages, self.indices_per_page)[:, 0].cpu().numpy().astype(np.int64)
        sizes = np.tile(np.asarray(self.piece_sizes, dtype=np.int64), pages)
        return self._computed_ptrs(found, layout, first), sizes

    def _computed_ptrs(self, found: tuple, layout: str, first: np.ndarray) -> np.ndarray:
        """The pieces' pointers of the pages whose first host indices are ``first``."""
        base, row, per_layer, v_offset = found
        if layout == "layer_first":
            layers = len(self.piece_sizes) // 2
            k = (base + first * row)[:, None] + np.arange(layers, dtype=np.int64)[None, :] * per_layer
        else:
            k = (base + first * row * self.pool.layer_num)[:, None]
        return np.stack([k, k + v_offset], axis=2).reshape(-1)

    @property
    def logical(self) -> bool:
        """A logical anchor pool: indices without bytes (``kv_buffer`` is None)."""
        return self.store is None

    def page_buffers(self, host_indices: torch.Tensor, pages: int) -> list:
        """Per page, its pieces as ``(ptr, nbytes)``; a single piece is a tuple, several a list.
        Checked as ``page_table``."""
        ptrs, sizes = self._pieces(host_indices, pages)
        per_page = len(self.piece_sizes)
        if per_page == 1:
            return [(p, self.page_bytes) for p in ptrs]
        pieces = list(zip(ptrs, sizes))
        return [pieces[i * per_page : (i + 1) * per_page] for i in range(pages)]

    def page_table(self, host_indices: torch.Tensor, pages: int) -> PageBuffers:
        """The same pieces as one ``PageBuffers``, built from arrays (no Python work per piece).

        Raises ValueError when the indices or the pool's answer do not describe ``pages`` pages
        of this lane's pieces inside the pool's memory: a pointer outside it would let NIXL read
        or write memory that is not a page."""
        if self._layout is not None:  # pieces computed from the indices: checked per page
            return PageBuffers.of_layout(self._computed_inside(host_indices, pages), self._piece_layout, pages)
        ptrs, sizes = self._pieces(host_indices, pages)
        if len(ptrs) <= _FEW_PIECES:  # plain Python: array setup costs more than the pieces
            per_page = len(self.piece_sizes)
            pieces = list(zip(ptrs, sizes))
            return PageBuffers(
                [pieces[i * per_page : (i + 1) * per_page] for i in range(pages)], pages, self.page_bytes
            )
        return PageBuffers.from_arrays(
            np.asarray(ptrs, dtype=np.uint64), np.asarray(sizes, dtype=np.uint64), pages, self.page_bytes
        )

    def _computed_inside(self, host_indices: torch.Tensor, pages: int):
        """The computed pieces' pointers (a list, or an array for many pieces), once every page
        of ``host_indices`` is found inside the pool: a page starting at index ``f`` has its
        pieces inside ``kv_buffer`` exactly when ``0 <= f`` and ``f + indices_per_page <=
        pool.size`` (pieces are ``f`` rows into each layer's K and V planes), so the check
        costs a minimum and a maximum per batch, not a comparison per piece."""
        self._check_count(host_indices, pages)
        per_page = self.indices_per_page
        if pages * len(self.piece_sizes) > _COMPUTED_IN_ARRAYS:
            first = host_indices[::per_page].cpu().numpy().astype(np.int64)
            ptrs = self._computed_ptrs(self._layout, self.pool.layout, first)
            lo, hi = int(first.min()), int(first.max())
        else:
            firsts = host_indices[::per_page].tolist()
            ptrs = self._computed_few_ptrs(self._layout, firsts)
            lo, hi = min(firsts), max(firsts)
        if lo < 0 or hi + per_page > self.pool.size:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"{self.name}: a page at host index {bad} lies outside the host pool's memory "
                f"(indices 0 to {self.pool.size - 1}, {per_page} per page)"
            )
        return ptrs

    def _check_count(self, host_indices: torch.Tensor, pages: int) -> None:
        if host_indices.numel() != pages * self.indices_per_page:
            raise ValueError(
                f"{self.name}: {host_indices.numel()} host indices for {pages} pages; expected "
                f"{pages * self.indices_per_page} ({self.indices_per_page} per page)"
            )

    def _outside(self, ptrs, sizes) -> list[int]:
        """Positions of the pieces that no region of the pool's memory holds whole."""
        if len(ptrs) <= _FEW_PIECES:
            regions = self._regions
            return [
                i for i, (p, n) in enumerate(zip(ptrs, sizes))
                if not any(s <= p and p + n <= e for s, e in regions)
            ]
        ptr_array = np.asarray(ptrs, dtype=np.int64)
        end_array = ptr_array + np.asarray(sizes, dtype=np.int64)
        inside = (
            (ptr_array[:, None] >= self._starts[None, :]) & (end_array[:, None] <= self._ends[None, :])
        ).any(axis=1)
        return np.flatnonzero(~inside).tolist()

    def _pieces(self, host_indices: torch.Tensor, pages: int) -> tuple:
        if self._layout is not None:  # computed pieces are checked per page
            return self._computed_inside(host_indices, pages), list(self.piece_sizes) * pages
        self._check_count(host_indices, pages)
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        per_page = len(self.piece_sizes)
        if len(ptrs) != pages * per_page or list(sizes) != list(self.piece_sizes) * pages:
            raise ValueError(
                f"{self.name}: get_page_buffer_meta gave {len(ptrs)} pieces of sizes "
                f"{sorted(set(sizes))} for {pages} pages; expected {per_page} pieces per page of "
                f"sizes {list(self.piece_sizes)}"
            )
        outside = self._outside(ptrs, sizes)
        if outside:
            bad = outside[0]
            raise ValueError(
                f"{self.name}: piece {bad} at {int(ptrs[bad]):#x} (+{int(sizes[bad])}) lies outside the host "
                f"pool's memory {[(hex(s), int(e - s)) for s, e in zip(self._starts, self._ends)]}"
            )
        return ptrs, sizes


class KvtierHiCacheStorage(HiCacheStorage):
    """SGLang HiCache storage backed by kvtier's NIXL page store (see the module docstring).

    Constructed by SGLang's ``dynamic`` factory path as ``cls(storage_config, kwargs)``; the
    settings come from ``storage_config.extra_config`` (``settings.BackendSettings``)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.settings = BackendSettings.from_extra_config(storage_config.extra_config)
        if self.settings.left_to_sglang:
            logger.info("kvtier: SGLang's own flags decide %s; kvtier's configuration values for them are "
                        "not used by the storage backend", ", ".join(self.settings.left_to_sglang))
        # The cluster tier (Mooncake Store) behind each lane's store: kvtier.config's `cluster`
        # keys, from the extra config, its `config` file or KVTIER_CLUSTER / KVTIER_CLUSTER_<SETTING>.
        self._cluster = self.settings.cluster
        self.storage_config = storage_config
        if self.settings.store_kwargs.get("create"):
            os.makedirs(_directory(self.settings.path), exist_ok=True)
        self.registered_pools = {}
        self._anchor: Optional[_Lane] = None
        self._lanes: dict[str, _Lane] = {}
        self._register_lock = threading.Lock()
        self._warned: set[tuple[str, str, str]] = set()
        self._warn_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._prefetch_pages: list[int] = []
        self._backup_pages: list[int] = []
        self._prefetch_gbps: list[float] = []
        self._backup_gbps: list[float] = []
        self._closed = False

    # ----------------------------------------------------------------- pools
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Open the store for SGLang's KV host pool (the anchor) and register its memory."""
        super().register_mem_pool_host(mem_pool_host)
        self._anchor = self._open_lane(str(PoolName.KV), mem_pool_host, "target", self.storage_config.is_mla_model)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Open a store for an extra host pool (e.g. the speculative draft's ``PoolName.DRAFT``).

        The KV pool arrives through ``register_mem_pool_host``; its v2 registration is a no-op."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if name == str(PoolName.KV):
            return
        role = "draft" if name.startswith("draft") else "target"
        replicated = isinstance(host_pool, MLATokenToKVPoolHost) and self.storage_config.is_mla_model
        self._lanes[name] = self._open_lane(name, host_pool, role, replicated)

    def _open_lane(self, name: str, pool: Any, role: str, replicated: bool) -> _Lane:
        with self._register_lock:
            if self._closed:
                raise RuntimeError(f"kvtier backend is closed; cannot register host pool {name!r}")
            old = self._lanes.get(name) if name != str(PoolName.KV) else self._anchor
            if old is not None and old.pool is pool:
                return old
            regions = _pool_regions(pool)
            if not regions and name != str(PoolName.KV):
                raise ValueError(
                    f"host pool {name!r} ({type(pool).__name__}) has no kv_buffer; kvtier stores MHA and "
                    "MLA host pools (only the KV anchor may be a logical pool without bytes)"
                )
            if not regions:
                logger.info("kvtier: host pool %r (%s) has no kv_buffer: a logical anchor, its pages "
                            "travel in v2 pools", name, type(pool).__name__)
                return _Lane(name, pool, None, (), replicated, [])
            if not hasattr(pool, "get_page_buffer_meta"):
                raise ValueError(f"host pool {name!r} ({type(pool).__name__}) has no get_page_buffer_meta; "
                                 "kvtier moves pages zero-copy and needs it")
            first = torch.arange(int(getattr(pool, "logical_page_size", pool.page_size)), dtype=torch.int64)
            _, sizes = pool.get_page_buffer_meta(first)
            piece_sizes = tuple(int(s) for s in sizes)
            kv_format = resolve_kv_format(role, pool.dtype)
            namespace, fields = pool_namespace(
                pool=pool, pool_name=name, storage_config=self.storage_config, kv_format=kv_format,
                replicated=replicated, piece_sizes=piece_sizes, tag=self.settings.namespace_tag,
            )
            store = RemoteStore(
                self.settings.path,
                namespace=namespace,
                page_bytes=sum(piece_sizes),
                namespace_label=_namespace_label(fields),
                **self.settings.store_kwargs,
            )
            if self._cluster is not None:
                store = open_cluster(self._cluster, store, True, namespace=namespace, page_bytes=sum(piece_sizes))
            try:
                for region in regions:
                    store.register_host_memory(region)
            except Exception:
                store.close()
                raise
            if old is not None and old.store is not None:
                old.store.close()
            logger.info(
                "kvtier: host pool %r (%s, layout %s, %d pieces, %d bytes a page) -> store %s "
                "namespace %s (%s)", name, type(pool).__name__, pool.layout, len(piece_sizes),
                sum(piece_sizes), self.settings.path, namespace[:16], fields,
            )
            return _Lane(name, pool, store, piece_sizes, replicated, regions)

    # ----------------------------------------------------------------- v1
    def batch_exists(self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        """Number of leading ``keys`` stored (0 on any failure)."""
        lane = self._anchor
        if not keys:
            return 0
        if lane is None or lane.logical:
            return 0
        present = self._contains(lane, keys)
        hits = present.index(False) if False in present else len(present)
        return hits

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Read pages into the KV host pool at ``host_indices``; True per page read and verified.
        SGLang keeps only the pages before the first miss (``_page_get_zero_copy``), so pages
        after a gap in the store are not read."""
        return self._read(self._anchor, str(PoolName.KV), keys, host_indices, prefix=True)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> List[bool]:
        """Store pages of the KV host pool at ``host_indices``; True per page stored (or not
        this rank's to store)."""
        return self._write(self._anchor, str(PoolName.KV), keys, host_indices)

    # ----------------------------------------------------------------- v2
    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        """Longest usable prefix of ``keys`` over the KV pool and every pool in ``pool_transfers``
        (``ALL_PAGES``: every page of the prefix; ``TRAILING_PAGES``: its last pages only)."""
        anchor = self._anchor
        kv_pages = len(keys) if anchor is not None and anchor.logical else self.batch_exists(keys, extra_info)
        hit_count: dict = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            lane = self._lanes.get(str(transfer.name))
            if lane is None or lane.logical:
                self._fail("exists", str(transfer.name), 0, "the pool is not registered")
                restorable = []
                break
            present = self._contains(lane, keys[:kv_pages])
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = present.index(False) if False in present else kv_pages
                pool_restorable = set(range(1, boundary + 1))
            elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                trailing = max(1, len(transfer.keys) if transfer.keys else 1)
                pool_restorable = {
                    n for n in range(1, kv_pages + 1) if all(present[max(0, n - trailing) : n])
                }
                boundary = max(pool_restorable, default=0)
            else:
                self._fail("exists", str(transfer.name), 0, f"hit policy {transfer.hit_policy} is not supported")
                pool_restorable, boundary = set(), 0
            if boundary:
                hit_count[transfer.name] = boundary
            restorable = [n for n in restorable if n in pool_restorable]
        return PoolTransferResult(restorable[-1] if restorable else 0, hit_count, restorable)

    def batch_get_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[str, List[bool]]:
        return {
            t.name: self._read(self._lane_of(t), str(t.name), t.keys or [], t.host_indices)
            for t in transfers
        }

    def batch_set_v2(self, transfers: List[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[str, List[bool]]:
        return {
            t.name: self._write(self._lane_of(t), str(t.name), t.keys or [], t.host_indices)
            for t in transfers
        }

    def _lane_of(self, transfer: PoolTransfer) -> Optional[_Lane]:
        if str(transfer.name) == str(PoolName.KV):
            return self._anchor
        return self._lanes.get(str(transfer.name))

    # ----------------------------------------------------------------- generic (copying) interface
    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        """Not served: kvtier requires ``interface_v1`` (checked at construction), so SGLang never
        takes this path; a call is a miss."""
        self._fail("read", "kv", 1, _GENERIC)
        return None

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[None]:
        self._fail("read", "kv", len(keys), _GENERIC)
        return [None] * len(keys)

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        self._fail("write", "kv", 1, _GENERIC)
        return False

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        self._fail("write", "kv", len(keys), _GENERIC)
        return False

    # ----------------------------------------------------------------- housekeeping
    def clear(self) -> bool:
        """Remove every page of this backend's namespaces (never another namespace's)."""
        ok = True
        for lane in self._all_lanes():
            try:
                removed = lane.store.clear()
                logger.info("kvtier: cleared %d pages of pool %r", removed, lane.name)
            except Exception as exc:
                self._fail("clear", lane.name, 0, exc)
                ok = False
        return ok

    def get_stats(self):
        """SGLang's ``StorageMetrics`` since the last call: pages per batch and GB/s per batch."""
        with self._stats_lock:
            stats = StorageMetrics(
                prefetch_pgs=self._prefetch_pages, backup_pgs=self._backup_pages,
                prefetch_bandwidth=self._prefetch_gbps, backup_bandwidth=self._backup_gbps,
            )
            self._prefetch_pages, self._backup_pages = [], []
            self._prefetch_gbps, self._backup_gbps = [], []
        return stats

    def store_stats(self) -> dict[str, dict]:
        """Each lane's ``RemoteStore.stats()``, by pool name."""
        return {lane.name: lane.store.stats() for lane in self._all_lanes()}

    def close(self) -> None:
        """Release the stores (files, NIXL registrations); idempotent."""
        with self._register_lock:
            if self._closed:
                return
            self._closed = True
            lanes = self._all_lanes()
            self._anchor = None
            self._lanes = {}
        for lane in lanes:
            try:
                lane.store.close()
            except Exception as exc:
                logger.warning("kvtier: closing the store of pool %r failed: %r", lane.name, exc)

    def _all_lanes(self) -> list[_Lane]:
        lanes = [self._anchor, *self._lanes.values()]
        return [lane for lane in lanes if lane is not None and not lane.logical]

    # ----------------------------------------------------------------- data path
    def _contains(self, lane: _Lane, keys: Sequence[str]) -> list[bool]:
        try:
            present = lane.store.contains_ids(key_ids(keys))
        except Exception as exc:
            self._fail("exists", lane.name, len(keys), exc)
            return [False] * len(keys)
        hits = sum(present)
        metrics.count(lane.name, "exists", hit=hits, miss=len(keys) - hits)
        return present

    def _read(self, lane: Optional[_Lane], name: str, keys: Sequence[str], host_indices: Any,
              prefix: bool = False) -> List[bool]:
        count = len(keys)
        if count == 0:
            return []
        if lane is None:
            self._fail("read", name, count, "the pool is not registered")
            return [False] * count
        if lane.logical:
            return [True] * count
        start = time.perf_counter()
        try:
            buffers = lane.page_table(host_indices, count)
            found = lane.store.get_ids(key_ids(keys), buffers, prefix=prefix)
        except Exception as exc:
            self._fail("read", name, count, exc)
            return [False] * count
        hits = sum(found)
        metrics.count(name, "read", hit=hits, miss=count - hits)
        metrics.count_bytes(name, "read", hits * lane.page_bytes)
        self._record("prefetch", hits, hits * lane.page_bytes, time.perf_counter() - start)
        return list(found)

    def _write(self, lane: Optional[_Lane], name: str, keys: Sequence[str], host_indices: Any) -> List[bool]:
        count = len(keys)
        if count == 0:
            return []
        if lane is None:
            self._fail("write", name, count, "the pool is not registered")
            return [False] * count
        if lane.logical or (lane.replicated and not _is_storage_writer(self.storage_config)):
            metrics.count(name, "write", skipped=count)
            return [True] * count
        start = time.perf_counter()
        try:
            ids = key_ids(keys)
            buffers = lane.page_table(host_indices, count)
            # Pages found present are skipped and reported stored: asked of the index itself,
            # not the presence cache, which may not yet know another handle removed them.
            present = lane.store.contains_ids(ids, fresh=True)
            missing = [i for i in range(count) if not present[i]]
            if len(missing) < count:
                buffers = buffers.take(missing)
            written = lane.store.put_ids([ids[i] for i in missing], buffers) if missing else []
        except Exception as exc:
            self._fail("write", name, count, exc)
            return [False] * count
        result = [bool(p) for p in present]
        for i, ok in zip(missing, written):
            result[i] = bool(ok)
        stored = sum(written)
        failed = len(missing) - stored
        if failed:
            self._fail("write", name, failed, "the store did not publish every page (see kvtier.tiers.remote logs)")
        metrics.count(name, "write", written=stored, present=count - len(missing))
        metrics.count_bytes(name, "write", stored * lane.page_bytes)
        self._record("backup", stored, stored * lane.page_bytes, time.perf_counter() - start)
        return result

    def _record(self, kind: str, pages: int, nbytes: int, seconds: float) -> None:
        if not pages or not self.storage_config.enable_storage_metrics:
            return
        with self._stats_lock:
            (self._prefetch_pages if kind == "prefetch" else self._backup_pages).append(pages)
            (self._prefetch_gbps if kind == "prefetch" else self._backup_gbps).append(
                nbytes / max(seconds, 1e-9) / 1e9
            )

    def _fail(self, op: str, pool: str, pages: int, cause: Any) -> None:
        """Count ``pages`` failed for ``op`` on ``pool`` and log ``cause`` (an exception or a
        sentence) the first time its kind is seen for that operation and pool."""
        if pages:
            metrics.count(pool, op, failed=pages)
        kind = type(cause).__name__ if isinstance(cause, BaseException) else cause
        with self._warn_lock:
            if (op, pool, kind) in self._warned:
                return
            self._warned.add((op, pool, kind))
        detail = f"{kind}: {cause}" if isinstance(cause, BaseException) else cause
        logger.warning("kvtier: %s on pool %s failed for %d pages: %s (logged once per kind of failure; "
                       "failures are misses or False, counted in kvtier_sglang_pages_total)",
                       op, pool, pages, detail)


def _directory(location: str) -> str:
    """The directory of a ``path`` setting (a path or ``file:///path``)."""
    if location.startswith("file://"):
        from urllib.parse import urlparse
        from urllib.request import url2pathname

        return url2pathname(urlparse(location).path)
    return location
