"""The router's view of the replicas: what each one holds and how loaded it is.

Two sources, both explicit:
- the replica's published digest (its cache as chained block hashes, as of a time on the
  replica) and its engine stats, delivered through Ray Serve's routing stats; a digest
  replaces the previous one whole, so the view is exact as of the digest's time;
- the router's own bookkeeping of what it sent where: requests in flight (and their
  uncached prompt tokens, the prefill a replica still owes), and the block hashes of
  requests routed since the last digest. Those count as held by their replica until a
  digest taken after the request completed arrives (then the digest says whether the
  prefix is still there). This bridges the digest period so a burst sharing a new prefix
  is not scattered; it never outlives one digest period after completion.

Pure Python: no Ray, so the policy and its bookkeeping are tested without a cluster.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from radixserve.engine.outputs import EngineStats
from radixserve.routing import RouteRequest

from .cache_digest import CacheDigest
from .prefix_hashes import matched_blocks

MAX_BRIDGE_S = 30.0      # a finished request counts as held this long at most without a digest
TENTATIVE_S = 5.0        # a choice Ray Serve never confirmed (request gone before dispatch)


@dataclass
class RoutedRequest:
    hashes: list[int]
    uncached_tokens: int             # the prompt tokens its replica lacked when it was sent
    routed_at: float
    completed_at: float | None = None
    confirmed: bool = False          # Ray Serve dispatched it (on_request_routed)
    prompt_tokens: int = 0           # 0: unknown (its prefill owed stays uncached_tokens)

    def owed_tokens(self, digest: CacheDigest | None, block_tokens: int) -> int:
        """The prefill it still owes: what its replica lacked when it was sent, less what
        a digest taken since shows in the cache (prefilled, or loaded from a peer with
        --kv-share: a request that waited on a peer's prefill and loaded it owes nothing
        more, though it was sent as a miss)."""
        if digest is None or digest.taken_at <= self.routed_at or not self.prompt_tokens:
            return self.uncached_tokens
        done = matched_blocks(self.hashes, digest.hashes) * block_tokens
        return min(self.uncached_tokens, max(0, self.prompt_tokens - done))

    def pending(self, now: float) -> bool:
        """Still owed by its replica: not completed, and dispatched or just chosen."""
        return self.completed_at is None and (self.confirmed or now - self.routed_at < TENTATIVE_S)


@dataclass
class ReplicaState:
    replica_id: str
    digest: CacheDigest | None = None
    stats: EngineStats | None = None
    stats_at: float = 0.0                  # time.time() on the router when they arrived
    routed: dict[str, RoutedRequest] = field(default_factory=dict)

    @property
    def in_flight(self) -> int:
        now = time.time()
        return sum(1 for r in self.routed.values() if r.pending(now))

    def queued_prefill_tokens(self, block_tokens: int) -> int:
        """The prefill its requests in flight still owe (RoutedRequest.owed_tokens)."""
        now = time.time()
        return sum(r.owed_tokens(self.digest, block_tokens) for r in self.routed.values()
                   if r.pending(now))

    def held_blocks(self, hashes: Sequence[int]) -> int:
        """Leading blocks of a prompt this replica holds (or will, having been sent it)."""
        best = matched_blocks(hashes, self.digest.hashes) if self.digest else 0
        for r in self.routed.values():
            if best >= len(hashes):
                break
            if len(r.hashes) > best and r.hashes[best] == hashes[best]:
                n = best
                while n < len(hashes) and n < len(r.hashes) and r.hashes[n] == hashes[n]:
                    n += 1
                best = n
        return best

    def take_digest(self, digest: CacheDigest, stats: EngineStats | None) -> None:
        self.digest = digest
        if stats is not None:
            self.stats, self.stats_at = stats, time.time()
        # Requests that completed before the digest was taken are in it (or evicted).
        self.routed = {k: r for k, r in self.routed.items()
                       if r.completed_at is None or r.completed_at >= digest.taken_at}


class ClusterState:
    """Every replica's state, keyed by Ray Serve's replica id (unique_id).

    Ray Serve runs the router on its own event-loop thread while the HTTP front end reads
    the same state: writers and cross-thread readers hold `lock`.
    """

    def __init__(self, block_tokens: int):
        self.block_tokens = block_tokens
        self.lock = threading.RLock()
        self.replicas: dict[str, ReplicaState] = {}
        self._owner: dict[str, str] = {}          # routed request id -> replica id
        self.sent: dict[str, int] = {}             # requests dispatched to each replica, ever
        self.decisions = 0                         # routing decisions and their cost
        self.decision_seconds = 0.0
        # --router-view events: who follows each replica's advertised KV events (the
        # EventFeed: it sets the digests); None: digests come with the routing stats.
        self.event_source = None
        # What each cache-aware decision saw (a list to append to, set by a benchmark to
        # explain a spread; None: nothing recorded).
        self.decision_log: list[DecisionRecord] | None = None
        # Every request Ray Serve dispatched, in order (set by a benchmark to replay the
        # same sequence: scripts/bench_cluster.py --replay; None: nothing recorded).
        self.request_log: list[SentRecord] | None = None

    def replica(self, replica_id: str) -> ReplicaState:
        state = self.replicas.get(replica_id)
        if state is None:
            state = self.replicas[replica_id] = ReplicaState(replica_id)
        return state

    def keep_only(self, replica_ids: Sequence[str]) -> None:
        for gone in set(self.replicas) - set(replica_ids):
            self.forget(gone)
        for rid in replica_ids:
            self.replica(rid)

    def forget(self, replica_id: str) -> None:
        """A replica died: nothing it held is reachable any more."""
        state = self.replicas.pop(replica_id, None)
        if self.event_source is not None:
            self.event_source.untrack(replica_id)
        if state is not None:
            for request_id in state.routed:
                self._owner.pop(request_id, None)

    def published(self, replica_id: str, routing_stats: dict) -> None:
        if self.event_source is not None:       # the view follows the replica's events
            state = self.replica(replica_id)
            meta = routing_stats.get("kv_event_metadata")
            if meta is not None:
                self.event_source.track(replica_id, meta)
            if routing_stats.get("stats") is not None:
                state.stats, state.stats_at = routing_stats["stats"], time.time()
            return
        digest = routing_stats.get("digest")
        if digest is None:
            return
        state = self.replica(replica_id)
        if state.digest is None or digest.taken_at > state.digest.taken_at:
            state.take_digest(digest, routing_stats.get("stats"))

    def routed(self, request_id: str, replica_id: str, hashes: list[int],
               uncached_tokens: int, confirmed: bool, prompt_tokens: int = 0) -> None:
        """The router chose `replica_id` for a request (confirmed: Ray Serve dispatched it
        there). Recorded at the choice, so a burst of decisions sees the earlier ones."""
        previous = self._owner.get(request_id)
        if confirmed:
            self.sent[replica_id] = self.sent.get(replica_id, 0) + 1
        if previous == replica_id and request_id in self.replicas[replica_id].routed:
            entry = self.replicas[replica_id].routed[request_id]
            entry.confirmed = entry.confirmed or confirmed
            return
        if previous is not None and previous in self.replicas:     # rejected there: moved
            self.replicas[previous].routed.pop(request_id, None)
        state = self.replica(replica_id)
        now = time.time()
        # Never-dispatched choices, and finished requests of a replica whose digests stopped
        # coming, must not pile up.
        stale = [k for k, r in state.routed.items()
                 if (r.completed_at is not None and now - r.completed_at > MAX_BRIDGE_S)
                 or (r.completed_at is None and not r.pending(now))]
        for k in stale:
            del state.routed[k]
            self._owner.pop(k, None)
        state.routed[request_id] = RoutedRequest(hashes, uncached_tokens, now, None, confirmed,
                                                 prompt_tokens)
        self._owner[request_id] = replica_id

    def completed(self, request_id: str) -> None:
        replica_id = self._owner.pop(request_id, None)
        state = self.replicas.get(replica_id) if replica_id else None
        if state is not None and request_id in state.routed:
            state.routed[request_id].completed_at = time.time()

    def held_tokens(self) -> int:
        """Tokens in every replica's latest digest (what the view knows is cached)."""
        return sum(len(s.digest.hashes) * self.block_tokens
                   for s in self.replicas.values() if s.digest is not None)


