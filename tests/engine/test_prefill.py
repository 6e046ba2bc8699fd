"""Prefill-only requests: parked after their first token with their pages kept, freed by abort."""

import json

import pytest

from engine import FinishReason, SamplingParams
from kvcache.slicing import UNBOUND, stale_end
from tests.engine.engine_fixtures import make_engine, run_to_completion, tiny_model  # noqa: F401

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
B, W = 8, 32  # windserve-tiny's sliding window is 32 tokens


def prefill_to_park(engine, request_id, prompt, params=GREEDY):
    """Step until the request's parking update; every other update must be for other requests."""
    engine.prefill(request_id, prompt, params)
    for _ in range(100):
        for update in engine.step():
            if update.request_id == request_id:
                assert update.is_finished and update.prefill is not None and update.finish_reason is None
                return update
    raise AssertionError(f"{request_id} never parked")


def manager_tables(engine, request_id):
    manager = engine.manager
    return {g.name: manager.get_block_ordinals(request_id, g.name) for g in manager.spec.groups}


def test_finish_reason_is_a_plain_string_outside():
    assert str(FinishReason.STOP) == "stop" and f"{FinishReason.LENGTH}" == "length"
    assert json.dumps({"finish_reason": FinishReason.ABORT}) == '{"finish_reason": "abort"}'
    assert FinishReason.ERROR == "error" and FinishReason("stop") is FinishReason.STOP


def test_parking_keeps_pages_at_their_positions(tiny_model):
    """P=60 in chunks of 16: the sliding group released blocks 0, 1 after the 48-token chunk; the rest stay bound."""
    engine = make_engine(tiny_model, role="context", tokens_per_block=B, max_num_batched_tokens=16)
    prompt = [(7 * i + 1) % 256 for i in range(60)]  # token 0 shows text: k = 1 (test_handoff: k > 1)
    update = prefill_to_park(engine, "p", prompt)
    result = update.prefill
    assert result.block_ordinals == manager_tables(engine, "p")
    ceil_p = -(-len(prompt) // B)
    full, sliding = result.block_ordinals["full"], result.block_ordinals["sliding"]
    assert len(full) == len(sliding) == ceil_p and all(page >= 0 for page in full)
    released = stale_end(48, W, B)
    assert released == 2 and sliding[:released] == [UNBOUND] * released and all(p >= 0 for p in sliding[released:])
    bound = sum(page >= 0 for table in result.block_ordinals.values() for page in table)
    assert engine.manager.num_free_pages() == engine.manager.num_total_pages() - bound
    assert not engine.has_unfinished()
    engine.manager.check_integrity()

    alone = run_to_completion(make_engine(tiny_model, tokens_per_block=B), [prompt], SamplingParams(max_tokens=1))["r0"]
    assert (result.request_id, result.num_prompt_tokens, result.output_token_ids[0]) == ("p", 60, alone[0])
    assert update.new_token_ids == [alone[0]] and result.finish_reason is None and result.output_logprobs[0] is None


def test_parked_pages_survive_other_requests_and_abort_frees_them(tiny_model):
    engine = make_engine(tiny_model, role="context", tokens_per_block=B, num_pages=24)
    parked = prefill_to_park(engine, "parked", list(range(40))).prefill
    others = [f"o{i}" for i in range(3)]
    for request_id in others:
        engine.add_request(request_id, list(range(100, 130)), GREEDY)
    while engine.has_unfinished():
        engine.step()
    assert manager_tables(engine, "parked") == parked.block_ordinals
    engine.manager.check_integrity()
    assert engine.abort("parked") and not engine.abort("parked")
    engine.manager.check_integrity()
    assert engine.manager.num_free_pages() == engine.manager.num_total_pages()


@pytest.mark.parametrize("stage", ["waiting", "prefilling", "parked", "reserved"])
def test_abort_frees_every_page_wherever_the_request_is(tiny_model, stage):
    engine = make_engine(tiny_model, role="context", tokens_per_block=B, max_num_batched_tokens=16)
    prompt = list(range(50))
    if stage == "reserved":
        assert engine.reserve_prefilled("x", prompt)
    elif stage == "parked":
        prefill_to_park(engine, "x", prompt)
    else:
        engine.prefill("x", prompt, GREEDY)
        if stage == "prefilling":
            assert engine.step() == [] and engine.manager.has_request("x")
    assert engine.abort("x")
    assert not engine.manager.has_request("x") and not engine.has_unfinished()
    engine.manager.check_integrity()
    assert engine.manager.num_free_pages() == engine.manager.num_total_pages()


def test_first_token_that_ends_the_request_is_reported(tiny_model):
    engine = make_engine(tiny_model, role="context", tokens_per_block=B)
    prompt = [72, 105, 33]
    first = prefill_to_park(engine, "a", prompt).prefill.output_token_ids[0]
    length = prefill_to_park(engine, "b", prompt, SamplingParams(max_tokens=1)).prefill
    stopped = prefill_to_park(engine, "c", prompt, SamplingParams(stop_token_ids=(first,), logprobs=2)).prefill
    assert (length.output_token_ids[0], length.finish_reason) == (first, FinishReason.LENGTH)
    assert (stopped.output_token_ids[0], stopped.finish_reason) == (first, FinishReason.STOP)
    assert stopped.output_logprobs[0].token_id == first and len(stopped.output_logprobs[0].top) == 2
    for request_id in ("a", "b", "c"):  # parked whatever the reason, until aborted
        assert engine.manager.has_request(request_id)
        engine.abort(request_id)
    assert engine.manager.num_free_pages() == engine.manager.num_total_pages()
