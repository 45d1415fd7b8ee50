"""The one lookup thread per engine (engine/peer_lookup.py): a store call that does not
return holds that thread, and every lookup queued behind it. Such a lookup is not waited
for once the one being answered is past its compute time (the store counts as stuck),
whatever its own deadline; a waiting poll's deadline is the whole wait, so before this
it stayed pending until then. The clock is controlled: the stuck lookup's `stuck_at` is
moved into the past, and the store call is held by an event."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from radixserve.cache.tiers import ReadPending
from radixserve.engine.peer_lookup import ShareTicket
from radixserve.engine.peer_share import PeerShare
from radixserve.share.dir_store import DirSharedStore
from radixserve.share.keys import ShareScope, entry_key

SCOPE = ShareScope(b"q" * 16)
FIRST = tuple(entry_key(SCOPE, bytes([1, i]) * 8) for i in range(4))
SECOND = tuple(entry_key(SCOPE, bytes([2, i]) * 8) for i in range(4))


class HeldStore(DirSharedStore):
    """`published` of FIRST blocks until `gate` opens (a hung NFS mount, say)."""

    def __init__(self, root):
        super().__init__(root, 1 << 20)
        self.entered, self.gate = threading.Event(), threading.Event()

    def published(self, keys):
        if tuple(keys) == FIRST:
            self.entered.set()
            self.gate.wait()
        return super().published(keys)


def test_a_lookup_queued_behind_a_stuck_one_is_late_at_once(tmp_path):
    store = HeldStore(tmp_path)
    peers = PeerShare(store, SCOPE, 16, lookup_min_s=600.0)    # deadlines: not the clock
    first, second = ShareTicket(), ShareTicket()
    try:
        with pytest.raises(ReadPending):
            peers._ask(first, FIRST, 0)
        assert store.entered.wait(60)                       # the thread is in the store
        with pytest.raises(ReadPending):                    # a poll of a wait on a peer:
            peers._ask(second, SECOND, 0, wait_left_s=3600.0)   # its deadline, an hour
        waiting = SimpleNamespace(share=second)
        assert peers.pending(waiting)                       # the first is not stuck yet
        first.lookup.stuck_at = time.monotonic() - 1.0      # now it is
        assert peers.lookups.stuck() and not second.lookup.overdue
        assert not peers.pending(waiting)                   # not waited for: admitted ...
        assert peers.pending(SimpleNamespace(share=first))  # (the stuck one's own deadline)
        assert peers._late(second) == 0 and second.missed   # ... and computed, as load does
        assert second.lookup is None
        store.gate.set()                                    # the store comes back
        assert peers.lookups.drain(60)
        assert first.lookup.done and first.lookup.claim.claimed == len(FIRST)
        peers.retire(SimpleNamespace(share=first))          # its sequence ends
    finally:
        store.gate.set()
        peers.close()
    assert peers.stats().lookups_late == 1
    assert not list(tmp_path.glob("*.claim"))   # the first's released; the second's none