@dataclass(frozen=True)
class SentRecord:
    """One request as dispatched: when, its prompt's routing hashes and length, where."""

    at: float                         # time.time() on the router
    hashes: list[int]
    prompt_tokens: int
    replica_id: str


@dataclass(frozen=True)
class DecisionRecord:
    """One cache-aware decision as its score saw it, per candidate replica (sorted ids)."""

    at: float                         # time.time() on the router
    replica_ids: list[str]
    held_tokens: list[int]            # prompt tokens each replica holds (or was sent)
    loadable_tokens: int              # prompt tokens any replica could load from the store
    in_flight: list[int]
    queued_seconds: list[float]
    scores: list[float]
    candidates: list[int]             # within the load bound
    tied: list[int]                   # the candidates left to the rendezvous tie-break
    chosen: int
    assigned: list[int] | None = None  # --kv-share: the prefix's recent requests per replica


@dataclass
class CandidateView:
    """`radixserve.routing.ClusterView` over the candidate replicas of one decision."""

    states: list[ReplicaState]
    hashes: list[int]
    block_tokens: int
    prefill_seconds_per_token: float
    decode_seconds_per_request: float

    @property
    def num_replicas(self) -> int:
        return len(self.states)

    def queued_requests(self) -> list[int]:
        return [s.in_flight for s in self.states]

    def queued_seconds(self) -> list[float]:
        return [s.queued_prefill_tokens(self.block_tokens) * self.prefill_seconds_per_token
                + s.in_flight * self.decode_seconds_per_request for s in self.states]

    def cached_tokens(self, request: RouteRequest) -> list[int]:
        return [min(request.prompt_tokens, s.held_blocks(self.hashes) * self.block_tokens)
                for s in self.states]

    def settled(self, request: RouteRequest) -> list[bool]:
        """Per replica: its digest shows every block of the prompt the router counts it as
        holding (none is only booked for a request still loading or computing it)."""
        return [s.held_blocks(self.hashes) <= (matched_blocks(self.hashes, s.digest.hashes)
                                               if s.digest else 0) for s in self.states]

    def shared_tokens(self, request: RouteRequest) -> int:
        """--kv-share: what any live replica holds is in the cluster store (each publishes
        a prompt's pages once its prefill is done), so any other can load it."""
        return max(self.cached_tokens(request), default=0)
