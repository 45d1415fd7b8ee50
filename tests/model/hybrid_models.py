"""Tiny random-weight checkpoints of the window-bearing families (Gemma 2, Gemma 3, Mistral and
Qwen2 with `sliding_window`, Qwen3), saved as transformers directories, with our loaded
model beside transformers' own: what the hybrid-family tests compare."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tiny_models import hf_config, random_hf_model, save_hf_dir, tiny_tokenizer

WINDOW = 16     # tokens; prompts and generations run well past it

FAMILIES: dict[str, tuple[str, dict]] = {
    # One global layer between two local ones; a scale that is not 1/sqrt(head_dim), the
    # final soft-cap and distinct RoPE bases per layer type all exercised.
    "gemma3": ("gemma3_text", dict(
        num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        final_logit_softcapping=30.0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}})),
    # Local/global alternating (its default pattern), attention and final soft-caps low
    # enough to bite on these logits (50 and 30 would leave tanh nearly linear here).
    "gemma2": ("gemma2", dict(
        num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "mistral": ("mistral", dict(sliding_window=WINDOW)),                  # every layer
    "qwen2": ("qwen2", dict(sliding_window=WINDOW, use_sliding_window=True,
                            max_window_layers=1)),                        # layer 1 only
    "qwen3": ("qwen3", dict(sliding_window=WINDOW, use_sliding_window=True,
                            max_window_layers=1, head_dim=16)),
}

PROMPTS = [
    "the cat",                                                    # inside the window
    "the quick brown fox jumps over the lazy dog",                # longer than the window
    "she sells sea shells by the sea shore, and the shells she sells are sea shells",
]


@dataclass
class Family:
    name: str
    directory: Path
    hf_model: object          # transformers, float32
    loaded: object            # ours (LoadedModel), float32

    def ids(self, text: str) -> list[int]:
        return tiny_tokenizer().encode(text)


def build_family(name: str, root: Path, seed: int = 0) -> Family:
    from radixserve.model.loader import load_model
    arch, overrides = FAMILIES[name]
    hf = random_hf_model(hf_config(arch, **overrides), seed=seed)
    directory = save_hf_dir(root / name, hf)
    return Family(name, directory, hf, load_model(str(directory), dtype="float32"))
