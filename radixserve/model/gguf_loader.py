"""Read a llama, qwen2, qwen3, gemma2 or gemma3 GGUF file: metadata, config, and
dequantized HF-named weights.

Quantized tensors (Q4_1, Q8_0, ...) are dequantized to float32 by the `gguf` package and
cast to the working dtype one at a time, on access, so loading never holds a second copy
of the model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from .config import ModelConfig, config_from_gguf
from .errors import ModelLoadError
from .gguf_file import GGUFTensorInfo, read_gguf_header, tensor_array
from .quantized_linear import GROUP_SIZE, Int4Groups
from .weights import LazyWeights, check_weights

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 2/3's extra norms. llama.cpp's converter stores Gemma's norm weights plus one (its
# graph multiplies by w, transformers by 1 + w): the reader subtracts it back.
_GEMMA_BLOCK_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass
class GGUFContents:
    path: Path
    metadata: dict[str, Any]       # every key/value of the header (tokenizer arrays too)
    config: ModelConfig
    weights: LazyWeights    # HF names -> CPU tensors in the working dtype, q/k un-permuted
    # HF names of 2-D weights -> their GGML type names (what --weights-dtype auto follows)
    weight_types: dict[str, str]
    # HF name -> the file's own int4 blocks (Q4_0 / Q4_1, un-permuted), None for others
    int4_groups: Callable[[str], Int4Groups | None]
    tensor_bytes: int = 0           # the file's tensor data, all tensors


def hf_name(gguf_name: str, gemma: bool = False, qk_norm: bool = False) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = {**_BLOCK_NAMES, **(_GEMMA_BLOCK_NAMES if gemma else {}),
             **(_QK_NORM_NAMES if qk_norm else {})}
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (it interleaves the two rotary halves of
    each head for ggml's rope); HF's rotate_half expects them as contiguous halves."""
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
             .transpose(1, 2).reshape(w.shape))


def load_gguf(path: str | Path, dtype: torch.dtype) -> GGUFContents:
    """The header is read now (fast: no tensor data); weights are dequantized on access."""
    import gguf
    from gguf.quants import dequantize

    header = read_gguf_header(path)
    header.check_complete()
    path, meta, tensors = header.path, header.metadata, dict(header.tensors)
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: GGUF file has no token_embd.weight tensor")
    vocab_size = int(tensors["token_embd.weight"].dims[-1])
    config = config_from_gguf(meta, vocab_size, tied="output.weight" not in tensors)
    if "blk.0.attn_q.bias" in tensors or "blk.0.attn_output.bias" in tensors:
        config = replace(config, attention_bias="blk.0.attn_q.bias" in tensors,
                         o_proj_bias="blk.0.attn_output.bias" in tensors)

    file = np.memmap(path, mode="r")
    if "rope_freqs.weight" in tensors:   # llama 3.x: rope scaling stored as per-dim factors
        info = tensors.pop("rope_freqs.weight")
        factors = dequantize(tensor_array(file, info), gguf.GGMLQuantizationType(info.type))
        config = _with_freq_factors(config, factors)

    gemma = config.gemma
    # llama.cpp permutes q/k rows for its llama-arch rope only (qwen, gemma: NEOX style).
    permuted = meta.get("general.architecture") == "llama"

    def hf_name_of(gguf_name: str) -> str | None:
        return hf_name(gguf_name, gemma, config.qk_norm)

    unknown = [n for n in tensors if hf_name_of(n) is None]
    if unknown:
        raise ModelLoadError(
            f"{path}: unexpected tensor(s) for a {meta.get('general.architecture')} model, "
            f"e.g. {', '.join(unknown[:3])}")
    shapes = {hf_name_of(n): t.shape for n, t in tensors.items()}
    check_weights(config, shapes, str(path))

    by_hf_name = {hf_name_of(n): t for n, t in tensors.items()}

    def unpermute(name: str, w: torch.Tensor) -> torch.Tensor:
        if not permuted:
            return w
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            return unpermute_rope_rows(w, config.num_heads)
        if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            return unpermute_rope_rows(w, config.num_kv_heads)
        return w

    def read(name: str) -> torch.Tensor:
        t = by_hf_name[name]
        arr = dequantize(tensor_array(file, t), gguf.GGMLQuantizationType(t.type))
        if not arr.flags.writeable:          # a view of the read-only file mapping
            arr = np.array(arr)
        w = unpermute(name, torch.from_numpy(arr).reshape(shapes[name]))
        if gemma:                 # llama.cpp stores Gemma's norm weights as 1 + w
            return (w - 1.0 if name.endswith("norm.weight") else w).to(dtype).contiguous()
        return w.to(dtype).contiguous()

    def groups(name: str) -> Int4Groups | None:
        info = by_hf_name.get(name)
        found = None if info is None else _int4_blocks(file, info)
        if found is None:
            return None
        return Int4Groups(*(unpermute(name, t) for t in (found.q, found.scale, found.offset)))

    types = {n: gguf.GGMLQuantizationType(t.type).name for n, t in by_hf_name.items()
             if len(t.shape) == 2 and n.endswith(".weight")}
    return GGUFContents(path=path, metadata=meta, config=config,
                        weights=LazyWeights(shapes, read), weight_types=types,
                        int4_groups=groups,
                        tensor_bytes=sum(t.num_bytes for t in header.tensors.values()))


def _int4_blocks(file: np.memmap, info: GGUFTensorInfo) -> Int4Groups | None:
    """A Q4_0 / Q4_1 tensor's own integers and block constants, exactly (see
    quantized_linear: Q4_1 ``d * q + m``, Q4_0 ``d * (q - 8)``). Block layout (ggml):
    fp16 d, [fp16 m,] then 16 bytes whose low nibbles are q[0:16], high nibbles q[16:32]."""
    from gguf import GGMLQuantizationType as T

    kind = T(info.type)
    if kind not in (T.Q4_0, T.Q4_1) or info.shape[-1] % GROUP_SIZE:
        return None
    head = 4 if kind == T.Q4_1 else 2
    raw = np.asarray(file[info.offset:info.offset + info.num_bytes]).reshape(-1, head + 16)
    d = raw[:, :2].copy().view(np.float16).astype(np.float32)[:, 0]
    offset = (raw[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0] if head == 4
              else -8 * d)
    nibbles = raw[:, head:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1)
    rows, cols = info.shape
    return Int4Groups(torch.from_numpy(q.reshape(rows, cols)),
                      torch.from_numpy(d.reshape(rows, -1)),
                      torch.from_numpy(offset.reshape(rows, -1)))


def _with_freq_factors(config: ModelConfig, factors: np.ndarray) -> ModelConfig:
    if config.rope_scaling is not None:
        raise ModelLoadError("GGUF has both rope_freqs and a rope scaling type")
    if factors.size != config.head_dim // 2:
        raise ModelLoadError(
            f"rope_freqs has {factors.size} entries, expected head_dim/2 = {config.head_dim // 2}")
    return replace(config, rope_scaling={
        "rope_type": "freq_factors", "factors": tuple(float(x) for x in factors.ravel())})
