"""lpm's wait bound: which waiting sequences are overdue and in what order they are served.

Prefix-first admission would let a stream of cache hits hold a cold request back for ever;
the bound (`--lpm-max-wait-steps`, docs/conversations.md) caps that. These are the bound's
rules as pure functions of the queue; the scheduler applies them (budget share, memory and
slots kept, preemption) in engine/scheduler.py.
"""

from __future__ import annotations

from collections.abc import Iterable

from radixserve.engine.request import SeqState

LPM_MAX_WAIT_STEPS = 16         # lpm: a sequence waiting this many steps is overdue
OVERDUE_BUDGET_SHARE = 0.25     # lpm: share of a step's token budget overdue ones go first in
PREEMPT_AFTER_BOUNDS = 2        # lpm: overdue this many bounds, younger running ones make room


def wait_order(seq: SeqState) -> tuple:
    """Who has waited longest first: by the step the wait began (arrival, or a preemption
    that made room for an overdue sequence), then arrival."""
    return (seq.waiting_since, seq.request.arrival_time, seq.index)


def overdue_share(token_budget: int) -> int:
    """Tokens of each step's budget the overdue sequence being served may count on."""
    return int(OVERDUE_BUDGET_SHARE * token_budget)


def oldest_overdue(waiting: Iterable[SeqState], step: int, max_wait_steps: int
                   ) -> SeqState | None:
    """The sequence waiting longest among those waiting `max_wait_steps` steps or more."""
    deadline = step - max_wait_steps
    overdue = [s for s in waiting if s.waiting_since <= deadline]
    return min(overdue, key=wait_order) if overdue else None


def overdue_first(looked: list[tuple[SeqState, int]], step: int, max_wait_steps: int,
                  token_budget: int) -> set[int]:
    """Ids of the overdue sequences ordered before all others this step: the oldest (at
    least one), while their prefill work (prompt minus cached prefix, the ints of `looked`)
    fits in OVERDUE_BUDGET_SHARE of the token budget."""
    overdue = sorted((item for item in looked if step - item[0].waiting_since >= max_wait_steps),
                     key=lambda item: wait_order(item[0]))
    room = OVERDUE_BUDGET_SHARE * token_budget
    ahead: set[int] = set()
    for s, cached in overdue:
        if ahead and room <= 0:
            break
        ahead.add(id(s))
        room -= len(s.token_ids) - cached
    return ahead


def youngest_after(running: Iterable[SeqState], seq: SeqState) -> SeqState | None:
    """The running sequence latest in wait order, if it comes after `seq` (a victim)."""
    key = wait_order(seq)
    younger = [s for s in running if wait_order(s) > key]
    return max(younger, key=wait_order) if younger else None
