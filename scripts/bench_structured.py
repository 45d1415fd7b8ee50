"""Structured outputs, measured side by side in one run (docs/structured.md):

1. mask cost per decode step at batch 32: 32 constrained requests vs 32 plain ones on the
   same engine; the masks' own time (filled + applied) against the mean step time;
2. compile time of a 50-tool `required` grammar: cold, warm (memory), after a restart (a
   new compiler on the same cache directory), without and with the start-up prewarm;
3. a 50-tool agent loop: cached prompt tokens per turn, on a first engine and then on a
   second one restored from the first's saved KV cache (--kv-disk-dir); with
   --two-processes, across two server processes instead (structured_two_servers.py).

    PYTHONPATH=$PWD python scripts/bench_structured.py [--batch 32] [--turns 4]
    PYTHONPATH=$PWD python scripts/bench_structured.py --two-processes [--turns 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from radixserve.engine.config import EngineConfig
from radixserve.engine.engine import Engine
from radixserve.engine.grammar import GrammarSpec
from radixserve.engine.grammar_cache import GrammarCompiler
from radixserve.engine.sampling_params import SamplingParams
from radixserve.model import load_model
from radixserve.server import protocol as P
from radixserve.server.tools import ToolChoice, call_grammar, parse_tools, render_messages

MODEL = "smollm2-135m-instruct"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0,
                                                         "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 8}},
    "required": ["name", "age", "tags"], "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False}}


def fifty_tools() -> list[dict]:
    return [{"type": "function", "function": {
        "name": f"tool_{i:02d}", "description": f"Look up record kind {i} by query.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "maxLength": 64},
            "limit": {"type": "integer", "minimum": 1, "maximum": 100},
            "mode": {"enum": ["fast", "exact", f"mode_{i}"]}},
            "required": ["query", "limit"], "additionalProperties": False}}} for i in range(50)]


def engine_config(**kw) -> EngineConfig:
    return EngineConfig(**{"model": MODEL, "dtype": "float32", "device": "cpu",
                           "kv_cache_tokens": 65536, "max_running_requests": 64,
                           "warmup_tokens": 64, **kw})


async def mask_cost(loaded, batch: int, tokens: int) -> dict:
    engine = Engine(engine_config(), loaded)
    await engine.start()
    compiler = GrammarCompiler(engine.tokenizer)
    grammar = compiler.compile_blocking(GrammarSpec.json_schema(SCHEMA))
    prompts = [engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Describe person number {i} as JSON."}])
        for i in range(batch)]
    out = {}
    for label, g in (("plain", None), ("constrained", grammar), ("plain_again", None)):
        masks = engine.runner.sampler.masks
        steps0, mask0 = engine.stats().steps, masks.seconds
        params = SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=g is None,
                                grammar=g)

        async def one(p):
            async for _ in engine.generate(p, params):
                pass
        started = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - started
        steps = engine.stats().steps - steps0
        out[label] = {"steps": steps, "ms_per_step": round(wall / steps * 1e3, 2),
                      "mask_ms_per_step": round((masks.seconds - mask0) / max(steps, 1) * 1e3, 3)}
        await engine.flush_cache()
    await engine.shutdown()
    c = out["constrained"]
    out["mask_share_of_step"] = round(c["mask_ms_per_step"] / c["ms_per_step"], 4)
    return out


def _timed(fn) -> tuple[float, float, object]:
    """(wall ms, CPU ms of this process, result): CPU time is steadier on a busy machine."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3, result


