"""scripts/cluster_replay.py (bench_cluster.py --replay): a served run's dispatched requests
replayed in the cluster simulation. Checked here on the few-shot burst as the router logs
it (82 shared routing blocks of 16 tokens, 2 own blocks and a 4-token tail per prompt)."""

from __future__ import annotations

from radixserve.cluster.view import SentRecord
from radixserve.replay.cluster import ServiceModel
from radixserve.routing import LoadBound

PREFIX_BLOCKS, PROMPT = 82, 1348            # 1,312 shared tokens; 16 prompts of 1,348


def fewshot_log(replicas: list[str], first: int = 0) -> list[SentRecord]:
    """16 prompts, 8 at once then one a second, dealt round-robin to `replicas`."""
    prefix = list(range(1000, 1000 + PREFIX_BLOCKS))
    return [SentRecord(100.0 + (0 if q < 8 else q),
                       prefix + [50_000 + 10 * (first + q) + j for j in range(2)], PROMPT,
                       replicas[q % len(replicas)]) for q in range(16)]


def test_measured_routing_replays_the_placement_and_the_store_computes_the_prefix_once(
        load_script):
    m = load_script("cluster_replay")
    replicas = ["a", "b", "c", "d"]
    log = fewshot_log(replicas)

    def setup(share):
        return m.ReplaySetup(replicas, "cache-aware", 3072, share, LoadBound(), 16, 16,
                             ServiceModel(3e-3, 0.05))

    on = m.replay_workloads(log, [16], setup(True))["measured"][0]
    off = m.replay_workloads(log, [16], setup(False))["measured"][0]
    own = 36 * 16                       # each prompt's own 36 tokens (2 blocks + tail)
    assert on["requests_per_replica"] == off["requests_per_replica"] == [4, 4, 4, 4]
    assert on["computed_tokens"] == 16 * PREFIX_BLOCKS + own        # the prefix once
    assert on["loaded_tokens"] == 3 * 16 * PREFIX_BLOCKS            # by the 3 others
    assert off["computed_tokens"] == 4 * 16 * PREFIX_BLOCKS + own   # once per replica
    assert off["loaded_tokens"] == 0


def test_a_later_workloads_figures_are_its_own(load_script):
    """Two workloads on one deployment: the second's figures exclude the first's, and its
    prefix, already held, is not computed again."""
    m = load_script("cluster_replay")
    replicas = ["a", "b", "c", "d"]
    log = fewshot_log(replicas) + [
        SentRecord(r.at + 100, r.hashes, r.prompt_tokens, r.replica_id)
        for r in fewshot_log(replicas, first=100)]
    got = m.replay_workloads(log, [16, 32], m.ReplaySetup(
        replicas, "round-robin", 3072, True, LoadBound(), 16, 16, ServiceModel()))
    first, second = got["measured"]
    assert first["requests_per_replica"] == second["requests_per_replica"] == [4, 4, 4, 4]
    assert second["computed_tokens"] == 36 * 16                     # only the questions
    assert got["own"][1]["requests_per_replica"] == [4, 4, 4, 4]    # round-robin's own
