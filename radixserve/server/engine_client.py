"""What the server needs from an engine: the protocol it types against.

`radixserve.engine.engine.Engine` satisfies it, so do the Ray client of `--replicas N`
(`radixserve.cluster.client.RayEngineClient`) and the model-free fake engine of the server
tests; the server never reaches past it (no `getattr` probing, no `engine.tree`, no
`engine.runner`). Every admin call is a coroutine, because behind Ray each one is a round
trip to every replica; a local engine's run on the event loop without awaiting anything.
"""

from __future__ import annotations

from typing import AsyncGenerator, Callable, Protocol, Sequence, runtime_checkable

from radixserve.engine.outputs import EngineStats, RequestOutput
from radixserve.engine.pins import PinInfo
from radixserve.engine.sampling_params import SamplingParams


@runtime_checkable
class TokenizerClient(Protocol):
    """Text <-> token ids, and the chat template. Called on a worker thread, never on the
    event loop (server/prompts.py)."""

    vocab_size: int
    max_token_chars: int            # the longest vocabulary entry, in characters

    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict],
                            add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class ServedConfig(Protocol):
    """What the server reads of an engine's configuration: an `EngineConfig` locally, a
    `ClientConfig` behind Ray."""

    @property
    def model(self) -> str:
        """The served model's default name (`--served-model-name` overrides it)."""
        ...


@runtime_checkable
class EngineClient(Protocol):
    @property
    def config(self) -> ServedConfig: ...

    max_model_len: int              # the effective context length (may be below the model's)
    tokenizer: TokenizerClient

    async def start(self) -> None: ...

    async def shutdown(self, grace_s: float = 0.0, save_by: float | None = None) -> None: ...

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                 namespace: str | None = None,
                 request_id: str | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Queue a request; raises InvalidRequest / QueueFull / EngineStopped before queueing."""
        ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def replica_stats(self) -> dict[str, EngineStats]:
        """Stats per replica behind this client (`--replicas N`); empty for one engine."""
        ...

    async def refresh_stats(self) -> object:
        """Fetch stats that live elsewhere (Ray replicas) before reading `stats`."""
        ...

    def metrics_collector(self) -> object | None:
        """Extra Prometheus collector (per-replica and router metrics), or None."""
        ...

    def describe_kv_cache(self) -> str | None:
        """One start-up line on the KV cache's dtypes and capacity gain, or None where the
        pools live elsewhere (Ray replicas print their own)."""
        ...

    def describe_weights(self) -> str | None:
        """One start-up line on the resident weights (dtype, bytes against the file's), or
        None where the model lives elsewhere (Ray replicas)."""
        ...

    async def flush_cache(self) -> None:
        """Drop every namespace's cached prefixes (CacheBusy while requests run)."""
        ...

    async def save_cache(self) -> dict:
        """Write the cache to --kv-disk-dir now (NoDiskStore without one); the report."""
        ...

    async def flush_namespace(self, namespace: str | None) -> int:
        """Drop the cached prefixes of one namespace and the namespaces under it
        (`namespace/...`); returns the pages freed (CacheBusy if any of them is locked)."""
        ...

    async def namespace_stats(self, namespace: str | None) -> dict[str, int]:
        """Counters of one namespace and those under it: `cached_tokens`, `nodes`."""
        ...

    async def pin(self, prompt_ids: Sequence[int], namespace: str | None = None) -> PinInfo:
        """Keep the prompt's whole pages in the pool until `unpin` (computed first when not
        cached); InvalidRequest, PinConflict / PinLimitExceeded (409), QueueFull."""
        ...

    async def unpin(self, pin_id: str) -> PinInfo:
        """Release a pin; UnknownPin (404) when no pin has this id."""
        ...

    def pinned(self) -> list[PinInfo]:
        """Every pin, oldest first (ids, sizes, namespaces; no tokens)."""
        ...

    def cache_tree(self, limit: int, namespace: str | None = None, *, label_key: bytes,
                   reveal: Callable[[str | None], bool]) -> dict:
        """The bounded tree view of GET /cache/tree (cache/summary.py: build_tree); token
        ids only for namespaces where `reveal(namespace)` is true. Unsupported (409) where
        there is no one tree (Ray replicas)."""
        ...

    @property
    def ready(self) -> bool:
        """True once the engine can serve (warm-up done, loop running)."""
        ...

    @property
    def error(self) -> str | None:
        """Why the engine cannot serve (an internal failure stopped it), or None."""
        ...
