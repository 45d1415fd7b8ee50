"""The prefix cache: page allocator, radix tree, eviction policies, and the two together.

Imports neither torch nor kv_pool: the offline replay tool uses this package without a model.
"""

from .eviction import POLICIES, EvictionPolicy, GDSFPolicy, LFUPolicy, LRUPolicy, make_policy
from .memory import PagedMemory
from .page_allocator import OutOfPages, PageAccountingError, PageAllocator
from .radix_cache import EMPTY_PAGES, CacheLockedError, InsertResult, MatchResult, RadixCache
from .tree_node import TreeNode

__all__ = [
    "CacheLockedError", "EMPTY_PAGES", "EvictionPolicy", "GDSFPolicy", "InsertResult",
    "LFUPolicy", "LRUPolicy", "MatchResult", "OutOfPages", "POLICIES", "PageAccountingError",
    "PageAllocator", "PagedMemory", "RadixCache", "TreeNode", "make_policy",
]
