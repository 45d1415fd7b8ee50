"""A brute-force model of the radix cache's contents, for the stateful test.

No tree: every cached page is one entry, keyed by (namespace, the whole token prefix that
ends with that page). Inserted sequences add their pages' entries; evictions remove the
entries of the freed pages. Longest prefixes are found by trying every length, and the
copy-on-write candidates by scanning every entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class ModelMatch:
    pages: list[int]            # fully matched pages, in order
    cow_tokens: int             # tokens of the best partially matching next page
    cow_pages: set[int]         # every page achieving cow_tokens (ties are the tree's choice)

    def matched_tokens(self, page_size: int) -> int:
        return len(self.pages) * page_size + self.cow_tokens


@dataclass
class BruteForceCache:
    page_size: int
    entries: dict[tuple, int] = field(default_factory=dict)   # (ns, prefix) -> page
    owner: dict[int, tuple] = field(default_factory=dict)     # page -> (ns, prefix)

    def match(self, tokens, namespace, max_tokens=None) -> ModelMatch:
        ps = self.page_size
        limit = len(tokens) if max_tokens is None else max(0, min(len(tokens), max_tokens))
        pages = []
        while (len(pages) + 1) * ps <= limit:
            page = self.entries.get((namespace, tuple(tokens[:(len(pages) + 1) * ps])))
            if page is None:
                break
            pages.append(page)
        base = len(pages) * ps
        cow, cow_pages = 0, set()
        if ps > 1 and base < limit:
            head = tuple(tokens[:base])
            for (ns, prefix), page in self.entries.items():
                if ns == namespace and len(prefix) == base + ps and prefix[:base] == head:
                    n = common_prefix(prefix[base:], tokens[base:limit])
                    if n > cow:
                        cow, cow_pages = n, {page}
                    elif n == cow and n > 0:
                        cow_pages.add(page)
        return ModelMatch(pages, cow, cow_pages)

    def insert(self, tokens, pages, namespace) -> tuple[int, list[int]]:
        """(cached tokens, the cache's pages for the sequence) -- adopts the missing ones."""
        ps = self.page_size
        cached, out = None, []
        for i, page in enumerate(pages):
            key = (namespace, tuple(tokens[:(i + 1) * ps]))
            have = self.entries.get(key)
            if have is None:
                if cached is None:
                    cached = i * ps
                self.entries[key] = page
                self.owner[page] = key
                have = page
            out.append(have)
        return (len(pages) * ps if cached is None else cached), out

    def remove_pages(self, pages) -> None:
        for page in pages:
            del self.entries[self.owner.pop(page)]

    def clear(self) -> None:
        self.entries.clear()
        self.owner.clear()

    def page_set(self) -> set[int]:
        return set(self.owner)

    def check_prefix_closed(self) -> None:
        """Whatever survives eviction is still a tree: every entry's parent page is cached."""
        ps = self.page_size
        for ns, prefix in self.entries:
            if len(prefix) > ps:
                assert (ns, prefix[:-ps]) in self.entries, f"orphan page for {prefix}"
