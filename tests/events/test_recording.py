"""`radixserve kv-events` records a stream as JSON lines (catching up through the replay
endpoint), and `radixserve replay` reads the recording as a hash-id trace."""

from __future__ import annotations

import json

from radixserve.cache import PagedMemory, RadixCache
from radixserve.cli import main
from radixserve.events.block_events import BlockEvents, media_for
from radixserve.events.schema import ENCODINGS
from radixserve.replay.traces import read_trace
from tests.events.test_golden import run


def test_record_then_replay_the_recording(publisher, tmp_path, capsys):
    tree = RadixCache(page_size=1)
    mem = PagedMemory(64, tree)
    events = BlockEvents(ENCODINGS["map"], 4, 1, media_for("cpu"))
    tree.attach_observer(events)
    shared = list(range(100, 108))                         # two blocks
    for tail in ([1, 2, 3, 4], [5, 6, 7, 8, 9], [1, 2, 3, 4]):
        run(tree, mem, shared + tail)
        publisher.publish(events.take_batch() or ENCODINGS["map"].KVEventBatch(0.0, []))
    assert publisher.wait_sent(3, timeout_s=30)
    out = tmp_path / "events.jsonl"
    assert main(["kv-events", publisher.endpoint, "--replay", publisher.replay_endpoint,
                 "--encoding", "map", "--out", str(out), "--count", "3"]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["seq"] - publisher.first_seq for line in lines] == [0, 1, 2]
    assert lines[0]["events"][0]["type"] == "BlockStored"
    assert lines[0]["events"][0]["token_ids"] == shared + [1, 2, 3, 4]
    assert lines[2]["events"] == []                        # the third request was a hit

    trace = read_trace(out)
    assert trace.format == "hash" and trace.block_size == 4
    # One request per run of stored blocks, for its whole prefix: [a, b, c] then [a, b, d].
    ids = [r.hash_ids for r in trace.requests]
    assert ids == [(0, 1, 2), (0, 1, 3)]
    assert [r.input_length for r in trace.requests] == [12, 12]

    assert main(["replay", str(out), "--json", "--no-optimal"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["requests"] == 2
    assert report["ceiling"]["hit_tokens"] == 8             # the shared two blocks
