"""Token sampling and speculative verification, from logits to token ids.

Two distributions matter per row of logits:

- the *raw* distribution, ``log_softmax(logits)``: what logprobs report
  (as vLLM does), whatever the sampling parameters;
- the *sampling* distribution ``p`` (see ``sampling_probs``) of the
  processed logits (penalties, logit bias, min_tokens: engine.penalties, when
  a row's params ask for any): temperature, then top-k, then top-p; one-hot at
  the argmax for greedy rows. Sampling and verification draw from ``p``.

Randomness comes only from the per-request ``torch.Generator`` passed in, so
a seeded request's tokens do not depend on what it is batched with. On an
engine whose decode steps sample on the device (engine.gpu.sampling's
counter-based noise), ``Sampler(counter_draws=True)`` draws its rows from that
same noise, keyed by (seed, output index): a request's tokens then do not
depend on whether a step was a pure decode step (device) or mixed with another
request's prefill (here); ``Sampler.verify`` does the same with a ``key``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from engine.gpu.sampling import counter_draws, penalize
from engine.grammar import TokenMasks
from engine.native import argmax_rows_kernel
from engine.outputs import TokenLogprob
from engine.params import SamplingParams
from engine.penalties import TokenHistory, any_processors, penalty_rows


class SampleResult(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class VerifyResult(NamedTuple):
    """Accepted drafts followed by one more token (correction or bonus)."""

    token_ids: list[int]
    num_accepted: int
    logprobs: list[TokenLogprob | None]


def greedy_token_ids(logits: torch.Tensor) -> list[int]:
    """``logits.argmax(dim=-1).tolist()``: the native kernel for contiguous float32 CPU rows (argmax.cpp, the
    same ids: ties to the lowest, a NaN first; ~10x faster over a 49k vocabulary), torch's argmax otherwise."""
    kernel = argmax_rows_kernel() if logits.device.type == "cpu" else None
    if kernel is not None and logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[1] > 0:
        return kernel(logits.contiguous()).tolist()
    return logits.argmax(dim=-1).tolist()


def processed_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                     histories: Sequence[TokenHistory] | None, masks: TokenMasks | None = None) -> torch.Tensor:
    """``logits`` after each row's processors (engine.penalties), then its grammar mask (engine.grammar:
    disallowed tokens -inf); ``logits`` itself (never modified) where no row has either."""
    scores = logits
    if any_processors(params):
        if histories is None:  # a processor silently skipped would be an answer the caller did not ask for
            raise ValueError("penalties, logit_bias or min_tokens need each row's token history")
        scores = penalize(logits, penalty_rows(params, histories, logits.shape[-1], logits.device))
    if masks is not None:
        scores = masks.apply(_copied(logits) if scores is logits else scores)
    return scores


def _copied(logits: torch.Tensor) -> torch.Tensor:
    """A float32 copy to mask. On the CPU a plain memcpy (numpy's): torch's copy of a row this wide runs
    on its OpenMP pool, whose threads then spin beside the next forward's native kernels (a step at c = 1
    on 2 cores took 24 ms instead of 14 with a grammar; with this copy 14)."""
    if logits.device.type != "cpu":
        return logits.to(torch.float32, copy=True).contiguous()
    return torch.from_numpy(logits.float().numpy().copy())


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: ``[n, V]`` float32, rows sum to 1.

    Order: divide by temperature, keep the ``top_k`` largest, then keep the
    smallest prefix (by descending probability) whose mass reaches ``top_p``;
    the top token is always kept. Ties rank the lower token id first. Greedy
    rows are one-hot at the argmax (ties -> lowest id). Does not modify
    ``logits``.
    """
    if len(params) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits but {len(params)} params")
    device = logits.device
    temps = torch.tensor([1.0 if p.is_greedy else p.temperature for p in params], device=device)
    scaled = logits.float() / temps[:, None]
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        probs = _filtered_probs(scaled, params)
    else:
        probs = scaled.softmax(dim=-1)
    greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
    if greedy_rows:
        rows = torch.tensor(greedy_rows, device=device)
        probs[rows] = 0.0
        probs[rows, logits[rows].argmax(dim=-1)] = 1.0
    return probs


def _filtered_probs(scaled: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Softmax of ``scaled`` after each row's top-k then top-p cut (sorted once)."""
    vocab_size, device = scaled.shape[-1], scaled.device
    top_ks = torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params], device=device)
    top_ps = torch.tensor([p.top_p for p in params], device=device)
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab_size, device=device)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_ks[:, None], float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p; never
    # the top token (a top_p below float32's range rounds to 0). The top_p < 1
    # guard keeps cumsum rounding from cutting the tail of unfiltered rows.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = (mass_before >= top_ps[:, None]) & (top_ps[:, None] < 1.0) & (ranks > 0)
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    return torch.zeros_like(scaled).scatter_(-1, sorted_ids, sorted_probs)


