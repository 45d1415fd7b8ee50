"""scripts/trace_signals.py: reuse shares per online signal, checked on hand-made traces."""

from __future__ import annotations

import json
import math

import pytest


@pytest.fixture
def ts(load_script):
    return load_script("trace_signals")


def test_next_use_gaps_count_block_accesses_to_the_next_use(ts):
    assert ts.next_use_gaps([[1, 2], [1, 3], [2]]) == [2, 3, math.inf, math.inf, math.inf]


def test_power_of_4_buckets_name_their_bounds(ts):
    assert [ts.power_of_4_bucket(x, 64) for x in (0, 3, 4, 15, 16, 63, 64, 10**6)] == \
        ["< 4", "< 4", "< 16", "< 16", "< 64", "< 64", ">= 64", ">= 64"]


def test_short_replies_reused_long_replies_not(ts):
    """Requests with 8-token replies come back (their next turn extends them), those with
    2,000-token replies never do: the reply-length signal separates them completely, and
    seen blocks' reuse gaps are bucketed."""
    requests, replies = [], []
    for conv in range(20):
        base = 1000 * conv
        requests.append([base, base + 1])               # a turn with a short reply...
        replies.append(8)
        requests.append([base + 500, base + 501])       # ...a one-off with a long reply...
        replies.append(2000)
        requests.append([base, base + 1, base + 2])     # ...then the next turn
        replies.append(2000)
    table = ts.signal_table(requests, replies, within=4).to_dict()["signals"]
    by_reply = table["new block: reply tokens"]
    assert by_reply["< 16"] == {"blocks": 40, "reused": 1.0, "reused_within": 1.0}
    assert by_reply[">= 1024"]["blocks"] == 60          # the one-offs and the turns' new tails
    assert by_reply[">= 1024"]["reused"] == 0.0
    continues = table["new block: request"]["continues a known prefix"]
    assert continues == {"blocks": 20, "reused": 0.0, "reused_within": 0.0}
    seen = table["seen block: last reuse gap (block accesses)"]
    assert seen == {"< 16": {"blocks": 40, "reused": 0.0, "reused_within": 0.0}}


def test_cli_reads_a_hash_trace(ts, tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    lines = [{"timestamp": i, "input_length": 1024, "output_length": 4, "hash_ids": [7, 8 + i]}
             for i in range(3)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    ts.main([str(path), "--json", "--within", "2"])
    out = json.loads(capsys.readouterr().out)
    assert out["within"] == 2
    # block 7: new in request 0, then seen twice (gap 2, reused at gap 2 again, then never)
    assert out["signals"]["new block: reply tokens"]["< 16"]["blocks"] == 4
    assert out["signals"]["seen block: last reuse gap (block accesses)"]["< 4"] == \
        {"blocks": 2, "reused": 0.5, "reused_within": 0.5}
