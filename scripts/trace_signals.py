#!/usr/bin/env python
"""Which online signals predict a block's reuse in a hash trace: evidence for eviction policies.

An eviction policy can only act on what a live server knows when it keys a leaf. This reads
a Mooncake-format trace (hash ids per request, in file order) and, for every block access,
notes such facts and whether -- and how soon -- the same block is used again:

- new blocks (their first sighting), by the *reply length* of the request that brought them
  (powers of 4; a server knows it when the request finishes, before the leaf is unlocked),
  by whether that request *continued a known prefix* (its first block was seen before), and
  by the request's *size* (powers of 4 blocks);
- blocks seen before, by their *last reuse gap* (powers of 4 block accesses): does a short
  gap predict another short one (the premise of LIRS and LRU-K)?

Per bucket: blocks, the share used again at all, and the share used again within
``--within`` block accesses (roughly what an LRU cache of that many blocks would catch).
A signal helps a policy where its buckets differ a lot in those shares.

    python scripts/trace_signals.py ../shared/traces/mooncake_fast25_synthetic_trace.jsonl
    python scripts/trace_signals.py traces/chat.jsonl --block-size 16 --within 4096 --json
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import sys

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from radixserve.replay.traces import read_trace  # noqa: E402

NEVER = math.inf


@dataclass
class Bucket:
    """Block accesses that share one value of a signal."""

    blocks: int = 0
    reused: int = 0            # used again later in the trace
    reused_within: int = 0     # used again within `within` block accesses

    def add(self, gap: float, within: int) -> None:
        self.blocks += 1
        self.reused += gap != NEVER
        self.reused_within += gap <= within

    def row(self) -> dict:
        n = max(self.blocks, 1)
        return {"blocks": self.blocks, "reused": self.reused / n,
                "reused_within": self.reused_within / n}


@dataclass
class SignalTable:
    """Buckets per signal name, in the order the buckets were first met."""

    within: int
    signals: dict[str, dict[str, Bucket]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(Bucket)))

    def add(self, signal: str, value: str, gap: float) -> None:
        self.signals[signal][value].add(gap, self.within)

    def to_dict(self) -> dict:
        return {"within": self.within,
                "signals": {s: {v: b.row() for v, b in sorted(buckets.items(), key=_order)}
                            for s, buckets in self.signals.items()}}


def _order(item: tuple[str, Bucket]) -> tuple:
    """Buckets named by a bound ("< 64", ">= 256") sort by it; others by name."""
    value = item[0]
    digits = "".join(c for c in value if c.isdigit())
    return (value[0] != "<" and value[0] != ">", int(digits) if digits else 0, value)


def power_of_4_bucket(x: int, top: int) -> str:
    """"< 4", "< 16", ... up to ">= top" (top a power of 4)."""
    bound = 4
    while bound <= top:
        if x < bound:
            return f"< {bound}"
        bound *= 4
    return f">= {top}"


def next_use_gaps(requests: Sequence[Sequence[int]]) -> list[float]:
    """For every block access in order: block accesses until the same block's next access
    (NEVER when it is the last)."""
    flat = [b for ids in requests for b in ids]
    gaps: list[float] = [NEVER] * len(flat)
    seen_at: dict[int, int] = {}
    for i in range(len(flat) - 1, -1, -1):
        later = seen_at.get(flat[i])
        if later is not None:
            gaps[i] = later - i
        seen_at[flat[i]] = i
    return gaps


def signal_table(requests: Sequence[Sequence[int]], replies: Sequence[int],
                 within: int) -> SignalTable:
    """The table for `requests` (hash ids each) with their reply lengths (tokens)."""
    gaps = next_use_gaps(requests)
    table = SignalTable(within)
    last_seen: dict[int, int] = {}      # block -> index of its latest access
    prev_gap: dict[int, int] = {}       # block -> its latest reuse gap
    i = 0
    for ids, reply in zip(requests, replies):
        continues = bool(ids) and ids[0] in last_seen
        size = power_of_4_bucket(len(ids), 256)
        for block in ids:
            gap = gaps[i]
            if block not in last_seen:
                table.add("new block: reply tokens", power_of_4_bucket(reply, 1024), gap)
                table.add("new block: request", "continues a known prefix" if continues
                          else "starts new", gap)
                table.add("new block: request blocks", size, gap)
            else:
                prev_gap[block] = i - last_seen[block]
                table.add("seen block: last reuse gap (block accesses)",
                          power_of_4_bucket(prev_gap[block], 4**8), gap)
            last_seen[block] = i
            i += 1
    return table


def print_table(table: SignalTable) -> None:
    data = table.to_dict()
    for signal, rows in data["signals"].items():
        print(f"\n{signal:<46}{'blocks':>9}{'reused':>9}{'within ' + str(data['within']):>14}")
        for value, row in rows.items():
            print(f"  {value:<44}{row['blocks']:>9,}{row['reused']:>9.1%}"
                  f"{row['reused_within']:>14.1%}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="a hash-id JSONL trace (Mooncake format)")
    p.add_argument("--block-size", type=int, default=512, help="tokens per hash id")
    p.add_argument("--within", type=int, default=8192,
                   help="count reuses within this many block accesses (default 8192)")
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    args = p.parse_args(argv)
    trace = read_trace(args.trace, "hash", args.block_size)
    table = signal_table([r.hash_ids for r in trace.requests],
                         [r.output_length for r in trace.requests], args.within)
    if args.json:
        print(json.dumps(table.to_dict(), indent=1))
    else:
        print(f"{args.trace}: {len(trace.requests):,} requests, "
              f"{sum(len(r.hash_ids) for r in trace.requests):,} block accesses")
        print_table(table)


if __name__ == "__main__":
    main()
