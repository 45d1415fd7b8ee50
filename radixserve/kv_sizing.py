"""How many bytes a token's K/V take, and how many pages the KV pool gets: one answer.

`radixserve serve` (through the model runner) and `radixserve plan` both size the pool with
the functions here, so the planner's figures are the server's by construction. Torch-free:
the planner reads configs of models it never loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

CPU_KV_BUDGET_BYTES = 4 << 30       # the pool on CPU when --kv-cache-tokens is unset
DEFAULT_KV_MEMORY_FRACTION = 0.85   # CUDA: share of the memory free after the weights
SCALE_BYTES = 4                     # one float32 scale per token per KV head (8-bit formats)


@dataclass(frozen=True)
class KVElement:
    """One storage format for K or V."""
    name: str
    bytes: int
    quantized: bool     # 8-bit codes with a scale beside them


KV_ELEMENTS: dict[str, KVElement] = {e.name: e for e in (
    KVElement("float32", 4, False), KVElement("bfloat16", 2, False),
    KVElement("float16", 2, False), KVElement("fp8_e4m3", 1, True),
    KVElement("fp8_e5m2", 1, True), KVElement("int8", 1, True))}
KV_DTYPE_CHOICES = ("auto",) + tuple(KV_ELEMENTS)
_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
            "half": "float16", "fp8": "fp8_e4m3"}


def kv_element(name: str) -> KVElement:
    name = _ALIASES.get(str(name), str(name).removeprefix("torch."))
    try:
        return KV_ELEMENTS[name]
    except KeyError:
        raise ValueError(f"unknown KV cache dtype {name!r}; choose one of "
                         f"{', '.join(KV_DTYPE_CHOICES)}") from None


@dataclass(frozen=True)
class KVFormat:
    """Storage of keys and of values (K16/V8 is KVFormat("bfloat16", "fp8_e4m3"))."""
    k: str
    v: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "k", kv_element(self.k).name)
        object.__setattr__(self, "v", kv_element(self.v).name)

    @property
    def elements(self) -> tuple[KVElement, KVElement]:
        return kv_element(self.k), kv_element(self.v)

    @property
    def quantized(self) -> bool:
        return any(e.quantized for e in self.elements)

    def token_bytes(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes one token's K and V take across all layers, scales included."""
        return num_layers * num_kv_heads * sum(
            head_dim * e.bytes + (SCALE_BYTES if e.quantized else 0) for e in self.elements)

    def describe(self) -> str:
        return self.k if self.k == self.v else f"K {self.k}, V {self.v}"


def resolve_kv_format(kv_cache_dtype: str, k: str | None, v: str | None,
                      model_dtype: str) -> KVFormat:
    """--kv-cache-dtype, overridden per side by --kv-cache-dtype-k/-v; "auto": the model's
    working dtype (`model_dtype`, e.g. "bfloat16")."""
    def pick(side: str | None) -> str:
        name = side or kv_cache_dtype or "auto"
        return model_dtype if name == "auto" else name
    return KVFormat(pick(k), pick(v))


def budget_bytes(device_type: str, free_bytes: int | None, fraction: float) -> float:
    """The pool's byte budget when --kv-cache-tokens is unset: on CUDA `fraction` of the
    memory free once the weights are loaded, on CPU a fixed 4 GiB."""
    if device_type != "cuda":
        return CPU_KV_BUDGET_BYTES
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"--kv-cache-memory-fraction must be in (0, 1], got {fraction}")
    return (free_bytes or 0) * fraction


