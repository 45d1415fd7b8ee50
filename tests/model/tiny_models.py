"""Tiny random Llama-family checkpoints written to disk the way users' files look:
transformers `save_pretrained` directories and llama.cpp-style GGUF files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")


def byte_level_vocab() -> tuple[list[str], list[str]]:
    """GPT-2 byte alphabet + two control tokens, and a few merges."""
    from tokenizers.pre_tokenizers import ByteLevel
    tokens = list(ByteLevel.alphabet())
    tokens.sort()
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens += ["Ġt", "he", "Ġthe", "<s>", "</s>"]
    return tokens, merges


def tiny_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tokens, merges = byte_level_vocab()
    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                              merges=[tuple(m.split(" ")) for m in merges]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                   chat_template=CHAT_TEMPLATE)


def hf_config(arch: str, **overrides):
    from transformers import (Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig,
                              Qwen2Config, Qwen3Config)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig,
           "qwen3": Qwen3Config, "gemma3_text": Gemma3TextConfig,
           "gemma2": Gemma2Config}[arch]
    vocab = len(byte_level_vocab()[0])
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.2,
                bos_token_id=vocab - 2, eos_token_id=vocab - 1, pad_token_id=None)
    if arch in ("gemma3_text", "gemma2"):
        base.update(head_dim=16, hidden_activation="gelu_pytorch_tanh")
    base.update(overrides)
    return cls(**base)


def random_hf_model(config, seed: int = 0):
    """A transformers model with random weights large enough to give peaked logits
    (biases too, which random init leaves at zero)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.generation_config.eos_token_id = None
    return model


def save_hf_dir(directory: Path, model, **save_kwargs) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, **save_kwargs)
    tiny_tokenizer().save_pretrained(directory)
    return directory


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (the forward direction)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
             .swapaxes(1, 2).reshape(w.shape))


GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


GEMMA_GGUF_NAMES = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
QK_NORM_GGUF_NAMES = {
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
# GGUF architectures whose q/k rows llama.cpp's converter permutes (its llama-style rope).
PERMUTED_ARCHS = ("llama",)


def write_gguf(path: Path, model, arch: str = "llama", q8_names: tuple[str, ...] = (),
               rope_freqs: np.ndarray | None = None) -> dict[str, torch.Tensor]:
    """Write `model` as llama.cpp would (q/k permuted, names mapped, metadata keys);
    tensors named in q8_names are stored Q8_0. Returns the HF state dict as stored
    (quantization round trip applied), for building the reference.
    arch "gemma2"/"gemma3": llama.cpp's Gemma layout (its extra norm names, norms stored
    as 1 + w, q/k not permuted, the sliding window and soft-caps in the metadata); "qwen2"/
    "qwen3": q/k not permuted (biases, q/k norms as named); "llama" with a config's
    sliding_window: the window in the metadata (Mistral)."""
    import gguf
    cfg = model.config
    gemma = arch in ("gemma2", "gemma3")
    names = {**GGUF_NAMES, **(GEMMA_GGUF_NAMES if gemma else {}),
             **(QK_NORM_GGUF_NAMES if arch in ("gemma3", "qwen3") else {})}
    rope = cfg.rope_parameters
    theta = (rope["full_attention"] if "full_attention" in rope else rope)["rope_theta"]
    tokens, merges = byte_level_vocab()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(theta))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if getattr(cfg, "head_dim", None):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if gemma or (arch == "llama" and getattr(cfg, "sliding_window", None)):
        w.add_sliding_window(cfg.sliding_window)
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if gemma and getattr(cfg, cap, None) is not None:
            getattr(w, "add_" + cap)(getattr(cfg, cap))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3 if t.startswith("<") else 1 for t in tokens])
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_chat_template(CHAT_TEMPLATE)

    stored: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        arr = t.float().numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, i, rest = name.split(".", 3)
            base, kind = rest.rsplit(".", 1)
            gname = f"blk.{i}.{names[base + '.weight'].replace('.weight', '.' + kind)}"
        if gemma:
            arr_file = arr + 1.0 if name.endswith("norm.weight") else arr
        elif arch not in PERMUTED_ARCHS:
            arr_file = arr
        elif name.endswith(("q_proj.weight", "q_proj.bias")):
            arr_file = llama_cpp_permute(arr, cfg.num_attention_heads)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            arr_file = llama_cpp_permute(arr, cfg.num_key_value_heads)
        else:
            arr_file = arr
        if gname in q8_names:
            q = gguf.quants.quantize(arr_file, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            assert arr_file is arr, "keep q/k unquantized: the reference needs them exact"
            back = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(arr.shape)
            stored[name] = torch.from_numpy(np.ascontiguousarray(back))
        else:
            w.add_tensor(gname, np.ascontiguousarray(arr_file))
            # Gemma norms: what reading back gives, (w + 1) - 1 in float32.
            back = (arr_file - 1.0 if gemma and name.endswith("norm.weight")
                    else arr.copy())
            stored[name] = torch.from_numpy(back)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored

