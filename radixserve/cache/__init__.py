"""The prefix cache: page allocator, radix tree, eviction policies, the two together
(PagedMemory) and one request's hold on pages (PrefixLease).

Imports neither torch nor kv_pool: the offline replay tool uses this package without a model.
"""

from .eviction import POLICIES, EvictionPolicy, GDSFPolicy, LFUPolicy, LRUPolicy, make_policy
from .memory import PagedMemory
from .page_allocator import OutOfPages, PageAccountingError, PageAllocator
from .prefix_lease import CopyOrder, PrefixLease
from .radix_cache import EMPTY_PAGES, CacheLockedError, InsertResult, MatchResult, RadixCache
from .tree_node import TreeNode

__all__ = [
    "CacheLockedError", "CopyOrder", "EMPTY_PAGES", "EvictionPolicy", "GDSFPolicy", "InsertResult",
    "LFUPolicy", "LRUPolicy", "MatchResult", "OutOfPages", "POLICIES", "PageAccountingError",
    "PageAllocator", "PagedMemory", "PrefixLease", "RadixCache", "TreeNode", "make_policy",
]
