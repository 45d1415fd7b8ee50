"""Soak: `radixserve serve` under a mixed load for a chosen duration, watching for leaks.

    python scripts/soak.py --duration-s 1800          # the figures in docs/benchmarks.md
    python scripts/soak.py --duration-s 120 --every-kind  # what tests/server/test_soak_script.py runs

The server runs as a subprocess with a small KV pool over a disk tier (--kv-disk-dir in a
temporary directory), so cached prefixes churn down to disk and back. Client threads mix:
chat and completions over a few shared system prompts (prefix hits), streams that hang up
at a random chunk, n=2 requests, flushes (the whole cache's, refused 409 while requests run,
and a tenant's own namespace, which succeeds under load) and pins/unpins, batch jobs (the server has no
batch route: `radixserve batch` runs files offline, so a job here is a batch file's lines,
few-shot requests sharing one preamble, sent together through the API as a client-side
batch runner would), and the fast hostile inputs of tests/server/hostile.py (nested JSON,
5 MB prompts, absurd parameters...).

Every `--sample-s` it records the server's RSS, open descriptors and threads, and checks
page conservation (free + cached + private = total, from /cache/stats). After a warm-up it
pauses the load, waits for the server to go idle and takes the descriptor and thread
baseline; at the end it does the same again. It fails (exit 1) on:
- RSS growing after warm-up: the least-squares slope over the run's rest, times that span,
  above max(--rss-tolerance-mib, 3 x the residuals' spread);
- more descriptors or threads at the end (idle, given 30 s to settle) than at the
  warm-up's end (idle);
- a conservation error, or a page count that does not add up;
- any 5xx, or any request error other than the expected refusals;
- no tenant flush succeeding over the whole run.

The server runs with API keys and --namespace-per-api-key: the clients' traffic uses one
tenant key, each client flushes with a key of its own (its namespace holds only what that
client just asked, and nothing of it runs when it flushes), and the admin key reads the
pool-wide /cache/stats and tries the whole-cache flush.
It prints one JSON summary line last (latency p50/p99 of whole requests, counts, samples).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.server import http  # noqa: E402
from tests.server.hostile import hostile_cases, rss_bytes, run_case, stop_server  # noqa: E402

SYSTEMS = [("You are the front desk of a mountain hotel. Answer in one short sentence. " * 4),
           ("You are a terse librarian who names one book and its author, nothing else. " * 4),
           ("You translate the user's words into plain French, with no commentary. " * 4)]
QUESTIONS = ["When is breakfast?", "Is there parking?", "Can I bring a dog?", "Where is the spa?",
             "What is a good novel about the sea?", "Translate: the train is late.",
             "Recommend something short.", "Translate: good morning, friends."]
# hostile inputs answered at once (the slow-body ones hold a connection for the timeouts)
FAST_HOSTILE = ("nested arrays (10,000 levels)", "5 MB prompt", "invalid UTF-8", "n 1000",
                "max_tokens 10^9", "10,000 stop strings", "text/plain body", "no content type")
WARMUP_FRACTION = 0.25
# the kinds of action --every-kind waits for (the whole-cache flush, pin and unpin are side
# actions; a tenant's flush must succeed at least once, so a short run waits for one)
EVERY_KIND = ("chat", "completion", "stream", "batch", "hostile", "tenant_flush")
TENANT_KEY, ADMIN_KEY = "soak-tenant", "soak-admin"


def flush_key(client_index: int) -> str:
    return f"soak-flush-{client_index}"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@dataclass(frozen=True)
class Keys:
    """The headers of one client: its traffic's, its own flush namespace's, the admin's."""

    tenant: dict[str, str]
    flush: dict[str, str]
    admin: dict[str, str]

    @classmethod
    def for_client(cls, client_index: int) -> "Keys":
        return cls(bearer(TENANT_KEY), bearer(flush_key(client_index)), bearer(ADMIN_KEY))


