"""`radixserve replay --model-layout`: the window-aware tree against a full-KV tree at the
same bytes, on the server's own cache code.

A layout is a model's layer groups (what `radixserve plan` reads: a short name, a model
directory, a .gguf or a config.json), bf16 KV. For each capacity C (tokens of KV in every
layer) the trace is replayed twice: a full-KV tree of C tokens (C x the bytes of a token in
every layer), and the window-aware tree (cache/window_memory.py, WindowedMemory with the
server's WindowRule) given the same bytes, split into full-attention and windowed pages by
`kv_sizing.window_pools`, the function the server sizes its pools with. Each point reports
both token hit rates and the bytes each layer group holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.window_memory import WindowedMemory
from radixserve.cache.window_rule import WindowRule
from radixserve.kv_sizing import (DEFAULT_CHECKPOINT_WINDOWS, KVFormat, LayerGroup,
                                  layer_groups, window_pools)

from .replayer import ReplayConfig, ReplayStats, replay
from .report import human_tokens
from .sweep import SweepOptions, prepare, progress_bar

__all__ = ["LayoutPoint", "LayoutReport", "ModelLayout", "format_layout_table",
           "read_layout", "run_layout_sweep"]


@dataclass(frozen=True, slots=True)
class ModelLayout:
    name: str
    groups: tuple[LayerGroup, ...]

    @property
    def window(self) -> int:
        """The window the windowed pool keeps: the largest of the layers'."""
        return max(g.window for g in self.groups if g.window is not None)

    @property
    def bytes_per_token(self) -> int:
        return sum(g.bytes_per_token for g in self.groups)


def read_layout(model: str) -> ModelLayout:
    """The layer groups of MODEL (as `radixserve plan` takes it), bf16 KV; ValueError when
    it has no windowed layers (or MLA's latent pages)."""
    from radixserve.planner.model_spec import PlanInputError, read_model_spec

    try:
        spec = read_model_spec(model)
    except PlanInputError as exc:
        raise ValueError(f"--model-layout: {exc}") from None
    windows = {w for w in spec.layer_windows if w is not None}
    if not windows or spec.mla is not None:
        raise ValueError(f"--model-layout {model}: a window-aware layout needs layers with "
                         f"a sliding window and no MLA")
    groups = layer_groups(KVFormat("bfloat16", "bfloat16"), spec.layer_windows,
                          spec.num_kv_heads, spec.head_dim)
    return ModelLayout(spec.name, tuple(groups))


@dataclass(slots=True)
class LayoutPoint:
    capacity_tokens: int            # tokens of KV in every layer (the full-KV tree)
    policy: str
    kv_bytes: int                   # both trees' budget
    full_kv: ReplayStats
    window_aware: ReplayStats
    full_kv_group_bytes: dict[str, int]
    window_aware_group_bytes: dict[str, int]

    @property
    def over_budget(self) -> bool:
        """The windowed pool's floor (one whole request) took the window-aware tree past
        the budget: not a same-bytes comparison."""
        return sum(self.window_aware_group_bytes.values()) > self.kv_bytes

    @property
    def hit_ratio(self) -> float:
        """The window-aware tree's token hit rate over the full-KV tree's."""
        full = self.full_kv.token_hit_rate
        return self.window_aware.token_hit_rate / full if full else 1.0

    def to_dict(self) -> dict:
        return {"capacity_tokens": self.capacity_tokens, "policy": self.policy,
                "kv_bytes": self.kv_bytes, "full_kv": self.full_kv.to_dict(),
                "window_aware": self.window_aware.to_dict(), "hit_ratio": self.hit_ratio,
                "over_budget": self.over_budget,
                "full_kv_group_bytes": self.full_kv_group_bytes,
                "window_aware_group_bytes": self.window_aware_group_bytes}


@dataclass(slots=True)
class LayoutReport:
    trace: str
    requests: int
    mode: str
    page_size: int
    layout: ModelLayout
    points: list[LayoutPoint] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"trace": self.trace, "requests": self.requests, "mode": self.mode,
                "page_size": self.page_size,
                "layout": {"name": self.layout.name,
                           "groups": [asdict(g) for g in self.layout.groups]},
                "points": [p.to_dict() for p in self.points]}


def _group_name(g: LayerGroup) -> str:
    return "full" if g.window is None else f"window {g.window}"


