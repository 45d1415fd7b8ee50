"""Constrained decoding in the engine: a preempted sequence's grammar continues where its
tokens left off (same greedy tokens as without preemption), aborts and finished samples let
their matchers go, and every page is accounted for."""

from __future__ import annotations

import asyncio
import re

from radixserve.engine.grammar import GrammarSpec
from radixserve.engine.grammar_cache import GrammarCompiler
from radixserve.engine.sampling_params import SamplingParams
from tests.engine.engine_helpers import QUESTIONS, chat_ids, check_pages, collect, make_engine, \
    run_all, run_scenario

# Can only end after 24 digits: with max_tokens 30 every sample runs to its limit.
DIGITS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
          "minItems": 24, "maxItems": 24, "x-guidance": {"whitespace_flexible": False}}


def test_preempted_sequences_keep_their_grammar(model_fp32):
    compiler = GrammarCompiler(make_engine(model_fp32).tokenizer)
    grammar = compiler.compile_blocking(GrammarSpec.json_schema(DIGITS))
    params = SamplingParams(max_tokens=30, temperature=0.0, grammar=grammar)
    big = make_engine(model_fp32)
    prompts = [big.tokenizer.encode(" ".join([q] * 8)) for q in QUESTIONS[:3]]   # no shared
                                                                                  # prefix
    reference = run_all(big, prompts, params)
    # Two sequences admitted with the scheduler's 16-token decode reserve each; past it
    # they run out of pages and one is preempted (recomputed with its tokens later).
    longest = max(len(p) for p in prompts)
    small = make_engine(model_fp32, kv_cache_tokens=2 * (longest + 16) + 2,
                        chunked_prefill_size=1024, schedule_policy="fcfs")
    results = run_all(small, prompts, params)
    assert small.stats().preemptions > 0
    assert [r.token_ids[0] for r in results] == [r.token_ids[0] for r in reference]
    for r in results:
        assert r.final.finish_reason == "length"        # the grammar cannot end in 30 tokens
        assert re.fullmatch(r"\[[0-9](,[0-9])*,?", r.text[0]), r.text[0]
    assert compiler.matchers.live == 0


def test_abort_releases_the_matcher_and_pages(model_fp32):
    engine = make_engine(model_fp32)
    compiler = GrammarCompiler(engine.tokenizer)
    grammar = compiler.compile_blocking(GrammarSpec.json_schema(DIGITS))

    async def scenario(engine):
        stream = engine.generate(chat_ids(engine, QUESTIONS[0]),
                                 SamplingParams(max_tokens=30, temperature=1.0, n=2,
                                                grammar=grammar), request_id="g1")
        seen = 0
        async for out in stream:
            seen += len(out.token_ids)
            if seen == 2:
                assert compiler.matchers.live == 2
                engine.abort("g1")
            if out.finished and out.index == 1:
                break
        await stream.aclose()
        # the engine keeps serving constrained requests
        return await collect(engine.generate(chat_ids(engine, QUESTIONS[1]), SamplingParams(
            max_tokens=4, temperature=0.0, grammar=compiler.compile_blocking(
                GrammarSpec.json_object()))))

    done = run_scenario(engine, scenario, check_pages)
    assert compiler.matchers.live == 0
    assert done.text[0].startswith("{") and len(done.token_ids[0]) == 4


def test_deterministic_mode_stays_deterministic_under_a_grammar(model_fp32):
    """Seeded sampling under a grammar: the same tokens alone and beside other requests."""
    engine = make_engine(model_fp32, deterministic=True)
    compiler = GrammarCompiler(engine.tokenizer)
    grammar = compiler.compile_blocking(GrammarSpec.json_schema(DIGITS))
    seeded = SamplingParams(max_tokens=6, temperature=1.0, seed=7, grammar=grammar)

    async def scenario(engine):
        prompt = chat_ids(engine, QUESTIONS[2])
        alone = await collect(engine.generate(prompt, seeded))
        others = [asyncio.create_task(collect(engine.generate(
            chat_ids(engine, q), SamplingParams(max_tokens=6, temperature=1.0))))
            for q in QUESTIONS[3:5]]
        together = await collect(engine.generate(prompt, seeded))
        await asyncio.gather(*others)
        return alone, together

    alone, together = run_scenario(engine, scenario, check_pages)
    assert alone.token_ids[0] == together.token_ids[0]
    assert compiler.matchers.live == 0
