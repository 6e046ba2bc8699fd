"""Sampling on the device: penalties and logit bias, greedy, temperature, top-k, top-p, and verification
of drafts, with no host sync.

Draws use counter-based noise, a hash of (seed, output index, token id), instead of a generator per
request: the same seeded request draws the same token wherever it sits in a batch, whatever the
padding, and the ops have fixed shapes (a CUDA graph could capture them). A draw is the Gumbel-max
trick (equivalent to sampling from ``softmax(logits / T)`` over the kept tokens)::

    token = argmax_v  logits[v] / T + g[v]     over the kept v (all, or top-k/top-p's cut)
    g[v]  = -log(-log(u[v]))                   u: uniform_noise, 24 bits of hash, in (0, 1]

The arithmetic is one computation everywhere (this module's torch ops, engine.gpu.triton_sampling's
one-pass kernel, the host's ``counter_draws``): IEEE float32 ``+ - * /`` each rounded once and bit
fields, with ``log_f32`` (not torch.log, numpy's or CUDA's log, which may differ in the last bit)
for the logs, so every path draws the same token, bit for bit, not just in distribution.

Greedy rows (temperature 0) take the argmax (ties: the lowest id). Verification is engine.sampler's
``match_sample`` on every row at once: token t's draw is compared with the draft that follows it in
its request::

    token      t0   t1   t2 | t3          offsets  0 1 2 | 0
    input      x    d0   d1 | y           draws    d0 e1 f2 | g3
    match      d0==d0  e1!=d1  (last of row) -> row 0 accepts 1 draft, emits d0, e1
"""

from __future__ import annotations

import functools
import importlib.util
from typing import NamedTuple

import torch

_MASK32 = (1 << 32) - 1
_MULTIPLIERS = (0x7FEB352D, 0x46CA68B5)  # under 2**31: a 32-bit value times one fits in int64
_GOLDEN = 0x9E3779B9  # added to a token id before its hash
_NO_MISMATCH = 1 << 30
# float32 values written out exactly, so torch, numpy and Triton all read the same constant
LN2 = float.fromhex("0x1.62e43p-1")
SQRT2 = float.fromhex("0x1.6a09e6p+0")
ATANH_SERIES = (float.fromhex("0x1.555556p-2"), float.fromhex("0x1.99999ap-3"),  # 1/3, 1/5
                float.fromhex("0x1.24924ap-3"), float.fromhex("0x1.c71c72p-4"))  # 1/7, 1/9
ONE_BELOW = float.fromhex("0x1.fffffep-1")  # the largest float32 under 1


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (xorshift-multiply rounds) of int64 values, result in [0, 2**32)."""
    x = x & _MASK32
    for multiplier in _MULTIPLIERS:
        x = x ^ (x >> 16)
        x = (x * multiplier) & _MASK32
    return x ^ (x >> 15)


def uniform_noise(seed_lo: torch.Tensor, seed_hi: torch.Tensor, counters: torch.Tensor, vocab_size: int):
    """u [N, V] in (0, 1]: row n's from (seed, counter) of row n only, column v's from token id v. 24 bits
    plus a half, rounded to float32: above 2**23 the half rounds to even, so 1.0 itself occurs (2**-24)."""
    row = _mix(seed_lo.long() ^ _mix(seed_hi.long() ^ _mix(counters.long())))
    columns = torch.arange(vocab_size, device=row.device, dtype=torch.int64)
    bits = _mix(row[:, None] ^ _mix(columns + _GOLDEN)[None, :]) >> 8
    return (bits.float() + 0.5) * (1.0 / (1 << 24))


def log_f32(x: torch.Tensor) -> torch.Tensor:
    """log(x) for positive normal float32 x from bit fields and ``+ - * /`` only (each one IEEE-rounded,
    never fused), so engine.gpu.triton_sampling's copy gives the same bits::

        x = m * 2**e, m in [sqrt(1/2), sqrt(2))     log x = e ln2 + 2 atanh(s),  s = (m - 1) / (m + 1)
        2 atanh(s) = 2s (1 + z/3 + z^2/5 + z^3/7 + z^4/9),  z = s^2 <= 0.0295: the next term is < 3e-9
    """
    bits = x.view(torch.int32)
    exponent = (bits >> 23) - 127
    mantissa = ((bits & 0x7FFFFF) | 0x3F800000).view(torch.float32)  # [1, 2)
    is_high = mantissa > SQRT2
    mantissa = torch.where(is_high, mantissa * 0.5, mantissa)
    exponent = exponent + is_high.int()
    s = (mantissa - 1.0) / (mantissa + 1.0)
    z = s * s
    c3, c5, c7, c9 = ATANH_SERIES
    series = ((z * c9 + c7) * z + c5) * z + c3
    series = series * z
    two_s = s + s
    return exponent.float() * LN2 + (two_s + two_s * series)


def gumbel_noise(seed_lo: torch.Tensor, seed_hi: torch.Tensor, counters: torch.Tensor, vocab_size: int):
    """g [N, V] = -log(-log(u)), u from ``uniform_noise``; a u of 1.0 is taken as the float32 below 1 (its
    g, about 16.6, stands for the top 2**-24 of the range, as a continuous u there would)."""
    u = uniform_noise(seed_lo, seed_hi, counters, vocab_size).clamp_max(ONE_BELOW)
    return -log_f32(-log_f32(u))


def top_cut(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """engine.sampler's top-k then top-p cut with per-row tensors (``top_k`` 0 = all), as the last kept
    (value, id) of each row sorted by value, descending, ties by id: token v is kept when
    ``(scaled[v], -v) >= (value, -id)``. The kept tokens are the longest prefix of the sorted row that
    passes the cut (a prefix, so one pair names it; it differs from a token-by-token cut only where a
    parallel cumsum's rounding is not monotone), the top token always."""
    vocab_size = scaled.shape[-1]
    top_k = torch.where(top_k > 0, top_k, vocab_size).long()
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab_size, device=scaled.device)
    in_top_k = ranks < top_k[:, None]
    sorted_probs = sorted_logits.masked_fill(~in_top_k, float("-inf")).softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    top_p = top_p[:, None]
    drop = (mass_before >= top_p) & (top_p < 1.0) & (ranks > 0)
    last = (in_top_k & ~drop).int().cumprod(dim=-1).sum(dim=-1, keepdim=True) - 1
    return sorted_logits.gather(-1, last).squeeze(-1), sorted_ids.gather(-1, last).squeeze(-1)


