"""The hostile-input mix of issue 20 against `radixserve serve` from one or more checkouts,
side by side: an unrelated probe stream's chunk gaps while the mix arrives, and the
server's RSS over a run of refused 5 MB prompts.

    git worktree add /tmp/base a3700ee      # the code before issue 20
    python scripts/bench_hostile.py --checkout before=/tmp/base --checkout after=. \
        --extra "after=--header-timeout-s 2 --body-timeout-s 2"

Each checkout's server runs from its own directory (its `radixserve/` wins on sys.path),
with flags both old and new servers know. Clients wait at most --client-timeout-s, so a
server without read timeouts shows as held connections instead of hanging the run.

The big-body control run (issue 39), printed for each checkout: the probe streams from the
server while one client posts the big bodies of the mix (5 MB prompt, 200,000 messages,
megabytes of stop strings) in turn to a sink (another process that reads and drops them:
the control, which costs the client and the machine the same) and to the server; the
server's extra gap is the difference. Phases alternate (sink, server, sink, server, ...)
so that drift in the machine's load falls on both. `--control-only` runs just this. Beside
the gaps, per phase: the server's CPU and its event loop thread's CPU (what the loop spends
on the bodies, holding the GIL the compute thread needs: an upper bound on what the bodies
add to a chunk's gap that load on the machine hardly disturbs) and the bodies posted (a
body the server refuses unread returns sooner, so more of them are posted per chunk).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.server.hostile import (HELD, Outcome, Probe, hostile_cases,  # noqa: E402
                                  rss_bytes, run_case, stop_server)
from tests.server import http  # noqa: E402

BIG_PROMPT = {"prompt": "word " * (1024 * 1024), "max_tokens": 4}     # 5 MB of text


def start(checkout: Path, extra: list[str], args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", "0",
           "--decode-compile", "off",
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
        sink, sink_url = start_sink()
        try:
            control = big_body_phases(url, sink_url, args.control_rounds, args.client_timeout_s,
                                      args.phase_chunks, proc.pid, args.body_interval_s)
        finally:
            sink.kill()
            sink.wait()
        if args.control_only:
            return {"name": name, "control": control}
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
                "expected": [c.expect for c in cases], "control": control}
    finally:
        stop_server(proc)


BIG_BODY_CASES = ("5 MB prompt", "200,000 messages", "17 stop strings of 450 KB",
                  "1 MB stop string", "10,000 stop strings")


def sink_main(port_file: str) -> None:
    """The control's sink: reads each body whole and answers 400, nothing else."""
    from aiohttp import web

    async def drop(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"error": {"message": "sink"}}, status=400)

    async def serve() -> None:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/{tail:.*}", drop)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        Path(port_file).write_text(str(runner.addresses[0][1]))
        await asyncio.Event().wait()
    asyncio.run(serve())


def start_sink() -> tuple[subprocess.Popen, str]:
    port_file = Path(f"/tmp/bench_hostile_sink_{os.getpid()}")
    port_file.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, __file__, "--sink", str(port_file)])
    while not port_file.exists() or not port_file.read_text():
        if proc.poll() is not None:
            raise RuntimeError("the sink did not start")
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port_file.read_text()}"
    port_file.unlink()
    return proc, url


