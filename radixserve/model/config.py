"""ModelConfig: the shape of a Llama-family, Gemma 2/3 or DeepSeek-V2/V3 model, read from
config.json or GGUF metadata (DeepSeek's MLA and MoE parts: `deepseek_config.py`).

Both sources are normalised here so the model code never sees a dict of raw keys. Which
layers attend through a sliding window is resolved here too (`layer_windows`), so the
model, the attention backend and the KV sizing read one answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from .deepseek_config import DEEPSEEK_FAMILIES, MLAConfig, MoEConfig, mla_and_moe
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
    "qwen3": {"qk_norm": True},           # RMSNorm over each q/k head before RoPE
    "gemma3_text": {"qk_norm": True},
    "gemma2": {},                         # Gemma 3's layer without q/k norms, soft-capped
}
# Families with Gemma's layer: (1 + w) norms around both blocks, GeGLU, scaled embeddings.
GEMMA_FAMILIES = ("gemma3_text", "gemma2")
# Gemma's default layer pattern when a config lists no layer_types: every Nth layer global.
GEMMA_GLOBAL_EVERY = {"gemma3_text": 6, "gemma2": 2}
# Gemma 3's RoPE base of local layers when the config names none (transformers' default).
GEMMA3_LOCAL_ROPE_THETA = 10000.0
# The attention kinds a `layer_types` entry may name; anything else is refused at load.
LAYER_TYPES = ("full_attention", "sliding_attention")


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
    # hybrid and newer families (defaults: a plain Llama):
    layer_windows: tuple[int | None, ...] | None = None   # per layer; None: all full
    qk_norm: bool = False                # RMSNorm over each q and k head (Qwen3, Gemma 3)
    hidden_act: str = "silu"             # "gelu_pytorch_tanh" for Gemma
    query_pre_attn_scalar: float | None = None   # attention scale 1/sqrt(this), not head_dim
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    rope_local_theta: float | None = None  # RoPE base of sliding-window layers (Gemma 3)
    attn_logit_softcapping: float | None = None  # attention logits capped (Gemma 2)
    # DeepSeek-V2/V3 (deepseek_config.py): latent attention and routed experts. With `mla`,
    # head_dim is the decoupled RoPE key's width and num_kv_heads is num_heads.
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None

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

        if self.layer_windows is not None and len(self.layer_windows) != self.num_layers:
            raise ModelLoadError(f"layer_types has {len(self.layer_windows)} entries for "
                                 f"{self.num_layers} layers")

    @property
    def gemma(self) -> bool:
        return self.model_type in GEMMA_FAMILIES

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (it attends to its last W positions), or None."""
        return None if self.layer_windows is None else self.layer_windows[layer]

    @property
    def windows(self) -> tuple[int | None, ...]:
        return self.layer_windows or (None,) * self.num_layers

    @property
    def attention_scale(self) -> float | None:
        """The softmax scale when it is not 1/sqrt(head_dim) (None: that default)."""
        return None if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar ** -0.5

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
        if model_type in DEEPSEEK_FAMILIES:
            return _deepseek_config(cls, cfg)
        if model_type not in HF_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture: model_type {model_type!r} in config.json "
                f"(supported: {', '.join(sorted((*HF_ARCHITECTURES, *DEEPSEEK_FAMILIES)))})")
        gemma = model_type in GEMMA_FAMILIES
        act = (cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
               if gemma else cfg.get("hidden_act", "silu"))
        wanted = "gelu_pytorch_tanh" if gemma else "silu"
        if act != wanted:
            raise ModelLoadError(f"unsupported hidden_act {act!r} for {model_type} "
                                 f"(only {wanted!r})")
        _refuse_unsupported_attention(cfg)
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
        rope_theta, scaling, local_theta = _rope_by_layer_type(cfg)
        max_pos = int(cfg.get("max_position_embeddings", 4096))
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
            max_position_embeddings=max_pos, model_type=model_type,
            layer_windows=_layer_windows(cfg, layers),
            qk_norm=bool(arch.get("qk_norm", False)), hidden_act=act,
            query_pre_attn_scalar=(float(cfg.get("query_pre_attn_scalar") or 256)
                                   if gemma else None),
            final_logit_softcapping=_optional_float(cfg, "final_logit_softcapping"),
            rope_local_theta=(GEMMA3_LOCAL_ROPE_THETA if local_theta is None
                              and model_type == "gemma3_text" else local_theta),
            attn_logit_softcapping=(_optional_float(cfg, "attn_logit_softcapping")
                                    if gemma else None))


