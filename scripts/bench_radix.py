#!/usr/bin/env python
"""Microbenchmark of the radix prefix cache on two request streams, side by side with SGLang.

Per request it makes the tree calls the engine makes, one request at a time (the same
five calls as SGLang's side of the comparison):

    match_prefix(prompt, max_tokens=len(prompt) - 1); lock(handle)
    PagedMemory.alloc_after(matched pages, the pages not matched)  # evicts when short
    insert(prompt + output, pages, start=handle); free(duplicates); unlock(handle)

`--via-lease` makes the same calls through PrefixLease (cache/prefix_lease.py), as the
engine and the replay tool do: acquire, grow, release(prompt + output).

Streams (`--streams`):

  shared  (issue 3) 64 groups x 16 prompts; each prompt = the group's 2048-token system
          prompt + a 128-token question; each request then produces 256 output tokens;
          shuffled. Capacities: one that holds everything, and 200,000 tokens.
  long    (issue 11) the first 500 requests of the shared Mooncake trace
          (/work/shared/traces, `--trace`) expanded to tokens as the replay tool does in
          token mode (12.8k-token prompts on average, little reuse), outputs included.
          Capacity: 2,000,000 tokens.

It reports microseconds per request for page sizes 1 and 16, with the ratio to SGLang's
pure-Python RadixCache on the same stream (page size 1), run interleaved with ours when
`--sglang-path` is given (see scripts/sglang_radix_ref.py), else against the issue's
figures for the shared stream.

Token ids reach the cache as the engine keeps them: an `array('q')` per sequence, which
the tree packs with one memcpy (radixserve/cache/token_keys.py). `--keys list` passes
plain lists instead, so each call also pays for packing what it reads of them, and
`--fresh-ints` makes every request's ints distinct objects, as a tokenizer would (which
only matters for lists).

    python scripts/bench_radix.py --quick      # seconds-long smoke run
    python scripts/bench_radix.py --sglang-path /work/sglang_ref/sglang-0.5.23
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from array import array
from pathlib import Path

from radixserve.cache import PagedMemory, PrefixLease, RadixCache
from radixserve.cache.token_keys import TYPECODE, prefix

SGLANG_US = {"fits": 48.0, 200_000: 74.0}     # shared stream, per request, page size 1 (issue 3)
TARGET_FRACTION = 1 / 3
DEFAULT_TRACE = (Path(__file__).resolve().parents[2] / "shared" / "traces"
                 / "mooncake_fast25_synthetic_trace.jsonl")
LONG_REQUESTS = 500
LONG_CAPACITY = 2_000_000


def make_stream(groups: int, prompts: int, system: int, question: int, output: int,
                seed: int, fresh_ints: bool, keys: str = "list") -> list[tuple]:
    """[(prompt, prompt + output)] in shuffled order, as lists or `array('q')`s."""
    rng = random.Random(seed)
    vocab = 32_000

    def toks(n: int) -> list[int]:
        return [rng.randrange(1000, vocab) for _ in range(n)]

    stream = []
    for _ in range(groups):
        sys_prompt = toks(system)
        for _ in range(prompts):
            prompt = sys_prompt + toks(question)
            if fresh_ints:
                prompt = [int(str(t)) for t in prompt]
            full = prompt + toks(output)
            if keys == "array":
                prompt, full = array(TYPECODE, prompt), array(TYPECODE, full)
            stream.append((prompt, full))
    rng.shuffle(stream)
    return stream


def make_long_stream(trace_path: str | Path, requests: int, keys: str = "list",
                     fresh_ints: bool = False) -> list[tuple]:
    """[(prompt, prompt + output)] of a hash-id trace, tokens as the replay tool makes them."""
    from radixserve.replay.traces import read_trace
    from radixserve.replay.workload import Workload

    trace = read_trace(trace_path, limit=requests)
    stream = []
    for item in Workload(trace, "token", 1, include_outputs=True):
        prompt = item.prompt_keys
        full = item.full_keys if item.full_keys is not None else prompt
        if keys == "array":
            stream.append((array(TYPECODE, prompt.tobytes()), array(TYPECODE, full.tobytes())))
        else:
            p, f = prompt.tolist(), full.tolist()
            if fresh_ints:
                p, f = [int(str(t)) for t in p], [int(str(t)) for t in f]
            stream.append((p, f))
    return stream


def run_stream(stream, page_size: int, capacity_tokens: int, policy: str,
               via_lease: bool = False) -> dict:
    """Time the per-request cache calls over the whole stream; return the figures."""
    tree = RadixCache(page_size, policy)
    memory = PagedMemory(capacity_tokens // page_size, tree)
    ps = page_size
    ops = 0
    clock = time.perf_counter_ns
    cpu0 = time.thread_time_ns()
    t0 = clock()
    if via_lease:
        for prompt, full in stream:
            lease = PrefixLease(memory)
            lease.acquire(prompt, max_tokens=len(prompt) - 1)
            lease.grow(-(-len(full) // ps) - len(lease.pages))
            lease.release(full, len(full))          # insert, free duplicates, unlock
            ops += 5
    else:
        for prompt, full in stream:
            m = tree.match_prefix(prompt, max_tokens=len(prompt) - 1)
            tree.lock(m.node)
            n_pages = -(-len(full) // ps)
            pages = memory.alloc_after(m.pages, n_pages - len(m.pages))  # read-only
            n_whole = len(full) // ps
            whole_pages = pages[:n_whole]
            r = tree.insert(prefix(full, n_whole * ps), whole_pages, start=m.node)
            dup = r.duplicates(whole_pages)         # as PrefixLease: duplicates, then the
            if len(dup):                            # private tail (a partial last page)
                memory.free(dup)
            if n_whole != n_pages:
                memory.free(pages[n_whole:])
            tree.unlock(m.node)
            ops += 5                                # match, lock, alloc(+evict), insert, unlock
    elapsed = (clock() - t0) / 1e9
    cpu = (time.thread_time_ns() - cpu0) / 1e9
    tree.check_invariants()
    memory.check_conservation()
    return {"seconds": elapsed, "cpu_seconds": cpu, "ops": ops, "requests": len(stream),
            "hit_rate": tree.hit_tokens / max(1, tree.query_tokens),
            "evicted": tree.evicted_tokens, "nodes": tree.num_nodes}


def per_request_us(runs: list[dict]) -> tuple[float, float, float]:
    """(best wall, median wall, best CPU) microseconds per request over repeated passes."""
    n = runs[0]["requests"]
    walls = [r["seconds"] / n * 1e6 for r in runs]
    return min(walls), statistics.median(walls), min(r["cpu_seconds"] for r in runs) / n * 1e6


def compare(name: str, stream, capacities: dict, page_sizes: list[int], repeats: int,
            policy: str, run_sglang, sglang_path: str | None, issue_figures: dict,
            via_lease: bool) -> None:
    """Time ours (each page size) and SGLang's, interleaved per pass; print one table."""
    print(f"{'stream':>6} {'page':>4} {'capacity':>9} {'us/req':>8} {'median':>7} {'cpu us':>7} "
          f"{'req/s':>9} {'hit rate':>8} {'evicted':>9} {'vs SGLang':>10} {'target':>7}")
    for cap_name, cap in capacities.items():
        ours: dict[int, list[dict]] = {ps: [] for ps in page_sizes}
        theirs: list[dict] = []
        for _ in range(repeats):                # interleaved, so drift hits both alike
            for ps in page_sizes:
                gc.collect()                    # see below
                ours[ps].append(run_stream(stream, ps, cap, policy, via_lease))
            if run_sglang is not None:
                # Both trees link children and parents (reference cycles): without a
                # collection here, the pass after another one would pay, inside its timing,
                # for collecting the previous pass's whole tree.
                gc.collect()
                theirs.append(run_sglang(stream, cap, sglang_path, "minimal", policy))
        if theirs:
            ref, ref_median, ref_cpu = per_request_us(theirs)
            print(f"{name:>6} {'sgl1':>4} {str(cap_name):>9} {ref:>8.1f} {ref_median:>7.1f} "
                  f"{ref_cpu:>7.1f} {1e6 / ref:>9.0f} {theirs[0]['hit_rate']:>8.3f} "
                  f"{theirs[0]['evicted']:>9}   (SGLang's RadixCache, measured, page size 1)")
        else:
            ref = issue_figures.get(cap_name)
        for ps in page_sizes:
            best = min(ours[ps], key=lambda r: r["seconds"])
            us, median, cpu_us = per_request_us(ours[ps])
            if ref is None:
                ratio, ok = "-", "-"
            else:
                ratio = f"{us / ref:.2f}x"
                ok = "ok" if us <= ref * TARGET_FRACTION else "MISS"
            print(f"{name:>6} {ps:>4} {str(cap_name):>9} {us:>8.1f} {median:>7.1f} {cpu_us:>7.1f} "
                  f"{1e6 / us:>9.0f} {best['hit_rate']:>8.3f} {best['evicted']:>9} "
                  f"{ratio:>10} {ok:>7}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one pass over each stream per case")
    ap.add_argument("--repeats", type=int, default=5, help="passes per case (best is kept)")
    ap.add_argument("--policy", default="lru", choices=["lru", "lfu", "gdsf"])
    ap.add_argument("--page-sizes", default="1,16")
    ap.add_argument("--streams", default="shared,long",
                    help="comma-separated: shared (system prompts), long (Mooncake trace)")
    ap.add_argument("--trace", default=str(DEFAULT_TRACE),
                    help="the hash-id trace of the long stream")
    ap.add_argument("--fresh-ints", action="store_true",
                    help="every request gets its own int objects (tokenizer-like)")
    ap.add_argument("--keys", choices=["array", "list"], default="array",
                    help="token ids as the engine keeps them (array('q')) or as lists")
    ap.add_argument("--sglang-path", metavar="DIR",
                    help="an unpacked SGLang wheel (see scripts/sglang_radix_ref.py): time its "
                         "RadixCache on the same stream, interleaved with ours, and compare "
                         "with that instead of the issue's stated figures")
    ap.add_argument("--keep-freed-memory", action="store_true",
                    help="raise glibc's mmap/trim thresholds first, as the engine does on CPU "
                         "(engine/host_memory.py): fresh page arrays stop page-faulting; "
                         "applies to both sides of the comparison")
    ap.add_argument("--via-lease", action="store_true",
                    help="make the calls through PrefixLease, as the engine does")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.keep_freed_memory:
        from radixserve.engine.host_memory import keep_freed_host_memory

        keep_freed_host_memory()
    run_sglang = None
    if args.sglang_path:
        from sglang_radix_ref import load_sglang, run_sglang_stream

        load_sglang(args.sglang_path)          # its import cost stays outside every timing
        run_sglang = run_sglang_stream
    repeats = 1 if args.quick else args.repeats
    page_sizes = [int(x) for x in args.page_sizes.split(",")]
    streams = args.streams.split(",")
    print(f"policy {args.policy}, token ids as {args.keys}s"
          f"{' of fresh int objects' if args.fresh_ints else ''}, best of {repeats}"
          f"{', glibc keeps freed memory' if args.keep_freed_memory else ''}"
          f"{', through PrefixLease' if args.via_lease else ''}")
    for name in streams:
        if name == "shared":
            groups, prompts, system, question, output = 64, 16, 2048, 128, 256
            stream = make_stream(groups, prompts, system, question, output, args.seed,
                                 args.fresh_ints, args.keys)
            total = groups * system + groups * prompts * (question + output)
            capacities = {"fits": total + 4096, 200_000: 200_000}
            figures = SGLANG_US
            print(f"shared: {len(stream)} requests, {total} distinct tokens")
        elif name == "long":
            stream = make_long_stream(args.trace, LONG_REQUESTS, args.keys, args.fresh_ints)
            capacities = {"2M": LONG_CAPACITY}
            figures = {}
            prompt_tokens = sum(len(p) for p, _ in stream)
            print(f"long: {len(stream)} requests of {Path(args.trace).name}, "
                  f"{prompt_tokens / len(stream):.0f} prompt tokens on average")
        else:
            raise SystemExit(f"unknown stream {name!r}")
        # The pre-built stream (millions of list items) is harness data that a server would
        # not hold; keep the collector from re-scanning it (the tree's own objects count).
        gc.collect()
        gc.freeze()
        compare(name, stream, capacities, page_sizes, repeats, args.policy, run_sglang,
                args.sglang_path, figures, args.via_lease)
        del stream
        gc.unfreeze()
        gc.collect()
    print("us/req: wall clock (best pass); median: of the passes; cpu us: this thread's CPU "
          "time (best pass; less sensitive to a busy machine)")
    if run_sglang is None:
        print(f"vs SGLang (shared stream): against the issue's figures for SGLang's RadixCache, "
              f"{SGLANG_US['fits']:.0f} us (fits) / {SGLANG_US[200_000]:.0f} us (200k) per "
              f"request (pass --sglang-path to measure it side by side)")
    print(f"target: wall us/req <= {TARGET_FRACTION:.3g} of SGLang's (page size 1)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
