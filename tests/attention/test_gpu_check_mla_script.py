"""scripts/gpu_check_mla.py's CPU dry run: its cases run and write the report (the CUDA
cases compare the flashinfer MLA backend with the torch one when a GPU is lent)."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check_mla.py"


def test_dry_run_writes_every_case(tmp_path, monkeypatch):
    out = tmp_path / "mla.json"
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--dry-run", "--out", str(out)])
    module = runpy.run_path(str(SCRIPT))
    assert module["main"]() == 0
    cases = json.loads(out.read_text())["cases"]
    assert [c["case"] for c in cases] == ["mixed step, page_size 1", "mixed step, page_size 16",
                                          "decode batch 4 x 64 cached"]
    assert all(c["ok"] for c in cases[:2]) and cases[2]["candidate_ms"] > 0
