"""`radixserve plan` figures for four well-known shapes, against numbers computed by hand.

Every expected value below was worked out on paper from the published config (comments
show the arithmetic); none is produced by the code under test.
"""

from __future__ import annotations

import json

import pytest

from radixserve.cli import main
from radixserve.planner.capacity import PlanOptions, make_plan
from radixserve.planner.model_spec import spec_from_hf_config

GIB = 2**30

LLAMA2_7B = dict(model_type="llama", hidden_size=4096, num_attention_heads=32,
                 num_key_value_heads=32, num_hidden_layers=32, intermediate_size=11008,
                 vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
                 hidden_act="silu", tie_word_embeddings=False)
LLAMA3_8B = dict(LLAMA2_7B, num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                 max_position_embeddings=8192, rope_theta=500000.0)
MISTRAL_7B = dict(LLAMA3_8B, model_type="mistral", vocab_size=32000,
                  max_position_embeddings=32768, sliding_window=4096, rope_theta=10000.0)
DEEPSEEK_V2_LITE = dict(
    model_type="deepseek_v2", hidden_size=2048, num_attention_heads=16,
    num_key_value_heads=16, num_hidden_layers=27, intermediate_size=10944,
    moe_intermediate_size=1408, n_routed_experts=64, n_shared_experts=2,
    num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None,
    qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=102400,
    max_position_embeddings=163840, hidden_act="silu", tie_word_embeddings=False)


def plan(cfg, **opts):
    return make_plan(spec_from_hf_config(cfg, "test"), PlanOptions(**opts))


def test_llama2_7b_mha():
    p = plan(LLAMA2_7B, memory_bytes=80 * GIB, dtype="bfloat16", context=4096,
             concurrency=16, shared_prefix_tokens=1000)
    assert p.attention == "MHA" and p.served_by_radixserve
    assert p.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2 == 524_288
    # embed+head 2*32000*4096 + 32 * (4*4096^2 + 3*4096*11008 + 2*4096) + 4096
    assert p.num_params == 6_738_415_616
    assert p.weight_bytes == 13_476_831_232
    # (80 GiB - weights) * 0.85 // 524288 = 61,559,137,484.8 // 524,288
    assert p.pool_pages == p.pool_tokens == 117_414
    assert p.max_concurrency_at_context == 117_414 // 4096 == 28
    assert p.max_context_at_concurrency == 117_414 // 16 == 7338
    # 15 extra copies of 1000 tokens x 512 KiB
    assert p.shared_prefix_saved_bytes == 15 * 1000 * 524_288
    assert p.max_concurrency_with_shared_prefix == (117_414 - 1000) // 3096 == 37
    assert "2 x 32 x 32 x 128 x 2 = 524,288 B" in p.formula


def test_llama3_8b_gqa_and_fp8():
    p = plan(LLAMA3_8B, memory_bytes=80 * GIB, dtype="bfloat16", context=8192,
             concurrency=64)
    assert p.attention == "GQA"
    assert p.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072
    assert p.num_params == 8_030_261_248
    assert p.pool_pages == 452_903          # (80 GiB - 16,060,522,496 B) * 0.85 // 131,072
    assert p.max_concurrency_at_context == 55
    assert p.max_context_at_concurrency == 7076
    # CPU rule, page size 16: 4 GiB // (131,072 x 16) pages
    cpu = plan(LLAMA3_8B, dtype="bfloat16", page_size=16)
    assert cpu.pool_pages == 2048 and cpu.pool_tokens == 32_768
    # fp8 K and V: 32 layers x 8 heads x 2 x (128 one-byte codes + a 4-byte scale)
    fp8 = plan(LLAMA3_8B, dtype="bfloat16", kv_cache_dtype="fp8_e4m3")
    assert fp8.kv_bytes_per_token == 67_584
    assert fp8.pool_tokens == 4 * GIB // 67_584 == 63_550
    k16v8 = plan(LLAMA3_8B, dtype="bfloat16", kv_cache_dtype_k="bfloat16",
                 kv_cache_dtype_v="int8")
    assert k16v8.kv_bytes_per_token == 32 * 8 * (256 + 132) == 99_328


