"""kvtier: a hierarchical KV-cache page store (device -> pinned host -> remote) for LLM inference."""

from kvtier.errors import DeviceError, SettingError, TierSizeError
from kvtier.format import PageFormat, dequantize, quantize
from kvtier.index import Namespace, PageState, key_id, key_ids, prefix_keys
from kvtier.log import apply_log_level
from kvtier.pool import LoadHandle, MatchResult, PoolExhausted, TieredPool

__all__ = [
    "DeviceError",
    "LoadHandle",
    "MatchResult",
    "Namespace",
    "PageFormat",
    "PageState",
    "PoolExhausted",
    "SettingError",
    "TierSizeError",
    "TieredPool",
    "dequantize",
    "key_id",
    "key_ids",
    "prefix_keys",
    "quantize",
]
__version__ = "0.1.0"

apply_log_level()
