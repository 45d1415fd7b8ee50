"""--weights-dtype: which form a model's weights are served in, and turning a loaded model's
linear layers into that form.

``auto`` follows the GGUF's own precision class (its linear weights' most common type):
Q8_0 -> int8; Q4_0/Q4_1/Q5_x/K-quants -> int4; float files and HF checkpoints -> bf16
(the model's dtype, unquantized). Quantized forms run on CPU only. Their kernels compute
in bf16 (or fp16); a float32 model (a CPU without fast bf16) casts each linear's input to
bf16 and back (quantized_linear.kernel_dtype). There ``auto`` still keeps float weights:
int4 took SmolLM2's batch-1 decode step 1.57x less CPU time than fp32 weights, but batches
of 32-64 sequences 12-18% more (docs/benchmarks.md, "One stream"), and the issue's rule is
that batched decode must not get slower; ask for ``int4``/``int8`` explicitly for one stream.

The conversion is generic: every nn.Linear of a model becomes an Int4Linear/Int8Linear
(module names kept, so any model family built from nn.Linear works), and the LM head and
token embeddings become one int8 table (per-row scales: a row is both a token's embedding
and its logit's weights; int8 rather than int4 because the embedding gathers rows).
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Iterable

import torch
from torch import nn

from .errors import ModelLoadError
from .dual_linear import DualLinear
from .quantized_linear import Int4Groups, Int4Linear, Int8Embedding, Int8Linear, \
    can_pack, int4_groups_from_float

WEIGHTS_DTYPES = ("auto", "bf16", "int8", "int4", "int4+float")
QUANTIZED = ("int8", "int4", "int4+float")
DUAL = "int4+float"      # int4 and float forms side by side, by rows (dual_linear.py)

# GGML type names -> precision class (gguf.GGMLQuantizationType names)
_INT8_TYPES = {"Q8_0", "Q8_1", "Q8_K"}
_INT4_TYPES = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
               "IQ4_NL", "IQ4_XS"}

GroupsFor = Callable[[str], "Int4Groups | None"]


def precision_class(type_names: Iterable[str]) -> str:
    """The weights dtype ``auto`` means for a GGUF whose linear weights have these types."""
    counts = Counter(type_names)
    if not counts:
        return "bf16"
    common = counts.most_common(1)[0][0]
    return "int8" if common in _INT8_TYPES else "int4" if common in _INT4_TYPES else "bf16"


def resolve_weights_dtype(requested: str, auto_class: str, device: torch.device,
                          activations: torch.dtype) -> str:
    """``requested`` made concrete; ModelLoadError for what cannot be served."""
    if requested not in WEIGHTS_DTYPES:
        raise ModelLoadError(f"unknown weights dtype {requested!r} "
                             f"(choose {', '.join(WEIGHTS_DTYPES)})")
    if requested == "auto":
        fast = device.type == "cpu" and activations in (torch.bfloat16, torch.float16)
        return auto_class if fast else "bf16"
    if requested in QUANTIZED and device.type != "cpu":
        raise ModelLoadError(f"--weights-dtype {requested} runs on CPU only (torch's "
                             f"weight-only CPU kernels); on {device.type} use --weights-dtype "
                             f"bf16 (what auto picks there)")
    return requested


def quantize_model(model: nn.Module, kind: str, groups_for: GroupsFor | None = None,
                   fill: bool = True) -> None:
    """Replace, in place, every nn.Linear of ``model`` by its ``kind`` form, and the LM head
    and embeddings (``lm_head``, ``embed_tokens``) by one int8 table when tied, two if not.
    ``groups_for(module name)``: exact int4 groups from the file, or None (then the float
    weight is quantized). ``fill=False`` builds the layers empty (a weights-cache entry
    fills them): no float weight is read. Float weights are freed as they are replaced."""
    if kind not in QUANTIZED:
        return
    dtype = _activation_dtype(model)
    if kind == DUAL:
        _add_int4_forms(model, dtype, groups_for, fill)
        return
    head, embed = getattr(model, "lm_head", None), getattr(model, "embed_tokens", None)
    tied = head is not None and embed is not None and head.weight is embed.weight
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and module is not head:
            _replace(model, name, _quantized_linear(name, module, kind, dtype, groups_for, fill))
    if head is not None:
        head_q = _int8(head, "lm_head", dtype, fill)
        model.lm_head = head_q
        if embed is not None:
            model.embed_tokens = Int8Embedding(head_q if tied else _int8(
                _as_linear(embed), "embed_tokens", dtype, fill))


def _add_int4_forms(model: nn.Module, dtype: torch.dtype, groups_for: GroupsFor | None,
                    fill: bool) -> None:
    """Every nn.Linear -> a DualLinear of an int4 copy and itself; the LM head of an int8
    copy and itself (int8 as in ``int4``: an int4 head lost quality; kept float where the
    kernel cannot take its width); the embeddings stay as they are (float)."""
    head = getattr(model, "lm_head", None)
    for name, module in list(model.named_modules()):
        if module is head:
            if can_pack("int8", head.out_features, head.in_features):
                model.lm_head = DualLinear(_int8(head, "lm_head", dtype, fill), head)
        elif isinstance(module, nn.Linear):
            int4 = _quantized_linear(name, module, "int4", dtype, groups_for, fill)
            _replace(model, name, DualLinear(int4, module))


def describe_form(kind: str, dtype: torch.dtype) -> str:
    """The weights form for the start-up line."""
    if kind == DUAL:
        return (f"int4 linears and int8 LM head for steps of few rows, beside the "
                f"{_name(dtype)} ones")
    if kind in QUANTIZED:
        return f"{kind} linears, int8 LM head/embeddings"
    return _name(dtype)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, shared ones counted once."""
    seen: dict[int, int] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def _activation_dtype(model: nn.Module) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def _quantized_linear(name: str, linear: nn.Linear, kind: str, dtype: torch.dtype,
                      groups_for: GroupsFor | None, fill: bool) -> nn.Module:
    cls = Int4Linear if kind == "int4" else Int8Linear
    new = cls(linear.in_features, linear.out_features, dtype, linear.bias is not None, name)
    if not fill:
        return new
    if kind == "int4":
        groups = groups_for(name) if groups_for is not None else None
        new.load(groups if groups is not None else int4_groups_from_float(linear.weight))
    else:
        new.load(linear.weight)
    if linear.bias is not None:
        new.bias = linear.bias.detach().to(dtype).clone()
    return new


def _int8(linear: nn.Linear, name: str, dtype: torch.dtype, fill: bool) -> Int8Linear:
    new = Int8Linear(linear.in_features, linear.out_features, dtype, False, name)
    if fill:
        new.load(linear.weight)
    return new


def _as_linear(embed: nn.Embedding) -> nn.Linear:
    """A bias-free nn.Linear view of an embedding table (rows = tokens)."""
    with torch.device("meta"):
        linear = nn.Linear(embed.embedding_dim, embed.num_embeddings, bias=False)
    linear.weight = embed.weight
    return linear


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(owner), leaf, new)
