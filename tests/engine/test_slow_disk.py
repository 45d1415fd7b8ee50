"""A slow disk is skipped, not waited on: once the disk tier's measured load cost per token
is above recompute's (engine/tier_costs.py), a prefix cached on disk is computed again;
once the skip has lasted PROBE_AFTER_S (on the costs' clock, here a hand-moved one), a load
probes the disk again, and a disk that has recovered is used again.

"Slow" is injected as time, not waited for: the reader's clock jumps 100 s during each page
read, so the measured load cost is far above any machine's prefill cost and the test does
not depend on this machine's speed. (That the step never waits on a disk read, however long,
is shown in test_disk_writer_engine.py with a gate.)
"""

from __future__ import annotations

import asyncio
import time

from engine_helpers import collect, wait_idle
from test_disk_writer_engine import engine_with_gate, expected, serve_onto_disk  # noqa: F401
from test_engine_tiers import GREEDY

from radixserve.cache.tier_types import Tier
from radixserve.engine.tier_costs import PROBE_AFTER_S
from radixserve.storage import disk_reader

JUMP_S = 100.0


class JumpingClock:
    """`time` for the disk reader: perf_counter runs JUMP_S ahead after every slow read."""

    def __init__(self):
        self.ahead = 0.0

    def perf_counter(self) -> float:
        return time.perf_counter() + self.ahead


class SlowReads:
    """Wraps the disk tier's pages: each read takes JUMP_S on the reader's clock while
    `slow` is set."""

    def __init__(self, inner, clock: JumpingClock):
        self.inner, self.clock, self.reads, self.slow = inner, clock, 0, True

    def read_page(self, slot: int) -> bytes | None:
        self.reads += 1
        if self.slow:
            self.clock.ahead += JUMP_S
        return self.inner.read_page(slot)


def test_a_disk_slower_than_recompute_is_skipped_then_probed_again(
        model_fp32, expected, tmp_path, monkeypatch):  # noqa: F811
    prompts, replies = expected                 # A, five others, A (uncached replies)
    engine, writer, gate = engine_with_gate(model_fp32, tmp_path, prompts)
    gate.set()
    tiers, costs = engine.tiers.lower, engine.tiers.costs
    clock = JumpingClock()
    monkeypatch.setattr(disk_reader, "time", clock)
    now = [0.0]                                 # the costs' clock: moved by hand
    costs.clock = lambda: now[0]

    async def a_from_disk():
        """A's prefix back on disk (its copy there was kept), then A: its first token."""
        await serve_onto_disk(engine, writer, prompts[1:4])
        assert tiers.tree.match_prefix(prompts[-1]).lower_tokens(Tier.DISK) > 0
        reply = await collect(engine.generate(prompts[-1], GREEDY))
        await wait_idle(engine)
        engine.check_invariants()
        return reply.token_ids[0]

    async def main():
        await engine.start()
        try:
            await serve_onto_disk(engine, writer, prompts[:-1])     # A's prefix on disk
            engine.tiers.reader.source = reads = SlowReads(engine.tiers.reader.source, clock)
            # The first load from the slow disk is how its cost gets measured.
            loaded = tiers.counters[Tier.DISK].loaded_tokens
            first = await collect(engine.generate(prompts[-1], GREEDY))
            await wait_idle(engine)
            engine.check_invariants()
            assert first.token_ids[0] == replies[-1]
            assert reads.reads > 0 and tiers.counters[Tier.DISK].loaded_tokens > loaded
            assert costs.load_s_per_token[Tier.DISK] > costs.prefill_s_per_token
            assert costs.max_tier() < Tier.DISK
            # Skipped: A is computed, not read.
            reads_before, loaded = reads.reads, tiers.counters[Tier.DISK].loaded_tokens
            assert await a_from_disk() == replies[-1]
            assert reads.reads == reads_before
            assert tiers.counters[Tier.DISK].loaded_tokens == loaded
            # The disk recovers; the skip has lasted PROBE_AFTER_S: A's load probes it, the
            # sample replaces the slow figure, and the disk is used again.
            reads.slow = False
            now[0] += PROBE_AFTER_S
            assert await a_from_disk() == replies[-1]
            assert reads.reads > reads_before
            assert tiers.counters[Tier.DISK].loaded_tokens > loaded
            assert costs.load_s_per_token[Tier.DISK] < costs.prefill_s_per_token
            assert costs.max_tier() == Tier.DISK
        finally:
            await engine.shutdown()
    asyncio.run(main())
