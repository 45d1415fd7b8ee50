"""The CUDA path's logic, on CPU: dtype and device choice, KV pool sizing from free GPU
memory, the runner's host-to-device inputs, and scripts/gpu_check.py's plumbing."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from radixserve import kv_sizing
from radixserve.attention.backend import BackendUnavailable
from radixserve.attention.context import ForwardContext
from radixserve.attention.metadata import SeqSpan
from radixserve.engine import runner as runner_mod
from radixserve.engine.batch import StepBatch
from radixserve.engine.config import EngineConfig
from radixserve.engine.runner import ModelRunner, kv_pool_pages, logits_rows, to_device
from radixserve.engine.sampling_params import SamplingParams
from radixserve.model.config import ModelConfig
from radixserve.model.dtype import resolve_device, resolve_dtype
from radixserve.model.errors import ModelLoadError
from radixserve.model.llama import LlamaForCausalLM
from radixserve.model.loader import LoadedModel

ROOT = Path(__file__).resolve().parents[2]
GPU_CHECK = ROOT / "scripts" / "gpu_check.py"
CUDA = torch.device("cuda")
GIB = 2**30


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check_for_tests", GPU_CHECK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module        # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


# ---- dtype and device --------------------------------------------------------------------

@pytest.mark.parametrize("capability, expected", [
    ((9, 0), torch.bfloat16), ((8, 0), torch.bfloat16), ((8, 9), torch.bfloat16),
    ((7, 5), torch.float16), ((7, 0), torch.float16), ((6, 1), torch.float16)])
def test_auto_dtype_on_cuda_is_bf16_only_where_the_hardware_has_it(monkeypatch, capability,
                                                                    expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    # torch's own check also says yes where bf16 is merely emulated: it must not decide.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", CUDA) == expected


def test_explicit_dtype_wins_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_dtype("float32", CUDA) == torch.float32
    assert resolve_dtype("fp16", CUDA) == torch.float16


def test_cuda_device_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ModelLoadError, match="CUDA is not available"):
        resolve_device("cuda")


# ---- KV pool sizing ----------------------------------------------------------------------

SMOL = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64, mla=None)  # SmolLM2-135M
SMOL_BF16_TOKEN_BYTES = 2 * 30 * 3 * 64 * 2     # K and V, every layer, 2 bytes an element


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("fraction", [0.85, 0.5, 1.0])
def test_cuda_pool_is_a_fraction_of_free_memory(monkeypatch, page_size, fraction):
    free = 10 * GIB + 12345
    monkeypatch.setattr(runner_mod, "cuda_free_bytes", lambda device: free)
    config = EngineConfig(page_size=page_size, kv_cache_memory_fraction=fraction)
    pages = kv_pool_pages(config, SMOL, CUDA, torch.bfloat16)
    page_bytes = SMOL_BF16_TOKEN_BYTES * page_size
    assert pages * page_bytes <= fraction * free < (pages + 1) * page_bytes


def test_cuda_pool_size_follows_dtype(monkeypatch):
    monkeypatch.setattr(runner_mod, "cuda_free_bytes", lambda device: 4 * GIB)
    config = EngineConfig()
    bf16 = kv_pool_pages(config, SMOL, CUDA, torch.bfloat16)
    fp32 = kv_pool_pages(config, SMOL, CUDA, torch.float32)
    assert bf16 in (2 * fp32, 2 * fp32 + 1)


def test_explicit_pool_size_does_not_look_at_memory(monkeypatch):
    def no(device):
        raise AssertionError("free memory must not be read when --kv-cache-tokens is set")

    monkeypatch.setattr(runner_mod, "cuda_free_bytes", no)
    assert kv_pool_pages(EngineConfig(kv_cache_tokens=1000, page_size=16), SMOL, CUDA,
                         torch.bfloat16) == 62
    with pytest.raises(ValueError, match="at least one page"):
        kv_pool_pages(EngineConfig(kv_cache_tokens=8, page_size=16), SMOL, CUDA, torch.bfloat16)


def test_cpu_pool_uses_the_fixed_budget(monkeypatch):
    monkeypatch.setattr(runner_mod, "cuda_free_bytes", lambda device: 1 / 0)
    pages = kv_pool_pages(EngineConfig(), SMOL, torch.device("cpu"), torch.bfloat16)
    assert pages == kv_sizing.CPU_KV_BUDGET_BYTES // SMOL_BF16_TOKEN_BYTES


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_bad_memory_fraction_is_refused(monkeypatch, fraction):
    monkeypatch.setattr(runner_mod, "cuda_free_bytes", lambda device: 10 * GIB)
    with pytest.raises(ValueError, match="kv-cache-memory-fraction"):
        kv_pool_pages(EngineConfig(kv_cache_memory_fraction=fraction), SMOL, CUDA,
                      torch.bfloat16)


def test_no_room_for_one_page_is_an_error(monkeypatch):
    monkeypatch.setattr(runner_mod, "cuda_free_bytes", lambda device: 1000)
    with pytest.raises(ValueError, match="less than one page"):
        kv_pool_pages(EngineConfig(), SMOL, CUDA, torch.bfloat16)


def test_free_memory_is_read_after_releasing_cached_blocks(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda device=None: calls.append("mem_get_info") or (7 * GIB, 8 * GIB))
    assert runner_mod.cuda_free_bytes(CUDA) == 7 * GIB
    assert calls == ["empty_cache", "mem_get_info"]


# ---- the runner's inputs -----------------------------------------------------------------

def test_logits_rows_are_each_sampled_spans_last_token():
    rng = np.random.default_rng(0)
    for _ in range(200):
        lens = rng.integers(1, 9, size=rng.integers(1, 12)).tolist()
        rows = sorted(rng.choice(len(lens), size=rng.integers(0, len(lens) + 1),
                                 replace=False).tolist())
        flat_owner = [i for i, n in enumerate(lens) for _ in range(n)]
        expected = [max(j for j, owner in enumerate(flat_owner) if owner == i) for i in rows]
        assert logits_rows(lens, rows).tolist() == expected


def test_to_device_on_cpu_keeps_values_as_int64():
    for values in ([3, 1, 4], np.array([3, 1, 4], dtype=np.int32), []):
        t = to_device(values, torch.device("cpu"))
        assert t.dtype == torch.long and t.tolist() == list(np.asarray(values).tolist())


def test_to_device_on_cuda_copies_from_pinned_memory_without_blocking(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory",
                        lambda self, *a: calls.append(("pin", self.tolist())) or self)
    monkeypatch.setattr(torch.Tensor, "to",
                        lambda self, *a, **k: calls.append(("to", a, k)) or self)
    to_device([5, 6], CUDA)
    assert calls == [("pin", [5, 6]), ("to", (CUDA,), {"non_blocking": True})]


# ---- the runner on a tiny random model ---------------------------------------------------

TINY = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   intermediate_size=96, vocab_size=97, max_position_embeddings=256)


@pytest.fixture(scope="module")
def tiny_loaded():
    torch.manual_seed(0)
    model = LlamaForCausalLM(TINY)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p))
    return LoadedModel("tiny", TINY, model.eval(), tokenizer=None)


def test_flashinfer_on_a_cpu_model_is_refused_and_auto_takes_torch(tiny_loaded):
    with pytest.raises(BackendUnavailable, match="CUDA"):
        ModelRunner(EngineConfig(attention_backend="flashinfer", kv_cache_tokens=64),
                    tiny_loaded)
    runner = ModelRunner(EngineConfig(kv_cache_tokens=64), tiny_loaded)
    assert runner.backend.name == "torch"
    assert runner.kv_pool.device.type == "cpu" and runner.kv_pool.dtype == torch.float32


def _greedy_batch(spans, rng, sample_rows):
    input_ids, positions = [], []
    for s in spans:
        input_ids += rng.integers(0, TINY.vocab_size, size=s.new_len).tolist()
        positions += list(range(s.cached_len, s.cached_len + s.new_len))
    greedy = SamplingParams(temperature=0.0)
    return StepBatch(input_ids=input_ids, positions=positions, spans=spans,
                     sample_rows=sample_rows, sample_params=[greedy] * len(sample_rows),
                     generators=[None] * len(sample_rows))


def test_execute_samples_the_requested_spans_last_tokens(tiny_loaded):
    """Only some spans sample (a prefill chunk that is not a prompt's last does not): the
    tokens must be the argmax of those spans' last-token logits, computed separately."""
    from radixserve.attention.metadata import build_metadata

    pages = [np.arange(i * 40, (i + 1) * 40, dtype=np.int32) for i in range(4)]
    steps = [  # (spans, sample_rows): fresh prefills, then a mixed step over cached prefixes
        ([SeqSpan(pages[0], 0, 7), SeqSpan(pages[1], 0, 5), SeqSpan(pages[2], 0, 9),
          SeqSpan(pages[3], 0, 3)], [0, 2, 3]),
        ([SeqSpan(pages[1], 5, 6), SeqSpan(pages[0], 7, 1), SeqSpan(pages[2], 9, 1),
          SeqSpan(pages[3], 3, 1)], [1, 3]),
    ]
    runner = ModelRunner(EngineConfig(kv_cache_tokens=160), tiny_loaded)
    ref = ModelRunner(EngineConfig(kv_cache_tokens=160), tiny_loaded)
    rng = np.random.default_rng(1)
    for spans, sample_rows in steps:
        batch = _greedy_batch(spans, rng, sample_rows)
        got = runner.execute(batch).sample.token_ids
        meta = build_metadata(spans, 1, "cpu")
        ctx = ForwardContext.prepare(ref.backend, meta, ref.kv_pool)
        logits = ref.model(torch.tensor(batch.input_ids), torch.tensor(batch.positions), ctx,
                           meta.last_token_rows())                          # all spans
        assert got == logits.argmax(-1)[sample_rows].tolist()


# ---- scripts/gpu_check.py ----------------------------------------------------------------

@pytest.mark.timeout(1800)          # every section of the script, on a loaded 2-core machine
def test_gpu_check_cpu_dry_run_report(tmp_path):
    out = tmp_path / "report.json"
    # A budget no busy machine reaches: no section may be skipped for time, and the test
    # does not depend on the machine's speed.
    proc = subprocess.run(
        [sys.executable, str(GPU_CHECK), "--cpu-dry-run", "--quick", "--budget-s", "100000",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=1700)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "pip install" in proc.stdout and "Traceback" not in proc.stderr
    report = json.loads(out.read_text())
    assert report["mode"] == "cpu-dry-run" and report["sections"] == [
        "kernels", "model_greedy", "fp8_kv", "deterministic", "throughput", "tiers", "windows"]
    assert report["tiers"]["status"] == "ok", report["tiers"]
    assert report["windows"]["status"] == "ok", report["windows"]
    assert {r["window"] for r in report["windows"]["results"]} == {64, None, 32}
    env = report["environment"]
    assert env["torch"] == torch.__version__ and env["cuda_available"] is False
    assert "flashinfer" in env and "python" in env
    assert report["kernels"]["status"] == "ok"
    assert report["fp8_kv"]["status"] == "ok" and report["fp8_kv"]["failed"] == []
    det = report["deterministic"]
    assert det["status"] == "ok", det
    assert det["identical_deterministic"] == f"{det['prompts']}/{det['prompts']}"

    greedy = report["model_greedy"]
    assert greedy["status"] == "ok" and greedy["problems"] == []
    assert greedy["model"]["device"] == "cpu" and greedy["model"]["dtype"] == "float32"
    assert set(greedy["runs"]) == {"torch", "flashinfer", "flashinfer_page16"}
    n_prompts, n_tokens = len(greedy["prompts"]), greedy["max_tokens"]
    for name, run in greedy["runs"].items():
        assert run["attention_backend"] == "torch"          # the stand-in, on CPU
        assert len(run["token_ids"]) == len(run["text"]) == n_prompts
        assert all(len(t) == n_tokens for t in run["token_ids"])
        assert run["prefix_hit_tokens"] > 0, name           # later prompts reuse the first's
    assert greedy["runs"]["flashinfer_page16"]["page_size"] == 16
    # torch against itself: every comparison is exact.
    for comparison in greedy["comparisons"].values():
        assert comparison["all_identical"]
        for row in comparison["per_prompt"]:
            assert row["identical"] and row["first_divergence"] is None
            assert row["max_abs_logit_diff"] == 0.0 and row["top1_agreement"] == 1.0

    tp = report["throughput"]
    assert tp["status"] == "ok"
    decode = tp["decode"]
    assert decode["method"] and decode["attention_backend"] == "torch"
    assert [r["batch"] for r in decode["results"]] == [1, 4]
    for r in decode["results"]:
        assert r["status"] == "ok" and r["decode_tokens_per_s"] > 0 and r["ms_per_step"] > 0
        assert r["hbm_floor_ms"] > 0 and r["floor_over_measured"] > 0
    assert [r["batch"] for r in tp["fp8_over_bf16_kv"]] == [1, 4]
    assert tp["decode_fp8_kv"]["kv_cache_dtype"] == "fp8_e4m3"
    assert tp["prefill"]["share_of_peak"] > 0 and tp["prefill"]["tokens"] == 64
    assert tp["prefill"]["host_tier"]["recompute_over_load"] > 0
    agree = tp["agreement_with_torch"]
    assert agree["identical"] == agree["prompts"] == 2           # torch against itself
    assert tp["model"]["name"] == "llama3-8b-shaped"
    assert all(det["tile_invariance"]["batch_invariant"].values())
    shared = tp["shared_system_prompt"]
    on, off = shared["runs"]["cache_on"], shared["runs"]["cache_off"]
    for run in (on, off):
        assert run["status"] == "ok" and run["wall_s"] > 0 and run["ttft_p50_s"] > 0
        assert run["ttft_p90_s"] >= run["ttft_p50_s"]
    assert on["cached_prompt_share"] > 0 and off["cached_prompt_share"] == 0
    assert shared["cache_on_speedup_wall"] == pytest.approx(off["wall_s"] / on["wall_s"],
                                                            rel=0.02)
    assert shared["cache_on_speedup_ttft_p50"] > 0
    assert shared["greedy_identical_on_vs_off"] == shared["workload"]["requests"]


def test_gpu_check_skips_sections_when_the_budget_is_spent(gpu_check, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert gpu_check.main(["--cpu-dry-run", "--budget-s", "0", "--out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert "torch" in report["environment"]
    for name in gpu_check.SECTIONS:
        assert report[name]["status"] == "skipped" and "budget" in report[name]["note"]


def test_gpu_check_rejects_unknown_sections(gpu_check):
    with pytest.raises(SystemExit):
        gpu_check.main(["--cpu-dry-run", "--sections", "kernels,warp_drive"])


def test_kernel_configurations_stop_when_time_runs_out(gpu_check):
    report = {}
    gpu_check.check_kernels(report, device="cpu", stand_in=True, quick=True,
                            time_left=lambda: 0.0)
    k = report["kernels"]
    assert k["status"] == "incomplete" and k["num_checks"] == 0
    assert len(k["skipped_for_time_budget"]) == 2


def test_first_divergence(gpu_check):
    fd = gpu_check.first_divergence
    assert fd([1, 2, 3], [1, 2, 3]) is None
    assert fd([1, 2, 3], [1, 5, 3]) == 1
    assert fd([7], [8]) == 0
    assert fd([1, 2], [1, 2, 3]) == 2


class _FakeTeacher:
    """TeacherForced.compare on fixed logits instead of a model."""

    def __init__(self, gpu_check, logits: dict):
        self.compare = gpu_check.TeacherForced.compare.__get__(self)
        self._logits = logits

    def logits(self, backend, tokens):
        return self._logits[backend]


@pytest.mark.parametrize("margin, noise, explained", [(0.05, 0.1, True), (3.0, 0.1, False),
                                                      (0.2, 0.1, True), (0.21, 0.1, False)])
def test_a_divergence_is_explained_only_by_a_near_tie(gpu_check, margin, noise, explained):
    prompt, reply = [0, 1, 2], [5, 6, 7, 8]
    ref = torch.full((len(prompt) + len(reply), 10), -10.0)
    ref[:, 3] = 1.0
    row = len(prompt) - 1 + 2                # predicts reply[2], where they diverge
    ref[row, 4] = 1.0 - margin               # runner-up, `margin` below the top token
    other = ref.clone()
    other[row, 4] += noise                   # the other backend's logits differ by `noise`
    teacher = _FakeTeacher(gpu_check, {"torch": ref, "flashinfer": other})
    got = teacher.compare("torch", "flashinfer", prompt, reply, divergence=2)
    assert got["max_abs_logit_diff"] == pytest.approx(noise, abs=1e-4)
    assert got["ref_top2_margin_at_divergence"] == pytest.approx(margin, abs=1e-4)
    assert got["explained_by_near_tie"] is explained
    same = teacher.compare("torch", "torch", prompt, reply, divergence=None)
    assert same["max_abs_logit_diff"] == 0.0 and same["top1_agreement"] == 1.0
    assert "explained_by_near_tie" not in same


@pytest.mark.parametrize("case", ["identical", "near_tie", "real_divergence", "wrong_backend",
                                  "run_fails"])
def test_model_greedy_verdicts(gpu_check, monkeypatch, case):
    """The section's decision logic on scripted engine runs (no model)."""
    torch_out = [[1, 2, 3, 4], [5, 6, 7, 8]]
    other_out = torch_out if case in ("identical", "wrong_backend") else [[1, 2, 3, 4],
                                                                          [5, 6, 9, 9]]

    def fake_run(loaded, prompts, max_tokens, attention_backend, kv_cache_tokens,
                 page_size=1):
        if case == "run_fails" and page_size == 16:
            raise RuntimeError("kernel exploded")
        ran_on = "torch" if case == "wrong_backend" and page_size == 16 else attention_backend
        return {"attention_backend": ran_on, "page_size": page_size,
                "token_ids": torch_out if attention_backend == "torch" else other_out}

    class FakeTeacher:
        def __init__(self, loaded, max_tokens):
            pass

        def compare(self, ref, other, prompt, reply, divergence):
            row = {"max_abs_logit_diff": 0.1, "top1_agreement": 1.0}
            if divergence is not None:
                row["ref_top2_margin_at_divergence"] = 0.15 if case == "near_tie" else 2.0
                row["explained_by_near_tie"] = case == "near_tie"
            return row

    monkeypatch.setattr(gpu_check, "_greedy_run", fake_run)
    monkeypatch.setattr(gpu_check, "TeacherForced", FakeTeacher)
    ctx = gpu_check.CheckContext("cuda", False, gpu_check.CPU_DRY_SIZES, gpu_check.Budget(60))
    ctx.loaded = SimpleNamespace(tokenizer=SimpleNamespace(
        apply_chat_template=lambda messages: [len(messages[-1]["content"]), 7]))
    report = {}
    gpu_check.check_model_greedy(report, ctx)
    g = report["model_greedy"]
    expected = {"identical": "ok", "near_tie": "ok", "real_divergence": "FAILED",
                "wrong_backend": "FAILED", "run_fails": "error"}[case]
    assert g["status"] == expected, g
    fi = g["comparisons"]["flashinfer"]
    assert fi["all_identical"] is (case in ("identical", "wrong_backend"))
    if case in ("near_tie", "real_divergence"):
        assert fi["per_prompt"][1]["first_divergence"] == 2
        assert fi["per_prompt"][0]["identical"]
    if case == "real_divergence":
        assert any("prompt 1 diverges at token 2" in p for p in g["problems"])
    if case == "wrong_backend":
        assert g["problems"] == ["flashinfer_page16 ran on the torch backend"]
    if case == "run_fails":
        assert "kernel exploded" in g["runs"]["flashinfer_page16"]["error"]
        assert "flashinfer_page16" not in g["comparisons"] and "flashinfer" in g["comparisons"]


def test_throughput_part_failing_leaves_the_other(gpu_check, monkeypatch):
    def decode_fails(ctx, loaded):
        raise RuntimeError("no flashinfer here")

    shared = {"runs": {"cache_on": {"status": "ok"}, "cache_off": {"status": "skipped"}}}
    ok = {"status": "ok"}
    monkeypatch.setattr(gpu_check, "_decode_throughput", decode_fails)
    monkeypatch.setattr(gpu_check, "_shared_prompt", lambda ctx, loaded: shared)
    for part in ("_fp8_decode", "_prefill", "_backend_agreement"):
        monkeypatch.setattr(gpu_check, part, lambda ctx, loaded: ok)
    ctx = gpu_check.CheckContext("cpu", True, gpu_check.CPU_DRY_SIZES, gpu_check.Budget(60))
    ctx.big = object()
    report = {}
    gpu_check.check_throughput(report, ctx)
    t = report["throughput"]
    assert t["status"] == "error" and "no flashinfer here" in t["decode"]["error"]
    assert t["shared_system_prompt"] is shared and t["prefill"] is ok

    monkeypatch.setattr(gpu_check, "_decode_throughput",
                        lambda ctx, loaded: {"results": [{"status": "ok"}]})
    gpu_check.check_throughput(report, ctx)
    assert report["throughput"]["status"] == "incomplete"      # cache_off was skipped
