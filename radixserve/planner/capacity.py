"""Capacity arithmetic: KV bytes per token, the pool `radixserve serve` would allocate, and
what fits in it. The pool comes from `radixserve.kv_sizing`, the server's own sizing code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from radixserve.kv_sizing import (DEFAULT_KV_MEMORY_FRACTION, SCALE_BYTES, KVFormat,
                                  budget_bytes, kv_element, layer_groups, pool_pages,
                                  resolve_kv_format, window_pools)
from radixserve.planner.model_spec import ModelSpec, PlanInputError

WEIGHT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PLAN_AUTO_DTYPE = "bfloat16"     # what --dtype auto picks on GPUs and on CPUs with fast bf16


@dataclass(frozen=True)
class PlanOptions:
    context: int = 32768
    concurrency: int = 64
    memory_bytes: int | None = None       # GPU memory; None: the CPU sizing rule
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    kv_cache_dtype_k: str | None = None
    kv_cache_dtype_v: str | None = None
    page_size: int = 1
    kv_cache_tokens: int | None = None
    kv_cache_memory_fraction: float = DEFAULT_KV_MEMORY_FRACTION
    shared_prefix_tokens: int = 0


@dataclass
class Plan:
    model: str
    architecture: str
    attention: str                  # MHA / GQA / MQA / MLA
    served_by_radixserve: bool
    not_served_because: str | None
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    kv_format: str
    formula: str
    kv_bytes_per_token: int
    weights_dtype: str
    num_params: int
    params_source: str
    weight_bytes: int
    device: str
    memory_bytes: int | None
    kv_budget_bytes: float | None
    pool_pages: int
    pool_tokens: int
    pool_bytes: int
    page_size: int
    context: int
    concurrency: int
    max_concurrency_at_context: int
    max_context_at_concurrency: int
    model_context: int
    served_context: int | None
    sliding_windows: dict[str, int] = field(default_factory=dict)   # window -> layers
    window_aware_bytes_per_request: int | None = None
    window_aware_max_concurrency: int | None = None
    mla_uncompressed_bytes_per_token: int | None = None
    shared_prefix_tokens: int = 0
    shared_prefix_pages: int = 0
    shared_prefix_saved_bytes: int = 0
    max_concurrency_with_shared_prefix: int | None = None
    notes: list[str] = field(default_factory=list)
    # Full vs sliding-window layers: {"window": W or None, "num_layers", "bytes_per_token"}
    # (kv_sizing.layer_groups, as the server's runner groups them).
    layer_groups: list[dict] = field(default_factory=list)
    # One window size: the windowed layers' own pool (pages), beside pool_pages' page ids.
    window_pool_pages: int | None = None


def _kv_terms(spec: ModelSpec, fmt: KVFormat) -> tuple[int, str]:
    """(bytes per token, the formula with this model's numbers)."""
    k, v = fmt.elements
    if spec.mla is not None:
        latent = spec.mla
        scale = SCALE_BYTES if k.quantized else 0
        total = spec.num_layers * (latent.latent_dim * k.bytes + scale)
        text = (f"layers x (kv_lora_rank + qk_rope_head_dim) x bytes = {spec.num_layers} x "
                f"({latent.kv_lora_rank} + {latent.qk_rope_head_dim}) x {k.bytes}"
                + (f" + {spec.num_layers} x {scale} (scales)" if scale else ""))
        return total, f"{text} = {total:,} B"
    total = fmt.token_bytes(spec.num_layers, spec.num_kv_heads, spec.head_dim)
    dims = f"{spec.num_layers} layers x {spec.num_kv_heads} KV heads"
    if k == v and not k.quantized:
        text = (f"2 x layers x kv_heads x head_dim x bytes = 2 x {spec.num_layers} x "
                f"{spec.num_kv_heads} x {spec.head_dim} x {k.bytes}")
    else:
        parts = [f"({spec.head_dim} x {e.bytes}" + (f" + {SCALE_BYTES} scale" if e.quantized
                                                    else "") + ")" for e in (k, v)]
        text = f"{dims} x [K {parts[0]} + V {parts[1]}]"
    return total, f"{text} = {total:,} B"


def make_plan(spec: ModelSpec, opts: PlanOptions) -> Plan:
    for name in ("context", "concurrency", "page_size"):
        if getattr(opts, name) < 1:
            raise PlanInputError(f"--{name.replace('_', '-')} must be at least 1, got "
                                 f"{getattr(opts, name)}")
    if opts.shared_prefix_tokens < 0:
        raise PlanInputError("--shared-prefix-tokens must not be negative")
    dtype = PLAN_AUTO_DTYPE if opts.dtype == "auto" else opts.dtype
    if dtype not in WEIGHT_BYTES:
        raise PlanInputError(f"--dtype {opts.dtype!r}: choose auto, {', '.join(WEIGHT_BYTES)}")
    try:
        fmt = resolve_kv_format(opts.kv_cache_dtype, opts.kv_cache_dtype_k,
                                opts.kv_cache_dtype_v, dtype)
    except ValueError as exc:
        raise PlanInputError(str(exc)) from None
    token_bytes, formula = _kv_terms(spec, fmt)
    weight_bytes = spec.num_params * WEIGHT_BYTES[dtype]

    device = "cpu" if opts.memory_bytes is None else "cuda"
    free = None
    if opts.memory_bytes is not None and opts.kv_cache_tokens is None:
        free = opts.memory_bytes - weight_bytes
        if free <= 0:
            raise PlanInputError(
                f"{opts.memory_bytes / 2**30:.1f} GiB is too small for the weights alone "
                f"({weight_bytes / 2**30:.1f} GiB in {dtype})")
    try:
        budget = (None if opts.kv_cache_tokens is not None
                  else budget_bytes(device, free, opts.kv_cache_memory_fraction))
        pages = pool_pages(token_bytes=token_bytes, page_size=opts.page_size,
                           kv_cache_tokens=opts.kv_cache_tokens, budget=budget or 0)
    except ValueError as exc:
        raise PlanInputError(str(exc)) from None

    ps = opts.page_size
    pages_per_request = math.ceil(opts.context / ps)
    plan = Plan(
        model=spec.name, architecture=spec.architecture, attention=spec.attention_kind,
        served_by_radixserve=spec.unsupported is None, not_served_because=spec.unsupported,
        num_layers=spec.num_layers, num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, kv_format=fmt.describe(), formula=formula,
        kv_bytes_per_token=token_bytes, weights_dtype=dtype, num_params=spec.num_params,
        params_source=spec.params_source, weight_bytes=weight_bytes, device=device,
        memory_bytes=opts.memory_bytes, kv_budget_bytes=budget, pool_pages=pages,
        pool_tokens=pages * ps, pool_bytes=pages * ps * token_bytes, page_size=ps,
        context=opts.context, concurrency=opts.concurrency,
        max_concurrency_at_context=pages // pages_per_request,
        max_context_at_concurrency=(pages // opts.concurrency) * ps,
        model_context=spec.max_context, served_context=spec.served_context)
    _windows(spec, plan)
    if spec.mla is None:
        plan.layer_groups = [
            {"window": g.window, "num_layers": g.num_layers, "bytes_per_token": g.bytes_per_token}
            for g in layer_groups(fmt, spec.layer_windows, spec.num_kv_heads, spec.head_dim)]
    _window_pools(spec, plan, fmt, opts, budget)
    _shared_prefix(plan, opts.shared_prefix_tokens, pages_per_request)
    if spec.mla is not None:
        m = spec.mla        # without MLA: every head's key (nope + rope) and value
        plan.mla_uncompressed_bytes_per_token = (
            spec.num_layers * spec.num_heads * kv_element(fmt.k).bytes
            * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim))
    _notes(spec, plan)
    return plan


def _windows(spec: ModelSpec, plan: Plan) -> None:
    if not spec.windows:
        return
    for w in spec.windows:
        plan.sliding_windows[str(w)] = sum(1 for x in spec.layer_windows if x == w)
    layer_bytes = plan.kv_bytes_per_token // spec.num_layers
    plan.window_aware_bytes_per_request = layer_bytes * sum(
        min(plan.context, w or plan.context) for w in spec.layer_windows)
    plan.window_aware_max_concurrency = plan.pool_bytes // plan.window_aware_bytes_per_request


def _window_pools(spec: ModelSpec, plan: Plan, fmt: KVFormat, opts: PlanOptions,
                  budget: float | None) -> None:
    """Windowed layers: the server's per-group pools (kv_sizing.window_pools), the pool
    figures then being the full-attention page ids and both pools' bytes."""
    if spec.mla is not None or not spec.windows:
        return
    groups = layer_groups(fmt, spec.layer_windows, spec.num_kv_heads, spec.head_dim)
    try:
        pools = window_pools(groups, page_size=opts.page_size,
                             kv_cache_tokens=opts.kv_cache_tokens, budget=budget or 0,
                             max_model_len=spec.max_context)
    except ValueError as exc:
        raise PlanInputError(str(exc)) from None
    ps = opts.page_size
    plan.pool_pages = pools.full_pages
    plan.pool_tokens = pools.full_pages * ps
    plan.pool_bytes = pools.pool_bytes(groups, ps)
    plan.window_pool_pages = pools.window_pages
    plan.max_concurrency_at_context = pools.full_pages // math.ceil(opts.context / ps)
    plan.max_context_at_concurrency = (pools.full_pages // opts.concurrency) * ps


def _shared_prefix(plan: Plan, prefix: int, pages_per_request: int) -> None:
    """One copy of the prefix's full pages in the tree instead of one per request; the
    partial last page of the prefix is copied per request (copy-on-write)."""
    plan.shared_prefix_tokens = prefix
    if prefix <= 0:
        return
    shared = min(prefix, plan.context) // plan.page_size
    plan.shared_prefix_pages = shared
    plan.shared_prefix_saved_bytes = ((plan.concurrency - 1) * shared * plan.page_size
                                      * plan.kv_bytes_per_token)
    own = pages_per_request - shared
    free = plan.pool_pages - shared
    if own <= 0:
        plan.max_concurrency_with_shared_prefix = None   # unbounded by KV: no own pages
    else:
        plan.max_concurrency_with_shared_prefix = max(0, free // own)


def _notes(spec: ModelSpec, plan: Plan) -> None:
    if spec.unsupported:
        plan.notes.append(f"radixserve cannot serve this model ({spec.unsupported}); the "
                          f"figures are for planning a deployment elsewhere")
    if spec.mla is not None:
        plan.notes.append("MLA: the cache holds one latent per token and layer, shared by "
                          "all heads (what vLLM and SGLang store for DeepSeek models)")
    if spec.windows and spec.served_context is not None and spec.mla is None:
        plan.notes.append(
            "radixserve keeps the windowed layers in their own pool (--kv-window-pool auto): "
            "the full-attention pool above holds every token, the window pool the windows "
            "running requests and cached match points need (docs/models.md)"
            + (f"; windows {spec.windows} share it at the largest" if len(spec.windows) > 1
               else ""))
    if spec.served_context is not None and plan.context > spec.served_context:
        plan.notes.append(f"--context {plan.context} exceeds the {spec.served_context} "
                          f"tokens radixserve serves for this model")
    if plan.max_concurrency_at_context == 0:
        plan.notes.append(f"one request of {plan.context} tokens does not fit in the pool")
