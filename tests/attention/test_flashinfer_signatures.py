"""Every call the flashinfer backend makes, bound to the installed flashinfer's signatures.

CI installs flashinfer-python (CPU: it imports without CUDA; scripts/dev.sh). Its wrapper
classes are replaced by fakes that bind each call to the real method's signature and then
compute the documented maths (tests/attention/flashinfer_fakes.py); outputs are compared
with the torch backend on the same pool. An API change in flashinfer fails here.
"""

import importlib.util
import math
import sys
from pathlib import Path

import flashinfer
import pytest
import torch

from attn_helpers import make_scenario
from flashinfer_fakes import fake_flashinfer, paged_attention_base2
from radixserve.attention import create_backend
from radixserve.attention.flashinfer_backend import FlashInferBackend
from radixserve.attention.kv_pool import KVPool
from radixserve.attention.metadata import build_metadata
from radixserve.kv_sizing import KVFormat

BACKEND_SOURCE = (Path(__file__).resolve().parents[2] / "radixserve" / "attention"
                  / "flashinfer_backend.py")
# (cached, new): prefills over cached prefixes and fresh, in all three query-tile classes
# for group 3 (1 and 5 new tokens: <= 16 packed rows; 9: <= 64; 40: more), then decodes.
LENS = [(0, 40), (21, 9), (3, 5), (64, 1), (0, 1), (17, 1)]


@pytest.fixture
def fakes(monkeypatch):
    module = fake_flashinfer(flashinfer)
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module


