"""Ray Serve LLM's KV-aware router core routing radixserve replicas from their KV events.

Ray Serve LLM 2.60's `KVAwareRouter` delegates every choice to Dynamo's `SelectionService`
(`ray.llm._internal.serve.routing_policies.kv_aware.kv_token_tracker`): it registers each
replica's `kv_event_metadata` with `upsert_worker` (the service's listener subscribes to the
replica's ZeroMQ events and replays gaps) and asks `select_and_reserve` for each prompt.
This script does exactly those two calls, with the same fields, against radixserve
replicas: each is a real radix tree and the engine's events path (events/stream.py:
KVEvents, tree facts replayed on the publisher's thread), without a model. Each replica
caches its own prompt family; every probe prompt must go to the replica that holds its
prefix. Then replica 0 restarts on the same endpoints with other prompts, and Dynamo's
index must follow (the old family gone, the new one routed).

Needs Dynamo's selection core, which is not a radixserve dependency (ai-dynamo-runtime
pins pydantic <= 2.13.5; the full ai-dynamo also needs aisimulate from NVIDIA's index):

    pip download ai-dynamo-runtime==1.6.1 --no-deps -d /tmp/dyn
    pip install --no-deps --target /tmp/dynsite /tmp/dyn/ai_dynamo_runtime-1.6.1-*.whl
    PYTHONPATH=.:/tmp/dynsite python scripts/route_with_dynamo.py
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import time

import zmq

from radixserve.cache import PagedMemory, RadixCache
from radixserve.cache.prefix_lease import PrefixLease
from radixserve.events.stream import KVEvents, KVEventsConfig

BLOCK = 16
MODEL, TENANT = "smollm2", "default"     # one routing group, as Ray Serve LLM uses


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Replica:
    """A radixserve cache publishing its KV events on fixed local ports."""

    def __init__(self, pub_port: int, replay_port: int, encoding: str):
        self.ports = (pub_port, replay_port)
        self.encoding = encoding
        self.tree = RadixCache(page_size=1)
        self.mem = PagedMemory(8192, self.tree)
        config = KVEventsConfig(f"tcp://*:{pub_port}", f"tcp://*:{replay_port}",
                                block_size=BLOCK, encoding=encoding)
        self.events = KVEvents(self.tree, config, "cuda")    # media as a GPU engine names them

    def serve(self, tokens: list[int]) -> None:
        lease = PrefixLease(self.mem, None)
        lease.acquire(tokens)
        lease.grow(len(tokens) - len(lease.pages))
        lease.extend(tokens, len(tokens))
        lease.release()
        self.events.flush()

    def metadata(self) -> dict:
        """What a Ray Serve LLM replica puts in routing_stats["kv_event_metadata"]."""
        return {"endpoint": f"tcp://127.0.0.1:{self.ports[0]}",
                "replay_endpoint": f"tcp://127.0.0.1:{self.ports[1]}", "dp_rank": 0,
                "block_size": BLOCK, "max_num_batched_tokens": 8192}


async def restarted(ports: tuple[int, int], encoding: str, timeout_s: float) -> Replica:
    """A new replica on the old one's ports (ZeroMQ frees a closed socket's port
    asynchronously: retry while it is still in use)."""
    t0 = time.monotonic()
    while True:
        try:
            return Replica(*ports, encoding)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() - t0 > timeout_s:
                raise
            await asyncio.sleep(0.05)


async def register(svc, worker_id: int, meta: dict) -> None:
    """KVTokenTracker._upsert_worker's call, field for field."""
    await svc.upsert_worker({
        "worker_id": worker_id, "model_name": MODEL, "tenant_id": TENANT,
        "endpoint": f"ray://replica-{worker_id}", "block_size": meta["block_size"],
        "max_num_batched_tokens": meta["max_num_batched_tokens"],
        "data_parallel_start_rank": meta["dp_rank"], "data_parallel_size": 1,
        "kv_events_endpoints": {meta["dp_rank"]: meta["endpoint"]},
        "replay_endpoint": meta["replay_endpoint"]})