def _deepseek_config(cls: type[ModelConfig], cfg: Mapping[str, Any]) -> ModelConfig:
    """A DeepSeek-V2/V3 config.json: the shared fields here, MLA and MoE in their own."""
    mla, moe = mla_and_moe(cfg)
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"unsupported hidden_act {act!r} for {cfg['model_type']} "
                             f"(only 'silu')")
    try:
        heads, hidden, layers, inter, vocab = (int(cfg[k]) for k in (
            "num_attention_heads", "hidden_size", "num_hidden_layers", "intermediate_size",
            "vocab_size"))
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks required key {e.args[0]!r}") from None
    return cls(hidden_size=hidden, num_layers=layers,
               num_heads=heads, num_kv_heads=heads, head_dim=mla.qk_rope_head_dim,
               intermediate_size=inter, vocab_size=vocab,
               rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
               rope_theta=float((cfg.get("rope_parameters") or {}).get(
                   "rope_theta", cfg.get("rope_theta", 10000.0))),
               tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
               max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
               model_type=cfg["model_type"], mla=mla, moe=moe)


def _optional_float(cfg: Mapping[str, Any], key: str) -> float | None:
    value = cfg.get(key)
    return None if value is None else float(value)


def _refuse_unsupported_attention(cfg: Mapping[str, Any]) -> None:
    """Attention variants we do not implement are refused with the field named, never
    served approximately."""
    if cfg.get("attn_logit_softcapping") is not None and cfg.get("model_type") != "gemma2":
        raise ModelLoadError(
            f"attn_logit_softcapping={cfg['attn_logit_softcapping']!r} in config.json is not "
            f"supported for {cfg.get('model_type')!r} (only Gemma 2 soft-caps attention)")
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError("use_bidirectional_attention=true in config.json is not "
                             "supported (causal attention only)")


def _rope_by_layer_type(cfg: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None,
                                                         float | None]:
    """(theta, scaling) of full-attention layers and the RoPE base of sliding layers when
    it differs by layer type (Gemma 3: transformers 5.x `rope_parameters` keyed by layer
    type, 4.x `rope_local_base_freq`)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and "full_attention" in params:
        theta, scaling = _hf_rope({"rope_parameters": params["full_attention"]})
        local = params.get("sliding_attention")
        if local is None:
            return theta, scaling, None
        local_theta, local_scaling = _hf_rope({"rope_parameters": local})
        if local_scaling is not None:
            raise ModelLoadError("rope_parameters.sliding_attention in config.json: only "
                                 "rope_type 'default' is supported for sliding layers")
        return theta, scaling, local_theta
    theta, scaling = _hf_rope(cfg)
    local = cfg.get("rope_local_base_freq")
    return theta, scaling, None if local is None else float(local)


def _layer_windows(cfg: Mapping[str, Any], layers: int) -> tuple[int | None, ...] | None:
    """Each layer's sliding window, as transformers applies it: `layer_types` when the
    config lists them, else the family's rule. None: every layer attends fully."""
    window = _sliding_window(cfg)
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            raise ModelLoadError(f"layer_types in config.json must list one entry per layer "
                                 f"({layers}), got {types!r}")
        for i, kind in enumerate(types):
            if kind not in LAYER_TYPES:
                raise ModelLoadError(
                    f"layer_types[{i}] = {kind!r} in config.json is not a supported "
                    f"attention variant (supported: {', '.join(LAYER_TYPES)})")
    elif cfg.get("model_type") in GEMMA_FAMILIES:
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
                      or GEMMA_GLOBAL_EVERY[cfg["model_type"]])
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(layers)]
    elif cfg.get("model_type") in ("qwen2", "qwen3"):
        first = int(cfg.get("max_window_layers") or 0)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    else:
        types = ["sliding_attention"] * layers
    if window is None:
        if cfg.get("model_type") in GEMMA_FAMILIES and "sliding_attention" in types:
            raise ModelLoadError("config.json names sliding_attention layers but has no "
                                 "sliding_window")
        return None
    windows = tuple(window if kind == "sliding_attention" else None for kind in types)
    return windows if any(w is not None for w in windows) else None


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
    if cfg.get("model_type") in ("qwen2", "qwen3"):
        layer_types = cfg.get("layer_types") or []
        if not cfg.get("use_sliding_window", False) and "sliding_attention" not in layer_types:
            return None
    if int(window) < 1:
        raise ModelLoadError(f"sliding_window in config.json must be positive, got {window!r}")
    return int(window)


