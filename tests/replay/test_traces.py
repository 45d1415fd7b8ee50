"""Trace readers: both formats, replay order, and malformed lines named by line number."""

from __future__ import annotations

import pytest

from radixserve.replay.cli import main as replay_main
from radixserve.replay.traces import TraceError, read_trace

from .helpers import hash_record as rec
from .helpers import write_jsonl

BAD_HASH_LINES = [
    rec([1, 2], 8),                                   # line 1: good
    "{not json",                                      # line 2
    {"input_length": 8},                              # line 3: no hash_ids
    rec([1, 2, 3], 8),                                # line 4: 3 blocks for 8 tokens
    {"input_length": "8", "hash_ids": [1, 2]},        # line 5: wrong type
    "",                                               # line 6: blank, ignored
    rec([1, 2], 8),                                   # line 7: good
    rec([4], 0),                                      # line 8: empty prompt
]


def test_stop_at_the_first_bad_line(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", BAD_HASH_LINES)
    with pytest.raises(TraceError) as info:
        read_trace(path, block_size=4)
    assert info.value.line == 2
    assert str(info.value).startswith(f"{path}:2: invalid JSON")


def test_skip_bad_lines_and_keep_their_numbers(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", BAD_HASH_LINES)
    trace = read_trace(path, block_size=4, on_error="skip")
    assert [r.line for r in trace.requests] == [1, 7]
    assert [e.line for e in trace.skipped] == [2, 3, 4, 5, 8]
    reasons = {e.line: e.reason for e in trace.skipped}
    assert "hash_ids" in reasons[3]
    assert "3 hash_ids but input_length 8 needs 2 blocks of 4 tokens" in reasons[4]
    assert "input_length" in reasons[5]
    assert "input_length must be >= 1" in reasons[8]


def test_cli_reports_the_line_and_stops_or_skips(tmp_path, capsys):
    path = write_jsonl(tmp_path / "t.jsonl", BAD_HASH_LINES)
    assert replay_main([str(path), "--block-size", "4", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2: invalid JSON" in err
    assert replay_main([str(path), "--block-size", "4", "--no-progress",
                        "--on-error", "skip"]) == 0
    out, err = capsys.readouterr()
    assert f"skipped {path}:4: " in err
    assert "skipped 5 malformed line(s)" in out
    # The two good requests are the same prompt: the second hits its 7 matchable tokens.
    assert "43.75%" in out     # 7 / 16 tokens, the ceiling


def test_wrong_block_size_is_explained(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [rec([1, 2, 3], 1000)])
    with pytest.raises(TraceError, match=r"t.jsonl:1: .*wrong --block-size"):
        read_trace(path)                               # default block size 512
    assert read_trace(path, block_size=400).requests[0].hash_ids == (0, 1, 2)  # dense ids


def test_replay_order_is_timestamp_order(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [rec([1], 4, timestamp=30),
                                              rec([2], 4, timestamp=10),
                                              rec([3], 4, timestamp=30),
                                              rec([4], 4, timestamp=20)])
    trace = read_trace(path, block_size=4)
    assert [r.line for r in trace.requests] == [2, 4, 1, 3]   # stable on ties
    assert read_trace(path, block_size=4, limit=2).num_lines == 3


def test_text_records(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [
        {"prompt": "hello", "output_length": 3},
        {"messages": [{"role": "user", "content": "hi"}], "output": "hey"},
        {"input_ids": [5, 6, 7], "output_ids": [8]},
        {"prompt": "x", "input_ids": [1]},                  # line 4: two prompts
        {"messages": [{"content": "no role"}]},             # line 5
        {"input_ids": []},                                  # line 6
        {"output_length": 3},                               # line 7: no prompt at all
    ])
    trace = read_trace(path, on_error="skip")
    assert trace.format == "text"
    assert [r.line for r in trace.requests] == [1, 2, 3]
    assert trace.requests[2].input_ids == (5, 6, 7)
    reasons = {e.line: e.reason for e in trace.skipped}
    assert set(reasons) == {4, 5, 6, 7}
    assert "got prompt, input_ids" in reasons[4]
    assert "role" in reasons[5]
    assert "need exactly one of" in reasons[7]


def test_a_trace_without_requests_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", ["", "{bad"])
    with pytest.raises(TraceError, match="no valid request"):
        read_trace(path, on_error="skip")


@pytest.mark.parametrize("mode", ["block", "token"])
def test_hash_ids_of_any_size(tmp_path, mode):
    # Ids far beyond int64 (and negative: signed 64-bit hashes) are names, nothing more:
    # they are renumbered densely when read, so equal ids share and different ids do not.
    from radixserve.replay.replayer import ReplayConfig, replay
    from radixserve.replay.workload import Workload

    big, huge = 10**12, 2**64 + 5
    records = [rec([big, 2**63], 8), rec([big, 2**63], 8), rec([huge, -7], 8),
               rec([huge, -7, 10**30], 12)]
    trace = read_trace(write_jsonl(tmp_path / "t.jsonl", records), block_size=4)
    assert [r.hash_ids for r in trace.requests] == [(0, 1), (0, 1), (2, 3), (2, 3, 4)]
    for policy in ("lru", "belady"):
        got = replay(Workload(trace, mode, 4), ReplayConfig(None if policy == "lru" else 40,
                                                            policy, check_every=1))
        assert got.hit_tokens == 7 + 8, policy    # repeat: 7 of 8; [huge, -7] then 8 of 11


@pytest.mark.parametrize("mode", ["block", "token"])
def test_ids_that_would_wrap_around_int64_do_not_collide(tmp_path, mode):
    # Token mode synthesizes id * block_size + j: without dense ids, 2**55 + 1 blocks of 512
    # wrap around int64 onto block 1's tokens and fake a hit.
    from radixserve.replay.replayer import ReplayConfig, replay
    from radixserve.replay.workload import Workload

    records = [rec([1], 512), rec([2**55 + 1], 512), rec([1], 512)]
    trace = read_trace(write_jsonl(tmp_path / "t.jsonl", records), block_size=512)
    got = replay(Workload(trace, mode, 512), ReplayConfig(None))
    assert got.hit_tokens == 511          # only the true repeat, request 2, hits (L-1)
    assert got.hit_requests == 1


def test_what_cannot_be_represented_is_refused_with_its_line(tmp_path):
    lines = [rec([1], 4), {"input_length": 2**41, "hash_ids": [1]}]
    with pytest.raises(TraceError) as info:
        read_trace(write_jsonl(tmp_path / "t.jsonl", lines), block_size=4)
    assert info.value.line == 2 and "2**40" in info.value.reason
    lines = [{"input_ids": [1, 2]}, {"input_ids": [1, 2**63]}]
    with pytest.raises(TraceError) as info:
        read_trace(write_jsonl(tmp_path / "t.jsonl", lines), "text")
    assert info.value.line == 2 and "input_ids" in info.value.reason
    lines = [{"input_ids": [1, 2], "output_length": 2**50}]
    with pytest.raises(TraceError) as info:
        read_trace(write_jsonl(tmp_path / "t.jsonl", lines), "text")
    assert info.value.line == 1 and "output_length" in info.value.reason


def test_tile_repeats_the_trace_with_its_own_ids_and_later_times(tmp_path):
    from radixserve.replay.replayer import ReplayConfig, replay
    from radixserve.replay.traces import tile_trace
    from radixserve.replay.workload import Workload

    records = [rec([1, 2], 8, timestamp=0), rec([1, 3], 8, timestamp=10),
               rec([1, 2], 8, timestamp=30)]
    trace = read_trace(write_jsonl(tmp_path / "t.jsonl", records), block_size=4)
    tiled = tile_trace(trace, 3)
    assert len(tiled.requests) == 9
    assert [r.timestamp for r in tiled.requests] == [0, 10, 30, 45, 55, 75, 90, 100, 120]
    ids = [set(h for r in tiled.requests[3 * c: 3 * c + 3] for h in r.hash_ids)
           for c in range(3)]
    assert not (ids[0] & ids[1]) and not (ids[1] & ids[2])
    one = replay(Workload(trace, "block", 4), ReplayConfig(None)).hit_tokens
    assert replay(Workload(tiled, "block", 4), ReplayConfig(None)).hit_tokens == 3 * one > 0
    with pytest.raises(ValueError, match="--tile"):
        tile_trace(trace, 0)
