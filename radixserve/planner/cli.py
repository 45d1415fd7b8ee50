"""`radixserve plan MODEL`: how much KV fits, from the model's config and the serve flags.

Bad input (a missing file, a config without the needed fields, memory too small for the
weights) prints one line on stderr and exits 2.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict

from radixserve.kv_sizing import DEFAULT_KV_MEMORY_FRACTION, KV_DTYPE_CHOICES
from radixserve.planner.capacity import PlanOptions, make_plan
from radixserve.planner.model_spec import PlanInputError, read_model_spec
from radixserve.planner.report import format_plan

# Nominal memory of common accelerators, as their drivers report it (GiB).
GPU_MEMORY_GIB = {"a10": 24, "l4": 24, "rtx4090": 24, "l40s": 48, "a100-40gb": 40,
                  "a100": 80, "a100-80gb": 80, "h100": 80, "h200": 140, "b200": 180,
                  "mi300x": 192}
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}


def parse_size(text: str) -> int:
    """"80GiB", "24GB", "512MiB", "1073741824" -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (e.g. 80GiB, 24GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_tokens(text: str) -> int:
    """"32k" -> 32768 (contexts count in powers of two), "4096" -> 4096."""
    m = re.fullmatch(r"\s*([0-9]+)\s*([kKmM]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (e.g. 4096, 32k)")
    return int(m.group(1)) * {"": 1, "k": 2**10, "m": 2**20}[m.group(2).lower()]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):          # one line and exit 2, like every bad input here
        print(f"radixserve plan: {message}", file=sys.stderr)
        raise SystemExit(2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.__class__ = _Parser
    parser.add_argument("model", help="short name, Hugging Face directory, .gguf file or "
                                      "config.json (any architecture)")
    mem = parser.add_mutually_exclusive_group()
    mem.add_argument("--memory", type=parse_size, default=None,
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
    parser.add_argument("--kv-cache-tokens", type=int, default=None)
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
