#!/usr/bin/env python
"""The window-aware cache against a full-KV cache on a Gemma-3-shaped model, by replay-level
simulation (the server's own cache code, no model: the engine is too slow on 2 CPU cores
for conversations of 16k-32k tokens).

Model layout `gemma3-1b` (Gemma 3 1B's KV shape): 26 layers, 1 KV head x 256 dims, bf16,
every 6th layer full attention (4 full, 22 with a 512-token window): 1,024 B per token and
layer, 26 KiB per token with full KV in every layer.

Workload: `--conversations` conversations, each starting from one of `--system-prompts`
shared 2,000-token system prompts, taking turns round-robin; a turn is the history plus a
500-1,500-token user message, then a 300-token answer, until the history passes
`--max-tokens` (default 24,000). Each request runs as the engine runs it, through the
same leases (PrefixLease / WindowedLease): match, 2,048-token prefill chunks, the answer
decoded in 64-token steps, release keeping the KV.

Reported, side by side in one run:
- KV bytes per cached token in the window-aware tree, against 26 KiB (target <= 1/4);
- token hit rate (cached prompt tokens / prompt tokens) of the window-aware tree given a
  quarter of the full-KV tree's bytes, against the full-KV tree (target >= 95%).

    python scripts/bench_hybrid.py [--conversations 12] [--budget-tokens 120000]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from radixserve.cache.memory import PagedMemory
from radixserve.cache.page_allocator import OutOfPages
from radixserve.cache.prefix_lease import PrefixLease
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.window_lease import WindowedLease
from radixserve.cache.window_memory import WindowedMemory
from radixserve.cache.window_rule import WindowRule
from radixserve.kv_sizing import (DEFAULT_CHECKPOINT_WINDOWS, DEFAULT_WINDOW_POOL_FRACTION,
                                  KVFormat, group_pool_pages,
                                  layer_groups, window_pool_floor)

LAYERS, WINDOW, KV_HEADS, HEAD_DIM = 26, 512, 1, 256
LAYER_WINDOWS = tuple(None if i % 6 == 5 else WINDOW for i in range(LAYERS))
GROUPS = layer_groups(KVFormat("bfloat16", "bfloat16"), LAYER_WINDOWS, KV_HEADS, HEAD_DIM)
FULL_KV_BYTES = sum(g.bytes_per_token for g in GROUPS)
CHUNK, DECODE_STEP, ANSWER = 2048, 64, 300


def workload(conversations: int, system_prompts: int, max_tokens: int,
             seed: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, answer) per request, conversations interleaved turn by turn."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 50_000, 2000).tolist() for _ in range(system_prompts)]
    histories = [list(systems[c % system_prompts]) for c in range(conversations)]
    requests = []
    while any(len(h) < max_tokens for h in histories):
        for h in histories:
            if len(h) >= max_tokens:
                continue
            h += rng.integers(0, 50_000, int(rng.integers(500, 1500))).tolist()
            answer = rng.integers(0, 50_000, ANSWER).tolist()
            requests.append((list(h), answer))
            h += answer                 # the answer joins the history as generated
    return requests


def run(memory: PagedMemory, lease_type, requests, page_size: int) -> dict:
    """Every request through a lease; the hit rate and what the tree holds at the end."""
    hit = total = 0
    for prompt, answer in requests:
        tokens = prompt + answer
        lease = lease_type(memory, None, True)
        lease.acquire(prompt, max_tokens=len(prompt) - 1)
        hit += lease.matched_tokens
        total += len(prompt)
        done = lease.matched_tokens
        try:
            while done < len(tokens):
                step = min(CHUNK if done < len(prompt) else DECODE_STEP, len(tokens) - done)
                if isinstance(lease, WindowedLease):
                    lease.slide(done)
                lease.grow(-(-(done + step) // page_size) - len(lease.pages))
                done += step
                lease.extend(tokens, done)
        except OutOfPages:
            lease.release()
            continue
        lease.release(tokens, done)
    memory.check_conservation()
    return {"hit_rate": hit / total, "tree_tokens": memory.tree.total_tokens}


def window_bytes_per_token(memory: WindowedMemory, page_size: int) -> float:
    full_b = sum(g.bytes_per_token for g in GROUPS if g.window is None)
    win_b = sum(g.bytes_per_token for g in GROUPS if g.window is not None)
    ids = memory.tree.tree_page_ids()
    windows = int(memory.windows.present(ids).sum())
    return (len(ids) * full_b + windows * win_b) * page_size / max(1, len(ids) * page_size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--system-prompts", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=24_000)
    ap.add_argument("--budget-tokens", type=int, default=150_000,
                    help="the full-KV tree's pool in tokens (its bytes: x 26 KiB)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--window-fraction", type=float, default=DEFAULT_WINDOW_POOL_FRACTION,
                    help="windowed pages per full-attention page (--kv-window-pool-fraction)")
    ap.add_argument("--checkpoint", type=int, default=WINDOW * DEFAULT_CHECKPOINT_WINDOWS,
                    help="tokens between kept windows (--kv-window-checkpoint)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    ps = args.page_size
    requests = workload(args.conversations, args.system_prompts, args.max_tokens, args.seed)
    prompt_tokens = sum(len(p) for p, _ in requests)
    print(f"model layout gemma3-1b: {LAYERS} layers, {sum(w is None for w in LAYER_WINDOWS)} "
          f"full, window {WINDOW}; {FULL_KV_BYTES:,} B/token with full KV")
    print(f"workload: {len(requests)} requests, {prompt_tokens:,} prompt tokens, "
          f"conversations to {args.max_tokens:,} tokens, page size {ps}")

    budget = args.budget_tokens * FULL_KV_BYTES
    started = time.perf_counter()
    full = run(PagedMemory(args.budget_tokens // ps, RadixCache(ps)), PrefixLease, requests, ps)
    full_s = time.perf_counter() - started

    checkpoint = args.checkpoint
    floor = window_pool_floor(WINDOW, ps, CHUNK, 32_768, checkpoint)
    pools = group_pool_pages(GROUPS, page_size=ps, kv_cache_tokens=None, budget=budget / 4,
                             fraction=args.window_fraction, floor=floor)
    rule = WindowRule(WINDOW, ps, checkpoint)
    mem = WindowedMemory(pools.full_pages, RadixCache(ps), pools.window_pages, rule)
    started = time.perf_counter()
    win = run(mem, WindowedLease, requests, ps)
    win_s = time.perf_counter() - started
    per_token = window_bytes_per_token(mem, ps)

    print(f"full-KV tree, {budget / 2**30:.2f} GiB: hit rate {full['hit_rate']:.4f}, "
          f"{full['tree_tokens']:,} tokens cached ({full_s:.1f} s)")
    print(f"window-aware tree, {pools.pool_bytes(GROUPS, ps) / 2**30:.2f} GiB (a quarter): "
          f"{pools.full_pages * ps:,} full-attention tokens + {pools.window_pages * ps:,} "
          f"windowed: hit rate {win['hit_rate']:.4f}, {win['tree_tokens']:,} tokens "
          f"cached ({win_s:.1f} s); {mem.dropped_windows:,} windowed pages dropped for room")
    print(f"KV bytes per cached token: {per_token:,.0f} vs {FULL_KV_BYTES:,} full KV = "
          f"{per_token / FULL_KV_BYTES:.3f} (target <= 0.25)")
    print(f"hit rate at a quarter of the memory: {win['hit_rate'] / full['hit_rate']:.3f} of "
          f"the full-KV tree's (target >= 0.95)")


if __name__ == "__main__":
    main()
