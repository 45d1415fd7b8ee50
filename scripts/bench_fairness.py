"""Fairness of prefix-first admission: cold requests' time to first token against the prefill
prefix-first ordering saves, for fcfs, lpm without a wait bound, and lpm with
--lpm-max-wait-steps.

The engine's real scheduler, tree and memory run over the null model (no torch) on a
simulated clock: a step takes STEP_S + PREFILL_S_PER_TOKEN x its tokens, so the figures do
not depend on this machine's speed or load. Workload: 95% of requests start with one of
8 shared 2,048-token system prompts (skewed popularity), 5% are cold (512 fresh tokens);
the pool holds about all 8 system prompts and little else, so the order of admission
decides what is evicted.

Load: a server offered more than it can serve has a queue that grows without bound
whatever the policy, so the arrival rate is stated as a share of fcfs's capacity (its
throughput with every request queued from the start, measured on the same prompts) and the
default runs below saturation (`--load 0.8`); `--load 1.2` shows overload.

TTFT figures leave out requests that arrive in the first --warmup-s simulated seconds: at
the start nothing is cached, every policy is arrival order, and with ~5% cold requests the
few that arrive then would be the cold p99 whatever the policy (prefill counts everyone).

    PYTHONPATH=. python scripts/bench_fairness.py [--requests 6000] [--load 0.8] [--seeds 0,1,2]

Prints, per seed and policy: the prompt-token hit rate, prefill tokens computed, the median
TTFT of all requests, hot and cold, the cold p99 and its ratio to the cold median and to
the median of all, and the share of lpm's prefill saving (against fcfs) each policy keeps.
Then where the cold requests' time went (mean simulated ms per cold request, all of them and
the slowest 2%): waiting for the step in progress; waiting, before (queued) and after
(overdue) the bound, in steps whose admission stopped at memory / the running cap / the
token budget / nothing (behind others in the order); and computing (admission to first
token, prefill chunks shared with the rest of the batch).

`--pool-pages` resizes the KV pool (does the tail move with memory?); `--variants
'name:bound=8,token_budget=1024;...'` adds lpm runs with other SchedulerConfig fields.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections import defaultdict

from radixserve.engine.null_model import NullRunner, null_core
from radixserve.engine.request import SeqStatus, new_request
from radixserve.engine.sampling_params import SamplingParams

STEP_S = 0.004
PREFILL_S_PER_TOKEN = 0.00002
SYSTEMS, SYSTEM_TOKENS, SUFFIX_TOKENS, COLD_TOKENS, MAX_TOKENS = 8, 2048, 16, 512, 16
POOL_PAGES = 16384
COLD_SHARE = 0.05
MAX_RUNNING, TOKEN_BUDGET = 64, 2048
PHASES = ("step in progress", "queued: memory", "queued: running cap", "queued: budget",
          "queued: other", "overdue: memory", "overdue: running cap", "overdue: budget",
          "overdue: other", "computing")


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


class Clock:
    """The simulated clock, each request's first-token time, and where each request's
    time before its first token went (PHASES)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.at: dict[str, float] = {}
        self.phases: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def emit(self, out) -> None:
        if out.token_ids:
            self.at.setdefault(out.request_id, self.now)

    def charge(self, scheduler, plan, seconds: float) -> None:
        """Charge a step's `seconds` to every request still without a first token."""
        cap = scheduler.config.max_wait_steps
        stop = plan.admission_stop or "other"
        for seq in scheduler.waiting:
            overdue = scheduler.step - seq.waiting_since >= cap
            phase = f"{'overdue' if overdue else 'queued'}: {stop}"
            if phase not in PHASES:
                phase = f"{'overdue' if overdue else 'queued'}: other"
            self.phases[seq.request.request_id][phase] += seconds
        for seq in plan.seqs:
            if seq.status is SeqStatus.RUNNING and seq.num_generated <= 1 \
                    and seq.request.request_id not in self.at:
                self.phases[seq.request.request_id]["computing"] += seconds


