"""kvtier as SGLang's HiCache storage backend (``--hicache-storage-backend kvtier``).

Modules:
- ``backend``: ``KvtierHiCacheStorage``, the ``HiCacheStorage`` subclass SGLang's ``dynamic``
  factory constructs; pages move zero-copy between SGLang's host pools and kvtier's remote store.
- ``plugin``: the ``sglang.srt.plugins`` entry point that makes SGLang accept
  ``--hicache-storage-backend kvtier`` and records each model runner's KV format.
- ``namespace``: where a page is valid (model, KV dtype and scales, host layout, geometry, ranks).
- ``settings``: the keys of ``--hicache-storage-backend-extra-config`` kvtier reads.
- ``metrics``: ``kvtier_sglang_*`` Prometheus counters beside SGLang's own.

Importing this package must never import SGLang; ``backend`` and ``plugin`` do, when imported.
"""

BACKEND_MODULE = "kvtier.adapters.sglang.backend"
BACKEND_CLASS = "KvtierHiCacheStorage"
BACKEND_NAME = "kvtier"
