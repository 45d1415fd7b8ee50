"""Engine: the asyncio front of the scheduler. Callers `generate`; one loop task steps.

All scheduler state is touched only on the event loop; the forward pass runs in a single
worker thread, so the loop keeps serving HTTP while a step computes. Requests come in
through `generate` and leave through per-request asyncio queues.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

import torch

from radixserve.attention.page_bytes import page_payload_bytes
from radixserve.cache.memory import PagedMemory
from radixserve.cache.radix_cache import CacheLockedError, RadixCache
from radixserve.cache.window_memory import WindowedMemory
from radixserve.cache.window_files import StoredWindows
from radixserve.cache.window_rule import WindowRule
from radixserve.engine.compute_thread import compute_executor, on_compute_thread
from radixserve.engine.config import EngineConfig
from radixserve.engine.core import EngineCore
from radixserve.engine.cache_stats import CacheStats
from radixserve.engine.kv_persistence import KVPersistence, open_store
from radixserve.engine.window_persistence import SavedWindows
from radixserve.engine.errors import (CacheBusy, EngineStopped, EngineUnhealthy, InvalidRequest,
                                      NoDiskStore, PinConflict, QueueFull)
from radixserve.engine.output_processor import OutputProcessor
from radixserve.engine.outputs import EngineStats, GrammarMaskStats, OneProcessStats, RequestOutput
from radixserve.cache.namespaces import in_namespace
from radixserve.engine.pins import PinBook, PinInfo
from radixserve.engine.request import Request, new_request
from radixserve.engine.runner import ModelRunner
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.scheduler import DECODE_RESERVE_TOKENS, Scheduler, SchedulerConfig
from radixserve.engine.seeds import SampleSeeds
from radixserve.engine.seq_memory import SequenceMemory
from radixserve.engine.tier_setup import make_peer_share, make_tiers
from radixserve.engine.validation import check_request
from radixserve.kv_sizing import DEFAULT_CHECKPOINT_WINDOWS
from radixserve.model import LoadedModel

log = logging.getLogger(__name__)


class Engine(OneProcessStats):
    def __init__(self, config: EngineConfig, loaded: LoadedModel):
        self.config = config
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.runner = on_compute_thread(ModelRunner, config, loaded)
        self.page_size = config.page_size
        self.tree = RadixCache(page_size=config.page_size, policy=config.eviction_policy)
        self.memory = self._memory()
        self._executor = compute_executor()
        # Held by each step (schedule, forward, complete) and by the disk saves' page copies.
        self._step_lock = asyncio.Lock()
        # --kv-disk-dir: one store for the disk tier's pages and the saved cache.
        store = open_store(config, self.runner)
        self.tiers = make_tiers(config, self.runner, self.tree, store)
        if self.tiers is not None and isinstance(self.memory, WindowedMemory):
            self.memory.follow(self.tiers.lower)    # demoted nodes keep their windows
            self.runner.windowed.attach(self.memory.windows.of_page)
            if self.tiers.lower.disk is not None:      # their window files, read back
                self.memory.stored = StoredWindows(
                    self.memory, self.tiers.lower, self.tiers.lower.disk,
                    page_payload_bytes(self.runner.windowed.pool))
        self.kv_events = self._kv_events(config)
        self.persistence = (KVPersistence(store, self.tree, self.tiers, self.runner.mover,
                                          self._on_compute, self._step_lock,
                                          self._saved_windows(store))
                            if store is not None else None)
        self.peers = make_peer_share(config, self.runner, self.tiers)    # --kv-share
        self.seq_memory = SequenceMemory(self.memory, use_cache=not config.disable_radix_cache,
                                         tiers=self.tiers, peers=self.peers)
        self.pool_tokens = self.runner.num_pages * config.page_size
        self.max_model_len = self._max_model_len()
        self.pins = PinBook(self.memory, self._pin_limit())
        self._stats = EngineStats(pages_total=self.runner.num_pages, page_size=config.page_size)
        self.scheduler = Scheduler(
            SchedulerConfig(page_size=config.page_size,
                            max_running=config.max_running_requests,
                            token_budget=config.chunked_prefill_size,
                            policy=config.schedule_policy,
                            max_wait_steps=config.lpm_max_wait_steps),
            self.seq_memory, self._stats)
        self.outputs = OutputProcessor(self.tokenizer, self._stats, self.max_model_len)
        self.core = EngineCore(self.scheduler, self.outputs)
        self._ids = itertools.count()
        self._seeds = SampleSeeds(config.seed)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._failure: str | None = None

    def _kv_events(self, config: EngineConfig):
        """--kv-events: the tree's observer and the publisher (None: off). Imported here,
        so an engine without events never loads ZeroMQ."""
        if not config.kv_events:
            return None
        if config.disable_radix_cache:
            log.warning("--kv-events ignored: --disable-radix-cache leaves nothing to announce")
            return None
        from radixserve.events.stream import KVEvents, KVEventsConfig

        return KVEvents(self.tree, KVEventsConfig.from_engine(config), str(self.runner.device))

    def _publish_events(self, at_once: bool = True) -> None:
        """Hand the events of the last step (or admin change) to the publisher; after a
        step (`at_once` False) only once --kv-events-interval-ms has passed
        (KVEvents.after_step), the rest being handed over when the engine goes idle."""
        if self.kv_events is None:
            return
        if at_once:
            self.kv_events.flush()
        else:
            self.kv_events.after_step()

    def _memory(self) -> PagedMemory:
        """The page accounting: with per-group pools, the windowed pool's too."""
        if self.runner.windowed is None:
            return PagedMemory(self.runner.num_pages, self.tree)
        rule = WindowRule.of(self.runner.window, self.config.page_size,
                             self.config.kv_window_checkpoint, DEFAULT_CHECKPOINT_WINDOWS)
        memory = WindowedMemory(self.runner.num_pages, self.tree, self.runner.window_pages,
                                rule)
        self.runner.windowed.attach(memory.windows.of_page)
        return memory

    def _saved_windows(self, store) -> SavedWindows | None:
        """With per-group pools, the windows a save writes beside the pages."""
        if not isinstance(self.memory, WindowedMemory):
            return None
        return SavedWindows(self.memory, self.runner.windowed, store)

    async def _on_compute(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _max_model_len(self) -> int:
        model_len = self.loaded.config.max_position_embeddings
        wanted = self.config.max_model_len or model_len
        if wanted > model_len:
            raise ValueError(f"--max-model-len {wanted} exceeds the model's context {model_len}")
        # One sequence must always fit in the pool alone, or preemption could not help.
        limit = self.pool_tokens - DECODE_RESERVE_TOKENS - self.page_size
        if wanted > limit:
            log.warning("max model length lowered from %d to %d: the KV pool holds %d tokens",
                        wanted, limit, self.pool_tokens)
            wanted = limit
        return wanted

    def _pin_limit(self) -> int:
        """--max-pinned-tokens (default: a quarter of the pool), lowered so that a request
        of the full context still fits beside the pins: pinned pages are never evicted."""
        wanted = self.config.max_pinned_tokens
        if wanted is None:
            wanted = self.pool_tokens // 4
        room = self.pool_tokens - self.max_model_len - DECODE_RESERVE_TOKENS - self.page_size
        limit = max(0, min(wanted, room))
        if wanted > limit and self.config.max_pinned_tokens is not None:
            log.warning("max pinned tokens lowered from %d to %d: the KV pool holds %d tokens "
                        "and one request may need %d", wanted, limit, self.pool_tokens,
                        self.max_model_len)
        return limit

    # ---- lifecycle ----------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """True from the end of `start` (warm-up done, loop running) until `shutdown`:
        what the server's /health reports."""
        return self._task is not None and not self._stopping

    async def start(self) -> None:
        if self._task is None:
            await self._warm_up()
            if self.persistence is not None and self.persistence.restored is None:
                await self.persistence.restore()
                self._publish_events()      # announce what the restart reloaded
            self._wake = asyncio.Event()
            self._stopping = False
            self._task = asyncio.get_running_loop().create_task(self._run_loop())

    async def _warm_up(self) -> None:
        """A throw-away prefill on the compute thread (see ModelRunner.warm_up), into pages
        borrowed from the free list and returned right after: the pool is untouched."""
        wanted = self.config.warmup_tokens
        if wanted is None:
            wanted = self.config.chunked_prefill_size
        num_tokens = min(wanted, self.max_model_len, self.pool_tokens)
        if num_tokens <= 0:
            return
        pages = self.memory.alloc(self.seq_memory.pages_for(num_tokens))
        try:
            await asyncio.get_running_loop().run_in_executor(
                self._executor, self.runner.warm_up, pages, num_tokens)
        finally:
            self.memory.free(pages)

    async def shutdown(self, grace_s: float = 0.0, save_by: float | None = None) -> None:
        """Stop taking requests, let running ones finish for `grace_s`, abort the rest;
        then, with --kv-disk-dir, save the cache to disk, copying pages until `save_by`
        (time.monotonic; None: all of them)."""
        await self._stop_loop(grace_s)
        compiled = getattr(self.runner, "compiled_decode", None)   # a NullRunner has none
        if compiled is not None:            # a compile still running stops
            compiled.close()
        # Only after a restore: the tree then holds what the directory did (or more).
        if (self.persistence is not None and self.persistence.restored is not None
                and self._failure is None):
            report = await self.persistence.save(save_by)
            log.info("KV disk store: saved on shutdown: %s", report.as_dict())
        if self.tiers is not None:
            await self.tiers.close()            # queued pages written first
        if self.persistence is not None:
            self.persistence.store.close()      # another engine may open the directory
        if self.kv_events is not None:
            self.kv_events.close()
        if self.peers is not None:
            # A step cut short still hands its pages over; a stuck store holds neither
            # this nor the threads' stop longer than the peers' close bound (logged).
            await self.share_published(self.peers.close_wait_s)
            await asyncio.to_thread(self.peers.close, self.peers.close_wait_s)

    async def share_published(self, timeout: float | None = None) -> bool:
        """--kv-share: wait until the pages queued for publishing so far are in the store
        (False: `timeout` seconds passed first). The step that copies them runs on the
        compute thread (one thread: a no-op queued behind it runs once it has), then the
        publisher thread hands them over."""
        if self.peers is None:
            return True
        await self._on_compute(lambda: None)
        return await asyncio.to_thread(self.peers.drain, timeout)

    async def save_cache(self, deadline: float | None = None) -> dict:
        """Write the cache to --kv-disk-dir now (POST /cache/save); requests keep running.
        Raises NoDiskStore without one."""
        if self.persistence is None:
            raise NoDiskStore("the server was started without a usable --kv-disk-dir")
        return (await self.persistence.save(deadline)).as_dict()

    async def _stop_loop(self, grace_s: float) -> None:
        self._stopping = True
        if self._task is None:
            return
        deadline = asyncio.get_running_loop().time() + grace_s
        while self.scheduler.has_work() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self.scheduler.requests):
            self.scheduler.abort(request_id)
        self._wake.set()
        while self.scheduler.has_work() and not self._task.done():
            await asyncio.sleep(0.01)
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._task = None
        self.pins.fail_pending(EngineStopped("the engine stopped before the prefix was pinned"))
        self.pins.drop_all()

    # ---- requests -----------------------------------------------------------------

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                 namespace: str | None = None,
                 request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request and return its stream of outputs.

        Raises InvalidRequest / QueueFull / EngineStopped here, before anything is queued.
        """
        self._check_running()
        request, queue = self._submit(self._validate(prompt_ids, params), params, namespace,
                                      request_id)
        return self._stream(request, queue)

    def _check_running(self) -> None:
        if self._failure is not None:
            raise EngineUnhealthy(f"the engine stopped after an internal error: {self._failure}")
        if self._stopping or self._task is None:
            raise EngineStopped("the engine is not running")

    def _submit(self, prompt: list[int], params: SamplingParams, namespace: str | None,
                request_id: str | None) -> tuple[Request, asyncio.Queue]:
        """Queue a validated request; QueueFull / EngineStopped before anything is queued."""
        self._check_running()
        waiting = self.scheduler.num_waiting_requests
        if waiting >= self.config.max_queue_len:
            raise QueueFull(f"{waiting} requests are waiting "
                            f"(the queue holds {self.config.max_queue_len})")
        request_id = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        if request_id in self.scheduler.requests:
            raise InvalidRequest("request_id", f"request id {request_id!r} is already running")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        request = new_request(request_id, prompt, params, namespace, queue.put_nowait,
                              self.page_size, self._generators(params))
        self.core.add(request)
        self._wake.set()
        return request, queue

    def _validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        prompt = [int(t) for t in prompt_ids]
        check_request(prompt, params, self.tokenizer.vocab_size, self.max_model_len)
        return prompt

    def _generators(self, params: SamplingParams) -> list[torch.Generator | None]:
        return [None if seed is None else torch.Generator().manual_seed(seed)
                for seed in self._seeds.for_request(params)]

    async def _stream(self, request: Request, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        remaining = len(request.sequences)
        try:
            while remaining:
                out = await queue.get()
                remaining -= out.finished
                yield out
        finally:
            if remaining:           # the consumer went away: abort what is left
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        if self.scheduler.abort(request_id) and self._wake is not None:
            self._wake.set()

    # ---- pinned prefixes (engine/pins.py) -----------------------------------------

    async def pin(self, prompt_ids: Sequence[int], namespace: str | None = None) -> PinInfo:
        """Keep the prompt's whole pages in the pool until `unpin`: computed first (one
        prefill through the scheduler) when not all cached. The same prefix pinned again
        keeps its pin (same id, `created=False`). Raises InvalidRequest (bad ids, too long
        for the context, shorter than a page), PinConflict / PinLimitExceeded (409),
        QueueFull / EngineStopped as `generate` does."""
        self._check_running()
        if self.config.disable_radix_cache:
            raise PinConflict("pinning needs the prefix cache, and this server runs with "
                              "--disable-radix-cache", code="cache_disabled")
        params = SamplingParams(max_tokens=1, temperature=0.0)
        prompt = self._validate(prompt_ids, params)
        size = len(prompt) - len(prompt) % self.page_size
        if size == 0:
            raise InvalidRequest("prompt", f"the prompt has {len(prompt)} tokens, less than one "
                                           f"KV page ({self.page_size} tokens): nothing to pin")
        tokens = prompt[:size]
        if (known := self.pins.find(tokens, namespace)) is not None:
            return self.pins.hold(tokens, namespace, known.cached_tokens)
        pending = self.pins.pending_for(tokens, namespace)     # asked twice at once
        first = pending is None
        if first:
            self.pins.check_room(size)
            cached = self.tree.peek_prefix(tokens, namespace)
            cached -= cached % self.page_size
            if cached == size:
                return self.pins.hold(tokens, namespace, cached)
            request, _ = self._submit(prompt, params, namespace, None)
            pending = self.pins.expect(request, tokens, namespace, cached)
        try:
            info = await asyncio.shield(pending.done)
        except asyncio.CancelledError:
            if self.pins.cancel(pending):
                self.abort(pending.request.request_id)
            raise
        return info if first else dataclasses.replace(info, created=False)

    async def unpin(self, pin_id: str) -> PinInfo:
        """Release a pin (UnknownPin when no pin has this id): its pages stay cached and
        become evictable."""
        return self.pins.unpin(pin_id)

    def pinned(self) -> list[PinInfo]:
        """The pins, oldest first."""
        return self.pins.infos()

    # ---- the loop -----------------------------------------------------------------

    async def _run_loop(self) -> None:
        """Step until cancelled. Anything that escapes a step's own error handling (a
        failed invariant check, a bug in failing a step) stops the engine loudly."""
        try:
            await self._steps()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fail_engine(exc)

    def _fail_engine(self, error: Exception) -> None:
        """Log, mark the engine unhealthy, and end every live request with an error."""
        log.critical("engine stopped: %s: %s", type(error).__name__, error, exc_info=error)
        self._failure = f"{type(error).__name__}: {error}"
        self.pins.fail_pending(EngineUnhealthy(self._failure))
        try:
            self.core.fail_all(error)
        except Exception:
            log.exception("could not release the live requests' pages")
        # Whatever failing them left open still gets its final event.
        seqs = [s for r in self.scheduler.requests.values() for s in r.sequences]
        self.outputs.finish(seqs, "error", time.monotonic(), error)

    @property
    def error(self) -> str | None:
        """Why the engine cannot serve (None while it can): an internal failure stopped it,
        or its loop ended while it was not shutting down. /health reports this."""
        if self._failure is not None:
            return self._failure
        if self._task is not None and self._task.done() and not self._stopping:
            return "the engine loop is not running"
        return None

    @property
    def healthy(self) -> bool:
        return self.error is None

    async def _steps(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self.pins.settle()      # before any step can evict what a pin request inserted
            if not self.scheduler.has_work():
                if self.config.debug_invariants:
                    self.check_invariants()
                self._publish_events()      # what pins or admin calls changed meanwhile
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self._step_lock:
                stepped = await self._step(loop)
                self._publish_events(at_once=False)
            if not stepped:
                # Nothing fits right now (all waiting, memory short): let aborts arrive.
                await asyncio.sleep(0.001)

    async def _step(self, loop: asyncio.AbstractEventLoop) -> bool:
        """One step: schedule, forward pass, complete. False when nothing could run."""
        try:
            plan = self.core.schedule()
        except Exception as exc:  # a scheduler bug must not leave requests hanging
            log.exception("scheduling step %d failed", self.scheduler.step)
            self.core.fail_all(exc)
            return True
        if not plan.batch:
            return False
        try:
            result = await loop.run_in_executor(self._executor, self.runner.execute, plan.batch)
        except Exception as exc:  # a failed step fails its requests, not the engine
            log.exception("step %d failed", self.scheduler.step)
            self.core.fail_step(plan, exc)
            return True
        if self.tiers is not None:
            self.tiers.observe(result, plan.batch.num_tokens)
        elif self.peers is not None:        # (with tiers, their costs are the peers' too)
            self.peers.costs.observe_prefill(plan.batch.num_tokens, result.forward_seconds)
        try:
            self.core.complete(plan, result)
        except Exception as exc:
            log.exception("completing step %d failed", self.scheduler.step)
            self.core.fail_all(exc)
        return True

    # ---- introspection ------------------------------------------------------------

    def stats(self) -> EngineStats:
        s = self._stats
        s.running = self.scheduler.num_running_requests    # requests, as the metrics say
        s.waiting = self.scheduler.num_waiting_requests
        s.pages_free = self.memory.num_free
        s.pages_cached = self.tree.total_tokens // self.page_size
        s.pages_locked = self.tree.locked_tokens // self.page_size
        s.pages_private = s.pages_total - s.pages_free - s.pages_cached
        s.kv_pool_bytes = self.runner.kv_bytes
        s.evicted_tokens = self.memory.evicted_tokens
        s.pinned_tokens = self.pins.pinned_tokens
        s.pinned_prefixes = self.pins.count
        s.pinned_tokens_limit = self.pins.limit
        s.cache = CacheStats(
            cached_tokens=self.tree.total_tokens,
            evictable_tokens=self.tree.evictable_tokens,
            locked_tokens=self.tree.locked_tokens,
            nodes=self.tree.num_nodes,
            query_tokens=s.prefix_query_tokens,
            hit_tokens=s.prefix_hit_tokens,
            enabled=not self.config.disable_radix_cache,
        )
        if self.tiers is not None:
            s.tiers = self.tiers.stats()
        s.share = self.peers.stats() if self.peers is not None else None
        s.kv_disk = self.persistence.stats() if self.persistence is not None else None
        s.kv_events = self.kv_events.stats if self.kv_events is not None else None
        masks = self.runner.sampler.masks
        s.grammar_masks = GrammarMaskStats(steps=masks.steps, rows=masks.rows,
                                           seconds=masks.seconds)
        return s

    def cache_summary(self, top_k: int = 20) -> dict:
        from radixserve.cache.summary import build_summary

        return build_summary(self.tree, top_k)

    def cache_tree(self, limit: int, namespace: str | None = None, *, label_key: bytes,
                   reveal: Callable[[str | None], bool]) -> dict:
        """The bounded tree view behind GET /cache/tree (cache/summary.py: build_tree)."""
        from radixserve.cache.summary import build_tree

        return build_tree(self.tree, limit, namespace, label_key=label_key, reveal=reveal)

    def describe_kv_cache(self) -> str:
        """The start-up line on the KV cache's dtypes and capacity gain."""
        return self.runner.describe_kv_cache()

    def describe_weights(self) -> str:
        """The start-up line on the resident weights."""
        return self.runner.loaded.describe_weights()

    async def flush_cache(self) -> None:
        """Empty the tree; pinned prefixes (and their paths) stay."""
        if self.scheduler.has_work():
            raise CacheBusy(f"{self.scheduler.num_live} requests are running")
        try:
            if self.pins.count:
                self.memory.free(self.tree.evict(self.tree.evictable_tokens))
                return
            self.memory.flush_cache()
        except CacheLockedError as exc:
            raise CacheBusy(str(exc)) from exc
        finally:
            self._publish_events()

    async def flush_namespace(self, namespace: str | None) -> int:
        """Drop one namespace's cached prefixes (and those nested under it); the pages
        freed. Requests of other namespaces may keep running; refused (CacheBusy) while a
        pin or a request holds prefixes in it."""
        held = [p for p in self.pins.infos() if in_namespace(p.namespace, namespace)]
        if held:
            raise CacheBusy(f"{len(held)} pinned prefix(es) are in this namespace; unpin them "
                            f"first (DELETE /cache/pin/{{id}})")
        try:
            return self.memory.flush_namespace(namespace)
        except CacheLockedError as exc:
            raise CacheBusy(str(exc)) from exc
        finally:
            self._publish_events()

    async def namespace_stats(self, namespace: str | None) -> dict[str, int]:
        return self.tree.namespace_counts(namespace)

    def check_invariants(self) -> None:
        """Page conservation; with no live request, no lock may be held."""
        live = self.scheduler.running + self.scheduler.waiting
        self.seq_memory.check(live)
        if not live:
            pinned = self.pins.locked_tokens()
            assert self.tree.locked_tokens == pinned, \
                f"{self.tree.locked_tokens} tokens locked with no live request, {pinned} pinned"
