"""kvtier: a hierarchical KV-cache page store (device -> pinned host -> remote) for LLM inference."""

from kvtier.format import PageFormat, dequantize, quantize
from kvtier.index import Namespace, PageState, key_id, key_ids, prefix_keys
from kvtier.pool import LoadHandle, MatchResult, PoolExhausted, TieredPool

__all__ = [
    "LoadHandle",
    "MatchResult",
    "Namespace",
    "PageFormat",
    "PageState",
    "PoolExhausted",
    "TieredPool",
    "dequantize",
    "key_id",
    "key_ids",
    "prefix_keys",
    "quantize",
]
__version__ = "0.1.0"
