"""Namespace nesting, in one place: `tenant/app` is inside `tenant`.

The tree flushes and counts a namespace with those nested under it, and pins are listed and
released by the same rule (engine/pins.py).
"""

from __future__ import annotations

__all__ = ["in_namespace"]


def in_namespace(namespace: str | None, scope: str | None) -> bool:
    """True when `namespace` is `scope` or nested under it (`scope/...`); the default
    namespace (None) holds only itself."""
    if scope is None or namespace is None:
        return namespace == scope
    return namespace == scope or namespace.startswith(scope + "/")