def run(policy: str, max_wait_steps: int, requests, seed: int, warmup_s: float = 0.0,
        token_budget: int = TOKEN_BUDGET, pool_pages: int = POOL_PAGES, **settings) -> dict:
    core = null_core(num_pages=pool_pages, max_running=MAX_RUNNING, token_budget=token_budget,
                     policy=policy)
    scheduler = core.scheduler
    scheduler.config.max_wait_steps = max_wait_steps
    for name, value in settings.items():
        if not hasattr(scheduler.config, name):
            raise SystemExit(f"--variants: SchedulerConfig has no field {name!r}")
        setattr(scheduler.config, name, value)
    runner = NullRunner(seed=seed)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0)
    clock = Clock()
    i, computed = 0, 0
    live: dict[str, tuple[float, bool]] = {}
    while i < len(requests) or scheduler.has_work():
        while i < len(requests) and requests[i][0] <= clock.now:
            arrival, prompt, cold = requests[i]
            live[f"r{i}"] = (arrival, cold)
            clock.phases[f"r{i}"]["step in progress"] += clock.now - arrival
            core.add(new_request(f"r{i}", prompt, params, None, clock.emit, 1,
                                 arrival_time=arrival))
            i += 1
        if not scheduler.has_work():
            clock.now = requests[i][0]
            continue
        plan = core.schedule()
        seconds = STEP_S + PREFILL_S_PER_TOKEN * plan.batch.num_tokens if plan.batch else STEP_S
        clock.charge(scheduler, plan, seconds)
        clock.now += seconds
        if plan.batch:
            computed += sum(n for n in plan.new_lens if n > 1)      # prefill tokens
            core.complete(plan, runner.execute(plan.batch))
    first = clock.at
    stats = scheduler.stats
    ttft = {rid: first[rid] - arrival for rid, (arrival, _) in live.items() if arrival >= warmup_s}
    cold_ids = sorted((r for r, (_, c) in live.items() if c and r in ttft), key=ttft.get)
    cold = [ttft[r] for r in cold_ids]
    hot = sorted(ttft[r] for r, (_, c) in live.items() if not c and r in ttft)
    tail = cold_ids[int(0.98 * len(cold_ids)):]
    return {"hit": stats.prefix_hit_tokens / max(1, stats.prefix_query_tokens),
            "computed": computed, "hot_median": statistics.median(hot),
            "cold_median": statistics.median(cold), "cold_p99": cold[int(0.99 * (len(cold) - 1))],
            "median": statistics.median(ttft.values()),
            "cold_phases": mean_phases(clock.phases, cold_ids),
            "tail_phases": mean_phases(clock.phases, tail),
            "throughput": len(requests) / clock.now}


def mean_phases(phases: dict[str, dict[str, float]], ids: list[str]) -> dict[str, float]:
    return {p: sum(phases[r][p] for r in ids) / max(1, len(ids)) for p in PHASES}


def capacity(requests, seed: int, token_budget: int, pool_pages: int) -> float:
    """fcfs's requests per simulated second with every request queued at time 0."""
    queued = [(0.0, prompt, cold) for _, prompt, cold in requests]
    return run("fcfs", 10**9, queued, seed, token_budget=token_budget,
               pool_pages=pool_pages)["throughput"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=6000)
    ap.add_argument("--load", type=float, default=0.8,
                    help="arrival rate as a share of fcfs's measured capacity")
    ap.add_argument("--rate", type=float, default=None,
                    help="arrivals per simulated second (overrides --load)")
    ap.add_argument("--seeds", default="0,1,2", help="workloads to run, one table each")
    ap.add_argument("--warmup-s", type=float, default=1.0,
                    help="simulated seconds of arrivals left out of the TTFT figures")
    ap.add_argument("--bound", default="16", help="--lpm-max-wait-steps to test (comma list)")
    ap.add_argument("--token-budget", type=int, default=TOKEN_BUDGET,
                    help="tokens per step (--chunked-prefill-size): bounds a step's length")
    ap.add_argument("--pool-pages", type=int, default=POOL_PAGES,
                    help="KV pool size (page = 1 token); the default holds about the 8 "
                         "system prompts and little else")
    ap.add_argument("--variants", default="",
                    help="more lpm runs with other SchedulerConfig fields: "
                         "'name:bound=8,token_budget=1024;name2:...'")
    args = ap.parse_args()
    for seed in (int(x) for x in args.seeds.split(",")):
        report(args, seed)


