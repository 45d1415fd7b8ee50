"""--seed: unseeded sampled requests are reproducible from the server seed (as in vLLM)."""

from __future__ import annotations

from engine_helpers import QUESTIONS, chat_ids, make_engine, run_all
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.seeds import SampleSeeds


def test_seeds_follow_the_server_seed_and_the_request_order():
    a, b, other = SampleSeeds(7), SampleSeeds(7), SampleSeeds(8)
    sampled = SamplingParams(temperature=1.0, n=2)
    first = a.for_request(sampled)
    assert first == b.for_request(sampled) and first != other.for_request(sampled)
    assert first[1] == first[0] + 1                                  # sample i: seed + i
    assert a.for_request(sampled) != first                           # a new draw per request
    assert a.for_request(SamplingParams(temperature=1.0, seed=5, n=3)) == [5, 6, 7]
    assert a.for_request(SamplingParams(temperature=0.0, n=2)) == [None, None]
    # Greedy and seeded requests take nothing from the sequence of drawn seeds.
    b.for_request(sampled)
    assert a.for_request(sampled) == b.for_request(sampled)


def test_server_seed_makes_unseeded_requests_reproducible(model_fp32):
    def outputs(server_seed):
        engine = make_engine(model_fp32, seed=server_seed)
        params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)   # no seed
        prompts = [chat_ids(engine, q) for q in QUESTIONS[:3]]
        return [r.token_ids[0] for r in run_all(engine, prompts, params)]

    assert outputs(11) == outputs(11)
    assert outputs(11) != outputs(12)