@dataclass
class Tally:
    """What the clients saw, shared by their threads."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    latencies: list[float] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def record(self, kind: str, status: int | None, seconds: float | None = None) -> None:
        with self.lock:
            key = f"{kind}:{status}"
            self.statuses[key] = self.statuses.get(key, 0) + 1
            if seconds is not None and status == 200:
                self.latencies.append(seconds)
            if status is not None and status >= 500:
                self.errors.append(f"{kind} answered {status}")

    def fail(self, what: str) -> None:
        with self.lock:
            self.errors.append(what)

    def kinds(self) -> set[str]:
        """The kinds of action that have answered at least once."""
        with self.lock:
            return {key.split(":")[0] for key in self.statuses}


def start_server(args: argparse.Namespace, disk_dir: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", "0",
           "--decode-compile", "off", "--model",
           args.model, "--dtype", args.dtype, "--device", "cpu", "--kv-cache-tokens",
           str(args.kv_cache_tokens), "--page-size", "16", "--max-model-len", "512",
           "--kv-disk-dir", disk_dir, "--header-timeout-s", "5", "--body-timeout-s", "5",
           "--namespace-per-api-key", "--api-key", TENANT_KEY, "--admin-api-key", ADMIN_KEY]
    for i in range(args.clients):
        cmd += ["--api-key", flush_key(i)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for line in iter(proc.stdout.readline, ""):
        if m := re.search(r"on (http://127\.0\.0\.1:\d+)", line):
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, m.group(1)
    raise RuntimeError("the server did not start")


def chat_body(rng: random.Random, **extra) -> dict:
    return {"messages": [{"role": "system", "content": rng.choice(SYSTEMS)},
                         {"role": "user", "content": rng.choice(QUESTIONS)}],
            "max_tokens": rng.randint(2, 12), "temperature": 0.7, **extra}


def one_action(url: str, rng: random.Random, tally: Tally, hostile: list, keys: Keys) -> None:
    """One client action, drawn at random with the mix's weights."""
    roll = rng.random()
    started = time.monotonic()
    key = keys.tenant
    if roll < 0.35:
        r = http.post(url + "/v1/chat/completions", json=chat_body(rng), timeout=300,
                      headers=key)
        tally.record("chat", r.status, time.monotonic() - started)
    elif roll < 0.55:
        body = {"prompt": rng.choice(SYSTEMS) + rng.choice(QUESTIONS),
                "max_tokens": rng.randint(2, 12), "n": rng.choice([1, 2])}
        r = http.post(url + "/v1/completions", json=body, timeout=300, headers=key)
        tally.record("completion", r.status, time.monotonic() - started)
    elif roll < 0.80:                    # a stream, hung up at a random chunk (or not)
        hang_up_at = rng.randint(1, 12)
        with http.SSEStream(url + "/v1/chat/completions",
                            chat_body(rng, stream=True, max_tokens=12), timeout=300,
                            headers=key) as s:
            tally.record("stream", s.status)
            for i, _ in enumerate(s.events()):
                if i + 1 >= hang_up_at:
                    break
    elif roll < 0.825:
        r = http.post(url + "/cache/flush", json={}, timeout=300,   # 409 while busy
                      headers=keys.admin)
        tally.record("flush", r.status)
    elif roll < 0.85:
        tenant_flush(url, rng, tally, keys.flush)
    elif roll < 0.88:
        batch_job(url, rng, tally, key)
    elif roll < 0.92:
        r = http.post(url + "/cache/pin", json={"prompt": rng.choice(SYSTEMS)}, timeout=300,
                      headers=key)
        tally.record("pin", r.status)
        if r.status == 200:
            d = http.request("DELETE", url + f"/cache/pin/{r.json()['id']}", timeout=300,
                             headers=key)
            tally.record("unpin", d.status)
    else:
        case = rng.choice(hostile)
        out = run_case(url, case)
        tally.record("hostile", out.status)
        if out.status != case.expect:
            tally.fail(f"hostile {case.name!r}: {out.status}, expected {case.expect}")


def tenant_flush(url: str, rng: random.Random, tally: Tally, key: dict[str, str]) -> None:
    """A chat in the client's own namespace, then that namespace's flush: nothing of it
    runs any more, so the flush must succeed (200) however busy the server is."""
    r = http.post(url + "/v1/chat/completions", json=chat_body(rng), timeout=300, headers=key)
    tally.record("chat", r.status)
    r = http.post(url + "/cache/flush", json={}, timeout=300, headers=key)
    tally.record("tenant_flush", r.status)
    if r.status == 200 and r.json().get("scope") != "namespace":
        tally.fail(f"a tenant flush answered scope {r.json().get('scope')!r}")