def test_mistral_7b_sliding_window():
    p = plan(MISTRAL_7B, memory_bytes=24 * GIB, dtype="bfloat16", context=32768,
             concurrency=8)
    assert p.kv_bytes_per_token == 131_072
    assert p.num_params == 7_241_732_096
    assert p.sliding_windows == {"4096": 32}
    assert p.served_context == 32768 and p.model_context == 32768   # window honoured
    # Every layer windowed: per-group pools, so pool_pages counts page ids (no full-KV
    # bytes) and the windowed pool, 0.09 of them, takes the budget:
    # (24 GiB - 14,483,464,192 B) * 0.85 ~ 9,593,504,563 B; less the null page,
    # // (0.09 x 131,072 B)
    assert p.pool_pages == 813_230 and p.window_pool_pages == int(813_230 * 0.09) == 73_190
    assert p.pool_bytes == (73_190 + 1) * 131_072 <= 9_593_504_563
    assert p.max_concurrency_at_context == 813_230 // 32768 == 24
    # a window-aware cache holds 4096 tokens per layer: 32 layers x 4096 x 4096 B
    assert p.window_aware_bytes_per_request == 536_870_912
    assert p.window_aware_max_concurrency == 73_191 * 131_072 // 536_870_912 == 17    # (one pool)
    assert any("windowed layers in their own pool" in n for n in p.notes)
    assert p.layer_groups == [{"window": 4096, "num_layers": 32, "bytes_per_token": 131_072}]


def test_per_layer_windows_from_layer_types():
    cfg = dict(MISTRAL_7B, num_hidden_layers=4, sliding_window=1024,
               layer_types=["sliding_attention", "full_attention"] * 2)
    p = plan(cfg, context=8192, dtype="bfloat16")
    assert p.sliding_windows == {"1024": 2}
    # per layer 2 x 8 x 128 x 2 = 4096 B/token: 2 layers x 1024 + 2 layers x 8192 tokens
    assert p.window_aware_bytes_per_request == 4096 * (2 * 1024 + 2 * 8192)
    assert p.layer_groups == [{"window": None, "num_layers": 2, "bytes_per_token": 8192},
                              {"window": 1024, "num_layers": 2, "bytes_per_token": 8192}]


def test_deepseek_v2_lite_mla():
    p = plan(DEEPSEEK_V2_LITE, memory_bytes=80 * GIB, dtype="bfloat16", context=32768,
             concurrency=32)
    # served since issue 34 (latent pages): the planner asks the server's own config reader
    assert p.attention == "MLA" and p.served_by_radixserve, p.not_served_because
    assert p.kv_bytes_per_token == 27 * (512 + 64) * 2 == 31_104
    # 27 x 16 heads x (128 + 64 + 128) x 2 without MLA
    assert p.mla_uncompressed_bytes_per_token == 276_480
    # attention 13,763,072 x 27; MoE 571,080,704 x 26; one dense MLP 67,239,936;
    # norms 4096 x 27; embeddings 2 x 102400 x 2048; final norm 2048
    assert p.num_params == 15_706_484_224
    assert p.pool_pages == 1_488_986        # (80 GiB - 31,412,968,448 B) * 0.85 // 31,104
    assert p.max_concurrency_at_context == 1_488_986 // 32768 == 45
    fp8 = plan(DEEPSEEK_V2_LITE, kv_cache_dtype="fp8_e4m3")
    assert fp8.kv_bytes_per_token == 27 * (576 + 4) == 15_660


def _write(tmp_path, cfg):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_cli_json_and_text(tmp_path, capsys):
    path = _write(tmp_path, LLAMA3_8B)
    assert main(["plan", path, "--gpu", "h100", "--context", "8k", "--dtype", "bfloat16",
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["pool_pages"] == 452_903 and got["kv_bytes_per_token"] == 131_072
    assert main(["plan", path, "--memory", "80GiB", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "452,903 tokens" in out and "= 131,072 B" in out


@pytest.mark.parametrize("argv, message", [
    (["/no/such/model"], "not found"),
    (["{cfg_missing}"], "num_hidden_layers"),
    (["{cfg}", "--memory", "8GiB", "--dtype", "bfloat16"], "too small for the weights"),
    (["{cfg}", "--memory", "lots"], "not a memory size"),
    (["{cfg}", "--kv-cache-dtype", "fp4"], "invalid choice"),
    (["{cfg}", "--kv-cache-tokens", "8", "--page-size", "16"], "at least one page"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, message):
    cfg = _write(tmp_path, LLAMA3_8B)
    missing = tmp_path / "m" / "config.json"
    missing.parent.mkdir()
    missing.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    argv = [a.format(cfg=cfg, cfg_missing=missing) for a in argv]
    try:
        rc = main(["plan", *argv])
    except SystemExit as exc:
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err
