"""Where the server's extra stream gap goes while big bodies arrive (issue 39): the served
process instrumented from inside, the big bodies of bench_hostile.py posted to a sink and to
the server in alternating phases while a probe streams.

    PYTHONPATH=. python scripts/trace_big_bodies.py --rounds 3

The server (`radixserve serve`, SmolLM2 fp32, as bench_hostile.py runs it) gets, before
`main()`: a loop-lag probe (a 2 ms sleep that wakes more than 10 ms late), the collector's
pauses (`gc.callbacks`, by generation and thread), the body path (`read_body`, the JSON
decode: wall and thread CPU time) and the compute thread's forward passes (wall and CPU).
Each event is timed on CLOCK_MONOTONIC, shared by the client, so that it falls into the sink
or the server phase. Printed: per phase, the probe's gaps, the decode step's wall and CPU
time, loop lag and GC pauses; per body, the read and the decode.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
LAG_SLEEP_S, LAG_REPORT_S = 0.002, 0.010


class Recorder:
    """Events (kind, start, end, details) of the served process, written out on demand."""

    def __init__(self, path: str):
        self.path, self.events, self._gc_start = path, [], 0.0

    def add(self, kind: str, start: float, **details) -> None:
        self.events.append((kind, start, time.monotonic(), details))

    def on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.monotonic()
        else:
            self.add("gc", self._gc_start, gen=info["generation"],
                     thread=threading.current_thread().name)

    def write(self) -> None:
        """Whole or not at all: the client waits for the file to appear."""
        Path(self.path + ".part").write_text(json.dumps(self.events))
        os.replace(self.path + ".part", self.path)


def instrumented_serve(out: str, argv: list[str]) -> int:
    """`radixserve serve argv` with the recorder hooked in; SIGUSR1 writes the events."""
    import signal

    import radixserve.engine.runner as runner
    import radixserve.server.body as body
    import radixserve.server.cli as cli
    from radixserve.cli import main

    rec = Recorder(out)
    gc.callbacks.append(rec.on_gc)
    signal.signal(signal.SIGUSR1, lambda *_: rec.write())

    async def lag_probe() -> None:
        while True:
            start = time.monotonic()
            await asyncio.sleep(LAG_SLEEP_S)
            if time.monotonic() - start > LAG_REPORT_S:
                rec.add("lag", start)

    start_server, read_body, decode = cli.start_server, body.read_body, body.P.decode
    execute = runner.ModelRunner.execute

    async def traced_start_server(*args):
        server = await start_server(*args)
        asyncio.get_running_loop().create_task(lag_probe())
        return server

    async def traced_read_body(request):
        start = time.monotonic()
        try:
            return await read_body(request)
        finally:
            rec.add("read_body", start, size=request.content_length)

    def traced_decode(data, type):
        start, cpu = time.monotonic(), time.thread_time()
        try:
            return decode(data, type)
        finally:
            rec.add("decode", start, size=len(data), cpu=time.thread_time() - cpu)

    def traced_execute(self, batch):
        start, cpu = time.monotonic(), time.thread_time()
        try:
            return execute(self, batch)
        finally:
            rec.add("execute", start, tokens=batch.num_tokens, cpu=time.thread_time() - cpu)

    cli.start_server, body.read_body, body.P.decode = (traced_start_server, traced_read_body,
                                                       traced_decode)
    runner.ModelRunner.execute = traced_execute
    return main(["serve", *argv])


def client_phases(url: str, rounds: int, phase_chunks: int) -> tuple[list, list]:
    """The probe's (time, gap) pairs and the phases (target, start, end)."""
    import bench_hostile as bh
    from tests.server.hostile import Probe, hostile_cases, run_case

    sink, sink_url = bh.start_sink()
    cases = [c for c in hostile_cases(20) if c.name in bh.BIG_BODY_CASES]
    probe, stamps = Probe(url), []
    probe.gaps = StampedGaps(stamps)
    probe.start()
    phases = []
    try:
        while not stamps:
            time.sleep(0.05)
        for _ in range(rounds):
            for target, target_url in (("sink", sink_url), ("server", url)):
                before, start = len(stamps), time.monotonic()
                while len(stamps) - before < phase_chunks and not probe.failures:
                    for case in cases:
                        run_case(target_url, case)
                phases.append((target, start, time.monotonic()))
    finally:
        probe.stop()
        sink.kill()
        sink.wait()
    return stamps, phases


