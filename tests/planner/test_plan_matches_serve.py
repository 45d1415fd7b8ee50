"""The planner's pool equals the pool `radixserve serve` allocates for the same flags.

The server side parses the flags with serve's own parser, builds the engine on the default
model and reads the pool line serve prints at start (`describe_pool`).
"""

from __future__ import annotations

import json
import re

import pytest

import radixserve.kv_sizing as kv_sizing
from radixserve.cli import build_parser_for, main
from radixserve.engine.config import EngineConfig
from radixserve.engine.engine import Engine
from radixserve.server.cli import describe_pool

MODEL = "smollm2-135m-instruct"

FLAG_SETS = [
    ["--dtype", "bfloat16", "--kv-cache-tokens", "5000", "--page-size", "16"],
    ["--dtype", "float32", "--kv-cache-tokens", "777"],
    ["--dtype", "bfloat16", "--page-size", "4"],           # the CPU byte budget
    ["--dtype", "float32", "--page-size", "3"],
    ["--dtype", "bfloat16", "--kv-cache-dtype", "fp8_e4m3", "--page-size", "16"],
    ["--dtype", "float32", "--kv-cache-dtype", "int8", "--kv-cache-dtype-k", "bfloat16"],
    ["--dtype", "bfloat16", "--kv-cache-dtype-v", "fp8_e5m2", "--kv-cache-tokens", "3001"],
]


def served_pool(argv: list[str], loaded) -> tuple[int, int]:
    args = build_parser_for(["serve"]).parse_args(["serve", "--model", MODEL, *argv])
    engine = Engine(EngineConfig.from_args(args), loaded)
    line = describe_pool(engine)
    m = re.search(r"KV pool: (\d+) tokens .* \((\d+) bytes\)", line)
    assert m, line
    return int(m.group(1)), int(m.group(2))


def planned_pool(argv: list[str], capsys) -> tuple[int, int]:
    assert main(["plan", MODEL, *argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    return got["pool_tokens"], got["pool_bytes"]


@pytest.mark.parametrize("argv", FLAG_SETS, ids=" ".join)
def test_planner_pool_equals_served_pool(argv, monkeypatch, capsys, request):
    # A small CPU budget: the same rule as the 4 GiB default, without allocating 4 GiB.
    monkeypatch.setattr(kv_sizing, "CPU_KV_BUDGET_BYTES", 48 << 20)
    loaded = request.getfixturevalue("model_fp32" if "float32" in argv else "model_bf16")
    served = served_pool(argv, loaded)
    assert planned_pool(argv, capsys) == served
    assert served[0] > 0
