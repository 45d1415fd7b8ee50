"""The event loop's CPU per big body of bench_hostile.py's control run (issue 39): what each
body costs the thread that holds the GIL while the compute thread waits. A server on the
tests' fake engine (the HTTP path is the real one: read, size check, decode, validation,
refusal) in this process; each case posted N times; the loop thread's CPU from
/proc/self/task/TID/stat (10 ms ticks: N=40 resolves 0.25 ms). Runs in ~10 s idle.

    PYTHONPATH=. python scripts/loop_cost_per_body.py 40
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))

from bench_hostile import BIG_BODY_CASES  # noqa: E402
from radixserve.server.state import ServerConfig  # noqa: E402
from tests.server.fake_engine import FakeEngine  # noqa: E402
from tests.server.hostile import hostile_cases, run_case  # noqa: E402
from tests.server.live import LiveServer  # noqa: E402


def thread_cpu_s(tid: int) -> float:
    fields = open(f"/proc/self/task/{tid}/stat").read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(posts: int) -> None:
    with LiveServer(FakeEngine(max_model_len=2048), ServerConfig(port=0)) as server:
        loop_thread = server.thread.native_id
        for case in [c for c in hostile_cases(20) if c.name in BIG_BODY_CASES]:
            run_case(server.url, case)                      # warm
            cpu, start = thread_cpu_s(loop_thread), time.monotonic()
            statuses = {run_case(server.url, case).status for _ in range(posts)}
            print(f"{case.name:28s} {sorted(statuses)}: loop CPU "
                  f"{1000 * (thread_cpu_s(loop_thread) - cpu) / posts:6.2f} ms, client wall "
                  f"{1000 * (time.monotonic() - start) / posts:6.1f} ms per body")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)
