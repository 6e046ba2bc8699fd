"""The capacity table: what one replica of each role sustains, profiled on the machine (bench.profile).

    prefill rows   prompt_len -> tokens_per_s        one context replica, prompts back to back
    decode rows    (batch, context_len) -> per_token_s   one generation replica, ``batch`` streams
    kv_capacity_tokens                                   KV tokens a generation replica holds

Lookups interpolate linearly between rows and clamp outside them (a prompt longer
than any profiled is priced as the longest: the planner then under-provisions
rather than invents a slope). The JSON is the one bench.profile writes::

    {"prefill": [{"prompt_len": 128, "tokens_per_s": 900.0}, ...],
     "decode": [{"batch": 1, "context_len": 256, "per_token_s": 0.02}, ...],
     "kv_capacity_tokens": 16384, "source": "..."}
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path


def interpolate(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise-linear y(x) through sorted ``xs``, clamped at both ends."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class CapacityTable:
    prefill_lens: tuple[float, ...]
    prefill_tokens_per_s: tuple[float, ...]
    decode_batches: tuple[int, ...]  # the batch axis, shared by every context row
    decode_contexts: tuple[float, ...]
    decode_per_token_s: tuple[tuple[float, ...], ...]  # [context row][batch column]
    kv_capacity_tokens: int
    source: str = "synthetic"

    def __post_init__(self) -> None:
        if not self.prefill_lens or len(self.prefill_lens) != len(self.prefill_tokens_per_s):
            raise ValueError("prefill rows need a prompt length and a rate each")
        if list(self.prefill_lens) != sorted(set(self.prefill_lens)) or min(self.prefill_tokens_per_s) <= 0:
            raise ValueError("prefill prompt lengths must increase and rates be positive")
        if list(self.decode_batches) != sorted(set(self.decode_batches)) or self.decode_batches[0] < 1:
            raise ValueError("decode batches must increase from at least 1")
        if list(self.decode_contexts) != sorted(set(self.decode_contexts)) or not self.decode_contexts:
            raise ValueError("decode context lengths must increase")
        if len(self.decode_per_token_s) != len(self.decode_contexts):
            raise ValueError("one decode row per context length")
        if any(len(row) != len(self.decode_batches) or min(row) <= 0 for row in self.decode_per_token_s):
            raise ValueError("each decode row has a positive time per batch")
        if self.kv_capacity_tokens < 1:
            raise ValueError("kv_capacity_tokens must be positive")

    @property
    def max_batch(self) -> int:
        return self.decode_batches[-1]

    def prefill_rate(self, prompt_len: float) -> float:
        """Prompt tokens/s one context replica computes at this (uncached) prompt length."""
        return interpolate(self.prefill_lens, self.prefill_tokens_per_s, prompt_len)

    def prefill_time(self, prompt_len: float) -> float:
        return max(prompt_len, 1.0) / self.prefill_rate(prompt_len)

    def per_token_time(self, batch: float, context_len: float) -> float:
        """Seconds per decode step of ``batch`` streams whose KV averages ``context_len`` tokens."""
        batches = tuple(map(float, self.decode_batches))
        by_context = [interpolate(batches, row, batch) for row in self.decode_per_token_s]
        return interpolate(self.decode_contexts, tuple(by_context), context_len)

    def decode_batch_within(self, tpot_s: float, context_len: float) -> int:
        """The largest batch whose step time meets ``tpot_s`` and whose KV fits (at least 1)."""
        kv_bound = max(1, int(self.kv_capacity_tokens // max(context_len, 1.0)))
        best = 1
        for batch in range(1, min(self.max_batch, kv_bound) + 1):
            if self.per_token_time(batch, context_len) <= tpot_s:
                best = batch
        return best

    def decode_rate(self, tpot_s: float, context_len: float) -> float:
        """Output tokens/s one generation replica sustains within ``tpot_s`` at this context length."""
        batch = self.decode_batch_within(tpot_s, context_len)
        return batch / self.per_token_time(batch, context_len)

    def to_json(self) -> dict:
        return {
            "prefill": [{"prompt_len": n, "tokens_per_s": r} for n, r in zip(self.prefill_lens,
                                                                               self.prefill_tokens_per_s)],
            "decode": [{"batch": b, "context_len": c, "per_token_s": t}
                       for c, row in zip(self.decode_contexts, self.decode_per_token_s)
                       for b, t in zip(self.decode_batches, row)],
            "kv_capacity_tokens": self.kv_capacity_tokens, "source": self.source,
        }

    @classmethod
    def from_json(cls, data: dict) -> CapacityTable:
        prefill = sorted(data["prefill"], key=lambda r: r["prompt_len"])
        decode = data["decode"]
        batches = sorted({int(r["batch"]) for r in decode})
        contexts = sorted({float(r["context_len"]) for r in decode})
        times = {(int(r["batch"]), float(r["context_len"])): float(r["per_token_s"]) for r in decode}
        return cls(
            prefill_lens=tuple(float(r["prompt_len"]) for r in prefill),
            prefill_tokens_per_s=tuple(float(r["tokens_per_s"]) for r in prefill),
            decode_batches=tuple(batches), decode_contexts=tuple(contexts),
            decode_per_token_s=tuple(tuple(times[(b, c)] for b in batches) for c in contexts),
            kv_capacity_tokens=int(data["kv_capacity_tokens"]), source=str(data.get("source", "json")),
        )

    @classmethod
    def load(cls, path: str | Path) -> CapacityTable:
        return cls.from_json(json.loads(Path(path).read_text()))


def synthetic_table() -> CapacityTable:
    """A GPU-like replica, for the simulator and tests when no profile is given: prefill slows with
    prompt length (attention grows with it), a decode step costs a fixed launch time plus a share per
    stream plus the KV it reads (batch x context)."""
    lens = (128.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0)
    rates = tuple(12000.0 / (1.0 + n / 8192.0) for n in lens)
    batches = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128)
    contexts = (256.0, 1024.0, 2048.0, 4096.0, 8192.0)
    rows = tuple(tuple(0.012 + 0.00015 * b + 0.25e-6 * b * c for b in batches) for c in contexts)
    return CapacityTable(lens, rates, batches, contexts, rows, kv_capacity_tokens=200_000, source="synthetic")