def is_kept(scaled: torch.Tensor, cut: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """[N, V]: token v of row n passes row n's ``top_cut``."""
    value, last_id = (part[:, None] for part in cut)
    ids = torch.arange(scaled.shape[-1], device=scaled.device)
    return (scaled > value) | ((scaled == value) & (ids <= last_id))


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


def sample_tokens(logits: torch.Tensor, rows: SamplingRows, *, is_greedy: bool, is_filtered: bool,
                  use_kernel: bool | None = None) -> torch.Tensor:
    """Token ids [N] (int64) for logits [N, V]. ``is_greedy`` / ``is_filtered``: what the host knows
    of the step (every row greedy: argmax only; any top-k/top-p: the sort for ``top_cut``), so no value
    is read back. ``use_kernel``: engine.gpu.triton_sampling's one pass (None: where the logits are on
    CUDA and Triton compiles; True on CPU tensors: Triton's interpreter, which tests ask for), else the
    torch ops below; both give the same ids."""
    if is_greedy:
        return logits.argmax(dim=-1)
    is_sampled = rows.temperature > 0
    cut = None
    if is_filtered:  # the sort stays in torch; the kernel takes its (value, id) pair per row
        cut = top_cut(logits.float() / torch.where(is_sampled, rows.temperature, 1.0)[:, None], rows.top_k,
                      rows.top_p)
    if use_kernel if use_kernel is not None else _compiles_here(logits):
        from engine.gpu.triton_sampling import triton_sample_tokens

        return triton_sample_tokens(logits, rows, cut)
    return _torch_sample_tokens(logits, rows, cut)


def _torch_sample_tokens(logits: torch.Tensor, rows: SamplingRows, cut) -> torch.Tensor:
    is_sampled = rows.temperature > 0
    scaled = logits.float() / torch.where(is_sampled, rows.temperature, 1.0)[:, None]
    scores = scaled + gumbel_noise(rows.seed_lo, rows.seed_hi, rows.counters, logits.shape[-1])
    if cut is not None:
        scores = scores.masked_fill(~is_kept(scaled, cut), float("-inf"))
    return torch.where(is_sampled, scores.argmax(dim=-1), logits.argmax(dim=-1))


def _compiles_here(logits: torch.Tensor) -> bool:
    """CUDA logits and a Triton that compiles (imported here only then: a CPU process's first import of
    Triton would fix its mode, engine.gpu.triton_build)."""
    if not logits.is_cuda or not _triton_importable():
        return False
    from engine.gpu.triton_build import is_interpreted

    return not is_interpreted()


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def sampling_rows(temperatures: list[float], top_ks: list[int], top_ps: list[float], seeds: list[int],
                  counters: list[int], device: torch.device) -> SamplingRows:
    """SamplingRows from per-row values (temperature 0 = greedy), the seed reduced to two 31-bit halves
    (its low 62 bits) as engine.gpu.step_buffers stages it."""
    half = (1 << 31) - 1
    return SamplingRows(torch.tensor(temperatures, dtype=torch.float32, device=device),
                        torch.tensor(top_ks, dtype=torch.int32, device=device),
                        torch.tensor(top_ps, dtype=torch.float32, device=device),
                        torch.tensor([s & half for s in seeds], dtype=torch.int32, device=device),
                        torch.tensor([(s >> 31) & half for s in seeds], dtype=torch.int32, device=device),
                        torch.tensor(counters, dtype=torch.int32, device=device))


def counter_draws(scores: torch.Tensor, temperatures: list[float], top_ks: list[int], top_ps: list[float],
                  seeds: list[int], counters: list[int]) -> torch.Tensor:
    """The draws ``sample_tokens`` makes, for the host path's mixed steps on an engine whose decode steps
    sample here: ``scores`` are the processed logits [N, V]; row n has its request's sampling values
    (temperature 0 = greedy) and is keyed by its seed and output index, so a request draws the same
    token whichever path its step took. It is ``sample_tokens`` itself (same ops, the same kernel on
    CUDA), not a copy."""
    rows = sampling_rows(temperatures, top_ks, top_ps, seeds, counters, scores.device)
    is_sampled = [t > 0 for t in temperatures]
    is_filtered = any(s and (k > 0 or p < 1.0) for s, k, p in zip(is_sampled, top_ks, top_ps))
    return sample_tokens(scores, rows, is_greedy=not any(is_sampled), is_filtered=is_filtered)


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
