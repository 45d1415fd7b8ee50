"""Detection by trying: `auto` falls back to torch when flashinfer's first plan() fails (as
it does without nvcc or prebuilt kernels); `flashinfer` makes that a start-up error."""

import logging
import sys

import flashinfer
import pytest
import torch

import radixserve.attention.flashinfer_probe as probe_mod
from flashinfer_fakes import fake_flashinfer
from radixserve.attention import BackendUnavailable, TorchAttentionBackend, create_backend
from radixserve.attention.flashinfer_backend import FlashInferBackend
from radixserve.kv_sizing import KVFormat

KW = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
# What flashinfer's JIT raises at the first plan() without a toolkit (jit/cpp_ext.py).
NO_NVCC = RuntimeError("Could not find nvcc and default cuda_home='/usr/local/cuda' "
                       "doesn't exist")


def _install(monkeypatch, plan_error=None):
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer(flashinfer, plan_error))


@pytest.fixture
def trial_on_cpu(monkeypatch):
    """create_backend's real trial, run on the CPU (this machine has no CUDA)."""
    real = probe_mod.flashinfer_trial_error

    def on_cpu(backend, kv_format=None):
        backend.device = torch.device("cpu")
        return real(backend, kv_format)

    monkeypatch.setattr(probe_mod, "flashinfer_trial_error", on_cpu)


@pytest.mark.parametrize("deterministic", [False, True])
def test_trial_passes_when_plan_and_run_work(monkeypatch, deterministic):
    _install(monkeypatch)
    backend = FlashInferBackend(**KW, device="cpu", deterministic=deterministic)
    assert probe_mod.flashinfer_trial_error(backend) is None
    assert backend.classes[0].prefill.plans       # it really planned


def test_trial_reports_missing_nvcc_in_one_line(monkeypatch):
    _install(monkeypatch, NO_NVCC)
    reason = probe_mod.flashinfer_trial_error(FlashInferBackend(**KW, device="cpu"))
    assert reason.startswith("flashinfer needs nvcc or prebuilt kernels: "
                             "`flashinfer download-kernels`")
    assert "Could not find nvcc" in reason and "\n" not in reason


def test_trial_reports_other_kernel_failures(monkeypatch):
    _install(monkeypatch, RuntimeError("CUDA error: no kernel image is available\nmore"))
    reason = probe_mod.flashinfer_trial_error(FlashInferBackend(**KW, device="cpu"))
    assert reason == ("flashinfer failed its start-up trial (RuntimeError: CUDA error: no "
                      "kernel image is available)")


def test_auto_without_a_toolkit_falls_back_with_one_log_line(monkeypatch, trial_on_cpu,
                                                             caplog):
    _install(monkeypatch, NO_NVCC)
    with caplog.at_level(logging.WARNING, logger="radixserve.attention.backend"):
        backend = create_backend("auto", **KW, device="cuda")
    assert isinstance(backend, TorchAttentionBackend)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "flashinfer download-kernels" in lines[0]
    assert lines[0].endswith("using the torch attention backend")


def test_explicit_flashinfer_without_a_toolkit_is_a_start_up_error(monkeypatch, trial_on_cpu):
    _install(monkeypatch, NO_NVCC)
    with pytest.raises(BackendUnavailable, match="flashinfer download-kernels"):
        create_backend("flashinfer", **KW, device="cuda", deterministic=True)


@pytest.mark.parametrize("kv_format", [None, KVFormat("fp8_e4m3", "fp8_e4m3")])
def test_auto_keeps_flashinfer_when_the_trial_runs(monkeypatch, trial_on_cpu, kv_format):
    _install(monkeypatch)
    backend = create_backend("auto", **KW, device="cuda", kv_format=kv_format)
    assert isinstance(backend, FlashInferBackend)
