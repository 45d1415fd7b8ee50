"""The forward over a paged KV pool: chunked prefill and mixed batches give the logits
of a single whole-prompt pass (fp32)."""

from __future__ import annotations

import pytest
import torch

from model_helpers import PagedRunner

# Same math, different GEMM shapes (T differs), so float32 rounding differs slightly.
ATOL = 1e-3

TEXTS = [
    "The quick brown fox jumps over the lazy dog, and then it runs far away.",
    "用一句话介绍一下长城。它有多长？",
    "Emoji test 🚀🌍 and numbers 12345.",
    "Short.",
]


def ids_of(model, text: str) -> list[int]:
    return model.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def whole_pass(model, ids: list[int]) -> torch.Tensor:
    r = PagedRunner(model, page_size=1)
    return r.step([(r.new_seq(len(ids)), ids)], logits_indices=torch.arange(len(ids)))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("split", [1, 17, -1])     # chunk boundary: early, mid-page, last
def test_two_chunk_prefill_equals_one_pass(model_fp32, page_size, split):
    ids = ids_of(model_fp32, TEXTS[0])
    expected = whole_pass(model_fp32, ids)
    cut = split % len(ids)
    r = PagedRunner(model_fp32, page_size=page_size)
    seq = r.new_seq(len(ids))
    first = r.step([(seq, ids[:cut])], logits_indices=torch.arange(cut))
    second = r.step([(seq, ids[cut:])], logits_indices=torch.arange(len(ids) - cut))
    got = torch.cat([first, second])
    assert (got - expected).abs().max().item() < ATOL
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("page_size", [1, 16])
def test_mixed_batch_equals_each_sequence_alone(model_fp32, page_size):
    """One step holding two prefill chunks (one continuing a cached prefix) and three
    decodes gives each sequence the logits it gets when computed alone."""
    prompts = [ids_of(model_fp32, t) for t in TEXTS]
    alone = [whole_pass(model_fp32, p) for p in prompts]

    r = PagedRunner(model_fp32, page_size=page_size)
    seqs = [r.new_seq(len(p)) for p in prompts]
    # Warm-up step: seq0 caches 9 tokens; seqs 2 and 3 cache all but their last token.
    r.step([(seqs[0], prompts[0][:9]), (seqs[2], prompts[2][:-1]), (seqs[3], prompts[3][:-1])])
    # The mixed step: prefill of seq0's rest (over its cached prefix) and all of seq1,
    # then decode-shaped single tokens for seqs 2 and 3.
    work = [(seqs[0], prompts[0][9:]), (seqs[1], prompts[1]),
            (seqs[2], prompts[2][-1:]), (seqs[3], prompts[3][-1:])]
    got = r.step(work)                         # default: last token of each sequence
    assert got.shape == (4, model_fp32.config.vocab_size)
    for i, ref in enumerate(alone):
        assert (got[i] - ref[-1]).abs().max().item() < ATOL, f"sequence {i}"
        assert int(got[i].argmax()) == int(ref[-1].argmax())


def test_decode_batch_of_many_equals_alone(model_fp32):
    """32 decodes in one step (different lengths) == each decoded alone."""
    base = ids_of(model_fp32, TEXTS[1])
    prompts = [base[: 8 + i] for i in range(32)]
    r = PagedRunner(model_fp32, page_size=4, num_tokens=4096)
    seqs = [r.new_seq(len(p)) for p in prompts]
    r.step([(s, p[:-1]) for s, p in zip(seqs, prompts)])
    got = r.step([(s, p[-1:]) for s, p in zip(seqs, prompts)])
    for i in (0, 13, 31):
        ref = whole_pass(model_fp32, prompts[i])[-1]
        assert (got[i] - ref).abs().max().item() < ATOL
