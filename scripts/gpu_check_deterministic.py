"""The `deterministic` section of scripts/gpu_check.py: --deterministic on the CUDA path.

With ``deterministic=True`` the flashinfer backend plans every sequence (decodes included) on
the prefill wrapper with a fixed KV split (``fixed_split_size``, ``disable_split_kv=False``;
radixserve/attention/flashinfer_backend.py) and the model's linear layers run in row blocks
that ``radixserve.model.invariant_ops.choose_row_blocks`` checked on this GPU (falling back
to fixed 32-row tiles). Checked here, on the default model with greedy decoding:
  - row blocks: which blocks each linear shape got (the measured ones, or the fallback);
  - the prompts (two system prompts x questions) (a) one at a time with the cache off and
    (b) all at once with the cache on, page size 16, a small chunked-prefill budget:
    identical token for token, and how many replies differ in the default mode for contrast.
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


def check_deterministic(report: dict, gc: ModuleType, ctx) -> None:
    section: dict = {"status": "running"}
    report["deterministic"] = section
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
    section["status"] = "ok" if same[True] == f"{len(prompts)}/{len(prompts)}" else "FAILED"
