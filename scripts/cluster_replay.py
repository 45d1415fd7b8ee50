"""bench_cluster.py --replay: the replay's cluster simulation (`radixserve replay --replicas N
--share`) run on the very request sequence a served configuration dispatched, to compare
its predicted figures (prompt tokens computed, hit rate counting loads, tokens loaded from
the store, requests per replica) with what the replicas measured.

The router logs each dispatched request (ClusterState.request_log: its routing hashes,
prompt length, replica, time). They become a hash-id trace (one id per routing block, a
unique id for a partial last block) replayed in block mode at the same block size, arrivals
at their logged times. Two replays per configuration:
- **own routing**: the replay's router of the same name decides, on its service model;
- **measured routing**: every request goes where the served router sent it, so a
  difference from the measurement is the cache and store model's, not the routing's.

Workloads run one after another on one deployment (caches kept), so workload k's figures
are those of the replay of workloads 1..k minus those of 1..k-1.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from radixserve.replay.cluster import ClusterConfig, ClusterStats, ServiceModel, simulate_cluster
from radixserve.replay.traces import read_trace
from radixserve.replay.workload import Workload
from radixserve.routing import LoadBound, Router

TAIL_IDS = 1 << 39          # hash ids of partial last blocks: one per request, never shared
STORE_TOKENS = 1 << 20      # the simulated store's capacity (the served one is not the limit)


@dataclass(frozen=True)
class ReplaySetup:
    replicas: list[str]             # replica ids, sorted: a replica's index in the replay
    router: str
    kv_tokens: int                  # per replica
    share: bool
    load_bound: LoadBound
    block_tokens: int
    output_tokens: int
    service: ServiceModel


class FollowRouter(Router):
    """Sends request i where the served router sent it."""

    name = "measured"

    def __init__(self, choices: list[int]):
        super().__init__(max(choices) + 1 if choices else 1)
        self.choices = choices
        self.next = 0

    def choose(self, request, view):
        r = self.choices[self.next]
        self.next += 1
        return r


def hash_trace(log: list, setup: ReplaySetup) -> list[dict]:
    """The logged requests as hash-trace records (dense ids, times in ms from the first)."""
    ids: dict[int, int] = {}
    t0 = log[0].at if log else 0.0
    records = []
    for i, sent in enumerate(log):
        hash_ids = [ids.setdefault(h, len(ids)) for h in sent.hashes]
        if sent.prompt_tokens > setup.block_tokens * len(hash_ids):
            hash_ids.append(TAIL_IDS + i)
        records.append({"input_length": sent.prompt_tokens, "hash_ids": hash_ids,
                        "output_length": setup.output_tokens,
                        "timestamp": 1000.0 * (sent.at - t0)})
    return records


def simulate(log: list, setup: ReplaySetup, follow: bool) -> ClusterStats:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sent.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in hash_trace(log, setup)))
        work = Workload(read_trace(path, "hash", setup.block_tokens), "block",
                        setup.block_tokens)
    index = {rid: i for i, rid in enumerate(setup.replicas)}
    config = ClusterConfig(len(setup.replicas), setup.router if not follow else "round-robin",
                           setup.kv_tokens, service=setup.service,
                           load_bound=setup.load_bound,
                           share_tokens=STORE_TOKENS if setup.share else 0)
    router = FollowRouter([index[s.replica_id] for s in log]) if follow else None
    return simulate_cluster(work, config, router=router)


def figures(stats: ClusterStats, before: ClusterStats | None, replicas: int) -> dict:
    """One workload's figures: the replay up to its end minus the replay before it."""
    def less(attr):
        return getattr(stats, attr) - (getattr(before, attr) if before else 0)
    per = [n - (before.replica_requests[i] if before else 0)
           for i, n in enumerate(stats.replica_requests or [0] * replicas)]
    query, hit = less("query_tokens"), less("hit_tokens")
    mean = sum(per) / len(per) if per else 0
    return {"computed_tokens": query - hit, "token_hit_rate": hit / query if query else None,
            "loaded_tokens": less("loaded_tokens"), "requests_per_replica": per,
            "requests_max_over_mean": max(per) / mean if mean else None}


def replay_workloads(log: list, ends: list[int], setup: ReplaySetup) -> dict[str, list[dict]]:
    """Per workload (its log ends at `ends[k]`): the two replays' figures."""
    out: dict[str, list[dict]] = {"own": [], "measured": []}
    for mode, follow in (("own", False), ("measured", True)):
        before = None
        for end in ends:
            stats = simulate(log[:end], setup, follow)
            out[mode].append(figures(stats, before, len(setup.replicas)))
            before = stats
    return out
