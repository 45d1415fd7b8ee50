"""`radixserve plan` and the server agree for the window-bearing families: the same pool
and the same split into full-attention and sliding-window layer groups."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

import radixserve.kv_sizing as kv_sizing
from radixserve.cli import build_parser_for, main
from radixserve.engine.config import EngineConfig
from radixserve.engine.engine import Engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from hybrid_models import FAMILIES, WINDOW, build_family  # noqa: E402

FLAGS = ["--dtype", "float32", "--page-size", "4"]       # the CPU byte budget


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan-hybrid")
    return {name: build_family(name, root) for name in FAMILIES}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_plan_equals_server_for_each_family(name, families, monkeypatch, capsys):
    monkeypatch.setattr(kv_sizing, "CPU_KV_BUDGET_BYTES", 8 << 20)
    family = families[name]
    model = str(family.directory)
    args = build_parser_for(["serve"]).parse_args(["serve", "--model", model, *FLAGS])
    engine = Engine(EngineConfig.from_args(args), family.loaded)
    stats = engine.stats()
    assert main(["plan", model, *FLAGS, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["served_by_radixserve"], plan["not_served_because"]
    assert (plan["pool_tokens"], plan["pool_bytes"]) == (
        stats.pages_total * stats.page_size, stats.kv_pool_bytes)
    # Per-group pools: the windowed layers' own pool, a fraction of the full one.
    assert plan["window_pool_pages"] == engine.runner.window_pages
    assert 0 < plan["window_pool_pages"] < plan["pool_pages"]
    assert plan["layer_groups"] == [asdict(g) for g in engine.runner.layer_groups]
    windows = [w for w in family.loaded.config.windows]
    assert [g["num_layers"] for g in plan["layer_groups"]] == [
        windows.count(g["window"]) for g in plan["layer_groups"]]
    assert any(g["window"] == WINDOW for g in plan["layer_groups"])
    assert sum(g["bytes_per_token"] for g in plan["layer_groups"]) == \
        plan["kv_bytes_per_token"]


def test_plan_text_shows_the_split(families, capsys):
    assert main(["plan", str(families["gemma3"].directory), "--dtype", "float32"]) == 0
    text = capsys.readouterr().out
    # 3 layers, 2 KV heads x 16 dims x 4 B x (K, V) = 256 B per layer per token
    assert f"layer groups     full attention: 1 layers, 256 B/token; window {WINDOW}: " \
           f"2 layers, 512 B/token" in text


def test_plan_of_a_gemma3_gguf_shows_the_split(families, tmp_path, capsys):
    """A GGUF's layer pattern is the server's reading of it (Gemma's local/global layers
    are not in the generic keys): served, with the groups the loaded model has."""
    from tiny_models import write_gguf

    from radixserve.model.loader import load_model
    gguf = tmp_path / "gemma3.gguf"
    write_gguf(gguf, families["gemma3"].hf_model, arch="gemma3")
    assert main(["plan", str(gguf), *FLAGS, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["served_by_radixserve"], plan["not_served_because"]
    windows = list(load_model(str(gguf), dtype="float32").config.windows)
    assert [(g["window"], g["num_layers"]) for g in plan["layer_groups"]] == [
        (w, windows.count(w)) for w in sorted(set(windows), key=lambda w: w or 0)]
    assert any(g["window"] == WINDOW for g in plan["layer_groups"])
    assert plan["window_pool_pages"] > 0
