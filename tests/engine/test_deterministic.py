"""--deterministic: a request's tokens depend only on the request — not on what runs beside
it, how its prompt is chunked, preemption and recompute, the prefix cache, or page size."""

from __future__ import annotations

import asyncio
import random

import pytest

from engine_helpers import QUESTIONS, SYSTEM_PROMPT, chat_ids, collect, make_engine, wait_idle
from radixserve.engine.sampling_params import SamplingParams
from radixserve.model.invariant_ops import native_bf16_cpu

# bf16 determinism is promised (and so checked) only where bf16 GEMMs are native; elsewhere
# deterministic mode refuses bf16 linears at start (test_bf16_refused_without_native_bf16).
needs_native_bf16 = pytest.mark.skipif(not native_bf16_cpu(),
                                       reason="CPU without AVX512-BF16/AMX: bf16 refused")

OTHER_SYSTEM = "You are a terse geography tutor. Reply with the answer only, no sentence. " * 4


def prompts_for(engine) -> list[list[int]]:
    """32 prompts: 16 questions behind each of two long shared system prompts."""
    return [chat_ids(engine, q, system=s) for s in (SYSTEM_PROMPT, OTHER_SYSTEM)
            for q in QUESTIONS]


def run(engine, prompts, params_for, order, one_at_a_time=False, warm=()):
    """Tokens per prompt index, running ``order`` (all at once unless one_at_a_time) after
    the ``warm`` prompts have run to completion."""

    async def main():
        await engine.start()
        try:
            for i in warm:
                await collect(engine.generate(prompts[i], params_for(i)))
            got = {}
            if one_at_a_time:
                for i in order:
                    got[i] = (await collect(engine.generate(prompts[i], params_for(i))))
            else:
                results = await asyncio.gather(*(collect(engine.generate(prompts[i],
                                                                         params_for(i)))
                                                 for i in order))
                got = dict(zip(order, results))
            await wait_idle(engine)
            engine.check_invariants()
            return [got[i].token_ids[0] for i in range(len(prompts))], got
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def three_ways(model, params_for, max_tokens):
    ref_engine = make_engine(model, deterministic=True, disable_radix_cache=True)
    prompts = prompts_for(ref_engine)
    n = len(prompts)
    # (a) one at a time, cache off
    alone, _ = run(ref_engine, prompts, params_for, range(n), one_at_a_time=True)
    # (b) all at once, cache on, page size 16, a pool for ~3 sequences (preemption), small
    #     chunked-prefill budget
    longest = max(map(len, prompts)) + max_tokens
    busy = make_engine(model, deterministic=True, page_size=16,
                       kv_cache_tokens=3 * longest + 64, chunked_prefill_size=96)
    together, _ = run(busy, prompts, params_for, list(range(n)))
    assert busy.stats().preemptions > 0
    # (c) another order, on a cache warmed by other requests (partial hits, copy-on-write
    #     at page size 4)
    order = list(range(n))
    random.Random(1).shuffle(order)
    warmed = make_engine(model, deterministic=True, page_size=4)
    shuffled, got = run(warmed, prompts, params_for, order, warm=[3, 20, 7])
    assert sum(r.final.usage.cached_tokens for r in got.values()) > 0
    return alone, together, shuffled


@needs_native_bf16
def test_greedy_identical_alone_batched_preempted_and_cached_bf16(model_bf16):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone, together, shuffled = three_ways(model_bf16, lambda i: params, 12)
    assert sum(a == b for a, b in zip(alone, together)) == 32
    assert sum(a == b for a, b in zip(alone, shuffled)) == 32
    assert all(len(t) == 12 for t in alone)


@needs_native_bf16
def test_seeded_sampling_identical_bf16(model_bf16):
    def params_for(i):
        return SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=1000 + i,
                              ignore_eos=True)

    alone, together, shuffled = three_ways(model_bf16, params_for, 10)
    assert sum(a == b for a, b in zip(alone, together)) == 32
    assert sum(a == b for a, b in zip(alone, shuffled)) == 32
    assert len({tuple(t) for t in alone}) > 16     # really sampled: not all the same


