"""Tier simulation: demote on eviction, load on hit; checked by hand and against replay."""

from __future__ import annotations

import json

import pytest

from radixserve.replay.cli import main as replay_main
from radixserve.replay.replayer import ReplayConfig, replay
from radixserve.replay.traces import read_trace
from radixserve.replay.workload import Workload
from radixserve.replay.tiers import TierConfig, simulate_tiers

from .helpers import hash_record as rec
from .helpers import write_jsonl

BS = 4


@pytest.fixture(scope="module")
def slice400():
    from .helpers import REAL_TRACE

    return Workload(read_trace(REAL_TRACE, limit=400), "block", 512)


def test_a_cycle_through_host_and_disk_by_hand(tmp_path):
    # The first tier holds 2 pages: one block and a request's private last-token page. Each
    # request is one whole block plus one token, so each one evicts the previous block.
    # Host holds 2 pages, disk 4. Walk-through (host / disk contents after each request):
    #   [1] miss                  host -        disk -
    #   [2] miss, 1 demoted       host 1        disk -
    #   [3] miss, 2 demoted       host 1 2      disk -
    #   [1] host hit; 3 demoted, 2 pushed to disk            host 1 3   disk 2
    #   [2] disk hit (through host); 1 refreshed, 3 to disk  host 1 2   disk 2 3
    #   [3] disk hit (through host); 2 refreshed, 1 to disk  host 2 3   disk 2 3 1
    records = [rec([b, 100 + i], 5) for i, b in enumerate((1, 2, 3, 1, 2, 3))]
    trace = read_trace(write_jsonl(tmp_path / "t.jsonl", records), "hash", BS)
    tiers = TierConfig(host_capacity_tokens=2 * BS, disk_capacity_tokens=4 * BS,
                       kv_bytes_per_token=1)
    got = simulate_tiers(Workload(trace, "block", BS), ReplayConfig(2 * BS, check_every=1),
                         tiers)
    assert got.hit_tokens == {"gpu": 0, "host": 4, "disk": 8}
    page = BS                                       # bytes per page at 1 byte per token
    assert got.bytes_in == {"host": 5 * page, "disk": 3 * page}
    assert got.bytes_out == {"host": 6 * page, "disk": 2 * page}


@pytest.mark.parametrize("policy", ["lfu", "gdsf", "belady"])
def test_the_first_tier_is_the_plain_replay_for_every_policy(slice400, policy):
    config = ReplayConfig(150_000, policy, check_every=100)
    plain = replay(slice400, config)
    tiered = simulate_tiers(slice400, config, TierConfig(200_000, 400_000))
    assert tiered.hit_tokens["gpu"] == plain.hit_tokens
    assert tiered.total_hit_tokens > plain.hit_tokens


def test_the_first_tier_is_the_plain_replay_and_tiers_add_hits(slice400):
    config = ReplayConfig(300_000, "lru", check_every=100)
    plain = replay(slice400, config)
    ceiling = replay(slice400, ReplayConfig(None))
    none = simulate_tiers(slice400, config, TierConfig())
    assert none.hit_tokens == {"gpu": plain.hit_tokens, "host": 0, "disk": 0}
    some = simulate_tiers(slice400, config, TierConfig(200_000, 400_000))
    assert some.hit_tokens["gpu"] == plain.hit_tokens
    assert plain.hit_tokens < some.total_hit_tokens <= ceiling.hit_tokens
    assert some.hit_tokens["host"] > 0 and some.hit_tokens["disk"] > 0
    # A host tier that never fills keeps every evicted page: the hierarchy hits all that
    # an unbounded cache would.
    huge = simulate_tiers(slice400, config, TierConfig(10**9, 0))
    assert huge.total_hit_tokens == ceiling.hit_tokens
    assert huge.bytes_in["host"] == (huge.bytes_in["host"] // (512 * 131072)) * 512 * 131072


def test_cli_tiers_json_and_plot(tmp_path, capsys):
    path = write_jsonl(tmp_path / "t.jsonl", [rec([b, 100 + i], 5)
                                              for i, b in enumerate((1, 2, 3, 1, 2, 3))])
    png = tmp_path / "tiers.png"
    code = replay_main([str(path), "--block-size", "4", "--capacity-tokens", "8,16",
                        "--host-capacity-tokens", "8", "--disk-capacity-tokens", "16",
                        "--kv-bytes-per-token", "1", "--json", "--plot", str(png)])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    first = {(p["capacity_tokens"], p["policy"]): p for p in report["points"]}[8, "lru"]
    assert first["hit_tokens"] == {"gpu": 0, "host": 4, "disk": 8}
    assert first["token_hit_rate"] == pytest.approx(12 / 30)
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert replay_main([str(path), "--block-size", "4", "--capacity-tokens", "8",
                        "--host-capacity-tokens", "8", "--replicas", "2"]) == 2
    assert "not both" in capsys.readouterr().err
    code = replay_main([str(path), "--block-size", "4", "--capacity-tokens", "8,16",
                        "--host-capacity-tokens", "8", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0 and "host hit" in out and "disk hit" in out
