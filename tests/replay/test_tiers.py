"""Tier replay (the server's LowerTiers below the replay's cache): checked by hand, against
the plain replay, and against the engine's own tier counters."""

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
    # The server's tiers (LowerTiers) are exclusive: a page is in exactly one tier, and a
    # load takes it out of host memory or off the disk. The first tier holds 2 pages: one
    # block and a request's private last-token page. Each request is one whole block plus
    # one token, so each one evicts the previous block. Host holds 1 page, disk 4.
    # Walk-through (pool / host / disk after each request):
    #   [1] miss                                            1 / -  / -
    #   [2] miss, 1 demoted                                 2 / 1  / -
    #   [3] miss, 2 demoted, 1 pushed to disk               3 / 2  / 1
    #   [2] host hit (2 leaves host); 3 demoted             2 / 3  / 1
    #   [1] disk hit (1 leaves disk); 2 demoted, 3 to disk  1 / 2  / 3
    #   [3] disk hit; 1 demoted, 2 to disk                  3 / 1  / 2
    records = [rec([b, 100 + i], 5) for i, b in enumerate((1, 2, 3, 2, 1, 3))]
    trace = read_trace(write_jsonl(tmp_path / "t.jsonl", records), "hash", BS)
    tiers = TierConfig(host_capacity_tokens=BS, disk_capacity_tokens=4 * BS,
                       kv_bytes_per_token=1)
    got = simulate_tiers(Workload(trace, "block", BS), ReplayConfig(2 * BS, check_every=1),
                         tiers)
    assert got.hit_tokens == {"gpu": 0, "host": 4, "disk": 8}
    page = BS                                       # bytes per page at 1 byte per token
    # in: demotions into the tier; out: loads from it and demotions out of it.
    assert got.bytes_in == {"host": 5 * page, "disk": 3 * page}
    assert got.bytes_out == {"host": 4 * page, "disk": 2 * page}


