#!/usr/bin/env python
"""Time SGLang's own pure-Python RadixCache on the stream of scripts/bench_radix.py (CPU only).

SGLang is not a dependency of radixserve and is never installed into its venv (its wheel's
requirements pull a CUDA torch). Fetch the wheel alone and unpack it outside the repository:

    mkdir -p /work/sglang_ref/dl
    pip download sglang==0.5.23 --no-deps -d /work/sglang_ref/dl
    python -m zipfile -e /work/sglang_ref/dl/sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl \\
        /work/sglang_ref/sglang-0.5.23

(The wheel is tagged cp311/manylinux only because it also ships Rust extensions; the file timed
here, sglang/srt/mem_cache/radix_cache.py, is plain Python.) Then, from the repository root:

    python scripts/sglang_radix_ref.py --sglang-path /work/sglang_ref/sglang-0.5.23

How it is loaded. `sglang/__init__.py` and most of `sglang.srt` import CUDA/triton kernels,
zmq, the server args etc. Instead of installing those, `load_sglang()` registers the packages
`sglang`, `sglang.srt`, `sglang.srt.utils`, `sglang.srt.mem_cache` and
`sglang.srt.mem_cache.allocator` as bare packages (their `__init__.py` files are skipped, so
submodules load straight from the unpacked files) and puts five stand-ins into `sys.modules`
(see STUBS below), none of which the cache's match/insert/lock/evict code calls with the
default settings (KV events and metrics off). Everything the timed loop runs (radix_cache.py,
base_prefix_cache.py, cache_init_params.py, events.py, mem_cache/utils.py, evict_policy.py,
allocator/base.py) is SGLang's unmodified source, imported from `--sglang-path`.

Two call sequences per request (prompt, full), page size 1, one request at a time:

  minimal    the same five operations as bench_radix.run_stream, in SGLang's API:
             match_prefix(RadixKey(prompt, limit=len(prompt)-1)); inc_lock_ref(node);
             evict_for_alloc(shortfall) if the allocator is short; alloc(unmatched tokens of
             full); kv = cat(path_device_indices(node)[:prefix], new);
             insert(RadixKey(full), kv); free_segment(kv[prefix:insert.prefix_len]);
             dec_lock_ref(node)
  scheduler  what SGLang 0.5.23's scheduler calls for a request that is prefilled in one chunk
             and then finishes: match_kv_cache-style match; lock(); prefix_device_indices();
             evict + alloc of the prompt's extension; row write; checkpoint(up_to=len(prompt))
             after prefill (checkpoint_kv_cache); evict + alloc of the output tokens (in one go,
             where the real decode loop allocates one token per step); then
             release_kv_cache(checkpoint=True) = checkpoint(up_to=len(full)) + unlock().
             checkpoint() is SGLang's own method: insert + a second insert splitting the leaf at
             the prompt boundary, free of duplicates, re-match, path_device_indices, row write,
             unlock + re-lock.

The allocator and the request-to-token pool are minimal fakes (SGLang's TokenToKVPoolAllocator
frees with torch.cat over the whole free list, an O(capacity) copy per free on a CPU tensor that
is a device-side op on a GPU server; the fake keeps a free stack instead). Token ids are converted
to array('q') before the clock starts, since SGLang's Req holds them that way already.
"""

from __future__ import annotations

import argparse
import ast
import gc
import os
import sys
import time
import types
from array import array
from typing import Iterable, Sequence

SGLANG_VERSION = "0.5.23"
DEFAULT_SGLANG_PATH = f"/work/sglang_ref/sglang-{SGLANG_VERSION}"

