"""What the front end tells the router about a call, passed as the call's first argument.

Ray Serve hands a request's arguments to the `RequestRouter`, so this is how a request's
block hashes reach the router without the router decoding anything. `prompt` (text) is
only filled for Ray's PrefixCacheAffinityRouter, which reads `.prompt` from an argument.
`target` pins a control call (stats, flush) to one replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RouteInfo:
    hashes: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    target: str | None = None          # a replica id: this call must go there
    prompt: str = ""                   # prompt text, for the prefix-affinity router only
    routing_key: int | None = None     # a prompt_cache_key's stable hash (routers.py)
