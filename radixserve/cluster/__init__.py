"""Scale-out on Ray Serve: N engine replicas behind radixserve's one HTTP front end.

- `prefix_hashes`: chained, namespaced hashes of routing blocks (pure, no torch, no Ray);
  the replicas publish their caches in this form and the router hashes prompts with it.
- `cache_digest`: a replica's read-only walk of its radix tree into those hashes.
- `view`: what the router knows about each replica (digest, load) and the scoring adapter
  onto `radixserve.routing`.
- `replica`, `ray_router`, `client`, `launch`: the Ray Serve deployment, its custom
  `RequestRouter`, the front end's engine client, and start-up. These import Ray.
"""

RAY_EXTRA_HINT = "--replicas needs Ray Serve: pip install 'radixserve[ray]'"
