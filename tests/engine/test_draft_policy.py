"""The draft length policy: drafts pay when they are accepted and verify tokens are cheap."""

from __future__ import annotations

from engine.draft_policy import DraftLengthPolicy, StepCost


def fitted(t0: float, t1: float) -> StepCost:
    cost = StepCost()
    for n in (1, 2, 3, 5, 1, 4):
        cost.record(n, t0 + t1 * n)
    return cost


def test_fit_recovers_the_line():
    assert abs(fitted(2.0, 0.5).token_cost_ratio() - 0.25) < 1e-9


def test_policy_follows_acceptance_and_cost():
    policy = DraftLengthPolicy(4)
    policy.cost = fitted(1.0, 0.05)  # verify tokens nearly free
    assert policy.draft_len(num_accepted=0, num_proposed=40) == 0  # random text: drafts never accepted
    assert policy.draft_len(num_accepted=95, num_proposed=100) == 4
    policy.cost = fitted(1.0, 1.0)  # each verify token costs a whole step's overhead
    assert policy.draft_len(num_accepted=95, num_proposed=100) < 4
    assert policy.draft_len(num_accepted=50, num_proposed=100) == 0


def test_unfitted_cost_uses_the_prior():
    cost = StepCost()
    for _ in range(10):
        cost.record(1, 0.01)  # one step size only: no slope to fit
    assert 0 < cost.token_cost_ratio() < 1
