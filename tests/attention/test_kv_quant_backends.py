"""Which backend reads which KV storage: flashinfer's FP8 path, torch for the rest."""

import pytest
import torch

import radixserve.attention.backend as backend_mod
import radixserve.attention.flashinfer_probe as probe_mod
from radixserve.attention import TorchAttentionBackend, build_metadata, create_backend
from radixserve.attention.flashinfer_backend import FP8_KV_SCALE, FlashInferBackend
from radixserve.attention.metadata import SeqSpan
from radixserve.kv_sizing import KVFormat

import numpy as np

KW = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)


@pytest.fixture
def flashinfer_present(monkeypatch):
    monkeypatch.setattr(backend_mod, "flashinfer_import_error", lambda: None)
    # the start-up trial (a plan and run on the device) is tested in test_flashinfer_trial
    monkeypatch.setattr(probe_mod, "flashinfer_trial_error", lambda backend, kv_format: None)


@pytest.mark.parametrize("name, storage", [("fp8_e4m3", torch.float8_e4m3fn),
                                           ("fp8_e5m2", torch.float8_e5m2)])
def test_fp8_kv_goes_to_flashinfer_with_its_dtype_and_a_tensor_scale(flashinfer_present,
                                                                    name, storage):
    backend = create_backend("auto", **KW, device="cuda", kv_format=KVFormat(name, name))
    assert isinstance(backend, FlashInferBackend)
    assert backend.kv_dtype == storage and backend.fixed_kv_scale == FP8_KV_SCALE
    spans = [SeqSpan(np.arange(3, dtype=np.int32), 0, 5), SeqSpan(np.arange(3, 5), 2, 1)]
    prefill, decode = backend.plan_calls(build_metadata(spans, 4, "cpu"))
    for call in (prefill, decode):
        assert call.kwargs["kv_data_type"] == storage
        assert call.kwargs["q_data_type"] == torch.bfloat16
    assert backend._run_kw == dict(k_scale=FP8_KV_SCALE, v_scale=FP8_KV_SCALE)


def test_bf16_kv_keeps_flashinfer_calls_unchanged(flashinfer_present):
    backend = create_backend("auto", **KW, device="cuda", kv_format=KVFormat("bfloat16",
                                                                              "bfloat16"))
    assert isinstance(backend, FlashInferBackend)
    assert backend.fixed_kv_scale is None and backend._run_kw == {}


@pytest.mark.parametrize("fmt, match", [(("int8", "int8"), "int8"),
                                        (("bfloat16", "fp8_e4m3"), "one dtype for K and V"),
                                        (("float32", "float32"), "float32 KV cache")])
@pytest.mark.parametrize("name", ["auto", "flashinfer"])
def test_kv_flashinfer_cannot_read_falls_back_to_torch(flashinfer_present, fmt, match, name):
    with pytest.warns(RuntimeWarning, match=match):
        backend = create_backend(name, **KW, device="cuda", kv_format=KVFormat(*fmt))
    assert isinstance(backend, TorchAttentionBackend)