# sys.modules stand-ins, and why each is needed (filled in by load_sglang()).
STUBS = {
    "sglang.kernels.ops.kvcache.mla_buffer":
        "GPU MLA kv-buffer kernels that mem_cache/utils.py re-exports; importing them pulls the "
        "JIT/triton kernel tree. Functions here raise if called; RadixCache never calls them.",
    "sglang.srt.mem_cache.memory_pool":
        "real module imports triton, CUDA kernels, model layers; base_prefix_cache only needs "
        "the name ReqToTokenPool for a Protocol annotation (a placeholder class).",
    "sglang.srt.observability.metrics_collector":
        "pulls server_args / forward_batch_info; used only by init_metrics_collector(), which "
        "runs only with enable_metrics=True (off here, as by default).",
    "sglang.srt.disaggregation.kv_events":
        "needs zmq and the network utils; the event classes are used only when "
        "enable_kv_cache_events=True (off here, as by default: every record_* returns early).",
    "sglang.srt.utils.common":
        "4,000+ line module needing orjson, psutil, pybase64, starlette...; radix_cache.py "
        "imports only ceil_align from it, so the stand-in holds SGLang's own ceil_align and "
        "ceil_div, compiled from that file's source (not a rewrite).",
}
# Packages registered without running their __init__.py (which import the whole server).
BARE_PACKAGES = ("sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.mem_cache",
                 "sglang.srt.mem_cache.allocator")

_loaded: dict[str, types.SimpleNamespace] = {}


def load_sglang(sglang_path: str = DEFAULT_SGLANG_PATH) -> types.SimpleNamespace:
    """Import SGLang's radix_cache from `sglang_path` (unpacked wheel) with the stubs above."""
    root = os.path.abspath(sglang_path)
    if root in _loaded:
        return _loaded[root]
    if _loaded:
        raise RuntimeError("a different SGLang tree is already loaded in this process")
    rc_file = os.path.join(root, "sglang", "srt", "mem_cache", "radix_cache.py")
    if not os.path.isfile(rc_file):
        raise FileNotFoundError(f"{rc_file} not found; see this module's docstring")
    for name in list(sys.modules):
        if name == "sglang" or name.startswith("sglang."):
            raise RuntimeError(f"{name} is already imported; run in a fresh process")
    sys.path.insert(0, root)

    def bare_package(name: str) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__path__ = [os.path.join(root, *name.split("."))]
        m.__package__ = name
        sys.modules[name] = m
        return m

    def stub(name: str, **attrs) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__doc__ = "radixserve stand-in: " + STUBS[name]
        m.__dict__.update(attrs)
        sys.modules[name] = m
        return m

    def unavailable(name: str):
        def f(*_a, **_k):
            raise RuntimeError(f"{name} is stubbed out by scripts/sglang_radix_ref.py")
        f.__name__ = name
        return f

    class Placeholder:
        """Stand-in class for names used only in annotations or disabled code paths."""

    for pkg in BARE_PACKAGES:
        bare_package(pkg)

    # mem_cache/utils.py: `from sglang.kernels.ops.kvcache.mla_buffer import (...)`
    src = open(os.path.join(root, "sglang", "srt", "mem_cache", "utils.py")).read()
    mla_names = sorted({a.name for n in ast.parse(src).body if isinstance(n, ast.ImportFrom)
                        and n.module == "sglang.kernels.ops.kvcache.mla_buffer"
                        for a in n.names})
    stub("sglang.kernels.ops.kvcache.mla_buffer", **{n: unavailable(n) for n in mla_names})
    stub("sglang.srt.mem_cache.memory_pool", ReqToTokenPool=Placeholder, KVCache=Placeholder)
    stub("sglang.srt.observability.metrics_collector",
         STAT_LOGGER_ROLE_RADIX_CACHE="radix_cache",
         RadixCacheMetricsCollector=Placeholder,
         radix_cache_metric_labels=unavailable("radix_cache_metric_labels"),
         resolve_collector_class=unavailable("resolve_collector_class"))
    stub("sglang.srt.disaggregation.kv_events",
         AllBlocksCleared=Placeholder, BlockRemoved=Placeholder, BlockStored=Placeholder,
         StorageMedium=Placeholder,
         kv_event_namespace_seed=unavailable("kv_event_namespace_seed"),
         namespaced_block_hash=unavailable("namespaced_block_hash"))
    common_path = os.path.join(root, "sglang", "srt", "utils", "common.py")
    wanted = {"ceil_align", "ceil_div"}
    tree = ast.parse(open(common_path).read(), common_path)
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert {n.name for n in defs} == wanted, "ceil_align/ceil_div not found in utils/common.py"
    common = stub("sglang.srt.utils.common")
    common.__file__ = common_path
    exec(compile(ast.Module(body=defs, type_ignores=[]), common_path, "exec"), common.__dict__)

    import importlib
    alloc_base = importlib.import_module("sglang.srt.mem_cache.allocator.base")
    sys.modules["sglang.srt.mem_cache.allocator"].BaseTokenToKVPoolAllocator = (
        alloc_base.BaseTokenToKVPoolAllocator)
    rc = importlib.import_module("sglang.srt.mem_cache.radix_cache")
    bpc = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
    cip = importlib.import_module("sglang.srt.mem_cache.cache_init_params")
    for mod in (rc, bpc, cip, alloc_base):
        assert os.path.abspath(mod.__file__).startswith(root), mod.__file__
    ns = types.SimpleNamespace(
        root=root, radix_cache=rc, RadixCache=rc.RadixCache, RadixKey=rc.RadixKey,
        CacheInitParams=cip.CacheInitParams, MatchPrefixParams=bpc.MatchPrefixParams,
        InsertParams=bpc.InsertParams, EvictParams=bpc.EvictParams,
        BaseTokenToKVPoolAllocator=alloc_base.BaseTokenToKVPoolAllocator)
    ns.FakeAllocator = _make_fake_allocator(ns.BaseTokenToKVPoolAllocator)
    _loaded[root] = ns
    return ns


