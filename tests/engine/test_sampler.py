"""Sampler: greedy, truncation sets, sampling frequencies, seeds, logprobs.

References are brute force: plain Python truncation over a sorted list, softmax
frequencies, torch.log_softmax of the raw logits.
"""

from __future__ import annotations

import math

import pytest
import torch

from radixserve.engine.sampler import Sampler
from radixserve.engine.sampling_params import SamplingParams


def sp(**kw) -> SamplingParams:
    return SamplingParams(**kw)


def draw(sampler, logits_row, params, n, generators=None):
    """n independent draws of one row, as one batch of n identical rows."""
    logits = logits_row.expand(n, -1).contiguous()
    gens = generators if generators is not None else [None] * n
    return sampler.sample(logits, [params] * n, gens).token_ids


def reference_allowed(probs: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    """Top-k, then top-p over the renormalised top-k mass, then min-p; brute force."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    if top_k > 0:
        order = order[:top_k]
    mass = sum(probs[i] for i in order)
    kept, before = [], 0.0
    for i in order:
        if top_p < 1.0 and before >= top_p * mass:
            break
        kept.append(i)
        before += probs[i]
    pmax = max(probs)
    return {i for i in kept if probs[i] >= min_p * pmax}


def test_greedy_rows_are_argmax_in_mixed_batch():
    torch.manual_seed(0)
    logits = torch.randn(12, 500)
    params = [sp(temperature=0.0), sp(top_k=1, temperature=1.3), sp(temperature=0.9)] * 4
    result = Sampler().sample(logits, params, [None] * 12)
    argmax = logits.argmax(-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            assert result.token_ids[i] == argmax[i]
    assert Sampler().sample(logits, [sp(temperature=0.0)] * 12, [None] * 12).token_ids == argmax


def test_top_k_one_is_deterministic():
    torch.manual_seed(1)
    row = torch.randn(1, 300)
    # A flat distribution: any randomness left would show up across 200 draws.
    row = row * 0.01
    tokens = draw(Sampler(), row, sp(top_k=1, temperature=1.5), 200)
    assert set(tokens) == {int(row.argmax())}


CRAFTED = [0.3, 0.25, 0.2, 0.1, 0.05, 0.04, 0.03, 0.02, 0.006, 0.004]


@pytest.mark.parametrize("top_k,top_p,min_p,allowed", [
    (3, 1.0, 0.0, {0, 1, 2}),
    (-1, 0.6, 0.0, {0, 1, 2}),          # mass before token 2 is 0.55 < 0.6
    (-1, 0.5, 0.0, {0, 1}),             # mass before token 2 is 0.55 >= 0.5
    (4, 0.6, 0.0, {0, 1}),              # top-p over the top-4 mass 0.85: 0.55 >= 0.51
    (-1, 1.0, 0.5, {0, 1, 2}),          # probability >= 0.15
    (0, 0.96, 0.0, {0, 1, 2, 3, 4, 5, 6}),   # 0 disables k; mass before token 7 is 0.97
])
@pytest.mark.parametrize("window", [1024, 2])    # 2: the nucleus spills out of the window
def test_truncation_never_leaves_allowed_set(top_k, top_p, min_p, allowed, window):
    torch.manual_seed(2)
    row = torch.tensor(CRAFTED).log()[None, :]
    params = sp(top_k=top_k, top_p=top_p, min_p=min_p)
    assert reference_allowed(CRAFTED, top_k, top_p, min_p) == allowed
    tokens = draw(Sampler(nucleus_window=window), row, params, 4000)
    assert set(tokens) == allowed       # nothing outside; everything inside shows up
    # Inside the set, frequencies follow the renormalised probabilities.
    mass = sum(CRAFTED[i] for i in allowed)
    for i in allowed:
        assert abs(tokens.count(i) / 4000 - CRAFTED[i] / mass) < 0.04


@pytest.mark.parametrize("window", [2, 8, 1024])   # 2 and 8: widen by topk, then sort
def test_truncation_matches_brute_force_on_random_distributions(window):
    gen = torch.Generator().manual_seed(3)
    sampler = Sampler(nucleus_window=window)
    for trial in range(12):
        row = torch.randn(1, 150, generator=gen) * (1.0 + trial % 2)
        probs = torch.softmax(row[0].double(), -1).tolist()
        top_k = [-1, 5, 20][trial % 3]
        top_p = [1.0, 0.9, 0.5, 0.75][trial % 4]
        min_p = [0.0, 0.0, 0.1][trial % 3]
        allowed = reference_allowed(probs, top_k, top_p, min_p)
        tokens = set(draw(sampler, row, sp(top_k=top_k, top_p=top_p, min_p=min_p), 3000))
        assert tokens <= allowed
        mass = sum(probs[i] for i in allowed)
        assert {i for i in allowed if probs[i] / mass > 0.01} <= tokens


def softmax_list(row: torch.Tensor, temperature: float) -> list[float]:
    z = [x / temperature for x in row.tolist()]
    m = max(z)
    e = [math.exp(x - m) for x in z]
    return [x / sum(e) for x in e]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_temperature_frequencies_follow_softmax(temperature):
    torch.manual_seed(4)
    row = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, -1.5]])
    n = 20000
    tokens = draw(Sampler(), row, sp(temperature=temperature), n)
    expected = softmax_list(row[0], temperature)
    for i, p in enumerate(expected):
        # 5 standard deviations of a binomial proportion, plus a little slack.
        assert abs(tokens.count(i) / n - p) < 5 * math.sqrt(p * (1 - p) / n) + 1e-3


def test_seeded_row_frequencies_follow_softmax():
    """One generator drawn from step after step is an honest sampler too."""
    row = torch.tensor([[0.5, 1.5, -0.3, 0.9]])
    g = torch.Generator().manual_seed(5)
    sampler = Sampler()
    n = 3000
    tokens = [sampler.sample(row, [sp(temperature=0.8)], [g]).token_ids[0] for _ in range(n)]
    for i, p in enumerate(softmax_list(row[0], 0.8)):
        assert abs(tokens.count(i) / n - p) < 5 * math.sqrt(p * (1 - p) / n) + 1e-3


SEEDED_CASES = [
    sp(temperature=1.0),
    sp(temperature=0.7, top_k=40),
    sp(temperature=1.2, top_p=0.9),
    sp(temperature=0.9, top_k=200, top_p=0.8, min_p=0.02),
    sp(temperature=1.5, min_p=0.1),
]


def run_seeded(target: SamplingParams, seed: int, steps: int, vocab: int,
               others: list[SamplingParams], position: int, other_seed: int | None):
    """Generate `steps` tokens for a seeded row placed among `others`."""
    logit_gen = torch.Generator().manual_seed(99)      # same logits every run
    g = torch.Generator().manual_seed(seed)
    other_gens = [torch.Generator().manual_seed(other_seed + j) if other_seed is not None
                  else None for j in range(len(others))]
    sampler = Sampler(nucleus_window=64)
    out = []
    for _ in range(steps):
        target_logits = torch.randn(1, vocab, generator=logit_gen) * 3
        other_logits = torch.randn(len(others), vocab)       # global RNG: differs per run
        logits = torch.cat([other_logits[:position], target_logits, other_logits[position:]])
        params = others[:position] + [target] + others[position:]
        gens = other_gens[:position] + [g] + other_gens[position:]
        out.append(sampler.sample(logits, params, gens).token_ids[position])
    return out


@pytest.mark.parametrize("target", SEEDED_CASES)
def test_seed_reproduces_across_batch_compositions(target):
    vocab, steps = 2000, 25
    torch.manual_seed(6)
    alone = run_seeded(target, 1234, steps, vocab, [], 0, None)
    compositions = [
        ([sp(temperature=0.0)] * 3, 1, None),
        ([sp(top_k=1500), sp(top_p=0.99, temperature=2.0), sp()], 3, None),   # wide window, spill
        ([sp(top_k=3), sp(temperature=0.5, top_p=0.3)], 0, 7),               # other seeded rows
        ([sp(min_p=0.3), sp(temperature=0.0), sp(top_k=10, top_p=0.5)] * 5, 9, None),
    ]
    for others, position, other_seed in compositions:
        torch.manual_seed(position + 17)
        got = run_seeded(target, 1234, steps, vocab, others, position, other_seed)
        assert got == alone
    assert run_seeded(target, 4321, steps, vocab, [], 0, None) != alone


def test_logprobs_match_log_softmax_of_raw_logits():
    torch.manual_seed(8)
    logits = torch.randn(5, 300) * 2
    params = [sp(logprobs=3, temperature=0.5), sp(), sp(logprobs=0),
              sp(temperature=0.0, logprobs=20), sp(logprobs=5, top_k=10)]
    result = Sampler().sample(logits, params, [None] * 5)
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert len(result.token_ids) == len(result.logprobs) == 5
    assert result.logprobs[1] is None
    for i, p in enumerate(params):
        lp = result.logprobs[i]
        if p.logprobs is None:
            continue
        tok = result.token_ids[i]
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(reference[i, tok].item(), abs=1e-5)
        assert len(lp.top) == p.logprobs
        ref_vals, ref_ids = reference[i].topk(p.logprobs) if p.logprobs else (torch.empty(0), [])
        assert [t for t, _ in lp.top] == list(map(int, ref_ids))
        assert [v for _, v in lp.top] == pytest.approx(ref_vals.tolist(), abs=1e-5)
    # Greedy rows pick the best token, whose logprob heads the top list.
    best = result.logprobs[3]
    assert best.top[0] == (result.token_ids[3], pytest.approx(best.logprob))


def test_empty_batch_and_shape_errors():
    sampler = Sampler()
    empty = sampler.sample(torch.empty(0, 10), [], [])
    assert empty.token_ids == [] and empty.logprobs == []
    with pytest.raises(ValueError):
        sampler.sample(torch.zeros(2, 10), [sp()], [None, None])
    with pytest.raises(ValueError):
        sampler.sample(torch.zeros(10), [sp()], [None])
