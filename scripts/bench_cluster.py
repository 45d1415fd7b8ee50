"""Routers side by side on a local Ray cluster: prefill work and hit rate, not throughput.

For each configuration -- N replicas under each `--router` policy, and one replica holding
the same total KV -- the script deploys radixserve's replicas on Ray Serve, serves them
through radixserve's own HTTP front end (in this process, on 127.0.0.1), and sends the
shared-prefix, multi-turn and few-shot workloads of scripts/bench_serving.py (same
generators, same client), flushing every replica first. It reports, per workload and
configuration: cluster-wide prompt tokens computed (looked up minus hit, from /metrics),
token hit rate, TTFT p50/p90, requests per replica (max, mean, max/mean), and for the
cache-aware router its view lag (a request's completion to the router's digest holding its
prompt) and routing cost per decision.

  python scripts/bench_cluster.py                 # 4 replicas, every router, all workloads
  python scripts/bench_cluster.py --quick         # tiny workloads: a smoke run
  python scripts/bench_cluster.py --routers cache-aware,round-robin --workloads few-shot
  python scripts/bench_cluster.py --routers cache-aware --load-bounds 1.25+2,1+1,inf
  python scripts/bench_cluster.py --share off,ray,dir   # issue 38: KV moves between replicas
  python scripts/bench_cluster.py --full          # the bounded full run, targets checked

`--full` is issue 38's whole Show list in one bounded run: every router x --share
off,ray,dir x the three workloads at FULL_SIZES (shared-prefix 4 groups x 4 prompts of a
384-token system prompt, multi-turn 4 conversations x 3 turns, few-shot unchanged at 16
questions on a ~1,000-token prefix, 8 output tokens), plus one replica holding the KV of
four on every workload (the "one replica's" reference of the few-shot targets, and each
workload's maximum possible saved); it ends with a PASS/FAIL line per target (`targets`).
Trimmed to aim at about 12 minutes on an idle 2-core machine; it took 1,407 s on a busy
one (docs/benchmarks.md).

Saved prompt tokens (`saved`: prompt tokens less those computed, i.e. hits plus loads) are
printed per configuration, and each workload's header names the maximum possible: what
the one replica holding the KV of all of them saved (one cache that sees every request
computes each prefix once; no cluster can save more).

With `--share`, every router runs once per cluster store (--kv-share off | ray | a fresh
shared directory), side by side; a prompt token a replica loaded from a peer's pages counts
as cached (it was not computed), so "computed" is the cluster's prefill work with sharing.
`prefix-affinity` is Ray Serve LLM's own PrefixCacheAffinityRouter (when importable).

Needs the ray extra (pip install -e '.[ray]'). Replicas are CPU processes of one thread
each (--replica-cpus); on a 2-core machine 4 replicas share the cores, so latencies are
long and noisy: compare computed tokens and hit rates, which do not depend on speed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_serving as bs                                           # noqa: E402

from radixserve.cluster.options import ROUTER_CHOICES, ClusterOptions, import_launch  # noqa: E402
from radixserve.cluster.prefix_hashes import matched_blocks, prompt_hashes  # noqa: E402
from radixserve.engine.config import EngineConfig                    # noqa: E402
from radixserve.engine.sampling_params import SamplingParams         # noqa: E402
from radixserve.routing import LoadBound                             # noqa: E402
from radixserve.server.app import (ServerConfig, ServerState, bound_address,  # noqa: E402
                                   drain_and_stop, start_server)

WORKLOADS = ("shared-prefix", "multi-turn", "few-shot")
SHARES = ("off", "ray", "dir")
FULL_SIZES = bs.Sizes(groups=4, prompts_per_group=4, system_len=384, question_len=32,
                      output_len=8, conversations=4, turns=3, turn_len=32,
                      fewshot_len=1024, fewshot_questions=16)
SINGLE = "1 replica"                # the one-replica configuration's name starts so


def build_workloads(names: list[str], sizes: bs.Sizes, seed: int) -> list[tuple[str, list]]:
    make = {"shared-prefix": bs.shared_prefix_workload, "multi-turn": bs.multiturn_workload,
            "few-shot": bs.fewshot_workload}
    return [(n, make[n](sizes, seed)) for n in names]


def sent_per_replica(client) -> dict[str, int]:
    """Requests the router dispatched to each replica (robust to a replica's stats going
    missing for a while on a loaded machine)."""
    with client.state.lock:
        return dict(client.state.sent)


async def measure_view_lag(client, samples: int = 5) -> dict:
    """Seconds from a request's last output to the router's digest holding its prompt."""
    lags = []
    for i in range(samples):
        ids = [5000 + 97 * i + j for j in range(4 * client.state.block_tokens)]
        hashes = prompt_hashes(ids, client.state.block_tokens, None)
        async for _ in client.generate(ids, SamplingParams(max_tokens=1)):
            pass
        done = time.time()
        while True:
            with client.state.lock:
                held = any(s.digest is not None and
                           matched_blocks(hashes, s.digest.hashes) == len(hashes)
                           for s in client.state.replicas.values())
            if held:
                lags.append(time.time() - done)
                break
            await asyncio.sleep(0.005)
    return {"view_lag_ms_p50": 1000 * statistics.median(lags),
            "view_lag_ms_max": 1000 * max(lags)}


async def run_config(name: str, options: ClusterOptions, engine_config: EngineConfig,
                     workloads: list, args) -> dict:
    launch = import_launch()
    if engine_config.kv_share == "ray":
        launch.start_ray(options)
        from radixserve.share.ray_store import clear_directory

        clear_directory()                   # the last configuration's pages: not ours
    t0 = time.perf_counter()
    client = launch.deploy(engine_config, options)
    await client.start()
    state = ServerState.create(client, ServerConfig(port=0))
    server = await start_server(state, "127.0.0.1", 0)
    host, port = bound_address(server)
    url = f"http://{host}:{port}"
    print(f"[{name}] {options.replicas} replica(s) up in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)
    out: dict = {"config": name, "replicas": options.replicas, "router": options.router,
                 "kv_tokens_per_replica": engine_config.kv_cache_tokens, "workloads": {},
                 "share": engine_config.kv_share}
    shared_before = None
    if args.decisions:
        client.state.decision_log = []
    if args.replay:
        client.state.request_log = []
    ends = []                               # where each workload's requests end in the log
    try:
        for wname, workload in workloads:
            logged = len(client.state.decision_log or ())
            before = sent_per_replica(client)
            decisions0, seconds0 = client.state.decisions, client.state.decision_seconds
            run = await bs.run_workload(bs.ClientConfig(url, ""), workload,
                                        bs.RunOptions(max_concurrency=args.max_concurrency,
                                                      seed=args.seed, warmup=0),
                                        progress=False)
            after = sent_per_replica(client)
            s = bs.summarize(run)
            ids = sorted(set(after) | set(client.replica_ids()))
            per = [after.get(r, 0) - before.get(r, 0) for r in ids]
            mean = sum(per) / len(per) if per else 0.0
            decisions = client.state.decisions - decisions0
            out["workloads"][wname] = {
                "completed": s["completed"], "failed": s["failed"],
                # from each response's usage (cached_tokens), not from /metrics: exact
                # even if a replica restarts and its counters start again
                "prompt_tokens": s["total_prompt_tokens"],
                "computed_tokens": s["total_prompt_tokens"] - s["cached_prompt_tokens"],
                "token_hit_rate": s["hit_rate_usage"],
                "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p90_ms": s["ttft_ms"]["p90"],
                "requests_per_replica": per,
                "requests_max_over_mean": max(per) / mean if mean else None,
                "decision_us": 1e6 * (client.state.decision_seconds - seconds0) / decisions
                if decisions else None,
            }
            if args.decisions:
                out["workloads"][wname]["decisions"] = [
                    dataclasses.asdict(d) for d in client.state.decision_log[logged:]]
            if engine_config.kv_share != "off":
                out["workloads"][wname]["share"] = await share_figures(client, shared_before)
                shared_before = out["workloads"][wname]["share"]["total"]
            ends.append(len(client.state.request_log or ()))
            print(f"[{name}] {wname}: {json.dumps(out['workloads'][wname])}", file=sys.stderr)
        if args.replay:
            replayed = replay_run(client, ends, options, engine_config, args)
            for (wname, _), own, measured in zip(workloads, replayed["own"],
                                                 replayed["measured"]):
                out["workloads"][wname]["replay"] = {"own": own, "measured": measured}
        if options.router == "cache-aware":
            out["view_lag"] = await measure_view_lag(client)
    finally:
        await drain_and_stop(server, 1.0)
        await client.shutdown()
    return out


def replay_run(client, ends: list[int], options: ClusterOptions,
               engine_config: EngineConfig, args) -> dict:
    """--replay: the replay's figures on the requests this configuration dispatched."""
    from cluster_replay import ReplaySetup, replay_workloads

    from radixserve.replay.cluster import ServiceModel

    log = list(client.state.request_log)
    setup = ReplaySetup(sorted({s.replica_id for s in log} | set(client.replica_ids())),
                        options.router, engine_config.kv_cache_tokens,
                        engine_config.kv_share != "off", options.load_bound,
                        client.state.block_tokens, args.output_tokens,
                        ServiceModel(args.replay_prefill_s, args.replay_decode_s))
    return replay_workloads(log, ends, setup)


