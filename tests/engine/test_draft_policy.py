"""The draft length policy: drafts pay when they are accepted and verify tokens are cheap."""

from __future__ import annotations

from engine.draft_policy import PROBE_EVERY, DraftLengthPolicy, StepCost


def fitted(t0: float, t1: float) -> StepCost:
    cost = StepCost()
    for n in (1, 2, 3, 5, 1, 4):
        cost.record(n, t0 + t1 * n)
    return cost


def test_fit_recovers_the_line():
    assert abs(fitted(2.0, 0.5).token_cost_ratio() - 0.25) < 1e-9


def rejected(policy: DraftLengthPolicy, num_drafts: int) -> None:
    """What the engine records when a request's drafts are rejected one by one."""
    for _ in range(num_drafts):
        policy.record_verify(1, 0)


def test_policy_follows_acceptance_and_cost():
    policy = DraftLengthPolicy(4)
    policy.cost = fitted(1.0, 0.05)  # verify tokens nearly free
    rejected(policy, 40)
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


def test_steps_costing_in_proportion_to_their_tokens_never_draft():
    """Gemma 3 at c = 8: 8-row decode steps 98 ms, 32-row verifies 444 ms (every request drafting 3). The line
    has no fixed cost, so a verify token costs what a decoded one does: no acceptance makes drafts pay. The
    same engine at c = 1 (1 row 27 ms, 4 rows 45 ms) drafts 3 at that acceptance."""
    policy = DraftLengthPolicy(3)
    for _ in range(4):
        policy.cost.record(8, 0.098, num_drafting=0)
        policy.cost.record(32, 0.444, num_drafting=8)
    token, drafting = policy.cost.ratios()
    assert token >= 20 and drafting == 0.0
    assert policy.draft_len(num_accepted=97, num_proposed=100) == 0
    policy.cost = StepCost()
    for _ in range(4):
        policy.cost.record(1, 0.027, num_drafting=0)
        policy.cost.record(4, 0.045, num_drafting=1)
    assert policy.draft_len(num_accepted=97, num_proposed=100) == 3


class Item:
    """What record_step reads of a scheduled request."""

    def __init__(self, num_drafts: int) -> None:
        self.is_decode, self.draft_token_ids, self.num_query_tokens = True, [7] * num_drafts, 1 + num_drafts


def test_when_every_step_drafts_alike_a_probe_step_drafts_nothing_and_the_fit_learns_its_cost():
    """8 requests always drafting 3 (32-row steps only: no slope to fit, the prior says draft): every
    PROBE_EVERY-th decode step drafts nothing; its 8-row time shows steps cost in proportion to their
    tokens (Gemma 3's figures), and drafting stops."""
    policy = DraftLengthPolicy(3)
    probes = []
    for step in range(1, 3 * PROBE_EVERY + 1):
        k = policy.draft_len(num_accepted=97, num_proposed=100)
        if policy.probing:
            probes.append(step)
        batch = [Item(k) for _ in range(8)]
        policy.record_step(batch, 0.098 + 0.0144 * 8 * k)  # 98 ms for 8 rows, 14.4 ms a row more
        if probes:
            break
    assert probes == [PROBE_EVERY + 1]  # the step after the PROBE_EVERY-th decode step
    assert policy.draft_len(num_accepted=97, num_proposed=100) == 0 and not policy.probing


def test_fit_separates_the_drafting_overhead():
    """Steps with and without drafting requests: the fit recovers t1 / t0 and td / t0."""
    cost = StepCost()
    for n, d in ((1, 0), (2, 1), (3, 1), (1, 0), (5, 1), (4, 2), (6, 2), (1, 0)):
        cost.record(n, 2.0 + 0.5 * n + 0.8 * d, num_drafting=d)
    token, drafting = cost.ratios()
    assert abs(token - 0.25) < 1e-6 and abs(drafting - 0.4) < 1e-6


