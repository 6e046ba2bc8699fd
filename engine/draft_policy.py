"""How many drafts to verify this step: the length that maximises expected tokens per second.

With per-draft acceptance ``a`` a verify step with ``k`` drafts emits on average
``E(k) = (1 - a**(k+1)) / (1 - a)`` tokens. A step over ``n`` query tokens, ``d`` of
its requests drafting, costs ``t0 + t1 * n + td * d`` (fitted online from the
engine's own step times: ``td`` is what drafting adds besides the tokens, the
proposal and the verify sampling, which on a small model outweighs the tokens).
So per request::

    k* = argmax_k  E(k) / (t0 + t1 * (1 + k) + td * [k > 0])        k in 0 .. max_draft_len

``a`` is the request's own record, smoothed towards the engine's recent
acceptance ``A`` (over all requests' verified drafts, exponentially weighted,
Laplace-smoothed: 0.5 before any), plus an exploration bonus that grows with the steps it has
run and shrinks with the drafts it has had verified (UCB-style)::

    a = (accepted + 8 * A) / (proposed + 8) + EXPLORE * sqrt(ln(1 + steps) / (proposed + 8))

With ``A`` = 0.5 (a fixed Laplace prior, until 0af17c4, 2026-12-03) every new request
started out expecting half its drafts accepted and drafted until its own
rejections said otherwise: on random windserve-tiny text, where a 1-draft step
costs ~10% more than a plain one and 13% of drafts are accepted, 40% of steps
drafted and wall time was 0.90-0.97x of no drafts. A workload's acceptance is
mostly a property of its text and model, so a new request now starts from
what the last ones saw.

Without the bonus two early rejections stop a request drafting for good (its
record never changes again), even where its text turns repetitive later; with
it a request that stopped probes again, ever more rarely while drafts keep failing.

On a CPU a verify pass of a MoE model reads more experts than a 1-token pass
(``t1`` is large): drafts pay only when they are usually accepted, and random
text (low ``a``) drafts little. Outputs never change: greedy verification
emits what sequential decoding would, whatever ``k``.
"""

from __future__ import annotations

import math

# Before the fit has seen two different step sizes: t1 / t0 as measured for a
# 1-token decode step of a small model on one CPU thread (about 0.3).
_PRIOR_TOKEN_COST = 0.3
# A fit whose line has no fixed cost (t0 <= 0) while tokens cost something: steps cost in proportion to
# their tokens, so a verify token costs what a decoded one does and drafts cannot pay. The ratio used then
# (t0 taken as 5% of a token's cost). Seen on Gemma 3 270M at c = 8: an 8-row decode step 98 ms, a 32-row
# verify 444 ms (past the 8 rows of the few-row kernels, through its 262,144-row head); the old fallback to
# the prior (0.3) drafted every step at 97% acceptance and was 12% slower than not drafting.
_PROPORTIONAL_TOKEN_COST = 20.0
_DECAY = 0.97  # weight of older step times in the fit
_MARGIN = 1.03  # a longer draft must promise this much more: the fit is noisy and a wasted verify is not free
EXPLORE = 0.2  # the bonus's weight: gptoss-mid repetitive 1.28-1.39x wall at 0.2-0.4 against 1.04-1.20x at 0
# Weight of the engine's acceptance in a request's estimate, in drafts. 8 against 2 (two runs of 3 reps each,
# wall ratios): gptoss-mid repetitive 1.45x / 1.39x against 1.33x / 1.36x, random 1.40x / 1.35x against
# 1.25x / 1.18x, windserve-tiny random 1.06x / 1.06x against 1.00x / 1.04x, repetitive 1.12x / 1.12x
# against 1.04x / 1.05x.
_PRIOR_DRAFTS = 8
_SHARED_DECAY = 0.99  # per verified draft: the engine's acceptance follows about the last 100 drafts
# While every recent step had about the same number of tokens (each request drafting the same: no slope to
# fit), every PROBE_EVERY-th decode step drafts nothing, so that the fit sees what drafting costs.
PROBE_EVERY = 8