def batch_job(url: str, rng: random.Random, tally: Tally, headers: dict[str, str],
              lines: int = 4) -> None:
    """A batch file's lines (one preamble, several questions) sent at once; each must be
    answered 200."""
    preamble = rng.choice(SYSTEMS)
    bodies = [{"messages": [{"role": "system", "content": preamble},
                            {"role": "user", "content": q}],
               "max_tokens": rng.randint(2, 8), "temperature": 0}
              for q in rng.sample(QUESTIONS, lines)]
    statuses: list[int | None] = [None] * lines

    def send(i: int) -> None:
        try:
            statuses[i] = http.post(url + "/v1/chat/completions", json=bodies[i],
                                    timeout=300, headers=headers).status
        except OSError as e:        # a hang (no answer in 300 s) or a dropped connection:
            tally.fail(f"batch job: {type(e).__name__}: {e}")   # not lost in the thread

    started = time.monotonic()
    senders = [threading.Thread(target=send, args=(i,)) for i in range(lines)]
    for t in senders:
        t.start()
    for t in senders:
        t.join()
    tally.record("batch", 200 if all(x == 200 for x in statuses) else
                 max(x or 0 for x in statuses), time.monotonic() - started)


def client(url: str, seed: int, tally: Tally, hostile: list, keys: Keys,
           stop: threading.Event, go: threading.Event) -> None:
    rng = random.Random(seed)
    actions = 0                         # each client starts with a batch job and a tenant
    while not stop.is_set():            # flush: short runs have them too
        go.wait()
        if stop.is_set():
            return
        try:
            actions += 1
            if actions == 1:
                batch_job(url, rng, tally, keys.tenant)
            elif actions == 2:
                tenant_flush(url, rng, tally, keys.flush)
            else:
                one_action(url, rng, tally, hostile, keys)
        except OSError as e:                # the client's own socket: a server fault here
            tally.fail(f"client error: {type(e).__name__}: {e}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


def conservation(url: str) -> str | None:
    pool = http.get(url + "/cache/stats", timeout=60, headers=bearer(ADMIN_KEY)).json()["pool"]
    total = pool["pages_free"] + pool["pages_cached"] + pool["pages_private"]
    if total != pool["pages_total"]:
        return f"pages: free + cached + private = {total}, total {pool['pages_total']}"
    return None


def tokens_done(url: str) -> float:
    """Prompt + generated tokens so far (/metrics): the engine's progress."""
    text = http.get(url + "/metrics", timeout=60, headers=bearer(ADMIN_KEY)).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(("radixserve_prompt_tokens_total ",
                                   "radixserve_generation_tokens_total ")))


def wait_idle(url: str, stall_s: float = 300.0) -> None:
    """Until nothing runs or waits and no page is private. Fails only when the engine
    makes no progress (no token prefilled or generated) for `stall_s`: a busy machine
    may take many minutes to finish the running requests, a hang never finishes them."""
    progress, stalled_since = tokens_done(url), time.monotonic()
    while time.monotonic() - stalled_since < stall_s:
        stats = http.get(url + "/cache/stats", timeout=60, headers=bearer(ADMIN_KEY)).json()
        if stats["requests"]["running"] == stats["requests"]["waiting"] == 0 \
                and stats["pool"]["pages_private"] == 0:
            return
        if (now_done := tokens_done(url)) != progress:
            progress, stalled_since = now_done, time.monotonic()
        time.sleep(0.1)
    raise RuntimeError(f"the server made no progress for {stall_s:g} s and is not idle: "
                       f"requests {stats['requests']}, pool {stats['pool']}, tiers "
                       f"{stats.get('tiers')}")


def idle_counts(url: str, pid: int, at_most: tuple[int, int] | None = None,
                settle_s: float = 30.0) -> tuple[int, int]:
    """Open descriptors and threads once idle. With `at_most` (the baseline), polls up to
    `settle_s` for them to come back down: a hung-up stream's socket or a worker thread
    closes a moment after its request ends; a leak never does."""
    wait_idle(url)
    deadline = time.monotonic() + settle_s
    while True:
        counts = open_fds(pid), threads(pid)
        if at_most is None or time.monotonic() > deadline or \
                (counts[0] <= at_most[0] and counts[1] <= at_most[1]):
            return counts
        time.sleep(0.1)


def rss_growth(samples: list[tuple[float, int]]) -> tuple[float, float]:
    """(growth over the span by the least-squares slope, 3 x the residuals' spread), MiB."""
    if len(samples) < 3:
        return 0.0, 0.0
    xs = [t for t, _ in samples]
    ys = [r / 2**20 for _, r in samples]
    slope, intercept = statistics.linear_regression(xs, ys)
    residuals = [y - (slope * x + intercept) for x, y in zip(xs, ys)]
    return slope * (xs[-1] - xs[0]), 3 * statistics.pstdev(residuals)


