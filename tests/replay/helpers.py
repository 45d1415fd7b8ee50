"""Helpers for the replay tests: tiny traces written to tmp files, the shared real trace."""

from __future__ import annotations

import json
from pathlib import Path

def _shared_trace() -> Path:
    """The shared trace beside the checkout (a worktree may sit one level deeper)."""
    name = Path("shared") / "traces" / "mooncake_fast25_synthetic_trace.jsonl"
    for parent in Path(__file__).resolve().parents[3:5]:
        if (parent / name).is_file():
            return parent / name
    return Path(__file__).resolve().parents[3] / name


REAL_TRACE = _shared_trace()


def write_jsonl(path: Path, records: list) -> Path:
    """Each record: a dict (dumped as JSON) or a str (written as the raw line)."""
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n")
    return path


def hash_record(hash_ids, input_length, output_length=0, timestamp=None) -> dict:
    rec = {"input_length": input_length, "output_length": output_length,
           "hash_ids": list(hash_ids)}
    if timestamp is not None:
        rec["timestamp"] = timestamp
    return rec



def replay_records(tmp_path: Path, records: list, capacity_tokens, policy="lru", *,
                   block_size=4, page_size=None, mode="block", concurrency=1,
                   include_outputs=False, warmup_fraction=0.0, check_every=1):
    """Replay a hand-made hash-id trace; conservation and tree checks after every request."""
    from radixserve.replay.replayer import ReplayConfig, replay
    from radixserve.replay.traces import read_trace
    from radixserve.replay.workload import Workload

    trace = read_trace(write_jsonl(tmp_path / "t.jsonl", records), "hash", block_size)
    workload = Workload(trace, mode, page_size or block_size, include_outputs)
    config = ReplayConfig(capacity_tokens, policy, concurrency, warmup_fraction, check_every)
    return replay(workload, config)
