"""The host's share of a static decode step: what overlapped steps (engine.overlap) can hide on a GPU.

    python -m bench.host_step [--concurrency 1 8 64] [--steps 40] [--max-model-len 131072] [--out bench/out]
    python -m bench.host_step --arrivals     # TTFT and ITL under steady arrivals, the real forward

Runs windserve-tiny's decode steps on the static path (use_static_buffers, as on a GPU) on the CPU with
the model's forward replaced by its output for the same padded size, computed once: what is left is
scheduling, staging the buffers, sampling a fixed logits tensor and postprocessing (stop checks, text,
pages), i.e. the Python a GPU step waits for unless step n+1 is launched while step n runs. Prints the
median per concurrency and the split of the largest one (schedule, run, postprocess). A diagnosis: on
a GPU the real comparison is bench/gpu_check.sh's graph_timing (graphs with and without overlap).

``--max-model-len`` sizes the buffers' block tables as a long-context deployment does (131,072 positions:
8,192 ordinals a row at 16 tokens a block) while the live contexts stay a few hundred tokens: the staging
cost that grows with the table's width, not with what the step uses. Past windserve-tiny's 4,096
positions it runs a copy of the model whose config allows them (the weights are the same).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

from bench.engine_models import available_models, make_llm, mixed_prompts
from engine import SamplingParams
from engine.gpu import static_runner


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the positions the buffers are sized for (default: the model's 4,096)")
    parser.add_argument("--arrivals", action="store_true",
                        help="instead: TTFT and ITL with the real forward under steady arrivals (mixed steps)")
    parser.add_argument("--out", default=os.path.join("bench", "out"))
    return parser.parse_args(argv)


def cached_forward(real, is_real: bool = True):
    """``StaticStepRunner._forward`` replaced: the real forward once per padded size, then its output.
    ``is_real`` False: a fixed random logits tensor of that size instead (at 131k positions the CPU's torch
    reference attention gathers every row's whole table, 256 x 131,072 keys, which no host holds)."""
    outputs = {}

    def forward(runner, size: int):
        if size not in outputs:
            vocab = runner.model.config.vocab_size
            outputs[size] = real(runner, size) if is_real else torch.randn(
                size, vocab, generator=torch.Generator().manual_seed(size))
        return outputs[size]
    return forward


def with_positions(path: str, max_model_len: int | None, tmp: str) -> str:
    """``path``, or a copy of it whose config allows ``max_model_len`` positions (same weights)."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    if max_model_len is None or max_model_len <= config["max_position_embeddings"]:
        return path
    target = os.path.join(tmp, f"positions-{max_model_len}")
    shutil.copytree(path, target)
    config["max_position_embeddings"] = max_model_len
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump(config, f)
    return target


def host_step_ms(path: str, concurrency: int, steps: int, max_model_len: int | None = None) -> dict:
    max_tokens = 2 * steps + 8 + concurrency  # the first prompts decode while the last ones prefill
    kwargs = {} if max_model_len is None else {"max_model_len": max_model_len}
    llm = make_llm(path, concurrency, 256, max_tokens + 8, use_static_buffers=True, async_scheduling=False, **kwargs)
    if max_model_len is not None and llm.engine.max_model_len < max_model_len:
        raise RuntimeError(f"{llm.engine.max_model_len} positions fit the pages, not {max_model_len}")
    engine = llm.engine
    for i, prompt in enumerate(mixed_prompts(concurrency, (16, 256), seed=3)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    started: set[str] = set()
    while len(started) < concurrency:
        started.update(u.request_id for u in engine.step() if u.new_token_ids)
    for _ in range(3):
        engine.step()  # warm-up: the real forward runs once for this padded size
    split = {"schedule": 0.0, "run": 0.0, "postprocess": 0.0}
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        scheduled = engine.scheduler.schedule()
        scheduled_at = time.perf_counter()
        output = engine.runner.run(scheduled)
        run_at = time.perf_counter()
        updates = engine._postprocess(scheduled, output)  # what LLMEngine.step does, timed in parts
        end = time.perf_counter()
        if len(updates) != concurrency:
            raise RuntimeError(f"a decode step served {len(updates)} of {concurrency} requests")
        times.append(end - start)
        for name, seconds in zip(split, (scheduled_at - start, run_at - scheduled_at, end - run_at)):
            split[name] += seconds / steps
    return {"concurrency": concurrency, "max_model_len": engine.max_model_len,
            "host_step_ms": statistics.median(times) * 1e3,
            **{f"{name}_ms": seconds * 1e3 for name, seconds in split.items()}}


def arrivals_ms(path: str, num_requests: int = 24, every: int = 3, max_tokens: int = 32) -> dict:
    """TTFT and ITL (medians, ms) on the CPU's static path with the real forward: a prompt (16..256 tokens)
    arrives every ``every`` steps, so most steps mix a prefill chunk with decodes (engine.runner's split)."""
    llm = make_llm(path, 8, 256, max_tokens + 8, use_static_buffers=True, async_scheduling=False,
                   max_num_batched_tokens=128)
    engine, params = llm.engine, SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    prompts = mixed_prompts(num_requests, (16, 256), seed=5)
    added, first, last, gaps = {}, {}, {}, []
    for step in range(20000):
        arrival, is_arrival = divmod(step, every)
        if is_arrival == 0 and arrival < num_requests:
            engine.add_request(f"r{arrival}", prompts[arrival], params)
            added[f"r{arrival}"] = time.perf_counter()
        elif arrival >= num_requests and not engine.has_unfinished():
            break
        for update in engine.step():
            if not update.new_token_ids:
                continue
            now, name = time.perf_counter(), update.request_id
            if name not in first:
                first[name] = now
            else:
                gaps.append((now - last[name]) / len(update.new_token_ids))
            last[name] = now
    stats = engine.stats()
    return {"ttft_ms": statistics.median(first[r] - added[r] for r in added) * 1e3,
            "itl_ms": statistics.median(gaps) * 1e3, "decode_rows": stats.get("num_decode_rows"),
            "static_decode_rows": stats.get("num_static_decode_rows")}


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse(argv)
    if args.arrivals:
        row = arrivals_ms(available_models(("windserve-tiny",), tempfile.gettempdir())["windserve-tiny"])
        print(f"arrivals: TTFT {row['ttft_ms']:.2f} ms, ITL {row['itl_ms']:.2f} ms (medians); decode rows "
              f"{row['decode_rows']}, on the static path {row['static_decode_rows']}")
        return [row]
    tmp = tempfile.mkdtemp(prefix="windserve-host-step-")
    real = static_runner.StaticStepRunner._forward
    static_runner.StaticStepRunner._forward = cached_forward(real, args.max_model_len is None)
    try:
        path = with_positions(available_models(("windserve-tiny",), tmp)["windserve-tiny"], args.max_model_len, tmp)
        rows = [host_step_ms(path, c, args.steps, args.max_model_len) for c in args.concurrency]
    finally:
        static_runner.StaticStepRunner._forward = real
        shutil.rmtree(tmp, ignore_errors=True)
    for row in rows:
        print(f"c={row['concurrency']:>3}, {row['max_model_len']} positions: host step "
              f"{row['host_step_ms']:.2f} ms (mean: schedule "
              f"{row['schedule_ms']:.2f}, run without the forward {row['run_ms']:.2f}, "
              f"postprocess {row['postprocess_ms']:.2f})")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "host_step.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
