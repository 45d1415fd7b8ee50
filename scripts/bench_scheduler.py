"""The scheduler's own CPU time per step, with a stand-in model whose forward costs nothing.

Measures Scheduler.schedule() + Scheduler.complete() (admission, page reservation, batch
assembly, sampling bookkeeping) plus the output processor (stop checks, streaming) and,
separately, the page-table metadata the runner builds, at 1, 64 and 256 running decodes.

    python scripts/bench_scheduler.py [--steps 200] [--quick]
    python scripts/bench_scheduler.py --kv-events both [--steps 400]

`--kv-events both` measures step time with the KV events publisher (radixserve/events) on
and off side by side, in alternating rounds, at 256 running: the steady-decode workload
above and a shared-prefix churn (requests finish and new ones behind the same 128-token
prefix are admitted, so pages are inserted, evicted and announced every step); it prints
the on/off ratio and the event bytes per request. The publisher binds a free local port
with no subscriber (a PUB drops with nobody listening: the cost measured is the engine's).
The scheduler thread only records the tree's changes; the publisher's thread computes the
events (events/tree_facts.py), holding the GIL while it does. A real forward pass runs in
torch without the GIL, which leaves the publisher that time; the stand-in's takes none,
so the publisher's work lands in the timed step. `--forward-ms X` makes the stand-in
forward wait X ms without the GIL, as a real one would (0: the plain stand-in).

    python scripts/bench_scheduler.py --kv-events both --forward-ms 2
    python scripts/bench_scheduler.py --kv-events own     # the events' own CPU only
    python scripts/bench_scheduler.py --kv-events steady --rounds 20 --steps 100

`--kv-events steady` is the steady measure of the 2% bound: churn only, `--rounds` pairs
of off/on rounds (ABBA), each round warmed up first; per pair the on/off ratios of the
median step's wall time, of the engine process's CPU per step (all its threads) and of the
scheduler thread's CPU, and the publisher's own CPU (PublisherStats.cpu_s: its process's,
the default, or with `--kv-events-publisher thread` its thread's, read inside it) as a
share of the off round's process CPU; each printed as a median with a bootstrap 95%
interval and the IQR over the pairs. ~5 minutes for 16 pairs of 60 steps:

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/bench_scheduler.py --kv-events steady --rounds 16 --steps 60

Beside the ratios, `steady` prints counters per step, off and on (step_counters.py: the
engine thread's GC collections and their CPU, net allocated blocks, context switches; the
pipe writer's and the publisher process's wake-ups): steadier than time on a busy machine,
and they name a cause. `--drain-ms`, `--gc-freeze`, `--pin` and `--child-discards`
vary one suspect each.
The whole step with a real forward: bench_kv_events_step.py.

Both end with the events' own CPU on each thread, measured so that a busy machine moves
it least: the scheduler thread's (a churn round's observer calls recorded, then made again
under one timer per step, best of 5: timing each call adds the timer's own cost, ~0.4 us,
to every one of ~100 calls a step at page 1) and the publisher's (the churn's facts
recorded, then replayed and encoded on one thread, best of 5 per step: no GIL contention).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import time

from radixserve.attention.metadata import build_metadata
from radixserve.engine.core import EngineCore
from radixserve.engine.null_model import NullRunner, null_core
from radixserve.engine.request import new_request
from radixserve.engine.sampling_params import SamplingParams
from step_counters import StepCounters


def build(running: int, page_size: int, prompt_len: int, shared: int,
          requests: int | None = None, pages: int | None = None,
          max_tokens: tuple[int, int] | None = None) -> tuple[EngineCore, list]:
    pages = pages or (running * (prompt_len + 4096)) // page_size + 1024
    core = null_core(num_pages=pages, page_size=page_size, max_running=running,
                     token_budget=8192)
    rng = random.Random(0)
    prefix = [rng.randrange(1000) for _ in range(shared)]
    sink = []
    for r in range(requests or running):
        n = rng.randint(*max_tokens) if max_tokens else 1 << 20
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                stop=["STOP"])   # never produced: the stand-in emits a-z
        prompt = prefix + [rng.randrange(1000) for _ in range(prompt_len - shared)]
        core.add(new_request(f"r{r}", prompt, params, None, sink.append, page_size))
    return core, sink


def timed_step(core: EngineCore, runner: NullRunner, after=None,
               forward_s: float = 0.0) -> tuple:
    """One step: (its plan, seconds in schedule + complete (+ `after()`, the KV events'
    flush), the stand-in forward pass left out; the same as this thread's CPU seconds)."""
    t0, c0 = time.perf_counter(), time.thread_time()
    plan = core.schedule()
    t1, c1 = time.perf_counter(), time.thread_time()
    result = runner.execute(plan.batch)
    if forward_s:
        time.sleep(forward_s)       # a forward pass that holds no GIL (not timed)
    t2, c2 = time.perf_counter(), time.thread_time()
    core.complete(plan, result)
    if after is not None:
        after()
    return plan, (t1 - t0) + (time.perf_counter() - t2), (c1 - c0) + (time.thread_time() - c2)


def measure(running: int, steps: int, page_size: int) -> dict:
    core, sink = build(running, page_size, prompt_len=256, shared=128)
    runner = NullRunner(page_size=page_size)
    sched = core.scheduler
    while any(s.in_prefill for s in sched.running) or sched.waiting:   # reach steady decode
        plan = core.schedule()
        core.complete(plan, runner.execute(plan.batch))
    sched_times, meta_times = [], []
    for _ in range(steps):
        plan, seconds, _ = timed_step(core, runner)
        t3 = time.perf_counter()
        build_metadata(plan.batch.spans, page_size, "cpu")
        sched_times.append(seconds)
        meta_times.append(time.perf_counter() - t3)
        sink.clear()
    assert len(plan.batch.spans) == running
    return {"running": running, "page_size": page_size,
            "scheduler_ms": statistics.median(sched_times) * 1e3,
            "metadata_ms": statistics.median(meta_times) * 1e3}


def attach_events(core: EngineCore, publisher: str = "process",
                  child_options: dict | None = None, clock=time.monotonic):
    """The engine's KV events (radixserve/events) on this core's tree: 16-token blocks,
    array encoding, the default hand-over interval, a PUB on a free local port nobody
    reads, the publisher a process of its own or a thread (`publisher`). The timed steps
    call `after_step`, as the engine's loop does."""
    from radixserve.events.stream import KVEvents, KVEventsConfig

    return KVEvents(core.scheduler.memory.tree,
                    KVEventsConfig("tcp://127.0.0.1:*", publisher=publisher), "cpu",
                    child_options=child_options, clock=clock)


def events_round(workload: str, events: bool, steps: int, page_size: int,
                 forward_ms: float = 0.0, on_start=None, publisher: str = "process") -> dict:
    """One timed run at 256 running, with or without events: median ms per step (the
    events' flush, as the engine does after each step, included) and event bytes per
    finished request."""
    running = 256
    if workload == "decode":
        core, sink = build(running, page_size, prompt_len=256, shared=128)
    else:       # churn: 4x as many requests as slots, short outputs, a pool that evicts
        core, sink = build(running, page_size, prompt_len=256, shared=128,
                           requests=running * 4, max_tokens=(8, 48),
                           pages=running * 320 // page_size)
    kv = attach_events(core, publisher) if events else None
    runner = NullRunner(page_size=page_size)
    sched = core.scheduler
    if workload == "decode":
        while any(s.in_prefill for s in sched.running) or sched.waiting:
            plan = core.schedule()
            core.complete(plan, runner.execute(plan.batch))
            if kv is not None:
                kv.flush()
    if kv is not None and on_start is not None:
        kv.publisher.wait_idle(timeout_s=60)    # the warm-up's events are sent
        on_start()
    times, thread_cpu, finished = [], 0.0, 0
    cpu0 = time.process_time()
    for _ in range(steps):
        _, seconds, cpu = timed_step(core, runner, kv.after_step if kv is not None else None,
                                     forward_ms / 1e3)
        times.append(seconds)
        thread_cpu += cpu
        finished += sum(1 for out in sink if out.finished)
        sink.clear()
    nbytes = nbatches = 0
    if kv is not None:
        kv.publisher.wait_idle(timeout_s=60)    # the publisher's work is part of the cost
        nbytes = kv.stats.published_bytes
        nbatches = kv.stats.published_batches
    # CPU of every thread of the process (the publisher's included) over the loop, per step
    # (the stand-in forward pass included, alike on and off), and the scheduler thread's
    # own CPU in the timed part of the step: less sensitive than wall time to other
    # processes on a shared machine.
    cpu_ms = (time.process_time() - cpu0) / steps * 1e3
    if kv is not None:
        kv.close()
    return {"ms": statistics.median(times) * 1e3, "cpu_ms": cpu_ms,
            "thread_ms": thread_cpu / steps * 1e3, "finished": finished, "bytes": nbytes,
            "batches": nbatches / steps}


def _timed(owner, name: str, totals: dict, calls: dict) -> None:
    """Replace owner.name (an instance's method) by one that adds its thread CPU to
    totals[name] and counts its calls in calls[name]."""
    fn = getattr(owner, name)

    def timed(*args):
        t0 = time.thread_time()
        try:
            return fn(*args)
        finally:
            totals[name] += time.thread_time() - t0
            calls[name] += 1

    setattr(owner, name, timed)


def timer_cost(n: int = 20_000) -> float:
    """The seconds `_timed` adds to each call it times, measured around a C call that does
    nothing (a dict store, as TreeFacts.trimmed is): subtracted from the timed totals."""
    from collections import defaultdict

    class Owner:
        pass

    owner, totals, calls = Owner(), defaultdict(float), defaultdict(int)
    owner.noop = {}.__setitem__
    _timed(owner, "noop", totals, calls)
    noop = owner.noop
    for i in range(n):
        noop(0, i)
    return totals["noop"] / n


def events_own_cpu(workload: str, steps: int, page_size: int) -> dict:
    """One events-on round with the events' own code timed per call (thread CPU): on the
    scheduler thread, the tree observer's calls and the flush; on the publisher's, the
    events' computation (FactReplay) and the encode + send. Each timed call carries some
    of the timer's own cost (`timer_cost`, ~0.3-1 us): `sched_us` has it subtracted,
    `sched_raw_us` not (an upper bound)."""
    from collections import defaultdict

    import radixserve.events.stream as stream

    totals: dict = defaultdict(float)
    calls: dict = defaultdict(int)
    real = stream.KVEvents.__init__

    def init(kv, *args, **kwargs):
        real(kv, *args, **kwargs)
        for name in ("stored", "split", "removed", "trimmed", "moved", "cleared"):
            _timed(kv.facts, name, totals, calls)
        _timed(kv, "flush", totals, calls)
        _timed(kv.publisher, "_prepare", totals, calls)
        _timed(kv.publisher, "_send", totals, calls)

    def start():
        totals.clear()
        calls.clear()

    stream.KVEvents.__init__ = init
    try:
        r = events_round(workload, True, steps, page_size, on_start=start,
                         publisher="thread")     # its calls are timed in this process
    finally:
        stream.KVEvents.__init__ = real
    names = [k for k in totals if k not in ("_prepare", "_send")]
    sched = sum(totals[k] for k in names)
    sched_calls = sum(calls[k] for k in names)
    overhead = timer_cost() * sched_calls
    return {"sched_us": max(0.0, sched - overhead) / steps * 1e6,
            "sched_raw_us": sched / steps * 1e6, "calls": sched_calls / steps,
            "thread_us": (totals["_prepare"] + totals["_send"]) / steps * 1e6,
            "thread_ms": r["thread_ms"]}


def print_own(own: list) -> None:
    print("\nthe events' own CPU per step, timed call by call (one more round per setting):")
    print("(sched thread: the timer's own cost per call subtracted; raw: not, an upper bound)")
    print(f"{'workload':>9} {'page':>5} {'calls/step':>11} {'sched thread us':>16} "
          f"{'of an off step':>15} {'raw us':>8} {'raw of off':>11} {'publisher thread us':>20}")
    for workload, page_size, r, off_ms in own:
        print(f"{workload:>9} {page_size:>5} {r['calls']:>11.1f} {r['sched_us']:>16.1f} "
              f"{r['sched_us'] / (off_ms * 1e3):>15.2%} {r['sched_raw_us']:>8.1f} "
              f"{r['sched_raw_us'] / (off_ms * 1e3):>11.2%} {r['thread_us']:>20.1f}",
              flush=True)


def publisher_cpu(steps: int, page_size: int, repeats: int = 5) -> dict:
    """The publisher's own work on a churn round of 1,024 requests (it drains after step
    ~110), without a second thread (`replay_costs`). Returns us per step, all steps and
    from step 50 on (the first steps admit whole prompts: bursts of stores)."""
    best, _, _ = replay_costs(steps, page_size, 1024, repeats)
    return {"all_us": sum(best) / steps * 1e6,
            "steady_us": sum(best[50:]) / (steps - 50) * 1e6 if steps > 50 else float("nan")}


class CallRecorder:
    """A tree observer that only records its calls, (method name, args) per step; a
    stored node is copied as it is then (with its parent's id and depth: it may be gone
    from the tree when the calls are made again)."""

    def __init__(self):
        self.steps: list[list[tuple]] = [[]]
        for name in ("split", "removed", "trimmed", "moved", "cleared"):
            setattr(self, name, self._recorder(name))

    def _recorder(self, name: str):
        return lambda *args: self.steps[-1].append((name, args))

    def stored(self, node) -> None:
        from radixserve.cache.radix_cache import EMPTY_PAGES
        from radixserve.cache.tree_node import TreeNode

        key, pending = node.key_parts()
        up = node.parent
        parent = TreeNode(up.id, b"", EMPTY_PAGES, None, up.depth, up.namespace)
        copy = TreeNode(node.id, key, EMPTY_PAGES, parent, node.depth, node.namespace,
                        _pending=pending, tier=node.tier)
        self.steps[-1].append(("stored", (copy,)))


def observer_cpu(steps: int, page_size: int, repeats: int = 5) -> dict:
    """The scheduler thread's events work per churn step without a timer per call: the
    tree's observer calls of each step are recorded, then made again on a fresh
    TreeFacts (and its `take`, as the engine's flush does) under one timer per step,
    `repeats` times, each step's best kept; then, under a second timer, the hand-off to
    a publisher process: the step's facts encoded as one frame (fact_messages.py). The
    nodes are in their final state by then, which costs the same calls. Returns us per
    step: `capture_us` and `encode_us`."""
    from radixserve.events.fact_messages import FactEncoder
    from radixserve.events.tree_facts import TreeFacts

    core, sink = build(256, page_size, prompt_len=256, shared=128, requests=1024,
                       max_tokens=(8, 48), pages=256 * 320 // page_size)
    recorder = CallRecorder()
    core.scheduler.memory.tree.attach_observer(recorder)
    runner = NullRunner(page_size=page_size)
    for _ in range(steps):
        plan = core.schedule()
        core.complete(plan, runner.execute(plan.batch))
        recorder.steps.append([])
        sink.clear()
    best = [float("inf")] * steps
    encode = [float("inf")] * steps
    frame = FactEncoder().frame
    for _ in range(repeats):
        facts = TreeFacts()
        methods = {name: getattr(facts, name) for name in ("stored", "split", "removed",
                                                           "trimmed", "moved", "cleared")}
        calls = [[(methods[name], args) for name, args in step] for step in recorder.steps]
        take = facts.take
        for i in range(steps):
            step = calls[i]
            t0 = time.thread_time()
            for method, args in step:
                method(*args)
            taken = take()
            t1 = time.thread_time()
            frame(taken)
            best[i] = min(best[i], t1 - t0)
            encode[i] = min(encode[i], time.thread_time() - t1)
    return {"capture_us": sum(best) / steps * 1e6, "encode_us": sum(encode) / steps * 1e6}


def print_publisher(steps: int) -> None:
    print("\nthe publisher's work (replay + encode) per churn step, alone on one thread, "
          "best of 5 per step:")
    print(f"{'page':>5} {'all steps us':>13} {'from step 50 us':>16}")
    for page_size in (1, 16):
        r = publisher_cpu(steps, page_size)
        print(f"{page_size:>5} {r['all_us']:>13.1f} {r['steady_us']:>16.1f}", flush=True)


def print_observer(steps: int) -> None:
    print("\nthe scheduler thread's events work per churn step, the step's observer calls "
          "made again under one timer (best of 5 per step), the facts' encode for a "
          "publisher process, and an off round's step:")
    print(f"{'page':>5} {'capture us':>11} {'encode us':>10} {'off step us':>12} {'share':>7}")
    for page_size in (1, 16):
        off = events_round("churn", False, steps, page_size)["thread_ms"] * 1e3
        us = observer_cpu(steps, page_size)
        print(f"{page_size:>5} {us['capture_us']:>11.1f} {us['encode_us']:>10.1f} "
              f"{off:>12.1f} {(us['capture_us'] + us['encode_us']) / off:>7.2%}", flush=True)


def own_only(steps: int, rounds: int) -> None:
    """`--kv-events own`: the call-by-call rounds alone (an off round per setting gives
    the step they are a share of), `rounds` times, for a quick look at the events' cost."""
    own = []
    for _ in range(rounds):
        for workload in ("decode", "churn"):
            for page_size in (1, 16):
                off = events_round(workload, False, steps, page_size)
                own.append((workload, page_size, events_own_cpu(workload, steps, page_size),
                            off["thread_ms"]))
    print_own(own)
    print_observer(steps)
    print_publisher(steps)


def compare_events(steps: int, rounds: int = 3, forward_ms: float = 0.0) -> None:
    """Per workload and page size: median over the rounds of the wall ms per step, the
    scheduler thread's CPU ms per step and the process's CPU ms per step, off and on."""
    print("wall: median step (schedule + complete + flush); sched cpu: the scheduler "
          "thread's CPU in it; proc cpu: every thread of the process over the loop")
    print(f"{'workload':>9} {'page':>5} {'wall off':>9} {'on':>7} {'on/off':>7} "
          f"{'sched cpu off':>14} {'on':>7} {'on/off':>7} {'proc cpu off':>13} {'on':>7} "
          f"{'on/off':>7} {'event bytes/request':>20} {'batches/step':>13}")
    own = []
    for workload in ("decode", "churn"):
        for page_size in (1, 16):
            off, on, per_request = [], [], []
            for i in range(rounds):     # alternated, and which goes first too: drift
                for events in (False, True) if i % 2 == 0 else (True, False):   # hits both
                    r = events_round(workload, events, steps, page_size, forward_ms)
                    (on if events else off).append(r)
                    if events and r["finished"]:
                        per_request.append(r["bytes"] / r["finished"])
            cols = []
            for key in ("ms", "thread_ms", "cpu_ms"):
                a, b = (statistics.median(x[key] for x in runs) for runs in (off, on))
                cols.append(f"{a:>9.3f} {b:>7.3f} {b / a:>7.3f}")
            per = f"{statistics.median(per_request):.0f}" if per_request else "-"
            per += f" {statistics.median(x['batches'] for x in on):>13.2f}"
            print(f"{workload:>9} {page_size:>5} {cols[0]} {cols[1]:>30} {cols[2]:>29} "
                  f"{per:>20}", flush=True)
            own.append((workload, page_size, events_own_cpu(workload, steps, page_size),
                        statistics.median(x["thread_ms"] for x in off)))
    print_own(own)
    print_observer(steps)
    print_publisher(steps)


def steady_round(events: bool, steps: int, page_size: int, warmup: int,
                 forward_ms: float, publisher: str = "process", freeze: bool = False,
                 pin: bool = False, child_options: dict | None = None) -> dict:
    """One churn round at 256 running for `--kv-events steady`: `warmup` untimed steps
    (the first admit whole prompts), the publisher idle, then `steps` timed ones. Returns
    per step: the median wall time of schedule + complete + flush, the engine process's
    CPU (every thread of this process, the loop and the publisher's catch-up after it;
    not the publisher process's), the scheduler thread's CPU in the timed part, and the
    publisher's own CPU (its thread's, or its process's: PublisherStats.cpu_s); and the
    engine thread's counters (step_counters.py) and the pipe writer's wake-ups per step.
    `freeze`: gc.freeze() before the timed steps (what the engine does after its start),
    on and off alike; `pin`: this process on CPU 0, the publisher process on CPU 1."""
    core, sink = build(256, page_size, prompt_len=256, shared=128,
                       requests=256 + (warmup + steps) * 12, max_tokens=(8, 48),
                       pages=256 * 320 // page_size)
    kv = attach_events(core, publisher, child_options) if events else None
    runner = NullRunner(page_size=page_size)
    flush_cpu = [0.0]

    def flush() -> None:        # the engine's flush, its thread CPU summed (~1 us a timer)
        t0 = time.thread_time()
        kv.after_step()
        flush_cpu[0] += time.thread_time() - t0

    if kv is None:
        flush = None
    for _ in range(warmup):
        timed_step(core, runner, flush)
        sink.clear()
    if kv is not None:
        kv.publisher.wait_idle(timeout_s=60)
        if pin and hasattr(kv.publisher, "process"):
            os.sched_setaffinity(kv.publisher.process.pid, {1})
    if pin:
        os.sched_setaffinity(0, {0})
    if freeze:
        gc.collect()
        gc.freeze()
    pub0 = kv.stats.cpu_s if kv is not None else 0.0
    writer0 = getattr(kv.publisher, "writer_cpu_s", 0.0) if kv is not None else 0.0
    wakes0 = getattr(kv.publisher, "writer_wakes", 0) if kv is not None else 0
    child0 = kv.publisher.child_wakes() if events and publisher == "process" else 0
    walls, sched_cpu = [], 0.0
    flush_cpu[0] = 0.0
    counters = StepCounters()
    counters.start()
    cpu0 = time.process_time()
    for _ in range(steps):
        _, seconds, cpu = timed_step(core, runner, flush, forward_ms / 1e3)
        walls.append(seconds)
        sched_cpu += cpu
        sink.clear()
    proc_loop = time.process_time() - cpu0
    counted = counters.stop(steps)
    if freeze:
        gc.unfreeze()
    wakes = getattr(kv.publisher, "writer_wakes", 0) - wakes0 if kv is not None else 0
    pub = writer = child_wakes = 0.0
    if kv is not None:
        kv.publisher.wait_idle(timeout_s=60)    # the publisher's work is part of the cost
        pub = kv.stats.cpu_s - pub0
        child_wakes = kv.publisher.child_wakes() - child0 if publisher == "process" else 0
        writer = getattr(kv.publisher, "writer_cpu_s", 0.0) - writer0
    proc = time.process_time() - cpu0
    assert core.scheduler.waiting, "the round ran out of requests: churn needs new ones"
    if kv is not None:
        kv.close()
    return {"wall_us": statistics.median(walls) * 1e6, "proc_us": proc / steps * 1e6,
            "sched_us": sched_cpu / steps * 1e6, "pub_us": pub / steps * 1e6,
            "writer_us": writer / steps * 1e6, "flush_us": flush_cpu[0] / steps * 1e6,
            "loop_proc_us": proc_loop / steps * 1e6, "writer_wakes": wakes / steps,
            "child_wakes": child_wakes / steps, **counted}


def replay_costs(steps: int, page_size: int, requests: int, repeats: int = 5
                 ) -> tuple[list[float], list[float], list[int]]:
    """The publisher's work on a churn round, on this thread: the tree's facts of each
    step are recorded (no publisher), then replayed into a fresh shadow and encoded,
    `repeats` times, each step's best time kept (the least disturbed by other processes).
    Also the floor under that work, which no bookkeeping can remove: hashing each stored
    block (path_hash.chain_blocks over each stored node's tokens), listing its token ids
    (token_keys.unpack) and encoding the step's batch. Returns per step: seconds of the
    work, of its floor, and the tokens stored."""
    import msgspec

    from radixserve.cache.path_hash import chain_blocks, namespace_seed
    from radixserve.cache.token_keys import ITEM_BYTES, unpack
    from radixserve.events.block_events import BlockEvents, media_for
    from radixserve.events.schema import ENCODINGS
    from radixserve.events.tree_facts import STORED, FactReplay, TreeFacts

    core, sink = build(256, page_size, prompt_len=256, shared=128, requests=requests,
                       max_tokens=(8, 48), pages=256 * 320 // page_size)
    facts = TreeFacts()
    core.scheduler.memory.tree.attach_observer(facts)
    facts.cleared()
    runner, recorded = NullRunner(page_size=page_size), []
    for _ in range(steps):
        plan = core.schedule()
        core.complete(plan, runner.execute(plan.batch))
        recorded.append(facts.take())
        sink.clear()
    keys = [[f[3] for f in step if f[0] == STORED] for step in recorded]
    encoder, seed = msgspec.msgpack.Encoder(), namespace_seed(None)
    whole, floor = [float("inf")] * steps, [float("inf")] * steps
    for _ in range(repeats):
        replay = FactReplay(BlockEvents(ENCODINGS["array"], 16, page_size, media_for("cpu")))
        for i, step in enumerate(recorded):
            t0 = time.thread_time()
            batch = replay.batch(step)
            if batch is not None:
                encoder.encode(batch)
            t1 = time.thread_time()
            for key in keys[i]:
                chain_blocks(seed, key, 16)
                unpack(key)
            if batch is not None:
                encoder.encode(batch)
            t2 = time.thread_time()
            whole[i] = min(whole[i], t1 - t0)
            floor[i] = min(floor[i], t2 - t1)
    return whole, floor, [sum(len(key) for key in step) // ITEM_BYTES for step in keys]


def publisher_floor(steps: int, page_size: int, warmup: int) -> dict:
    """`replay_costs` on a steady churn round (requests enough for `warmup` + `steps`
    steps of admissions), over the steps after `warmup`: us per step."""
    whole, floor, tokens = replay_costs(warmup + steps, page_size,
                                        256 + (warmup + steps) * 12)
    return {"whole_us": sum(whole[warmup:]) / steps * 1e6,
            "floor_us": sum(floor[warmup:]) / steps * 1e6,
            "stored_tokens": sum(tokens[warmup:]) / steps}


def spread(values: list[float], resamples: int = 2000) -> tuple[float, float, float, float]:
    """(median, its bootstrap 95% interval low and high, the interquartile range)."""
    rng = random.Random(0)
    n = len(values)
    medians = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    q1, _, q3 = statistics.quantiles(values, n=4)
    return (statistics.median(values), medians[int(0.025 * resamples)],
            medians[int(0.975 * resamples) - 1], q3 - q1)


# The engine thread's counters per step (step_counters.py), printed off and on.
COUNTERS = (("gc0", "gc gen0 collections/step"), ("gc1", "gc gen1 collections/step"),
            ("gc2", "gc gen2 collections/step"), ("gc_us", "gc cpu us/step"),
            ("blocks", "net allocated blocks/step"), ("vcsw", "voluntary ctx sw/step"),
            ("ivcsw", "involuntary ctx sw/step"), ("writer_wakes", "writer wakes/step"),
            ("child_wakes", "publisher process wakes/step"),
            ("loop_proc_us", "loop process cpu us/step"))


def steady_events(steps: int, pairs: int, warmup: int, forward_ms: float,
                  publisher: str = "process", freeze: bool = False, pin: bool = False,
                  child_options: dict | None = None) -> None:
    """`--kv-events steady`: churn at 256 running, events off and on in `pairs` pairs of
    rounds (ABBA order, so drift hits both), per pair the on/off ratios; prints each
    ratio's median with its bootstrap 95% interval and IQR. The scheduler thread's events
    work comes from `observer_cpu` (its calls made again under one timer per step: within
    a round, the on-off difference of the scheduler thread's CPU is lost in the noise).
    The events' share of the engine's step is that work plus the flush's (the facts
    taken, encoded and written to the pipe, timed in the round) and the CPU of the
    engine's helper thread (the pipe writer; the publisher thread in thread mode), read
    inside it, over the off round's process CPU per step. A publisher process's own CPU
    is printed beside it, as a share of the off step too: the cost moved to another core,
    not gone."""
    print(f"churn at 256 running, {pairs} off/on pairs of {steps} timed steps after "
          f"{warmup} warm-up steps; stand-in forward {forward_ms} ms; publisher: "
          f"{publisher}; gc.freeze: {freeze}; pinned: {pin}; publisher process options: "
          f"{child_options or 'default'}")
    print(f"{'page':>5} {'measure':>34} {'median':>8} {'95% low':>8} {'95% high':>9} "
          f"{'IQR':>7}")
    for page_size in (1, 16):
        rows: dict[str, list[float]] = {}
        own = observer_cpu(min(steps, 200), page_size)
        in_engine = publisher == "thread"       # the publisher's CPU is the engine's too
        for i in range(pairs):
            runs = {}
            for events in (False, True) if i % 2 == 0 else (True, False):
                runs[events] = steady_round(events, steps, page_size, warmup, forward_ms,
                                            publisher, freeze, pin, child_options)
            off, on = runs[False], runs[True]
            for name, value in (
                    ("wall on/off (median step)", on["wall_us"] / off["wall_us"]),
                    ("engine process cpu on/off", on["proc_us"] / off["proc_us"]),
                    ("sched thread cpu on/off", on["sched_us"] / off["sched_us"]),
                    ("off process cpu us/step", off["proc_us"]),
                    (f"publisher {publisher} cpu us/step", on["pub_us"]),
                    (f"publisher {publisher} share of off", on["pub_us"] / off["proc_us"]),
                    ("pipe writer thread cpu us/step", on["writer_us"]),
                    ("flush (take+encode+write) us/step", on["flush_us"]),
                    ("events share of engine step",
                     (on["pub_us"] * in_engine + on["writer_us"] + on["flush_us"]
                      + own["capture_us"]) / off["proc_us"])):
                rows.setdefault(name, []).append(value)
            for key, label in COUNTERS:
                for side, run in (("off", off), ("on", on)):
                    rows.setdefault(f"{label} {side}", []).append(run[key])
        print(f"{page_size:>5} {'sched thread capture us/step':>34} "
              f"{own['capture_us']:>8.1f}   (best of 5 per step, one timer per step)")
        print(f"{page_size:>5} {'facts encode (process) us/step':>34} "
              f"{own['encode_us']:>8.1f}   (the hand-off's frame; best of 5 per step)")
        alone = publisher_floor(min(steps, 200), page_size, warmup)
        off_cpu = statistics.median(rows["off process cpu us/step"])
        print(f"{page_size:>5} {'publisher work alone us/step':>34} {alone['whole_us']:>8.1f}"
              f"   ({alone['whole_us'] / off_cpu:.2%} of the off step; replay + encode, "
              f"one thread, best of 5)")
        print(f"{page_size:>5} {'floor: hash+token lists+encode':>34} {alone['floor_us']:>8.1f}"
              f"   ({alone['floor_us'] / off_cpu:.2%} of the off step; "
              f"{alone['stored_tokens']:.0f} tokens stored per step)")
        for name, values in rows.items():
            med, low, high, iqr = spread(values)
            fmt = ".1f" if name.endswith(("us/step", "us/step off", "us/step on")) else ".4f"
            print(f"{page_size:>5} {name:>34} {med:>8{fmt}} {low:>8{fmt}} {high:>9{fmt}} "
                  f"{iqr:>7{fmt}}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="a few steps only")
    parser.add_argument("--kv-events", choices=["off", "both", "own", "steady"],
                        default="off",
                        help="both: step time with KV events on vs off at 256 running; "
                             "own: only the events' own CPU, timed call by call; "
                             "steady: churn, many alternating pairs, medians and spreads")
    parser.add_argument("--forward-ms", type=float, default=0.0,
                        help="with --kv-events: the stand-in forward waits this long "
                             "without the GIL, as a real forward pass does")
    parser.add_argument("--rounds", type=int, default=3,
                        help="with --kv-events: alternated off/on rounds per setting "
                             "(steady: off/on pairs, 20+ for a steady median)")
    parser.add_argument("--kv-events-publisher", choices=["process", "thread"],
                        default="process",
                        help="with --kv-events steady: the publisher's mode (stream.py)")
    parser.add_argument("--warmup", type=int, default=40,
                        help="with --kv-events steady: untimed steps before each round")
    parser.add_argument("--gc-freeze", action="store_true",
                        help="with --kv-events steady: gc.freeze() before each round's "
                             "timed steps, on and off alike (as the engine does)")
    parser.add_argument("--pin", action="store_true",
                        help="with --kv-events steady: this process on CPU 0, the "
                             "publisher process on CPU 1")
    parser.add_argument("--drain-ms", type=float, default=None,
                        help="with --kv-events steady: the publisher process drains its "
                             "ring this often while frames come; default: the hand-over "
                             "interval's pace (stream.py)")
    parser.add_argument("--child-discards", action="store_true",
                        help="with --kv-events steady: the publisher process reads the "
                             "frames and drops them (the engine's side alone)")
    args = parser.parse_args()
    steps = 10 if args.quick else args.steps
    if args.kv_events == "both":
        print(f"stand-in forward: {args.forward_ms} ms without the GIL")
        compare_events(steps, 1 if args.quick else args.rounds, args.forward_ms)
        return
    if args.kv_events == "steady":
        steady_events(steps, 2 if args.quick else args.rounds, args.warmup, args.forward_ms,
                      args.kv_events_publisher, args.gc_freeze, args.pin,
                      {**({} if args.drain_ms is None
                          else {"drain_ms": args.drain_ms}),
                       **({"discard": True} if args.child_discards else {})})
        return
    if args.kv_events == "own":
        own_only(steps, 1 if args.quick else args.rounds)
        return
    print(f"{'running':>8} {'page':>5} {'scheduler ms/step':>18} {'metadata ms/step':>17} {'target':>8}")
    for page_size in (1, 16):
        for running in (1, 64, 256):
            r = measure(running, steps, page_size)
            target = "<= 1 ms" if running == 256 else ""
            print(f"{r['running']:>8} {page_size:>5} {r['scheduler_ms']:>18.3f} "
                  f"{r['metadata_ms']:>17.3f} {target:>8}")


if __name__ == "__main__":
    main()