def cpu_seconds(pid: int, thread: int | None = None) -> float:
    """User + system CPU time of a process, all its threads (/proc/PID/stat), or of one of
    its threads (/proc/PID/task/TID/stat; the main thread's id is the pid: the server's
    event loop, which holds the GIL while it reads, parses and refuses bodies)."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    fields = Path(path).read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def big_body_phases(url: str, sink_url: str, rounds: int, client_timeout_s: float,
                    phase_chunks: int = 10, server_pid: int | None = None,
                    body_interval_s: float = 0.0) -> dict:
    """Probe gaps on `url` while one client posts the big bodies to the sink, then to the
    server, alternating `rounds` times; a phase repeats the bodies until the probe has
    streamed `phase_chunks` chunks during it (a busy machine streams slowly). Each phase
    also records the server process's CPU seconds (all threads), a measure that load on the
    machine disturbs far less than wall-clock gaps. With `body_interval_s`, bodies start at
    most one per interval in both arms (the same offered load: a body refused unread
    returns sooner, and back to back that alone posts several times more of them)."""
    cases = [c for c in hostile_cases(client_timeout_s) if c.name in BIG_BODY_CASES]
    gaps: dict[str, list[float]] = {"sink": [], "server": []}
    per_round: list[dict[str, list[float]]] = []
    # per phase: (server CPU s, its loop thread's CPU s, probe chunks, big bodies posted)
    cpu: dict[str, list[tuple[float, float, int, int]]] = {"sink": [], "server": []}
    statuses: dict[str, set] = {"sink": set(), "server": set()}
    probe = Probe(url).start()
    try:
        while not probe.gaps and not probe.failures:     # streaming: the phases can start
            time.sleep(0.05)
        for _ in range(rounds):
            per_round.append({})
            for target, target_url in (("sink", sink_url), ("server", url)):
                before, bodies = len(probe.gaps), 0
                if server_pid:
                    cpu_before = cpu_seconds(server_pid), cpu_seconds(server_pid, server_pid)
                while len(probe.gaps) - before < phase_chunks and not probe.failures:
                    for case in cases:
                        started = time.monotonic()
                        statuses[target].add(run_case(target_url, case).status)
                        bodies += 1
                        time.sleep(max(0.0, started + body_interval_s - time.monotonic()))
                phase = probe.gaps[before:]
                gaps[target] += phase
                per_round[-1][target] = phase
                if server_pid:
                    cpu[target].append((cpu_seconds(server_pid) - cpu_before[0],
                                        cpu_seconds(server_pid, server_pid) - cpu_before[1],
                                        len(phase), bodies))
    finally:
        probe.stop()
    return {"gaps": gaps, "rounds": per_round, "cpu": cpu, "statuses": statuses,
            "failures": probe.failures}


def median_gap_difference(server: list[float], sink: list[float], resamples: int = 2000,
                          seed: int = 0) -> tuple[float, float, float]:
    """The server's extra median gap and a bootstrap 95% interval for it (gaps resampled
    within each arm): an interval that holds 0 means the extra gap is within noise."""
    rng = random.Random(seed)
    diffs = sorted(statistics.median(rng.choices(server, k=len(server)))
                   - statistics.median(rng.choices(sink, k=len(sink))) for _ in range(resamples))
    return (statistics.median(server) - statistics.median(sink),
            diffs[int(0.025 * resamples)], diffs[int(0.975 * resamples) - 1])


def control_report(name: str, control: dict) -> None:
    sink, server = control["gaps"]["sink"], control["gaps"]["server"]
    print(f"\n## Big bodies to a sink (control) vs to the server: probe chunk gaps ({name})")
    print(f"- to the sink:   {gap_summary(sink)}  (statuses {sorted(control['statuses']['sink'])})")
    print(f"- to the server: {gap_summary(server)}  (statuses {sorted(control['statuses']['server'])})")
    if len(sink) > 1 and len(server) > 1:
        q_sink, q_server = statistics.quantiles(sink, n=100), statistics.quantiles(server, n=100)
        print(f"- the server's extra gap: median {1000 * (statistics.median(server) - statistics.median(sink)):+.0f} ms, "
              f"p99 {1000 * (q_server[98] - q_sink[98]):+.0f} ms, "
              f"longest {1000 * (max(server) - max(sink)):+.0f} ms")
        extra, low, high = median_gap_difference(server, sink)
        verdict = "holds 0: within noise" if low <= 0 <= high else "excludes 0"
        print(f"- the server's extra median gap, bootstrap 95% interval: {1000 * extra:+.0f} ms "
              f"[{1000 * low:+.0f}, {1000 * high:+.0f}] ({verdict})")
        rounds = [r for r in control.get("rounds", []) if r.get("sink") and r.get("server")]
        per_round = [statistics.median(r["server"]) - statistics.median(r["sink"]) for r in rounds]
        if len(per_round) > 1:
            print("- per round (server median - sink median): "
                  + ", ".join(f"{1000 * d:+.0f}" for d in per_round) + " ms; "
                  f"median {1000 * statistics.median(per_round):+.0f} ms")
    cpu = control.get("cpu", {})
    if cpu.get("sink") and cpu.get("server"):
        def per(arm: str, field: int, unit: int) -> float:
            return sum(p[field] for p in cpu[arm]) / max(1, sum(p[unit] for p in cpu[arm]))
        sink_cpu, server_cpu = per("sink", 0, 2), per("server", 0, 2)
        print(f"- server CPU seconds (all threads) per probe chunk: sink phases {sink_cpu:.3f}, "
              f"server phases {server_cpu:.3f} ({server_cpu - sink_cpu:+.3f})")
        sink_loop, server_loop = per("sink", 1, 2), per("server", 1, 2)
        # what the loop spends on the bodies holds the GIL the compute thread needs: an
        # upper bound, steady under load, of what they can add to a chunk's gap
        print(f"- its event loop's CPU seconds per probe chunk: sink phases {sink_loop:.4f}, "
              f"server phases {server_loop:.4f} ({server_loop - sink_loop:+.4f}); big bodies "
              f"per probe chunk: {per('sink', 3, 2):.1f} to the sink, "
              f"{per('server', 3, 2):.1f} to the server")

    if control["failures"]:
        print(f"- probe failures: {control['failures']}")


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
    ap.add_argument("--checkout", action="append", metavar="NAME=DIR")
    ap.add_argument("--control-rounds", type=int, default=3,
                    help="big-body phases to the sink and to the server, alternating")
    ap.add_argument("--body-interval-s", type=float, default=0.0,
                    help="control: start at most one big body per this many seconds, in both "
                         "arms (0: back to back)")
    ap.add_argument("--phase-chunks", type=int, default=10,
                    help="probe chunks each big-body phase lasts at least")
    ap.add_argument("--control-only", action="store_true", help="only the big-body control run")
    ap.add_argument("--sink", metavar="PORT_FILE", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--big-prompts", type=int, default=10)
    ap.add_argument("--client-timeout-s", type=float, default=20.0)
    ap.add_argument("--extra", action="append", default=[], metavar="NAME=ARGS",
                    help="more server flags for one checkout (flags the other may not know)")
    args = ap.parse_args()
    if args.sink:
        sink_main(args.sink)
        return 0
    if not args.checkout:
        ap.error("--checkout is required")
    extras = {name: value.split() for name, _, value in (e.partition("=") for e in args.extra)}
    results = []
    for spec in args.checkout:
        name, _, directory = spec.partition("=")
        results.append(measure(name, Path(directory).resolve(), extras.get(name, []), args))
        print(f"{name}: done", file=sys.stderr, flush=True)
    for r in results:
        control_report(r["name"], r["control"])
    if not args.control_only:
        report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
