"""API keys and prefix-cache namespaces.

A cached prefix answers faster, so one tenant could probe another's prompts by timing.
Requests therefore carry a namespace: `cache_salt` from the body and, with
`--namespace-per-api-key`, one derived from the caller's key. Namespaces are hashes, never
the key or salt itself, because they show up in cache summaries and logs.

Admin keys (`--admin-api-key`) are valid everywhere and may also act on every tenant's
cache (flush it all, read every counter); tenant keys only on their own namespace.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass


def _digest(kind: str, value: str) -> str:
    return hashlib.sha256(f"radixserve-{kind}\0{value}".encode()).hexdigest()[:24]


@dataclass(frozen=True)
class AuthConfig:
    api_keys: tuple[str, ...] = ()
    namespace_per_api_key: bool = False
    admin_keys: tuple[str, ...] = ()

    @property
    def enabled(self) -> bool:
        return bool(self.api_keys or self.admin_keys)

    def is_admin(self, key: str) -> bool:
        return key in self.admin_keys

    def check(self, authorization: str | None) -> str | None:
        """The matching key for an `Authorization` header, or None when it matches none.
        Compares in constant time against every key."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        given = authorization[len("Bearer "):].strip().encode()
        found = None
        for key in self.api_keys + self.admin_keys:
            if hmac.compare_digest(given, key.encode()):
                found = key
        return found

    def key_owner(self, key: str) -> str:
        """Who owns what a key stores (stored responses), with or without per-key
        namespaces: a digest, never the key."""
        return "owner-" + _digest("owner", key)

    def key_namespace(self, key: str | None) -> str | None:
        if key is None or not self.namespace_per_api_key:
            return None
        return "key-" + _digest("key", key)


def cache_namespace(key_namespace: str | None, cache_salt: str | None) -> str | None:
    """The engine namespace of a request: its key's namespace, refined by its salt."""
    if cache_salt is None:
        return key_namespace
    salt = "salt-" + _digest("salt", cache_salt)
    return f"{key_namespace}/{salt}" if key_namespace else salt
