"""The real engine with --kv-events: a router index built from its stream predicts its
match for every probe prompt (in whole blocks, page size 4, 16-token blocks, a host tier),
/metrics reports the publisher, and a restart with --kv-disk-dir announces what it
reloaded, after an AllBlocksCleared."""

from __future__ import annotations

import asyncio
import re

import pytest

from radixserve.engine.config import EngineConfig
from radixserve.engine.engine import Engine
from radixserve.engine.sampling_params import SamplingParams
from radixserve.events.subscriber import EventSubscriber
from radixserve.server.metrics import ServerMetrics
from tests.events.conftest import LOCAL, drain
from tests.events.consumers import DynamoIndex, LlmdIndex

GREEDY = SamplingParams(max_tokens=1, temperature=0.0)
BLOCK = 16
SYSTEM = list(range(1000, 1040))          # 40 tokens: two whole blocks and a half
PROMPTS = [SYSTEM + [7, 8, 9] * k for k in (1, 3, 6)] + [[5] * 37, SYSTEM[:20] + [3] * 30]
OTHERS = [[2000 + i] * 60 for i in range(5)]    # 300 new tokens: the 256-token pool evicts


def make(model, **overrides) -> Engine:
    config = EngineConfig(**{"kv_cache_tokens": 256, "page_size": 4, "chunked_prefill_size": 64,
                             "debug_invariants": True, "warmup_tokens": 0,
                             "kv_events": LOCAL, "kv_events_replay": LOCAL,
                             "kv_events_block_size": BLOCK, **overrides})
    return Engine(config, model)


async def serve(engine: Engine, prompts, namespace=None) -> None:
    for p in prompts:
        async for _ in engine.generate(p, GREEDY, namespace=namespace):
            pass
    while engine.scheduler.has_work():          # the loop publishes as it goes idle
        await asyncio.sleep(0.005)


def check_predictions(engine: Engine, indexes, sub: EventSubscriber, probes) -> int:
    pub = engine.kv_events.publisher
    for r in drain(sub, pub, pub.sent_when_idle()):
        for index in indexes:
            index.apply(r.batch)
    hits = 0
    for tokens, ns in probes:
        engine_blocks = engine.tree.peek_prefix(tokens, ns) // BLOCK
        hits += engine_blocks
        for index in indexes:
            assert index.matched_blocks(tokens, ns) == engine_blocks, (type(index), tokens)
    return hits


def test_engine_stream_predicts_its_matches(model_fp32):
    engine = make(model_fp32, kv_host_tokens=128)
    indexes = [LlmdIndex(BLOCK), DynamoIndex(BLOCK)]
    probes = [(p, ns) for p in PROMPTS + OTHERS for ns in (None, "tenant-a")]

    async def main():
        await engine.start()
        sub = EventSubscriber(engine.kv_events.publisher.endpoint,
                              engine.kv_events.publisher.replay_endpoint)
        try:
            await serve(engine, PROMPTS[:3])
            hits = check_predictions(engine, indexes, sub, probes)
            await serve(engine, OTHERS, namespace="tenant-a")  # evicts, demotes to host
            await serve(engine, PROMPTS[:2])
            hits += check_predictions(engine, indexes, sub, probes)
            assert engine.stats().tiers.l2.demoted_tokens > 0
            await engine.flush_cache()
            check_predictions(engine, indexes, sub, probes)
            assert not indexes[0].media                            # AllBlocksCleared
            engine.check_invariants()
            return hits
        finally:
            sub.close()
            await engine.shutdown()

    hits = asyncio.run(main())
    assert hits > 0
    text = ServerMetrics(engine.stats).render().decode()
    assert "radixserve_kv_events_batches_total" in text
    assert "radixserve_kv_events_dropped_batches_total 0.0" in text
    # the default publisher is a process of its own: its CPU seconds come back, it ended
    cpu = re.search(r"^radixserve_kv_events_publisher_cpu_seconds_total (\S+)$", text, re.M)
    assert cpu and float(cpu.group(1)) > 0
    assert "radixserve_kv_events_publisher_exits_total 0.0" in text
    assert engine.kv_events.publisher.process.returncode == 0


def test_restart_announces_the_reloaded_cache(model_fp32, tmp_path):
    directory = str(tmp_path / "kv")

    async def first():
        engine = make(model_fp32, kv_disk_dir=directory)
        await engine.start()
        try:
            await serve(engine, PROMPTS[:2])
        finally:
            await engine.shutdown()         # saves the cache

    async def second():
        engine = make(model_fp32, kv_disk_dir=directory)
        await engine.start()                # restores, and announces it
        sub = EventSubscriber(engine.kv_events.publisher.endpoint,
                              engine.kv_events.publisher.replay_endpoint)
        try:
            index = LlmdIndex(BLOCK)
            pub = engine.kv_events.publisher
            got = drain(sub, pub, pub.sent_when_idle())
            kinds = [type(e).__name__ for r in got for e in r.batch.events]
            assert kinds[0] == "AllBlocksCleared" and "BlockStored" in kinds
            media = {e.medium for r in got for e in r.batch.events if hasattr(e, "medium")}
            assert media == {"DISK"}
            for r in got:
                index.apply(r.batch)
            for p in PROMPTS[:3]:
                assert index.matched_blocks(p, None) == engine.tree.peek_prefix(p) // BLOCK
            assert index.matched_blocks(PROMPTS[0], None) >= 2
            engine.check_invariants()
        finally:
            sub.close()
            await engine.shutdown()

    asyncio.run(first())
    asyncio.run(second())
