"""Sampling on the device: penalties and logit bias, greedy, temperature, top-k, top-p, and verification
of drafts, with no host sync.

Draws use counter-based noise, a hash of (seed, output index, token id), instead of a generator per
request: the same seeded request draws the same token wherever it sits in a batch, whatever the
padding, and the ops have fixed shapes (a CUDA graph could capture them). A draw is the exponential
race (equivalent to sampling from ``p``): ``argmax_v p[v] / E[v]`` with ``E[v] = -log(u[v])`` and
``u`` uniform in (0, 1); a token with ``p = 0`` never wins, a token with ``p = 1`` always does.

The probabilities are engine.sampler's ``sampling_probs``: temperature, then top-k, then top-p, the
top token always kept; greedy rows (temperature 0) take the argmax (ties: the lowest id).
Verification is engine.sampler's ``match_sample`` on every row at once: token t's draw is compared
with the draft that follows it in its request::

    token      t0   t1   t2 | t3          offsets  0 1 2 | 0
    input      x    d0   d1 | y           draws    d0 e1 f2 | g3
    match      d0==d0  e1!=d1  (last of row) -> row 0 accepts 1 draft, emits d0, e1
"""

from __future__ import annotations

from typing import NamedTuple

import torch

_MASK32 = (1 << 32) - 1
_MULTIPLIERS = (0x7FEB352D, 0x46CA68B5)  # under 2**31: a 32-bit value times one fits in int64
_NO_MISMATCH = 1 << 30


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (xorshift-multiply rounds) of int64 values, result in [0, 2**32)."""
    x = x & _MASK32
    for multiplier in _MULTIPLIERS:
        x = x ^ (x >> 16)
        x = (x * multiplier) & _MASK32
    return x ^ (x >> 15)


def uniform_noise(seed_lo: torch.Tensor, seed_hi: torch.Tensor, counters: torch.Tensor, vocab_size: int):
    """u [N, V] in (0, 1): row n's from (seed, counter) of row n only, column v's from token id v."""
    row = _mix(seed_lo.long() ^ _mix(seed_hi.long() ^ _mix(counters.long())))
    columns = torch.arange(vocab_size, device=row.device, dtype=torch.int64)
    bits = _mix(row[:, None] ^ _mix(columns + 0x9E3779B9)[None, :]) >> 8  # 24 bits: exact in float32
    return (bits.float() + 0.5) * (1.0 / (1 << 24))


def filtered_probs(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """engine.sampler's top-k then top-p cut with per-row tensors (``top_k`` 0 = all), softmax after."""
    vocab_size = scaled.shape[-1]
    top_k = torch.where(top_k > 0, top_k, vocab_size).long()
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab_size, device=scaled.device)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    top_p = top_p[:, None]
    drop = (mass_before >= top_p) & (top_p < 1.0) & (ranks > 0)
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    return torch.zeros_like(scaled).scatter_(-1, sorted_ids, sorted_probs)


class PenaltyRows(NamedTuple):
    """The logits processors per token row, built by engine.penalties: dense over the vocabulary
    [N, V] ``bias`` (logit_bias, -inf where min_tokens masks a stop id), ``seen`` (in the prompt or the
    outputs: what the repetition penalty reads) and ``counts`` (in the outputs); per row [N, 1]
    ``repetition`` (1 = off), ``frequency``, ``presence`` (0 = off)."""

    bias: torch.Tensor
    seen: torch.Tensor
    counts: torch.Tensor
    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor


def penalize(logits: torch.Tensor, rows: PenaltyRows) -> torch.Tensor:
    """Processed float32 logits [N, V], in vLLM's order::

        s = logits + bias                                      (logit_bias; min_tokens' -inf)
        s = s * r if s < 0 else s / r        where seen        (transformers' RepetitionPenalty)
        s = s - frequency * count - presence * (count > 0)     (OpenAI's formula)

    A row whose processors are off keeps its logits (bias 0, r 1, penalties 0). ``logits`` is not
    modified: logprobs still report the raw distribution."""
    scores = logits.float() + rows.bias
    repeated = torch.where(scores < 0, scores * rows.repetition, scores / rows.repetition)
    scores = torch.where(rows.seen, repeated, scores)
    return scores - rows.frequency * rows.counts - rows.presence * (rows.counts > 0).float()


class SamplingRows(NamedTuple):
    """Per token row: temperature (0 = greedy), top_k (0 = all), top_p, seed halves, output index."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed_lo: torch.Tensor
    seed_hi: torch.Tensor
    counters: torch.Tensor


def sample_tokens(logits: torch.Tensor, rows: SamplingRows, *, is_greedy: bool, is_filtered: bool) -> torch.Tensor:
    """Token ids [N] (int64) for logits [N, V]. ``is_greedy`` / ``is_filtered``: what the host knows
    of the step (every row greedy: argmax only; any top-k/top-p: the sort), so no value is read back."""
    greedy_ids = logits.argmax(dim=-1)
    if is_greedy:
        return greedy_ids
    is_sampled = rows.temperature > 0
    scaled = logits.float() / torch.where(is_sampled, rows.temperature, 1.0)[:, None]
    probs = filtered_probs(scaled, rows.top_k, rows.top_p) if is_filtered else scaled.softmax(dim=-1)
    noise = -torch.log(uniform_noise(rows.seed_lo, rows.seed_hi, rows.counters, logits.shape[-1]))
    drawn = (probs / noise).argmax(dim=-1)
    return torch.where(is_sampled, drawn, greedy_ids)


def counter_draws(probs: torch.Tensor, seeds: list[int], counters: list[int]) -> torch.Tensor:
    """The draws ``sample_tokens`` makes, for rows of sampling probabilities [N, V] already computed (the
    host path's mixed steps on an engine whose decode steps sample here): row n is keyed by
    (``seeds[n]``, ``counters[n]``), the request's seed and output index, so a request draws the same
    token whichever path its step took."""
    device = probs.device
    seed_lo = torch.tensor([s & ((1 << 31) - 1) for s in seeds], device=device)
    seed_hi = torch.tensor([(s >> 31) & ((1 << 31) - 1) for s in seeds], device=device)
    noise = -torch.log(uniform_noise(seed_lo, seed_hi, torch.tensor(counters, device=device), probs.shape[-1]))
    return (probs / noise).argmax(dim=-1)


def accepted_drafts(sampled: torch.Tensor, input_ids: torch.Tensor, token_offsets: torch.Tensor,
                    table_rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Drafts accepted per request row [num_rows]: the offset of the first token whose draw differs from
    the next input of its row (the last token of a row has none: it stops there). Padded tokens
    (row -1) land in a spare slot that is dropped."""
    pad = torch.full((1,), -1, dtype=torch.int64, device=sampled.device)
    next_ids = torch.cat([input_ids[1:].long(), pad])
    next_offsets = torch.cat([token_offsets[1:].long(), pad])
    offsets = token_offsets.long()
    is_match = (sampled == next_ids) & (next_offsets == offsets + 1)
    first_miss = torch.where(is_match, _NO_MISMATCH, offsets)
    slots = torch.where(table_rows >= 0, table_rows.long(), num_rows)
    counts = torch.full((num_rows + 1,), _NO_MISMATCH, dtype=torch.int64, device=sampled.device)
    return counts.scatter_reduce_(0, slots, first_miss, reduce="amin")[:num_rows]


def top_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int):
    """Raw-distribution logprob of each row's token [N], and its ``num_top`` best (values, ids) [N, num_top]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, token_ids[:, None]).squeeze(-1)
    values, ids = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)
    return chosen, values, ids
