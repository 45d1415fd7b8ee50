"""The Ray Serve `RequestRouter`s: radixserve's policies over the replicas' published caches.

`ViewMixin` keeps the shared `ClusterState` current from Ray Serve's own hooks: replica
updates (which carry each replica's routing stats: its cache digest and engine stats),
actor deaths (the replica's view is dropped at once), and each request's routing and
completion. It also pins control calls (`RouteInfo.target`) to their replica. The policy
decides everything else:

- `cache-aware` (`RadixRequestRouter`): `radixserve.routing.CacheAwareRouter`, the same
  code as the replay simulation's: among the replicas within the load bound (requests in
  flight, counted here from the moment of each choice), the least queued work in seconds
  + prefill of the prompt tokens the replica lacks; ties (nothing cached, equal load) go
  to the prompt's rendezvous replica, so a new prefix's followers find it; with
  --kv-share, replicas that tie on the cache are balanced by the requests of the prefix
  this router sent each (`radixserve.routing.spread`), recorded at the choice;
- `pow2`, `round-robin`: the shared policies on the router's in-flight counts;
- `prefix-affinity`: Ray Serve LLM's PrefixCacheAffinityRouter (see `affinity_router`).

Routing never waits on routing stats: the Serve controller collects them in the
background (with a timeout), and a decision reads whatever the view holds.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from radixserve.routing import (CacheAwareRouter, LoadBound, PowerOfTwoRouter,
                                RoundRobinRouter, RouteRequest)

from .route_info import RouteInfo
from .view import CandidateView, ClusterState, DecisionRecord, SentRecord
from .views_registry import state_for

log = logging.getLogger("radixserve.cluster")

POLICIES = ("cache-aware", "pow2", "round-robin")


def route_info(pending_request: PendingRequest | None) -> RouteInfo | None:
    if pending_request is None:
        return None
    for arg in pending_request.args:
        if isinstance(arg, RouteInfo):
            return arg
    return None


class ViewMixin:
    """Bookkeeping shared by every radixserve router class (see the module docstring)."""

    state: ClusterState

    def init_view(self, view_key: str, block_tokens: int) -> None:
        self.state = state_for(view_key, block_tokens)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        with self.state.lock:
            self.state.keep_only([r.replica_id.unique_id for r in replicas])
            for r in replicas:
                stats = r.routing_stats
                if stats:
                    self.state.published(r.replica_id.unique_id, stats)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        with self.state.lock:
            self.state.forget(replica_id.unique_id)

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        self.note(pending_request, replica_id.unique_id, confirmed=True)

    def note(self, pending_request: PendingRequest | None, replica_id: str,
             confirmed: bool) -> None:
        """Book a request on a replica: at the choice, and again when Ray Serve sends it."""
        info = route_info(pending_request)
        if info is None or info.target is not None:
            return
        with self.state.lock:
            if confirmed and self.state.request_log is not None:
                self.state.request_log.append(SentRecord(time.time(), info.hashes,
                                                         info.prompt_tokens, replica_id))
            state = self.state.replica(replica_id)
            held = state.held_blocks(info.hashes) * self.state.block_tokens
            self.state.routed(pending_request.metadata.internal_request_id, replica_id,
                              info.hashes, max(0, info.prompt_tokens - held), confirmed,
                              info.prompt_tokens)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        with self.state.lock:
            self.state.completed(internal_request_id)

    def count_decision(self, seconds: float) -> None:
        with self.state.lock:
            self.state.decision_seconds += seconds
            self.state.decisions += 1

    def pinned(self, candidates: list[RunningReplica],
               info: RouteInfo | None) -> list[list[RunningReplica]] | None:
        """The one replica a control call names (empty while it is not running)."""
        if info is None or info.target is None:
            return None
        return [[r for r in candidates if r.replica_id.unique_id == info.target]]


class RadixRequestRouter(ViewMixin, RequestRouter):
    """cache-aware, pow2 and round-robin on the replicas' published caches and load."""

    def initialize_state(self, view_key: str = "", policy: str = "cache-aware",
                         block_tokens: int = 16, prefill_seconds_per_token: float = 2e-4,
                         decode_seconds_per_request: float = 0.1, cache_weight: float = 4.0,
                         load_bound: str = str(LoadBound()), seed: int = 0,
                         load_fraction: float | None = None, **_: Any) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown router policy {policy!r}; choose from {POLICIES}")
        self.init_view(view_key, block_tokens)
        self.policy = policy
        self.prefill_seconds_per_token = prefill_seconds_per_token
        self.decode_seconds_per_request = decode_seconds_per_request
        self._pow2 = PowerOfTwoRouter(1, seed)
        self._cache_aware = CacheAwareRouter(1, prefill_seconds_per_token, cache_weight,
                                             LoadBound.parse(load_bound), load_fraction)
        self._round_robin = RoundRobinRouter(1)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        info = route_info(pending_request)
        pinned = self.pinned(candidate_replicas, info)
        if pinned is not None:
            return pinned
        if not candidate_replicas:
            return []
        start = time.perf_counter()
        chosen = candidate_replicas[self.choose_index(candidate_replicas, info)]
        self.note(pending_request, chosen.replica_id.unique_id, confirmed=False)
        self.count_decision(time.perf_counter() - start)
        return [[chosen]]

    def choose_index(self, candidates: list[RunningReplica], info: RouteInfo | None) -> int:
        ids = sorted(range(len(candidates)), key=lambda i: candidates[i].replica_id.unique_id)
        candidates = [candidates[i] for i in ids]          # a stable order for every policy
        with self.state.lock:
            view = CandidateView([self.state.replica(r.replica_id.unique_id) for r in candidates],
                                 info.hashes if info else [], self.state.block_tokens,
                                 self.prefill_seconds_per_token, self.decode_seconds_per_request)
            return ids[self.policy_index(view, info)]

    def policy_index(self, view: CandidateView, info: RouteInfo | None) -> int:
        n = view.num_replicas
        if self.policy == "round-robin":
            self._round_robin.num_replicas = n
            self._round_robin._next %= n
            return self._round_robin.choose(None, view)
        queued = view.queued_requests()
        if self.policy == "pow2" or info is None or not info.hashes:
            return self._pow2.pick(range(n), queued)
        self._cache_aware.num_replicas = n
        request = RouteRequest(info.hashes, info.prompt_tokens, info.routing_key)
        ids = [s.replica_id for s in view.states]
        ranking = self._cache_aware.ranked(request, view, ids)
        chosen = self._cache_aware.pick(request, ranking)
        self._cache_aware.routed(request, ids[chosen])     # its own record (PrefixSpread)
        if self.state.decision_log is not None:
            self.state.decision_log.append(DecisionRecord(
                time.time(), [s.replica_id for s in view.states],
                view.cached_tokens(request), view.shared_tokens(request),
                view.queued_requests(), view.queued_seconds(), ranking.scores,
                ranking.candidates, ranking.tied, chosen, ranking.assigned))
        return chosen
