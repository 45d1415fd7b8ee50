"""Gemma 2, Gemma 3, sliding-window Mistral/Qwen2 and Qwen3 over paged KV equal transformers on
the same weights (fp32), with prompts and generations longer than the window."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybrid_models import FAMILIES, PROMPTS, WINDOW, build_family
from model_helpers import PagedRunner, hf_greedy, hf_logits

# fp32 logits (magnitude ~5-10). Measured: bit-identical (max diff 0.0) on this CPU; other
# thread counts or BLAS builds may reorder sums (~1e-5). A wrong window, scale, norm or
# RoPE base moves logits by > 0.1 (the first bug found here: 5.2 at position 0).
ATOL = 1e-3


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Each family built once per module, on first use (name -> Family)."""
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            cache[name] = build_family(name, tmp_path_factory.mktemp("hybrid"))
        return cache[name]
    return get


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, built):
    return built(request.param)


def test_config_reads_the_windows(family):
    cfg, hf_cfg = family.loaded.config, family.hf_model.config
    # transformers' own answer: Mistral windows every layer, the others by layer type.
    types = getattr(hf_cfg, "layer_types", None) or ["sliding_attention"] * len(cfg.windows)
    expected = [None if t == "full_attention" else WINDOW for t in types]
    assert list(cfg.windows) == expected
    assert WINDOW in expected
    # The context is the model's, not cut to the window.
    assert cfg.max_position_embeddings == family.hf_model.config.max_position_embeddings


@pytest.mark.parametrize("page_size", [1, 4])
def test_prefill_logits_match_every_position(family, page_size):
    ids = family.ids(" ".join(PROMPTS))
    assert len(ids) > 3 * WINDOW
    runner = PagedRunner(family.loaded, page_size=page_size)
    ours = runner.step([(runner.new_seq(len(ids)), ids)], logits_indices=torch.arange(len(ids)))
    ref = hf_logits(family.hf_model, ids)
    err = (ours - ref).abs().max().item()
    assert err < ATOL, f"max |logit diff| {err:.2e}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_64_tokens_match_generate(family):
    runner = PagedRunner(family.loaded, page_size=4)
    for text in PROMPTS:
        ids = family.ids(text)
        assert runner.greedy(ids, 64) == hf_greedy(family.hf_model, ids, 64), text


def share_prefix(runner: PagedRunner, donor, n: int):
    """A sequence whose first `n` cached tokens are the donor's, as the radix cache hands
    them out: the donor's whole pages, and a copy of a partially shared page."""
    ps = runner.page_size
    seq = runner.new_seq(n + 64)
    whole = n // ps
    seq.pages[:whole] = donor.pages[:whole]
    if n % ps:                                       # copy-on-write of the partial page
        src, dst = int(donor.pages[whole]), int(seq.pages[whole])
        for cache in (runner.pool.k, runner.pool.v):
            for layer in cache:
                layer[dst].copy_(layer[src])
    seq.cached_len = n
    return seq


@pytest.mark.parametrize("hit", [WINDOW // 2, WINDOW, 5 * WINDOW, 3 * WINDOW + 2],
                         ids=["inside-first-window", "at-W", "far-beyond", "inside-a-page"])
def test_cached_prefix_equals_uncached(family, hit):
    """A prompt continuing another's first `hit` tokens from its cached KV generates what
    it generates computed from scratch (greedy, fp32)."""
    donor_ids = family.ids(" ".join(PROMPTS) * 2)
    assert len(donor_ids) > hit + WINDOW
    prompt = donor_ids[:hit] + family.ids(" and then the dog ran to the shore")
    runner = PagedRunner(family.loaded, page_size=4, num_tokens=4096)
    donor = runner.new_seq(len(donor_ids))
    runner.step([(donor, donor_ids)])
    seq = share_prefix(runner, donor, hit)
    first = runner.step([(seq, prompt[hit:])])
    got = [int(first[0].argmax())]
    for _ in range(7):
        got.append(int(runner.step([(seq, got[-1:])])[0].argmax()))
    assert got == PagedRunner(family.loaded, page_size=4).greedy(prompt, 8)


def test_decodes_and_prefills_mixed_in_one_step(family):
    """A step holding a long prefill continuing its cache and decodes past the window
    gives each sequence its logits computed alone."""
    texts = [" ".join(PROMPTS), PROMPTS[2], PROMPTS[1] * 2]
    prompts = [family.ids(t) for t in texts]
    runner = PagedRunner(family.loaded, page_size=4)
    seqs = [runner.new_seq(len(p)) for p in prompts]
    runner.step([(seqs[0], prompts[0][:20])] + [(s, p[:-1]) for s, p in
                                                zip(seqs[1:], prompts[1:])])
    got = runner.step([(seqs[0], prompts[0][20:])] + [(s, p[-1:]) for s, p in
                                                      zip(seqs[1:], prompts[1:])])
    for i, p in enumerate(prompts):
        ref = hf_logits(family.hf_model, p)[-1]
        assert (got[i] - ref).abs().max().item() < ATOL, i


def test_gemma3_gguf_equals_transformers(tmp_path):
    """A Gemma 3 GGUF laid out as llama.cpp writes it (norms stored as 1 + w, q/k not
    permuted, the window in the metadata, every 6th layer global) loads to transformers'
    logits on the weights as stored."""
    from tiny_models import hf_config, random_hf_model, write_gguf
    from transformers import AutoModelForCausalLM
    from radixserve.model.loader import load_model

    hf_cfg = hf_config("gemma3_text", num_hidden_layers=7, sliding_window=WINDOW,
                       query_pre_attn_scalar=16)       # = head_dim, as llama.cpp assumes
    assert hf_cfg.layer_types[5] == "full_attention"
    stored = write_gguf(tmp_path / "g.gguf", random_hf_model(hf_cfg), arch="gemma3")
    ref = AutoModelForCausalLM.from_config(hf_cfg).to(torch.float32).eval()
    ref.load_state_dict(stored, strict=False)
    ref.tie_weights()
    ours = load_model(str(tmp_path / "g.gguf"), dtype="float32")
    assert list(ours.config.windows) == [None if t == "full_attention" else WINDOW
                                         for t in hf_cfg.layer_types]
    ids = list(np.random.default_rng(0).integers(0, hf_cfg.vocab_size, 3 * WINDOW))
    runner = PagedRunner(ours, page_size=4)
    got = runner.step([(runner.new_seq(len(ids)), ids)], logits_indices=torch.arange(len(ids)))
    assert (got - hf_logits(ref, ids)).abs().max().item() < ATOL


def test_gemma2_soft_caps_change_the_logits(built):
    """The Gemma 2 comparison is not vacuous: without the attention soft-cap (or with the
    final one dropped) our logits leave transformers' by far more than ATOL."""
    from dataclasses import replace
    g2 = built("gemma2")
    ids = g2.ids(" ".join(PROMPTS))
    ref = hf_logits(g2.hf_model, ids)
    cfg = g2.loaded.config

    def max_diff(config) -> float:
        g2.loaded.model.config = config          # the final cap is read by the model
        try:
            runner = PagedRunner(replace(g2.loaded, config=config), page_size=4)
            got = runner.step([(runner.new_seq(len(ids)), ids)],
                              logits_indices=torch.arange(len(ids)))
        finally:
            g2.loaded.model.config = cfg
        return (got - ref).abs().max().item()

    assert max_diff(cfg) < ATOL
    assert max_diff(replace(cfg, attn_logit_softcapping=None)) > 0.1
    assert max_diff(replace(cfg, final_logit_softcapping=None)) > 0.1
