"""Recordings of a KV event stream: one JSON line per batch, and reading one as a trace.

`radixserve kv-events ENDPOINT --out FILE` writes `{"seq", "ts", "events": [...]}` per
batch (events as maps with their "type", whatever the wire shape was). `radixserve replay`
reads such a file as a hash-id trace (`hash_requests`): every block run stored into the KV
pool (medium "GPU", or "CPU" in a stream with no GPU medium: a CPU engine's pool) is one
request for its whole prefix, whose `hash_ids` are the chain from the namespace's first
block (block hashes are path hashes: equal ids, equal prefixes), at the batch's time.
Imports no ZeroMQ: the replay tool reads recordings offline.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

__all__ = ["batch_record", "hash_requests", "is_recording_line"]

_json = msgspec.json.Encoder()


def batch_record(seq: int, batch) -> bytes:
    """One JSON line for a decoded KVEventBatch (array or map shape alike)."""
    events = []
    for ev in batch.events:
        record = {"type": type(ev).__name__}
        record.update(msgspec.structs.asdict(ev))
        events.append(record)
    return _json.encode({"seq": seq, "ts": batch.ts, "rank": batch.data_parallel_rank,
                         "events": events}) + b"\n"


def is_recording_line(obj) -> bool:
    return isinstance(obj, dict) and "events" in obj and "seq" in obj


def hash_requests(path: str | Path) -> tuple[int, list[tuple[float, list[int]]]]:
    """(block size, [(timestamp, hash_ids of the whole prefix)]) of a recording: one entry
    per BlockStored into the KV pool, in stream order."""
    batches = [msgspec.json.decode(line) for line in Path(path).read_bytes().splitlines()
               if line.strip()]
    media = {ev.get("medium") for b in batches for ev in b["events"]}
    pool = "GPU" if "GPU" in media else "CPU"
    parent_of: dict[int, int | None] = {}
    block_size = 0
    out = []
    for b in batches:
        for ev in b["events"]:
            if ev["type"] == "AllBlocksCleared":
                parent_of.clear()
            if ev["type"] != "BlockStored":
                continue
            block_size = ev["block_size"]
            parent = ev["parent_block_hash"]
            for h in ev["block_hashes"]:
                parent_of[h] = parent
                parent = h
            if ev["medium"] != pool:
                continue
            chain, h = [], ev["block_hashes"][-1]
            while h is not None:
                chain.append(h)
                h = parent_of.get(h)
            out.append((b["ts"], chain[::-1]))
    return block_size, out
