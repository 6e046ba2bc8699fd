"""The capacity table of this machine for one model and config, for the P:D planner (app.planner_capacity).

    python -m bench.profile [--model windserve-tiny] [--out bench/out/capacity.json] [--quick]
        [--num-pages 1024] [--tokens-per-block 16] [--threads 1]

Measured with the engine directly (engine.LLM, as bench.engine builds it), one torch thread:

- prefill: ``n`` fresh prompts of each length (random ids, so no prefix hit) with
  ``max_tokens = 1``: prompt tokens / wall seconds;
- decode: ``batch`` fresh prompts of each context length, run twice, with ``max_tokens = 1`` and
  ``1 + k``: the per-token time is the difference of the two walls over ``k`` (the prefill cancels).

``kv_capacity_tokens`` is what a generation replica's pool holds (``--num-pages`` x
``--tokens-per-block``; configs/disagg.yaml gives the generation worker 1024 pages of 16). The
default run stays under two minutes on one core of a shared machine; ``--quick`` is for tests.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from app.planner_capacity import CapacityTable
from bench.common import progress, torch_threads
from bench.engine_models import make_llm
from engine import SamplingParams
from engine.model_registry import resolve_model_path

MODES = {
    "default": dict(prefill_lens=(64, 256, 1024), prefill_prompts=4, batches=(1, 4, 16), contexts=(64, 512),
                    decode_steps=8),
    "quick": dict(prefill_lens=(16, 64), prefill_prompts=2, batches=(1, 2), contexts=(16, 32), decode_steps=2),
}


class Prompts:
    """Fresh random prompts: a new seed per call, so no prompt shares a block with an earlier one."""

    def __init__(self) -> None:
        self.seed = 0

    def make(self, num: int, length: int) -> list[list[int]]:
        self.seed += 1
        rng = random.Random(self.seed)
        return [[rng.randrange(256) for _ in range(length)] for _ in range(num)]


def wall(llm, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return time.perf_counter() - start


def profile_prefill(llm, prompts: Prompts, mode: dict) -> tuple[tuple[float, ...], tuple[float, ...]]:
    lens, rates = [], []
    for length in mode["prefill_lens"]:
        batch = prompts.make(mode["prefill_prompts"], length)
        seconds = wall(llm, batch, 1)
        lens.append(float(length))
        rates.append(len(batch) * length / seconds)
        progress(f"prefill {length:5d} tokens: {rates[-1]:8.0f} tok/s")
    return tuple(lens), tuple(rates)


def profile_decode(llm, prompts: Prompts, mode: dict) -> tuple[tuple[float, ...], ...]:
    steps, rows = mode["decode_steps"], []
    for context in mode["contexts"]:
        row = []
        for batch in mode["batches"]:
            only_prefill = wall(llm, prompts.make(batch, context), 1)
            with_decode = wall(llm, prompts.make(batch, context), 1 + steps)
            row.append(max(with_decode - only_prefill, 1e-6) / steps)
            progress(f"decode context {context:5d} batch {batch:3d}: {row[-1] * 1e3:7.2f} ms/token")
        rows.append(tuple(row))
    return tuple(rows)


def profile(model: str, mode: dict, num_pages: int, tokens_per_block: int) -> CapacityTable:
    path = resolve_model_path(model)
    longest = max(*mode["prefill_lens"], *mode["contexts"])
    batch = max(mode["prefill_prompts"], *mode["batches"])
    llm = make_llm(path, batch, longest, mode["decode_steps"] + 2)
    prompts = Prompts()
    wall(llm, prompts.make(2, 16), 2)  # warm-up, not timed
    lens, rates = profile_prefill(llm, prompts, mode)
    rows = profile_decode(llm, prompts, mode)
    return CapacityTable(lens, rates, tuple(mode["batches"]), tuple(map(float, mode["contexts"])), rows,
                         kv_capacity_tokens=num_pages * tokens_per_block,
                         source=f"bench.profile {model} {time.strftime('%Y-%m-%d')}")


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="windserve-tiny")
    parser.add_argument("--out", default="bench/out/capacity.json")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--num-pages", type=int, default=1024)
    parser.add_argument("--tokens-per-block", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    with torch_threads(args.threads):
        table = profile(args.model, MODES["quick" if args.quick else "default"], args.num_pages,
                        args.tokens_per_block)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table.to_json(), indent=1))
    progress(f"wrote {out}")
    return str(out)


if __name__ == "__main__":
    main()
