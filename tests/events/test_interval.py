"""--kv-events-interval-ms: a busy engine hands its steps' facts to the publisher once per
interval (KVEvents.after_step), not once per step; consumers still end with the engine's
exact index, and a flush (the engine going idle) hands over what is left at once."""

from __future__ import annotations

import pytest

from radixserve.cache import PagedMemory, RadixCache
from radixserve.events.stream import KVEvents, KVEventsConfig
from tests.events.conftest import LOCAL
from tests.events.test_resync import BLOCK, PROMPTS, serve_and_check

STEP_S = 0.004      # each prompt is served in one step of this long (a fake clock)


@pytest.mark.parametrize("interval_s, handed_over", [
    # Steps end at 4, 8, 12 ... 56 ms: hand-overs at 12, 24, 36 and 48 ms, then the
    # final flush hands over the last two steps' facts.
    (0.010, 5),
    (0.0, len(PROMPTS)),    # 0: after every step, as vLLM does (the flush finds nothing)
])
def test_after_step_hands_over_once_per_interval(interval_s, handed_over):
    now = [0.0]
    tree = RadixCache(page_size=1)
    mem = PagedMemory(64, tree)
    kv = KVEvents(tree, KVEventsConfig(LOCAL, LOCAL, block_size=BLOCK, publisher="thread",
                                       interval_s=interval_s),
                  "cpu", clock=lambda: now[0])
    frames = []
    publish = kv.publisher.publish
    kv.publisher.publish = lambda facts, wake=False: (frames.append((len(facts), wake))
                                                      or publish(facts, wake))

    def step():
        now[0] += STEP_S
        kv.after_step()

    try:
        got = serve_and_check(kv, tree, mem, flush=step)     # ends with one kv.flush()
        # Every step changed the tree, so every hand-over carried facts.
        assert len(frames) == handed_over and all(n for n, _ in frames), frames
        # Paced hand-overs leave the process publisher to drain at its own pace.
        assert not any(wake for _, wake in frames[:-1])
        assert sum(len(r.batch.events) for r in got) > len(PROMPTS)
    finally:
        kv.close()


def test_a_negative_interval_is_refused():
    with pytest.raises(ValueError, match="interval"):
        KVEventsConfig(LOCAL, interval_s=-0.001)
