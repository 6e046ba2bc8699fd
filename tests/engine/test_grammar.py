"""Structured outputs on windserve-tiny (engine.grammar): the matcher stands where the outputs leave it
(a replay accepts each token exactly once), drafts are cut at their first invalid token, every path
that samples (greedy, seeded, drafts, the static path, a disaggregated handoff, its fallback) gives
the tokens of the plain aggregated decode, and what does not compile is a GrammarError.

windserve-tiny is byte-level with random weights: its outputs are whatever the grammar allows, so the
grammars here are finite (a bounded integer, an enum, a choice): every request ends with a stop id."""

import json
import random
import re
import threading

import pytest

from engine import FinishReason, SamplingParams
from engine.gpu import paged_attention
from engine.grammar import GrammarError, GrammarSpec, new_bitmask
from engine.grammar_compile import GrammarCompiler
from tests.engine.engine_fixtures import make_engine, run_to_completion, tiny_model  # noqa: F401
from tests.engine.test_first_token import assert_handoff_gives, tokens

B = 8
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "b": {"enum": ["xy", "zw"]}}, "required": ["a", "b"]}
JSON = GrammarSpec.json_schema(SCHEMA)
CHOICE = GrammarSpec.choice(["yes", "no", 'say "maybe"'])
REGEX = GrammarSpec("regex", r"[a-z]{2,5}@[a-z]{2,4}\.com")
PROMPTS = [list(b'{"a": 12, "b": "xy"} {"a": 12, "b": "zw"} {"a": 1'), [(5 * i + 3) % 256 for i in range(19)],
           [7, 8, 9] * 5 + [1, 2]]
BASE = dict(max_tokens=40)


def run(tiny_model, params, **kwargs):
    engine = make_engine(tiny_model, tokens_per_block=B, max_model_len=160, max_num_seqs=4, **kwargs)
    return run_to_completion(engine, PROMPTS, params), engine


def text(tiny_model, ids):
    return tiny_model.tokenizer.decode(ids)


@pytest.fixture(scope="module")
def compiler(tiny_model):
    return GrammarCompiler(tiny_model.tokenizer.hf_tokenizer, tiny_model.hf_config.vocab_size)


