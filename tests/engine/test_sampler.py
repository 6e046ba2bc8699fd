"""Sampler: greedy, filters, per-request seeds, logprobs, speculative verification."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.params import SamplingParams
from engine.sampler import Sampler, match_sample, sampling_probs

GREEDY = SamplingParams()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _logits(num_rows: int, vocab_size: int, seed: int) -> torch.Tensor:
    return torch.randn(num_rows, vocab_size, generator=_gen(seed)) * 3


# --- sampling_probs ---------------------------------------------------------


def test_greedy_is_argmax_ties_to_lowest_id():
    logits = torch.tensor([[0.0, 2.0, 5.0, 5.0, 1.0], [7.0, 7.0, 7.0, 0.0, 0.0]])
    result = Sampler().sample(logits, [GREEDY, GREEDY], [None, None])
    assert result.token_ids == [2, 0]
    assert result.logprobs == [None, None]


def test_temperature_scales_logits():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    probs = sampling_probs(logits, [SamplingParams(temperature=0.5)])
    torch.testing.assert_close(probs, torch.softmax(logits / 0.5, dim=-1))


def test_top_k_ties_keep_the_lower_ids():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0]])
    probs = sampling_probs(logits, [SamplingParams(temperature=1.0, top_k=2)])
    torch.testing.assert_close(probs, torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0]]))


def test_top_k_keeps_k_largest_renormalised():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0]])
    probs = sampling_probs(logits, [SamplingParams(temperature=1.0, top_k=2)])
    expected = torch.zeros(1, 5)
    expected[0, [1, 2]] = torch.softmax(torch.tensor([4.0, 3.0]), dim=-1)
    torch.testing.assert_close(probs, expected)


@pytest.mark.parametrize(
    "top_p, kept",
    [(0.5, [0]), (0.6, [0, 1]), (0.85, [0, 1]), (0.9, [0, 1, 2]), (1.0, [0, 1, 2, 3]), (0.01, [0])],
)
def test_top_p_keeps_smallest_prefix_reaching_mass(top_p, kept):
    raw = torch.tensor([0.5, 0.35, 0.1, 0.05])
    probs = sampling_probs(raw.log()[None], [SamplingParams(temperature=1.0, top_p=top_p)])[0]
    expected = torch.zeros(4)
    expected[kept] = raw[kept] / raw[kept].sum()
    torch.testing.assert_close(probs, expected)


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    temperature=st.floats(0.05, 3.0),
    top_k=st.integers(0, 12),
    top_p=st.floats(0.01, 1.0),
)
def test_sampling_probs_is_a_distribution_keeping_the_top_token(seed, temperature, top_k, top_p):
    logits = _logits(3, 10, seed)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    probs = sampling_probs(logits, [params] * 3)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))
    assert (probs.gather(-1, logits.argmax(-1, keepdim=True)) > 0).all()
    if top_k:
        assert ((probs > 0).sum(-1) <= top_k).all()


# --- sample -----------------------------------------------------------------


def test_seeded_request_gets_the_same_tokens_alone_or_batched():
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    others = [SamplingParams(temperature=0.8, top_k=5), GREEDY, SamplingParams(temperature=1.5)]
    alone_gen, batched_gen = _gen(7), _gen(7)
    other_gens = [_gen(1), None, _gen(2)]
    sampler = Sampler()
    alone, batched = [], []
    for step in range(30):
        logits = _logits(4, 50, seed=step)
        alone += sampler.sample(logits[2:3], [params], [alone_gen]).token_ids
        batch_params = [others[0], others[1], params, others[2]]
        batch_gens = [other_gens[0], other_gens[1], batched_gen, other_gens[2]]
        batched.append(sampler.sample(logits, batch_params, batch_gens).token_ids[2])
    assert alone == batched
    assert len(set(alone)) > 1  # really sampled, not greedy


def test_different_seeds_sample_differently():
    logits = torch.zeros(1, 1000)
    params = [SamplingParams(temperature=1.0)]
    a = [Sampler().sample(logits, params, [g]).token_ids[0] for g in [_gen(1)] * 20]
    b = [Sampler().sample(logits, params, [g]).token_ids[0] for g in [_gen(2)] * 20]
    assert a != b


def test_sample_frequencies_follow_probs():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 5.0]])
    params = SamplingParams(temperature=2.0, top_k=4)
    expected = sampling_probs(logits, [params])[0]
    gen = _gen(0)
    counts = torch.zeros(5)
    for _ in range(4000):
        counts[Sampler().sample(logits, [params], [gen]).token_ids[0]] += 1
    assert counts[3] == 0  # cut by top-k
    assert (counts / 4000 - expected).abs().max() < 0.03


def test_logprobs_are_of_the_raw_distribution():
    logits = _logits(2, 30, seed=3)
    params = [SamplingParams(temperature=0.3, top_k=2, logprobs=4), SamplingParams(logprobs=0)]
    result = Sampler().sample(logits, params, [_gen(0), None])
    raw = torch.log_softmax(logits, dim=-1)
    for row, (token_id, lp) in enumerate(zip(result.token_ids, result.logprobs)):
        assert lp.token_id == token_id
        assert math.isclose(lp.logprob, raw[row, token_id].item(), rel_tol=1e-5)
    top_vals, top_ids = raw[0].topk(4)
    assert [t for t, _ in result.logprobs[0].top] == top_ids.tolist()
    assert [v for _, v in result.logprobs[0].top] == pytest.approx(top_vals.tolist())
    assert result.logprobs[1].top == ()


def test_sample_rejects_mismatched_lengths():
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(2, 5), [GREEDY], [None, None])


# --- verify -----------------------------------------------------------------


def _sequential_greedy(logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """What decoding one token at a time would emit, given the drafts as context."""
    emitted = []
    for row, draft in enumerate([*drafts, None]):
        token = Sampler().sample(logits[row : row + 1], [GREEDY], [None]).token_ids[0]
        emitted.append(token)
        if token != draft:
            break
    return emitted


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 10_000), num_drafts=st.integers(0, 6), data=st.data())
def test_greedy_verify_equals_sequential_greedy(seed, num_drafts, data):
    logits = _logits(num_drafts + 1, 4, seed)
    targets = logits.argmax(-1).tolist()
    # Drafts that mostly agree with the model, so long accepted runs occur.
    drafts = [
        data.draw(st.sampled_from([t, t, t, (t + 1) % 4])) for t in targets[:num_drafts]
    ]
    result = Sampler().verify(logits, drafts, GREEDY, None)
    assert result.token_ids == _sequential_greedy(logits, drafts)
    assert result.token_ids[: result.num_accepted] == drafts[: result.num_accepted]
    assert len(result.token_ids) == result.num_accepted + 1


def test_greedy_verify_all_accepted_appends_bonus():
    logits = torch.tensor([[0.0, 9.0, 0.0], [9.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
    result = Sampler().verify(logits, [1, 0], GREEDY, None)
    assert result == (([1, 0, 2]), 2, [None, None, None])


def test_verify_logprobs_follow_each_emitted_token():
    logits = _logits(3, 8, seed=5)
    targets = logits.argmax(-1).tolist()
    drafts = [targets[0], (targets[1] + 1) % 8]
    result = Sampler().verify(logits, drafts, SamplingParams(logprobs=2), None)
    raw = torch.log_softmax(logits, dim=-1)
    assert result.token_ids == targets[:2]
    for row, lp in enumerate(result.logprobs):
        assert lp.token_id == result.token_ids[row]
        assert math.isclose(lp.logprob, raw[row, lp.token_id].item(), rel_tol=1e-5)
        assert len(lp.top) == 2


def test_verify_rejects_wrong_row_count():
    with pytest.raises(ValueError):
        Sampler().verify(torch.zeros(2, 5), [1, 2], GREEDY, None)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), num_drafts=st.integers(0, 4), data=st.data())
def test_sampled_verify_emits_the_tokens_sequential_sampling_draws(seed, num_drafts, data):
    """Seeded by position, verify's tokens are the draws sequential sampling makes: the accepted
    drafts are exactly those draws, the emitted token the first draw that differs."""
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.95, logprobs=1)
    logits = _logits(num_drafts + 1, 8, seed)
    probs = sampling_probs(logits, [params] * (num_drafts + 1))
    sequential = [int(torch.multinomial(probs[i], 1, generator=_gen(seed + i))) for i in range(num_drafts + 1)]
    # drafts that agree with the draws for a while, then anything
    num_right = data.draw(st.integers(0, num_drafts))
    drafts = sequential[:num_right] + data.draw(st.lists(st.integers(0, 7), min_size=num_drafts - num_right,
                                                         max_size=num_drafts - num_right))
    gen = torch.Generator()
    result = Sampler().verify(logits, drafts, params, gen, reseed=lambda row: gen.manual_seed(seed + row))
    n = len(result.token_ids)
    assert result.token_ids == sequential[:n]
    assert drafts[: n - 1] == sequential[: n - 1] and (n == num_drafts + 1 or drafts[n - 1] != sequential[n - 1])
    assert result.num_accepted == n - 1 >= num_right
    assert len(result.logprobs) == n


# Target rows over a vocab of 5: row 0 scores draft 0, row 1 scores draft 1, row 2 the bonus.
TARGET_LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0], [0.0, 3.0, -2.0, 1.0, 0.5], [1.0] * 5])
FILTERED = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)
NUM_DRAWS = 20_000


@pytest.mark.parametrize(
    "params, drafts",
    [
        (SamplingParams(temperature=1.0), [0, 1]),  # both drafts likely
        (SamplingParams(temperature=1.0), [3, 2]),  # first draft unlikely (p ~ 0.03)
        (FILTERED, [3, 1]),  # first draft cut by top-k: p = 0, always rejected
    ],
    ids=["likely", "unlikely", "impossible"],
)
def test_speculative_sampling_keeps_the_target_distribution(params, drafts):
    """The property speculation rests on: each emitted token is distributed as p says.

    The first emitted token follows p_0 whatever the draft; given that drafts
    d_0..d_{j-1} were accepted, the next one (a draft, a correction or the
    bonus) follows p_j. Checked wherever at least 5k draws reach position j.
    """
    probs = sampling_probs(TARGET_LOGITS, [params] * 3)
    gen = _gen(11)
    counts = [Counter() for _ in range(3)]
    for _ in range(NUM_DRAWS):
        token_ids = match_sample(probs, drafts, gen)
        for position, token_id in enumerate(token_ids):
            counts[position][token_id] += 1
    assert counts[0].total() == NUM_DRAWS
    for position, position_counts in enumerate(counts):
        if position_counts.total() >= 5_000:
            assert _max_abs_diff(position_counts, probs[position]) < 0.02, position


def _max_abs_diff(counts: Counter, probs: torch.Tensor) -> float:
    total = counts.total()
    return max(abs(counts[token] / total - p) for token, p in enumerate(probs.tolist()))


def test_greedy_fast_path_picks_what_the_probability_path_picks():
    logits = torch.cat([_logits(6, 50, seed=7), torch.tensor([[1.0] * 50])])  # last row: all tied -> id 0
    fast = Sampler().sample(logits, [GREEDY] * 7, [None] * 7)
    with_logprobs = Sampler().sample(logits, [SamplingParams(logprobs=0)] * 7, [None] * 7)
    assert fast.token_ids == with_logprobs.token_ids == logits.argmax(dim=-1).tolist()
    assert fast.token_ids[-1] == 0
    assert [lp.token_id for lp in with_logprobs.logprobs] == fast.token_ids