@pytest.fixture(scope="module")
def model_fp16(tmp_path_factory):
    """A random-weight two-layer model with SmolLM2-135M's layer shapes (576 wide, 1,536
    MLP, 9 query and 3 KV heads: the same GEMM reductions the real model's layers do) and a
    small vocabulary, in fp16. fp16 has no native GEMM on most CPUs: the real model took
    130 s here for a few tokens; batch invariance is a property of the kernels' shapes."""
    from radixserve.model import load_model
    from tests.model.tiny_models import hf_config, random_hf_model, save_hf_dir
    config = hf_config("llama", hidden_size=576, intermediate_size=1536,
                       num_attention_heads=9, num_key_value_heads=3,
                       max_position_embeddings=4096)
    path = save_hf_dir(tmp_path_factory.mktemp("fp16") / "llama", random_hf_model(config))
    return load_model(str(path), dtype="float16")


def alone_and_together(model):
    """6 prompts' (3 behind each system prompt) 6 greedy tokens one at a time (cache off),
    then all at once in reverse order, chunked, page size 16, after one warm-up prompt.
    Kept small: fp16 has no native GEMM on most CPUs."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ref_engine = make_engine(model, deterministic=True, disable_radix_cache=True)
    prompts = prompts_for(ref_engine)[::6]
    alone, _ = run(ref_engine, prompts, lambda i: params, range(len(prompts)),
                   one_at_a_time=True)
    busy = make_engine(model, deterministic=True, page_size=16, chunked_prefill_size=80)
    together, _ = run(busy, prompts, lambda i: params, list(range(len(prompts)))[::-1],
                      warm=[2])
    return alone, together


def test_greedy_identical_fp16(model_fp16):
    alone, together = alone_and_together(model_fp16)
    assert alone == together


@needs_native_bf16
def test_greedy_identical_with_decode_groups_bf16(model_bf16):
    """A system prompt longer than two 256-key chunks: the batched decodes share its whole
    chunks (computed once per group) and still match decoding each prompt alone."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ref_engine = make_engine(model_bf16, deterministic=True, disable_radix_cache=True)
    long_system = SYSTEM_PROMPT * 8
    prompts = [chat_ids(ref_engine, q, system=long_system) for q in QUESTIONS]
    assert len(prompts[0]) > 2 * 256
    alone, _ = run(ref_engine, prompts, lambda i: params, range(len(prompts)),
                   one_at_a_time=True)
    busy = make_engine(model_bf16, deterministic=True, page_size=16)
    backend = busy.runner.backend
    shared_chunks, prepare = [], backend.prepare

    def counting_prepare(meta):
        plan = prepare(meta)
        shared_chunks.append(plan.shared_chunks)
        return plan

    backend.prepare = counting_prepare
    together, _ = run(busy, prompts, lambda i: params, list(range(len(prompts)))[::-1],
                      warm=[0])
    assert max(shared_chunks) >= 2             # the grouped path really ran
    assert alone == together


@pytest.fixture(scope="module")
def model_int4():
    from radixserve.model import load_model
    return load_model("smollm2-135m-instruct", dtype="bfloat16", weights_dtype="int4")


def test_greedy_identical_int4_weights(model_int4):
    """Quantized linears (int4 groups, int8 LM head) keep --deterministic's promise: their
    kernels are row-invariant, so a batch of 6 gives each prompt its tokens alone."""
    assert type(model_int4.model.layers[0].qkv_proj).__name__ == "Int4Linear"
    alone, together = alone_and_together(model_int4)
    assert alone == together


def test_greedy_identical_int4_weights_float32(model_int4_fp32):
    """The same with float32 activations (int4 by name where bf16 is emulated): the casts
    to and from the kernels' bf16 are per element, so rows stay independent."""
    assert type(model_int4_fp32.model.layers[0].qkv_proj).__name__ == "Int4Linear"
    alone, together = alone_and_together(model_int4_fp32)
    assert alone == together


@pytest.mark.skipif(native_bf16_cpu(), reason="this CPU computes bf16 natively")
def test_bf16_refused_without_native_bf16(model_bf16):
    """Without AVX512-BF16 or AMX, bf16 GEMMs were measured not row-invariant: deterministic
    mode refuses bf16 linears at start, with the way out named, instead of breaking its
    promise."""
    with pytest.raises(ValueError, match="AVX512-BF16 or AMX.*float16 or float32"):
        make_engine(model_bf16, deterministic=True)
