"""The replay command: options, JSON, plot, capacity syntax, and no torch on the way."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from radixserve.replay.cli import main as replay_main
from radixserve.replay.report import parse_capacities, parse_capacity

from .helpers import hash_record as rec
from .helpers import write_jsonl

REPO = Path(__file__).resolve().parents[2]


def test_capacity_syntax():
    assert parse_capacity("8192") == 8192
    assert parse_capacity("500k") == 500_000
    assert parse_capacity("1.5M") == 1_500_000
    assert parse_capacity("2g") == 2_000_000_000
    assert parse_capacity("64Ki") == 65_536
    assert parse_capacity("1Mi") == 1 << 20
    assert parse_capacity("inf") is None
    assert parse_capacities("1M, 500k,1M,inf") == [1_000_000, 500_000, None]
    for bad in ("", "1X", "-5", "M", "1e6"):
        with pytest.raises(ValueError):
            parse_capacity(bad)


@pytest.fixture
def cycle_trace(tmp_path):
    # A cycle of 3 one-block prompts with 1-token private tails (see test_hand_traces).
    return write_jsonl(tmp_path / "cycle.jsonl",
                       [rec([b, 100 + i], 5) for i, b in enumerate([1, 2, 3] * 3)])


def test_json_report(cycle_trace, capsys):
    code = replay_main([str(cycle_trace), "--block-size", "4", "--capacity-tokens",
                        "12,1k", "--policy", "lru,gdsf", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mode"] == "block" and report["page_size"] == 4
    points = {(p["capacity_tokens"], p["policy"]): p for p in report["points"]}
    assert set(points) == {(c, p) for c in (12, 1000) for p in ("lru", "gdsf", "belady")}
    assert points[12, "lru"]["hit_tokens"] == 0
    assert points[12, "belady"]["hit_tokens"] == 12
    assert points[12, "belady"]["fraction_of_optimal"] == 1.0
    # Share of the LRU-to-optimal gap closed: 0 for LRU, 1 for the optimal, none where
    # the gap is empty (1k tokens hold everything).
    assert points[12, "lru"]["gap_closed"] == 0.0
    assert points[12, "belady"]["gap_closed"] == 1.0
    assert points[12, "gdsf"]["gap_closed"] == pytest.approx(points[12, "gdsf"]["hit_tokens"] / 12)
    assert points[1000, "gdsf"]["gap_closed"] is None
    # 1k tokens hold all three blocks: every repeat hits, as in the unbounded ceiling.
    assert points[1000, "lru"]["hit_tokens"] == report["ceiling"]["hit_tokens"] == 6 * 4
    assert report["ceiling"]["token_hit_rate"] == pytest.approx(24 / 45)
    assert report["ceiling"]["request_hit_rate"] == pytest.approx(6 / 9)
    assert points[1000, "gdsf"]["prefill_tokens"] == 45 - 24


def test_table_plot_and_options(cycle_trace, tmp_path, capsys):
    png = tmp_path / "curve.png"
    code = replay_main([str(cycle_trace), "--block-size", "4", "--capacity-tokens",
                        "8,12,16,1k", "--policy", "lru", "--plot", str(png),
                        "--concurrency", "2", "--warmup-fraction", "0.3",
                        "--mode", "token", "--check-every", "1"])
    assert code == 0
    out = capsys.readouterr().out
    assert "token mode" in out and "concurrency 2" in out and "belady" in out
    assert "gap closed" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000


def test_unknown_policy_and_bad_page_size(cycle_trace, capsys):
    assert replay_main([str(cycle_trace), "--block-size", "4", "--policy", "fifo"]) == 2
    assert "unknown policy 'fifo'" in capsys.readouterr().err
    assert replay_main([str(cycle_trace), "--block-size", "4", "--page-size", "3",
                        "--mode", "block"]) == 2
    assert "divide the block size" in capsys.readouterr().err


def test_no_torch_and_both_entry_points(cycle_trace):
    code = f"""
import sys
from radixserve.cli import main
assert main(["replay", {str(cycle_trace)!r}, "--block-size", "4", "--capacity-tokens",
             "12", "--no-progress"]) == 0
assert main(["replay", {str(cycle_trace)!r}, "--block-size", "4", "--capacity-tokens",
             "12", "--no-progress", "--replicas", "1,2", "--router", "all"]) == 0
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "radixserve.model"))
assert not heavy, heavy
assert "radixserve.model" not in sys.modules
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "replay.py"),
                          str(cycle_trace), "--block-size", "4", "--json"],
                         check=True, capture_output=True, text=True, timeout=120).stdout
    assert json.loads(out)["ceiling"]["hit_tokens"] == 24


def test_bad_plot_paths_fail_before_the_sweep(cycle_trace, tmp_path, capsys):
    base = [str(cycle_trace), "--block-size", "4", "--capacity-tokens", "12", "--no-progress"]
    assert replay_main(base + ["--plot", str(tmp_path / "no" / "such" / "c.png")]) == 2
    out, err = capsys.readouterr()
    assert "does not exist" in err and "Traceback" not in err
    assert replay_main(base + ["--plot", str(tmp_path / "curve.xyz")]) == 2
    err = capsys.readouterr().err
    assert "unsupported file type '.xyz'" in err and ".png" in err


def test_a_plot_that_fails_late_keeps_the_report(cycle_trace, tmp_path, capsys):
    # The folder exists when checked, but the file cannot be written: the table is printed
    # first, then one line says why the plot failed.
    target = tmp_path / "curve.png"
    target.mkdir()                      # a folder where the file should go
    code = replay_main([str(cycle_trace), "--block-size", "4", "--capacity-tokens", "12",
                        "--no-progress", "--plot", str(target)])
    out, err = capsys.readouterr()
    assert code == 2
    assert "belady" in out and "ceiling" in out
    assert "plot failed" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("flags,message", [
    (["--page-size", "0"], "--page-size must be >= 1"),
    (["--limit", "0"], "--limit must be >= 1"),
    (["--capacity-tokens", "3"], "less than one page (4 tokens)"),
    (["--capacity-tokens", "12,2"], "capacity 2 tokens is less than one page"),
])
def test_bad_numbers_get_clear_messages(cycle_trace, capsys, flags, message):
    assert replay_main([str(cycle_trace), "--block-size", "4", "--no-progress"] + flags) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_miss_reasons_in_aggregate(cycle_trace, capsys):
    """Each repeat finds its block cached (room for everything) and stops at its own tail,
    never seen; at 12 tokens under LRU the block was evicted in between (dropped: no lower
    tier)."""
    code = replay_main([str(cycle_trace), "--block-size", "4", "--capacity-tokens", "12,1k",
                        "--policy", "lru", "--no-optimal", "--miss-reasons", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    points = {p["capacity_tokens"]: p["miss_reasons"] for p in report["points"]}
    assert points[1000] == report["ceiling"]["miss_reasons"] == {"never_seen": 9}
    assert points[12] == {"never_seen": 3, "evicted": 6}
    replay_main([str(cycle_trace), "--block-size", "4", "--capacity-tokens", "12",
                 "--policy", "lru", "--no-optimal", "--miss-reasons"])
    assert "miss reasons (lru @ 12, requests): evicted 6, never_seen 3" in capsys.readouterr().out
