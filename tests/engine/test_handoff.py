"""Multi-token handoff: a prefill-only request whose token 0 shows no text decodes on, quietly,
until its text is visible, it finishes, or it has ``HANDOFF_MAX_TOKENS`` outputs (engine.handoff).

windserve-tiny is byte-level with random weights: token 0 is often half a UTF-8 character,
which the detokenizer holds back. The prompts are found by search, not hard-coded."""

import dataclasses

import pytest

import engine.handoff
from engine import FinishReason, SamplingParams
from engine.handoff import HANDOFF_MAX_TOKENS, kv_token_ids
from engine.tokenizer import IncrementalDecoder
from kvcache.slicing import UNBOUND, slice_range, stale_end
from tests.engine.engine_fixtures import make_engine, run_to_completion, tiny_model  # noqa: F401
from tests.engine.test_first_token import drain, local, tokens, transferred
from tests.engine.test_prefill import manager_tables, prefill_to_park

B = 8
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True, logprobs=2)
CANDIDATES = [[(7 * i + 13 * r) % 256 for i in range(37 + 2 * r)] for r in range(32)]


def handoff_len(tokenizer, prompt, outputs):
    """(k, text) the handoff should have: up to the first output whose text shows, capped."""
    decoder, text = IncrementalDecoder(tokenizer, prompt_ids=prompt), ""
    for k, token_id in enumerate(outputs[:HANDOFF_MAX_TOKENS], start=1):
        text += decoder.push(token_id)
        if text:
            return k, text
    return HANDOFF_MAX_TOKENS, text


def crosses_a_block(prompt, k):
    """The handed-over outputs' KV fills a block the prompt alone leaves partial (its name covers outputs)."""
    return (len(prompt) + k - 1) // B > len(prompt) // B


@pytest.fixture(scope="module", params=[GREEDY, SEEDED], ids=["greedy", "seeded"])
def held_back(request, tiny_model):
    """(params, prompts whose token 0 is held back, their aggregated outputs, (k, text) of each):
    a few, those whose handoff reaches a new block first, then those reaching the cap."""
    params = request.param
    aggregated = run_to_completion(make_engine(tiny_model, tokens_per_block=B), CANDIDATES, params)
    outputs = [aggregated[f"r{r}"] for r in range(len(CANDIDATES))]
    handoffs = [handoff_len(tiny_model.tokenizer, p, out) for p, out in zip(CANDIDATES, outputs)]
    held = [r for r, (k, _) in enumerate(handoffs) if k > 1]
    assert len(held) >= 2, f"too few prompts with a held-back token 0 among the candidates: {handoffs}"
    order = {r: (not crosses_a_block(CANDIDATES[r], handoffs[r][0]), handoffs[r][0] < HANDOFF_MAX_TOKENS) for r in held}
    picked = sorted(held, key=order.get)[:5]
    return params, [CANDIDATES[r] for r in picked], [outputs[r] for r in picked], [handoffs[r] for r in picked]