def _point(workload, config: ReplayConfig, layout: ModelLayout, space, progress) -> LayoutPoint:
    ps, cap = space.page_size, config.capacity_tokens
    kv_bytes = cap * layout.bytes_per_token
    full = replay(workload, config, progress)
    longest = max(p + o for p, o in workload.lengths())
    # The replay computes a request whole (no prefill chunks, no sliding while it runs):
    # the windowed pool's floor is then one whole request.
    pools = window_pools(layout.groups, page_size=ps, kv_cache_tokens=None, budget=kv_bytes,
                         max_model_len=longest, chunk_tokens=longest)
    # The rule in the tree's keys: block mode writes each page as tree_page_size keys.
    per_page = space.tree_page_size
    window_pages = -(-layout.window // ps)
    rule = WindowRule(window_pages * per_page, per_page,
                      window_pages * DEFAULT_CHECKPOINT_WINDOWS * per_page)

    def memory(num_pages: int, tree: RadixCache) -> WindowedMemory:
        return WindowedMemory(num_pages, tree, pools.window_pages, rule)

    aware = replay(workload, ReplayConfig(pools.full_pages * ps, config.policy,
                                          config.concurrency, config.warmup_fraction,
                                          config.check_every),
                   progress, memory=memory)
    aware_bytes = {_group_name(g): ps * g.bytes_per_token
                   * (pools.full_pages if g.window is None else pools.window_pages + 1)
                   for g in layout.groups}
    return LayoutPoint(cap, config.policy, kv_bytes, full, aware,
                       {_group_name(g): cap * g.bytes_per_token for g in layout.groups},
                       aware_bytes)


def run_layout_sweep(opts: SweepOptions, layout: ModelLayout,
                     warn: Callable[[str], None] = lambda _: None) -> LayoutReport:
    if any(cap is None for cap in opts.capacities):
        raise ValueError("--model-layout compares at the same bytes: give a finite "
                         "--capacity-tokens")
    if "belady" in opts.policies:
        raise ValueError("--model-layout runs the server's policies (lru, ...), not belady")
    prep = prepare(opts, warn)
    workload = prep.workload
    grid = [(cap, pol) for cap in opts.capacities for pol in opts.policies]
    bar = progress_bar(opts.progress, 2 * len(grid) * len(workload), "layout")
    report = LayoutReport(opts.trace, len(workload), prep.mode, prep.page_size, layout)
    try:
        for cap, pol in grid:
            config = ReplayConfig(cap, pol, opts.concurrency, opts.warmup_fraction,
                                  opts.check_every)
            report.points.append(_point(workload, config, layout, workload.space,
                                        bar.update if bar is not None else None))
    finally:
        if bar is not None:
            bar.close()
    return report


def format_layout_table(report: LayoutReport) -> str:
    head = (f"{'capacity':>9} {'policy':>6} {'KV MiB':>9} {'full-KV hit':>11} "
            f"{'window hit':>10} {'ratio':>6}  bytes per group (full-KV tree | window-aware)")
    lines = [f"trace {report.trace}: {report.requests:,d} requests, {report.mode} mode, "
             f"page size {report.page_size}; layout {report.layout.name}: " + ", ".join(
                 f"{_group_name(g)}: {g.num_layers} layers, {g.bytes_per_token:,d} B/token"
                 for g in report.layout.groups), head, "-" * len(head)]
    for p in report.points:
        groups = "; ".join(f"{k} {p.full_kv_group_bytes[k] / 2**20:,.2f} | "
                           f"{p.window_aware_group_bytes[k] / 2**20:,.2f} MiB"
                           for k in p.full_kv_group_bytes)
        lines.append(f"{human_tokens(p.capacity_tokens):>9} {p.policy:>6} "
                     f"{p.kv_bytes / 2**20:9,.2f} {p.full_kv.token_hit_rate:11.2%} "
                     f"{p.window_aware.token_hit_rate:10.2%} {p.hit_ratio:6.3f}"
                     f"{'*' if p.over_budget else ' '} {groups}")
    lines.append("capacity: tokens of KV in every layer for the full-KV tree; the window-aware "
                 "tree gets the same bytes, split as the server splits its pools")
    if any(p.over_budget for p in report.points):
        lines.append("*: the windowed pool's floor (one whole request of the trace) took the "
                     "window-aware tree past the budget: not a same-bytes point")
    return "\n".join(lines)
