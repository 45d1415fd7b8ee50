"""DeepSeek-V2/V3 (MLA, MoE) over latent pages equals transformers on the same weights
(fp32); absorbed decode equals decompressed decode and never builds per-head K/V for
cached tokens; a cached prefix gives the tokens computed from scratch."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mla_models import CONFIGS, build_mla_model
from model_helpers import PagedRunner, hf_greedy, hf_logits, latent_pool_and_backend

# fp32 logits (magnitude ~6-7). Measured max |diff| 6e-6 (v3-moe), 6e-6 (v2-dense),
# 1.1e-5 (v2-moe) on this CPU: summation order differs (absorbed decode; the de-interleaved
# RoPE). A wrong scale (YaRN mscale), RoPE layout, norm or routing moves them by > 0.1.
ATOL = 1e-4

PROMPTS = [
    "the cat",
    "the quick brown fox jumps over the lazy dog",
    "she sells sea shells by the sea shore, and the shells she sells are sea shells",
]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def mla(request, tmp_path_factory):
    return build_mla_model(request.param, tmp_path_factory.mktemp("mla"))


def test_config_reads_latent_and_moe(mla):
    cfg, hf = mla.loaded.config, mla.hf_model.config
    assert (cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim) == (hf.kv_lora_rank,
                                                              hf.qk_rope_head_dim)
    assert cfg.mla.q_lora_rank == hf.q_lora_rank
    moe_layers = [type(layer.mlp).__name__ for layer in mla.loaded.model.layers]
    if mla.name.endswith("moe"):
        assert moe_layers == ["GatedMLP", "MoE", "MoE"]
    else:
        assert cfg.moe is None and set(moe_layers) == {"GatedMLP"}


@pytest.mark.parametrize("page_size", [1, 4])
def test_prefill_logits_match_every_position(mla, page_size):
    ids = mla.ids(" ".join(PROMPTS))
    runner = PagedRunner(mla.loaded, page_size=page_size)
    ours = runner.step([(runner.new_seq(len(ids)), ids)], logits_indices=torch.arange(len(ids)))
    ref = hf_logits(mla.hf_model, ids)
    err = (ours - ref).abs().max().item()
    assert err < ATOL, f"max |logit diff| {err:.2e}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_64_tokens_match_generate(mla):
    runner = PagedRunner(mla.loaded, page_size=4)
    for text in PROMPTS:
        ids = mla.ids(text)
        assert runner.greedy(ids, 64) == hf_greedy(mla.hf_model, ids, 64), text


def test_absorbed_decode_equals_decompressed(mla):
    """The same decode steps (a batch of 3 with different context lengths) through the
    absorbed and the decompressed paths, on identical pages."""
    prompts = [mla.ids(t) for t in PROMPTS]
    outs = []
    for absorbed in (True, False):
        runner = PagedRunner(mla.loaded, page_size=4)
        runner.pool, runner.backend = latent_pool_and_backend(
            mla.loaded, runner.pool.num_pages, 4, absorbed=absorbed)
        seqs = [runner.new_seq(len(p) + 8) for p in prompts]
        runner.step([(s, p[:-1]) for s, p in zip(seqs, prompts)])
        steps = [runner.step([(s, p[-1:]) for s, p in zip(seqs, prompts)])]
        for _ in range(4):
            nxt = steps[-1].argmax(-1).tolist()
            steps.append(runner.step([(s, [t]) for s, t in zip(seqs, nxt)]))
        outs.append(torch.stack(steps))
    err = (outs[0] - outs[1]).abs().max().item()
    assert err < ATOL, f"absorbed vs decompressed: max |logit diff| {err:.2e}"


class ShapeLog(TorchDispatchMode):
    """Every shape an op produces while active."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def test_decode_never_builds_per_head_kv_for_cached_tokens(mla, monkeypatch):
    """A decode step over 3 sequences with 70+ cached tokens: `decompress` (the one
    place per-head K/V is built) is never called, and no op output has a per-head key or
    value width (qk_nope 16, v 12, kv_b_proj's 4 x 28) along a dimension as long as a
    cached context (weights have no such dimension)."""
    m, heads = mla.loaded.config.mla, mla.loaded.config.num_heads
    from radixserve.attention.mla_weights import LatentProjections
    calls = []
    real = LatentProjections.decompress
    monkeypatch.setattr(LatentProjections, "decompress",
                        lambda self, ckv: calls.append(ckv.shape[0]) or real(self, ckv))
    text = " ".join(PROMPTS) * 3
    prompts = [mla.ids(text)[i:72 + 4 * i] for i in range(3)]
    runner = PagedRunner(mla.loaded, page_size=4)
    seqs = [runner.new_seq(len(p) + 4) for p in prompts]
    runner.step([(s, p) for s, p in zip(seqs, prompts)])
    assert calls, "prefill decompresses (the instrument works)"
    calls.clear()
    per_head = {m.qk_nope_head_dim, m.v_head_dim, heads * (m.qk_nope_head_dim + m.v_head_dim)}
    with ShapeLog() as log:
        runner.step([(s, [1]) for s in seqs])
    assert calls == []
    cached = min(len(p) for p in prompts)
    assert cached > max(mla.hf_model.config.hidden_size, m.kv_lora_rank)   # not a weight dim
    built = [s for s in log.shapes if len(s) > 1 and s[-1] in per_head and max(s[:-1]) >= cached]
    assert built == [], f"per-head K/V built in decode: {built[:3]}"


@pytest.mark.parametrize("hit", [6, 8, 33, 36], ids=["inside-page", "at-page-boundary",
                                                     "inside-later-page", "at-later-boundary"])
def test_cached_prefix_equals_uncached(mla, hit):
    """A prompt continuing another's first `hit` latent tokens (whole pages shared, a
    partial page copied as the radix cache's copy-on-write does) generates what it
    generates from scratch (greedy, fp32)."""
    donor_ids = mla.ids(" ".join(PROMPTS))
    prompt = donor_ids[:hit] + mla.ids(" and then the dog ran to the shore")
    runner = PagedRunner(mla.loaded, page_size=4)
    donor = runner.new_seq(len(donor_ids))
    runner.step([(donor, donor_ids)])
    seq = runner.new_seq(len(prompt) + 8)
    whole = hit // 4
    seq.pages[:whole] = donor.pages[:whole]
    if hit % 4:
        runner.pool.copy_prefix(int(donor.pages[whole]), int(seq.pages[whole]), hit % 4)
    seq.cached_len = hit
    got = [int(runner.step([(seq, prompt[hit:])])[0].argmax())]
    for _ in range(7):
        got.append(int(runner.step([(seq, got[-1:])])[0].argmax()))
    assert got == PagedRunner(mla.loaded, page_size=4).greedy(prompt, 8)


def test_unknown_config_field_is_refused(tmp_path):
    from radixserve.model.errors import ModelLoadError
    from radixserve.model.loader import load_model
    model = build_mla_model("v2-dense", tmp_path)
    path = model.directory / "config.json"
    raw = json.loads(path.read_text())
    raw["kv_latent_quant_bits"] = 4
    path.write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="'kv_latent_quant_bits'"):
        load_model(str(model.directory), dtype="float32")
