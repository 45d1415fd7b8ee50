"""The KV cache's disk tier (L3): checked page files and the tree's index, crash-safe.

Torch-free (a test checks): pages are bytes here; the engine turns KV pool pages into bytes
and back. See docs/tiers.md for what is on disk and what happens on corruption and crash.
"""

from .disk_store import DiskPageStore, DiskStoreFull, StoreRefused
from .fingerprint import ModelFingerprint, model_fingerprint
from .store_index import INDEX_VERSION, IndexNode, StoreIndex
from .tier_pages import TierPages

__all__ = ["DiskPageStore", "DiskStoreFull", "StoreRefused", "ModelFingerprint",
           "model_fingerprint", "IndexNode", "StoreIndex", "INDEX_VERSION", "TierPages"]
