"""Where a router finds the `ClusterState` its front end created.

Ray Serve constructs `RequestRouter`s itself (in the process that holds the handle), so
the front end cannot pass its state object in; it registers it under a key it also puts in
the router's kwargs. A router in another process (a second handle elsewhere) gets a fresh
state of its own. This registry is the only module-level state of the cluster package.
"""

from __future__ import annotations

import threading

from .view import ClusterState

_states: dict[str, ClusterState] = {}
_lock = threading.Lock()


def register(key: str, state: ClusterState) -> None:
    with _lock:
        _states[key] = state


def unregister(key: str) -> ClusterState | None:
    with _lock:
        return _states.pop(key, None)


def state_for(key: str, block_tokens: int) -> ClusterState:
    with _lock:
        state = _states.get(key)
        if state is None:
            state = _states[key] = ClusterState(block_tokens)
        return state