class StepCost:
    """Least squares ``seconds = t0 + t1 * num_tokens + td * num_drafting`` over exponentially
    weighted steps; the line ``t0 + t1 * num_tokens`` (``td`` = 0) until drafting steps vary."""

    def __init__(self) -> None:
        self._w = 0.0
        self._xx = [[0.0] * 3 for _ in range(3)]  # weighted sums of x x^T, x = (1, num_tokens, num_drafting)
        self._xy = [0.0] * 3  # weighted sums of x * seconds
        self._ratios: tuple[float, float] | None = None  # solved once per recorded step, not per request

    def record(self, num_tokens: int, seconds: float, num_drafting: int = 0) -> None:
        d, x = _DECAY, (1.0, float(num_tokens), float(num_drafting))
        self._w = d * self._w + 1
        self._ratios = None
        for i in range(3):
            self._xy[i] = d * self._xy[i] + x[i] * seconds
            for j in range(3):
                self._xx[i][j] = d * self._xx[i][j] + x[i] * x[j]

    def ratios(self) -> tuple[float, float]:
        """``(t1 / t0, td / t0)``: one more query token, and drafting, in units of a step's fixed cost."""
        if self._ratios is None:
            self._ratios = self._fit()
        return self._ratios

    def _fit(self) -> tuple[float, float]:
        fit = _solve(self._xx, self._xy) if self._w >= 6 else None
        if fit is not None and fit[0] > 0 and fit[1] >= 0 and fit[2] >= 0:
            return fit[1] / fit[0], fit[2] / fit[0]
        if fit is not None and fit[0] <= 0 < fit[1]:
            return _PROPORTIONAL_TOKEN_COST, 0.0
        return self.token_cost_ratio(), 0.0

    def has_slope(self) -> bool:
        """Recent steps' token counts vary enough (variance over a quarter token) for the line to be fitted."""
        w, x = self._w, self._xx[0][1]
        return w >= 4 and w * self._xx[1][1] - x * x > 0.25 * w * w

    def token_cost_ratio(self) -> float:
        """``t1 / t0`` of the line alone (drafting ignored)."""
        w, x, y = self._w, self._xx[0][1], self._xy[0]
        spread = w * self._xx[1][1] - x * x
        if w < 4 or spread <= 1e-9 * w * w:
            return _PRIOR_TOKEN_COST
        t1 = (w * self._xy[1] - x * y) / spread
        t0 = (y - t1 * x) / w
        if t0 <= 0 < t1:  # steps cost in proportion to their tokens
            return _PROPORTIONAL_TOKEN_COST
        if t0 <= 0 or t1 < 0:  # noise, not a cost model
            return _PRIOR_TOKEN_COST
        return t1 / t0


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """``a x = b`` for 3 x 3 ``a`` (Cramer's rule); None when ``a`` is (nearly) singular."""
    def det(m: list[list[float]]) -> float:
        return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
                + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))
    d = det(a)
    scale = a[0][0] * a[1][1] * a[2][2]
    if scale <= 0 or abs(d) <= 1e-6 * scale:
        return None
    return [det([[b[r] if c == i else a[r][c] for c in range(3)] for r in range(3)]) / d for i in range(3)]


class DraftLengthPolicy:
    """``shared_prior`` = False gives the policy before the engine-wide prior; with ``explore`` = 0
    and ``fit_drafting`` = False too, the one before the bonus and the drafting term
    (``bench.spec_ab`` measures two of them side by side)."""

    def __init__(self, max_draft_len: int, explore: float = EXPLORE, fit_drafting: bool = True,
                 shared_prior: bool = True, prior_drafts: float = _PRIOR_DRAFTS) -> None:
        self.max_draft_len = max_draft_len
        self.explore = explore
        self.prior_drafts = prior_drafts
        self.fit_drafting = fit_drafting
        self.shared_prior = shared_prior
        self.cost = StepCost()
        self._verified = self._accepted = 0.0  # exponentially weighted counts over all requests
        self._decode_steps = 0
        self.probing = False  # this step drafts nothing (PROBE_EVERY)

    def record_verify(self, num_proposed: int, num_accepted: int) -> None:
        """One verify of ``num_proposed`` drafts, the first ``num_accepted`` of them accepted."""
        decay = _SHARED_DECAY ** num_proposed
        self._verified = decay * self._verified + num_proposed
        self._accepted = decay * self._accepted + num_accepted

    def prior_acceptance(self) -> float:
        """The engine's recent acceptance, Laplace-smoothed: 0.5 before any draft was verified (and
        without ``shared_prior``), a third after one rejected draft."""
        if not self.shared_prior:
            return 0.5
        return (self._accepted + 1) / (self._verified + 2)

    def record_step(self, scheduled: list, seconds: float) -> None:
        """A whole engine step's time (proposals and sampling included), if it only decoded or
        verified (prefill chunks would flatten the fit).

        On a GPU the step ends with the sampler's host sync, so its time is the device's too.
        """
        if all(item.is_decode for item in scheduled):
            num_drafting = sum(bool(item.draft_token_ids) for item in scheduled)
            self.cost.record(sum(item.num_query_tokens for item in scheduled), seconds, num_drafting)
            self._decode_steps += 1
            self.probing = num_drafting > 0 and not self.cost.has_slope() and self._decode_steps % PROBE_EVERY == 0
        else:
            self.probing = False

    def draft_len(self, num_accepted: int, num_proposed: int, num_steps: int = 0) -> int:
        """The best ``k`` for a request that had ``num_accepted`` of ``num_proposed`` drafts
        accepted over ``num_steps`` steps (its outputs so far); 0 in a probing step."""
        if self.probing:
            return 0
        weight = self.prior_drafts
        bonus = self.explore * math.sqrt(math.log(1 + num_steps) / (num_proposed + weight))
        accept = min((num_accepted + weight * self.prior_acceptance()) / (num_proposed + weight) + bonus, 0.98)
        token, drafting = self.cost.ratios() if self.fit_drafting else (self.cost.token_cost_ratio(), 0.0)
        best_k, best_rate = 0, 1 / (1 + token)
        for k in range(1, self.max_draft_len + 1):
            rate = (1 - accept ** (k + 1)) / (1 - accept) / (1 + token * (1 + k) + drafting)
            if rate > best_rate * _MARGIN:
                best_k, best_rate = k, rate
        return best_k
