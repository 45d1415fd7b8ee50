"""StoreIndex: the radix tree's shape as the disk store keeps it, and how it is checked.

One record per tree node: its id, its parent's id (None under a namespace root), its
namespace, the token ids of its edge and the keys of the page files holding their K/V.
Nodes are listed parents first. The index is written last, after every page it names, so
a valid index only names complete pages; `restorable` still drops any node that does not
fit (missing page, wrong length, unknown parent) together with everything below it, so a
damaged directory restores a consistent tree or nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection

import msgspec

from .checked_blob import HEADER, BadBlob, check_header, check_payload, pack_header
from .fingerprint import ModelFingerprint

__all__ = ["INDEX_VERSION", "IndexNode", "StoreIndex", "Restorable", "encode_index",
           "decode_index", "restorable"]

INDEX_VERSION = 1
INDEX_MAGIC = b"RXKVIDX1"
_INDEX_KEY = 0


class IndexNode(msgspec.Struct, array_like=True):
    node_id: int
    parent_id: int | None            # None: the node hangs from its namespace's root
    namespace: str | None
    token_ids: list[int]             # the edge's tokens: len == len(page_keys) * page_size
    page_keys: list[int]             # the disk store's page keys, in token order
    last_access: int = 0             # the tree's logical clock, to restore eviction order
    # Each page's path hash (cache/path_hash.py), so journal records can hang pages from
    # this node (journal_replay.py); [] in indexes written before the journal.
    page_hashes: list[bytes] = []
    # Per page, the key of the page file holding its sliding-window layers' KV (hybrid
    # models, engine/window_persistence.py; 0: none saved); [] when none was saved.
    window_keys: list[int] = []


class StoreIndex(msgspec.Struct):
    version: int
    fingerprint: ModelFingerprint
    nodes: list[IndexNode]
    # The write serial of each named page (filled by DiskPageStore.write_index): a page
    # file whose header carries another serial was rewritten after this index.
    page_serials: dict[int, int] = {}
    # The first journal file this index does not cover (storage/journal.py): a restart
    # replays that one and those after it.
    journal_from: int = 0

    def page_keys(self) -> set[int]:
        """Every page file the index names: the nodes' pages and their saved windows."""
        return {k for n in self.nodes for k in (*n.page_keys, *n.window_keys) if k}


def encode_index(index: StoreIndex) -> list[bytes]:
    """-> the index file's chunks (header, payload)."""
    payload = msgspec.msgpack.encode(index)
    return [pack_header(INDEX_MAGIC, _INDEX_KEY, payload), payload]


def decode_index(data: bytes) -> StoreIndex:
    """The index in a file's bytes; BadBlob when truncated, corrupt or of another version."""
    length, crc = check_header(INDEX_MAGIC, _INDEX_KEY, data[:HEADER.size])
    payload = data[HEADER.size:HEADER.size + length]
    check_payload(payload, length, crc, trailing=len(data) > HEADER.size + length)
    try:
        index = msgspec.msgpack.decode(payload, type=StoreIndex)
    except msgspec.DecodeError as e:
        raise BadBlob(f"undecodable: {e}") from None
    if index.version != INDEX_VERSION:
        raise BadBlob(f"index version {index.version}, this server reads {INDEX_VERSION}")
    return index


@dataclass
class Restorable:
    index: StoreIndex                                # the nodes that can be restored
    dropped: list[str] = field(default_factory=list)  # why others were not (one per node)


def restorable(index: StoreIndex, page_size: int, stored: Collection[int]) -> Restorable:
    """The part of `index` whose nodes all hang from restorable parents, hold whole pages
    that are all `stored`, and share no page with an earlier node."""
    kept: list[IndexNode] = []
    namespaces: dict[int, str | None] = {}
    used: set[int] = set()
    dropped: list[str] = []
    for node in index.nodes:
        why = _problem(node, page_size, stored, namespaces, used)
        if why:
            dropped.append(f"node {node.node_id}: {why}")
            continue
        kept.append(node)
        namespaces[node.node_id] = node.namespace
        used.update(node.page_keys)
    keys = StoreIndex(index.version, index.fingerprint, kept).page_keys()
    serials = {k: v for k, v in index.page_serials.items() if k in keys}
    return Restorable(StoreIndex(index.version, index.fingerprint, kept, serials,
                                 index.journal_from), dropped)


def _problem(node: IndexNode, page_size: int, stored: Collection[int],
             namespaces: dict[int, str | None], used: set[int]) -> str | None:
    if node.node_id in namespaces:
        return "duplicate node id"
    if node.parent_id is not None:
        if node.parent_id not in namespaces:
            return f"parent {node.parent_id} not restored"
        if namespaces[node.parent_id] != node.namespace:
            return "namespace differs from its parent's"
    if not node.page_keys or len(node.token_ids) != len(node.page_keys) * page_size:
        return f"{len(node.token_ids)} tokens for {len(node.page_keys)} pages"
    missing = [k for k in node.page_keys if k not in stored]
    if missing:
        return f"page {missing[0]:#x} missing"
    if any(k in used for k in node.page_keys) or len(set(node.page_keys)) < len(node.page_keys):
        return "page shared with another node"
    return None
