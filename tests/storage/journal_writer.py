"""A disk tier's writes for the journal crash tests: opens the store at argv[1] with a
journal (continuing from what it recovers), then forever: drops a leaf page, adds 1-3
pages chained onto live ones (page file, then its PageAdded record), and every few rounds
compacts the journal into the index -- as the server's disk tier does between saves. It
prints `page KEY` once a page's record is appended and `drop KEY` once a drop's is, so
the test knows exactly which pages a kill must not lose. `RADIXSERVE_CRASH_AT` stops it at
a crash point (storage/crash_points.py); the test may also SIGKILL it after a line.

Run as `python -m tests.storage.journal_writer DIR SEED` from the repository root.
"""

from __future__ import annotations

import hashlib
import random
import sys

from radixserve.storage import DiskPageStore
from radixserve.storage.journal import PageAdded

from .store_helpers import PAGE_SIZE, contents_of, fingerprint, payload_for, tokens_for


def path_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    data = b"".join(t.to_bytes(4, "little") for t in tokens)
    return hashlib.blake2b(data, key=parent or b"root", digest_size=16).digest()


def main(directory: str, seed: int) -> None:
    rng = random.Random(seed)
    store = DiskPageStore(directory, fingerprint(), journal_sync_ms=rng.choice((0, 5)))
    index = store.read_index()
    pages: dict[bytes, tuple[bytes | None, int, int]] = {}   # hash -> (parent, key, content)
    last: dict[int, bytes] = {}                              # node id -> its last page
    for n in index.nodes if index else []:                   # parents first
        parent = last.get(n.parent_id)
        for h, key, content in zip(n.page_hashes, n.page_keys, contents_of(n.token_ids)):
            pages[h] = (parent, key, content)
            parent = h
        last[n.node_id] = parent
    next_content = max((c for _, _, c in pages.values()), default=0) + 1
    print("opened", flush=True)
    rounds = 0
    while rounds < 300:             # a crash point never reached ends the run (the test fails)
        rounds += 1
        parents = {p for p, _, _ in pages.values()}
        leaves = [h for h in pages if h not in parents]
        if len(pages) > 12:
            victim = rng.choice(leaves)
            _, key, _ = pages.pop(victim)
            store.drop_page(key)
            print("drop", key, flush=True)
        for _ in range(rng.randint(1, 3)):
            parent = rng.choice(list(pages)) if pages and rng.random() < 0.8 else None
            tokens = tokens_for([next_content])
            h = path_hash(parent, tokens)
            key = store.new_page_key()
            serial = store.write_page(key, payload_for(next_content,
                                                       rng.choice((512, 4096, 20000))))
            store.journal_append(PageAdded(key, serial, h, parent, None, tokens))
            pages[h] = (parent, key, next_content)
            next_content += 1
            print("page", key, flush=True)
        if rounds % 4 == 0:
            store.compact()
            print("compact", flush=True)


if __name__ == "__main__":
    assert PAGE_SIZE == 4
    main(sys.argv[1], int(sys.argv[2]))
