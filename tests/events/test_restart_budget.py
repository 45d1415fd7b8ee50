"""RestartBudget: at most N restarts in any window; the window slides."""

from radixserve.events.restart_budget import RestartBudget


def test_the_budget_refuses_past_the_bound_and_frees_as_the_window_slides():
    now = [0.0]
    budget = RestartBudget(max_restarts=2, window_s=60.0, clock=lambda: now[0])
    assert budget.take() and budget.take()
    now[0] = 59.0
    assert not budget.take()        # two in the last 60 s already (a refusal books none)
    now[0] = 60.5                   # the first slid out, the second (at 0.0) too
    assert budget.take()
    now[0] = 61.0
    assert budget.take() and not budget.take()
    assert budget.describe() == "2 times in 60 s"