def test_parks_at_the_first_visible_text_with_the_aggregated_outputs(tiny_model, held_back):
    """One update with all k outputs (ids, text, logprobs as aggregated); pages of positions
    [0, P + k - 1) per group, window blocks only as far as the window still needs them."""
    params, prompts, outputs, ks = held_back
    engine = make_engine(tiny_model, role="context", tokens_per_block=B)
    for r, (prompt, expected, (k, text)) in enumerate(zip(prompts, outputs, ks)):
        update = prefill_to_park(engine, f"h{r}", prompt, params)
        result = update.prefill
        assert result.output_token_ids == update.new_token_ids == expected[:k]
        assert [lp.token_id for lp in result.output_logprobs] == expected[:k] == [lp.token_id for lp in update.logprobs]
        assert update.new_text == text and (text != "" or k == HANDOFF_MAX_TOKENS)
        num_kv = result.num_kv_tokens
        assert num_kv == len(prompt) + k - 1 and engine.manager.num_tokens(f"h{r}") == num_kv
        assert result.block_ordinals == manager_tables(engine, f"h{r}")
        for group in engine.manager.spec.groups:
            table = result.block_ordinals[group.name]
            assert len(table) == -(-num_kv // B)
            assert all(table[i] != UNBOUND for i in slice_range(num_kv, group.window, B))
            released = stale_end(num_kv - 1, group.window, B)  # the last quiet step released below this
            assert table[:released] == [UNBOUND] * released
        engine.manager.check_integrity()
    bound = sum(page >= 0 for r in range(len(prompts)) for t in manager_tables(engine, f"h{r}").values() for page in t)
    assert engine.manager.num_free_pages() == engine.manager.num_total_pages() - bound
    for r in range(len(prompts)):
        assert engine.abort(f"h{r}")
    assert engine.manager.num_free_pages() == engine.manager.num_total_pages()


def test_cap_is_reached_on_some_prompt(tiny_model):
    """A handoff that runs to the cap (greedy: among the candidates some do;
    seeded draws reach it on none of them, so this one is greedy only)."""
    aggregated = run_to_completion(make_engine(tiny_model, tokens_per_block=B), CANDIDATES, GREEDY)
    outputs = [aggregated[f"r{r}"] for r in range(len(CANDIDATES))]
    handoffs = [handoff_len(tiny_model.tokenizer, p, out) for p, out in zip(CANDIDATES, outputs)]
    capped = [r for r, (k, _) in enumerate(handoffs) if k == HANDOFF_MAX_TOKENS]
    assert capped, f"no candidate reaches the cap: {handoffs}"
    r = capped[0]
    update = prefill_to_park(make_engine(tiny_model, role="context", tokens_per_block=B), "cap", CANDIDATES[r], GREEDY)
    assert update.new_token_ids == update.prefill.output_token_ids == outputs[r][:HANDOFF_MAX_TOKENS]
    assert update.new_text == handoffs[r][1]


def test_disaggregated_equals_aggregated_after_a_multi_token_handoff(tiny_model, held_back):
    """Transfer of num_kv_tokens by ordinal, then add_prefilled with all k: the aggregated tokens and
    logprobs; and the fallback (resume with the k outputs, nothing transferred) the same."""
    params, prompts, outputs, ks = held_back
    context = make_engine(tiny_model, role="context", tokens_per_block=B)
    generation = make_engine(tiny_model, role="generation", tokens_per_block=B)
    fallback = make_engine(tiny_model, role="generation", tokens_per_block=B)
    for r, (prompt, expected, (k, _)) in enumerate(zip(prompts, outputs, ks)):
        got = transferred(context, generation, f"t{r}", prompt, params)
        assert got[0].new_token_ids[:k] == expected[:k] and tokens(got) == expected
        assert [lp.token_id for u in got for lp in u.logprobs] == expected
        resumed = local(fallback, f"f{r}", prompt, params, (expected[:k], got[0].logprobs[:k]))
        assert resumed[0].new_token_ids[:k] == expected[:k] and tokens(resumed) == expected
        assert [u.logprobs for u in resumed] == [u.logprobs for u in got]
    assert context.manager.num_free_pages() == context.manager.num_total_pages()


def test_reservation_names_the_blocks_of_the_handed_over_tokens(tiny_model, held_back):
    """The generation side's reservation is num_kv_tokens long and its prefix-cache names are those
    tokens' blocks: a later identical handoff binds them from the cache and pulls nothing."""
    params, prompts, outputs, ks = held_back
    generation = make_engine(tiny_model, role="generation", tokens_per_block=B, enable_prefix_caching=True)
    context = make_engine(tiny_model, role="context", tokens_per_block=B)
    r = 0  # the fixture puts a prompt whose handoff reaches a new block first, if there is one
    prompt, k = prompts[r], ks[r][0]
    assert crosses_a_block(prompt, k)
    transferred(context, generation, "first", prompt, params)
    kv = kv_token_ids(prompt, outputs[r][:k])
    assert generation.reserve_prefilled("again", kv) and generation.manager.num_tokens("again") == len(kv)
    full = generation.manager.get_cached_ordinals("again", "full")
    assert full == list(range(len(kv) // B))
    generation.abort("again")
    assert generation.manager.num_free_pages() == generation.manager.num_total_pages()


@pytest.mark.parametrize("ending", ["max_tokens", "stop_token"])
def test_a_finish_inside_the_handoff_parks_finished(tiny_model, held_back, ending):
    """max_tokens=2, or a stop token at output 1: parked with that reason and those 2 outputs;
    abort (what the context worker does for a finished prefill) frees every page."""
    params, prompts, outputs, ks = held_back
    r = max(range(len(ks)), key=lambda i: ks[i][0])
    assert ks[r][0] > 2  # else the handoff ends at output 1 anyway
    expected = outputs[r]
    if ending == "max_tokens":
        params, reason = dataclasses.replace(params, max_tokens=2), FinishReason.LENGTH
    else:
        if expected[1] == expected[0]:
            pytest.skip("output 1 repeats output 0: a stop token would end at output 0")
        params, reason = dataclasses.replace(params, stop_token_ids=(expected[1],)), FinishReason.STOP
    engine = make_engine(tiny_model, role="context", tokens_per_block=B)
    result = prefill_to_park(engine, "x", prompts[r], params).prefill
    assert (result.output_token_ids, result.finish_reason) == (expected[:2], reason)
    assert engine.abort("x") and not engine.has_unfinished()
    engine.manager.check_integrity()
    assert engine.manager.num_free_pages() == engine.manager.num_total_pages()


def test_cap_of_one_hands_over_at_token_0(tiny_model, held_back, monkeypatch):
    """HANDOFF_MAX_TOKENS = 1: the handoff before multi-token handoffs, token 0 alone, no text."""
    monkeypatch.setattr(engine.handoff, "HANDOFF_MAX_TOKENS", 1)
    params, prompts, outputs, ks = held_back
    context = make_engine(tiny_model, role="context", tokens_per_block=B)
    update = prefill_to_park(context, "one", prompts[0], params)
    assert update.new_token_ids == outputs[0][:1] and update.new_text == ""
    assert update.prefill.num_kv_tokens == len(prompts[0])
    context.abort("one")
    generation = make_engine(tiny_model, role="generation", tokens_per_block=B)
    assert tokens(transferred(context, generation, "t", prompts[0], params)) == outputs[0]
    drain(generation, "t")
