"""`radixserve chat "question"`: one chat reply, streamed to the terminal as it is made."""

from __future__ import annotations

import argparse
import asyncio
import sys

from radixserve.engine.config import EngineConfig, add_engine_arguments
from radixserve.engine.sampling_params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the user's message")
    parser.add_argument("--system", default=None, help="a system prompt")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    add_engine_arguments(parser)
    parser.set_defaults(kv_cache_tokens=None)


async def chat(config: EngineConfig, messages: list[dict], params: SamplingParams) -> None:
    from radixserve.engine.engine import Engine
    from radixserve.engine.model_loading import load_engine_model

    loaded = load_engine_model(config)
    engine = Engine(config, loaded)
    await engine.start()
    try:
        prompt = engine.tokenizer.apply_chat_template(messages)
        async for out in engine.generate(prompt, params):
            sys.stdout.write(out.text)
            sys.stdout.flush()
            if out.finished and out.error:
                print(f"\nerror: {out.error}", file=sys.stderr)
        sys.stdout.write("\n")
    finally:
        await engine.shutdown()


def run(args: argparse.Namespace) -> int:
    config = EngineConfig.from_args(args)
    if config.kv_cache_tokens is None:
        config.kv_cache_tokens = 16384      # one reply needs little; start fast
    messages = ([{"role": "system", "content": args.system}] if args.system else [])
    messages.append({"role": "user", "content": args.prompt})
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    asyncio.run(chat(config, messages, params))
    return 0
