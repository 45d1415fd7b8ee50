"""A request's miss report (cache/miss_reasons.py) as the `radixserve` usage extension:
where the prompt stopped matching the cache and why, and, for a divergence, a few decoded
tokens of the prompt and of the cached path around the first differing position.

The divergence's cached side comes from the request's own namespace (its key, refined by
its `cache_salt`), so the tokens shown are the same tenant's own; a match in another
namespace is only named, never shown.
"""

from __future__ import annotations

from typing import Any

from radixserve.cache.miss_reasons import MissReport
from radixserve.server.engine_client import TokenizerClient


def cache_extension(miss: MissReport | None, tokenizer: TokenizerClient) -> dict[str, Any] | None:
    if miss is None:
        return None
    out: dict[str, Any] = miss.as_dict()
    d = miss.divergence
    if d is not None:
        def decoded(ids: tuple[int, ...]) -> list[str]:
            return [tokenizer.decode([i], skip_special_tokens=False) for i in ids]

        out["divergence"] = {"position": d.position, "start": d.start,
                             "prompt_token_ids": list(d.prompt_tokens),
                             "cached_token_ids": list(d.cached_tokens),
                             "prompt": decoded(d.prompt_tokens),
                             "cached": decoded(d.cached_tokens)}
    return out