GGUF_ARCHITECTURES = ("llama", "gemma3", "qwen2", "qwen3", "gemma2")
# llama.cpp hard-codes what Gemma 3's GGUF metadata leaves out (its gemma3 graph).
GGUF_GEMMA3_LOCAL_ROPE_THETA = 10000.0
GGUF_GEMMA3_PATTERN = 6          # every 6th layer global, the rest sliding
# Gemma 2 in llama.cpp: every 2nd layer global (layer 0 sliding), one RoPE base.
GGUF_GEMMA_GLOBAL_EVERY = {"gemma3": GGUF_GEMMA3_PATTERN, "gemma2": 2}


def config_from_gguf(meta: Mapping[str, Any], vocab_size: int, tied: bool) -> ModelConfig:
    """From GGUF metadata of a llama, qwen2, qwen3, gemma2 or gemma3 file (keys `<arch>.*`)."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r} (supported: "
            f"{', '.join(repr(a) for a in GGUF_ARCHITECTURES)})")

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks '{arch}.{key}'")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or
                   meta.get(f"{arch}.rope.dimension_count") or hidden // heads)
    scaling = None
    scale_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if scale_type == "linear":
        scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scale_type not in ("none", None):
        raise ModelLoadError(
            f"GGUF rope scaling type {scale_type!r} is not supported (supported: linear)")
    layers = int(get("block_count"))
    config = ModelConfig(
        hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
        head_dim=head_dim, intermediate_size=int(get("feed_forward_length")),
        vocab_size=vocab_size,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)), rope_scaling=scaling,
        tie_word_embeddings=tied, max_position_embeddings=int(get("context_length", 4096)),
        model_type="llama")
    if arch in GGUF_GEMMA_GLOBAL_EVERY:
        return _gemma_from_gguf(config, meta, arch)
    return _qwen_from_gguf(config, arch) if arch.startswith("qwen") else \
        _llama_from_gguf(config, meta)


def _llama_from_gguf(config: ModelConfig, meta: Mapping[str, Any]) -> ModelConfig:
    """A llama-architecture file with `llama.attention.sliding_window` (Mistral converted by
    llama.cpp) windows every layer, as transformers' Mistral does."""
    from dataclasses import replace

    window = meta.get("llama.attention.sliding_window")
    if not window:
        return config
    return replace(config, layer_windows=(int(window),) * config.num_layers)


def _qwen_from_gguf(config: ModelConfig, arch: str) -> ModelConfig:
    """Qwen2/Qwen3 as llama.cpp runs them: full attention in every layer (GGUF carries no
    use_sliding_window / max_window_layers), q/k norms for Qwen3; biases follow the tensors."""
    from dataclasses import replace

    return replace(config, model_type=arch, qk_norm=arch == "qwen3")


def _gemma_from_gguf(config: ModelConfig, meta: Mapping[str, Any], arch: str) -> ModelConfig:
    """Gemma 2/3's extras, as llama.cpp runs them: windows on every layer but each Nth
    (`sliding_window_pattern`, an int or one bool per layer, else the family's rule), the
    attention scale `attention.scale` or 1/sqrt(head_dim), soft-caps when stored; Gemma 3:
    q/k norms and local RoPE base 10000."""
    from dataclasses import replace

    window = meta.get(f"{arch}.attention.sliding_window")
    if window is None:
        raise ModelLoadError(f"GGUF metadata lacks '{arch}.attention.sliding_window'")
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, (list, tuple)):       # true: sliding layer
        if len(pattern) != config.num_layers:
            raise ModelLoadError(f"'{arch}.attention.sliding_window_pattern' has "
                                 f"{len(pattern)} entries for {config.num_layers} layers")
        windows = tuple(int(window) if sliding else None for sliding in pattern)
    else:
        every = int(pattern or GGUF_GEMMA_GLOBAL_EVERY[arch])
        windows = tuple(None if (i + 1) % every == 0 else int(window)
                        for i in range(config.num_layers))
    scale = meta.get(f"{arch}.attention.scale")
    gemma3 = arch == "gemma3"
    return replace(config, model_type="gemma3_text" if gemma3 else "gemma2",
                   layer_windows=windows, qk_norm=gemma3, hidden_act="gelu_pytorch_tanh",
                   query_pre_attn_scalar=(float(config.head_dim) if scale is None
                                          else float(scale) ** -2),
                   final_logit_softcapping=_optional_float(
                       meta, f"{arch}.final_logit_softcapping"),
                   attn_logit_softcapping=_optional_float(
                       meta, f"{arch}.attn_logit_softcapping"),
                   rope_local_theta=GGUF_GEMMA3_LOCAL_ROPE_THETA if gemma3 else None)
