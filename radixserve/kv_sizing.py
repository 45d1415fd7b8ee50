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