def run(args: argparse.Namespace) -> dict:
    tally = Tally()
    hostile = [c for c in hostile_cases(30.0, bearer(TENANT_KEY)) if c.name in FAST_HOSTILE]
    with tempfile.TemporaryDirectory(prefix="soak-kv-") as disk_dir:
        proc, url = start_server(args, disk_dir)
        stop, go = threading.Event(), threading.Event()
        workers = [threading.Thread(target=client, args=(url, args.seed + i, tally, hostile,
                                                         Keys.for_client(i), stop, go),
                                    daemon=True)
                   for i in range(args.clients)]
        samples: list[dict] = []
        try:
            for w in workers:
                w.start()
            t0 = time.monotonic()
            warm_until = t0 + args.duration_s * WARMUP_FRACTION
            end = t0 + args.duration_s
            go.set()
            baseline = None
            # --every-kind: past the duration, go on until each kind of action has
            # answered (a busy machine runs fewer actions in the same seconds); a kind
            # still missing an hour later is a hang.
            needed = set(EVERY_KIND) if args.every_kind else set()
            while (now := time.monotonic()) < end or not needed <= tally.kinds():
                if now > end + 3600:
                    tally.fail(f"no answer of kinds {sorted(needed - tally.kinds())} in "
                               f"an hour past the duration")
                    break
                if baseline is None and now >= warm_until:
                    go.clear()
                    baseline = idle_counts(url, proc.pid)     # workers finish their action
                    go.set()
                problem = conservation(url)
                if problem:
                    tally.fail(problem)
                samples.append({"t": round(now - t0, 2), "rss": rss_bytes(proc.pid),
                                "fds": open_fds(proc.pid), "threads": threads(proc.pid),
                                "warm": baseline is not None})
                stop.wait(args.sample_s)
            go.clear()
            final = idle_counts(url, proc.pid, at_most=baseline)
            stop.set()
            go.set()
            for w in workers:
                w.join(300)
            problem = conservation(url)
            if problem:
                tally.fail(problem)
        finally:
            stop.set()
            go.set()
            stop_server(proc)
    warm = [(s["t"], s["rss"]) for s in samples if s["warm"]]
    growth, noise = rss_growth(warm)
    if growth > max(args.rss_tolerance_mib, noise):
        tally.fail(f"RSS grows after warm-up: +{growth:.1f} MiB over the run "
                   f"(noise {noise:.1f} MiB, tolerance {args.rss_tolerance_mib} MiB)")
    if not tally.statuses.get("tenant_flush:200"):
        tally.fail(f"no tenant flush succeeded ({tally.statuses.get('tenant_flush:409', 0)} "
                   f"refused 409)")
    if baseline is not None and (final[0] > baseline[0] or final[1] > baseline[1]):
        tally.fail(f"leak: idle fds/threads {baseline} after warm-up, {final} at the end")
    lat = sorted(tally.latencies)
    q = statistics.quantiles(lat, n=100) if len(lat) > 1 else [0.0] * 99
    return {"ok": not tally.errors, "errors": tally.errors[:20], "duration_s": args.duration_s,
            "requests": sum(tally.statuses.values()), "statuses": tally.statuses,
            "latency_p50_s": round(q[49], 3), "latency_p99_s": round(q[98], 3),
            "rss_mib": [round(s["rss"] / 2**20) for s in samples],
            "rss_growth_after_warmup_mib": round(growth, 1), "rss_noise_mib": round(noise, 1),
            "idle_fds_threads": {"after_warmup": baseline, "end": final},
            "samples": len(samples)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration-s", type=float, default=120.0)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--sample-s", type=float, default=2.0)
    ap.add_argument("--rss-tolerance-mib", type=float, default=48.0)
    ap.add_argument("--kv-cache-tokens", type=int, default=1024,
                    help="small, so that prefixes churn down to the disk tier")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--every-kind", action="store_true",
                    help="run past the duration until every kind of action has answered")
    args = ap.parse_args(argv)
    summary = run(args)
    print(f"soak: {summary['requests']} requests in {args.duration_s:g} s, p50 "
          f"{summary['latency_p50_s']} s, p99 {summary['latency_p99_s']} s; RSS MiB "
          f"{summary['rss_mib'][:1]}..{summary['rss_mib'][-1:]} (growth after warm-up "
          f"{summary['rss_growth_after_warmup_mib']} MiB, noise {summary['rss_noise_mib']}); "
          f"idle fds/threads {summary['idle_fds_threads']}", file=sys.stderr)
    for e in summary["errors"]:
        print(f"soak: FAIL: {e}", file=sys.stderr)
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
