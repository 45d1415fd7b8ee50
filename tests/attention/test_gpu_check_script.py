"""scripts/gpu_check.py: a clear exit without CUDA, and its plumbing on CPU."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_cuda_exits_with_a_message(gpu_check, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "report.json"
    assert gpu_check.main(["--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert "pip install flashinfer-python" in captured.out
    assert "nvcc" in captured.out
    assert "no CUDA device" in captured.err and "Traceback" not in captured.err
    assert not out.exists()


def test_cpu_dry_run_writes_a_report(gpu_check, tmp_path):
    out = tmp_path / "report.json"
    # Kernels only: tests/engine/test_cuda_path.py dry-runs the model sections.
    assert gpu_check.main(["--cpu-dry-run", "--quick", "--sections", "kernels",
                           "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    kernels = report["kernels"]
    assert kernels["status"] == "ok" and kernels["stand_in_for_flashinfer"] == "torch"
    cases = {(r["case"], r["page_size"], r["num_kv_heads"]) for r in kernels["results"]}
    assert {c for c, _, _ in cases} == set(gpu_check.KERNEL_CASES)
    assert {p for _, p, _ in cases} == {1, 16}
    for r in kernels["results"]:
        assert r["max_abs_err_flashinfer_vs_torch"] == 0.0          # torch vs itself
        assert r["torch_within_tolerance"] and r["kv_written_identically"]
        assert 0 < r["max_abs_err_torch_vs_dense"] <= r["largest_bound"]
    assert "model_greedy" not in report or report["model_greedy"]["status"] == "skipped"


def test_a_failing_section_is_recorded_not_raised(gpu_check):
    report = {}

    def boom():
        raise RuntimeError("kernel exploded")

    gpu_check._run_section(report, "kernels", boom)
    assert report["kernels"]["status"] == "error"
    assert "kernel exploded" in report["kernels"]["error"]


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_section_kernel_case_on_cpu(gpu_check, fmt):
    """The fp8_kv section's kernel check, torch standing in for flashinfer: both read an
    FP8 pool with the per-tensor scale and match dense attention on the decoded pages."""
    fp8 = gpu_check._import_script("gpu_check_fp8")
    row = fp8._case(gpu_check, fmt, 9, 3, 64, 16, gpu_check.KERNEL_CASES["mixed"], 0, "cpu",
                    stand_in=True)
    assert row["ok"] and row["max_abs_err_flashinfer_vs_torch"] == 0.0
    assert 0 < row["max_abs_err_flashinfer_vs_dense"] <= row["largest_bound"]


def test_cpu_dry_run_of_the_tiers_section(gpu_check, tmp_path):
    out = tmp_path / "report.json"
    assert gpu_check.main(["--cpu-dry-run", "--sections", "tiers", "--out", str(out)]) == 0
    tiers = json.loads(out.read_text())["tiers"]
    assert tiers["status"] == "ok" and len(tiers["results"]) == 3
    assert all(r["bytes_equal"] and not r["side_stream"] for r in tiers["results"])
