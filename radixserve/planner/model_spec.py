"""ModelSpec: the facts about a model that capacity planning needs, from any source.

Reads a short name, a Hugging Face directory, a `config.json` or a GGUF file, including
architectures the server cannot run (DeepSeek's MLA, per-layer sliding windows): planning
their deployment is legitimate, and the plan says that radixserve cannot serve them.
Only headers are read, never weights.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping


class PlanInputError(ValueError):
    """MODEL or a flag the planner cannot use; the message is the one line the user sees."""


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention: the cache holds one compressed latent per token."""
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int     # with the rope part: a key head without MLA
    v_head_dim: int

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelSpec:
    name: str
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_params: int
    params_source: str                      # "safetensors headers", "GGUF tensors", "config"
    max_context: int
    layer_windows: tuple[int | None, ...]   # per layer: sliding window, None = full attention
    mla: MLA | None = None
    unsupported: str | None = None          # why radixserve cannot serve it; None: it can
    served_context: int | None = None       # the server's context cap

    @property
    def attention_kind(self) -> str:
        if self.mla is not None:
            return "MLA"
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    @property
    def windows(self) -> list[int]:
        return sorted({w for w in self.layer_windows if w is not None})


def _int(cfg: Mapping[str, Any], key: str, source: str) -> int:
    value = cfg.get(key)
    if value is None:
        raise PlanInputError(f"{source}: the config has no {key!r}, which planning needs")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise PlanInputError(f"{source}: {key!r} is {value!r}, not an integer") from None


def _layer_windows(cfg: Mapping[str, Any], layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if not window:
        return (None,) * layers
    window = int(window)
    if isinstance(layer_types, list) and len(layer_types) == layers:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if cfg.get("model_type") == "qwen2" and not cfg.get("use_sliding_window", False):
        return (None,) * layers
    return (window,) * layers


def _config_params(cfg: Mapping[str, Any], layers: int, heads: int, kv_heads: int,
                   head_dim: int, mla: MLA | None) -> int:
    """Parameter count from the config: Llama-style blocks, MLA attention, MoE MLPs."""
    hidden = int(cfg.get("hidden_size", 0))
    vocab = int(cfg.get("vocab_size", 0))
    inter = int(cfg.get("intermediate_size", 0))
    if mla is None:
        attn = hidden * head_dim * (2 * heads + 2 * kv_heads)
    else:
        nope, v_dim = mla.qk_nope_head_dim, mla.v_head_dim
        q_rank = cfg.get("q_lora_rank")
        q_out = heads * (nope + mla.qk_rope_head_dim)
        q = hidden * q_out if not q_rank else hidden * q_rank + q_rank + q_rank * q_out
        attn = (q + hidden * mla.latent_dim + mla.kv_lora_rank
                + mla.kv_lora_rank * heads * (nope + v_dim) + heads * v_dim * hidden)
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0)
    moe_inter = int(cfg.get("moe_intermediate_size") or inter)
    shared = int(cfg.get("n_shared_experts") or 0)
    dense_layers = int(cfg.get("first_k_dense_replace", 0)) if experts else layers
    moe_layers = layers - dense_layers
    mlp_dense = 3 * hidden * inter
    mlp_moe = 3 * hidden * moe_inter * (experts + shared) + experts * hidden
    norms = 2 * hidden
    embed = vocab * hidden * (1 if cfg.get("tie_word_embeddings", False) else 2)
    return (layers * (attn + norms) + dense_layers * mlp_dense + moe_layers * mlp_moe
            + embed + hidden)


def spec_from_hf_config(cfg: Mapping[str, Any], name: str, num_params: int | None = None,
                        params_source: str = "config") -> ModelSpec:
    """From a config.json dict; the server's own parser decides whether it can serve it."""
    from radixserve.model.config import ModelConfig
    from radixserve.model.errors import ModelLoadError

    source = name
    if not isinstance(cfg, Mapping):
        raise PlanInputError(f"{source}: config.json is not a JSON object")
    if isinstance(cfg.get("text_config"), Mapping):      # multimodal wrappers
        cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get(
            "model_type", cfg.get("model_type"))}
    layers = _int(cfg, "num_hidden_layers", source)
    heads = _int(cfg, "num_attention_heads", source)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    hidden = _int(cfg, "hidden_size", source)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    mla = None
    if cfg.get("kv_lora_rank"):
        mla = MLA(_int(cfg, "kv_lora_rank", source), _int(cfg, "qk_rope_head_dim", source),
                  int(cfg.get("qk_nope_head_dim") or head_dim),
                  int(cfg.get("v_head_dim") or head_dim))
    layer_windows = _layer_windows(cfg, layers)
    try:
        served = ModelConfig.from_hf_config(cfg)
        unsupported, served_context = None, served.max_position_embeddings
        kv_heads, head_dim = served.num_kv_heads, served.head_dim
        layer_windows = served.windows       # the server's own reading of the layers
    except ModelLoadError as exc:
        unsupported, served_context = str(exc), None
    if num_params is None:
        num_params = _config_params(cfg, layers, heads, kv_heads, head_dim, mla)
    return ModelSpec(
        name=name, architecture=str(cfg.get("model_type", "unknown")), num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, num_params=num_params,
        params_source=params_source,
        max_context=int(cfg.get("max_position_embeddings", 4096)),
        layer_windows=layer_windows, mla=mla, unsupported=unsupported,
        served_context=served_context)


