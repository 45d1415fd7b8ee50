"""The `deterministic` section of scripts/gpu_check.py: --deterministic on the CUDA path.

With ``deterministic=True`` the flashinfer backend plans every sequence (decodes included) on
the prefill wrapper with a fixed KV split (``fixed_split_size``, ``disable_split_kv=False``;
radixserve/attention/flashinfer_backend.py) and the model's linear layers run in row blocks
that ``radixserve.model.invariant_ops.choose_row_blocks`` checked on this GPU (falling back
to fixed 32-row tiles). Checked here, on the default model with greedy decoding:
  - row blocks: which blocks each linear shape got (the measured ones, or the fallback);
  - the prompts (two system prompts x questions) (a) one at a time with the cache off and
    (b) all at once with the cache on, page size 16, a small chunked-prefill budget:
    identical token for token, and how many replies differ in the default mode for contrast;
  - attention alone (``tile_invariance``): one query row, bit for bit, as a decode alone, in
    a batch of 63 other decodes, next to a long prefill (batch invariance: the guarantee),
    and as the last row of prefill chunks of 4, 30 and 100 tokens (other query-tile
    classes: measured, not guaranteed on CUDA; docs/deterministic.md).
"""

from __future__ import annotations

from types import ModuleType

QUESTIONS = ["What is the capital of France?", "Which river flows through Cairo?",
             "How tall is Mount Everest?", "Where is the Colosseum?",
             "What is the capital of Kenya?", "Where is the Taj Mahal?"]
SYSTEMS = ["You are a meticulous assistant for a travel company. Answer in one sentence. " * 6,
           "You are a terse geography tutor. Reply with the answer only. " * 6]


def _tokens(gc: ModuleType, loaded, prompts, max_tokens, one_at_a_time,
            **config) -> tuple[list, dict]:
    """Greedy replies, and the row blocks each linear shape of the engine's model got."""
    import asyncio

    from radixserve.engine.config import EngineConfig
    from radixserve.engine.engine import Engine
    from radixserve.engine.sampling_params import SamplingParams

    engine = Engine(EngineConfig(**config), loaded)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(prompt):
        return await gc.greedy_tokens(engine, prompt, params)

    async def run():
        await engine.start()
        try:
            if one_at_a_time:
                return [await one(p) for p in prompts]
            return list(await asyncio.gather(*(one(p) for p in prompts)))
        finally:
            await engine.shutdown()

    outputs = asyncio.run(run())
    blocks = {str(tuple(m.weight.shape)): str(m.row_blocks)
              for m in engine.runner.model.modules() if hasattr(m, "row_blocks")}
    del engine
    gc._release_memory()
    return outputs, blocks


