"""engine.gpu.sampling on CPU tensors: greedy is the argmax, seeded draws depend on (seed, output index)
only, top-k / top-p keep to engine.sampler's allowed set, zero-probability tokens never win, and
draft verification accepts exactly the prefix engine.sampler's greedy verification accepts."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.gpu.sampling import SamplingRows, accepted_drafts, sample_tokens, uniform_noise
from engine.params import SamplingParams
from engine.sampler import Sampler, sampling_probs


def rows_for(params: list[SamplingParams], seeds: list[int], counters: list[int]) -> SamplingRows:
    seeds_t = torch.tensor(seeds, dtype=torch.int64)
    return SamplingRows(
        temperature=torch.tensor([0.0 if p.is_greedy else p.temperature for p in params]),
        top_k=torch.tensor([p.top_k for p in params], dtype=torch.int32),
        top_p=torch.tensor([p.top_p for p in params]),
        seed_lo=(seeds_t & (2**31 - 1)).int(), seed_hi=(seeds_t >> 31).int(),
        counters=torch.tensor(counters, dtype=torch.int32),
    )


def draw(logits, params, seeds, counters):
    is_greedy = all(p.is_greedy for p in params)
    is_filtered = any(p.top_k > 0 or p.top_p < 1 for p in params)
    return sample_tokens(logits, rows_for(params, seeds, counters), is_greedy=is_greedy,
                         is_filtered=is_filtered).tolist()


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(2, 50), st.integers(0, 2**31))
def test_greedy_is_the_argmax(num_rows, vocab, seed):
    logits = torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed))
    logits[0, vocab // 2] = logits[0].max()  # a tie: the lowest id, as on the host
    greedy = [SamplingParams()] * num_rows
    assert draw(logits, greedy, [0] * num_rows, [0] * num_rows) == logits.argmax(dim=-1).tolist()
    # greedy rows stay the argmax beside sampled rows
    mixed = [SamplingParams(temperature=1.0) if i % 2 else SamplingParams() for i in range(num_rows)]
    ids = draw(logits, mixed, list(range(num_rows)), [3] * num_rows)
    assert [ids[i] for i in range(0, num_rows, 2)] == logits.argmax(dim=-1)[0::2].tolist()


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**62), st.integers(0, 10_000), st.integers(0, 7), st.integers(0, 2**31))
def test_a_seeded_draw_does_not_depend_on_its_batch_position_or_neighbours(seed, counter, position, other):
    vocab = 64
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(other))
    params = SamplingParams(temperature=0.8, top_p=0.9)
    alone = draw(logits[position:position + 1], [params], [seed], [counter])[0]
    seeds = [other + i for i in range(8)]
    counters = [other % 97 + i for i in range(8)]
    seeds[position], counters[position] = seed, counter
    mixed = [SamplingParams(temperature=0.3 + 0.1 * i, top_k=i) for i in range(8)]
    mixed[position] = params
    assert draw(logits, mixed, seeds, counters)[position] == alone
    assert draw(logits[position:position + 1], [params], [seed], [counter])[0] == alone  # reproducible


def test_draws_vary_with_the_output_index_and_cover_the_distribution():
    logits = torch.zeros(1, 6)  # uniform over 6 tokens
    params = [SamplingParams(temperature=1.0)]
    ids = [draw(logits, params, [1234], [counter])[0] for counter in range(300)]
    counts = [ids.count(v) for v in range(6)]
    assert all(20 <= c <= 80 for c in counts), counts  # 50 expected each; far outside only if broken
    other_seed = [draw(logits, params, [1235], [counter])[0] for counter in range(300)]
    assert other_seed != ids


@settings(max_examples=50, deadline=None)
@given(st.integers(2, 40), st.integers(0, 12), st.floats(0.05, 1.0), st.floats(0.2, 2.0), st.integers(0, 2**31),
       st.integers(0, 2**40))
def test_top_k_and_top_p_never_pick_outside_the_allowed_set(vocab, top_k, top_p, temperature, data_seed, seed):
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(data_seed)) * 3
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)] * 4
    allowed = sampling_probs(logits, params) > 0
    ids = draw(logits, params, [seed] * 4, [0, 1, 2, 3])
    assert all(bool(allowed[i, t]) for i, t in enumerate(ids))


def test_zero_probability_never_drawn_and_certainty_always():
    logits = torch.full((64, 10), float("-inf"))
    logits[:, 3] = 0.0
    logits[:, 7] = 0.5  # only tokens 3 and 7 are possible
    params = [SamplingParams(temperature=1.0)] * 64
    ids = draw(logits, params, list(range(64)), list(range(64)))
    assert set(ids) == {3, 7}
    certain = torch.full((64, 10), -1e4)
    certain[:, 5] = 1e4
    assert draw(certain, params, list(range(64)), [9] * 64) == [5] * 64


def test_uniform_noise_is_in_the_open_unit_interval():
    u = uniform_noise(torch.tensor([0, 2**31 - 1]), torch.tensor([0, 2**31 - 1]), torch.tensor([0, 2**31 - 1]), 4096)
    assert u.min() > 0 and u.max() < 1
    assert 0.45 < float(u.mean()) < 0.55


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 2**31)), min_size=1, max_size=6), st.integers(0, 3))
def test_accepted_drafts_match_greedy_verification(requests, num_padding):
    """Each request: 1 + d tokens; the draws agree with the drafts for a random prefix."""
    vocab = 5
    input_ids, sampled, offsets, rows, expected = [], [], [], [], []
    for row, (num_drafts, seed) in enumerate(requests):
        g = torch.Generator().manual_seed(seed)
        drafts = torch.randint(0, vocab, (num_drafts,), generator=g).tolist()
        targets = torch.randint(0, vocab, (num_drafts + 1,), generator=g).tolist()
        logits = torch.nn.functional.one_hot(torch.tensor(targets), vocab).float()
        verified = Sampler().verify(logits, drafts, SamplingParams(), None)
        expected.append(verified.num_accepted)
        input_ids += [9] + drafts
        sampled += targets
        offsets += list(range(num_drafts + 1))
        rows += [row] * (num_drafts + 1)
    input_ids += [0] * num_padding
    sampled += [0] * num_padding
    offsets += [-1] * num_padding
    rows += [-1] * num_padding
    tensors = [torch.tensor(v) for v in (sampled, input_ids, offsets, rows)]
    assert accepted_drafts(*tensors, len(requests)).tolist() == expected


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(2, 300), st.integers(0, 2**31), st.sampled_from([0, 5]),
       st.sampled_from([1.0, 0.8]))
def test_the_hosts_counter_draws_are_the_devices_draws(num_rows, vocab, seed, top_k, top_p):
    """Sampler(counter_draws=True), the host path's mixed steps on an engine that samples decode steps on
    the device, draws each row's token from the same (seed, output index) noise as sample_tokens; its
    verification draws row i at output index first + i, as accepted_drafts compares them."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=generator) * 3
    params = [SamplingParams(temperature=0.7 + 0.1 * i, top_k=top_k, top_p=top_p, seed=seed + i)
              for i in range(num_rows)]
    seeds, counters = [p.seed for p in params], [3 * i + 1 for i in range(num_rows)]
    host = Sampler(counter_draws=True).sample(logits, params, [None] * num_rows, list(zip(seeds, counters)))
    assert host.token_ids == draw(logits, params, seeds, counters)
    one = params[0]
    device_rows = draw(logits, [one] * num_rows, [one.seed] * num_rows, [5 + i for i in range(num_rows)])
    drafts = device_rows[:-1]  # every draft matches its row's draw: all accepted, then the last row's
    verified = Sampler(counter_draws=True).verify(logits, drafts, one, None, key=(one.seed, 5))
    assert verified.token_ids == device_rows and verified.num_accepted == num_rows - 1