async def share_figures(client, before: dict | None) -> dict:
    """--kv-share: what the replicas moved through the cluster store during one workload
    (the difference of their summed counters), and the running total."""
    from radixserve.cluster.client import sum_stats

    replicas = await client.refresh_stats()
    share = sum_stats(list(replicas.values())).share
    total = {k: getattr(share, k) for k in ("loaded_tokens", "bytes_fetched", "load_seconds",
                                            "published_pages", "refused_pages",
                                            "forgotten_pages", "claimed_pages", "waits",
                                            "wait_seconds", "waits_expired", "skipped_slow",
                                            "lookups_late")}
    delta = {k: v - (before or {}).get(k, 0) for k, v in total.items()}
    delta["load_ms_per_token"] = (1e3 * delta["load_seconds"] / delta["loaded_tokens"]
                                  if delta["loaded_tokens"] else None)
    per_replica = {rid: {k: getattr(st.share, k) for k in ("loaded_tokens", "waits",
                                                            "lookups_late", "claimed_pages")}
                   for rid, st in replicas.items() if st.share is not None}
    return {**delta, "total": total, "per_replica_total": per_replica}


def waits_column(share: dict | None) -> str:
    """Claims: admissions that waited for a peer's pages / those whose wait ran out."""
    return "-" if not share else f"{share['waits']}/{share['waits_expired']}"


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def saved(m: dict) -> int:
    """Prompt tokens a configuration did not compute: its hits, loads included."""
    return m["prompt_tokens"] - m["computed_tokens"]


