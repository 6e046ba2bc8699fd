"""A request resumed with its handed-over outputs given (``resume(..., output_token_ids)``): the
generation side's fallback when a prompt's KV cannot be pulled. Its updates must be those
``add_prefilled`` gives after a transfer of the same prompt: the given tokens first, then the
same continuation, greedy or seeded, with drafts, and from a prefix-cache hit."""

import pytest

from engine import SamplingParams
from engine.handoff import kv_token_ids
from kvcache.slicing import slice_range
from tests.engine.engine_fixtures import make_engine, run_to_completion, tiny_model  # noqa: F401
from tests.engine.test_prefill import prefill_to_park

B = 8
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True, logprobs=2)
PROMPTS = [[(5 * i + 3 * r) % 256 for i in range(9 + 23 * r)] for r in range(3)] + [[10, 20, 30, 40] * 6]


def transferred(context, generation, request_id, prompt, params, first_token=None):
    """Prefill on ``context``, copy the windowed slice by ordinal, ``add_prefilled`` on ``generation``
    with the context's outputs (or ``first_token`` alone); every update of the request, in order."""
    prefill = prefill_to_park(context, request_id, prompt, params).prefill
    outputs, logprobs = prefill.output_token_ids, prefill.output_logprobs
    if first_token is not None:
        outputs, logprobs = [first_token[0]], [first_token[1]]
    kv = kv_token_ids(prompt, outputs)
    assert generation.reserve_prefilled(request_id, kv)
    for group in context.manager.spec.groups:
        src, dst = prefill.block_ordinals[group.name], generation.manager.get_block_ordinals(request_id, group.name)
        pages = generation.manager.storage.tensors[group.name]
        for ordinal in slice_range(len(kv), group.window, B):
            if dst[ordinal] >= 0:
                pages[dst[ordinal]] = context.manager.storage.tensors[group.name][src[ordinal]]
    context.abort(request_id)
    updates = generation.add_prefilled(request_id, prompt, outputs, params, logprobs)
    return updates + drain(generation, request_id)


def local(generation, request_id, prompt, params, given):
    """``given`` (ids, logprobs): resumed with those outputs given; (id, logprob): one output; None: a plain request."""
    if given is None:
        generation.add_request(request_id, prompt, params)
        return drain(generation, request_id)
    ids, logprobs = given if isinstance(given[0], list) else ([given[0]], [given[1]])
    generation.resume(request_id, prompt, ids, params, logprobs)
    return drain(generation, request_id)


def drain(engine, request_id):
    updates = []
    while engine.has_unfinished():
        updates += [u for u in engine.step() if u.request_id == request_id]
    engine.manager.check_integrity()
    assert engine.manager.num_free_pages() == engine.manager.num_total_pages()
    return updates


def tokens(updates):
    return [t for u in updates for t in u.new_token_ids]


def assert_handoff_gives(model, prompts, params, aggregated, tokens_per_block, draft_len) -> None:
    """Each prompt through a context and a generation engine (the transfer), and through a generation
    engine resumed with the context side's first tokens given (the fallback), gives ``aggregated[f"r{i}"]``;
    every context page is free afterwards."""
    kwargs = dict(tokens_per_block=tokens_per_block, max_model_len=160, max_draft_len=draft_len)
    context = make_engine(model, role="context", **kwargs)
    generation = make_engine(model, role="generation", **kwargs)
    fallback = make_engine(model, role="generation", **kwargs)
    for r, prompt in enumerate(prompts):
        got = transferred(context, generation, f"t{r}", prompt, params)
        assert tokens(got) == aggregated[f"r{r}"]
        k = len(got[0].new_token_ids)
        resumed = local(fallback, f"f{r}", prompt, params, (tokens(got)[:k], [None] * k))
        assert tokens(resumed) == aggregated[f"r{r}"]
    assert context.manager.num_free_pages() == context.manager.num_total_pages()


def engines(tiny_model, draft_len=0, **kwargs):
    kwargs = dict(tokens_per_block=B, max_draft_len=draft_len, **kwargs)
    return (make_engine(tiny_model, role="context", **kwargs), make_engine(tiny_model, role="generation", **kwargs),
            make_engine(tiny_model, role="generation", **kwargs))


