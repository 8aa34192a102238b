"""The SGLang harness (``make test-sglang``): sglang 0.5.23's own classes on the CPU.

Without sglang these tests skip, except under ``KVTIER_REQUIRE_SGLANG=1`` (set by
``make test-sglang``), where a missing sglang or NIXL is a collection error.
"""

from __future__ import annotations

import os

if os.environ.get("KVTIER_REQUIRE_SGLANG"):
    import nixl_cu13  # noqa: F401
    import sglang.srt.mem_cache.hicache_storage  # noqa: F401