def test_drafting_overhead_can_outweigh_cheap_tokens():
    """Verify tokens nearly free: 30% acceptance drafts; the same with drafting costing most of a step does not."""
    policy = DraftLengthPolicy(4)
    for n, d in ((1, 0), (2, 1), (3, 1), (1, 0), (5, 1), (4, 2), (6, 2), (1, 0)):
        policy.cost.record(n, 1.0 + 0.05 * n, num_drafting=d)
    assert policy.draft_len(num_accepted=29, num_proposed=100) >= 1
    policy.cost = StepCost()
    for n, d in ((1, 0), (2, 1), (3, 1), (1, 0), (5, 1), (4, 2), (6, 2), (1, 0)):
        policy.cost.record(n, 1.0 + 0.05 * n + 0.9 * d, num_drafting=d)
    assert policy.draft_len(num_accepted=29, num_proposed=100) == 0


def test_a_request_that_stopped_drafting_probes_again_ever_more_rarely():
    """Two early rejections stop drafting for now, not for good: later steps probe again; a
    request whose probes keep failing (random text) stops for good."""
    policy = DraftLengthPolicy(4)
    rejected(policy, 2)
    assert policy.draft_len(num_accepted=0, num_proposed=2, num_steps=0) == 0
    assert policy.draft_len(num_accepted=0, num_proposed=2, num_steps=5) >= 1
    rejected(policy, 8)
    assert [policy.draft_len(0, 10, steps) for steps in (5, 48, 1000)] == [0, 0, 0]
    assert policy.draft_len(num_accepted=0, num_proposed=40, num_steps=10_000) == 0


def test_the_previous_policy_never_probes_again():
    """``explore=0, fit_drafting=False``, a fixed prior of 0.5 weighted as 2 drafts (the policy of d2bdb01, 2026-12-03):
    two rejections stop it for good."""
    previous = DraftLengthPolicy(4, explore=0.0, fit_drafting=False, shared_prior=False, prior_drafts=2)
    assert [previous.draft_len(0, 2, steps) for steps in (0, 5, 1000)] == [0, 0, 0]
    assert DraftLengthPolicy(4).draft_len(0, 2, 5) >= 1


def test_a_new_request_starts_from_the_engines_recent_acceptance():
    """Drafts cost 15% of a step: a new request's first draft depends on what earlier requests saw."""
    random_text, repetitive, fixed = (DraftLengthPolicy(4), DraftLengthPolicy(4),
                                      DraftLengthPolicy(4, shared_prior=False))
    for policy in (random_text, repetitive, fixed):
        policy.cost = fitted(1.0, 0.15)
    for _ in range(60):  # earlier requests: one draft per verify, 10% accepted / 90% accepted
        for i in range(10):
            random_text.record_verify(1, int(i == 0))
            repetitive.record_verify(1, int(i != 0))
            fixed.record_verify(1, int(i == 0))
    assert abs(random_text.prior_acceptance() - 0.1) < 0.01 and abs(repetitive.prior_acceptance() - 0.9) < 0.01
    assert random_text.draft_len(num_accepted=0, num_proposed=0, num_steps=0) == 0
    assert repetitive.draft_len(num_accepted=0, num_proposed=0, num_steps=0) >= 2
    assert fixed.prior_acceptance() == 0.5 and fixed.draft_len(num_accepted=0, num_proposed=0, num_steps=0) >= 1
    # a request's own record still decides once it outweighs the engine's (8 drafts' worth)
    assert random_text.draft_len(num_accepted=19, num_proposed=20, num_steps=20) >= 2
    assert repetitive.draft_len(num_accepted=0, num_proposed=100, num_steps=100) == 0


def test_the_engines_acceptance_follows_recent_drafts():
    policy = DraftLengthPolicy(4)
    assert policy.prior_acceptance() == 0.5
    policy.record_verify(1, 0)
    assert abs(policy.prior_acceptance() - 1 / 3) < 1e-9
    for _ in range(500):
        policy.record_verify(4, 4)
    assert policy.prior_acceptance() > 0.98  # the early rejection has decayed away (Laplace caps it near 0.99)
