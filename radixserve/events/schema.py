"""The KV events wire format: vLLM's `vllm/distributed/kv_events.py`, field for field.

Each ZeroMQ message is three frames: the topic, the sequence number (8 bytes, big-endian)
and a msgpack `KVEventBatch`. The structs below copy vLLM's (same names, same field order,
`omit_defaults`, events tagged by class name), in its two shapes:
- `array`: every struct a msgpack array (vLLM's `array_like=True`, what llm-d, kthena and
  the llm-d simulator decode);
- `map`: every struct a msgpack map keyed by field name (vLLM since vllm#42892).
`ENCODINGS[name]` gives a shape's classes; a consumer decodes with the same classes.
(No `from __future__ import annotations` here: msgspec resolves the nested classes' field
types at run time.)
"""

from dataclasses import dataclass
from typing import Any, Union

import msgspec

__all__ = ["ENCODINGS", "EventClasses", "MEDIUM_CPU", "MEDIUM_CPU_HOST", "MEDIUM_DISK",
           "MEDIUM_GPU", "END_SEQ"]

# Where a block is (vLLM names the GPU pool "GPU" and its CPU offload tier "CPU").
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_CPU_HOST = "CPU_HOST"    # our host tier when the KV pool itself is in CPU memory
MEDIUM_DISK = "DISK"
END_SEQ = -1                    # the replay's end marker (vLLM's END_SEQ)


@dataclass(frozen=True)
class EventClasses:
    """One wire shape: the batch and the three event structs."""

    name: str
    BlockStored: type
    BlockRemoved: type
    AllBlocksCleared: type
    KVEventBatch: type

    def encoder(self) -> msgspec.msgpack.Encoder:
        return msgspec.msgpack.Encoder()

    def decoder(self) -> msgspec.msgpack.Decoder:
        return msgspec.msgpack.Decoder(self.KVEventBatch)


def _classes(name: str, array_like: bool) -> EventClasses:
    """vLLM's structs with `array_like` set one way (msgspec reads it per class)."""
    opts = dict(omit_defaults=True, gc=False, array_like=array_like)

    class KVCacheEvent(msgspec.Struct, tag=True, **opts):
        """Base class for all KV cache-related events."""

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(msgspec.Struct, **opts):
        ts: float
        events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
        data_parallel_rank: int | None = None

    return EventClasses(name, BlockStored, BlockRemoved, AllBlocksCleared, KVEventBatch)


ENCODINGS: dict[str, EventClasses] = {"array": _classes("array", True),
                                      "map": _classes("map", False)}