def compile_times(tokenizer, rounds: int) -> dict:
    """Per round, on a fresh cache directory: cold (nothing cached), warm (memory), after a
    restart without prewarm (a new compiler: the disk entry, then the matcher built), and
    after a restart with prewarm (`prewarm` done at start, off the request path; the
    request then finds the grammar built). The first compile of each new compiler waits
    for llguidance's tokenizer, built at start (timed apart as `tokenizer_build`)."""
    toolset = parse_tools(fifty_tools())
    spec = call_grammar(toolset, ToolChoice("required"), parallel=True)
    names = ("tokenizer_build", "cold", "warm", "after_restart_disk", "prewarm_at_start",
             "after_restart_prewarmed")
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    builds_after_prewarm = []
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as d:
            measured = {}
            first = GrammarCompiler(tokenizer, Path(d))
            measured["tokenizer_build"] = _timed(lambda: first.prewarm(0).result())
            measured["cold"] = _timed(lambda: first.compile_blocking(spec))
            measured["warm"] = _timed(lambda: first.compile_blocking(spec))
            restarted = GrammarCompiler(tokenizer, Path(d))
            restarted.prewarm(0).result()              # its tokenizer, built at start
            measured["after_restart_disk"] = _timed(lambda: restarted.compile_blocking(spec))
            prewarmed = GrammarCompiler(tokenizer, Path(d))
            measured["prewarm_at_start"] = _timed(lambda: prewarmed.prewarm(32).result())
            measured["after_restart_prewarmed"] = _timed(lambda: prewarmed.compile_blocking(spec))
            builds_after_prewarm.append(prewarmed.stats.compiles + prewarmed.stats.disk_hits)
            for c in (first, restarted, prewarmed):
                c.close()
            for n, (w, c, _) in measured.items():
                wall[n].append(w)
                cpu[n].append(c)
    median = lambda xs: round(sorted(xs)[len(xs) // 2], 3)    # noqa: E731
    return {"rounds": rounds,
            **{f"{n}_ms": median(wall[n]) for n in names},
            **{f"{n}_cpu_ms": median(cpu[n]) for n in names},
            "builds_on_request_path_after_prewarm": max(builds_after_prewarm)}


async def agent_loop(loaded, kv_dir: str, turns: int, label: str) -> list[dict]:
    """Turns of a conversation that carries 50 tools: prompt tokens, cached tokens, and the
    share of the tool block (the system message) found in the cache."""
    engine = Engine(engine_config(kv_disk_dir=kv_dir), loaded)
    await engine.start()
    tok = engine.tokenizer
    toolset = parse_tools(fifty_tools())
    block_msgs, _ = render_messages([], [], toolset, native=False)
    block_tokens = len(tok.apply_chat_template(block_msgs, add_generation_prompt=False))
    history = [P.ChatMessage(role="user", content="Find record 7 for 'alpha'.")]
    rows = []
    for turn in range(turns):
        texts = [m.content or "" for m in history]
        msgs, _ = render_messages(history, texts, toolset, native=False)
        ids = tok.apply_chat_template(msgs)
        final = None
        async for out in engine.generate(ids, SamplingParams(max_tokens=8, temperature=0)):
            final = out if out.finished else final
        cached = final.usage.cached_tokens
        rows.append({"engine": label, "turn": turn + 1, "prompt_tokens": len(ids),
                     "cached_tokens": cached, "tool_block_tokens": block_tokens,
                     "tool_block_hit": round(min(cached, block_tokens) / block_tokens, 4)})
        history += [P.ChatMessage(role="assistant", content=final.text or "ok"),
                    P.ChatMessage(role="user", content=f"Now record {turn + 8}, please.")]
    await engine.save_cache()
    await engine.shutdown()
    return rows


async def main(args) -> None:
    if args.two_processes:
        from structured_two_servers import run
        run(fifty_tools(), args.turns)
        return
    parts = set(args.parts.split(","))
    if "compile" in parts:
        from radixserve.model.tokenizer_loader import load_tokenizer
        print(json.dumps({"compile_50_tools": compile_times(load_tokenizer(MODEL),
                                                            args.rounds)}))
    if not parts & {"mask", "loop"}:
        return
    loaded = load_model(MODEL, dtype="float32", device="cpu")
    if "mask" in parts:
        print(json.dumps({"mask_cost_batch": args.batch,
                          **(await mask_cost(loaded, args.batch, args.tokens))}))
    if "loop" in parts:
        with tempfile.TemporaryDirectory() as kv_dir:
            for label in ("first", "second"):
                for row in await agent_loop(loaded, kv_dir, args.turns, label):
                    print(json.dumps(row))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5, help="compile-time rounds (medians)")
    ap.add_argument("--parts", default="mask,compile,loop",
                    help="which of mask, compile, loop to run (comma-separated)")
    ap.add_argument("--two-processes", action="store_true",
                    help="only the agent loop, across two `radixserve serve` processes sharing "
                         "--kv-disk-dir and --grammar-cache-dir (structured_two_servers.py)")
    asyncio.run(main(ap.parse_args()))
