"""What an external router does with our KV events, written from their sources, not ours.

- `vllm_classes`: msgspec structs typed in from vLLM's `vllm/distributed/kv_events.py`
  (field order matters for the array shape), in the array (`array_like=True`) and map
  shapes. Deliberately a second copy of the schema: the tests decode our stream with it.
- `LlmdIndex`: llm-d-kv-cache-manager's keys (pkg/kvcache/kvblock/token_processor.go):
  key = H(canonical CBOR of [parent key, block tokens, extra]), the root's parent =
  H(CBOR(hash seed)), whole blocks only; H = FNV-64a (the issue's scheme; the llm-d
  revision we read hashes the same CBOR with SHA-256's last 8 bytes: `sha256_low64`).
  BlockStored maps each engine hash to the key llm-d computes from the event's tokens and
  its parent's key; the index is key -> media.
- `DynamoIndex`: Dynamo's kv-router (lib/llm/src/kv_router/protocols.rs): a block's local
  hash = XXH3-64 over its tokens as u32 little-endian, seed 1337 (a cache namespace salts
  the seed, as Dynamo's `cache_namespace` does); sequence hash = local hash for the first
  block, then XXH3-64(seed 1337) of [parent sequence hash, local hash] as two u64 LE.
Both score a request as its count of leading blocks present in any medium.
"""


import hashlib
import struct
from typing import Any, Union

import cbor2
import msgspec
import xxhash

FNV_OFFSET = 0xcbf29ce484222325
FNV_PRIME = 0x100000001b3
MASK = (1 << 64) - 1
XXH3_SEED = 1337


def fnv64a(data: bytes) -> int:
    h = FNV_OFFSET
    for b in data:
        h = ((h ^ b) * FNV_PRIME) & MASK
    return h


def sha256_low64(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[24:], "big")


def vllm_classes(array_like: bool):
    opts = dict(omit_defaults=True, gc=False, array_like=array_like)

    class KVCacheEvent(msgspec.Struct, tag=True, **opts):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: Union[int, None]
        token_ids: list[int]
        block_size: int
        lora_id: Union[int, None]
        medium: Union[str, None]
        lora_name: Union[str, None]
        extra_keys: Union[list[Union[tuple[Any, ...], None]], None] = None
        group_idx: Union[int, None] = None
        kv_cache_spec_kind: Union[str, None] = None
        kv_cache_spec_sliding_window: Union[int, None] = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: Union[str, None]
        group_idx: Union[int, None] = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(msgspec.Struct, **opts):
        ts: float
        events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
        data_parallel_rank: Union[int, None] = None

    return KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared


class _Index:
    """Engine hash -> consumer key, and consumer key -> media holding it."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.key_of: dict[int, int] = {}
        self.media: dict[int, set[str]] = {}
        self.stored_blocks = 0

    def apply(self, batch) -> None:
        for ev in batch.events:
            self.apply_event(ev)

    def apply_event(self, ev) -> None:
        kind = type(ev).__name__
        if kind == "BlockStored":
            assert ev.block_size == self.block_size
            assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
            if ev.parent_block_hash is None:
                parent = None
            else:
                assert ev.parent_block_hash in self.key_of, \
                    "BlockStored names a parent that was never announced"
                parent = self.key_of[ev.parent_block_hash]
            extras = ev.extra_keys or [None] * len(ev.block_hashes)
            for i, h in enumerate(ev.block_hashes):
                toks = ev.token_ids[i * ev.block_size:(i + 1) * ev.block_size]
                extra = extras[i]
                key = self.block_key(parent, toks, extra)
                self.key_of[h] = key
                self.media.setdefault(key, set()).add(ev.medium)
                parent = key
                self.stored_blocks += 1
        elif kind == "BlockRemoved":
            for h in ev.block_hashes:
                key = self.key_of[h]
                held = self.media[key]
                assert ev.medium in held, "BlockRemoved in a medium never stored"
                held.discard(ev.medium)
                if not held:
                    del self.media[key]
        else:
            assert kind == "AllBlocksCleared"
            self.key_of.clear()
            self.media.clear()

    def request_keys(self, tokens, namespace) -> list[int]:
        bs = self.block_size
        extra = None if namespace is None else (namespace,)
        keys, parent = [], None
        for i in range(len(tokens) // bs):
            parent = self.block_key(parent, list(tokens[i * bs:(i + 1) * bs]), extra)
            keys.append(parent)
        return keys

    def matched_blocks(self, tokens, namespace) -> int:
        n = 0
        for key in self.request_keys(tokens, namespace):
            if key not in self.media:
                break
            n += 1
        return n


class LlmdIndex(_Index):
    def __init__(self, block_size: int, hash_fn=fnv64a, hash_seed: str = ""):
        super().__init__(block_size)
        self.hash_fn = hash_fn
        self.root = hash_fn(cbor2.dumps(hash_seed, canonical=True))
        self._memo: dict = {}

    def block_key(self, parent, tokens, extra) -> int:
        p = self.root if parent is None else parent
        extra = None if extra is None else list(extra)
        memo_key = (p, tuple(tokens), None if extra is None else tuple(extra))
        key = self._memo.get(memo_key)
        if key is None:
            key = self._memo[memo_key] = self.hash_fn(
                cbor2.dumps([p, list(tokens), extra], canonical=True))
        return key


def dynamo_seed(extra) -> int:
    """Dynamo's block-hash seed: 1337, salted by a cache namespace."""
    if extra is None:
        return XXH3_SEED
    return (XXH3_SEED + xxhash.xxh3_64_intdigest(str(extra[0]).encode(), seed=1)) & MASK


class DynamoIndex(_Index):
    def __init__(self, block_size: int):
        super().__init__(block_size)
        self._memo: dict = {}

    @staticmethod
    def local_hash(tokens, extra) -> int:
        return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(tokens)}I", *tokens),
                                        seed=dynamo_seed(extra))

    def block_key(self, parent, tokens, extra) -> int:
        memo_key = (parent, tuple(tokens), extra if extra is None else tuple(extra))
        key = self._memo.get(memo_key)
        if key is None:
            local = self.local_hash(tokens, extra)
            key = local if parent is None else xxhash.xxh3_64_intdigest(
                struct.pack("<QQ", parent, local), seed=XXH3_SEED)
            self._memo[memo_key] = key
        return key
