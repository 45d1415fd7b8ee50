"""SavedWindows: a hybrid model's sliding-window KV carried across a restart.

A page file holds the full-attention layers' KV only (the pool the tree's page ids name).
The sliding-window layers' KV of a page lives in the windowed pool, attached to the page's
id (cache/window_pages.py), and only where a match point needs it. Without it a restored
path is matched but backs off to 0 (its windows are missing). So wherever a page file is
written -- by the disk tier (a demotion, journaled: a `kill -9` keeps it) or by a save --
its window, when it has one, is written beside it as one more file under the same rules
(storage/tier_pages.py; `copy_out` gives a save the bytes), named by the page's journal
record and index entry (`IndexNode.window_keys`). A restart reads them back into the
windowed pool, attached to the restored disk-tier nodes' ids: a load then brings the node
into the pool with its windows, and the match ends where it did before the restart.

What is not carried: windows that do not fit the windowed pool at the restore (the most
recently used nodes' come first; the others stay on disk, unread), and a window attached
to a page after its file was written. Their matches back off to the last point whose
window is present, as before (docs/tiers.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from radixserve.attention.page_bytes import bytes_to_pages, pages_to_bytes
from radixserve.attention.window_kv import WindowedKV
from radixserve.cache.window_memory import WindowedMemory
from radixserve.storage import DiskPageStore

__all__ = ["SavedWindows", "RestoredWindow"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestoredWindow:
    """A restored disk-tier page whose window was saved."""
    tree_id: int            # its id in the tree (a disk-tier id)
    key: int                # the window's page file
    last_access: int        # its node's recency: the most recent go first


class SavedWindows:
    def __init__(self, memory: WindowedMemory, kv: WindowedKV, store: DiskPageStore):
        self.memory = memory
        self.kv = kv
        self.store = store

    # -- save ---------------------------------------------------------------------------

    def copy_out(self, tree_ids: np.ndarray) -> list[bytes | None]:
        """The window of each tree id (a pool page or a lower-tier slot) as bytes, None
        where it has none (compute thread, step lock held: no step rewrites a window
        between this copy and the walk that named the ids)."""
        windows = self.memory.windows.window_of(tree_ids)
        held = np.flatnonzero(windows != self.memory.windows.null)
        out: list[bytes | None] = [None] * len(windows)
        for i, payload in zip(held.tolist(), pages_to_bytes(self.kv.pool, windows[held].tolist())):
            out[i] = payload
        return out

    # -- restore ------------------------------------------------------------------------

    def read(self, found: list[RestoredWindow]) -> tuple[list[int], list[bytes]]:
        """(tree ids, payloads) of the windows to restore: the most recently used that fit
        the windowed pool's free pages, each checked by the store (a corrupt or missing
        file is skipped). Worker thread."""
        room = self.memory.windows.num_free
        chosen = sorted(found, key=lambda w: w.last_access)[-room:] if room else []
        ids, payloads = [], []
        for w in chosen:
            payload = self.store.read_page(w.key)
            if payload is not None:
                ids.append(w.tree_id)
                payloads.append(payload)
        return ids, payloads

    def place(self, ids: list[int], payloads: list[bytes]) -> int:
        """Attach a windowed page to each restored id and write its window there (compute
        thread, before any request); -> how many. Least recent first, so the windowed
        pool's room-making drops those first (WindowedMemory._window_room)."""
        if not ids:
            return 0
        pages = self.memory.windows.attach_lower(ids)
        try:
            bytes_to_pages(self.kv.pool, pages.tolist(), payloads)
        except ValueError as e:            # another KV layout wrote them
            log.warning("KV disk store %s: saved windows not restored: %s",
                        self.store.directory, e)
            self.memory.windows.detach(np.asarray(ids, dtype=np.int64))
            return 0
        return len(ids)
