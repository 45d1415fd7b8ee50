"""With 8-bit KV, generation from the prefix cache equals generation without it (fp32
compute, greedy), except where the uncached run itself stood at a near-tie.

Why not bit for bit: the cached prefix's bytes are identical either way, but the suffix is
computed in a different shape (alone after a cached prefix, or inside the whole prompt),
and fp32 GEMMs and attention round differently per shape: logits differ by ~3e-5 with
fp32 KV. Rounding storage turns some of those ulps into whole code steps: measured on
SmolLM2 (one prompt, prefix from the cache vs computed), the largest logit difference is
3.5e-5 with fp32 KV, 0.016 with bf16 KV, 0.19 with fp8_e4m3 KV. So the test bounds the
drift of the chosen tokens' logprobs per format (about twice what was measured), and
allows a different greedy token only where the uncached run's top two were closer than
twice that bound (a tie the drift can flip). Every reader of a cached page gets the same
bytes: a page's codes and scales never change (tests/attention/test_kv_quant.py).
"""

from __future__ import annotations

import pytest

from engine_helpers import QUESTIONS, chat_ids, make_engine, run_all
from radixserve.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)
FORMATS = {"fp8_e4m3": dict(kv_cache_dtype="fp8_e4m3"),
           "int8": dict(kv_cache_dtype="int8"),
           "k32_v8": dict(kv_cache_dtype_v="fp8_e5m2")}
# |logprob on - off| of the chosen tokens before any divergence, in nats
# (largest measured over two runs: fp8_e4m3 0.125, int8 0.056, K fp32 / V fp8_e5m2 0.038)
LOGPROB_DRIFT = {"fp8_e4m3": 0.25, "int8": 0.12, "k32_v8": 0.08}


async def tokens_and_logprobs(stream):
    """One request's greedy tokens and their TokenLogprobs."""
    tokens, logprobs = [], []
    async for out in stream:
        tokens += out.token_ids
        logprobs += out.logprobs or []
    return tokens, logprobs


def run_with_logprobs(engine, prompts, stagger: float = 0.0):
    return run_all(engine, prompts, GREEDY, stagger=stagger, collector=tokens_and_logprobs)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_cache_on_equals_cache_off(model_fp32, fmt):
    kv = FORMATS[fmt]
    off = make_engine(model_fp32, disable_radix_cache=True, **kv)
    prompts = [chat_ids(off, q) for q in QUESTIONS[:8]]
    expected = run_with_logprobs(off, prompts)
    for page_size in (1, 4):
        on = make_engine(model_fp32, page_size=page_size, **kv)
        assert on.runner.kv_pool.quantized
        got = run_with_logprobs(on, prompts, stagger=0.05)
        assert on.stats().prefix_hit_tokens > 0
        identical = 0
        for (a, lp_a), (b, lp_b) in zip(got, expected):
            n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            same = a[:n] if n is not None else a
            drift = max((abs(x.logprob - y.logprob) for x, y in zip(lp_a[:len(same)], lp_b)),
                        default=0.0)
            assert drift < LOGPROB_DRIFT[fmt], (page_size, drift)
            if n is None:
                identical += a == b
                continue
            (_, top1), (_, top2) = lp_b[n].top[:2]
            assert top1 - top2 < 2 * LOGPROB_DRIFT[fmt], (page_size, n, top1 - top2)
        assert identical >= len(prompts) - 2, (page_size, identical)


def test_start_line_names_the_dtypes_and_the_gain(model_fp32):
    engine = make_engine(model_fp32, kv_cache_dtype="fp8_e4m3", kv_cache_dtype_k="float32")
    line = engine.runner.describe_kv_cache()
    # per token: 30 layers x 3 heads x (64 x 4 + 64 + 4) = 29,160 B vs 46,080 in float32
    assert line == ("KV cache dtype: K float32, V fp8_e4m3 (a float32 scale per token and KV "
                    "head); 29,160 bytes per token vs 46,080 in float32: 1.58x the tokens")
    assert engine.runner.kv_pool.bytes_per_token == 29_160