def parse_variants(text: str) -> list[tuple[str, dict[str, float]]]:
    """'name:bound=8,token_budget=1024;name2:...' -> [(name, {field: number})]."""
    out = []
    for variant in filter(None, text.split(";")):
        name, _, rest = variant.partition(":")
        pairs = (kv.split("=") for kv in rest.split(",") if kv)
        out.append((name, {k: float(v) if "." in v else int(v) for k, v in pairs}))
    return out


def report(args: argparse.Namespace, seed: int) -> None:
    budget = args.token_budget
    pool = args.pool_pages
    capacity_rps = capacity(workload(min(args.requests, 3000), 1.0, seed), seed, budget, pool)
    rate = args.rate or args.load * capacity_rps
    requests = workload(args.requests, rate, seed)
    results = {"fcfs": run("fcfs", 10**9, requests, seed, args.warmup_s, budget, pool),
               "lpm, no bound": run("lpm", 10**9, requests, seed, args.warmup_s, budget, pool)}
    for bound in (int(b) for b in args.bound.split(",")):
        results[f"lpm, bound {bound}"] = run("lpm", bound, requests, seed, args.warmup_s,
                                             budget, pool)
    for name, settings in parse_variants(args.variants):
        bound = settings.pop("bound", 16)
        results[name] = run("lpm", bound, requests, seed, args.warmup_s, budget, pool,
                            **settings)
    saved = results["fcfs"]["computed"] - results["lpm, no bound"]["computed"]
    print(f"seed {seed}: {args.requests} requests at {rate:.1f}/s (simulated) = "
          f"{rate / capacity_rps:.2f} x fcfs's capacity ({capacity_rps:.1f}/s), "
          f"{COLD_SHARE:.0%} cold, {budget} tokens a step, {pool} pages, "
          f"TTFT of arrivals after {args.warmup_s:g} s, simulated ms")
    print(f"{'policy':<16} {'hit':>6} {'prefill':>10} {'all p50':>8} {'hot p50':>8} "
          f"{'cold p50':>9} {'cold p99':>9} {'/cold p50':>10} {'/all p50':>9} {'saving kept':>12}")
    for name, r in results.items():
        kept = (results["fcfs"]["computed"] - r["computed"]) / saved if saved > 0 else float("nan")
        print(f"{name:<16} {r['hit']:>6.3f} {r['computed']:>10} {1e3 * r['median']:>8.1f} "
              f"{1e3 * r['hot_median']:>8.1f} {1e3 * r['cold_median']:>9.1f} "
              f"{1e3 * r['cold_p99']:>9.1f} {r['cold_p99'] / r['cold_median']:>10.2f} "
              f"{r['cold_p99'] / r['median']:>9.2f} {kept:>12.3f}")
    print("where cold requests' time went (mean simulated ms per request: all cold / slowest 2%)")
    print(f"{'policy':<16} " + " ".join(f"{p:>20}" for p in PHASES))
    for name, r in results.items():
        print(f"{name:<16} " + " ".join(
            f"{1e3 * r['cold_phases'][p]:>9.1f} /{1e3 * r['tail_phases'][p]:>8.1f}"
            for p in PHASES))
    print(flush=True)


if __name__ == "__main__":
    main()
