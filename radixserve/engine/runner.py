"""ModelRunner: owns the weights, the KV pool and the attention backend; runs one step.

`execute` is the engine's only blocking call and runs in a worker thread: it reads the
StepBatch (a snapshot), writes K/V into pages the scheduler reserved, and samples.
"""

from __future__ import annotations

import logging

import torch

from radixserve.attention.backend import create_backend
from radixserve.attention.metadata import build_metadata
from radixserve.cache.kv_pool import KVPool
from radixserve.engine.batch import StepBatch
from radixserve.engine.config import EngineConfig
from radixserve.engine.sampler import SampleResult, Sampler
from radixserve.model import LoadedModel

log = logging.getLogger(__name__)

CPU_KV_BUDGET_BYTES = 4 << 30       # default pool on CPU when --kv-cache-tokens is unset


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was requested but torch sees no CUDA device")
    return torch.device(name)


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel):
        self.config = config
        self.loaded = loaded
        self.model = loaded.model
        mc = loaded.config
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        self.page_size = config.page_size
        num_pages = self._num_pages(mc)
        self.kv_pool = KVPool(mc.num_layers, num_pages, config.page_size, mc.num_kv_heads,
                              mc.head_dim, self.dtype, self.device)
        self.backend = create_backend(config.attention_backend, num_qo_heads=mc.num_heads,
                                      num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
                                      dtype=self.dtype, device=self.device)
        self.sampler = Sampler()

    def _num_pages(self, mc) -> int:
        if self.config.kv_cache_tokens is not None:
            if self.config.kv_cache_tokens < self.page_size:
                raise ValueError("--kv-cache-tokens must hold at least one page")
            return self.config.kv_cache_tokens // self.page_size
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * self.config.kv_cache_memory_fraction
        else:
            budget = CPU_KV_BUDGET_BYTES
        return KVPool.pages_for_budget(budget, mc.num_layers, self.page_size, mc.num_kv_heads,
                                       mc.head_dim, self.dtype)

    @property
    def num_pages(self) -> int:
        return self.kv_pool.num_pages

    def copy_prefix(self, src_page: int, dst_page: int, num_tokens: int) -> None:
        self.kv_pool.copy_prefix(src_page, dst_page, num_tokens)

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> SampleResult:
        meta = build_metadata(batch.spans, self.page_size, self.device)
        prepared = self.backend.prepare(meta)
        input_ids = torch.tensor(batch.input_ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(batch.positions, dtype=torch.long, device=self.device)
        ends = meta.qo_indptr[1:].to(torch.long) - 1
        logits_indices = ends[torch.tensor(batch.sample_rows, dtype=torch.long)].to(self.device)
        if not batch.sample_rows:
            self.model(input_ids, positions, meta, self.backend, prepared, self.kv_pool,
                       logits_indices=logits_indices)
            return SampleResult(token_ids=[], logprobs=[])
        logits = self.model(input_ids, positions, meta, self.backend, prepared, self.kv_pool,
                            logits_indices=logits_indices)
        return self.sampler.sample(logits, batch.sample_params, batch.generators)
