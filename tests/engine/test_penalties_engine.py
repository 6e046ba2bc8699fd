"""Penalties, logit_bias and min_tokens through the engine on windserve-tiny: greedy (and seeded)
tokens with drafts equal those without, the static (device-sampler) path equals the host path, the
processors change the tokens, and a disaggregated request (context side samples the first tokens,
generation side counts them) equals the aggregated one."""

import pytest

from engine import SamplingParams
from tests.engine.engine_fixtures import make_engine, run_to_completion, tiny_model  # noqa: F401
from tests.engine.test_first_token import assert_handoff_gives, tokens

B = 8
PROMPTS = [[10, 20, 30, 40] * 6, [(5 * i + 3) % 256 for i in range(19)], [7, 8, 9] * 5 + [1, 2]]
BASE = dict(max_tokens=20, ignore_eos=True)
PENALIZED = {  # negative penalties favour repeats: n-gram drafts are then accepted under penalties
    "frequency+presence": SamplingParams(**BASE, frequency_penalty=0.7, presence_penalty=0.4),
    "negative frequency+presence": SamplingParams(**BASE, frequency_penalty=-0.6, presence_penalty=-0.5),
    "repetition": SamplingParams(**BASE, repetition_penalty=1.3),
    "repetition below 1": SamplingParams(**BASE, repetition_penalty=0.7),
    "seeded, all": SamplingParams(**BASE, temperature=0.8, seed=5, frequency_penalty=0.5,
                                  presence_penalty=-0.3, repetition_penalty=1.1),
}


def run(tiny_model, params, **kwargs):
    engine = make_engine(tiny_model, tokens_per_block=B, max_model_len=160, max_num_seqs=4, **kwargs)
    return run_to_completion(engine, PROMPTS, params), engine


@pytest.fixture(scope="module")
def plain(tiny_model):
    return run(tiny_model, SamplingParams(**BASE))[0]


@pytest.mark.parametrize("name", list(PENALIZED))
def test_drafts_give_the_tokens_of_the_plain_decode(tiny_model, plain, name):
    """Each verify row counts the drafts before it (engine.penalties): greedy and seeded tokens with
    drafts are those without."""
    params = PENALIZED[name]
    (without, _), (with_drafts, engine) = (run(tiny_model, params, max_draft_len=d) for d in (0, 3))
    assert with_drafts == without
    if params.is_greedy:
        assert without != plain  # the processors changed greedy output
    if name.startswith(("negative", "repetition below")):  # rows past the first saw drafts as outputs
        assert engine.num_drafts_accepted > 0


def test_the_device_sampler_path_gives_the_host_tokens(tiny_model):
    """The static step (fixed buffers, engine.gpu.sampling's ops; Triton interpreted on CPU when
    TRITON_INTERPRET=1) applies every processor as the host sampler does, on verify rows too. Short:
    interpreted Triton attention is slow."""
    params = SamplingParams(max_tokens=10, ignore_eos=True, frequency_penalty=-0.6, presence_penalty=-0.5,
                            repetition_penalty=0.9, logit_bias={PROMPTS[0][0]: 3.0, 5: -100.0}, min_tokens=4)
    prompts = PROMPTS[:2]
    engine = make_engine(tiny_model, tokens_per_block=B, max_model_len=160, max_num_seqs=4)
    expected = run_to_completion(engine, prompts, params)
    for draft_len in (0, 3):
        engine = make_engine(tiny_model, tokens_per_block=B, max_model_len=160, max_num_seqs=4,
                             max_draft_len=draft_len, use_static_buffers=True)
        assert run_to_completion(engine, prompts, params) == expected, f"drafts={draft_len}"
        assert engine.runner.static.num_steps > 0 and (draft_len == 0 or engine.num_drafts_accepted > 0)


def test_a_banned_greedy_token_never_appears(tiny_model, plain):
    banned = plain["r0"][0]
    got, _ = run(tiny_model, SamplingParams(**BASE, logit_bias={banned: -100}))
    assert all(banned not in out for out in got.values())
    assert got["r0"][0] != banned


def test_min_tokens_holds_back_a_stop_token_id(tiny_model, plain):
    """Without min_tokens the request stops at the stop id's first appearance; with it the id is
    masked until min_tokens tokens are out."""
    out = plain["r1"]
    stop = out[1]
    first = out.index(stop)
    stopped, _ = run(tiny_model, [SamplingParams(**BASE, stop_token_ids=(stop,))] * 3)
    assert stopped["r1"] == out[:first + 1]
    held, _ = run(tiny_model, [SamplingParams(**BASE, stop_token_ids=(stop,), min_tokens=6)] * 3)
    assert len(held["r1"]) >= 6 and stop not in held["r1"][:6]


@pytest.mark.parametrize("draft_len", [0, 3])
def test_disaggregated_equals_aggregated_with_processors(tiny_model, plain, draft_len):
    """The context side samples the first token(s) under the same processors (a banned token, the
    repetition penalty over the prompt, min_tokens); the generation side counts them as outputs; the
    fallback (resume with them given) too."""
    banned = plain["r0"][0]
    params = SamplingParams(**BASE, logit_bias={banned: -100.0}, repetition_penalty=1.2, frequency_penalty=0.3,
                            min_tokens=3, stop_token_ids=(banned,))
    aggregated, _ = run(tiny_model, params)
    assert aggregated["r0"][0] != banned
    assert_handoff_gives(tiny_model, PROMPTS, params, aggregated, B, draft_len)
