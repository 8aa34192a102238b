"""Deciding, not moving: keys, page states, per-tier page tables, eviction and write policies."""

from kvtier.index.eviction import EvictionPolicy, LRUPolicy, make_policy
from kvtier.index.key_table import KeyTable
from kvtier.index.keys import KEY_SCHEME, Namespace, key_id, key_ids, prefix_keys
from kvtier.index.slot_list import SlotList
from kvtier.index.states import IllegalTransition, PageState
from kvtier.index.tier_index import TierIndex
from kvtier.index.write_policy import WRITE_POLICIES, WritePolicy

__all__ = [
    "KEY_SCHEME",
    "EvictionPolicy",
    "IllegalTransition",
    "KeyTable",
    "LRUPolicy",
    "Namespace",
    "PageState",
    "SlotList",
    "TierIndex",
    "WRITE_POLICIES",
    "WritePolicy",
    "key_id",
    "key_ids",
    "make_policy",
    "prefix_keys",
]
