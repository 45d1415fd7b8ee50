"""The Ray store: pages `ray.put` by their publisher and listed by one directory actor.
One small local Ray cluster for the module (its start is the slow part). Faults: a dead
publisher's pages are forgotten and never read; a page under the wrong key is refused; a
restarted directory forgets everything and sharing resumes; a second publish of a page is a
duplicate and the first copy serves both."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

try:
    import ray
except ImportError as exc:        # like the model fixtures: fail with the command that fixes it
    raise ImportError("the Ray tests need the ray extra: pip install -e '.[dev,ray]'") from exc

from radixserve.share.framing import frame                      # noqa: E402
from radixserve.share.keys import ShareScope, entry_key         # noqa: E402
from radixserve.share.ray_store import RaySharedStore, directory_actor  # noqa: E402

pytestmark = pytest.mark.timeout(600)
HANG = 120.0
SCOPE = ShareScope(b"r" * 16)


def keys(n: int, start: int = 0) -> list[bytes]:
    return [entry_key(SCOPE, i.to_bytes(16, "little")) for i in range(start, start + n)]


def page(i: int) -> bytes:
    return bytes([i % 251]) * 1024


@pytest.fixture(scope="module")
def actor():
    here = Path(__file__).resolve().parent       # workers import this module (Replica)
    path = os.pathsep.join([str(here), str(here.parents[1]), os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=2, include_dashboard=False, namespace="radixserve-share-test",
             log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    try:
        yield directory_actor(capacity_bytes=64 * 1100)
    finally:
        ray.shutdown()


def open_store(actor, owner: str) -> RaySharedStore:
    """A replica's store on the test's directory actor; its calls' deadline is HANG, so a
    busy machine's slow call is not taken for a missing or lost page."""
    return RaySharedStore(0, owner, actor=actor, call_timeout_s=HANG)


@ray.remote(num_cpus=0)
class Replica:
    """A publisher in its own process: it owns the objects it puts."""

    def __init__(self, owner: str):
        self.store = RaySharedStore(64 * 1100, owner, call_timeout_s=HANG)

    def publish(self, ks: list[bytes], start: int) -> int:
        return sum(self.store.publish(k, page(start + i)) for i, k in enumerate(ks))

    def pid(self) -> int:
        import os
        return os.getpid()


def test_pages_published_by_one_replica_are_fetched_by_another(actor):
    a, b = open_store(actor, "a"), open_store(actor, "b")
    ks = keys(4)
    assert [a.publish(k, page(i)) for i, k in enumerate(ks[:3])] == [True] * 3
    assert not b.publish(ks[0], page(0))         # one copy wins; b's is not kept
    assert b.published(ks) == 3
    got = b.fetch(ks)
    assert got.payloads == [page(0), page(1), page(2)] and got.refused == got.lost == 0
    assert b.counters.duplicate_pages == 1 and a.counters.published_pages == 3
    # The publisher thread's batch: only the missing page is put and registered.
    assert b.publish_many(ks, [page(i) for i in range(4)]) == 1
    assert b.counters.duplicate_pages == 4 and a.fetch(ks).payloads == [page(i) for i in range(4)]


def test_a_page_under_another_key_is_refused_and_forgotten(actor):
    store = open_store(actor, "c")
    ks = keys(2, start=100)
    store.publish(ks[0], page(0))
    wrong = ray.put(frame(keys(1, start=999)[0], page(1)))     # framed for another key
    ray.get(actor.publish.remote(ks[1], [wrong], "c", 1064))
    got = store.fetch(ks)
    assert got.payloads == [page(0)] and got.refused == 1
    assert store.published(ks) == 1                 # the bad entry is gone


def test_a_dead_publishers_pages_are_forgotten_never_read(actor):
    ks = keys(3, start=200)
    replica = Replica.remote("dead-one")
    assert ray.get(replica.publish.remote(ks, 0), timeout=HANG) == 3
    reader = open_store(actor, "reader")
    assert reader.published(ks) == 3
    ray.kill(replica)
    deadline = time.monotonic() + HANG
    while (got := reader.fetch(ks)).payloads:       # until Ray reports the owner gone
        assert got.payloads == [page(i) for i in range(len(got.payloads))]
        assert time.monotonic() < deadline, "a dead owner's objects stayed readable"
    # the fetch that ends the loop either saw an object lost, or the directory had already
    # forgotten the owner (it learned of the death first): a race, both correct
    assert got.refused == 0
    assert reader.published(ks) == 0                # every page of that owner forgotten


def test_a_restarted_directory_forgets_and_sharing_resumes(actor):
    store = open_store(actor, "d")
    ks = keys(2, start=300)
    store.publish(ks[0], page(0))
    ray.kill(actor, no_restart=False)               # Ray restarts it, empty
    deadline = time.monotonic() + HANG
    while store.published(ks[:1]):                  # the old actor answered, or none did
        assert time.monotonic() < deadline
    assert store.fetch(ks).payloads == []           # nothing wrong is served meanwhile
    while not store.publish(ks[0], page(0)):        # a miss while it restarts
        assert time.monotonic() < deadline
    assert store.fetch(ks[:1]).payloads == [page(0)]


def test_the_directory_is_bounded(actor):
    store = open_store(actor, "e")
    ks = keys(100, start=1000)
    store.publish_many(ks, [page(i) for i in range(100)])      # one batch: two actor calls
    size = ray.get(actor.size.remote())
    assert size["used_bytes"] <= 64 * 1100 and size["evicted"] > 0
    assert store.published(ks[-5:]) == 5 and store.published(ks[:1]) == 0


def test_claims_go_through_the_directory_actor(actor):
    """Two replicas claim the same pages: one holds them, the other is told how long; a
    release lets the other claim them."""
    a, b = (open_store(actor, owner) for owner in ("claim-a", "claim-b"))
    ks = keys(3, start=2000)
    assert a.claim(ks, "claim-a", 30.0).claimed == 3
    held = b.claim(ks, "claim-b", 30.0)
    assert held.claimed == 0 and time.time() < held.held_until <= time.time() + 30
    a.release_claims(ks, "claim-a")
    assert b.claim(ks, "claim-b", 30.0).claimed == 3
