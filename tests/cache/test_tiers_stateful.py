"""The tiered tree (pool, host, disk in one RadixCache) against a brute-force model.

Random requests (match, lock, load from host/disk or recompute, grow with eviction that
demotes, insert, keep or release), explicit evictions, steps that run the queued moves,
corrupted disk pages, flushes and restarts from the index (save into lent disk slots,
rebuild as disk nodes), at page sizes 1 and 16. Three simulated stores (one row
of token ids per pool page and per host slot; a dict of checksummed bytes for the disk)
execute every DemoteOrder / LoadOrder in issue order, as the engine's runner does, so a
wrong order, a slot reused too early or a page lost on the way shows up as wrong data.

The model keeps, for every cached page, the whole token prefix it ends and where it is
(tier, id); it follows the orders the tree issued and learns drops from their counter.
After every step: the tree's own recount (prefix-closed tiers, per-tier slot
conservation), pool page conservation (free + tree + private), the model's
page -> (tier, id) map == the tree's, the data in every page of every tier once the moves
ran, and matched lengths per tier == the model's for every sequence seen.
"""

from __future__ import annotations

import zlib

import numpy as np
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixserve.cache import PagedMemory, RadixCache
from radixserve.cache.prefix_lease import PrefixLease
from radixserve.cache.tiers import DISK, HOST, POOL, DemoteOrder, LoadOrder, LowerTiers

HEADS = [[], [0, 1, 2, 0, 1, 2, 0, 1], [0, 1, 2, 0, 1, 2, 2, 2, 1, 0], [1, 1, 1, 1, 2], [2]]
namespace_st = st.sampled_from([None, None, "tenant-b"])


class FakeDisk:
    """A page store: checksummed bytes per key; a page that fails is dropped, None."""

    def __init__(self):
        self.pages: dict[int, tuple[int, bytes]] = {}
        self.corrupt = 0

    def write_page(self, key: int, payload: bytes) -> None:
        self.pages[key] = (zlib.crc32(payload), payload)

    def read_page(self, key: int) -> bytes | None:
        entry = self.pages.get(key)
        if entry is None:
            return None
        crc, payload = entry
        if zlib.crc32(payload) != crc:
            self.corrupt += 1
            del self.pages[key]
            return None
        return payload

    def drop_page(self, key: int) -> None:
        self.pages.pop(key, None)


