"""`scripts/gpu_check.py --dry-run`: the plan of the GPU run, checked on any machine.

Runs nothing on a device. It checks that the sections' budgets and the start-up overhead fit
in one 8-minute run, that the two random-weight models and the largest decode pool fit an
H100's memory, and that what the run sends (the working tree as the device tool copies it:
tracked and untracked-not-ignored files, plus the carried .whl/ folder) stays under 64 MiB,
with flashinfer's wheel at most 20 MB and no torch wheel (wheels not fetched yet count at
their allowance). Writes the plan to --out.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
H100_MEMORY_BYTES = 78 * 2**30
WHEELS_FILE = ROOT / "scripts" / "gpu_wheels.txt"


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of the files the device tool copies: tracked + untracked-not-ignored."""
    names = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=root,
                           capture_output=True, check=True).stdout.split(b"\0")
    return sum((root / n.decode()).stat().st_size for n in names
               if n and (root / n.decode()).is_file())


def wheel_names() -> list[str]:
    return [line.split("==")[0] for line in WHEELS_FILE.read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def send_plan(gc: ModuleType, root: Path = ROOT) -> dict:
    """What one device run sends, and whether it fits."""
    wheel_dir = root / ".whl"
    wheels = {p.name: p.stat().st_size for p in sorted(wheel_dir.glob("*.whl"))}
    tree = tree_bytes(root)
    flashinfer = [size for name, size in wheels.items() if name.startswith("flashinfer_python")]
    missing = [n for n in wheel_names()
               if not any(w.startswith(n.replace("-", "_") + "-") for w in wheels)]
    # Not fetched yet (CI): count the wheels at their allowance, checked once fetched.
    wheel_bytes = sum(wheels.values()) if not missing else gc.WHEELS_MAX_BYTES
    return {"tree_bytes": tree, "wheels": wheels, "wheel_bytes": wheel_bytes,
            "total_bytes": tree + wheel_bytes, "limit_bytes": gc.SEND_LIMIT_BYTES,
            "missing_wheels": missing, "ready_to_send": not missing,
            "checks": {
                "under_64_mib": tree + wheel_bytes <= gc.SEND_LIMIT_BYTES,
                "wheels_within_allowance": wheel_bytes <= gc.WHEELS_MAX_BYTES,
                "flashinfer_wheel_at_most_20_mb": all(
                    size <= gc.FLASHINFER_WHEEL_MAX_BYTES for size in flashinfer),
                "no_torch_wheel": not any(n.startswith("torch-") for n in wheels)}}


def memory_plan(gc: ModuleType) -> dict:
    models = gc._import_script("gpu_check_models")
    sz = gc.GPU_SIZES
    rows = {}
    for name, cfg in (("smollm2-135m-shaped", models.SMOLLM2_135M),
                      ("llama3-8b-shaped", models.LLAMA3_8B)):
        per_layer = (cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
                     + cfg.num_heads * cfg.head_dim * cfg.hidden_size
                     + 3 * cfg.hidden_size * cfg.intermediate_size)
        params = (cfg.num_layers * per_layer + cfg.vocab_size * cfg.hidden_size
                  * (1 if cfg.tie_word_embeddings else 2))
        kv_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
        rows[name] = {"params_billion": round(params / 1e9, 3),
                      "weight_gib_bf16": round(params * 2 / 2**30, 2),
                      "kv_bytes_per_token_bf16": kv_token}
    big = rows["llama3-8b-shaped"]
    span = sz.decode_context + sz.decode_warmup + sz.decode_steps
    pool = max(sz.decode_batches) * span * big["kv_bytes_per_token_bf16"]
    peak = big["weight_gib_bf16"] * 2**30 + pool + gc.WORKSPACE_ESTIMATE_BYTES
    return {"models": rows, "largest_decode_pool_gib": round(pool / 2**30, 2),
            "peak_estimate_gib": round(peak / 2**30, 2),
            "checks": {"fits_h100": peak <= H100_MEMORY_BYTES}}


def time_plan(gc: ModuleType, sections: list[str], budget_s: float) -> dict:
    budgets = {s: gc.GPU_SIZES.section_budget_s[s] for s in sections}
    total = sum(budgets.values()) + gc.START_OVERHEAD_S
    return {"section_budget_s": budgets, "start_overhead_s": gc.START_OVERHEAD_S,
            "total_s": total, "run_budget_s": budget_s, "limit_s": gc.RUN_LIMIT_S,
            "checks": {"sections_fit_8_minutes": total <= gc.RUN_LIMIT_S,
                       "run_budget_fits_8_minutes":
                           budget_s + gc.START_OVERHEAD_S <= gc.RUN_LIMIT_S}}


def kernel_plan(gc: ModuleType, quick: bool) -> dict:
    heads = gc.HEAD_CONFIGS[:2] if quick else gc.HEAD_CONFIGS
    configs = [("bfloat16", h) for h in heads]
    configs += [] if quick else [("float16", h) for h in gc.FP16_CONFIGS]
    return {"configurations": [{"dtype": d, "heads": list(h)} for d, h in configs],
            "cases": len(configs) * len(gc.PAGE_SIZES) * len(gc.KERNEL_CASES),
            "note": "each configuration's first case includes flashinfer's JIT compile; the "
                    "report gives compile_s per configuration"}


def main_dry_run(gc: ModuleType, sections: list[str], quick: bool, budget_s: float,
                 out: Path) -> int:
    plan = {"mode": "dry-run", "sections": sections, "time": time_plan(gc, sections, budget_s),
            "memory": memory_plan(gc), "send": send_plan(gc), "kernels": kernel_plan(gc, quick),
            "command": gc.DEVICE_COMMAND}
    checks = {f"{part}.{name}": ok for part in ("time", "memory", "send")
              for name, ok in plan[part]["checks"].items()}
    plan["ok"] = all(checks.values())
    out.write_text(json.dumps(plan, indent=2) + "\n")
    t, m, s = plan["time"], plan["memory"], plan["send"]
    print(f"[gpu_check --dry-run] {len(sections)} sections, budgets {t['total_s']:.0f} s of "
          f"{t['limit_s']:.0f} s; peak memory ~{m['peak_estimate_gib']} GiB; sends "
          f"{s['total_bytes'] / 2**20:.1f} MiB of {s['limit_bytes'] / 2**20:.0f} MiB "
          f"(tree {s['tree_bytes'] / 2**20:.1f}, wheels {s['wheel_bytes'] / 2**20:.1f})")
    for name, ok in checks.items():
        print(f"[gpu_check --dry-run] {'ok  ' if ok else 'FAIL'} {name}")
    if s["missing_wheels"]:
        print(f"[gpu_check --dry-run] not fetched yet: {', '.join(s['missing_wheels'])} "
              "(scripts/gpu_wheels_fetch.sh, before the device run); counted at the "
              f"{gc.WHEELS_MAX_BYTES / 1e6:.0f} MB allowance")
    return 0 if plan["ok"] else 1