def max_saved(results: list[dict], workload: str) -> int | None:
    """The most any configuration could save on `workload`: the one replica's (it holds
    the KV of all the replicas, so it computes each prefix once); None if it did not run."""
    single = next((r for r in results if r["config"].startswith(SINGLE)), None)
    m = (single or {}).get("workloads", {}).get(workload)
    return None if m is None else saved(m)


def report(results: list[dict], workload_names: list[str]) -> str:
    lines = []
    for w in workload_names:
        most = max_saved(results, w)
        lines.append(f"\n{w}" + ("" if most is None else
                                 f" (maximum possible saved: {most}, one replica's)"))
        lines.append(f"  {'configuration':<38}{'computed':>10}{'saved':>8}{'hit rate':>10}"
                     f"{'TTFT p50':>10}"
                     f"{'TTFT p90':>10}{'req/replica max/mean':>24}{'us/decision':>13}"
                     f"{'loaded':>9}{'ms/tok':>8}{'waits/expired':>15}")
        for r in results:
            m = r["workloads"].get(w)
            if m is None:                   # a configuration that did not run it
                continue
            per = m["requests_per_replica"]
            spread = (f"{max(per)}/{sum(per) / len(per):.1f} = "
                      f"{fmt(m['requests_max_over_mean'], '.2f')}") if per else "-"
            lines.append(f"  {r['config']:<38}{fmt(m['computed_tokens'], '.0f'):>10}"
                         f"{saved(m):>8}{fmt(m['token_hit_rate'], '.3f'):>10}"
                         f"{fmt(m['ttft_p50_ms'], '.0f'):>10}{fmt(m['ttft_p90_ms'], '.0f'):>10}"
                         f"{spread:>24}{fmt(m['decision_us'], '.0f'):>13}"
                         f"{fmt(m.get('share', {}).get('loaded_tokens'), '.0f'):>9}"
                         f"{fmt(m.get('share', {}).get('load_ms_per_token'), '.3f'):>8}"
                         f"{waits_column(m.get('share')):>15}")
    if any("replay" in m for r in results for m in r["workloads"].values()):
        lines.append(replay_report(results, workload_names))
    for r in results:
        if "view_lag" in r:
            lag = r["view_lag"]
            lines.append(f"\n{r['config']}: view lag p50 {lag['view_lag_ms_p50']:.0f} ms, "
                         f"max {lag['view_lag_ms_max']:.0f} ms")
    return "\n".join(lines)