def match_sample(
    probs: torch.Tensor | None, draft_token_ids: Sequence[int], generator: torch.Generator | None,
    reseed: Callable[[int], None] | None = None, draw: Callable[[int], int] | None = None,
) -> list[int]:
    """Speculative verification for a deterministic drafter: draw, then compare.

    ``probs`` is ``[k+1, V]``, the target distribution ``p_i`` per row. Row
    ``i``'s token is a draw from ``p_i`` (``reseed(i)`` first: the generator
    seeded for that output position); draft ``d_i`` is accepted iff the draw
    equals it, and the first draw that differs (or row ``k``'s, the bonus) is
    emitted::

        row     0     1     2 (= k)
        draw    t0    t1    t2
        drafts  d0    d1
        t0 == d0, t1 != d1  ->  emit d0, t1

    Each emitted token is then distributed as ``p`` says, ``d_i`` is accepted
    with probability ``p_i(d_i)`` (as rejection sampling with a one-hot draft
    would), and, seeded by position, the tokens are the ones sequential
    sampling draws: the same whatever the draft length, so a seeded request's
    output does not depend on speculation. With ``draw`` (row i's token drawn
    already, by the counter-based noise) ``probs`` is not read and may be None.
    """
    for i in range(len(draft_token_ids) + 1):
        if draw is not None:  # row i's token drawn already (counter-based): compare only
            token_id = draw(i)
        else:
            if reseed is not None:
                reseed(i)
            token_id = _draw(probs[i], generator)
        if i == len(draft_token_ids) or token_id != draft_token_ids[i]:
            return list(draft_token_ids[:i]) + [token_id]
    raise AssertionError("unreachable: the last row always emits")


def _counter_draws(scores: torch.Tensor, params: Sequence[SamplingParams], keys: Sequence[tuple[int, int]]):
    """engine.gpu.sampling's counter-based draws of ``scores`` (processed logits), row i keyed by keys[i]
    = (seed, output index): the device's own sampling, so these rows draw what a decode step would."""
    return counter_draws(scores, [0.0 if p.is_greedy else p.temperature for p in params], [p.top_k for p in params],
                         [p.top_p for p in params], [k[0] for k in keys], [k[1] for k in keys])


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, num_samples=1, generator=generator))


def _token_logprobs(
    logits: torch.Tensor, token_ids: list[int], num_tops: Sequence[int | None]
) -> list[TokenLogprob | None]:
    """Raw-distribution logprob of ``token_ids[i]`` under row ``i`` plus its top alternatives."""
    rows = [i for i, num_top in enumerate(num_tops) if num_top is not None]
    results: list[TokenLogprob | None] = [None] * len(token_ids)
    if not rows:
        return results
    device = logits.device
    logprobs = torch.log_softmax(logits[torch.tensor(rows, device=device)].float(), dim=-1)
    chosen_ids = torch.tensor([token_ids[i] for i in rows], device=device)
    chosen = logprobs.gather(-1, chosen_ids[:, None]).squeeze(-1).tolist()
    max_top = min(max(num_tops[i] for i in rows), logprobs.shape[-1])
    top_vals, top_ids = (t.tolist() for t in logprobs.topk(max_top, dim=-1))
    for j, i in enumerate(rows):
        top = tuple(zip(top_ids[j], top_vals[j]))[: num_tops[i]]
        results[i] = TokenLogprob(token_ids[i], chosen[j], top)
    return results


