"""scripts/gpu_check.py's plan for one device run, and the tolerance its kernel cases use."""

import json
import math

import pytest
import torch


@pytest.fixture(scope="module")
def gc(load_script):
    return load_script("gpu_check")


def test_dry_run_plan_fits_eight_minutes_and_64_mib(gc, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert gc.main(["--dry-run", "--out", str(out)]) == 0, capsys.readouterr().out
    plan = json.loads(out.read_text())
    assert plan["ok"] and plan["sections"] == list(gc.SECTIONS)
    assert plan["time"]["total_s"] <= 480 and plan["command"]["carry"] == [".whl"]
    assert plan["memory"]["peak_estimate_gib"] < 78


def test_everything_the_run_sends_stays_under_64_mib(gc, load_script):
    """The working tree as the device tool copies it, plus the carried wheels (as fetched,
    or at their allowance when not fetched here)."""
    plan = load_script("gpu_check_plan")
    send = plan.send_plan(gc)
    assert send["tree_bytes"] > 100_000          # the tree was really listed
    assert send["total_bytes"] <= 64 * 2**20, send
    assert all(send["checks"].values()), send
    wheels = [line for line in plan.WHEELS_FILE.read_text().splitlines()
              if line and not line.startswith("#")]
    assert not any(w.startswith("torch") for w in wheels) and wheels[0].startswith(
        "flashinfer-python==")


def test_a_budget_over_eight_minutes_fails_the_plan(gc, tmp_path):
    assert gc.main(["--dry-run", "--budget-s", "600", "--out", str(tmp_path / "p.json")]) == 1


def _attention(q, k, v, dtype):
    """Attention with scores, probabilities and output rounded to ``dtype`` (a kernel's
    roundings), fp32 sums."""
    s = (q.float() @ k.float().T * q.shape[-1] ** -0.5).to(dtype).float()
    p = s.softmax(-1).to(dtype).float()
    return (p @ v.float()).to(dtype).float()


def _case(gc, dtype, keys, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, 128, generator=gen).to(dtype) for n in (4, keys, keys))
    scores = q.float() @ k.float().T * 128 ** -0.5
    probs = scores.softmax(-1)
    exact = probs @ v.float()
    bound = gc.attention_error_bound(scores, probs, v.float(), exact,
                                     str(dtype).removeprefix("torch."))
    return q, k, v, exact, bound


@pytest.mark.parametrize("dtype, keys", [(torch.bfloat16, 2048), (torch.bfloat16, 7),
                                         (torch.float16, 300)])
def test_tolerance_admits_a_kernels_rounding(gc, dtype, keys):
    q, k, v, exact, bound = _case(gc, dtype, keys, seed=keys)
    assert ((_attention(q, k, v, dtype) - exact).abs() <= bound).all()


@pytest.mark.parametrize("keys", [7, 100])
def test_tolerance_catches_a_missing_page(gc, keys):
    """A kernel that skips the last page (16 keys, or the last key of a short sequence)."""
    q, k, v, exact, bound = _case(gc, torch.bfloat16, keys, seed=1)
    keep = keys - min(16, keys // 4 or 1)
    wrong = _attention(q, k[:keep], v[:keep], torch.bfloat16)
    assert ((wrong - exact).abs() > bound).any()


def test_tolerance_grows_with_magnitude_and_keys(gc):
    scores = torch.zeros(1, 1, 10)
    probs = scores.softmax(-1)
    v = torch.ones(1, 10, 4)
    small = gc.attention_error_bound(scores, probs, v, probs @ v, "bfloat16")
    large = gc.attention_error_bound(scores, probs, 10 * v, probs @ (10 * v), "bfloat16")
    assert torch.allclose(large, 10 * small)
    many = gc.attention_error_bound(torch.zeros(1, 1, 10**6), torch.full((1, 1, 10**6), 1e-6),
                                    torch.ones(1, 10**6, 4), torch.ones(1, 1, 4), "bfloat16")
    assert (many > small).all()
    assert math.isclose(gc.UNIT_ROUNDOFF["bfloat16"], 2 ** -8)


def test_each_kernel_case_is_in_the_report_file_before_the_next_starts(gc, tmp_path,
                                                                      monkeypatch):
    """A process killed mid-section (a kernel crash, the run's time limit) leaves the cases
    that finished in the file; an exception is recorded and the next case still runs."""
    calls = []

    def case(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("JIT failed")
        if len(calls) == 4:
            raise SystemExit("killed")          # stands in for the process dying
        return {"max_abs_err_flashinfer_vs_dense": 0.0, "ok": True}

    monkeypatch.setattr(gc, "_kernel_case", case)
    path = tmp_path / "report.json"
    report = gc.LiveReport(path, mode="test")
    with pytest.raises(SystemExit):
        gc.check_kernels(report, device="cpu", stand_in=True, quick=True)
    saved = json.loads(path.read_text())
    rows = saved["kernels"]["results"]
    assert len(rows) == 3 and saved["kernels"]["status"] == "running"
    assert "JIT failed" in rows[1]["error"] and rows[1]["ok"] is False
    assert rows[0]["ok"] and rows[2]["ok"]
