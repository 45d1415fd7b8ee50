"""Where the router sent each prefix's recent requests: the load it assigned itself.

With a cluster store, several replicas hold or can load a hot prefix, so its requests tie
on the cache and the router is free to place them. Balancing those ties by requests in
flight (join the shortest queue) follows the replicas' speed: the replica that finishes
first takes the next request, and on a burst it can end with far more than its share
(bench_cluster's few-shot: 6 of 16). The router balances them instead by the requests it
routed itself with the same prefix, a sliding window per prefix (vLLM production-stack's
least-QPS routing counts routed requests over a window the same way): booked at the
choice, it does not depend on when replicas finish, and a replica's speed only matters
through the load bound.

A request is recorded under each of its page keys (chained: key i names the whole prefix
up to page i), so a later request finds the requests that shared its longest routed
prefix. Pure Python and bounded: `max_prefixes` keys, least recently used out first.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Hashable, Sequence


class PrefixSpread:
    """The replicas (any hashable id) of the last `window` requests routed per prefix."""

    def __init__(self, window: int = 64, max_prefixes: int = 1 << 14):
        if window < 1 or max_prefixes < 1:
            raise ValueError("a spread window and its prefix bound must be >= 1")
        self.window = window
        self.max_prefixes = max_prefixes
        self._sent: OrderedDict[int, deque[Hashable]] = OrderedDict()

    def record(self, page_keys: Sequence[int], replica: Hashable) -> None:
        """One request routed to `replica`, under every prefix of its prompt."""
        for key in page_keys:
            sent = self._sent.get(key)
            if sent is None:
                sent = self._sent[key] = deque(maxlen=self.window)
            else:
                self._sent.move_to_end(key)
            sent.append(replica)
        while len(self._sent) > self.max_prefixes:
            self._sent.popitem(last=False)

    def counts(self, page_keys: Sequence[int], replicas: Sequence[Hashable]) -> list[int]:
        """Requests each of `replicas` was sent (within the window) that share this
        prompt's longest routed prefix; zeros when no request shared its first page."""
        deepest = None
        for key in page_keys:
            sent = self._sent.get(key)
            if sent is None:
                break
            deepest = sent
        sent = Counter(deepest or ())
        return [sent[replica] for replica in replicas]