class Sampler:
    """Turns logits into tokens: batched sampling and speculative verification.

    Stateless: all randomness comes from the generators passed to each call, or with ``counter_draws``
    from the (seed, output index) keys passed to ``sample``.
    """

    def __init__(self, counter_draws: bool = False) -> None:
        self.counter_draws = counter_draws

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        keys: Sequence[tuple[int, int]] | None = None,
        histories: Sequence[TokenHistory] | None = None,
        masks: TokenMasks | None = None,
    ) -> SampleResult:
        """Pick one token per row of ``logits`` ``[n, V]``.

        Row ``i`` uses ``params[i]`` and draws only from ``generators[i]``
        (``None``: torch's global generator), so a seeded request gets the
        same tokens alone or in any batch. Greedy rows draw nothing.
        Logprobs (where ``params[i].logprobs`` is set) are of the raw logits.
        ``histories[i]``: row i's tokens, for the logits processors (None: no row has any).
        ``masks``: the grammar rows' allowed tokens (None: no row has a grammar).
        """
        if not len(params) == len(generators) == logits.shape[0]:
            raise ValueError(
                f"{logits.shape[0]} rows, {len(params)} params, {len(generators)} generators"
            )
        scores = processed_logits(logits, params, histories, masks)
        if all(p.is_greedy and p.logprobs is None for p in params):  # the common case: no probabilities needed
            return SampleResult(greedy_token_ids(scores), [None] * len(params))
        if self.counter_draws and keys is not None:  # keys[i]: (seed, output index) of row i
            token_ids = _counter_draws(scores, params, keys).tolist()
        else:
            probs = sampling_probs(scores, params)
            greedy_ids = probs.argmax(dim=-1).tolist()
            token_ids = [
                greedy_ids[i] if p.is_greedy else _draw(probs[i], generators[i])
                for i, p in enumerate(params)
            ]
        logprobs = _token_logprobs(logits, token_ids, [p.logprobs for p in params])
        return SampleResult(token_ids, logprobs)

    def verify(
        self,
        logits: torch.Tensor,
        draft_token_ids: Sequence[int],
        params: SamplingParams,
        generator: torch.Generator | None,
        reseed: Callable[[int], None] | None = None,
        key: tuple[int, int] | None = None,
        histories: Sequence[TokenHistory] | None = None,
        masks: TokenMasks | None = None,
    ) -> VerifyResult:
        """Check ``k`` drafts of one request against the target model's ``[k+1, V]`` logits.

        Row ``i`` is the model's distribution for the token after draft
        ``i-1`` (row 0: after the last committed token)::

            row:    0      1      ...   k-1        k
            scores: d_0    d_1    ...   d_{k-1}    (bonus)

        Greedy: accept ``d_i`` while it is the argmax of row ``i``, then emit
        the argmax of the first mismatching row (row ``k`` if all match), so
        the output equals sequential greedy decoding.

        Sampling: ``match_sample`` on ``sampling_probs`` of every row (``reseed(i)``
        seeds the generator for row ``i``'s output position), so every emitted token
        is the one sampling without speculation draws. With ``counter_draws`` and
        ``key`` (seed, row 0's output index) row ``i`` draws the counter-based token of
        output index ``key[1] + i`` instead, as the device's verification does.
        ``histories[i]``: row i's tokens, drafts before it included (engine.penalties.verify_histories).
        ``masks``: a grammar request's row masks, row i's after drafts[:i] (engine.grammar.verify_masks).
        """
        num_drafts = len(draft_token_ids)
        if logits.shape[0] != num_drafts + 1:
            raise ValueError(
                f"{num_drafts} drafts need {num_drafts + 1} rows of logits, got {logits.shape[0]}"
            )
        scores = processed_logits(logits, [params] * (num_drafts + 1), histories, masks)
        if params.is_greedy:
            token_ids = self._verify_greedy(scores, draft_token_ids)
        elif self.counter_draws and key is not None:
            keys = [(key[0], key[1] + i) for i in range(num_drafts + 1)]
            drawn = _counter_draws(scores, [params] * (num_drafts + 1), keys).tolist()
            token_ids = match_sample(None, draft_token_ids, None, draw=lambda i: drawn[i])
        else:
            probs = sampling_probs(scores, [params] * (num_drafts + 1))
            token_ids = match_sample(probs, draft_token_ids, generator, reseed)
        num_tops = [params.logprobs] * len(token_ids)
        logprobs = _token_logprobs(logits[: len(token_ids)], token_ids, num_tops)
        return VerifyResult(token_ids, len(token_ids) - 1, logprobs)

    @staticmethod
    def _verify_greedy(logits: torch.Tensor, draft_token_ids: Sequence[int]) -> list[int]:
        targets = greedy_token_ids(logits)
        num_accepted = 0
        for draft, target in zip(draft_token_ids, targets):
            if draft != target:
                break
            num_accepted += 1
        return targets[: num_accepted + 1]
