"""TierCosts (engine/tier_costs.py): load from a tier or the cluster store while it is
cheaper per token than computing; a source found slower is skipped, and after
PROBE_AFTER_S of skipping it is probed again, the probe's sample replacing the old figure.
The clock is moved by hand."""

from radixserve.cache.tier_types import Tier
from radixserve.engine.tier_costs import PROBE_AFTER_S, TierCosts


def costs_at(now: list[float]) -> TierCosts:
    costs = TierCosts(clock=lambda: now[0])
    costs.observe_prefill(100, 0.1)                     # computing: 1 ms a token
    return costs


def test_unmeasured_and_cheaper_tiers_are_loaded_from_and_a_slower_one_is_skipped():
    now = [0.0]
    costs = costs_at(now)
    assert costs.max_tier() == Tier.DISK                # nothing measured: load, to measure
    costs.observe_load(Tier.DISK, 100, 0.01)            # 0.1 ms a token
    assert costs.max_tier() == Tier.DISK
    costs.observe_load(Tier.HOST, 100, 0.5)             # 5 ms a token: host and below skipped
    assert costs.max_tier() == Tier.POOL


def test_a_skipped_tier_is_probed_after_a_while_and_a_recovered_one_is_used_again():
    now = [0.0]
    costs = costs_at(now)
    costs.observe_load(Tier.DISK, 10, 1.0)              # 100 ms a token
    assert costs.max_tier() == Tier.HOST                # the skip starts now
    now[0] += PROBE_AFTER_S / 2
    assert costs.max_tier() == Tier.HOST
    now[0] += PROBE_AFTER_S / 2
    assert costs.max_tier() == Tier.DISK                # due: loads let through
    assert costs.max_tier() == Tier.DISK                # ... until one is measured
    costs.observe_load(Tier.DISK, 10, 0.5)              # still slow: the sample replaces
    assert costs.load_s_per_token[Tier.DISK] == 0.05    # (a blend would give 0.09)
    assert costs.max_tier() == Tier.HOST                # skipped again, for a whole wait
    now[0] += PROBE_AFTER_S - 1
    assert costs.max_tier() == Tier.HOST
    now[0] += 1
    assert costs.max_tier() == Tier.DISK
    costs.observe_load(Tier.DISK, 10, 0.001)            # recovered: 0.1 ms a token
    assert costs.max_tier() == Tier.DISK
    now[0] += 10 * PROBE_AFTER_S
    assert costs.max_tier() == Tier.DISK


def test_the_cluster_store_is_probed_like_a_tier():
    now = [0.0]
    costs = costs_at(now)
    assert costs.peer_worth_loading()                   # unmeasured
    costs.observe_peer_load(10, 1.0)
    assert not costs.peer_worth_loading()
    now[0] += PROBE_AFTER_S
    assert costs.peer_worth_loading()
    costs.observe_peer_load(10, 0.001)
    assert costs.peer_s_per_token == 0.0001 and costs.peer_worth_loading()