class TieredMachine(RuleBasedStateMachine):
    page_size = 1
    num_pages = 12
    host_pages = 6
    disk_pages = 10

    def __init__(self):
        super().__init__()
        ps = self.page_size
        self.tree = RadixCache(ps, "lru")
        self.disk = FakeDisk()
        self.tiers = LowerTiers(self.tree, self.num_pages, self.host_pages, self.disk_pages,
                                self.disk if self.disk_pages else None, page_bytes=8 * ps)
        self.mem = PagedMemory(self.num_pages, self.tree)
        self.kv1 = np.full((self.num_pages, ps), -1, dtype=np.int64)
        self.kv2 = np.full((max(self.host_pages, 1), ps), -1, dtype=np.int64)
        # model: (namespace, prefix tuple ending with the page) -> (tier, tree id)
        self.where: dict[tuple, tuple[int, int]] = {}
        self.by_id: dict[int, tuple] = {}
        self.leases: list[PrefixLease] = []
        self.seen: list[tuple] = []
        self.inserted_tokens = 0
        self.dropped = 0
        self.learned = 0            # orders in tiers._moves the model has followed

    @initialize()
    def start(self):
        pass

    # ------------------------------------------------------------------ the runner
    def run_moves(self):
        """Execute the queued orders in issue order (what ModelRunner does), and teach
        the model where each page went."""
        ps = self.page_size
        self.learn()
        self.learned = 0
        for mv in self.tiers.take_moves():
            if isinstance(mv, DemoteOrder):
                rows = self.read(mv.src_tier, mv.src)
                self.write(mv.dst_tier, mv.dst, rows)
            else:
                assert isinstance(mv, LoadOrder)
                if mv.src_tier == DISK:
                    rows = np.stack([np.frombuffer(p, dtype=np.int64) for p in mv.payloads])
                else:
                    rows = self.read(HOST, mv.src)
                assert rows.shape == (len(mv.dst), ps)
                self.write(POOL, mv.dst, rows)
        self.tiers.moves_done()

    def learn(self):
        """The model follows the orders as they are issued (before they run)."""
        for mv in self.tiers._moves[self.learned:]:
            src = mv.src + (self.tiers.offset[mv.src_tier] if mv.src_tier != POOL else 0)
            if isinstance(mv, DemoteOrder):
                self.model_move(src, mv.dst + self.tiers.offset[mv.dst_tier], mv.dst_tier)
            else:
                self.model_move(src, mv.dst, POOL)
        self.learned = len(self.tiers._moves)

    def read(self, tier, ids):
        if tier == POOL:
            return self.kv1[ids].copy()
        if tier == HOST:
            return self.kv2[ids].copy()
        return np.stack([np.frombuffer(self.disk.pages[int(k)][1], dtype=np.int64)
                         for k in ids])

    def write(self, tier, ids, rows):
        if tier == POOL:
            self.kv1[ids] = rows
        elif tier == HOST:
            self.kv2[ids] = rows
        else:
            for k, row in zip(ids.tolist(), rows):
                self.disk.write_page(k, row.astype(np.int64).tobytes())

    def model_move(self, src_ids, dst_ids, dst_tier):
        for s, d in zip(src_ids.tolist(), dst_ids.tolist()):
            key = self.by_id.pop(s)
            self.where[key] = (dst_tier, d)
            self.by_id[d] = key

    # ------------------------------------------------------------------ tree views
    def tree_map(self) -> dict[tuple, tuple[int, int]]:
        ps = self.page_size
        out = {}
        for node in self.tree.iter_nodes():
            path, n = [], node
            while n.depth:
                path.append(n.tokens)
                n = n.parent
            tokens = [t for edge in reversed(path) for t in edge]
            start = node.depth - node.num_tokens
            for i, page in enumerate(node.pages.tolist()):
                end = start + (i + 1) * ps
                out[(node.namespace, tuple(tokens[:end]))] = (node.tier, page)
        return out

    def sync_drops(self):
        """Pages the tree dropped (last tier full, corrupt, no room anywhere)."""
        self.learn()
        now = self.tree_map()
        gone = [k for k in self.where if k not in now]
        for k in gone:
            tier, page = self.where.pop(k)
            if self.by_id.get(page) == k:       # else the id was reused since
                del self.by_id[page]
        self.dropped += len(gone) * self.page_size

    def model_match(self, tokens, namespace, limit):
        """(pool pages, [(tier, id)] of the lower pages continuing it)."""
        ps = self.page_size
        pool, lower = [], []
        i = 1
        while i * ps <= limit:
            got = self.where.get((namespace, tuple(tokens[:i * ps])))
            if got is None:
                break
            if got[0] == POOL and not lower:
                pool.append(got[1])
            else:
                lower.append(got)
            i += 1
        return pool, lower

    # ------------------------------------------------------------------ rules
    @rule(head=st.sampled_from(HEADS), tail=st.lists(st.integers(0, 2), max_size=24),
          namespace=namespace_st, keep=st.booleans(), load=st.booleans(),
          max_tier=st.sampled_from([HOST, DISK]))
    def request(self, head, tail, namespace, keep, load, max_tier):
        tokens = head + tail
        if len(tokens) < 2 or len(tokens) > (self.num_pages - 2) * self.page_size:
            return
        ps = self.page_size
        self.seen = (self.seen + [(tokens, namespace)])[-12:]
        lease = PrefixLease(self.mem, namespace)
        cap = len(tokens) - 1
        m = lease.acquire(tokens, max_tokens=cap)
        self.sync_drops()
        want_pool, want_lower = self.model_match(tokens, namespace, cap)
        assert m.pages.tolist() == want_pool
        assert [(n.tier, p) for n in m.lower for p in n.pages.tolist()] == want_lower
        tiers = [n.tier for n in m.lower]
        assert tiers == sorted(tiers) and all(t != POOL for t in tiers)
        if load:
            corrupt = self.tiers.counters.corrupt_pages
            from_tiers = sorted({n.tier for n in m.lower if n.tier <= max_tier})
            loaded = lease.load(m, max_tier)
            self.sync_drops()
            if loaded:
                event(f"loaded from tiers {from_tiers}")
            if self.tiers.counters.corrupt_pages > corrupt:
                event("a corrupt disk page ended a load")
            assert loaded % ps == 0 and loaded <= m.lower_tokens()
        start = lease.matched_tokens
        need = -(-len(tokens) // ps) - len(lease.pages)
        try:
            lease.grow(need)
        except Exception:
            lease.release()
            self.sync_drops()
            return
        self.sync_drops()
        self.run_moves()            # the step: moves first, then copy-on-write, then compute
        for order in lease.take_copy_orders():
            self.kv1[order.dst_page, :order.num_tokens] = \
                self.kv1[order.src_page, :order.num_tokens]
        got = self.kv1[lease.pages].ravel()[:start].tolist()
        assert got == tokens[:start], "served KV differs from the tokens"
        for pos in range(start, len(tokens)):
            self.kv1[lease.pages[pos // ps], pos % ps] = tokens[pos]
        whole = len(tokens) // ps * ps
        before = set(self.tree_map())
        lease.extend(tokens, len(tokens))
        after = self.tree_map()
        # Pages the insert adopted (new, or recomputed over host/disk nodes).
        for i in range(whole // ps):
            key = (namespace, tuple(tokens[:(i + 1) * ps]))
            tier, page = after[key]
            assert tier == POOL
            old = self.where.get(key)
            if old is None:
                assert key not in before
                self.inserted_tokens += ps
            elif old != (tier, page) and self.by_id.get(old[1]) == key:
                event("an insert recomputed pages over host/disk nodes")
                del self.by_id[old[1]]
            self.where[key] = (tier, page)
            self.by_id[page] = key
        if keep:
            self.leases.append(lease)
        else:
            lease.release()

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 7))
    def release(self, i):
        self.leases.pop(i % len(self.leases)).release()

    @rule(n=st.integers(1, 40))
    def evict(self, n):
        freed = self.tree.evict(n)
        self.mem.free(freed)
        self.sync_drops()

    @rule()
    def step(self):
        self.run_moves()

    @precondition(lambda self: self.disk.pages)
    @rule(i=st.integers(0, 100), at=st.integers(0, 10_000))
    def corrupt_disk_page(self, i, at):
        keys = sorted(self.disk.pages)
        key = keys[i % len(keys)]
        crc, payload = self.disk.pages[key]
        b = bytearray(payload)
        b[at % len(b)] ^= 0x10
        self.disk.pages[key] = (crc, bytes(b))

    @precondition(lambda self: not self.leases)
    @rule()
    def flush(self):
        self.run_moves()
        self.mem.free(self.tree.flush())
        self.dropped += len(self.where) * self.page_size
        self.where.clear()
        self.by_id.clear()

    @precondition(lambda self: not self.leases and self.disk_pages)
    @rule()
    def restart(self):
        """Save and start again from the index, as KVPersistence does: pool and host nodes
        are copied into disk slots lent by the tiers (whole nodes, parents first, while
        slots last: lending drops disk victims), the index lists every node on disk whose
        parent is (disk nodes by their own pages), and a fresh tree rebuilds it as disk
        nodes on the same page files. The model predicts what comes back: every page
        whose whole path was on disk, all in the disk tier; the rest is dropped."""
        self.run_moves()
        ps = self.page_size
        copies: dict[int, np.ndarray] = {}      # node id -> lent disk slots of its copy
        for node in list(self.tree.iter_nodes()):
            if node.tier == DISK or node.parent is None:
                continue
            slots = self.tiers.lend_disk_slots(len(node.pages))
            self.sync_drops()
            if len(slots) < len(node.pages):
                self.tiers.return_disk_slots(slots.tolist())
                continue
            rows = self.read(node.tier, self.tiers.local(node.tier, node.pages))
            for k, row in zip(slots.tolist(), rows):
                self.disk.write_page(k, row.astype(np.int64).tobytes())
            copies[node.id] = slots
        self.tree.check_invariants()            # lent slots are counted as held
        copied = {int(p) for node in self.tree.iter_nodes() if node.id in copies
                  for p in node.pages}
        index, saved = [], set()
        for node in self.tree.iter_nodes():
            pid = node.parent.id if node.parent.depth else None
            if pid is not None and pid not in saved:
                continue
            if node.tier == DISK:
                keys = self.tiers.local(DISK, node.pages).tolist()
            elif node.id in copies:
                keys = copies[node.id].tolist()
            else:
                continue
            saved.add(node.id)
            index.append((node.id, pid, node.namespace, node.tokens, keys, node.last_access))
        # The model: a page comes back iff every page of its path was on disk.
        on_disk = {k for k, (tier, page) in self.where.items()
                   if tier == DISK or page in copied}
        expected = {(ns, prefix) for ns, prefix in self.where
                    if all((ns, prefix[:j * ps]) in on_disk
                           for j in range(1, len(prefix) // ps + 1))}

        old_disk = self.disk
        self.tree = RadixCache(ps, "lru")
        self.disk = FakeDisk()
        self.tiers = LowerTiers(self.tree, self.num_pages, self.host_pages, self.disk_pages,
                                self.disk, page_bytes=8 * ps)
        self.mem = PagedMemory(self.num_pages, self.tree)
        self.kv1[:] = -1
        self.kv2[:] = -1
        placed = {}
        for old_id, pid, ns, tokens, keys, last in index:
            node = self.tiers.restore_disk_node(placed.get(pid), tokens, ns, last)
            assert node is not None, "an indexed node did not fit the same disk tier"
            for slot, key in zip(self.tiers.local(DISK, node.pages).tolist(), keys):
                self.disk.pages[slot] = old_disk.pages[key]     # TierPages.adopt
            placed[old_id] = node
        event(f"restart restored {len(placed)} nodes")
        now = self.tree_map()
        assert set(now) == expected, "restored pages != the model's"
        assert all(tier == DISK for tier, _ in now.values())
        assert self.tiers.used_pages(DISK) * ps == self.tiers.tokens(DISK) == len(now) * ps
        self.dropped += (len(self.where) - len(expected)) * ps
        self.where = now
        self.by_id = {page: key for key, (tier, page) in now.items()}
        self.learned = 0

    # ------------------------------------------------------------------ invariants
    @invariant()
    def consistent(self):
        self.learn()
        self.tree.check_invariants()
        self.mem.check_conservation([lease.private_pages for lease in self.leases])
        assert self.tree_map() == self.where, "model's page -> (tier, id) != the tree's"
        # Nothing is lost silently: every adopted token is cached somewhere or was dropped.
        assert self.inserted_tokens == len(self.where) * self.page_size + self.dropped

    @invariant()
    def data(self):
        if self.tiers._moves:
            return              # not run yet: the data is still on its way
        for (ns, prefix), (tier, page) in self.where.items():
            row = self.page_size
            want = list(prefix[-row:])
            if tier == POOL:
                assert self.kv1[page].tolist() == want
            elif tier == HOST:
                assert self.kv2[page - self.tiers.offset[HOST]].tolist() == want
            else:
                key = page - self.tiers.offset[DISK]
                entry = self.disk.pages.get(key)
                assert entry is not None, f"disk page {key} of a cached node is missing"
                if zlib.crc32(entry[1]) == entry[0]:       # not corrupted by the test
                    assert np.frombuffer(entry[1], dtype=np.int64).tolist() == want

    @invariant()
    def peek_is_the_whole_match(self):
        for tokens, ns in self.seen:
            pool, lower = self.model_match(tokens, ns, len(tokens) - 1)
            whole = (len(pool) + len(lower)) * self.page_size
            assert self.tree.peek_prefix(tokens, ns, len(tokens) - 1) >= whole


SETTINGS = settings(max_examples=int(__import__("os").environ.get("TIERS_EXAMPLES", 120)), stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


class TieredPage1(TieredMachine):
    page_size = 1


class TieredPage16(TieredMachine):
    page_size = 16
    num_pages = 8
    host_pages = 4
    disk_pages = 6


class HostOnly(TieredMachine):
    page_size = 1
    disk_pages = 0


class DiskOnly(TieredMachine):
    page_size = 4
    num_pages = 10
    host_pages = 0


TestTieredPage1 = TieredPage1.TestCase
TestTieredPage1.settings = SETTINGS
TestTieredPage16 = TieredPage16.TestCase
TestTieredPage16.settings = SETTINGS
TestHostOnly = HostOnly.TestCase
TestHostOnly.settings = settings(SETTINGS, max_examples=60)
TestDiskOnly = DiskOnly.TestCase
TestDiskOnly.settings = settings(SETTINGS, max_examples=60)
