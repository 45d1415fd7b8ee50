"""ModelRunner: owns the weights, the KV pool and the attention backend; runs one step.

`execute` is the engine's only blocking call and runs in a worker thread: it reads the
StepBatch (a snapshot), writes K/V into pages the scheduler reserved, and samples.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Sequence

import numpy as np
import torch

from radixserve.attention.backend import create_backend
from radixserve.attention.context import ForwardContext
from radixserve.attention.metadata import SeqSpan, build_metadata
from radixserve.attention.kv_pool import KVPool
from radixserve.attention.kv_quant import describe_kv_cache
from radixserve.attention.kv_tiers import HostKVPool, PageWriter, TierMover
from radixserve.attention.page_bytes import bytes_to_pages, pages_to_bytes
from radixserve.attention.window_kv import WindowedKV
from radixserve.cache.tier_types import MoveTimes
from radixserve.engine.batch import SampleResult, StepBatch, StepResult
from radixserve.engine.config import EngineConfig
from radixserve.engine.host_memory import keep_freed_host_memory
from radixserve.engine.lone_decode import lone_decode_inputs
from radixserve.engine.latent_setup import (describe_latent_cache, latent_attention,
                                            latent_token_bytes)
from radixserve.engine.sampler import Sampler
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.window_setup import group_pools, pool_window
from radixserve.kv_sizing import (KVFormat, budget_bytes, layer_groups, pool_pages,
                                  resolve_kv_format)
from radixserve.model import LoadedModel
from radixserve.model.invariant_ops import row_invariant_model

log = logging.getLogger(__name__)


def cuda_free_bytes(device: torch.device) -> int:
    """Free memory on a CUDA device, after handing torch's cached blocks back: blocks the
    caching allocator holds but does not use (weight loading leaves some) would otherwise
    count as taken and shrink the pool."""
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    return free


def kv_pool_pages(config: EngineConfig, mc, device: torch.device,
                  kv_format: KVFormat | torch.dtype) -> int:
    """Pool size: --kv-cache-tokens if given; on CUDA a fraction of the memory still free
    once the weights are loaded (the runner is built after them); else a fixed CPU budget.
    The arithmetic is `radixserve.kv_sizing`'s, shared with `radixserve plan`."""
    if isinstance(kv_format, torch.dtype):
        kv_format = KVFormat(str(kv_format), str(kv_format))
    free = None
    if device.type == "cuda" and config.kv_cache_tokens is None:
        free = cuda_free_bytes(device)
    budget = budget_bytes(device.type, free, config.kv_cache_memory_fraction)
    token_bytes = (latent_token_bytes(mc, kv_format) if mc.mla is not None else
                   kv_format.token_bytes(mc.num_layers, mc.num_kv_heads, mc.head_dim))
    return pool_pages(token_bytes=token_bytes,
                      page_size=config.page_size, kv_cache_tokens=config.kv_cache_tokens,
                      budget=budget)


def logits_rows(qo_lens: Sequence[int], sample_rows: Sequence[int]) -> np.ndarray:
    """Row of the flat step batch holding each sampled span's last token."""
    ends = np.cumsum(np.asarray(qo_lens, dtype=np.int64)) - 1
    return ends[np.asarray(sample_rows, dtype=np.int64)]


