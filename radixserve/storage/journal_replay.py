"""The disk tier as it was at a crash: the last index with the journal's records replayed.

Both are turned into one map of pages by path hash: the index's nodes (their
`page_hashes`, parents first) and then each record in order (`PageAdded` puts a page at its
hash, replacing an older file for the same path; `PagesDropped` removes the pages of those
files; `PagesTouched` raises their recency). The pages are then regrouped into index nodes: a page hangs from the page whose
hash is its `parent_hash`, a page with no parent starts its namespace, a run of pages with
one child each is one node. A page's window file (a hybrid model's sliding-window KV,
`PageAdded.window_key`) goes with it: named while its page is and its own file is present,
forgotten when its file is dropped. A page whose parent is not on disk cannot be restored (its
prefix is unknown): it is left out, and its file removed like any page no index names.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

from .journal import PageAdded, PagesDropped, PagesTouched, Record
from .store_index import IndexNode, StoreIndex

__all__ = ["replay"]


@dataclass
class _Page:
    key: int
    serial: int | None
    parent: bytes | None
    namespace: str | None
    token_ids: list[int]
    last_access: int
    window_key: int = 0             # its window's page file (IndexNode.window_keys)
    window_serial: int | None = None


def replay(index: StoreIndex, records: Iterable[Record], page_size: int,
           present: set[int] | None = None) -> StoreIndex:
    """`index` (its fingerprint and version are kept) with `records` applied. `present`
    (at recovery: the page files on disk): a `PageAdded` whose file is not among them is
    skipped, so an older file for the same path stays. Records are written ahead of
    their files (disk_store.write_page), and a crash mid-write leaves the record alone."""
    pages = _index_pages(index, page_size)
    by_key = {p.key: h for h, p in pages.items()}
    by_window = {p.window_key: h for h, p in pages.items() if p.window_key}
    for record in records:
        if isinstance(record, PageAdded):
            if present is not None and record.key not in present:
                continue
            old = pages.get(record.path_hash)
            if old is not None:
                by_key.pop(old.key, None)
                by_window.pop(old.window_key, None)
            window = record.window_key
            if present is not None and window not in present:
                window = 0                      # its file never completed
            pages[record.path_hash] = _Page(record.key, record.serial, record.parent_hash,
                                            record.namespace, record.token_ids,
                                            record.last_access, window,
                                            record.window_serial if window else None)
            by_key[record.key] = record.path_hash
            if window:
                by_window[window] = record.path_hash
        elif isinstance(record, PagesDropped):
            for key in record.keys:
                h = by_key.pop(key, None)
                if h is not None:
                    by_window.pop(pages.pop(h).window_key, None)
                h = by_window.pop(key, None)
                if h is not None:
                    pages[h].window_key, pages[h].window_serial = 0, None
        elif isinstance(record, PagesTouched):
            for key in record.keys:
                h = by_key.get(key)
                if h is not None:
                    page = pages[h]
                    page.last_access = max(page.last_access, record.last_access)
    nodes = _regroup(pages)
    named = {k for n in nodes for k in n.page_keys}
    serials = {p.key: p.serial for p in pages.values()
               if p.serial is not None and p.key in named}
    serials.update((p.window_key, p.window_serial) for p in pages.values()
                   if p.key in named and p.window_key and p.window_serial is not None)
    return StoreIndex(index.version, index.fingerprint, nodes, serials)


def _index_pages(index: StoreIndex, page_size: int) -> dict[bytes, _Page]:
    """The index's pages by path hash (a node written without hashes gets names no record
    can refer to: it is restored as it was, and nothing is hung from it)."""
    pages: dict[bytes, _Page] = {}
    last_hash: dict[int, bytes] = {}
    for node in index.nodes:
        n = len(node.page_keys)
        if n == 0 or len(node.token_ids) != n * page_size:
            continue
        hashes = node.page_hashes if len(node.page_hashes) == n else \
            [b"index-node:%d:%d" % (node.node_id, i) for i in range(n)]
        parent = last_hash.get(node.parent_id) if node.parent_id is not None else None
        if node.parent_id is not None and parent is None:
            continue                            # its parent was left out: so is it
        windows = node.window_keys if len(node.window_keys) == n else [0] * n
        for i, (h, key) in enumerate(zip(hashes, node.page_keys)):
            pages[h] = _Page(key, index.page_serials.get(key), parent, node.namespace,
                             node.token_ids[i * page_size:(i + 1) * page_size],
                             node.last_access, windows[i],
                             index.page_serials.get(windows[i]))
            parent = h
        last_hash[node.node_id] = hashes[-1]
    return pages


def _regroup(pages: dict[bytes, _Page]) -> list[IndexNode]:
    """Index nodes, parents first, from the pages reachable from a namespace's start."""
    children: dict[bytes | None, list[bytes]] = defaultdict(list)
    for h, page in pages.items():
        children[page.parent].append(h)
    nodes: list[IndexNode] = []
    stack: list[tuple[bytes, int | None]] = [(h, None) for h in reversed(children[None])]
    while stack:
        head, parent_id = stack.pop()
        run = [head]
        while len(children.get(run[-1], ())) == 1:
            run.append(children[run[-1]][0])
        run_pages = [pages[h] for h in run]
        node = IndexNode(len(nodes) + 1, parent_id, run_pages[0].namespace,
                         [t for p in run_pages for t in p.token_ids],
                         [p.key for p in run_pages],
                         max(p.last_access for p in run_pages), page_hashes=run,
                         window_keys=_window_keys(run_pages))
        nodes.append(node)
        stack.extend((h, node.node_id) for h in reversed(children.get(run[-1], ())))
    return nodes


def _window_keys(run: list[_Page]) -> list[int]:
    """IndexNode.window_keys of a run of pages ([] when none has a saved window)."""
    keys = [p.window_key for p in run]
    return keys if any(keys) else []
