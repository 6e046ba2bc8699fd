"""How many drafts to verify this step: the length that maximises expected tokens per second.

With per-draft acceptance ``a`` (the request's own record, Laplace-smoothed) a
verify step with ``k`` drafts emits on average ``E(k) = (1 - a**(k+1)) / (1 - a)``
tokens, and a forward pass over ``n`` query tokens costs ``t0 + t1 * n``
(fitted online from the runner's own step times), so per request::

    k* = argmax_k  E(k) / (t0 + t1 * (1 + k))            k in 0 .. max_draft_len

On a CPU a verify pass of a MoE model reads more experts than a 1-token pass
(``t1`` is large): drafts pay only when they are usually accepted, and random
text (low ``a``) drafts nothing. Outputs never change: greedy verification
emits what sequential decoding would, whatever ``k``.
"""

from __future__ import annotations

# Before the fit has seen two different step sizes: t1 / t0 as measured for a
# 1-token decode step of a small model on one CPU thread (about 0.3).
_PRIOR_TOKEN_COST = 0.3
_DECAY = 0.97  # weight of older step times in the fit
_MARGIN = 1.03  # a longer draft must promise this much more: the fit is noisy and a wasted verify is not free


class StepCost:
    """Least-squares line ``seconds = t0 + t1 * num_tokens`` over exponentially weighted steps."""

    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def record(self, num_tokens: int, seconds: float) -> None:
        d = _DECAY
        self._w = d * self._w + 1
        self._x = d * self._x + num_tokens
        self._y = d * self._y + seconds
        self._xx = d * self._xx + num_tokens * num_tokens
        self._xy = d * self._xy + num_tokens * seconds

    def token_cost_ratio(self) -> float:
        """``t1 / t0``: what one more query token costs, in units of a step's fixed cost."""
        w, x, y = self._w, self._x, self._y
        spread = w * self._xx - x * x
        if w < 4 or spread <= 1e-9 * w * w:
            return _PRIOR_TOKEN_COST
        t1 = (w * self._xy - x * y) / spread
        t0 = (y - t1 * x) / w
        if t0 <= 0 or t1 < 0:  # noise, not a cost model
            return _PRIOR_TOKEN_COST
        return t1 / t0


class DraftLengthPolicy:
    def __init__(self, max_draft_len: int) -> None:
        self.max_draft_len = max_draft_len
        self.cost = StepCost()

    def record_step(self, scheduled: list, seconds: float) -> None:
        """A whole engine step's time, if it only decoded or verified (prefill chunks would flatten the fit).

        On a GPU the step ends with the sampler's host sync, so its time is the device's too.
        """
        if all(item.num_new_tokens == 1 for item in scheduled):
            self.cost.record(sum(item.num_query_tokens for item in scheduled), seconds)

    def draft_len(self, num_accepted: int, num_proposed: int) -> int:
        """The best ``k`` for a request that had ``num_accepted`` of ``num_proposed`` drafts accepted."""
        accept = min((num_accepted + 1) / (num_proposed + 2), 0.98)
        ratio = self.cost.token_cost_ratio()
        best_k, best_rate = 0, 1 / (1 + ratio)
        for k in range(1, self.max_draft_len + 1):
            rate = (1 - accept ** (k + 1)) / (1 - accept) / (1 + ratio * (1 + k))
            if rate > best_rate * _MARGIN:
                best_k, best_rate = k, rate
        return best_k
