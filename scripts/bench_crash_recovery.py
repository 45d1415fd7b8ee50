"""The disk tier across kill -9 (issue 39): rounds of save, serve 1-5 s, `kill -9`, restart.

    python scripts/bench_crash_recovery.py [--model smollm2-135m-instruct] [--rounds 3]
        [--kv-cache-tokens 2048] [--page-size 4] [--seed 0] [--dir DIR]

Each round: start a server on the same --kv-disk-dir (small pool, so requests push
prefixes down to disk), serve chat requests with shared system prompts, `POST
/cache/save`, keep serving for a seeded 1-5 s, then SIGKILL it and count the page files
on disk. The next start reports what it recovered (`/cache/stats` -> kv_disk.recovery):
pages restored of those files, and the recovery time (journal replay + tree rebuild).
Speed figures depend on the machine: say whether it was shared.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

SYSTEMS = [f"You are the {role} of a {place}. Answer in one short sentence and never "
           f"invent prices, numbers or names. " * 2
           for role, place in (("front desk", "mountain hotel"), ("librarian", "city library"),
                               ("guide", "science museum"), ("clerk", "train station"))]
QUESTIONS = ["Is it open in winter?", "Can I bring a dog?", "Where is the nearest cafe?",
             "Do you take cards?", "What time do you close?", "Is there parking?",
             "Can children come?", "Is it busy on Sundays?", "Do I need a ticket?",
             "Is there wifi?", "Can I leave my bag here?", "Who do I ask for help?"]


def post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=600) as r:
        return json.load(r)


def start(args, kv: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", "0",
           "--decode-compile", "off", "--model",
           args.model, "--dtype", "float32", "--device", "cpu", "--kv-cache-tokens",
           str(args.kv_cache_tokens), "--page-size", str(args.page_size),
           "--kv-disk-dir", str(kv)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for line in iter(proc.stdout.readline, ""):
        m = re.search(r"serving .* on (http://127\.0\.0\.1:\d+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, m.group(1)
    raise SystemExit(f"the server exited: {proc.wait()}")


def serve(url: str, rng: random.Random, stop: threading.Event, model: str,
          done: list[int]) -> None:
    while not stop.is_set():
        question = f"{rng.choice(QUESTIONS)} (ticket {rng.randrange(10**6)})"
        body = {"model": model, "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "system", "content": rng.choice(SYSTEMS)},
                             {"role": "user", "content": question}]}
        try:
            post(url + "/v1/chat/completions", body)
        except OSError:
            return                          # killed
        done.append(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kv-cache-tokens", type=int, default=512)
    p.add_argument("--warm-requests", type=int, default=24,
                   help="requests served before each save (churn down to disk)")
    p.add_argument("--page-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None, help="the --kv-disk-dir (default: a temporary one)")
    args = p.parse_args()
    rng = random.Random(args.seed)
    kv = Path(args.dir or tempfile.mkdtemp(prefix="bench-crash-")) / "kv"
    on_disk = None
    print(f"model {args.model}, pool {args.kv_cache_tokens} tokens, page {args.page_size}, "
          f"dir {kv}")
    for round_ in range(args.rounds + 1):
        proc, url = start(args, kv)
        try:
            disk = get(url + "/cache/stats")["kv_disk"]
            if on_disk is not None:
                rec = disk["recovery"]
                print(f"round {round_}: {rec['restored_pages']} of {on_disk} page files "
                      f"restored ({rec['restored_pages'] / max(on_disk, 1):.1%}; journal "
                      f"records {rec['journal_records']}, torn tails {rec['torn_tails']}), "
                      f"recovery {rec['seconds']:.3f} s", flush=True)
            if round_ == args.rounds:
                break
            stop, done = threading.Event(), []
            workers = [threading.Thread(target=serve, args=(url, random.Random(rng.random()),
                                                            stop, args.model, done))
                       for _ in range(2)]
            for w in workers:
                w.start()
            while len(done) < args.warm_requests:    # churn: prefixes go down to disk
                time.sleep(0.05)
            saved = post(url + "/cache/save", {})
            serve_s = rng.uniform(1, 5)
            time.sleep(serve_s)                      # serving after the save
            files = len(list((kv / "pages").glob("*.page")))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            on_disk = len(list((kv / "pages").glob("*.page")))
            stop.set()
            for w in workers:
                w.join()
            print(f"round {round_ + 1}: saved {saved['nodes']} nodes "
                  f"({saved['pages_written']} pages written) after {len(done)} requests, "
                  f"served {serve_s:.1f} s more, kill -9 with {on_disk} page files on disk "
                  f"({files} just before)", flush=True)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    main()