def tile_invariance(device: str, backend_name: str, dtype_name: str = "bfloat16",
                    others: int = 64) -> dict:
    """One query row's attention output computed in several step shapes, bit-compared:
    alone, among ``others`` decodes, next to a prefill, and at the end of chunks."""
    import numpy as np
    import torch

    from radixserve.attention.backend import create_backend
    from radixserve.attention.kv_pool import KVPool
    from radixserve.attention.metadata import SeqSpan, build_metadata

    hq, hkv, d, ps, length = 32, 8, 128, 16, 300
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator(device="cpu").manual_seed(0)
    backend = create_backend(backend_name, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                             dtype=dtype, device=device, deterministic=True)
    other_len = 40
    pages_per = -(-max(length, 256) // ps)
    pool = KVPool(1, pages_per * (others + 2), ps, hkv, d, dtype, device)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device, dtype)  # noqa: E731
    seqs = []                          # (pages, full k, full v) per sequence
    for i in range(others + 2):
        n = length if i == 0 else (256 if i == others + 1 else other_len)
        pages = np.arange(i * pages_per, i * pages_per + -(-n // ps), dtype=np.int32)
        seqs.append((pages, rand(n, hkv, d), rand(n, hkv, d)))
    queries = [rand(len(k), hq, d) for _, k, _ in seqs]

    def row_of_x(spec: list[tuple[int, int]]) -> torch.Tensor:
        """spec: (sequence, new tokens) per span, sequence 0 (X) last; X's last row out."""
        spans, q, k, v = [], [], [], []
        for i, new in spec:
            pages, fk, fv = seqs[i]
            n = len(fk)
            spans.append(SeqSpan(pages, n - new, new))
            q.append(queries[i][n - new:])
            k.append(fk[n - new:])
            v.append(fv[n - new:])
        order = sorted(range(len(spans)), key=lambda j: spans[j].new_len == 1)  # prefills first
        spans, q, k, v = ([xs[j] for j in order] for xs in (spans, q, k, v))
        for (pages, fk, fv), span in zip([seqs[i] for i, _ in [spec[j] for j in order]], spans):
            pos = np.arange(span.cached_len)
            slots = torch.from_numpy(pages[pos // ps].astype(np.int64) * ps + pos % ps)
            pool.write(0, slots.to(device), fk[:span.cached_len], fv[:span.cached_len])
        meta = build_metadata(spans, ps, device)
        out = backend.forward(backend.prepare(meta), 0, torch.cat(q), torch.cat(k),
                              torch.cat(v), pool)
        x_at = order.index(len(spec) - 1)
        return out[int(meta.qo_indptr[x_at + 1]) - 1].clone()

    alone = row_of_x([(0, 1)])
    batch = {f"in_{others}_decodes": row_of_x([(i, 1) for i in range(1, others + 1)] + [(0, 1)]),
             "next_to_a_256_token_prefill": row_of_x([(others + 1, 256), (0, 1)])}
    chunks = {f"last_row_of_a_{n}_token_chunk": row_of_x([(0, n)]) for n in (4, 30, 100)}
    same = lambda t: bool(torch.equal(t, alone))  # noqa: E731
    diff = lambda t: (t.float() - alone.float()).abs().max().item()  # noqa: E731
    return {"backend": backend.name, "dtype": dtype_name, "heads": [hq, hkv, d],
            "batch_invariant": {k: same(t) for k, t in batch.items()},
            "chunk_class": {k: {"identical": same(t), "max_abs_diff": diff(t)}
                            for k, t in chunks.items()}}


def check_deterministic(report: dict, gc: ModuleType, ctx) -> None:
    section: dict = {"status": "running"}
    report["deterministic"] = section
    try:
        section["tile_invariance"] = tile_invariance(ctx.device, ctx.backend_under_test,
                                                     others=8 if ctx.dry_run else 64)
    except Exception as exc:           # recorded; the engine comparison still runs
        section["tile_invariance"] = gc._error(exc)
    gc.flush(report)
    loaded = ctx.model()
    section["model"] = ctx.model_info
    questions = QUESTIONS[:max(2, ctx.sizes.greedy_questions)]
    prompts = [loaded.tokenizer.apply_chat_template(
        [{"role": "system", "content": s}, {"role": "user", "content": q}])
        for s in SYSTEMS for q in questions]
    n_tok = ctx.sizes.greedy_tokens
    base = dict(attention_backend=ctx.backend_under_test, device=ctx.device,
                kv_cache_tokens=ctx.sizes.engine_kv_tokens, warmup_tokens=0)
    runs = {}
    # The default mode's contrast only on a GPU (the CPU dry run must stay short).
    for mode in (True,) if ctx.dry_run else (True, False):
        alone, section["row_blocks"] = _tokens(gc, loaded, prompts, n_tok, True, **base,
                                               deterministic=mode, disable_radix_cache=True)
        together, _ = _tokens(gc, loaded, prompts, n_tok, False, **base, deterministic=mode,
                              page_size=16, chunked_prefill_size=64)
        runs[mode] = alone, together
    same = {mode: f"{sum(a == b for a, b in zip(*runs[mode]))}/{len(prompts)}"
            for mode in runs}
    section.update(prompts=len(prompts), tokens_each=n_tok,
                   identical_deterministic=same[True],
                   identical_default_mode=same.get(False, "not run (dry run)"),
                   attention_backend=ctx.backend_under_test)
    tiles = section["tile_invariance"].get("batch_invariant", {"error": False})
    section["status"] = ("ok" if same[True] == f"{len(prompts)}/{len(prompts)}"
                         and all(tiles.values()) else "FAILED")