def allowed(bitmask, row, vocab_size):
    return [t for t in range(vocab_size) if (int(bitmask[row, t // 32]) >> (t % 32)) & 1]


def walk(compiler, spec, stop_ids, seed, vocab_size):
    """A random path through the grammar (a seeded pick among the allowed tokens each step, a stop id
    once nothing else is allowed): its tokens and the mask before each."""
    matcher, picks, masks = compiler.matcher(spec, stop_ids), random.Random(seed), []
    tokens_out = []
    while not tokens_out or tokens_out[-1] not in stop_ids:
        bitmask = new_bitmask(1, vocab_size)
        matcher.sync(tokens_out)
        matcher.fill(bitmask, 0)
        masks.append(allowed(bitmask, 0, vocab_size))
        tokens_out.append(picks.choice([t for t in masks[-1] if t not in stop_ids] or masks[-1]))
    return tokens_out, masks


@pytest.mark.parametrize("seed", range(3))
def test_a_replayed_matcher_stands_where_an_uninterrupted_one_does(tiny_model, compiler, seed):
    """Syncing a fresh matcher to k outputs (a handoff's replay), syncing again (a retry), and going back
    and forth (a rejected draft, another history) all give the mask of the uninterrupted run."""
    V, stop_ids = tiny_model.hf_config.vocab_size, list(tiny_model.tokenizer.eos_token_ids)
    path, masks = walk(compiler, JSON, stop_ids, seed, V)
    assert set(json.loads(bytes(path[:-1]).decode())) == {"a", "b"}
    for k in sorted({0, 1, len(path) // 2, len(path) - 1}):
        matcher, bitmask = compiler.matcher(JSON, stop_ids), new_bitmask(1, V)
        for _ in range(2):  # a second sync with the same outputs accepts nothing twice
            matcher.sync(path[:k])
            assert matcher.accepted == path[:k]
            matcher.fill(bitmask, 0)
            assert allowed(bitmask, 0, V) == masks[k]
        other = [t for t in masks[k // 2] if t != path[k // 2] and t not in stop_ids][:1]
        matcher.sync(path[:k // 2] + other)  # another history (a rejected draft, a retry elsewhere)
        for j in range(k // 2, len(path)):  # rolled back past the difference, then on to the end
            matcher.sync(path[:j])
            matcher.fill(bitmask, 0)
            assert allowed(bitmask, 0, V) == masks[j]


def test_an_output_the_grammar_does_not_allow_is_an_error(tiny_model, compiler):
    matcher = compiler.matcher(CHOICE, tiny_model.tokenizer.eos_token_ids)
    with pytest.raises(GrammarError, match="not allowed"):
        matcher.sync(list(b"nope"))


def test_drafts_are_cut_at_their_first_invalid_token(tiny_model, compiler):
    eos = tiny_model.tokenizer.eos_token_ids[0]
    matcher = compiler.matcher(CHOICE, [eos])
    outputs = list(b"y")
    assert matcher.num_valid(outputs, list(b"es")) == 2
    assert matcher.num_valid(outputs, list(b"eX") + [eos]) == 1
    assert matcher.num_valid(outputs, list(b"es") + [eos, ord("a")]) == 3  # nothing after the stop id
    assert matcher.accepted == outputs  # the checks consumed nothing


def test_what_does_not_compile_is_a_grammar_error(tiny_model, compiler):
    for bad in (GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "no-such-type"}}}),
                GrammarSpec("regex", "[a-"), GrammarSpec("ebnf", "root ::= undefined_rule")):
        with pytest.raises(GrammarError, match="does not compile"):
            compiler.compile(bad)
    fresh = GrammarCompiler(tiny_model.tokenizer.hf_tokenizer, tiny_model.hf_config.vocab_size)
    release = threading.Event()
    compile_slowly = fresh._compile
    fresh._compile = lambda spec: release.wait() and compile_slowly(spec)  # a compile that runs long
    with pytest.raises(GrammarError, match="did not compile within 0.05 s"):
        fresh.compile(JSON, deadline_s=0.05)
    release.set()
    assert fresh.compile(JSON) is fresh.compile(JSON) and fresh.num_compiles == 1  # finished, then cached
    with pytest.raises(GrammarError, match="stop token"):
        fresh.matcher(JSON, [])


@pytest.mark.parametrize("spec,pattern", [(JSON, None), (CHOICE, r'yes|no|say "maybe"'),
                                          (REGEX, r"[a-z]{2,5}@[a-z]{2,4}\.com")], ids=["json", "choice", "regex"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 3}], ids=["greedy", "seeded"])
def test_every_output_is_in_the_grammar_and_drafts_change_nothing(tiny_model, spec, pattern, sampling):
    params = SamplingParams(**BASE, **sampling, grammar=spec)
    (without, _), (with_drafts, engine) = (run(tiny_model, params, max_draft_len=d) for d in (0, 3))
    assert with_drafts == without
    for ids in without.values():
        assert ids[-1] in tiny_model.tokenizer.eos_token_ids  # a finite grammar: it ends itself
        value = text(tiny_model, ids)
        if pattern is None:
            assert set(json.loads(value)) == {"a", "b"} and 0 <= json.loads(value)["a"] <= 99
        else:
            assert re.fullmatch(pattern, value)
    if spec is JSON:
        assert engine.num_drafts_proposed > 0  # the prompt's JSON gave n-gram drafts, cut to the grammar


def test_max_tokens_cuts_the_value_with_length(tiny_model):
    engine = make_engine(tiny_model, tokens_per_block=B)
    engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=4, grammar=JSON))
    updates = [u for _ in range(20) if engine.has_unfinished() for u in engine.step()]
    assert updates[-1].finish_reason == FinishReason.LENGTH
    assert text(tiny_model, tokens(updates)) == '{"a"'


@pytest.fixture
def torch_attention(monkeypatch):
    """The static step's torch reference attention, also where the suite interprets Triton (as
    tests/engine/test_overlap.py does): both runs of a comparison take the same path."""
    monkeypatch.setattr(paged_attention, "_runs_triton", lambda *tensors: False)


@pytest.mark.parametrize("draft_len", [0, 3])
def test_grammar_rows_take_the_static_path_with_their_masks(tiny_model, torch_attention, draft_len):
    """Beside a plain request, grammar requests decode and verify on the static (device-sampler) path,
    masked there: greedy, the plan path's tokens for all three; seeded (an engine with a static path
    draws counter-based noise, another stream than the plan path's generator), in the grammar, and the
    same tokens with drafts as without. Every decode row took the static path (counted)."""
    params = [SamplingParams(**BASE, grammar=JSON), SamplingParams(max_tokens=12, ignore_eos=True),
              SamplingParams(**BASE, grammar=CHOICE), SamplingParams(**BASE, temperature=0.8, seed=1, grammar=REGEX)]
    expected, _ = run(tiny_model, params[:3])
    got, engine = run(tiny_model, params[:3], use_static_buffers=True, max_draft_len=draft_len)
    assert got == expected
    runner = engine.runner
    assert runner.num_decode_rows > 0 and runner.num_static_decode_rows == runner.num_decode_rows
    with_seed = [params[0], params[1], params[3]]
    seeded, engine = run(tiny_model, with_seed, use_static_buffers=True, max_draft_len=draft_len)
    assert engine.runner.num_static_decode_rows == engine.runner.num_decode_rows > 0
    assert re.fullmatch(r"[a-z]{2,5}@[a-z]{2,4}\.com", text(tiny_model, seeded["r2"]))
    if draft_len:
        undrafted, _ = run(tiny_model, with_seed, use_static_buffers=True)
        assert seeded == undrafted


@pytest.mark.parametrize("draft_len", [0, 3])
def test_disaggregated_equals_aggregated_under_a_grammar(tiny_model, draft_len):
    """The context side samples the first token(s) under the mask; the generation side's fresh matcher
    replays them once (and the fallback's, resumed with them given): the aggregated tokens."""
    params = SamplingParams(**BASE, grammar=JSON)
    aggregated, _ = run(tiny_model, params, max_draft_len=draft_len)
    assert_handoff_gives(tiny_model, PROMPTS, params, aggregated, B, draft_len)


def test_a_grammar_request_never_rides_an_overlapped_step(tiny_model, torch_attention):
    """A plain request's steps are launched ahead (engine.overlap); a grammar request joining later drains
    the pipeline (its mask needs the previous token on the host), and both keep the ordinary steps' tokens."""
    params = [SamplingParams(max_tokens=24, ignore_eos=True), SamplingParams(**BASE, grammar=JSON)]

    def drive(overlap):
        engine = make_engine(tiny_model, tokens_per_block=B, max_model_len=160, max_num_seqs=4,
                             use_static_buffers=True, async_scheduling=overlap)
        out = {"r0": [], "r1": []}
        engine.add_request("r0", PROMPTS[1], params[0])
        for k in range(200):
            if k == 6:
                engine.add_request("r1", PROMPTS[0], params[1])
            if k > 6 and not engine.has_unfinished():
                break
            for update in engine.step():
                out[update.request_id] += update.new_token_ids
        return out, engine

    (plain, _), (overlapped, engine) = drive(False), drive(True)
    assert overlapped == plain and engine.num_steps_launched_ahead > 0
    assert set(json.loads(text(tiny_model, plain["r1"]))) == {"a", "b"}


def test_the_grammar_ends_on_every_stop_id_of_the_request(tiny_model):
    """EOS by default; with ignore_eos, the request's stop_token_ids (here <|pad|>, which no grammar names)."""
    pad = tiny_model.tokenizer.hf_tokenizer.pad_token_id
    for params, ends in ((SamplingParams(**BASE, grammar=CHOICE), tiny_model.tokenizer.eos_token_ids),
                         (SamplingParams(**BASE, ignore_eos=True, stop_token_ids=(pad,), grammar=CHOICE), (pad,))):
        got, _ = run(tiny_model, params)
        for ids in got.values():
            assert ids[-1] in ends and text(tiny_model, ids) in ("yes", "no", 'say "maybe"')
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(ignore_eos=True, grammar=CHOICE)