def replay_report(results: list[dict], workload_names: list[str]) -> str:
    """--replay: measured, then the replay with its own routing and with the measured one."""
    lines = ["\nreplay vs measured (computed prompt tokens / hit rate counting loads / "
             "loaded tokens / req max/mean)"]
    for w in workload_names:
        lines.append(f"\n{w}")
        lines.append(f"  {'configuration':<38}{'measured':>30}{'replay, own routing':>30}"
                     f"{'replay, measured routing':>30}")
        for r in results:
            m = r["workloads"].get(w, {})
            if "replay" not in m:
                continue
            loaded = m.get("share", {}).get("loaded_tokens", 0)
            cells = [(m["computed_tokens"], m["token_hit_rate"], loaded,
                      m["requests_max_over_mean"])]
            cells += [(p["computed_tokens"], p["token_hit_rate"], p["loaded_tokens"],
                       p["requests_max_over_mean"])
                      for p in (m["replay"]["own"], m["replay"]["measured"])]
            text = [f"{c} / {fmt(h, '.3f')} / {lo} / {fmt(s, '.2f')}" for c, h, lo, s in cells]
            lines.append(f"  {r['config']:<38}" + "".join(f"{t:>30}" for t in text))
    return "\n".join(lines)


def targets(results: list[dict]) -> list[str]:
    """Issue 38's Show list, checked on a run's results: one PASS/FAIL line per target.

    few-shot, each router with each store: computed <= the one replica's (the prefix once
    plus the questions; 1% slack for the 16-token routing block), hit rate counting loads
    >= 95% of the one replica's, max/mean requests per replica <= 1.3. shared-prefix and
    multi-turn, each router with each store: computed <= the same router without a store.
    Every workload: cache-aware with each store saves more prompt tokens (hits plus loads)
    than prefix-affinity without one, at an equal or lower max/mean; where prefix-affinity
    already saves the maximum possible (the one replica's), equal to it is the most there
    is, and the line says so ("= the maximum")."""
    by = {(r["router"], r["share"].split(":")[0]): r for r in results
          if not r["config"].startswith(SINGLE)}
    single = next((r for r in results if r["config"].startswith(SINGLE)), None)
    lines = []

    def check(ok: bool, text: str) -> None:
        lines.append(f"  {'PASS' if ok else 'FAIL'}  {text}")

    one = (single or {}).get("workloads", {}).get("few-shot")
    for (router, share), r in by.items():
        if share == "off":
            continue
        for w, m in r["workloads"].items():
            name = f"{w}, {router} share={share}"
            if w == "few-shot" and one is not None:
                check(m["computed_tokens"] <= 1.01 * one["computed_tokens"],
                      f"{name}: computed {m['computed_tokens']} vs one replica's "
                      f"{one['computed_tokens']}")
                check(m["token_hit_rate"] >= 0.95 * one["token_hit_rate"],
                      f"{name}: hit rate {m['token_hit_rate']:.3f} >= 95% of one replica's "
                      f"{one['token_hit_rate']:.3f}")
                check((m["requests_max_over_mean"] or 0) <= 1.3,
                      f"{name}: max/mean {fmt(m['requests_max_over_mean'], '.2f')} <= 1.3")
            off = by.get((router, "off"), {}).get("workloads", {}).get(w)
            if w != "few-shot" and off is not None:
                check(m["computed_tokens"] <= off["computed_tokens"],
                      f"{name}: computed {m['computed_tokens']} <= {off['computed_tokens']} "
                      "without a store")
    ray_affinity = by.get(("prefix-affinity", "off"))
    for share in ("ray", "dir"):
        ca = by.get(("cache-aware", share))
        if ca is None or ray_affinity is None:
            continue
        for w, m in ca["workloads"].items():
            ref = ray_affinity["workloads"].get(w)
            if ref is None:
                continue
            most = max_saved(results, w)
            at_max = most is not None and saved(m) >= most
            check((saved(m) > saved(ref) or at_max) and (m["requests_max_over_mean"] or 0)
                  <= (ref["requests_max_over_mean"] or 0),
                  f"{w}, cache-aware share={share} vs prefix-affinity without: saved "
                  f"{saved(m)}{' = the maximum' if at_max else ''} vs {saved(ref)} "
                  f"(maximum possible {fmt(most, 'd')}), max/mean "
                  f"{fmt(m['requests_max_over_mean'], '.2f')} vs "
                  f"{fmt(ref['requests_max_over_mean'], '.2f')}")
    return ["\ntargets (issue 38)"] + lines if lines else []


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--routers", default=",".join(ROUTER_CHOICES),
                   help="comma-separated --router policies to compare")
    p.add_argument("--load-bounds", default=str(LoadBound()), metavar="C[+S],...",
                   help="cache-aware: one configuration per --router-load-bound value")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--no-single", action="store_true",
                   help="skip the one-replica baseline (same total KV)")
    p.add_argument("--kv-tokens", type=int, default=3072, help="KV pool per replica")
    p.add_argument("--replica-cpus", type=float, default=0.5,
                   help="Ray CPUs per replica (torch threads: 1 below 2)")
    p.add_argument("--ray-cpus", type=int, default=None,
                   help="logical CPUs of the local Ray (default: enough for the replicas)")
    p.add_argument("--routing-stats-period-s", type=float, default=0.1)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny workloads: a smoke run")
    p.add_argument("--full", action="store_true",
                   help="issue 38's bounded full run: every router x --share off,ray,dir x "
                        "the three workloads at FULL_SIZES, one replica on each, targets "
                        "checked (1,407 s on a busy 2-core machine)")
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--decisions", action="store_true",
                   help="cache-aware: record what the score saw at each decision (held, "
                        "loadable, in flight, queued seconds, score per replica) in --json")
    p.add_argument("--replay", action="store_true",
                   help="replay each configuration's dispatched requests in the replay's "
                        "cluster simulation (--replicas N [--share]): its own routing and "
                        "the measured routing, beside the measured figures")
    p.add_argument("--replay-prefill-s", type=float, default=3e-3,
                   help="--replay service model: seconds per computed prompt token")
    p.add_argument("--replay-decode-s", type=float, default=0.05,
                   help="--replay service model: seconds per output token")
    p.add_argument("--share", default="off", metavar="off,ray,dir",
                   help="cluster stores to compare (--kv-share): each router runs once per "
                        "store; dir is a fresh temporary directory per configuration")
    return p