async def indexed_blocks(svc, tokens: list[int]) -> dict[int, int]:
    scores = await svc.overlap_scores({"model_name": MODEL, "tenant_id": TENANT,
                                       "token_ids": tokens})
    return {w["worker_id"]: w["device_blocks"] for w in scores["workers"]}


async def wait_indexed(svc, replicas, families, rng, timeout_s: float) -> float:
    """Until Dynamo's index holds each family on its replica: a subscriber that connects
    after a batch was sent learns of the gap from the next one, so each round serves one
    more prompt per replica (a new batch) before it looks."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        want = len(families[0]) // BLOCK
        got = [await indexed_blocks(svc, fam) for fam in families]
        if all(g.get(i + 1, 0) >= want for i, g in enumerate(got)):
            return time.monotonic() - t0
        for rep, fam in zip(replicas, families):
            rep.serve(fam + [rng.randrange(50_000, 60_000) for _ in range(BLOCK)])
        await asyncio.sleep(0.05)
    raise TimeoutError(f"Dynamo did not index the families in {timeout_s} s: {got}")


async def route(svc, families, probes: int, rng, label: str) -> int:
    right = 0
    for k in range(probes):
        owner = k % len(families)
        prompt = families[owner] + [rng.randrange(60_000, 70_000) for _ in range(40)]
        sel = await svc.select_and_reserve({
            "model_name": MODEL, "tenant_id": TENANT, "selection_id": f"{label}-{k}",
            "token_ids": prompt, "allowed_worker_ids": [1, 2],
            "expected_output_tokens": 16})
        right += sel["worker_id"] == owner + 1
        if k < 2:
            print(f"  {label} probe {k}: family of replica {owner + 1} -> worker "
                  f"{sel['worker_id']}, {sel['overlap']['longest_matched']} tokens matched")
    print(f"{label}: {right}/{probes} prompts routed to the replica holding their prefix")
    return right


async def main(probes: int, timeout_s: float, encoding: str) -> int:
    from dynamo.llm import SelectionService

    rng = random.Random(0)
    ports = [(free_port(), free_port()) for _ in range(2)]
    replicas = [Replica(*p, encoding) for p in ports]
    families = [[rng.randrange(1000, 30_000) for _ in range(160)] for _ in range(2)]
    svc = SelectionService(indexer_threads=1)
    try:
        for wid, rep in enumerate(replicas, start=1):
            await register(svc, wid, rep.metadata())
        for rep, fam in zip(replicas, families):
            rep.serve(fam)
        took = await wait_indexed(svc, replicas, families, rng, timeout_s)
        print(f"Dynamo indexed both replicas' events in {took:.2f} s")
        ok = await route(svc, families, probes, rng, "before restart") == probes

        # Replica 1 restarts on the same ports with another family: its stream starts
        # with AllBlocksCleared at a higher sequence number (publisher.py).
        replicas[0].events.close()
        old = families[0]
        families[0] = [rng.randrange(1000, 30_000) for _ in range(160)]
        replicas[0] = await restarted(ports[0], encoding, timeout_s)
        replicas[0].serve(families[0])
        took = await wait_indexed(svc, replicas, families, rng, timeout_s)
        stale = (await indexed_blocks(svc, old)).get(1, 0)
        print(f"after replica 1 restarted: its new prompts indexed in {took:.2f} s; "
              f"blocks of its old prompts still indexed: {stale}")
        ok &= stale == 0
        ok &= await route(svc, families, probes, rng, "after restart") == probes
    finally:
        svc.shutdown()
        for rep in replicas:
            rep.events.close()
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probes", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--encoding", choices=["array", "map"], default="array")
    args = parser.parse_args()
    raise SystemExit(asyncio.run(main(args.probes, args.timeout, args.encoding)))