class StampedGaps(list):
    """A Probe's gap list that also keeps when each gap ended."""

    def __init__(self, stamps: list):
        super().__init__()
        self.stamps = stamps

    def append(self, gap: float) -> None:
        super().append(gap)
        self.stamps.append((time.monotonic(), gap))


def ms(xs: list[float]) -> str:
    return f"median {1000 * statistics.median(xs):.1f} ms, total {sum(xs):.2f} s" if xs else "none"


def report(stamps: list, phases: list, events: list) -> None:
    def phase_of(t: float) -> str | None:
        return next((p[0] for p in phases if p[1] <= t <= p[2]), None)

    seconds = defaultdict(float)
    for target, start, end in phases:
        seconds[target] += end - start
    for target in ("sink", "server"):
        mine = [e for e in events if phase_of(e[2]) == target]
        steps = [e for e in mine if e[0] == "execute" and e[3]["tokens"] == 1]
        print(f"## big bodies to the {target} ({seconds[target]:.1f} s of phases)")
        print(f"- probe gaps: {ms([g for t, g in stamps if phase_of(t) == target])}")
        print(f"- decode steps (1 token): wall {ms([e[2] - e[1] for e in steps])}; "
              f"compute-thread CPU {ms([e[3]['cpu'] for e in steps])}")
        print(f"- loop lag > {LAG_REPORT_S * 1000:.0f} ms: "
              f"{ms([e[2] - e[1] for e in mine if e[0] == 'lag'])}")
        for gen in (0, 1, 2):
            pauses = [e[2] - e[1] for e in mine if e[0] == "gc" and e[3]["gen"] == gen]
            print(f"- GC generation {gen}: {len(pauses)} collections, {ms(pauses)}")
    sizes = sorted({e[3]["size"] for e in events if e[0] == "decode"})
    for size in sizes:
        reads = [e[2] - e[1] for e in events if e[0] == "read_body" and e[3]["size"] == size]
        decodes = [e for e in events if e[0] == "decode" and e[3]["size"] == size]
        print(f"- body of {size:,} bytes (x{len(decodes)}): read {ms(reads)}; decode wall "
              f"{ms([e[2] - e[1] for e in decodes])}, CPU {ms([e[3]['cpu'] for e in decodes])}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--phase-chunks", type=int, default=8)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--serve", metavar="EVENTS_FILE", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args()
    if args.serve:
        return instrumented_serve(args.serve, rest)
    import re
    import signal
    events_file = f"/tmp/trace_big_bodies_{os.getpid()}.json"
    cmd = [sys.executable, __file__, "--serve", events_file, "--port", "0", "--model",
           args.model, "--dtype", "float32", "--device", "cpu", "--kv-cache-tokens", "8192",
           "--max-model-len", "2048"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)})
    try:
        for line in iter(proc.stdout.readline, ""):
            if m := re.search(r"on (http://127\.0\.0\.1:\d+)", line):
                break
        else:
            raise RuntimeError("the server did not start")
        threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
        stamps, phases = client_phases(m.group(1), args.rounds, args.phase_chunks)
        proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 120
        while not Path(events_file).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        events = json.loads(Path(events_file).read_text())
    finally:
        proc.terminate()
        proc.wait(60)
        Path(events_file).unlink(missing_ok=True)
    report(stamps, phases, events)
    return 0


if __name__ == "__main__":
    sys.exit(main())