def to_device(values, device: torch.device) -> torch.Tensor:
    """int64 host data -> `device`. On CUDA through pinned memory with a non-blocking copy:
    a copy from pageable memory may block the host until the stream is idle."""
    t = torch.as_tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel):
        self.config = config
        self.loaded = loaded
        # Deterministic mode: the same weights behind row-invariant linears (a copy of the
        # module tree; `loaded.model` itself is left as it is for other engines).
        self.model = (row_invariant_model(loaded.model) if config.deterministic
                      else loaded.model)
        mc = loaded.config
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        self.page_size = config.page_size
        if self.device.type == "cpu":
            keep_freed_host_memory()
        self.kv_format = resolve_kv_format(config.kv_cache_dtype, config.kv_cache_dtype_k,
                                           config.kv_cache_dtype_v,
                                           str(self.dtype).removeprefix("torch."))
        # Full vs sliding-window layers: with per-group pools (hybrid models) the windowed
        # layers get their own pool, backend and page map (`windowed`); else one full pool.
        self.layer_groups = layer_groups(self.kv_format, mc.windows, mc.num_kv_heads,
                                         mc.head_dim)
        self.window = pool_window(config, mc.windows)
        self.windowed: WindowedKV | None = None
        if mc.mla is not None:      # DeepSeek: latent pages and an MLA backend
            num_pages = kv_pool_pages(config, mc, self.device, self.kv_format)
            self.kv_pool, self.backend = latent_attention(config, mc, num_pages, self.dtype,
                                                          self.device, self.kv_format)
        else:
            self._full_and_windowed_pools()
        self.sampler = Sampler()
        self.mover: TierMover | None = None     # host/disk tiers (attach_tiers)
        self.share_publisher = None             # --kv-share: PeerShare's publisher thread
        self.compiled_decode = self._compiled_decode()   # --decode-compile

    def _compiled_decode(self):
        """The compiled lone step (loaded from the weights cache dir, or compiling in a
        child process), or None: --decode-compile off, a model it cannot serve, or hybrid
        pools (model/compiled_decode.py)."""
        c = self.config
        if c.decode_compile == "off" or self.windowed is not None \
                or self.loaded.config.mla is not None:
            return None
        from radixserve.model.compiled_decode import CompiledDecode
        from radixserve.model.weights_cache import WeightsCache
        cache_dir = WeightsCache.at(c.weights_cache_dir).directory
        compiled = CompiledDecode.create(
            c.decode_compile, self.loaded, self.kv_pool, cache_dir / "compiled",
            deterministic=c.deterministic,
            weights_cache_dir=None if c.no_weights_cache else str(cache_dir))
        if compiled is not None:
            compiled.start()
        return compiled

    def _full_and_windowed_pools(self) -> None:
        config, mc = self.config, self.loaded.config
        self.backend = self._backend(None if self.window is not None else mc.layer_windows)
        full_layers = None
        if self.window is None:
            num_pages = kv_pool_pages(config, mc, self.device, self.kv_format)
        else:
            pools = group_pools(config, self.layer_groups, mc.max_position_embeddings,
                                self._budget())
            num_pages = pools.full_pages
            full_layers = [i for i, w in enumerate(mc.windows) if w is None]
            win_layers = [i for i, w in enumerate(mc.windows) if w is not None]
            # Each windowed layer attends within its own window (several sizes share the
            # pool, which keeps the largest).
            win_backend = self._backend(mc.windows)
            self.windowed = WindowedKV(self._pool(pools.window_pages + 1, win_layers,
                                                  win_backend), win_backend, self.window)
        self.kv_pool = self._pool(num_pages, full_layers, self.backend)

    def _backend(self, layer_windows):
        c, mc = self.config, self.loaded.config
        return create_backend(c.attention_backend, num_qo_heads=mc.num_heads,
                              num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                              dtype=self.dtype, device=self.device, kv_format=self.kv_format,
                              deterministic=c.deterministic, sm_scale=mc.attention_scale,
                              layer_windows=layer_windows,
                              logits_soft_cap=mc.attn_logit_softcapping)

    def _pool(self, num_pages: int, layers, backend) -> KVPool:
        mc = self.loaded.config
        return KVPool(mc.num_layers, num_pages, self.page_size, mc.num_kv_heads, mc.head_dim,
                      self.dtype, self.device, kv_format=self.kv_format,
                      fixed_scale=backend.fixed_kv_scale, layers=layers)

    def _budget(self) -> float:
        free = None
        if self.device.type == "cuda" and self.config.kv_cache_tokens is None:
            free = cuda_free_bytes(self.device)
        return budget_bytes(self.device.type, free, self.config.kv_cache_memory_fraction)

    @property
    def window_pages(self) -> int:
        """Pages of the windowed pool (its null page not counted); 0 without one."""
        return self.windowed.pool.num_pages - 1 if self.windowed is not None else 0

    @property
    def kv_bytes(self) -> int:
        """Bytes of every KV pool."""
        extra = self.windowed.pool.total_bytes if self.windowed is not None else 0
        return self.kv_pool.total_bytes + extra

    def attach_tiers(self, host_pages: int, disk: PageWriter | None) -> None:
        """Host slots (pinned on CUDA) and the disk writer (its queue) the cache's tier
        moves use."""
        host = HostKVPool(self.kv_pool, host_pages) if host_pages else None
        self.mover = TierMover(self.kv_pool, host, disk, window_pool=(
            self.windowed.pool if self.windowed is not None else None))

    @property
    def num_pages(self) -> int:
        return self.kv_pool.num_pages

    def describe_kv_cache(self) -> str:
        mc = self.loaded.config
        if mc.mla is not None:
            return describe_latent_cache(self.kv_pool)
        return describe_kv_cache(self.kv_format, self.dtype, mc.num_layers, mc.num_kv_heads,
                                 mc.head_dim)

    def warm_up(self, pages: np.ndarray, num_tokens: int) -> None:
        """One throw-away prefill of `num_tokens` into `pages` (free pages lent by the caller).

        The first real steps otherwise pay for growing the host heap to a step's high-water
        mark (page faults: ~1 s over the first steps of scripts/bench_engine.py) and for
        creating the matmul kernels of a full-size step. vLLM and SGLang warm up likewise.
        """
        span = SeqSpan(pages, 0, num_tokens)
        batch = StepBatch(input_ids=[0] * num_tokens, positions=list(range(num_tokens)),
                          spans=[span], sample_rows=[0],
                          sample_params=[SamplingParams(max_tokens=1, temperature=0.0)],
                          generators=[None])
        self.execute(batch)

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> StepResult:
        """The step's tier moves (in issue order), then copy-on-write, the forward pass and
        sampling; what each took comes back with the samples."""
        # The worker thread starts on CUDA device 0: make the model's device current so
        # kernels that launch on the current device/stream (flashinfer's) use the right one.
        guard = (torch.cuda.device(self.device) if self.device.type == "cuda"
                 else contextlib.nullcontext())
        with guard:
            # tiers: demotions and loads, in issue order
            peer = batch.peer
            try:
                if peer is not None:        # pages to publish: read before anything below
                    for order in peer.publish:
                        self.share_publisher.submit(order.keys,
                                                    pages_to_bytes(self.kv_pool, order.pages),
                                                    order.release)
                moves = self.mover.run(batch.moves) if batch.moves else MoveTimes()
            finally:
                # Peer pages into pool pages taken after `moves`, even when a publish or a
                # move raised: they are in the tree already, and must never be read unfilled.
                if peer is not None:
                    for load in peer.loads:
                        bytes_to_pages(self.kv_pool, load.pages.tolist(), load.payloads)
            if not batch.spans:
                return StepResult(SampleResult(token_ids=[], logprobs=[]), moves)
            started = time.perf_counter()
            windowed = self.windowed
            compiled = self.compiled_decode
            if compiled is not None:
                compiled.poll()
                lone = (lone_decode_inputs(batch, self.page_size) if compiled.ready
                        and not batch.copies else None)
                if lone is not None:
                    logits = compiled.run(*lone)
                    result = self.sampler.sample(logits, batch.sample_params,
                                                 batch.generators, batch.matchers)
                    return StepResult(result, moves, time.perf_counter() - started)
            for order in batch.copies:      # copy-on-write pages this step computes into
                self.kv_pool.copy_prefix(order.src_page, order.dst_page, order.num_tokens)
                if windowed is not None:
                    windowed.copy_prefix(order.src_page, order.dst_page, order.num_tokens)
            meta = build_metadata(batch.spans, self.page_size, self.device)
            ctx = ForwardContext.prepare(
                self.backend, meta, self.kv_pool,
                windowed and windowed.prepare(batch.spans, self.page_size, self.device))
            input_ids = to_device(batch.input_ids, self.device)
            positions = to_device(batch.positions, self.device)
            logits_indices = to_device(logits_rows(meta.qo_lens, batch.sample_rows),
                                       self.device)
            logits = self.model(input_ids, positions, ctx, logits_indices)
            if not batch.sample_rows:
                result = SampleResult(token_ids=[], logprobs=[])
            else:
                result = self.sampler.sample(logits, batch.sample_params, batch.generators,
                                             batch.matchers)
            return StepResult(result, moves, time.perf_counter() - started)
