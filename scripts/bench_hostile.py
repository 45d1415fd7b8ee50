"""The hostile-input mix of issue 20 against `radixserve serve` from one or more checkouts,
side by side: an unrelated probe stream's chunk gaps while the mix arrives, and the
server's RSS over a run of refused 5 MB prompts.

    git worktree add /tmp/base a3700ee      # the code before issue 20
    python scripts/bench_hostile.py --checkout before=/tmp/base --checkout after=. \
        --extra "after=--header-timeout-s 2 --body-timeout-s 2"

Each checkout's server runs from its own directory (its `radixserve/` wins on sys.path),
with flags both old and new servers know. Clients wait at most --client-timeout-s, so a
server without read timeouts shows as held connections instead of hanging the run.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.server.hostile import (HELD, Outcome, Probe, hostile_cases,  # noqa: E402
                                  rss_bytes, run_case)
from tests.server import http  # noqa: E402

BIG_PROMPT = {"prompt": "word " * (1024 * 1024), "max_tokens": 4}     # 5 MB of text


def start(checkout: Path, extra: list[str], args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", "0",
           "--model", args.model, "--dtype", args.dtype, "--device", "cpu",
           "--kv-cache-tokens", "8192", "--max-model-len", "2048", *extra]
    proc = subprocess.Popen(cmd, cwd=checkout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1",
                                            "PYTHONPATH": str(checkout)})
    for line in iter(proc.stdout.readline, ""):
        if m := re.search(r"on (http://127\.0\.0\.1:\d+)", line):
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, m.group(1)
    raise RuntimeError(f"{checkout}: the server did not start")


def gap_summary(gaps: list[float]) -> str:
    if not gaps:
        return "no chunks"
    q = statistics.quantiles(gaps, n=100) if len(gaps) > 1 else gaps * 99
    return (f"{len(gaps)} gaps: median {statistics.median(gaps) * 1000:.0f} ms, "
            f"p99 {q[98] * 1000:.0f} ms, longest {max(gaps) * 1000:.0f} ms")


def measure(name: str, checkout: Path, extra: list[str], args: argparse.Namespace) -> dict:
    proc, url = start(checkout, extra, args)
    try:
        warm = Probe(url).start()
        warm.streamed.wait(300)
        warm.stop()
        baseline = warm.gaps
        cases = hostile_cases(args.client_timeout_s)
        rss = [rss_bytes(proc.pid)]
        probe = Probe(url).start()
        t0 = time.monotonic()
        with ThreadPoolExecutor(len(cases)) as pool:
            outcomes: list[Outcome] = list(pool.map(lambda c: run_case(url, c), cases))
        mix_s = time.monotonic() - t0
        refused = []
        for _ in range(args.big_prompts):
            r = http.post(url + "/v1/completions", json=BIG_PROMPT, timeout=300)
            refused.append(r.status)
            rss.append(rss_bytes(proc.pid))
        probe.stop()
        health = http.get(url + "/health", timeout=30).status
        return {"name": name, "baseline": baseline, "gaps": probe.gaps, "mix_s": mix_s,
                "outcomes": outcomes, "rss": rss, "refused": refused, "health": health,
                "expected": [c.expect for c in cases]}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def report(results: list[dict]) -> None:
    print("\n## Probe stream (chunk gaps)")
    for r in results:
        print(f"- {r['name']}: alone {gap_summary(r['baseline'])}; during the mix and the "
              f"refused prompts {gap_summary(r['gaps'])}")
    print("\n## RSS over refused 5 MB prompts (MiB; first value before any)")
    for r in results:
        print(f"- {r['name']}: " + " ".join(f"{x / 2**20:.0f}" for x in r["rss"]) +
              f"  (statuses {sorted(set(r['refused']))})")
    print("\n## Hostile mix: status (seconds)")
    names = [o.name for o in results[0]["outcomes"]]
    print("| case | " + " | ".join(r["name"] for r in results) + " |")
    print("|---|" + "---|" * len(results))
    for i, case in enumerate(names):
        cells = []
        for r in results:
            o = r["outcomes"][i]
            status = o.status if o.status is not None else ("held" if o.body == HELD else "closed")
            cells.append(f"{status} ({o.seconds:.1f} s)")
        print(f"| {case} | " + " | ".join(cells) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkout", action="append", required=True, metavar="NAME=DIR")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--big-prompts", type=int, default=10)
    ap.add_argument("--client-timeout-s", type=float, default=20.0)
    ap.add_argument("--extra", action="append", default=[], metavar="NAME=ARGS",
                    help="more server flags for one checkout (flags the other may not know)")
    args = ap.parse_args()
    extras = {name: value.split() for name, _, value in (e.partition("=") for e in args.extra)}
    results = []
    for spec in args.checkout:
        name, _, directory = spec.partition("=")
        results.append(measure(name, Path(directory).resolve(), extras.get(name, []), args))
        print(f"{name}: done", file=sys.stderr, flush=True)
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
