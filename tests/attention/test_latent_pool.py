"""LatentKVPool: only latents and RoPE keys, sized as `radixserve plan` sizes MLA, and
its pages survive copy-on-write and the host/disk tiers bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.attention.kv_tiers import HostKVPool, TierMover
from radixserve.attention.latent_pool import LatentKVPool
from radixserve.attention.page_bytes import page_payload_bytes, pool_tensors
from radixserve.cache.tiers import DISK, HOST, POOL, DemoteOrder, LoadOrder
from radixserve.engine.latent_setup import check_latent_format, latent_token_bytes
from radixserve.kv_sizing import KVFormat
from radixserve.model.config import ModelConfig
from radixserve.planner.capacity import PlanOptions, make_plan
from radixserve.planner.model_spec import spec_from_hf_config

# DeepSeek-V2-Lite's attention shapes (27 layers, 16 heads, latent 512 + RoPE 64).
V2_LITE = {
    "model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"],
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128, "v_head_dim": 128, "n_routed_experts": 64,
    "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "topk_method": "greedy", "norm_topk_prob": False,
    "routed_scaling_factor": 1.0, "vocab_size": 102400, "max_position_embeddings": 163840,
    "rope_theta": 10000, "rms_norm_eps": 1e-6,
    "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                     "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096},
}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_bytes_per_token_equal_the_plan(dtype):
    plan = make_plan(spec_from_hf_config(V2_LITE, "v2-lite"), PlanOptions(dtype=dtype))
    mc = ModelConfig.from_hf_config(V2_LITE)
    pool = LatentKVPool(mc.num_layers, 2, 16, mc.mla.kv_lora_rank, mc.mla.qk_rope_head_dim,
                        dtype, "cpu")
    assert pool.bytes_per_token == plan.kv_bytes_per_token == 27 * 576 * (
        2 if dtype == "bfloat16" else 4)
    assert latent_token_bytes(mc, KVFormat(dtype, dtype)) == pool.bytes_per_token
    assert sum(t[0].numel() * t.element_size() for t in pool.page_tensors()) \
        == page_payload_bytes(pool) == 16 * pool.bytes_per_token
    # full MHA KV of the same model: every head's key (nope + rope) and value
    assert plan.mla_uncompressed_bytes_per_token == 27 * 16 * (128 + 64 + 128) * (
        2 if dtype == "bfloat16" else 4)


@pytest.mark.parametrize("element", ["int8", "fp8_e4m3"])
def test_8bit_latents_take_the_planned_bytes_and_round_trip(element):
    plan = make_plan(spec_from_hf_config(V2_LITE, "v2-lite"),
                     PlanOptions(dtype="bfloat16", kv_cache_dtype=element))
    pool = LatentKVPool(27, 2, 4, 512, 64, torch.bfloat16, "cpu", element=element)
    assert pool.bytes_per_token == plan.kv_bytes_per_token == 27 * (576 + 4)
    assert page_payload_bytes(pool) == sum(t[0].numel() * t.element_size()
                                           for t in pool.page_tensors())
    g = torch.Generator().manual_seed(0)
    ckv, kpe = torch.randn(5, 512, generator=g), torch.randn(5, 64, generator=g)
    pool.write(3, torch.arange(5), ckv.bfloat16(), kpe.bfloat16())
    got_ckv, got_kpe = pool.read(3, torch.arange(5))
    assert got_ckv.dtype == torch.bfloat16
    # one scale for the token's 576 values: error within half a code step of the largest
    step = torch.cat([ckv, kpe], -1).abs().amax(-1, keepdim=True) / (
        127 if element == "int8" else 8)
    assert ((got_ckv.float() - ckv).abs() <= step).all()
    assert ((got_kpe.float() - kpe).abs() <= step).all()


def test_different_k_and_v_formats_are_refused():
    with pytest.raises(ValueError, match="one latent per token"):
        check_latent_format(KVFormat("int8", "bfloat16"))


def _filled_pool() -> LatentKVPool:
    pool = LatentKVPool(2, 6, 4, 32, 8, torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    for layer in range(2):
        pool.write(layer, torch.arange(0, 8), torch.randn(8, 32, generator=g),
                   torch.randn(8, 8, generator=g))
    return pool


def test_copy_prefix_copies_latents_and_rope_keys():
    pool = _filled_pool()
    pool.copy_prefix(1, 3, 3)
    for t in pool.page_tensors():
        assert torch.equal(t[3, :3], t[1, :3]) and not t[3, 3:].any()
    with pytest.raises(ValueError, match="num_tokens"):
        pool.copy_prefix(0, 2, 5)


class DictDisk:
    def __init__(self):
        self.pages = {}

    def submit(self, key, payload):
        self.pages[key] = bytes(payload)


def test_latent_pages_round_trip_through_host_and_disk():
    pool = _filled_pool()
    before = [t[:2].clone() for t in pool_tensors(pool)]
    assert len(pool_tensors(pool)) == 4                       # 2 layers x (latent, RoPE)
    disk = DictDisk()
    mover = TierMover(pool, HostKVPool(pool, 3), disk)
    ids = lambda *xs: np.array(xs, dtype=np.int32)  # noqa: E731
    mover.run([DemoteOrder(POOL, ids(0, 1), HOST, ids(2, 0)),
               DemoteOrder(HOST, ids(2, 0), DISK, ids(7, 9))])
    assert all(len(p) == page_payload_bytes(pool) for p in disk.pages.values())
    for t in pool_tensors(pool):
        t[:2].zero_()
    mover.run([LoadOrder(DISK, ids(7, 9), ids(4, 5), (disk.pages[7], disk.pages[9]))])
    mover.run([LoadOrder(HOST, ids(2, 0), ids(0, 1))])
    for a, t in zip(before, pool_tensors(pool)):
        assert torch.equal(a, t[4:6]) and torch.equal(a, t[:2])
