"""Generate realistic prefix-cache traces (hash-id JSONL, Mooncake format), deterministically.

Why: the shared Mooncake trace is one workload; an eviction policy must also hold up on
traffic it was not designed on. Each generator below models one common shape of LLM
traffic, with sizes in tokens and times in milliseconds:

- chat:    multi-turn conversations after one of a few system prompts; each turn resends
           the whole history (previous prompt + the reply + a new user message) after a
           think time; conversations arrive as a Poisson process and end at random.
- agent:   tool-using agent loops: a long shared tool specification, a task, then many
           quick steps that each append a tool result and call the model again.
- fewshot: few-shot prompts: a handful of example blocks of Zipf popularity, each request
           one block + a unique question, arriving in bursts (batch jobs).
- rag:     retrieval-augmented prompts: a system prompt, k documents drawn from a corpus of
           Zipf popularity (the best match first), then a unique question.
- mixed:   all four interleaved by timestamp.

Each prompt is built from token segments; its blocks of `--block-size` tokens get chained
hash ids (a block's id names its content and its whole prefix, as in the Mooncake trace), so
equal ids mean equal prefixes. Outputs are not materialized beyond `output_length`, except
that chat replies become part of the next turn's prompt.

    python scripts/gen_traces.py --out traces/ --seed 0           # all five, ~3,000 requests each
    radixserve replay traces/chat.jsonl --block-size 16 --capacity-tokens 200k,400k
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

Segment = tuple[int, int]           # (segment id, length in tokens): distinct ids never match


@dataclass
class Request:
    timestamp: float                # ms
    segments: list[Segment]
    output_length: int


@dataclass
class _Segments:
    """Hands out fresh segment ids (unique content)."""

    next_id: int = 1

    def new(self, length: int) -> Segment:
        self.next_id += 1
        return (self.next_id, int(length))


def _lognormal(rng: np.random.Generator, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(np.clip(rng.lognormal(np.log(median), sigma), lo, hi))


def _zipf_choice(rng: np.random.Generator, n: int, s: float) -> int:
    weights = 1.0 / np.arange(1, n + 1) ** s
    return int(rng.choice(n, p=weights / weights.sum()))


# ---------------------------------------------------------------------------- workloads
def chat(rng: np.random.Generator, seg: _Segments, n: int) -> list[Request]:
    systems = [seg.new(_lognormal(rng, 1200, 0.5, 200, 4000)) for _ in range(4)]
    out: list[Request] = []
    t = 0.0
    while len(out) < n:
        t += rng.exponential(1500.0)                       # a new conversation every ~1.5 s
        history = [systems[_zipf_choice(rng, len(systems), 1.0)]]
        turn_t = t
        for _ in range(1 + rng.geometric(0.2)):           # ~5 turns on average
            history.append(seg.new(_lognormal(rng, 120, 1.0, 5, 3000)))      # user message
            reply = _lognormal(rng, 250, 0.8, 5, 2000)
            out.append(Request(turn_t, list(history), reply))
            history.append(seg.new(reply))                 # the reply joins the history
            turn_t += reply * 20.0 + rng.lognormal(np.log(30_000), 1.0)      # think time
    return out


def agent(rng: np.random.Generator, seg: _Segments, n: int) -> list[Request]:
    tools = [seg.new(_lognormal(rng, 4000, 0.3, 2000, 8000)) for _ in range(2)]
    out: list[Request] = []
    t = 0.0
    while len(out) < n:
        t += rng.exponential(8000.0)                      # a new task every ~8 s
        history = [tools[int(rng.integers(len(tools)))],
                   seg.new(_lognormal(rng, 300, 0.7, 20, 3000))]            # the task
        step_t = t
        for _ in range(int(rng.integers(4, 30))):
            call = _lognormal(rng, 60, 0.6, 10, 400)
            out.append(Request(step_t, list(history), call))
            history.append(seg.new(call))                  # the model's tool call
            history.append(seg.new(_lognormal(rng, 500, 1.0, 20, 6000)))     # tool result
            step_t += call * 20.0 + rng.lognormal(np.log(2000), 0.8)        # tool latency
    return out


def fewshot(rng: np.random.Generator, seg: _Segments, n: int) -> list[Request]:
    blocks = [seg.new(_lognormal(rng, 2500, 0.4, 800, 6000)) for _ in range(40)]
    out: list[Request] = []
    t = 0.0
    while len(out) < n:
        t += rng.exponential(20_000.0)                    # a batch job every ~20 s
        block = blocks[_zipf_choice(rng, len(blocks), 0.8)]
        for i in range(int(rng.integers(4, 48))):
            out.append(Request(t + i * rng.exponential(200.0),
                               [block, seg.new(_lognormal(rng, 150, 0.6, 10, 1000))],
                               _lognormal(rng, 40, 0.7, 1, 400)))
    return out


def rag(rng: np.random.Generator, seg: _Segments, n: int) -> list[Request]:
    system = seg.new(600)
    docs = [seg.new(_lognormal(rng, 1200, 0.5, 200, 4000)) for _ in range(3000)]
    out: list[Request] = []
    t = 0.0
    for _ in range(n):
        t += rng.exponential(500.0)
        k = int(rng.integers(2, 6))
        picked: list[int] = []
        while len(picked) < k:
            d = _zipf_choice(rng, len(docs), 1.1)
            if d not in picked:
                picked.append(d)
        out.append(Request(t, [system, *(docs[d] for d in picked),
                               seg.new(_lognormal(rng, 60, 0.6, 5, 500))],
                           _lognormal(rng, 200, 0.7, 5, 2000)))
    return out


WORKLOADS: dict[str, Callable[[np.random.Generator, _Segments, int], list[Request]]] = {
    "chat": chat, "agent": agent, "fewshot": fewshot, "rag": rag}


def mixed(rng: np.random.Generator, seg: _Segments, n: int) -> list[Request]:
    out: list[Request] = []
    for make in WORKLOADS.values():
        out += make(rng, seg, n // len(WORKLOADS))
    return out


# ---------------------------------------------------------------------------- hashing
@dataclass
class _BlockHasher:
    """Chained block ids, dense in order of first appearance (as the Mooncake trace's)."""

    block_size: int
    ids: dict[bytes, int] = field(default_factory=dict)

    def hash_ids(self, segments: list[Segment]) -> tuple[list[int], int]:
        tokens = np.concatenate([np.arange(length, dtype=np.int64) + sid * (1 << 32)
                                 for sid, length in segments])
        digest = b""
        out = []
        for start in range(0, len(tokens), self.block_size):
            digest = hashlib.blake2b(digest + tokens[start:start + self.block_size].tobytes(),
                                     digest_size=16).digest()
            out.append(self.ids.setdefault(digest, len(self.ids)))
        return out, len(tokens)


def records(requests: list[Request], block_size: int) -> Iterator[dict]:
    hasher = _BlockHasher(block_size)
    for r in sorted(requests, key=lambda r: r.timestamp):     # stable: ties keep order
        ids, length = hasher.hash_ids(r.segments)
        yield {"timestamp": int(r.timestamp), "input_length": length,
               "output_length": r.output_length, "hash_ids": ids}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--workloads", default="chat,agent,fewshot,rag,mixed",
                        help="comma list of: chat, agent, fewshot, rag, mixed")
    parser.add_argument("--requests", type=int, default=3000, help="requests per trace")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per hash id")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    makers = {**WORKLOADS, "mixed": mixed}
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.workloads.split(","):
        if name not in makers:
            parser.error(f"unknown workload {name!r}; choose from {sorted(makers)}")
        rng = np.random.default_rng([args.seed, sorted(makers).index(name)])
        requests = makers[name](rng, _Segments(), args.requests)[:args.requests]
        path = args.out / f"{name}.jsonl"
        with path.open("w") as f:
            for rec in records(requests, args.block_size):
                f.write(json.dumps(rec) + "\n")
        print(f"{path}: {len(requests)} requests", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
