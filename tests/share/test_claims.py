"""Claims: "this replica is computing these pages". Of several owners claiming a page one
gets it; another owner's live claim ends a claim's run (its deadline is what a waiter
waits for); an owner's own claim is its; an expired claim is taken over; a release drops
only the owner's own. The same rules in both stores: the shared directory's claim files
and the Ray directory actor's table (its class, run here without Ray)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from radixserve.share.dir_store import DirSharedStore
from radixserve.share.keys import ShareScope, entry_key
from radixserve.share.ray_store import ShareDirectory
from radixserve.share.store import Claim

KEYS = [entry_key(ShareScope(b"c" * 16), i.to_bytes(16, "little")) for i in range(40)]


class ActorClaims:
    """The Ray directory actor's claim table, called as RaySharedStore calls it."""

    def __init__(self):
        self.actor = ShareDirectory(1 << 20)
        self.lock = threading.Lock()            # a Ray actor runs one call at a time

    def claim(self, keys, owner, ttl_s):
        with self.lock:
            claimed, left = self.actor.claim(keys, owner, ttl_s)
        return Claim(claimed, None if left is None else time.time() + left)

    def release_claims(self, keys, owner):
        with self.lock:
            self.actor.release_claims(keys, owner)


@pytest.fixture(params=["dir", "ray-actor"])
def store(request, tmp_path):
    return DirSharedStore(tmp_path, 1 << 20) if request.param == "dir" else ActorClaims()


def test_another_owners_live_claim_is_waited_for_and_an_own_claim_is_kept(store):
    assert store.claim(KEYS[:10], "a", 30.0) == Claim(10)
    assert store.claim(KEYS[:10], "a", 30.0) == Claim(10)          # its own already
    held = store.claim(KEYS[:12], "b", 30.0)
    assert held.claimed == 0 and time.time() + 25 < held.held_until < time.time() + 31
    # b's pages after a's: b claims those a does not; a's claim ends a run that starts free.
    assert store.claim(KEYS[10:12], "b", 30.0) == Claim(2)
    assert store.claim(KEYS[8:], "c", 30.0).claimed == 0
    store.release_claims(KEYS[:5], "b")                             # not b's: kept
    assert store.claim(KEYS[:1], "c", 30.0).claimed == 0
    store.release_claims(KEYS[:10], "a")
    assert store.claim(KEYS[:12], "c", 30.0) == Claim(10)           # stops at b's


def test_an_expired_claim_is_taken_over(store):
    assert store.claim(KEYS[:4], "dead", 0.0) == Claim(4)
    assert store.claim(KEYS[:4], "b", 30.0) == Claim(4)
    assert store.claim(KEYS[:4], "c", 30.0).claimed == 0


def test_an_owners_claim_made_again_is_renewed(store):
    """A holder whose prefill progresses claims its pages again (engine/peer_share.py):
    the claim gets the new deadline, so another owner still finds it held, and no
    temporary file of the renewal is left behind."""
    assert store.claim(KEYS[:3], "a", 0.0) == Claim(3)             # as good as expired
    assert store.claim(KEYS[:3], "a", 30.0) == Claim(3)            # renewed
    held = store.claim(KEYS[:3], "b", 30.0)
    assert held.claimed == 0 and held.held_until > time.time() + 25
    if isinstance(store, DirSharedStore):
        assert sorted(p.name for p in store.root.iterdir()) == \
            sorted(f"{k.hex()}.claim" for k in KEYS[:3])


def test_of_owners_claiming_at_once_each_page_gets_exactly_one(store):
    """Eight owners claim the same 40 pages at once: their claimed runs never overlap."""
    runs: dict[str, int] = {}
    start = threading.Barrier(8)

    def claim(owner, offset):
        start.wait()
        keys = KEYS[offset:] + KEYS[:offset]
        runs[owner] = (offset, store.claim(keys, owner, 30.0).claimed)

    threads = [threading.Thread(target=claim, args=(f"o{i}", 5 * i)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    owned = [k for offset, n in runs.values() for k in (KEYS[offset:] + KEYS[:offset])[:n]]
    assert len(owned) == len(set(owned)) <= len(KEYS)
    assert sum(n for _, n in runs.values()) >= 1    # the first to claim its start holds it


def test_a_dead_claimers_claim_files_and_stale_temporary_files_are_swept(tmp_path):
    """Claims past their deadline and old temporary files (a killed publisher's) go when a
    store opens; live claims and a publish in progress stay."""
    from radixserve.share import dir_store

    store = DirSharedStore(tmp_path, 1 << 20)
    assert store.claim(KEYS[:4], "dead", 0.0) == Claim(4)
    assert store.claim(KEYS[10:12], "live", 30.0) == Claim(2)
    stale, fresh = (tmp_path / f"{KEYS[20].hex()}{dir_store.TMP_MARK}{n}" for n in "ab")
    stale.write_bytes(b"half a page")
    fresh.write_bytes(b"being written")
    old = time.time() - dir_store.STALE_TMP_S - 60
    os.utime(stale, (old, old))
    DirSharedStore(tmp_path, 1 << 20)                  # another replica starts
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {f"{k.hex()}.claim" for k in KEYS[10:12]} | {fresh.name}
    assert store.claim(KEYS[10:12], "c", 30.0).claimed == 0        # still live


def test_the_directory_actor_sweeps_expired_claims_as_its_table_grows(monkeypatch):
    from radixserve.share import ray_store

    monkeypatch.setattr(ray_store, "CLAIMS_SWEPT_FROM", 8)
    actor = ray_store.ShareDirectory(1 << 20)
    assert actor.claim(KEYS[:6], "dead", 0.0) == (6, None)
    assert actor.claim(KEYS[6:8], "live", 30.0) == (2, None)
    assert actor.claim(KEYS[8:9], "b", 30.0) == (1, None)   # table at 8: swept first
    assert set(actor.claims) == set(KEYS[6:9])
