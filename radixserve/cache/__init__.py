"""The prefix cache: page allocator, radix tree, eviction policies, the two together
(PagedMemory), one request's hold on pages (PrefixLease) and the host/disk tiers below the
KV pool (LowerTiers).

Imports neither torch nor kv_pool: the offline replay tool uses this package without a model.
"""

from .eviction import POLICIES, EvictionPolicy, GDSFPolicy, LFUPolicy, LRUPolicy, make_policy
from .memory import PagedMemory
from .page_allocator import OutOfPages, PageAccountingError, PageAllocator
from .prefix_lease import CopyOrder, PrefixLease
from .radix_cache import EMPTY_PAGES, CacheLockedError, InsertResult, MatchResult, RadixCache
from .tier_types import Move, Tier, TierHooks
from .tiers import DemoteOrder, LoadOrder, LowerTiers
from .tree_node import TreeNode

__all__ = [
    "CacheLockedError", "CopyOrder", "DemoteOrder", "EMPTY_PAGES", "LoadOrder", "LowerTiers", "EvictionPolicy", "GDSFPolicy", "InsertResult",
    "Move", "Tier", "TierHooks",
    "LFUPolicy", "LRUPolicy", "MatchResult", "OutOfPages", "POLICIES", "PageAccountingError",
    "PageAllocator", "PagedMemory", "PrefixLease", "RadixCache", "TreeNode", "make_policy",
]
