"""The keys of ``--hicache-storage-backend-extra-config`` that the kvtier backend reads.

Owns parsing and checking that dictionary into ``BackendSettings``. It runs twice: in the
launcher, when the plugin rewrites ``--hicache-storage-backend kvtier`` (so a bad key stops the
server before any process starts), and in each scheduler when SGLang constructs the backend.
It must never open the store or touch SGLang's pools; an unknown key or a wrong type raises
``ValueError`` naming the key and what was expected.

Keys SGLang itself leaves in the dictionary when it reaches a ``dynamic`` backend (sglang
0.5.23, paths under ``sglang/srt/``): ``backend_name``, ``module_path``, ``class_name``
(``mem_cache/storage/backend_factory.py:142``), ``interface_v1``
(``managers/cache_controller.py:664``) and ``allocator`` (``mem_cache/pool_host/common.py:131``).
``tp_lcm_size`` and the prefetch keys are popped before the backend sees the dictionary
(``managers/cache_controller.py:777``, ``mem_cache/hybrid_cache/hybrid_cache_controller.py:404``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "allocator"})
NIXL_BACKENDS = ("POSIX", "GDS", "GDS_MT", "OBJ")
_KVTIER_KEYS = ("path", "capacity_gb", "nixl_backend", "nixl_backend_params", "timeout_s", "namespace_tag")


@dataclass(frozen=True)
class BackendSettings:
    """What the extra config asks of kvtier.

    - ``path``: the store directory (or ``file:///dir``), shared by every process that should
      share pages; required.
    - ``capacity_gb``: bound on the page bytes the whole directory holds (LRU eviction past it);
      ``None`` for unbounded.
    - ``nixl_backend`` / ``nixl_backend_params``: the NIXL storage backend and its parameters.
    - ``timeout_s``: per NIXL request; a request past it fails its pages (misses / False).
    - ``namespace_tag``: a free string folded into every namespace, for deployments that reuse
      a model name for other weights.
    """

    path: str
    capacity_gb: Optional[float] = None
    nixl_backend: str = "POSIX"
    nixl_backend_params: Mapping[str, str] = field(default_factory=dict)
    timeout_s: float = 30.0
    namespace_tag: Optional[str] = None

    @property
    def capacity_bytes(self) -> Optional[int]:
        return None if self.capacity_gb is None else int(self.capacity_gb * (1 << 30))

    @classmethod
    def from_extra_config(cls, extra: Optional[Mapping[str, Any]]) -> "BackendSettings":
        """Check ``extra`` (SGLang's parsed extra config) and return kvtier's part of it."""
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise ValueError(
                f"--hicache-storage-backend-extra-config must be a JSON object, got {type(extra).__name__}"
            )
        known = SGLANG_KEYS | set(_KVTIER_KEYS)
        for key in extra:
            if key not in known:
                raise ValueError(
                    f"unknown key {key!r} in --hicache-storage-backend-extra-config for kvtier; "
                    f"expected one of {sorted(known)}"
                )
        if not extra.get("interface_v1"):
            raise ValueError(
                f"kvtier needs \"interface_v1\": 1 in --hicache-storage-backend-extra-config "
                f"(got {extra.get('interface_v1')!r}): without it SGLang copies every page through "
                "its generic path instead of handing kvtier the host pool's memory"
            )
        path = extra.get("path")
        if not isinstance(path, str) or not path:
            raise ValueError(
                f"kvtier needs \"path\" (the store directory) in --hicache-storage-backend-extra-config, "
                f"got {path!r}"
            )
        capacity = extra.get("capacity_gb")
        if capacity is not None and (
            isinstance(capacity, bool) or not isinstance(capacity, (int, float))
            or not math.isfinite(capacity) or capacity <= 0
        ):
            raise ValueError(f"\"capacity_gb\" must be a number > 0 or absent, got {capacity!r}")
        backend = extra.get("nixl_backend", "POSIX")
        if backend not in NIXL_BACKENDS:
            raise ValueError(f"\"nixl_backend\" must be one of {NIXL_BACKENDS}, got {backend!r}")
        params = extra.get("nixl_backend_params", {})
        if not isinstance(params, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in params.items()
        ):
            raise ValueError(
                f"\"nixl_backend_params\" must be an object of string values, got {params!r}"
            )
        timeout = extra.get("timeout_s", 30.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"\"timeout_s\" must be a number > 0, got {timeout!r}")
        tag = extra.get("namespace_tag")
        if tag is not None and not isinstance(tag, str):
            raise ValueError(f"\"namespace_tag\" must be a string or absent, got {tag!r}")
        return cls(
            path=path,
            capacity_gb=None if capacity is None else float(capacity),
            nixl_backend=backend,
            nixl_backend_params=dict(params),
            timeout_s=float(timeout),
            namespace_tag=tag,
        )

