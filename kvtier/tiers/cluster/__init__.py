"""The cluster tier: pages shared by every host of a fleet through Mooncake Store.

``ClusterStore`` (``store``: object naming, records, breaker, counters) serves as a pool's remote
tier on its own, or behind a local store through ``ChainedStore`` (``chain``); ``client`` is the
Mooncake connection and ``settings`` what configuration says about it. Importing this package
does not import Mooncake; opening a store does.
"""

from kvtier.tiers.cluster.chain import ChainedStore, open_cluster
from kvtier.tiers.cluster.client import INSTALL_HINT, ClusterUnavailable
from kvtier.tiers.cluster.settings import ClusterSettings
from kvtier.tiers.cluster.store import ClusterStore

__all__ = ["ChainedStore", "ClusterSettings", "ClusterStore", "ClusterUnavailable", "INSTALL_HINT", "open_cluster"]
