"""A disk store writer for the crash tests: opens the store at argv[1] (continuing from what
it restores), then saves round after round -- new pages, an L3 eviction, the index -- and
prints a line after every step, so the test can kill it with SIGKILL at a chosen moment.

Run as `python -m tests.storage.crash_writer DIR SEED` from the repository root.
"""

from __future__ import annotations

import random
import sys

from radixserve.storage import DiskPageStore

from .store_helpers import fingerprint, node, payload_for


def main(directory: str, seed: int) -> None:
    rng = random.Random(seed)
    store = DiskPageStore(directory, fingerprint())
    restored = store.read_index()
    nodes = list(restored.nodes) if restored else []
    next_id = max((n.node_id for n in nodes), default=0) + 1
    print("opened", flush=True)
    while True:
        for _ in range(rng.randint(1, 3)):            # demotions: new nodes, new pages
            keys = [store.new_page_key() for _ in range(rng.randint(1, 3))]
            for key in keys:
                store.write_page(key, payload_for(key, rng.choice((512, 4096, 20000))))
                print("page", key, flush=True)
            parent = rng.choice(nodes) if nodes and rng.random() < 0.7 else None
            nodes.append(node(next_id, parent.node_id if parent else None, keys,
                              parent.namespace if parent else rng.choice((None, "t"))))
            next_id += 1
        parents = {n.parent_id for n in nodes}
        leaves = [n for n in nodes if n.node_id not in parents]
        if len(nodes) > 6:                            # an L3 eviction drops a leaf
            victim = rng.choice(leaves)
            nodes.remove(victim)
            for key in victim.page_keys:
                store.drop_page(key)
                print("drop", key, flush=True)
        store.write_index(store.new_index(nodes))
        print("index", len(nodes), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
