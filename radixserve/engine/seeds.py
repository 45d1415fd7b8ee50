"""Which seed each sample draws its random numbers from (what `--seed` does).

A request's own `seed` wins (sample i uses seed + i). A sampled request without one gets a
seed drawn from a generator seeded by the server's `--seed`, as vLLM's engine seed makes
unseeded requests reproducible: the same server seed and the same sequence of requests
give the same outputs, however the requests happen to be batched. Greedy requests draw
nothing (and take nothing from the sequence of seeds).
"""

from __future__ import annotations

import random

from radixserve.engine.sampling_params import SamplingParams

SEED_BITS = 62      # seed + i must stay below 2**63 (the largest seed a request may give)


class SampleSeeds:
    def __init__(self, server_seed: int):
        self._draw = random.Random(server_seed)

    def for_request(self, params: SamplingParams) -> list[int | None]:
        """One seed per sample (None: greedy, no randomness needed)."""
        if params.greedy:
            return [None] * params.n
        base = params.seed if params.seed is not None else self._draw.getrandbits(SEED_BITS)
        return [base + i for i in range(params.n)]
