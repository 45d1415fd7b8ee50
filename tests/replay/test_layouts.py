"""`radixserve replay --model-layout`: the window-aware tree (the server's WindowedMemory and
WindowRule) against a full-KV tree given the same bytes, on multi-turn conversations."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from radixserve.replay.cli import main as replay_main

from .helpers import hash_record, write_jsonl

WINDOW = 16      # tokens: 4 blocks of 4

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))


def layout_config(tmp_path):
    """A Gemma-3-shaped layer layout (5 local layers to 1 global) as a config.json."""
    from tiny_models import hf_config
    cfg = hf_config("gemma3_text", num_hidden_layers=6, sliding_window=WINDOW,
                    layer_types=["sliding_attention"] * 5 + ["full_attention"])
    path = tmp_path / "config.json"
    cfg.to_json_file(str(path))
    return path


def conversations(n: int, turns: int) -> list[dict]:
    """n conversations taking turns; each turn's prompt is the whole history (hash blocks
    of 4 tokens), 3 new blocks a turn, after a 4-block system prompt shared by all."""
    system = list(range(1, 5))
    histories = [list(system) for _ in range(n)]
    records, next_id = [], 100
    for _ in range(turns):
        for h in histories:
            h += list(range(next_id, next_id + 3))
            next_id += 3
            records.append(hash_record(h, 4 * len(h), 4))
    return records


def test_window_aware_tree_against_full_kv_at_the_same_bytes(tmp_path, capsys):
    trace = write_jsonl(tmp_path / "t.jsonl", conversations(16, 6))
    args = [str(trace), "--block-size", "4", "--mode", "token", "--page-size", "4",
            "--model-layout", str(layout_config(tmp_path)), "--capacity-tokens", "600,8192",
            "--no-progress"]
    assert replay_main([*args, "--check-every", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    groups = report["layout"]["groups"]
    assert [(g["window"], g["num_layers"]) for g in groups] == [(None, 1), (WINDOW, 5)]
    for p in report["points"]:
        full, aware = p["full_kv"], p["window_aware"]
        assert full["query_tokens"] == aware["query_tokens"] > 0
        # Same bytes: the full-KV tree's groups fill the budget; the window-aware pools fit
        # in it (a page's rounding aside) with far fewer bytes in the windowed group.
        assert sum(p["full_kv_group_bytes"].values()) == p["kv_bytes"]
        assert sum(p["window_aware_group_bytes"].values()) <= p["kv_bytes"]
        assert not p["over_budget"]
        win = f"window {WINDOW}"
        assert p["window_aware_group_bytes"][win] < p["full_kv_group_bytes"][win] / 2
        assert p["window_aware_group_bytes"]["full"] > p["full_kv_group_bytes"]["full"]
        assert 0 < full["token_hit_rate"] and 0 < aware["token_hit_rate"] <= 1
        assert p["hit_ratio"] == aware["token_hit_rate"] / full["token_hit_rate"]
    small, large = report["points"]
    # The small budget thrashes both (figures, not asserted); with room for everything
    # both hit every turn's whole history (each turn's end is a kept match point).
    assert small["full_kv"]["token_hit_rate"] < large["full_kv"]["token_hit_rate"]
    assert large["window_aware"]["token_hit_rate"] == large["full_kv"]["token_hit_rate"]
    assert replay_main([*args[:-2], "8192", "--no-progress"]) == 0      # the table
    text = capsys.readouterr().out
    assert "full-KV hit" in text and f"window {WINDOW}: 5 layers" in text


def test_a_layout_without_a_window_is_refused(tmp_path, capsys):
    from tiny_models import hf_config
    path = tmp_path / "config.json"
    hf_config("llama").to_json_file(str(path))
    trace = write_jsonl(tmp_path / "t.jsonl", conversations(1, 2))
    assert replay_main([str(trace), "--block-size", "4", "--model-layout", str(path),
                        "--capacity-tokens", "256", "--no-progress"]) == 2
    assert "needs layers with a sliding window" in capsys.readouterr().err