def _make_fake_allocator(base):
    import torch

    class FakeTokenAllocator(base):
        """Page-size-1 slot allocator: a free stack of int64 slot ids on the CPU.

        Same contract as SGLang's TokenToKVPoolAllocator (slots 1..size, alloc(n) -> int64
        tensor or None, free(tensor), available_size()); free_segment() and the rest are the
        real BaseTokenToKVPoolAllocator's. A double free overflows the stack and asserts.
        """

        def __init__(self, size: int):
            super().__init__(size, 1, torch.float16, "cpu", None, False)
            self.clear()

        def clear(self):
            self._stack = torch.arange(1, self.size + 1, dtype=torch.int64)
            self._top = self.size
            self.free_group = None

        def available_size(self):
            return self._top

        def alloc(self, need_size: int):
            top = self._top
            if need_size > top:
                return None
            self._top = top - need_size
            return self._stack[top - need_size:top].clone()

        def free(self, free_index):
            n = free_index.numel()
            if n == 0:
                return
            top = self._top
            assert top + n <= self.size, "double free"
            self._stack[top:top + n] = free_index
            self._top = top + n

    return FakeTokenAllocator


class FakeReqToTokenPool:
    """One request row (one request at a time), int32 like SGLang's ReqToTokenPool."""

    def __init__(self, max_context_len: int):
        import torch
        self.req_to_token = torch.zeros((1, max_context_len), dtype=torch.int32)

    def write(self, indices, values):          # = ReqToTokenPool.write
        self.req_to_token[indices] = values


class _KV:
    __slots__ = ("req_pool_idx", "cache_protected_len", "cache_inserted_len", "swa_evict_floor")

    def __init__(self):
        self.req_pool_idx = 0
        self.cache_protected_len = 0
        self.cache_inserted_len = 0
        self.swa_evict_floor = 0