@pytest.mark.parametrize("params,draft_len", [(GREEDY, 0), (GREEDY, 3), (SEEDED, 0)])
def test_local_prefill_with_the_context_first_token_equals_the_transferred_run(tiny_model, params, draft_len):
    """The first token the context side sampled, given to a local prefill: the same updates as
    the transfer gives (tokens, text, logprobs), and the same tokens as an aggregated run."""
    context, pulled, fallback = engines(tiny_model, draft_len)
    aggregated = run_to_completion(make_engine(tiny_model, tokens_per_block=B), PROMPTS, params)
    for r, prompt in enumerate(PROMPTS):
        reference = transferred(context, pulled, f"r{r}", prompt, params)
        first = reference[0]
        given = (first.new_token_ids, first.logprobs or [None] * len(first.new_token_ids))
        got = local(fallback, f"r{r}", prompt, params, given)
        assert tokens(got) == tokens(reference) == aggregated[f"r{r}"]
        assert (got[0].new_token_ids, got[0].new_text, got[0].logprobs) == (
            first.new_token_ids, first.new_text, first.logprobs)
        if draft_len == 0:  # with drafts, how tokens group into updates depends on step timings
            assert [u.logprobs for u in got] == [u.logprobs for u in reference]


@pytest.mark.parametrize("params,draft_len", [(GREEDY, 0), (GREEDY, 3), (SEEDED, 0)])
def test_a_given_first_token_replaces_the_sampled_one(tiny_model, params, draft_len):
    """A first token the model would not pick here: the local prefill still keeps it, and what
    follows continues from it exactly as after a transfer that carried it."""
    context, pulled, fallback = engines(tiny_model, draft_len)
    natural = run_to_completion(make_engine(tiny_model, tokens_per_block=B), PROMPTS, params)
    for r, prompt in enumerate(PROMPTS):
        other = ((natural[f"r{r}"][0] + 1) % 256, None)
        reference = transferred(context, pulled, f"r{r}", prompt, params, first_token=other)
        got = local(fallback, f"r{r}", prompt, params, other)
        assert tokens(got)[0] == other[0] != natural[f"r{r}"][0]
        assert tokens(got) == tokens(reference)
        assert got[0].logprobs in (None, [None])  # the given logprob, not the drawn one


def test_given_first_token_after_a_prefix_cache_hit(tiny_model):
    """The local prefill starts at its prefix-cache hit (blocks another request left), and the
    continuation is unchanged: the hit's KV equals what the prefill would compute."""
    shared = [(7 * i) % 256 for i in range(40)]
    prompt = shared + [1, 2, 3, 4, 5]
    context, pulled, fallback = engines(tiny_model, draft_len=2)
    expected = run_to_completion(make_engine(tiny_model, tokens_per_block=B), [prompt], GREEDY)["r0"]
    reference = transferred(context, pulled, "a", prompt, GREEDY)
    local(fallback, "warm", shared + [9], GREEDY, None)
    got = local(fallback, "a", prompt, GREEDY, (expected[0], None))
    assert got[-1].num_cached_tokens == 40 and fallback.scheduler.num_prefix_hit_tokens >= 40
    assert tokens(got) == tokens(reference) == expected


def test_given_first_token_that_ends_the_request(tiny_model):
    """max_tokens=1, or the given token is a stop token: one update, finished, as after a transfer."""
    _, _, fallback = engines(tiny_model)
    prompt = PROMPTS[1]
    first = run_to_completion(make_engine(tiny_model, tokens_per_block=B), [prompt], GREEDY)["r0"][0]
    one = local(fallback, "one", prompt, SamplingParams(max_tokens=1), (first + 3, None))
    stop = local(fallback, "stop", prompt, SamplingParams(max_tokens=9, stop_token_ids=(first + 3,)),
                 (first + 3, None))
    assert [(u.new_token_ids, u.finish_reason) for u in one] == [([first + 3], "length")]
    assert [(u.new_token_ids, u.finish_reason) for u in stop] == [([first + 3], "stop")]


def test_given_first_token_survives_a_preemption_before_its_prefill_ends(tiny_model):
    """Preempted mid-prefill (chunked, tight cache), the request recomputes and still keeps the given token."""
    kwargs = dict(tokens_per_block=B, num_pages=14, max_num_batched_tokens=16)
    prompts = [[(3 * i + r) % 256 for i in range(50)] for r in range(3)]
    expected = run_to_completion(make_engine(tiny_model, **kwargs), prompts, GREEDY)
    engine = make_engine(tiny_model, role="generation", **kwargs)
    for r, prompt in enumerate(prompts):
        engine.resume(f"r{r}", prompt, [expected[f"r{r}"][0]], GREEDY)
    got = {f"r{r}": [] for r in range(3)}
    while engine.has_unfinished():
        for update in engine.step():
            got[update.request_id] += update.new_token_ids
    assert got == expected
    assert engine.scheduler.num_preemptions > 0
