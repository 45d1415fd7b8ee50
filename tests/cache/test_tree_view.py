"""build_tree (the data behind GET /cache/tree): bounded, parents first, folded remainder,
stable hashes, token ids only where the caller may see them."""

from __future__ import annotations

import json

import numpy as np

from radixserve.cache import PageAllocator, RadixCache
from radixserve.cache.summary import MAX_TREE_LIMIT, TEXT_TOKENS, build_tree

SYSTEM = list(range(1000, 1064))


def fill(cache: RadixCache, alloc: PageAllocator, prompts, ns=None) -> None:
    for tokens in prompts:
        own = alloc.alloc(len(tokens))
        alloc.free(cache.insert(tokens, own, ns).duplicates(own))


def shared_prefix_cache(n: int = 30) -> RadixCache:
    c = RadixCache()
    alloc = PageAllocator(100_000)
    fill(c, alloc, [SYSTEM + [i] * (10 + i) for i in range(n)])            # one system prompt
    fill(c, alloc, [[7, 7, 7] + [i] * 5 for i in range(4)], ns="salt-abc")  # another namespace
    fill(c, alloc, [[9] * 20])                                              # a second root child
    return c


def by_id(tree):
    return {e["id"]: e for e in tree["nodes"]}


def test_tree_is_complete_when_under_the_limit():
    c = shared_prefix_cache()
    t = build_tree(c, limit=500, label_key=b"k")
    json.dumps(t)
    kinds = [e["kind"] for e in t["nodes"]]
    assert kinds.count("node") == c.num_nodes == t["shown_nodes"] and t["folded_nodes"] == 0
    assert "other" not in kinds and kinds.count("namespace") == 2
    entries = by_id(t)
    root = entries["root"]
    assert root["subtree_tokens"] == c.total_tokens
    default = entries["ns:default"]
    tops = [e for e in t["nodes"] if e["parent"] == "ns:default"]
    assert len(tops) == 2                                  # the system prompt and [9]*20
    big = max(tops, key=lambda e: e["subtree_tokens"])
    assert big["edge_tokens"] == 64 and big["subtree_nodes"] == 31
    assert default["subtree_tokens"] == sum(e["subtree_tokens"] for e in tops)
    seen = set()
    for e in t["nodes"]:                                   # parents come first
        assert e["parent"] is None or e["parent"] in seen
        seen.add(e["id"])
        assert "token_ids" not in e                        # nothing revealed by default


def test_tree_is_bounded_and_folds_the_rest():
    c = shared_prefix_cache(200)
    t = build_tree(c, limit=10, label_key=b"k")
    kinds = [e["kind"] for e in t["nodes"]]
    assert kinds.count("node") + kinds.count("namespace") == 10
    assert t["shown_nodes"] + t["folded_nodes"] == c.num_nodes
    folded = [e for e in t["nodes"] if e["kind"] == "other"]
    assert folded and sum(e["subtree_nodes"] for e in folded) >= t["folded_nodes"]
    # every shown entry's tokens = its shown children + its folded remainder + its own edge
    entries = by_id(t)
    for e in t["nodes"]:
        if e["kind"] in ("node", "namespace", "root"):
            kids = [k for k in t["nodes"] if k["parent"] == e["id"]]
            own = e.get("edge_tokens", 0)
            assert e["subtree_tokens"] == own + sum(k["subtree_tokens"] for k in kids), e
    # the shown nodes are the biggest ones: none left out holds more tokens
    full = {e["hash"]: e["subtree_tokens"] for e in build_tree(c, limit=500, label_key=b"k")["nodes"]
            if e["kind"] == "node"}
    shown = {e["hash"] for e in t["nodes"] if e["kind"] == "node"}
    assert min(full[h] for h in shown) >= max(v for h, v in full.items() if h not in shown)
    # the small namespace (4 prefixes of 8 tokens, sharing 3) is folded whole into the root's rest
    assert "ns:salt-abc" not in entries and entries["other:root"]["subtree_tokens"] == 3 + 4 * 5
    assert len(build_tree(c, limit=10**9, label_key=b"k")["nodes"]) <= 2 * MAX_TREE_LIMIT + 1


def test_namespace_filter_and_reveal_only_the_callers_namespace():
    c = shared_prefix_cache()
    t = build_tree(c, namespace="salt-abc", label_key=b"k", reveal=lambda ns: ns == "salt-abc")
    nodes = [e for e in t["nodes"] if e["kind"] == "node"]
    assert {e["namespace"] for e in nodes} == {"salt-abc"} and len(nodes) == c.num_nodes - 32
    assert all(e["token_ids"] for e in nodes)
    top = next(e for e in nodes if e["parent"] == "ns:salt-abc")
    assert top["token_ids"] == [7, 7, 7]
    mixed = build_tree(c, label_key=b"k", reveal=lambda ns: ns is None)
    for e in mixed["nodes"]:
        if e["kind"] == "node":
            assert ("token_ids" in e) == (e["namespace"] == "default")
            assert len(e.get("token_ids", [])) <= TEXT_TOKENS
    assert build_tree(c, namespace="nope", label_key=b"k")["nodes"][0]["subtree_nodes"] == 0


def test_hashes_name_prefixes_stably_under_one_key_only():
    c = shared_prefix_cache()
    a = [e["hash"] for e in build_tree(c, label_key=b"k")["nodes"] if e["kind"] == "node"]
    b = [e["hash"] for e in build_tree(c, label_key=b"k")["nodes"] if e["kind"] == "node"]
    other = [e["hash"] for e in build_tree(c, label_key=b"x")["nodes"] if e["kind"] == "node"]
    assert a == b and len(set(a)) == len(a)
    assert not set(a) & set(other)
    # the same tokens in another namespace get another name
    c2 = RadixCache()
    alloc = PageAllocator(100)
    fill(c2, alloc, [[1, 2, 3]])
    fill(c2, alloc, [[1, 2, 3]], ns="salt-x")
    names = [e["hash"] for e in build_tree(c2, label_key=b"k")["nodes"] if e["kind"] == "node"]
    assert len(set(names)) == 2


def test_locked_evictable_hits_and_idle():
    c = RadixCache()
    alloc = PageAllocator(100)
    fill(c, alloc, [[1, 2, 3, 4], [1, 2, 5, 6]])
    m = c.match_prefix([1, 2, 3, 4])
    c.lock(m.node)
    t = build_tree(c, label_key=b"k")
    nodes = {tuple(e["token_ids"]): e for e in
             build_tree(c, label_key=b"k", reveal=lambda ns: True)["nodes"] if e["kind"] == "node"}
    assert nodes[(1, 2)]["locked"] and nodes[(3, 4)]["locked"] and not nodes[(5, 6)]["locked"]
    assert nodes[(5, 6)]["evictable"] and not nodes[(3, 4)]["evictable"]
    assert not nodes[(1, 2)]["evictable"]                  # an inner node: not a leaf
    assert nodes[(3, 4)]["hits"] == 1 and nodes[(3, 4)]["idle"] < nodes[(5, 6)]["idle"]
    assert t["clock"] == c.clock
    c.unlock(m.node)
    c.check_invariants()
    assert np.all(c.tree_page_ids() >= 0)
