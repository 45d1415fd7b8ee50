"""The DeepSeek-V2/V3 parts of a ModelConfig: latent attention (MLA) and the MoE router.

Read from config.json (`DeepseekV2ForCausalLM` / `DeepseekV3ForCausalLM`). A field this
loader does not know is refused with its name: an MLA checkpoint whose config asks for
something we would silently ignore must not be served approximately.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from .errors import ModelLoadError

DEEPSEEK_FAMILIES = ("deepseek_v2", "deepseek_v3")

# Keys every transformers config.json may carry that change nothing we compute.
_BOOKKEEPING = frozenset({
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range",
    "attention_dropout", "output_router_logits", "pretraining_tp", "auto_map",
    "_name_or_path", "router_aux_loss_coef", "aux_loss_alpha", "seq_aux", "ep_size",
    # DeepSeek-V3's multi-token-prediction layers: extra weights for speculative decoding,
    # unused by the causal LM (transformers ignores them too).
    "num_nextn_predict_layers",
})
# Keys whose values we read (and check) below.
_READ = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "n_shared_experts",
    "n_routed_experts", "routed_scaling_factor", "kv_lora_rank", "q_lora_rank",
    "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "qk_head_dim", "head_dim",
    "topk_method", "n_group", "topk_group", "num_experts_per_tok", "moe_layer_freq",
    "first_k_dense_replace", "norm_topk_prob", "scoring_func", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
    "rope_parameters", "rope_interleave", "attention_bias", "mlp_bias",
    "tie_word_embeddings",
})
KNOWN_FIELDS = _BOOKKEEPING | _READ
V2_TOPK_METHODS = ("greedy", "group_limited_greedy")
V3_TOPK_METHODS = ("noaux_tc",)
_YARN_KEYS = frozenset({"rope_type", "type", "rope_theta", "factor", "beta_fast", "beta_slow",
                        "mscale", "mscale_all_dim", "original_max_position_embeddings",
                        "attention_factor", "truncate"})


@dataclass(frozen=True)
class MLAConfig:
    """Latent attention shapes, and the decoupled RoPE key's frequencies."""
    kv_lora_rank: int              # the cached latent's width (per token and layer)
    qk_rope_head_dim: int          # the cached RoPE key's width (shared by all heads)
    qk_nope_head_dim: int          # per head: the key part decompressed from the latent
    v_head_dim: int
    q_lora_rank: int | None        # None: q is one projection (DeepSeek-V2-Lite)
    rope_interleave: bool = True   # RoPE pairs (x0, x1), (x2, x3)... rather than halves
    yarn: Mapping[str, Any] | None = field(default=None, hash=False)   # rope_parameters

    @property
    def latent_dim(self) -> int:
        """Elements cached per token and layer: the latent and the RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times YaRN's mscale(mscale_all_dim)^2 when scaled."""
        scale = self.qk_head_dim ** -0.5
        if self.yarn and self.yarn.get("mscale_all_dim"):
            m = yarn_mscale(float(self.yarn["factor"]), float(self.yarn["mscale_all_dim"]))
            scale *= m * m
        return scale


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts with shared ones; which layers are MoE and how tokens are routed."""
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    num_shared_experts: int
    first_k_dense: int             # layers before this one use the dense MLP
    layer_freq: int                # then every layer_freq-th layer is MoE
    scoring: str                   # "softmax" (V2) or "sigmoid" (V3, with a score bias)
    topk_method: str               # greedy | group_limited_greedy | noaux_tc
    num_groups: int
    topk_groups: int
    routed_scaling_factor: float
    norm_topk_prob: bool

    def is_moe_layer(self, index: int) -> bool:
        """DeepSeek's rule (its modeling code): MoE from first_k_dense_replace on, every
        moe_layer_freq-th layer."""
        return index >= self.first_k_dense and index % self.layer_freq == 0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature, 0.1 * mscale * ln(factor) + 1 (1 when not scaled)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def refuse_unknown_fields(cfg: Mapping[str, Any]) -> None:
    unknown = sorted(k for k in cfg if k not in KNOWN_FIELDS)
    if unknown:
        raise ModelLoadError(
            f"config.json field {unknown[0]!r} is not understood by radixserve's "
            f"{cfg.get('model_type')} loader (refused rather than ignored"
            + (f"; also {', '.join(map(repr, unknown[1:4]))}" if len(unknown) > 1 else "")
            + ")")


def _int(cfg: Mapping[str, Any], key: str) -> int:
    if cfg.get(key) is None:
        raise ModelLoadError(f"config.json lacks required key {key!r}")
    return int(cfg[key])


def _rope(cfg: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, the YaRN parameters or None); other scalings are refused."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise ModelLoadError(f"rope scaling type {kind!r} in config.json is not supported "
                             f"for {cfg.get('model_type')} (supported: default, yarn)")
    unknown = sorted(set(params) - _YARN_KEYS)
    if unknown:
        raise ModelLoadError(f"rope_parameters field {unknown[0]!r} in config.json is not "
                             f"understood (yarn)")
    if "original_max_position_embeddings" not in params:
        raise ModelLoadError("yarn rope_parameters in config.json lack "
                             "'original_max_position_embeddings'")
    if params.get("factor") is None:
        params["factor"] = (float(cfg.get("max_position_embeddings", 4096))
                            / float(params["original_max_position_embeddings"]))
    params["rope_theta"] = theta
    return theta, params


def mla_and_moe(cfg: Mapping[str, Any]) -> tuple[MLAConfig, MoEConfig | None]:
    """The MLA and MoE parts of a DeepSeek config.json; refuses what we do not run."""
    refuse_unknown_fields(cfg)
    v3 = cfg.get("model_type") == "deepseek_v3"
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise ModelLoadError(f"{flag}=true in config.json is not supported for "
                                 f"{cfg['model_type']}")
    _, yarn = _rope(cfg)
    q_lora = cfg.get("q_lora_rank")
    mla = MLAConfig(kv_lora_rank=_int(cfg, "kv_lora_rank"),
                    qk_rope_head_dim=_int(cfg, "qk_rope_head_dim"),
                    qk_nope_head_dim=_int(cfg, "qk_nope_head_dim"),
                    v_head_dim=_int(cfg, "v_head_dim"),
                    q_lora_rank=None if q_lora is None else int(q_lora),
                    rope_interleave=bool(cfg.get("rope_interleave", True)) if v3 else True,
                    yarn=yarn)
    if mla.qk_rope_head_dim % 2:
        raise ModelLoadError(f"qk_rope_head_dim must be even, got {mla.qk_rope_head_dim}")
    layers = _int(cfg, "num_hidden_layers")
    if not cfg.get("n_routed_experts") or int(cfg.get("first_k_dense_replace") or 0) >= layers:
        return mla, None            # no MoE layer at all
    scoring = cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    allowed = V3_TOPK_METHODS if v3 else V2_TOPK_METHODS
    if method not in allowed:
        raise ModelLoadError(f"topk_method {method!r} in config.json is not supported for "
                             f"{cfg['model_type']} (supported: {', '.join(allowed)})")
    if scoring != ("sigmoid" if v3 else "softmax"):
        raise ModelLoadError(f"scoring_func {scoring!r} in config.json is not supported for "
                             f"{cfg['model_type']}")
    norm = bool(cfg.get("norm_topk_prob", v3))
    if norm and not v3:
        # transformers' DeepseekV2 router (our reference) never normalises: refuse rather
        # than serve an unchecked variant.
        raise ModelLoadError("norm_topk_prob=true in config.json is not supported for "
                             "deepseek_v2")
    experts = _int(cfg, "n_routed_experts")
    grouped = method != "greedy"
    groups = int(cfg.get("n_group") or 1) if grouped else 1
    if experts % groups:
        raise ModelLoadError(f"n_routed_experts ({experts}) is not a multiple of n_group "
                             f"({groups})")
    moe = MoEConfig(
        num_experts=experts, top_k=_int(cfg, "num_experts_per_tok"),
        moe_intermediate_size=_int(cfg, "moe_intermediate_size"),
        num_shared_experts=int(cfg.get("n_shared_experts") or 0),
        first_k_dense=int(cfg.get("first_k_dense_replace") or 0),
        layer_freq=int(cfg.get("moe_layer_freq") or 1), scoring=scoring, topk_method=method,
        num_groups=groups, topk_groups=int(cfg.get("topk_group") or groups) if grouped else 1,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        norm_topk_prob=norm)
    return mla, moe