@pytest.mark.parametrize("policy", ["lfu", "gdsf"])
def test_tiers_add_hits_for_every_policy(slice400, policy):
    # A node loaded back keeps its history (hit count, last access), so a policy that reads
    # it (LFU, GDSF) may rank the first tier's leaves differently from a plain replay, where
    # the same tokens are recomputed as a fresh node: only LRU's first tier is pinned below.
    config = ReplayConfig(150_000, policy, check_every=100)
    plain = replay(slice400, config)
    ceiling = replay(slice400, ReplayConfig(None, policy))
    tiered = simulate_tiers(slice400, config, TierConfig(200_000, 400_000))
    assert plain.hit_tokens < tiered.total_hit_tokens <= ceiling.hit_tokens


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
    # A host tier that never fills (10M tokens; the slice's prompts are 5.2M) keeps every
    # evicted page: the hierarchy hits all that an unbounded cache would.
    huge = simulate_tiers(slice400, config, TierConfig(10**7, 0))
    assert huge.total_hit_tokens == ceiling.hit_tokens
    assert huge.bytes_in["host"] == (huge.bytes_in["host"] // (512 * 131072)) * 512 * 131072


def test_cli_tiers_json_and_plot(tmp_path, capsys):
    path = write_jsonl(tmp_path / "t.jsonl", [rec([b, 100 + i], 5)
                                              for i, b in enumerate((1, 2, 3, 2, 1, 3))])
    png = tmp_path / "tiers.png"
    code = replay_main([str(path), "--block-size", "4", "--capacity-tokens", "8,16",
                        "--host-capacity-tokens", "4", "--disk-capacity-tokens", "16",
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


# ---------------------------------------------------------------- replay == engine's tiers
ENGINE_PS = 16


def _stream(seed: int = 3, requests: int = 40) -> list[dict]:
    """Requests over a few shared system prompts (2-6 blocks), each with its own tail:
    enough to demote into host memory, push down to disk and load from both."""
    import random

    rng = random.Random(seed)
    systems = [list(range(100 * s, 100 * s + rng.randint(2, 6))) for s in range(1, 7)]
    out = []
    for i in range(requests):
        blocks = rng.choice(systems) + [10_000 + i, 20_000 + i]
        out.append(rec(blocks, len(blocks) * ENGINE_PS - rng.randint(1, ENGINE_PS - 1)))
    return out


def _engine_side(prompts, pool_pages: int, host_pages: int, disk_pages: int,
                 page_bytes: int):
    """The engine's own admission, scheduler and tier runtime over a null model, one
    request at a time (max_tokens 1: prefill only). Its runner stand-in writes the pages
    the step's orders demote to disk. Returns the engine's TierStats and the hit tokens."""
    from radixserve.cache import PagedMemory, RadixCache
    from radixserve.cache.tiers import LowerTiers
    from radixserve.engine.core import EngineCore
    from radixserve.engine.null_model import NullRunner, OneCharTokenizer
    from radixserve.engine.output_processor import OutputProcessor
    from radixserve.engine.outputs import EngineStats
    from radixserve.engine.request import new_request
    from radixserve.engine.sampling_params import SamplingParams
    from radixserve.engine.scheduler import Scheduler, SchedulerConfig
    from radixserve.engine.seq_memory import SequenceMemory
    from radixserve.engine.tier_costs import TierCosts
    from radixserve.engine.tier_runtime import TierRuntime
    from radixserve.replay.tiers import ReplayDisk

    tree = RadixCache(ENGINE_PS)
    pool = PagedMemory(pool_pages, tree)
    disk = ReplayDisk()
    runtime = TierRuntime(LowerTiers(tree, pool_pages, host_pages, disk_pages, disk,
                                     page_bytes), TierCosts())   # unmeasured: always loads
    memory = SequenceMemory(pool, use_cache=True, tiers=runtime)
    stats = EngineStats(pages_total=pool_pages, page_size=ENGINE_PS)
    core = EngineCore(Scheduler(SchedulerConfig(ENGINE_PS, max_running=1, token_budget=4096),
                                memory, stats),
                      OutputProcessor(OneCharTokenizer(), stats, 1 << 20))
    runner = NullRunner(page_size=ENGINE_PS)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    hits = 0
    for i, prompt in enumerate(prompts):
        finals = []
        core.add(new_request(f"r{i}", list(prompt), params, None,
                             lambda o: finals.append(o) if o.finished else None, ENGINE_PS))
        while core.scheduler.has_work():
            plan = core.schedule()
            disk.run(plan.batch.moves)      # the runner's part: write what goes to disk
            core.complete(plan, runner.execute(plan.batch))
            memory.check(core.scheduler.running + core.scheduler.waiting)
        hits += finals[0].usage.cached_tokens
    return runtime.stats(), hits


def test_replay_tier_figures_are_the_engines(tmp_path):
    trace = read_trace(write_jsonl(tmp_path / "t.jsonl", _stream()), "hash", ENGINE_PS)
    workload = Workload(trace, "token", ENGINE_PS)
    pool, host, disk, kv_bytes = 12 * ENGINE_PS, 6 * ENGINE_PS, 10 * ENGINE_PS, 3
    got = simulate_tiers(workload, ReplayConfig(pool, check_every=1),
                         TierConfig(host, disk, kv_bytes))
    engine, engine_hits = _engine_side([item.prompt_keys.tolist() for item in workload],
                                       pool // ENGINE_PS, host // ENGINE_PS,
                                       disk // ENGINE_PS, ENGINE_PS * kv_bytes)
    # The stream exercises every move: demotions to host and disk, loads from both.
    assert engine.l2.demoted_tokens and engine.l3.demoted_tokens
    assert engine.l2.loaded_tokens and engine.l3.loaded_tokens
    assert got.hit_tokens["host"] == engine.l2.loaded_tokens
    assert got.hit_tokens["disk"] == engine.l3.loaded_tokens
    assert got.total_hit_tokens == engine_hits
    assert got.bytes_in == {"host": engine.l2.bytes_in, "disk": engine.l3.bytes_in}
    assert got.bytes_out == {"host": engine.l2.bytes_out, "disk": engine.l3.bytes_out}