def _safetensors_params(directory: Path) -> int | None:
    """Elements of every tensor, from the safetensors headers (no data read)."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for f in files:
        with f.open("rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for key, entry in header.items():
            if key != "__metadata__":
                n = 1
                for dim in entry["shape"]:
                    n *= int(dim)
                total += n
    return total


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PlanInputError(f"{path}: cannot read it as JSON ({exc})") from None


def spec_from_gguf(path: Path, name: str) -> ModelSpec:
    from radixserve.model.errors import ModelLoadError
    from radixserve.model.gguf_file import read_gguf_header

    try:
        header = read_gguf_header(path)
    except (ModelLoadError, OSError, ValueError) as exc:
        raise PlanInputError(f"{path} is not a readable GGUF file ({exc})") from None
    meta = header.metadata
    arch = str(meta.get("general.architecture", "unknown"))

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    cfg: dict[str, Any] = {"model_type": arch}
    for key, hf in (("block_count", "num_hidden_layers"),
                    ("attention.head_count", "num_attention_heads"),
                    ("attention.head_count_kv", "num_key_value_heads"),
                    ("embedding_length", "hidden_size"),
                    ("attention.key_length", "head_dim"),
                    ("context_length", "max_position_embeddings"),
                    ("attention.sliding_window", "sliding_window"),
                    ("attention.kv_lora_rank", "kv_lora_rank"),
                    ("rope.dimension_count", "qk_rope_head_dim")):
        if get(key) is not None:
            cfg[hf] = get(key)
    if "kv_lora_rank" not in cfg:
        cfg.pop("qk_rope_head_dim", None)
    params = 0
    for info in header.tensors.values():
        n = 1
        for dim in info.dims:
            n *= int(dim)
        params += n
    spec = spec_from_hf_config(cfg, name, params, "GGUF tensors")
    # The server's GGUF parser is the judge of what it can serve, and of the layers' windows
    # (Gemma's local/global pattern is not in the keys read above).
    from radixserve.model.config import config_from_gguf
    from radixserve.model.errors import ModelLoadError
    try:
        served = config_from_gguf(meta, 1, tied=False)
        spec = _replace(spec, unsupported=None, served_context=spec.max_context,
                        layer_windows=served.windows)
    except ModelLoadError as exc:
        spec = _replace(spec, unsupported=str(exc), served_context=None)
    return spec


def _replace(spec: ModelSpec, **changes: Any) -> ModelSpec:
    from dataclasses import replace
    return replace(spec, **changes)


def read_model_spec(model: str) -> ModelSpec:
    """MODEL as `radixserve serve --model` takes it, or a config.json file."""
    from radixserve.model.errors import ModelLoadError
    from radixserve.model.registry import SHORT_NAMES, resolve_short_name

    try:
        path = resolve_short_name(model)
    except ModelLoadError as exc:
        raise PlanInputError(str(exc)) from None
    path = path or Path(model).expanduser()
    if not path.exists():
        raise PlanInputError(f"model {model!r} not found: not a short name "
                             f"({', '.join(SHORT_NAMES)}), a directory, a .gguf file or a "
                             f"config.json")
    if path.is_dir():
        if (path / "config.json").is_file():
            params = _safetensors_params(path)
            return spec_from_hf_config(_read_json(path / "config.json"), model, params,
                                       "config" if params is None else "safetensors headers")
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise PlanInputError(f"{path}: neither a config.json nor exactly one .gguf file")
        path = ggufs[0]
    if path.suffix.lower() == ".gguf":
        return spec_from_gguf(path, model)
    if path.suffix.lower() == ".json":
        return spec_from_hf_config(_read_json(path), model)
    raise PlanInputError(f"{path}: expected a .gguf file, a config.json or a model directory")