class _Req:
    """The Req fields RadixCache.checkpoint() and match_kv_cache() read or write."""
    __slots__ = ("kv", "origin_input_ids", "full_untruncated_fill_ids", "extra_key",
                 "cache_salt", "priority", "lock", "last_node", "prefix_len")

    def __init__(self, prompt):
        self.kv = _KV()
        self.origin_input_ids = prompt
        self.full_untruncated_fill_ids = prompt
        self.extra_key = None
        self.cache_salt = None
        self.priority = None
        self.lock = None
        self.last_node = None
        self.prefix_len = 0


def run_sglang_stream(stream: Sequence[tuple[Sequence[int], Sequence[int]]],
                      capacity_tokens: int, sglang_path: str = DEFAULT_SGLANG_PATH,
                      mode: str = "minimal", policy: str = "lru") -> dict:
    """Run SGLang's RadixCache over `stream` [(prompt, full)] with `capacity_tokens` KV slots.

    Returns {"seconds", "cpu_seconds", "requests", "ops", "hit_rate", "hit_tokens",
    "query_tokens", "evicted", "nodes", "cached_tokens", "mode", "sglang_version"}.
    """
    if mode not in ("minimal", "scheduler"):
        raise ValueError(mode)
    sg = load_sglang(sglang_path)
    import torch

    # Its index tensors (at most a prompt's slots) gain nothing from intra-op threads, and
    # on a busy machine OpenMP's spinning helpers would bill SGLang for time it does not
    # need (~8x its CPU time at load 8 on 2 cores): one thread, as a fair floor.
    torch.set_num_threads(1)
    RadixKey, MatchPrefixParams = sg.RadixKey, sg.MatchPrefixParams
    InsertParams, EvictParams = sg.InsertParams, sg.EvictParams
    # SGLang's Req keeps token ids as array('q'); convert before the clock starts.
    arrays = [(a if isinstance(a, array) else array("q", a),
               b if isinstance(b, array) else array("q", b)) for a, b in stream]
    max_len = max(len(b) for _, b in arrays)
    allocator = sg.FakeAllocator(capacity_tokens)
    pool = FakeReqToTokenPool(max_len)
    tree = sg.RadixCache(sg.CacheInitParams(
        disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=allocator,
        page_size=1, eviction_policy=policy))
    evicted = 0
    hit = query = 0
    ops = 0

    def evict_for(n: int) -> None:             # BaseTokenToKVPoolAllocator.evict_to_free_tokens
        nonlocal evicted
        shortfall = n - allocator.available_size()
        if shortfall > 0 and tree.supports_prefix_sharing():
            evicted += tree.evict_for_alloc(EvictParams(num_tokens=shortfall)).num_tokens_evicted

    clock = time.perf_counter
    cpu0 = time.thread_time()
    t0 = clock()
    if mode == "minimal":
        for prompt, full in arrays:
            limit = len(prompt) - 1
            m = tree.match_prefix(MatchPrefixParams(key=RadixKey(prompt, None, limit=limit)))
            node, plen = m.last_device_node, m.device_prefix_len
            query += limit
            hit += plen
            tree.inc_lock_ref(node)
            n = len(full) - plen
            evict_for(n)
            new = allocator.alloc(n)
            kv = torch.cat((tree.path_device_indices(node)[:plen], new)) if plen else new
            r = tree.insert(InsertParams(key=RadixKey(full, None), value=kv))
            if r.prefix_len > plen:             # cache_finished_req: kv[protected:new_prefix]
                allocator.free_segment(kv[plen:r.prefix_len], start_pos=plen)
            tree.dec_lock_ref(node)
            ops += 5
    else:
        write = pool.write
        empty = torch.empty((0,), dtype=torch.int64)
        for prompt, full in arrays:
            req = _Req(prompt)
            # Req.init_next_round_input -> match_kv_cache -> _req_radix_key
            limit = max(len(prompt) - 1, 0)
            tail = tree.swa_reprefill_tail_tokens(req)
            if tail:
                limit = min(limit, max(0, len(prompt) - tail))
            m = tree.match_prefix(MatchPrefixParams(
                key=RadixKey(token_ids=prompt, extra_key=None, limit=limit, cache_salt=None),
                cow_mamba=False, req=req))
            req.prefix_len = plen = m.device_prefix_len
            req.last_node = m.last_device_node
            req.kv.cache_protected_len = plen
            query += limit
            hit += plen
            # PrefillAdder._commit_prefill_admission
            req.lock = tree.lock(req.last_node)
            # alloc_for_extend: prefix from the tree, extend slots, row write
            prefix = tree.prefix_device_indices(req) if plen else empty
            n = len(prompt) - plen
            evict_for(n)
            out = allocator.alloc(n)
            write((0, slice(0, plen)), prefix)
            write((0, slice(plen, len(prompt))), out)
            # process_batch_result_prefill -> checkpoint_kv_cache
            tree.checkpoint(req, up_to=len(prompt))
            req.prefix_len = len(prompt)
            # decode: the output tokens' slots (one per step in SGLang; one call here)
            n = len(full) - len(prompt)
            evict_for(n)
            out = allocator.alloc(n)
            write((0, slice(len(prompt), len(full))), out)
            # finish -> release_kv_cache(checkpoint=True)
            req.full_untruncated_fill_ids = full
            tree.checkpoint(req, up_to=len(full))
            assert req.kv.cache_protected_len == len(full)   # free_kv_row range is empty
            tree.unlock(req.lock)
            req.lock = None
            ops += 7    # match, lock, alloc, checkpoint(prefill), alloc, checkpoint, unlock
    elapsed = clock() - t0
    cpu = time.thread_time() - cpu0

    cached = tree.total_size()
    assert tree.protected_size() == 0, "a lock leaked"
    assert tree.evictable_size() == cached, (tree.evictable_size(), cached)
    assert allocator.available_size() + cached == capacity_tokens, "slot leak"
    nodes = 0
    stack = [tree.root_node]
    while stack:
        x = stack.pop()
        nodes += 1
        stack.extend(x.children.values())
    return {"seconds": elapsed, "cpu_seconds": cpu, "requests": len(arrays), "ops": ops,
            "hit_rate": hit / max(1, query), "hit_tokens": hit, "query_tokens": query,
            "evicted": evicted, "nodes": nodes - 1, "cached_tokens": cached, "mode": mode,
            "sglang_version": SGLANG_VERSION}