def pool_pages(*, token_bytes: int, page_size: int, kv_cache_tokens: int | None,
               budget: float) -> int:
    """Pages in the pool: --kv-cache-tokens // page_size if given, else whole pages in
    `budget` bytes. ValueError when not even one page fits."""
    if page_size < 1:
        raise ValueError(f"--page-size must be at least 1, got {page_size}")
    if kv_cache_tokens is not None:
        if kv_cache_tokens < page_size:
            raise ValueError("--kv-cache-tokens must hold at least one page")
        return kv_cache_tokens // page_size
    page_bytes = token_bytes * page_size
    if budget < page_bytes:
        raise ValueError(f"KV budget of {int(budget)} bytes is less than one page "
                         f"({page_bytes} bytes of {page_size} tokens)")
    return int(budget // page_bytes)


@dataclass(frozen=True)
class LayerGroup:
    """Layers sharing one attention window: full-attention layers need every token's K/V,
    sliding-window layers only their last `window` tokens (what per-group pools size)."""
    window: int | None          # None: full attention
    num_layers: int
    bytes_per_token: int        # K and V of one token across this group's layers

    @property
    def name(self) -> str:
        return "full attention" if self.window is None else f"sliding window {self.window}"


def layer_groups(fmt: KVFormat, layer_windows: Sequence[int | None], num_kv_heads: int,
                 head_dim: int) -> list[LayerGroup]:
    """The model's layers grouped by window: full attention first, then windows ascending.
    The groups' bytes per token sum to `fmt.token_bytes` over all layers."""
    windows = sorted(set(layer_windows), key=lambda w: -1 if w is None else w)
    groups = []
    for w in windows:
        n = sum(1 for x in layer_windows if x == w)
        groups.append(LayerGroup(w, n, fmt.token_bytes(n, num_kv_heads, head_dim)))
    return groups


DEFAULT_WINDOW_POOL_FRACTION = 0.09     # windowed pages per full-attention page (bench_hybrid.py)
DEFAULT_CHECKPOINT_WINDOWS = 16          # a checkpoint every 16 windows along a path


DEFAULT_PREFILL_CHUNK_TOKENS = 2048     # EngineConfig.chunked_prefill_size's default


@dataclass(frozen=True)
class GroupPools:
    """Pages of the per-group pools (window-aware cache): one page id space for the
    full-attention layers (the tree's pages) and a smaller pool for the sliding-window
    layers, which hold only the windows a running request or a match point needs."""
    full_pages: int
    window_pages: int

    def pool_bytes(self, groups: Sequence[LayerGroup], page_size: int) -> int:
        """Bytes of both pools, the windowed pool's all-zero null page included."""
        full = sum(g.bytes_per_token for g in groups if g.window is None)
        win = sum(g.bytes_per_token for g in groups if g.window is not None)
        return page_size * (self.full_pages * full + (self.window_pages + 1) * win)


def window_pool_floor(window: int, page_size: int, chunk_tokens: int,
                      max_model_len: int, checkpoint: int) -> int:
    """Windowed pages one request alone may need: its window, a prefill chunk and a page
    of look-ahead, plus the checkpoint windows along its own (locked) path."""
    pages = -(-(window + chunk_tokens) // page_size) + 2
    per_window = -(-window // page_size) + 1
    return pages + per_window * (max_model_len // max(checkpoint, 1) + 2)


def group_pool_pages(groups: Sequence[LayerGroup], *, page_size: int,
                     kv_cache_tokens: int | None, budget: float, fraction: float,
                     floor: int = 1) -> GroupPools:
    """Split the KV budget between the full-attention page ids and the windowed pool.

    --kv-cache-tokens T: T tokens of full-attention KV, and `fraction` of that (at least
    `floor` pages) for the windowed layers. A byte budget: the most full pages P with
    P * full bytes + ceil(P * fraction) * windowed bytes within it; when `floor` pages
    are more than that fraction, the windowed pool takes its floor and the full pages
    what is left, so both pools together never pass the budget (ValueError naming the
    flags when not even one full page is left). The windowed pool never has more pages
    than there are full pages (each full page has at most one window). One window group
    group's bytes: several window sizes share one pool (window_pools)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"--kv-window-pool-fraction must be in (0, 1], got {fraction}")
    full_bytes = sum(g.bytes_per_token for g in groups if g.window is None)
    win_bytes = sum(g.bytes_per_token for g in groups if g.window is not None)
    if kv_cache_tokens is not None:
        full = pool_pages(token_bytes=1, page_size=page_size,
                          kv_cache_tokens=kv_cache_tokens, budget=0)
        return GroupPools(full, min(full, max(floor, int(full * fraction))))
    usable = budget - page_size * win_bytes         # the windowed pool's null page
    full = int(max(usable, 0) // (page_size * (full_bytes + fraction * win_bytes)))
    window = int(full * fraction)
    if window < floor and full_bytes:
        window = floor                  # the floor's bytes first, the full pages the rest
        full = int(max(usable - floor * page_size * win_bytes, 0) // (page_size * full_bytes))
    window = min(full, max(window, floor))
    pools = GroupPools(full, window)
    if full < 1 or pools.pool_bytes(groups, page_size) > budget:
        raise ValueError(
            f"KV budget of {int(budget)} bytes cannot hold the windowed pool's floor of "
            f"{floor} pages (one request of --max-model-len tokens, a --chunked-prefill-size "
            f"chunk and its --kv-window-checkpoint windows) beside one full-attention page: "
            f"lower --max-model-len, or give a larger budget (--kv-cache-tokens, "
            f"--kv-cache-memory-fraction)")
    return pools


def window_pools(groups: Sequence[LayerGroup], *, page_size: int, kv_cache_tokens: int | None,
                 budget: float, max_model_len: int,
                 chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
                 fraction: float = DEFAULT_WINDOW_POOL_FRACTION,
                 checkpoint: int | None = None) -> GroupPools:
    """The per-group pools of a model with windowed layers: what the server allocates and
    `radixserve plan` reports (one function for both). Several window sizes share the
    windowed pool, which keeps the largest window."""
    window = max(g.window for g in groups if g.window is not None)
    floor = window_pool_floor(window, page_size, chunk_tokens, max_model_len,
                              checkpoint or window * DEFAULT_CHECKPOINT_WINDOWS)
    return group_pool_pages(groups, page_size=page_size, kv_cache_tokens=kv_cache_tokens,
                            budget=budget, fraction=fraction, floor=floor)
