"""Golden tests: our stream decoded with vLLM's own schema (both shapes), and llm-d's and
Dynamo's block keys recomputed from the events alone, checked against keys worked out from
the prompts in the test."""

from __future__ import annotations

import cbor2
import msgspec
import pytest
import xxhash

from radixserve.cache import PagedMemory, RadixCache
from radixserve.cache.prefix_lease import PrefixLease
from radixserve.cache.path_hash import block_int, chain_blocks, namespace_seed
from radixserve.cache.token_keys import pack
from radixserve.events.block_events import BlockEvents, block_ints, media_for
from radixserve.events.schema import ENCODINGS
from radixserve.events.subscriber import EventSubscriber
from tests.events.conftest import drain
from tests.events.consumers import (DynamoIndex, LlmdIndex, fnv64a, sha256_low64,
                                    vllm_classes)


def test_hash_building_blocks_match_published_vectors():
    # FNV-1a 64 test vector ("a"), canonical CBOR by hand, XXH3-64 of the empty input.
    assert fnv64a(b"a") == 0xaf63dc4c8601ec8c
    assert cbor2.dumps([0, [1, 2], None], canonical=True) == bytes.fromhex("8300820102f6")
    assert xxhash.xxh3_64_intdigest(b"", seed=0) == 0x2D06800538D394C2


def run(tree, mem, tokens, namespace=None):
    lease = PrefixLease(mem, namespace)
    lease.acquire(tokens)
    lease.grow(-(-len(tokens) // tree.page_size) - len(lease.pages))
    lease.extend(tokens, len(tokens))
    lease.release()


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_stream_decodes_with_vllm_schema_and_consumer_keys(publisher, encoding):
    block = 4
    tree = RadixCache(page_size=1)
    mem = PagedMemory(16, tree)
    events = BlockEvents(ENCODINGS[encoding], block, 1, media_for("cpu"))
    tree.attach_observer(events)
    batch_cls, stored_cls, removed_cls, _ = vllm_classes(encoding == "array")
    decoder = msgspec.msgpack.Decoder(batch_cls)
    raw: list[bytes] = []

    def decode(payload):
        raw.append(payload)
        return decoder.decode(payload)

    sub = EventSubscriber(publisher.endpoint, publisher.replay_endpoint, decode=decode)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]             # two whole blocks and a partial one
    b = [1, 2, 3, 4, 5, 6, 9, 9, 9]             # shares the first block and 2 tokens
    run(tree, mem, a)
    run(tree, mem, b)
    run(tree, mem, [1, 2, 3, 4], "tenant-x")    # same tokens, another namespace
    publisher.publish(events.take_batch())
    mem.free(tree.evict(16))                    # everything goes: 16 pages were too few
    publisher.publish(events.take_batch())
    got = drain(sub, publisher, 2)
    sub.close()

    # The shape on the wire: arrays tagged by their first item, or maps with "type".
    first = msgspec.msgpack.decode(raw[0])
    if encoding == "array":
        assert first[1][0][0] == "BlockStored" and isinstance(first[1][0], list)
    else:
        assert first["events"][0]["type"] == "BlockStored"
    stored = [e for e in got[0].batch.events if isinstance(e, stored_cls)]
    assert [e.token_ids for e in stored] == [[1, 2, 3, 4, 5, 6, 7, 8], [5, 6, 9, 9],
                                             [1, 2, 3, 4]]
    assert stored[0].parent_block_hash is None
    assert stored[1].parent_block_hash == stored[0].block_hashes[0]
    assert [e.extra_keys for e in stored] == [None, None, [("tenant-x",)]]
    assert {e.medium for e in stored} == {"CPU"} and {e.block_size for e in stored} == {4}
    removed = [h for e in got[1].batch.events if isinstance(e, removed_cls) for h in e.block_hashes]
    assert sorted(removed) == sorted(h for e in stored for h in e.block_hashes)

    # Consumers recompute their keys from the events alone ...
    for index in (LlmdIndex(block), LlmdIndex(block, sha256_low64), DynamoIndex(block)):
        index.apply(got[0].batch)
        # ... and they equal the keys worked out from each prompt in the test.
        for tokens, ns, want in ((a, None, 2), (b, None, 2), ([1, 2, 3, 4], "tenant-x", 1),
                                 ([1, 2, 3, 4, 5, 6, 7, 9], None, 1), ([1, 2, 3, 4], "y", 0)):
            assert index.matched_blocks(tokens, ns) == want
        ev_keys = [index.key_of[h] for h in stored[0].block_hashes]
        assert ev_keys == index.request_keys(a, None)
        assert index.key_of[stored[2].block_hashes[0]] != ev_keys[0]    # tenants apart
        index.apply(got[1].batch)
        assert not index.media

    # llm-d's keys by hand for the first block: FNV-64a(CBOR([root, tokens, None])).
    root = fnv64a(cbor2.dumps("", canonical=True))
    assert root == fnv64a(b"\x60")
    k0 = fnv64a(bytes([0x83, 0x1b]) + root.to_bytes(8, "big") + bytes([0x84, 1, 2, 3, 4, 0xf6]))
    assert LlmdIndex(block).request_keys(a, None)[0] == k0
    # Dynamo's: XXH3-64 seed 1337 over u32 little-endian tokens, then the chained pair.
    local0 = xxhash.xxh3_64_intdigest(bytes([1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0]),
                                      seed=1337)
    local1 = xxhash.xxh3_64_intdigest(b"".join(t.to_bytes(4, "little") for t in (5, 6, 7, 8)),
                                      seed=1337)
    seq1 = xxhash.xxh3_64_intdigest(local0.to_bytes(8, "little") + local1.to_bytes(8, "little"),
                                    seed=1337)
    assert DynamoIndex(block).request_keys(a, None) == [local0, seq1]


def test_block_ints_read_each_hash_as_block_int():
    hashes = chain_blocks(namespace_seed("t"), pack(list(range(64))), 4)
    assert block_ints(hashes) == [block_int(h) for h in hashes] and len(hashes) == 16
