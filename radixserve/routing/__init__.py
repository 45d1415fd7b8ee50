"""Request routing across engine replicas: the policies and their scores, shared code.

Pure Python, no torch and no server: a router reads a `ClusterView` (each replica's load,
and for the cache-aware policy the prompt tokens each replica holds) and names a replica.
The replay tool's cluster simulation (`radixserve replay --replicas N --router ...`) drives
these same objects; a serving router (Ray Serve) supplies its own view of the replicas.
"""

from .routers import (ROUTERS, CacheAwareRouter, ClusterView, ConsistentHashRouter,
                      LoadBound, PowerOfTwoRouter, PrefixAffinityRouter, RoundRobinRouter,
                      RouteRequest, Router, load_bound_arg, make_router)

__all__ = ["ROUTERS", "CacheAwareRouter", "ClusterView", "ConsistentHashRouter", "LoadBound",
           "PowerOfTwoRouter", "PrefixAffinityRouter", "RoundRobinRouter", "RouteRequest",
           "Router", "load_bound_arg", "make_router"]
