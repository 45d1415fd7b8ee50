"""ModelConfig: the shape of a Llama-family model, read from config.json or GGUF metadata.

Both sources are normalised here so the model code never sees a dict of raw keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from .errors import ModelLoadError

# rope scaling types a config.json may name; anything else is refused at load time.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# ...plus "freq_factors": per-dimension divisors a llama-3 GGUF stores as rope_freqs.
_IMPLEMENTED_ROPE_TYPES = SUPPORTED_ROPE_TYPES + ("freq_factors",)

# model_type -> overrides of config defaults that the architecture implies.
HF_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {"attention_bias": True},   # q/k/v carry a bias, o_proj does not
}


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = field(default=None, hash=False)
    tie_word_embeddings: bool = False
    attention_bias: bool = False         # bias on q/k/v projections
    max_position_embeddings: int = 4096
    # additions to the contract (defaults keep old call sites valid):
    o_proj_bias: bool = False            # Llama's attention_bias=True also biases o_proj
    mlp_bias: bool = False
    model_type: str = "llama"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim must be even for RoPE, got {self.head_dim}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in _IMPLEMENTED_ROPE_TYPES:
            raise ModelLoadError(
                f"rope scaling type {rope_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        """From a config.json dict (transformers 4.x `rope_scaling`/`rope_theta` or
        5.x `rope_parameters`)."""
        model_type = cfg.get("model_type")
        if model_type not in HF_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture: model_type {model_type!r} in config.json "
                f"(supported: {', '.join(sorted(HF_ARCHITECTURES))})")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"unsupported hidden_act {act!r} (only 'silu')")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            layers = int(cfg["num_hidden_layers"])
            inter = int(cfg["intermediate_size"])
            vocab = int(cfg["vocab_size"])
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks required key {e.args[0]!r}") from None
        arch = HF_ARCHITECTURES[model_type]
        attention_bias = bool(arch.get("attention_bias", cfg.get("attention_bias", False)))
        rope_theta, scaling = _hf_rope(cfg)
        max_pos = int(cfg.get("max_position_embeddings", 4096))
        window = _sliding_window(cfg)
        if window is not None and window < max_pos:
            # Sliding-window attention equals full attention while the context fits
            # in the window; capping the context keeps us exact without a windowed kernel.
            max_pos = window
        return cls(
            hidden_size=hidden, num_layers=layers, num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=inter, vocab_size=vocab,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta, rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=model_type == "llama" and attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            max_position_embeddings=max_pos, model_type=model_type)


def _hf_rope(cfg: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "default":
        return theta, None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"rope scaling type {rope_type!r} in config.json is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if "factor" not in params:
        raise ModelLoadError(f"rope scaling {rope_type!r} in config.json lacks 'factor'")
    return theta, {"rope_type": rope_type, **params}


def _sliding_window(cfg: Mapping[str, Any]) -> int | None:
    window = cfg.get("sliding_window")
    if not window:
        return None
    if cfg.get("model_type") == "qwen2":
        layer_types = cfg.get("layer_types") or []
        if not cfg.get("use_sliding_window", False) and "sliding_attention" not in layer_types:
            return None
    return int(window)


def config_from_gguf(meta: Mapping[str, Any], vocab_size: int, tied: bool) -> ModelConfig:
    """From GGUF metadata of a llama-architecture file (keys `llama.*`)."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r} (supported: 'llama')")

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"llama.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks 'llama.{key}'")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(meta.get("llama.attention.key_length") or
                   meta.get("llama.rope.dimension_count") or hidden // heads)
    scaling = None
    scale_type = meta.get("llama.rope.scaling.type", "none")
    if scale_type == "linear":
        scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scale_type not in ("none", None):
        raise ModelLoadError(
            f"GGUF rope scaling type {scale_type!r} is not supported (supported: linear)")
    return ModelConfig(
        hidden_size=hidden, num_layers=int(get("block_count")), num_heads=heads,
        num_kv_heads=int(meta.get("llama.attention.head_count_kv") or heads),
        head_dim=head_dim, intermediate_size=int(get("feed_forward_length")),
        vocab_size=vocab_size,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)), rope_scaling=scaling,
        tie_word_embeddings=tied, max_position_embeddings=int(get("context_length", 4096)),
        model_type="llama")
