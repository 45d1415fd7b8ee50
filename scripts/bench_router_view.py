"""The cluster router's view lag: how long after a request finishes the router knows its
replica holds the request's blocks, with `--router-view digest` and `--router-view events`
measured side by side in one run (two local Ray Serve deployments, one after the other).

    PYTHONPATH=. python scripts/bench_router_view.py [--requests 20] [--period 0.2]

Each request is a new 256-token prompt (16 blocks, none cached) sent through the real
RayEngineClient; after its last output the script polls the router's ClusterState (every
millisecond) until what a replica published (its digest, or the feed's set from its
events; not the router's own record of what it sent where) holds all its blocks. Digests arrive with Ray Serve's
routing stats every `--period` seconds; events as the replica publishes them after each step.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from radixserve.cluster.launch import deploy  # noqa: E402
from radixserve.cluster.options import ClusterOptions  # noqa: E402
from radixserve.cluster.prefix_hashes import matched_blocks, prompt_hashes  # noqa: E402
from radixserve.engine.config import EngineConfig  # noqa: E402
from radixserve.engine.sampling_params import SamplingParams  # noqa: E402


async def lags(view: str, requests: int, period: float) -> list[float]:
    options = ClusterOptions(replicas=2, num_cpus=4, replica_cpus=1,
                             routing_stats_period_s=period, app_name=f"radixserve-{view}",
                             router_view=view)
    client = deploy(EngineConfig(kv_cache_tokens=8192, warmup_tokens=0, max_model_len=1024),
                    options)
    await client.start()
    params = SamplingParams(max_tokens=1, temperature=0.0)
    out = []
    try:
        for i in range(requests + 1):
            ids = [10_000 + 300 * i + j for j in range(256)]
            hashes = prompt_hashes(ids, client.state.block_tokens, None)
            async for _ in client.generate(ids, params):
                pass
            done = time.perf_counter()
            while True:
                with client.state.lock:     # what a replica told (not the router's
                    held = max((matched_blocks(hashes, s.digest.hashes)     # own bridging)
                                for s in client.state.replicas.values()
                                if s.digest is not None), default=0)
                if held == len(hashes):
                    break
                if time.perf_counter() - done > 30:
                    raise TimeoutError(f"{view}: the view never held request {i}")
                await asyncio.sleep(0.001)
            if i:                       # the first one warms the replicas and the feed up
                out.append(time.perf_counter() - done)
    finally:
        await client.shutdown()         # removes the app (and closes the event feed)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--period", type=float, default=0.2,
                    help="--routing-stats-period-s (the digests' period)")
    args = ap.parse_args()
    import ray
    from ray import serve

    results = {}
    for view in ("digest", "events"):
        results[view] = asyncio.run(lags(view, args.requests, args.period))
    serve.shutdown()
    ray.shutdown()
    print(f"{'view':>7} {'median ms':>10} {'p90 ms':>8} {'max ms':>8}  (routing stats period "
          f"{args.period:g} s, {args.requests} requests)")
    for view, xs in results.items():
        xs = sorted(xs)
        print(f"{view:>7} {statistics.median(xs) * 1e3:>10.1f} "
              f"{xs[int(0.9 * (len(xs) - 1))] * 1e3:>8.1f} {xs[-1] * 1e3:>8.1f}")


if __name__ == "__main__":
    main()
