"""KV pages shared between replicas: the cluster store below host memory and disk.

A replica publishes the pages of a prompt it computed; another replica that misses the
same prefix loads them instead of computing them again (`--kv-share ray|dir:PATH|off`,
docs/scale-out.md). This package is the store side, with no torch and no engine: what a
shared page is called (`keys.py`), how its bytes are framed and checked (`framing.py`),
the `SharedStore` protocol (`store.py`) and its two implementations, a shared directory
(`dir_store.py`) and Ray's object store with a directory actor (`ray_store.py`). The
engine side (when to publish, when loading beats computing) is engine/peer_share.py.
"""

from .keys import ShareScope, entry_key
from .store import Fetched, SharedStore, ShareCounters, open_shared_store

__all__ = ["Fetched", "ShareCounters", "ShareScope", "SharedStore", "entry_key",
           "open_shared_store"]
