"""create_backend: names, CUDA/package detection, and the torch fallback."""

import sys

import pytest
import torch

import radixserve.attention.backend as backend_mod
import radixserve.attention.flashinfer_probe as probe_mod
from radixserve.attention import BackendUnavailable, TorchAttentionBackend, create_backend
from radixserve.attention.flashinfer_backend import FlashInferBackend

KW = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)


@pytest.fixture
def flashinfer_present(monkeypatch):
    monkeypatch.setattr(backend_mod, "flashinfer_import_error", lambda: None)
    # the start-up trial (a plan and run on the device) is tested in test_flashinfer_trial
    monkeypatch.setattr(probe_mod, "flashinfer_trial_error", lambda backend, kv_format: None)


@pytest.fixture
def flashinfer_missing(monkeypatch):
    monkeypatch.setattr(backend_mod, "flashinfer_import_error",
                        lambda: "the flashinfer package is not installed")


def test_torch_by_name_and_auto_on_cpu():
    assert isinstance(create_backend("torch", **KW, device="cpu"), TorchAttentionBackend)
    assert isinstance(create_backend("auto", **KW, device="cpu"), TorchAttentionBackend)
    # a CUDA device explicitly asked to use torch still gets torch
    assert isinstance(create_backend("torch", **KW, device="cuda"), TorchAttentionBackend)


def test_cpu_never_imports_flashinfer(monkeypatch):
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)   # other tests import it
    create_backend("auto", **KW, device="cpu")
    assert "flashinfer" not in sys.modules


def test_flashinfer_on_cpu_is_a_clear_error():
    with pytest.raises(BackendUnavailable, match="needs a CUDA device"):
        create_backend("flashinfer", **KW, device="cpu")


def test_unknown_name_and_bad_heads():
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_backend("xformers", **KW, device="cpu")
    with pytest.raises(ValueError, match="multiple"):
        create_backend("torch", num_qo_heads=6, num_kv_heads=4, head_dim=64,
                       dtype=torch.float32, device="cpu")


def test_auto_on_cuda_picks_flashinfer(flashinfer_present):
    backend = create_backend("auto", **KW, device="cuda")
    assert isinstance(backend, FlashInferBackend)
    assert backend.use_tensor_cores                      # group 4
    assert backend.sm_scale == pytest.approx(64 ** -0.5)
    explicit = create_backend("flashinfer", **KW, device="cuda:0", sm_scale=0.1)
    assert isinstance(explicit, FlashInferBackend) and explicit.sm_scale == 0.1


def test_auto_on_cuda_without_package_uses_torch(flashinfer_missing):
    assert isinstance(create_backend("auto", **KW, device="cuda"), TorchAttentionBackend)


def test_flashinfer_without_package_says_how_to_install(flashinfer_missing):
    with pytest.raises(BackendUnavailable, match="pip install flashinfer-python"):
        create_backend("flashinfer", **KW, device="cuda")


@pytest.mark.parametrize("name", ["auto", "flashinfer"])
@pytest.mark.parametrize("change, why", [
    (dict(head_dim=96), "head_dim=96"),
    (dict(head_dim=80), "head_dim=80"),
    (dict(dtype=torch.float32), "dtype=torch.float32"),
])
def test_unsupported_shape_or_dtype_falls_back_with_warning(flashinfer_present, name, change,
                                                            why):
    kw = {**KW, **change}
    with pytest.warns(RuntimeWarning, match=why):
        backend = create_backend(name, **kw, device="cuda")
    assert isinstance(backend, TorchAttentionBackend)
    assert backend.head_dim == kw["head_dim"]


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_supported_combinations_do_not_warn(flashinfer_present, head_dim, dtype, recwarn):
    kw = {**KW, "head_dim": head_dim, "dtype": dtype}
    assert isinstance(create_backend("auto", **kw, device="cuda"), FlashInferBackend)
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_real_import_check_reports_missing_package(monkeypatch):
    monkeypatch.setattr(backend_mod.importlib.util, "find_spec", lambda name: None)
    assert "not installed" in backend_mod.flashinfer_import_error()


@pytest.mark.parametrize("hq, hkv, expect", [(8, 8, False), (9, 3, False), (8, 4, False),
                                              (8, 2, True), (32, 8, True), (7, 1, True)])
def test_tensor_core_decode_from_group_size(hq, hkv, expect):
    b = FlashInferBackend(num_qo_heads=hq, num_kv_heads=hkv, head_dim=64,
                          dtype=torch.bfloat16, device="cuda")
    assert b.use_tensor_cores is expect


def test_deterministic_selects_fixed_split_or_deterministic_flashinfer(flashinfer_present):
    from radixserve.attention.fixed_split import FixedSplitBackend
    from radixserve.engine.config import EngineConfig, add_engine_arguments

    cpu = create_backend("auto", **KW, device="cpu", deterministic=True)
    assert isinstance(cpu, FixedSplitBackend) and not cpu.cascade
    cuda = create_backend("auto", **KW, device="cuda", deterministic=True)
    assert isinstance(cuda, FlashInferBackend) and cuda.deterministic
    assert not create_backend("auto", **KW, device="cuda").deterministic
    import argparse
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert EngineConfig.from_args(parser.parse_args(["--deterministic"])).deterministic
    assert not EngineConfig.from_args(parser.parse_args([])).deterministic


def test_hybrid_models_backends(flashinfer_present):
    """Gemma-like settings: flashinfer takes mixed windows and the soft-cap (one window class
    each); deterministic mode runs windows on the fixed-split torch backend, also when
    flashinfer was asked for, and refuses the soft-cap with the reason named."""
    from radixserve.attention.fixed_split import FixedSplitBackend
    gemma = dict(KW, layer_windows=[8, None, 8])
    fi = create_backend("flashinfer", **gemma, device="cuda", logits_soft_cap=50.0)
    assert isinstance(fi, FlashInferBackend) and fi.logits_soft_cap == 50.0
    assert [c.window_left for c in fi.classes] == [-1, 7] and fi.layer_class == [1, 0, 1]
    with pytest.warns(RuntimeWarning, match="deterministic mode with sliding-window"):
        det = create_backend("flashinfer", **gemma, device="cuda", deterministic=True)
    assert isinstance(det, FixedSplitBackend) and det.layer_windows == (8, None, 8)
    with pytest.raises(ValueError, match="soft-capping"):
        create_backend("torch", **gemma, device="cpu", deterministic=True,
                       logits_soft_cap=50.0)