def main(argv: Iterable[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sglang-path", default=DEFAULT_SGLANG_PATH,
                    help="root of the unpacked sglang wheel (holds sglang/srt/...)")
    ap.add_argument("--modes", default="minimal,scheduler")
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--fresh-ints", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_radix import make_stream

    load_sglang(args.sglang_path)                # import cost outside any timing
    groups, prompts, system, question, output = 64, 16, 2048, 128, 256
    stream = make_stream(groups, prompts, system, question, output, args.seed, args.fresh_ints)
    total = groups * system + groups * prompts * (question + output)
    gc.collect()
    gc.freeze()
    print(f"SGLang {SGLANG_VERSION} RadixCache ({args.sglang_path}), page size 1, policy "
          f"{args.policy}; stream: {len(stream)} requests, {total} distinct tokens, one pass")
    print(f"{'mode':>9} {'capacity':>9} {'us/req':>8} {'cpu us':>7} {'hit rate':>8} "
          f"{'evicted':>9} {'nodes':>6}")
    for mode in args.modes.split(","):
        for cap_name in ("fits", 200_000):
            cap = total + 4096 if cap_name == "fits" else cap_name
            r = run_sglang_stream(stream, cap, args.sglang_path, mode, args.policy)
            print(f"{mode:>9} {str(cap_name):>9} {r['seconds'] / r['requests'] * 1e6:>8.1f} "
                  f"{r['cpu_seconds'] / r['requests'] * 1e6:>7.1f} {r['hit_rate']:>8.3f} "
                  f"{r['evicted']:>9} {r['nodes']:>6}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
