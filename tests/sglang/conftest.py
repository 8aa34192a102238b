"""The SGLang harness (``make test-sglang``): sglang 0.5.23's own classes on the CPU.

Without sglang these tests skip, except under ``KVTIER_REQUIRE_SGLANG=1`` (set by
``make test-sglang``), where a missing sglang or NIXL is a collection error.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("KVTIER_REQUIRE_SGLANG"):
    import nixl_cu13  # noqa: F401
    import sglang.srt.mem_cache.hicache_storage  # noqa: F401


@pytest.fixture(autouse=True)
def bf16_model_runners():
    """Each test starts as a process whose target and draft model runners recorded a bf16 KV
    cache; fp8 tests record their own format on top."""
    import torch

    from kvtier.adapters.sglang.namespace import record_kv_format

    for role in ("target", "draft"):
        record_kv_format(role, torch.nn.Module(), torch.bfloat16)
