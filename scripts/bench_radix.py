#!/usr/bin/env python
"""Microbenchmark of the radix prefix cache on a generated shared-prefix stream.

Stream (issue 3): 64 groups x 16 prompts; each prompt = the group's 2048-token system prompt
+ a 128-token question; each request then produces 256 output tokens; shuffled. Per request
it does what the engine does, one request at a time:

    match_prefix(prompt, max_tokens=len(prompt) - 1); lock(handle)
    PagedMemory.alloc(the pages not matched)             # evicts when short
    insert(prompt + output, pages, start=handle); free(duplicates); unlock(handle)

and reports microseconds per request and cache operations per second for page sizes 1 and
16, at a capacity that holds everything and at 200,000 tokens, with the ratio to SGLang's
pure-Python RadixCache on the same stream (48 us / 74 us per request, page size 1).

Token ids reach the cache as the engine keeps them: an `array('q')` per sequence, which
the tree packs with one memcpy (radixserve/cache/token_keys.py). `--keys list` passes
plain lists instead, so each call also pays for packing them (~5 ns per token), and
`--fresh-ints` makes every request's ints distinct objects, as a tokenizer would (which
only matters for lists).

    python scripts/bench_radix.py --quick      # seconds-long smoke run
    python scripts/bench_radix.py              # the figures for docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import gc
from array import array
import random
import statistics
import time

import numpy as np

from radixserve.cache import PageAllocator, PagedMemory, RadixCache
from radixserve.cache.token_keys import TYPECODE

SGLANG_US = {"fits": 48.0, 200_000: 74.0}     # per request, page size 1 (issue 3)
TARGET_FRACTION = 1 / 3


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


def run_stream(stream, page_size: int, capacity_tokens: int, policy: str) -> dict:
    """Time the per-request cache calls over the whole stream; return the figures."""
    allocator = PageAllocator(capacity_tokens // page_size)
    tree = RadixCache(page_size, policy)
    memory = PagedMemory(allocator, tree)
    ps = page_size
    ops = 0
    clock = time.perf_counter_ns
    cpu0 = time.thread_time_ns()
    t0 = clock()
    for prompt, full in stream:
        m = tree.match_prefix(prompt, max_tokens=len(prompt) - 1)
        tree.lock(m.node)
        n_pages = -(-len(full) // ps)
        new = memory.alloc(n_pages - len(m.pages))
        pages = np.concatenate((m.pages, new))
        n_whole = len(full) // ps
        whole_pages = pages[:n_whole]
        r = tree.insert(full[:n_whole * ps] if n_whole * ps != len(full) else full, whole_pages,
                        start=m.node)
        dup = r.duplicates(whole_pages)
        if len(dup) or n_whole != n_pages:
            allocator.free(np.concatenate((dup, pages[n_whole:])))
        tree.unlock(m.node)
        ops += 5                                    # match, lock, alloc(+evict), insert, unlock
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one pass over the stream per case")
    ap.add_argument("--repeats", type=int, default=5, help="passes per case (best is kept)")
    ap.add_argument("--policy", default="lru", choices=["lru", "lfu", "gdsf"])
    ap.add_argument("--page-sizes", default="1,16")
    ap.add_argument("--fresh-ints", action="store_true",
                    help="every request gets its own int objects (tokenizer-like)")
    ap.add_argument("--keys", choices=["array", "list"], default="array",
                    help="token ids as the engine keeps them (array('q')) or as lists")
    ap.add_argument("--sglang-path", metavar="DIR",
                    help="an unpacked SGLang wheel (see scripts/sglang_radix_ref.py): time its "
                         "RadixCache on the same stream, interleaved with ours, and compare "
                         "with that instead of the issue's stated figures")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    groups, prompts, system, question, output = 64, 16, 2048, 128, 256
    stream = make_stream(groups, prompts, system, question, output, args.seed, args.fresh_ints,
                         args.keys)
    run_sglang = None
    if args.sglang_path:
        from sglang_radix_ref import load_sglang, run_sglang_stream

        load_sglang(args.sglang_path)          # its import cost stays outside every timing
        run_sglang = run_sglang_stream
    # The pre-built stream (~5M list items) is harness data that a server would not hold;
    # keep the garbage collector from re-scanning it (the tree's own objects still count).
    gc.collect()
    gc.freeze()
    total = groups * system + groups * prompts * (question + output)
    repeats = 1 if args.quick else args.repeats
    page_sizes = [int(x) for x in args.page_sizes.split(",")]
    print(f"stream: {len(stream)} requests, {total} distinct tokens, policy {args.policy}, "
          f"token ids as {args.keys}s"
          f"{' of fresh int objects' if args.fresh_ints else ''}, best of {repeats}")
    print(f"{'page':>4} {'capacity':>9} {'us/req':>8} {'median':>7} {'cpu us':>7} {'req/s':>9} "
          f"{'ops/s':>10} {'hit rate':>8} {'evicted':>9} {'vs SGLang':>10} {'target':>7}")
    for cap_name in ("fits", 200_000):
        cap = total + 4096 if cap_name == "fits" else cap_name
        ours: dict[int, list[dict]] = {ps: [] for ps in page_sizes}
        theirs: list[dict] = []
        for _ in range(repeats):                # interleaved, so drift hits both alike
            for ps in page_sizes:
                ours[ps].append(run_stream(stream, ps, cap, args.policy))
            if run_sglang is not None:
                theirs.append(run_sglang(stream, cap, args.sglang_path, "minimal", args.policy))
        if theirs:
            ref, ref_median, ref_cpu = per_request_us(theirs)
            print(f"{'sgl1':>4} {str(cap_name):>9} {ref:>8.1f} {ref_median:>7.1f} {ref_cpu:>7.1f} "
                  f"{1e6 / ref:>9.0f} {5e6 / ref:>10.0f} {theirs[0]['hit_rate']:>8.3f} "
                  f"{theirs[0]['evicted']:>9}   (SGLang's RadixCache, measured, page size 1)")
        else:
            ref = SGLANG_US[cap_name]
        for ps in page_sizes:
            best = min(ours[ps], key=lambda r: r["seconds"])
            us, median, cpu_us = per_request_us(ours[ps])
            ok = "ok" if us <= ref * TARGET_FRACTION else "MISS"
            print(f"{ps:>4} {str(cap_name):>9} {us:>8.1f} {median:>7.1f} {cpu_us:>7.1f} "
                  f"{1e6 / us:>9.0f} {best['ops'] / best['seconds']:>10.0f} "
                  f"{best['hit_rate']:>8.3f} {best['evicted']:>9} {us / ref:>9.2f}x {ok:>7}")
    print("us/req: wall clock (best pass); median: of the passes; cpu us: this thread's CPU "
          "time (best pass; less sensitive to a busy machine)")
    if run_sglang is None:
        print(f"vs SGLang: against the issue's figures for SGLang's RadixCache on these machines, "
              f"{SGLANG_US['fits']:.0f} us (fits) / {SGLANG_US[200_000]:.0f} us (200k) per request "
              f"(pass --sglang-path to measure it side by side)")
    print(f"target: wall us/req <= {TARGET_FRACTION:.3g} of SGLang's (page size 1)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
