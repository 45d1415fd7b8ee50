"""Path hashes: one name for a block of cached tokens, wherever the tree's edges fall.

A prompt of tokens t is cut into blocks of `block_tokens`; block i's hash covers the
namespace and every token up to the end of block i: hash_i = H(hash_{i-1}, block_i), with
hash_{-1} = H(namespace), H = blake2b-16 keyed by the previous hash. Equal hashes mean equal
namespaced prefixes, and two namespaces never share one. Only whole blocks are hashed.

Two users, one hash and one tree walk:
- the disk store knows a saved copy of a page by its path hash (block = page;
  engine/kv_persistence), so the same prefix saved twice is written once, however the
  tree was split since. The hashes live only in the running server (its index file stores
  token ids and page keys), so they are not part of the saved format;
- replicas publish, and the router names prompts by, the first 8 bytes of each block's hash
  as an int (cluster/prefix_hashes, cluster/cache_digest; block = routing block).

No torch: the router and the offline tools import this.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from radixserve.cache.token_keys import ITEM_BYTES, TokenIds, pack

if TYPE_CHECKING:
    from radixserve.cache.radix_cache import RadixCache
    from radixserve.cache.tree_node import TreeNode

DIGEST_BYTES = 16


def namespace_seed(namespace: str | None) -> bytes:
    """The chain's start for a namespace (None, the shared namespace, included)."""
    return hashlib.blake2b(f"radixserve-kv-path\0{namespace!r}".encode(),
                           digest_size=DIGEST_BYTES).digest()


def chain_blocks(start: bytes, key: bytes, block_tokens: int) -> list[bytes]:
    """The hashes of each whole block of packed tokens `key`, chained from `start`: block
    i's is blake2b-16 of its bytes keyed by block i-1's (by `start` for the first)."""
    step = block_tokens * ITEM_BYTES
    hashes, h = [], start
    blake2b = hashlib.blake2b          # looked up once: this loop is the walk's whole cost
    for i in range(0, len(key) - step + 1, step):
        h = blake2b(key[i:i + step], key=h, digest_size=DIGEST_BYTES).digest()
        hashes.append(h)
    return hashes


def block_int(digest: bytes) -> int:
    """A path hash as a 64-bit block id (its first 8 bytes): the routing hash replicas
    publish in digests and the block hash of KV events (radixserve/events)."""
    return int.from_bytes(digest[:8], "little")


def prompt_path_hashes(tokens: TokenIds, block_tokens: int,
                       namespace: str | None) -> list[bytes]:
    """The path hash of each whole block of a prompt, in order."""
    return chain_blocks(namespace_seed(namespace), pack(tokens), block_tokens)


def walk_path_hashes(tree: "RadixCache", block_tokens: int
                     ) -> Iterator[tuple["TreeNode", list[bytes]]]:
    """Every token-holding node, parents first, with the hashes of the blocks that end in
    it: a block that spans several edges hashes exactly as `prompt_path_hashes` hashes the
    same prompt. Read-only (no clock, no hit count); run it on the thread that owns the
    tree, with no await while iterating, so the tree cannot change under it."""
    step = block_tokens * ITEM_BYTES
    carry: dict[int, tuple[bytes, bytes]] = {}      # node id -> (chain hash, unfinished block)
    for node in tree.iter_nodes():
        parent = node.parent
        if parent is None or not parent.depth:
            h, rest = namespace_seed(node.namespace), b""
        else:
            h, rest = carry[parent.id]
        data = rest + node.key if rest else node.key
        hashes = chain_blocks(h, data, block_tokens)
        if node.children:
            whole = len(data) - len(data) % step
            carry[node.id] = (hashes[-1] if hashes else h, data[whole:])
        yield node, hashes


def node_page_hashes(node: "TreeNode", block_tokens: int
                     ) -> tuple[bytes | None, list[bytes]] | None:
    """(the hash of the block before `node`'s first, None at its namespace's start; the
    hashes of its whole blocks -- a partial last one has none), for a node that starts on a
    block boundary; None for one that does not. Walks up to the root: O(depth)."""
    if (node.depth - node.num_tokens) % block_tokens:
        return None
    parts = []
    n = node
    while n is not None and n.depth:
        parts.append(n.key)
        n = n.parent
    hashes = chain_blocks(namespace_seed(node.namespace), b"".join(reversed(parts)),
                          block_tokens)
    own = node.num_tokens // block_tokens
    if not own:
        return None
    before = hashes[-own - 1] if len(hashes) > own else None
    return before, hashes[len(hashes) - own:]
