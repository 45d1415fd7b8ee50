"""A disk store writer for the crash tests: opens the store at argv[1] (continuing from what
it restores), then saves round after round -- an L3 eviction, new pages (often under the
keys it dropped), the index -- and prints a line after every step, so the test can
kill it with SIGKILL at a chosen moment. Each page's content is `payload_for(c)` for a
content id `c` that the edge's tokens name (store_helpers.tokens_for).

Run as `python -m tests.storage.crash_writer DIR SEED` from the repository root.
"""

from __future__ import annotations

import random
import sys

from radixserve.storage import DiskPageStore

from .store_helpers import contents_of, fingerprint, node, payload_for


def main(directory: str, seed: int) -> None:
    rng = random.Random(seed)
    store = DiskPageStore(directory, fingerprint())
    restored = store.read_index()
    nodes = list(restored.nodes) if restored else []
    next_id = max((n.node_id for n in nodes), default=0) + 1
    next_content = max((c for n in nodes for c in contents_of(n.token_ids)), default=0) + 1
    free_keys: list[int] = []                         # dropped keys, written again later
    print("opened", flush=True)
    while True:
        # An eviction first, so its keys may be written again before the next index (as
        # a tier reusing disk slots does): the old index on disk still names them.
        parents = {n.parent_id for n in nodes}
        leaves = [n for n in nodes if n.node_id not in parents]
        if len(nodes) > 6:                            # an L3 eviction drops a leaf
            victim = rng.choice(leaves)
            nodes.remove(victim)
            for key in victim.page_keys:
                store.drop_page(key)
                free_keys.append(key)
                print("drop", key, flush=True)
        for _ in range(rng.randint(1, 3)):            # demotions: new nodes, new pages
            keys, contents = [], []
            for _ in range(rng.randint(1, 3)):
                reuse = free_keys and rng.random() < 0.5
                key = free_keys.pop(rng.randrange(len(free_keys))) if reuse \
                    else store.new_page_key()
                store.write_page(key, payload_for(next_content,
                                                  rng.choice((512, 4096, 20000))))
                keys.append(key)
                contents.append(next_content)
                next_content += 1
                print("page", key, flush=True)
            parent = rng.choice(nodes) if nodes and rng.random() < 0.7 else None
            nodes.append(node(next_id, parent.node_id if parent else None, keys,
                              parent.namespace if parent else rng.choice((None, "t")),
                              contents))
            next_id += 1
        store.write_index(store.new_index(nodes))
        print("index", len(nodes), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
