"""`radixserve plan MODEL`: how much KV fits, from the model's config and the serve flags.

Bad input (a missing file, a config without the needed fields, memory too small for the
weights) prints one line on stderr and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from radixserve.kv_sizing import DEFAULT_KV_MEMORY_FRACTION, KV_DTYPE_CHOICES
from radixserve.planner.capacity import PlanOptions, make_plan
from radixserve.planner.model_spec import PlanInputError, read_model_spec
from radixserve.planner.report import format_plan
from radixserve.units import parse_bytes, parse_tokens

# Nominal memory of common accelerators, as their drivers report it (GiB).
GPU_MEMORY_GIB = {"a10": 24, "l4": 24, "rtx4090": 24, "l40s": 48, "a100-40gb": 40,
                  "a100": 80, "a100-80gb": 80, "h100": 80, "h200": 140, "b200": 180,
                  "mi300x": 192}
class _Parser(argparse.ArgumentParser):
    def error(self, message: str):          # one line and exit 2, like every bad input here
        print(f"radixserve plan: {message}", file=sys.stderr)
        raise SystemExit(2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.__class__ = _Parser
    parser.add_argument("model", help="short name, Hugging Face directory, .gguf file or "
                                      "config.json (any architecture)")
    mem = parser.add_mutually_exclusive_group()
    mem.add_argument("--memory", type=parse_bytes, default=None,
                     help="accelerator memory, e.g. 80GiB (default: the CPU rule, 4 GiB "
                          "of KV)")
    mem.add_argument("--gpu", choices=sorted(GPU_MEMORY_GIB), default=None,
                     help="take --memory from a known accelerator")
    parser.add_argument("--context", type=parse_tokens, default=32768,
                        help="tokens per request (prompt + output), e.g. 32k")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--shared-prefix-tokens", type=parse_tokens, default=0,
                        help="a prefix every request shares (a system prompt)")
    parser.add_argument("--dtype", default="auto",
                        choices=["auto", "bfloat16", "float16", "float32"],
                        help="weights and compute dtype (auto: bfloat16)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_DTYPE_CHOICES)
    parser.add_argument("--kv-cache-dtype-k", default=None, choices=KV_DTYPE_CHOICES)
    parser.add_argument("--kv-cache-dtype-v", default=None, choices=KV_DTYPE_CHOICES)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--kv-cache-tokens", type=parse_tokens, default=None)
    parser.add_argument("--kv-cache-memory-fraction", type=float,
                        default=DEFAULT_KV_MEMORY_FRACTION)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def options_from_args(args: argparse.Namespace) -> PlanOptions:
    memory = args.memory
    if args.gpu is not None:
        memory = GPU_MEMORY_GIB[args.gpu] * 2**30
    return PlanOptions(
        context=args.context, concurrency=args.concurrency, memory_bytes=memory,
        dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_dtype_k=args.kv_cache_dtype_k, kv_cache_dtype_v=args.kv_cache_dtype_v,
        page_size=args.page_size, kv_cache_tokens=args.kv_cache_tokens,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        shared_prefix_tokens=args.shared_prefix_tokens)


def run(args: argparse.Namespace) -> int:
    try:
        plan = make_plan(read_model_spec(args.model), options_from_args(args))
    except PlanInputError as exc:
        print(f"radixserve plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(plan), indent=2) if args.json else format_plan(plan))
    return 0