async def main_async(args) -> list[dict]:
    if args.full:
        args.routers, args.share = ",".join(ROUTER_CHOICES), ",".join(SHARES)
        args.workloads, args.no_single = ",".join(WORKLOADS), False
    sizes = bs.QUICK_SIZES if args.quick else FULL_SIZES if args.full else bs.Sizes()
    args.output_tokens = sizes.output_len           # every workload's max_tokens (--replay)
    names = args.workloads.split(",")
    workloads = build_workloads(names, sizes, args.seed)
    started = time.perf_counter()
    ray_cpus = args.ray_cpus or max(2, int(args.replicas * args.replica_cpus + 1))

    shares = args.share.split(",")
    if any(s not in ("off", "ray", "dir") for s in shares):
        raise SystemExit(f"--share: a comma list of off, ray, dir; got {args.share!r}")
    scratch = Path(tempfile.mkdtemp(prefix="bench-share-"))

    def engine(kv_tokens: int, share: str = "off") -> EngineConfig:
        if share == "dir":
            share = f"dir:{tempfile.mkdtemp(dir=scratch)}"
        return EngineConfig(model=args.model, dtype="float32", device="cpu",
                            kv_cache_tokens=kv_tokens, warmup_tokens=64, kv_share=share)

    def options(replicas: int, router: str, name: str,
                load_bound: LoadBound = LoadBound()) -> ClusterOptions:
        return ClusterOptions(replicas=replicas, router=router, num_cpus=ray_cpus,
                              replica_cpus=args.replica_cpus, app_name=f"bench-{name}",
                              routing_stats_period_s=args.routing_stats_period_s,
                              load_bound=load_bound)

    results = []
    if not args.no_single:
        name = f"{SINGLE}, {args.replicas}x KV"
        results.append(await run_config(name, options(1, "round-robin", "single"),
                                         engine(args.kv_tokens * args.replicas), workloads,
                                         args))
    for router in args.routers.split(","):
        bounds = [LoadBound.parse(c) for c in args.load_bounds.split(",")] \
            if router == "cache-aware" else [LoadBound()]
        for c in bounds:
            for share in shares:
                name = f"{args.replicas} x {router}" + \
                    (f" {c}" if router == "cache-aware" else "") + \
                    (f" share={share}" if share != "off" else "")
                app = f"{router}-{c}-{share}".replace(".", "_").replace("+", "-")
                results.append(await run_config(name, options(args.replicas, router, app, c),
                                                 engine(args.kv_tokens, share), workloads,
                                                 args))
    shutil.rmtree(scratch, ignore_errors=True)
    print(report(results, names))
    print("\n".join(targets(results)))
    print(f"\nrun time {time.perf_counter() - started:.0f} s")
    return results


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    results = asyncio.run(main_async(args))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
