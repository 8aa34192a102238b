"""Deciding, not moving: keys, page states, per-tier page tables, eviction and write policies."""

from kvtier.index.eviction import EvictionPolicy, LRUPolicy, make_policy
from kvtier.index.keys import Namespace, prefix_keys
from kvtier.index.states import IllegalTransition, PageState
from kvtier.index.tier_index import TierIndex
from kvtier.index.write_policy import WRITE_POLICIES, WritePolicy

__all__ = [
    "EvictionPolicy",
    "IllegalTransition",
    "LRUPolicy",
    "Namespace",
    "PageState",
    "TierIndex",
    "WRITE_POLICIES",
    "WritePolicy",
    "make_policy",
    "prefix_keys",
]
