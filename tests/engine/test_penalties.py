"""engine.penalties and engine.gpu.sampling.penalize against references computed from the logits:
transformers' RepetitionPenaltyLogitsProcessor, OpenAI's presence/frequency formula written out here,
logit_bias added, min_tokens' -inf; on the host sampler and on the device sampler's ops (CPU tensors;
TRITON_INTERPRET=1 changes nothing here: the device sampler is torch ops, no Triton kernel)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import RepetitionPenaltyLogitsProcessor

from engine.gpu.sampling import SamplingRows, penalize, sample_tokens
from engine.outputs import FinishReason
from engine.params import SamplingParams
from engine.penalties import TokenHistory, history_of, penalty_rows, verify_histories
from engine.request import Request
from engine.sampler import Sampler, processed_logits
from engine.stopping import StopChecker

EOS = 0


def reference(logits: torch.Tensor, params: SamplingParams, history: TokenHistory) -> torch.Tensor:
    """One row [V], step by step as vLLM orders them, from the formulas (not from engine.penalties)."""
    scores = logits.clone()[None, :].float()
    for token_id, bias in params.logit_bias:
        scores[0, token_id] += bias
    if len(history.output_token_ids) < params.min_tokens:
        scores[0, list(history.stop_token_ids)] = float("-inf")
    if params.repetition_penalty != 1.0:
        seen = torch.tensor([[*history.prompt_token_ids, *history.output_token_ids]], dtype=torch.long)
        if seen.numel():
            scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(seen, scores)
    for token_id, count in Counter(history.output_token_ids).items():  # OpenAI's formula
        scores[0, token_id] -= params.presence_penalty * (count > 0) + params.frequency_penalty * count
    return scores[0]


@st.composite
def rows(draw, vocab_size: int):
    tokens = st.lists(st.integers(0, vocab_size - 1), max_size=12)
    params = SamplingParams(
        max_tokens=20,
        presence_penalty=draw(st.floats(-2, 2)), frequency_penalty=draw(st.floats(-2, 2)),
        repetition_penalty=draw(st.sampled_from([1.0, 0.5, 1.3, 2.0])),
        logit_bias=draw(st.dictionaries(st.integers(0, vocab_size - 1), st.floats(-100, 100), max_size=3)),
        min_tokens=draw(st.integers(0, 4)), stop_token_ids=tuple(draw(st.lists(st.integers(1, vocab_size - 1),
                                                                              max_size=2))),
    )
    return params, TokenHistory(draw(tokens), draw(tokens), params.stop_token_ids + (EOS,))


@settings(max_examples=60, deadline=None)
@given(st.data(), st.integers(4, 40), st.integers(1, 5), st.integers(0, 2**31))
def test_processed_logits_match_the_reference(data, vocab_size, num_rows, seed):
    drawn = [data.draw(rows(vocab_size)) for _ in range(num_rows)]
    params, histories = [p for p, _ in drawn], [h for _, h in drawn]
    logits = torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * 5
    expected = torch.stack([reference(logits[i], params[i], histories[i]) for i in range(num_rows)])
    got = processed_logits(logits, params, histories)  # the host sampler's
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    on_device = penalize(logits, penalty_rows(params, histories, vocab_size, logits.device))
    torch.testing.assert_close(on_device, expected, rtol=1e-5, atol=1e-4)
    greedy = [SamplingParams(max_tokens=20, **_fields(p)) for p in params]
    assert Sampler().sample(logits, greedy, [None] * num_rows, histories=histories).token_ids == \
        expected.argmax(dim=-1).tolist()
    device_rows = SamplingRows(*(torch.zeros(num_rows, dtype=dtype) for dtype in
                                 (torch.float32, torch.int32, torch.float32, torch.int32, torch.int32, torch.int32)))
    device_rows = device_rows._replace(top_p=torch.ones(num_rows))
    assert sample_tokens(on_device, device_rows, is_greedy=True, is_filtered=False).tolist() == \
        expected.argmax(dim=-1).tolist()


def _fields(params: SamplingParams) -> dict:
    return dict(presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
                repetition_penalty=params.repetition_penalty, logit_bias=params.logit_bias,
                min_tokens=params.min_tokens, stop_token_ids=params.stop_token_ids)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0]])
    history = TokenHistory([0], [1], ())
    got = processed_logits(logits, [SamplingParams(repetition_penalty=2.0)], [history])
    assert got.tolist() == [[1.0, -4.0, 3.0, -1.0]]  # prompt token 0 and output token 1 only


def test_presence_and_frequency_count_outputs_only():
    logits = torch.zeros(1, 4)
    history = TokenHistory([3, 3, 3], [1, 1, 2], ())
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    assert processed_logits(logits, [params], [history]).tolist() == [[0.0, -1.0, -0.75, 0.0]]


def test_min_tokens_masks_stop_ids_until_reached_then_lets_them_win():
    logits = torch.tensor([[5.0, 1.0, 4.0, 0.0]])  # EOS (0) and stop id 2 lead
    params = SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=(2,))
    early, done = TokenHistory([1], [3], (2, EOS)), TokenHistory([1], [3, 3], (2, EOS))
    assert Sampler().sample(logits, [params], [None], histories=[early]).token_ids == [1]
    assert Sampler().sample(logits, [params], [None], histories=[done]).token_ids == [0]


def test_a_strong_negative_bias_moves_greedy_off_its_token():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    params = SamplingParams(logit_bias={1: -100})
    assert Sampler().sample(logits, [params], [None], histories=[TokenHistory([], [], ())]).token_ids == [2]


def test_neutral_params_cost_nothing_and_missing_histories_fail_loudly():
    logits = torch.randn(2, 5)
    assert processed_logits(logits, [SamplingParams()] * 2, None) is logits  # no copy, no tensors built
    with pytest.raises(ValueError, match="history"):
        Sampler().sample(logits, [SamplingParams(presence_penalty=1.0)] * 2, [None] * 2)


@settings(max_examples=60, deadline=None)
@given(st.data(), st.integers(3, 8), st.integers(1, 4), st.integers(0, 2**31))
def test_greedy_verification_under_penalties_equals_the_sequential_decode(data, vocab_size, num_drafts, seed):
    """A verify step whose drafts are the sequential greedy tokens accepts them all and emits the next
    sequential token: row i counts drafts[:i] as outputs (engine.penalties.verify_histories)."""
    params, _ = data.draw(rows(vocab_size))
    params = SamplingParams(max_tokens=20, **_fields(params))
    outputs = data.draw(st.lists(st.integers(0, vocab_size - 1), max_size=4))
    request = Request("r", data.draw(st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=6)), params, 0,
                      output_token_ids=list(outputs), eos_token_ids=(EOS,))
    logits = torch.randn(num_drafts + 1, vocab_size, generator=torch.Generator().manual_seed(seed)) * 2
    sequential: list[int] = []
    for row in range(num_drafts + 1):
        sequential += Sampler().sample(logits[row:row + 1], [params], [None],
                                       histories=[history_of(request, sequential)]).token_ids
    result = Sampler().verify(logits, sequential[:-1], params, None,
                              histories=verify_histories(request, sequential[:-1]))
    assert result.token_ids == sequential and result.num_accepted == num_drafts


def test_a_verify_row_counts_the_drafts_before_it():
    """Row 1 follows draft d0 = 2: with it counted, frequency 2 pulls token 2 below token 1."""
    params = SamplingParams(max_tokens=8, frequency_penalty=2.0)
    request = Request("r", [0], params, 0)
    logits = torch.tensor([[0.0, 1.0, 3.0], [0.0, 2.5, 3.0]])
    assert [h.output_token_ids for h in verify_histories(request, [2])] == [[], [2]]
    result = Sampler().verify(logits, [2], params, None, histories=verify_histories(request, [2]))
    assert result.token_ids == [2, 1]


class _Letters:
    """An IncrementalDecoder stand-in: token t is the letter chr(t)."""

    def push(self, token_id: int) -> str:
        return chr(token_id)

    def flush(self) -> str:
        return ""


@pytest.mark.parametrize("min_tokens, stops_after", [(0, 2), (3, 4)])
def test_no_stop_string_ends_a_request_before_min_tokens(min_tokens, stops_after):
    """vLLM's rule: a stop string counts only once more than min_tokens tokens are out."""
    params = SamplingParams(max_tokens=8, stop=("b",), min_tokens=min_tokens)
    request = Request("r", [1], params, 0)
    checker = StopChecker(request, _Letters(), (), max_model_len=100)
    reasons = [checker.add_tokens([ord(letter)], [None]) for letter in "abcb"[:stops_after]]
    assert reasons[-1] == FinishReason.STOP and not any(reasons[:-1])
    assert request.text == "abcb"[:stops_after - 1]  # cut at the b that ended it, not an earlier one


def test_the_static_steps_rows_count_the_drafts_before_them():
    """engine.gpu.static_runner lays a verify step's rows out token by token (request 0: 1 row,
    request 1: its pending token then 2 drafts); each row is processed with its own history."""
    from types import SimpleNamespace

    from engine.gpu.static_runner import _processed

    params = SamplingParams(max_tokens=8, frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.5)
    requests = [Request("a", [1], params, 0, output_token_ids=[2]), Request("b", [3], params, 1)]
    drafts = [[], [4, 4]]
    scheduled = [SimpleNamespace(request=r, draft_token_ids=d, num_query_tokens=1 + len(d))
                 for r, d in zip(requests, drafts)]
    logits = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    histories = [history_of(requests[0])] + verify_histories(requests[1], drafts[1])
    assert [list(h.output_token_ids) for h in histories] == [[2], [], [4], [4, 4]]
    torch.testing.assert_close(_processed(logits, scheduled), processed_logits(logits, [params] * 4, histories))