def _outputs(backend_cls_or_name, page_size, hq, hkv, dtype, lens=LENS, kv_format=None,
             layer=0, model_kw=None, **kw):
    """(backend output, torch backend output) on identical pools and inputs, at ``layer``;
    ``model_kw``: what both backends get (layer_windows, logits_soft_cap)."""
    d = 64
    outs = []
    model_kw = model_kw or {}
    for which in (backend_cls_or_name, "torch"):
        pool = KVPool(layer + 1, sum(-(-(c + n) // page_size) for c, n in lens) + 4,
                      page_size, hkv, d, dtype, "cpu", kv_format=kv_format,
                      fixed_scale=1.0 if kv_format is not None else None)
        sc = make_scenario(pool, lens, hq, seed=page_size, layer=layer)
        if which == "torch":
            backend = create_backend("torch", num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                                     dtype=dtype, device="cpu", kv_format=kv_format,
                                     **model_kw)
        else:
            backend = which(num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, dtype=dtype,
                            device="cpu", **model_kw, **kw)
        meta = build_metadata(sc.spans, page_size, "cpu")
        outs.append(backend.forward(backend.prepare(meta), layer, sc.q, sc.k, sc.v,
                                    pool).float())
    return outs


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("page_size, hq, hkv", [(1, 9, 3), (16, 8, 2)],
                         ids=["page1_cuda_core_decode", "page16_tensor_core_decode"])
def test_calls_bind_and_fake_kernels_match_the_torch_backend(fakes, deterministic, page_size,
                                                             hq, hkv):
    got, ref = _outputs(FlashInferBackend, page_size, hq, hkv, torch.float32,
                        deterministic=deterministic)
    assert (got - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("layer", [0, 1, 2], ids=["local-8", "global", "local-16"])
def test_gemma_like_windows_and_soft_cap_bind_and_match_the_torch_backend(fakes, layer):
    """Mixed windows (one wrapper pair per window class, each planned with its own
    window_left) and Gemma 2's logits_soft_cap, bound to the real plan() signatures; every
    layer's output equals the torch backend's on the same model settings."""
    model_kw = dict(layer_windows=[8, None, 16], logits_soft_cap=3.0)
    got, ref = _outputs(FlashInferBackend, 4, 9, 3, torch.float32, layer=layer,
                        model_kw=model_kw)
    assert (got - ref).abs().max().item() < 1e-4
    uncapped = _outputs(FlashInferBackend, 4, 9, 3, torch.float32, layer=layer,
                        model_kw=dict(model_kw, logits_soft_cap=None))[0]
    assert (got - uncapped).abs().max().item() > 1e-2       # the cap and windows bite


def test_deterministic_mode_pins_fa2_and_plans_one_wrapper_per_tile_class(fakes):
    backend = FlashInferBackend(num_qo_heads=9, num_kv_heads=3, head_dim=64,
                                dtype=torch.float32, device="cpu", deterministic=True)
    pool = KVPool(1, 200, 4, 3, 64, torch.float32, "cpu")
    sc = make_scenario(pool, LENS, 9, seed=1)
    backend.prepare(build_metadata(sc.spans, 4, "cpu"))
    assert [w.init["backend"] for w in backend.classes[0].tiles] == ["fa2"] * 3
    planned = [[int(x) for x in w.plans[-1]["qo_indptr"]] for w in backend.classes[0].tiles]
    # class <=16 packed rows: 5, 1, 1, 1 new tokens; <=64: 9; more: 40
    assert planned == [[0, 5, 6, 7, 8], [0, 9], [0, 40]]
    for w in backend.classes[0].tiles:
        p = w.plans[-1]
        assert p["fixed_split_size"] == 2048 // 4 and p["disable_split_kv"] is False
        assert p["causal"] is True


def test_fp8_kv_calls_bind_with_scales(fakes):
    # fresh prefills only: every K/V goes through the pool's own fp8 write
    got, ref = _outputs(FlashInferBackend, 16, 8, 2, torch.bfloat16, lens=[(0, 40), (0, 9)],
                        kv_format=KVFormat("fp8_e4m3", "fp8_e4m3"),
                        kv_dtype=torch.float8_e4m3fn)
    assert (got - ref).abs().max().item() < 0.05     # bf16 outputs, same fp8 codes read


def test_fake_kernel_log_sum_exp_is_base_2():
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(2, 2, 4, 1, 8, generator=gen)
    q = torch.randn(3, 1, 8, generator=gen)
    out, lse = paged_attention_base2(q, k_cache, v_cache, torch.tensor([0, 3]),
                                     torch.tensor([0, 2]), torch.tensor([1, 0]),
                                     torch.tensor([3]), sm_scale=0.3, causal=True)
    k = torch.cat([k_cache[1], k_cache[0]])[:7, 0]            # pages 1 then 0, 4 + 3 keys
    scores = q[:, 0] @ k.T * 0.3
    scores = scores.masked_fill(torch.arange(7)[None, :] > torch.arange(3)[:, None] + 4,
                                float("-inf"))
    assert torch.allclose(lse[:, 0], torch.logsumexp(scores, -1) / math.log(2), atol=1e-5)
    v = torch.cat([v_cache[1], v_cache[0]])[:7, 0]
    assert torch.allclose(out[:, 0], scores.softmax(-1) @ v, atol=1e-5)


def _load_copy(tmp_path, monkeypatch, old: str, new: str):
    source = BACKEND_SOURCE.read_text()
    assert old in source
    path = tmp_path / "renamed_backend.py"
    path.write_text(source.replace(old, new))
    spec = importlib.util.spec_from_file_location("renamed_flashinfer_backend", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)     # dataclasses look it up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("deterministic, old, new", [
    (True, "fixed_split_size=", "fixed_split_pages="),
    (False, "kv_data_type=", "kv_dtype="),
    (True, 'backend=DETERMINISTIC_PREFILL_BACKEND', 'attention_backend="fa2"'),
])
def test_a_renamed_keyword_in_a_copy_of_the_backend_fails(fakes, tmp_path, monkeypatch,
                                                          deterministic, old, new):
    """The check above is not vacuous: the same calls with one keyword renamed fail."""
    renamed = _load_copy(tmp_path, monkeypatch, old, new)
    with pytest.raises(TypeError, match="unexpected keyword|got an unexpected"):
        _outputs(renamed.FlashInferBackend, 4, 8, 2, torch.float32,
                 deterministic=deterministic)
