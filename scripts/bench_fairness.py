"""Fairness of prefix-first admission: cold requests' time to first token against the prefill
prefix-first ordering saves, for fcfs, lpm without a wait bound, and lpm with
--lpm-max-wait-steps (the default 16).

TTFT figures leave out requests that arrive in the first --warmup-s simulated seconds: at
the start nothing is cached, every policy is arrival order, and with ~5% cold requests the
few that arrive then would be the cold p99 whatever the policy (prefill counts everyone).

The engine's real scheduler, tree and memory run over the null model (no torch) on a
simulated clock: a step takes STEP_S + PREFILL_S_PER_TOKEN x its tokens, so the figures do
not depend on this machine's speed or load. Workload: 95% of requests start with one of
8 shared 1,024-token system prompts (skewed popularity), 5% are cold (fresh tokens); the
pool holds about 5 of the system prompts, so the order of admission decides what is evicted.

    PYTHONPATH=. python scripts/bench_fairness.py [--requests 6000] [--rate 200] [--seeds 0,1,2]

Prints, per policy: the prompt-token hit rate, prefill tokens computed, hot and cold median
TTFT, cold p99 TTFT and its ratio to the overall median, and the share of lpm's prefill
saving (against fcfs) that each policy keeps.
"""

from __future__ import annotations

import argparse
import random
import statistics

from radixserve.engine.null_model import NullRunner, null_core
from radixserve.engine.request import new_request
from radixserve.engine.sampling_params import SamplingParams

STEP_S = 0.004
PREFILL_S_PER_TOKEN = 0.00002
SYSTEMS, SYSTEM_TOKENS, SUFFIX_TOKENS, COLD_TOKENS, MAX_TOKENS = 8, 2048, 16, 512, 16
POOL_PAGES = 16384
COLD_SHARE = 0.05


def workload(n: int, rate: float, seed: int) -> list[tuple[float, list[int], bool]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 30000) for _ in range(SYSTEM_TOKENS)] for _ in range(SYSTEMS)]
    weights = [1 / (i + 1) for i in range(SYSTEMS)]
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        suffix = [rng.randrange(3, 30000) for _ in range(SUFFIX_TOKENS)]
        if rng.random() < COLD_SHARE:
            out.append((t, [rng.randrange(3, 30000) for _ in range(COLD_TOKENS)], True))
        else:
            out.append((t, rng.choices(systems, weights)[0] + suffix, False))
    return out


class FirstTokens:
    """Each request's first-token time on the simulated clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self.at: dict[str, float] = {}

    def emit(self, out) -> None:
        if out.token_ids:
            self.at.setdefault(out.request_id, self.now)


def run(policy: str, max_wait_steps: int, requests, seed: int, warmup_s: float = 0.0) -> dict:
    core = null_core(num_pages=POOL_PAGES, max_running=64, token_budget=2048, policy=policy)
    core.scheduler.config.max_wait_steps = max_wait_steps
    runner = NullRunner(seed=seed)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0)
    clock = FirstTokens()
    i, computed = 0, 0
    live: dict[str, tuple[float, bool]] = {}
    while i < len(requests) or core.scheduler.has_work():
        while i < len(requests) and requests[i][0] <= clock.now:
            arrival, prompt, cold = requests[i]
            live[f"r{i}"] = (arrival, cold)
            core.add(new_request(f"r{i}", prompt, params, None, clock.emit, 1,
                                 arrival_time=arrival))
            i += 1
        if not core.scheduler.has_work():
            clock.now = requests[i][0]
            continue
        plan = core.schedule()
        if not plan.batch:
            clock.now += STEP_S
            continue
        computed += sum(n for n in plan.new_lens if n > 1)      # prefill tokens
        clock.now += STEP_S + PREFILL_S_PER_TOKEN * plan.batch.num_tokens
        core.complete(plan, runner.execute(plan.batch))
    first = clock.at
    stats = core.scheduler.stats
    ttft = {rid: first[rid] - arrival for rid, (arrival, _) in live.items() if arrival >= warmup_s}
    cold = sorted(ttft[r] for r, (_, c) in live.items() if c and r in ttft)
    hot = sorted(ttft[r] for r, (_, c) in live.items() if not c and r in ttft)
    everyone = sorted(ttft.values())
    return {"hit": stats.prefix_hit_tokens / max(1, stats.prefix_query_tokens),
            "computed": computed, "hot_median": statistics.median(hot),
            "cold_median": statistics.median(cold), "cold_p99": cold[int(0.99 * (len(cold) - 1))],
            "median": statistics.median(everyone)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=6000)
    ap.add_argument("--rate", type=float, default=200.0,
                    help="arrivals per simulated second (200: more than fcfs can serve)")
    ap.add_argument("--seeds", default="0,1,2", help="workloads to run, one table each")
    ap.add_argument("--warmup-s", type=float, default=1.0,
                    help="simulated seconds of arrivals left out of the TTFT figures")
    ap.add_argument("--bound", type=int, default=16, help="--lpm-max-wait-steps to test")
    args = ap.parse_args()
    for seed in (int(x) for x in args.seeds.split(",")):
        report(args, seed)


def report(args: argparse.Namespace, seed: int) -> None:
    rate = args.rate
    requests = workload(args.requests, rate, seed)
    results = {"fcfs": run("fcfs", 10**9, requests, seed, args.warmup_s),
               "lpm, no bound": run("lpm", 10**9, requests, seed, args.warmup_s),
               f"lpm, bound {args.bound}": run("lpm", args.bound, requests, seed, args.warmup_s)}
    saved = results["fcfs"]["computed"] - results["lpm, no bound"]["computed"]
    print(f"seed {seed}: {args.requests} requests at {rate:.1f}/s (simulated), "
          f"{COLD_SHARE:.0%} cold, TTFT of arrivals after {args.warmup_s:g} s; "
          f"TTFT in simulated ms")
    print(f"{'policy':<16} {'hit':>6} {'prefill':>10} {'all p50':>8} {'hot p50':>8} "
          f"{'cold p50':>9} {'cold p99':>9} {'p99/cold p50':>13} {'saving kept':>12}")
    for name, r in results.items():
        kept = (results["fcfs"]["computed"] - r["computed"]) / saved if saved > 0 else float("nan")
        print(f"{name:<16} {r['hit']:>6.3f} {r['computed']:>10} {1e3 * r['median']:>8.1f} "
              f"{1e3 * r['hot_median']:>8.1f} {1e3 * r['cold_median']:>9.1f} "
              f"{1e3 * r['cold_p99']:>9.1f} {r['cold_p99'] / r['cold_median']:>13.2f} "
              f"{kept:>12.3f}")
    print()


if __name__ == "__main__":
    main()
