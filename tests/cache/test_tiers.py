"""Tiers by hand: a prefix demoted down the tiers comes back, a corrupt disk page is a miss."""

from __future__ import annotations

from radixserve.cache import PagedMemory, RadixCache
from radixserve.cache.prefix_lease import PrefixLease
from radixserve.cache.tiers import DISK, HOST, DemoteOrder, LoadOrder, LowerTiers

from .test_tiers_stateful import FakeDisk


def tiered(num_pages=8, host=4, disk=8, ps=2):
    tree = RadixCache(ps)
    store = FakeDisk()
    tiers = LowerTiers(tree, num_pages, host, disk, store if disk else None, page_bytes=16)
    return tree, PagedMemory(num_pages, tree), tiers, store


def cache(mem, tokens):
    lease = PrefixLease(mem)
    lease.acquire(tokens)
    lease.grow(len(tokens) // mem.page_size - len(lease.pages))
    lease.release(tokens, len(tokens))


def run(tiers, store):
    """The runner's part for the disk: write what is demoted there (payload = the ids)."""
    for mv in tiers.take_moves():
        if isinstance(mv, DemoteOrder) and mv.dst_tier == DISK:
            for key in mv.dst.tolist():
                store.write_page(key, key.to_bytes(8, "little"))
    tiers.moves_done()


def test_a_prefix_goes_down_to_host_then_disk_and_matches_in_every_tier():
    tree, mem, tiers, store = tiered()
    a = list(range(8))                       # 4 pages of 2
    cache(mem, a)
    mem.free(tree.evict(8))                  # all of it to host (4 slots)
    m = tree.match_prefix(a + [99])
    assert m.matched_tokens == 0 and m.lower_tokens(HOST) == 8
    cache(mem, [50 + t for t in range(8)])   # fills the pool again
    mem.free(tree.evict(8))                  # host is full: `a` goes on to disk
    run(tiers, store)
    m = tree.match_prefix(a + [99])
    assert m.lower_tokens(DISK) == 8 and m.lower_tokens(HOST) == 0
    lease = PrefixLease(mem)
    m = lease.acquire(a + [99])
    assert lease.load(m) == 8 and lease.matched_tokens == 8
    loads = [mv for mv in tiers.take_moves() if isinstance(mv, LoadOrder)]
    assert [mv.src_tier for mv in loads] == [DISK] and sum(len(mv.payloads) for mv in loads) == 4
    assert tiers.counters[DISK].loaded_tokens == 8
    lease.release()
    tree.check_invariants()
    mem.check_conservation()


def test_a_corrupt_disk_page_ends_the_load_and_the_rest_is_dropped():
    tree, mem, tiers, store = tiered(host=0)
    a = list(range(8))
    cache(mem, a)
    mem.free(tree.evict(8))
    run(tiers, store)
    node = tree.match_prefix(a).lower[0]
    third = int(node.pages[2]) - tiers.offset[DISK]
    crc, payload = store.pages[third]
    store.pages[third] = (crc, b"x" + payload[1:])      # flip the third page's first byte
    lease = PrefixLease(mem)
    m = lease.acquire(a + [99])
    assert lease.load(m) == 4                # pages 1 and 2 load; 3 and 4 are recomputed
    assert tiers.counters.corrupt_pages == 1 and store.corrupt == 1
    assert tiers.counters[DISK].dropped_tokens == 4
    assert tree.peek_prefix(a + [99]) == 4
    lease.release()
    tree.check_invariants()
    mem.check_conservation()



def test_lent_disk_slots_make_room_from_disk_victims_and_are_counted():
    """The saver's copies share the disk tier's slots: lending drops disk leaves (policy
    order) when the tier is full, gives fewer when nothing more can go, and the slots are
    counted as held until returned."""
    tree, mem, tiers, store = tiered(host=0, disk=4)
    a = list(range(8))                       # 4 pages of 2: fills the disk tier
    cache(mem, a)
    mem.free(tree.evict(8))
    run(tiers, store)
    assert tiers.used_pages(DISK) == 4 and tiers.tokens(DISK) == 8
    lent = tiers.lend_disk_slots(3)          # the disk leaf (one node of 4 pages) goes
    assert len(lent) == 3 and tiers.used_pages(DISK) == 3 and tiers.tokens(DISK) == 0
    assert tiers.counters[DISK].dropped_tokens == 8
    tree.check_invariants()
    assert len(tiers.lend_disk_slots(5)) == 1   # only one slot left: the rest is lent
    tree.check_invariants()
    tiers.return_disk_slots(lent.tolist())
    assert tiers.used_pages(DISK) == 1
    tree.check_invariants()
    mem.check_conservation()


def test_a_restored_disk_node_is_matched_and_loaded():
    tree, mem, tiers, store = tiered(host=0, disk=4)
    root = tiers.restore_disk_node(None, [1, 2, 3, 4], None, last_access=7)
    child = tiers.restore_disk_node(root, [5, 6], None, last_access=7)
    assert tiers.restore_disk_node(root, [5, 6], None, last_access=7) is None   # present
    assert tiers.restore_disk_node(None, list(range(10, 20)), None, 7) is None  # no room
    for key in tiers.local(DISK, root.pages).tolist() + tiers.local(DISK, child.pages).tolist():
        store.write_page(key, key.to_bytes(8, "little"))
    tree.check_invariants()
    assert tree.total_tokens == 0 and mem.num_free == 8
    lease = PrefixLease(mem)
    m = lease.acquire([1, 2, 3, 4, 5, 6, 7])
    assert m.lower_tokens(DISK) == 6
    assert lease.load(m) == 6 and lease.matched_tokens == 6
    lease.release()
    tree.check_invariants()
    mem.check_conservation()


def test_the_tier_queue_reads_victims_in_the_order_a_sort_of_the_tier_gives():
    """LowerTiers keeps each tier's nodes in a heap (cache/tier_queue.py) instead of
    sorting the tier each time it makes room: its victims must be those a sort of the
    tier's nodes that may leave gives, in that order, after touches and splits."""
    tree, mem, tiers, store = tiered(num_pages=8, host=0, disk=64)
    prompts = [[p * 100 + t for t in range(6)] for p in range(6)]
    for p in prompts:                               # branches sharing nothing
        cache(mem, p)
        cache(mem, p + [p[0] + 50, p[0] + 51])      # a child below each: not a victim
    mem.free(tree.evict(tree.evictable_tokens))    # the rest of the pool goes down too
    run(tiers, store)
    for p in prompts[::2]:                          # touch some leaves, split some edges
        tree.match_prefix(p + [p[0] + 50, p[0] + 51, 7])
    for p in prompts[1::2]:
        tree.match_prefix(p[:4] + [7])
    run(tiers, store)

    def by_sort():
        may_go = [n for n in tiers.nodes[DISK].values() if n.lock_ref == 0
                  and not tiers._pending(n) and all(c.tier > DISK for c in n.children.values())]
        return sorted(may_go, key=lambda n: (tree.policy.key(n), n.id))

    assert len(tiers.nodes[DISK]) >= 6 and len(by_sort()) >= 4, len(by_sort())
    assert list(tiers._victims(DISK)) == by_sort()
    tiers.check()                                   # every node queued again, keys current
    victims = tiers._victims(DISK)
    first = next(victims)
    tiers._push_down(first)                         # dropped: its parent waits a pass
    rest = list(victims)
    assert first.parent is None or first.parent not in rest
    tree.check_invariants()
    assert list(tiers._victims(DISK)) == by_sort()
