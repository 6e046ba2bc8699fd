"""Where one engine step's time goes: torch's profiler and cProfile over decode steps at concurrency c.

    python -m bench.step_profile [--device cpu|cuda] [--dtype float32] [--concurrency 64] [--steps 20]
                                 [--model windserve-tiny|gptoss-mid] [--out bench/out]

Submits ``concurrency`` prompts of 16-256 random tokens with ``max_num_seqs = concurrency``,
runs until every request is decoding, then profiles ``steps`` decode steps (each step
waits for its device work, as ``LLMEngine.step`` returns host token ids). Prints the
median step, the ops with the most self CPU time (and device time on CUDA), and the
Python functions with the most cumulative time; writes both tables to
``<out>/step_profile_<device>.txt``. A diagnosis, not a figure: no ratio is taken.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import statistics
import tempfile
import time

from torch.profiler import ProfilerActivity, profile

from bench.engine_models import available_models, make_llm, mixed_prompts
from engine import SamplingParams


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model", choices=("windserve-tiny", "gptoss-mid"), default="windserve-tiny")
    parser.add_argument("--out", default=os.path.join("bench", "out"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> str:
    args = parse(argv)
    tmp = tempfile.mkdtemp(prefix="windserve-profile-")
    try:
        path = available_models((args.model,), tmp)[args.model]
        steps, c = args.steps, args.concurrency
        llm = make_llm(path, c, 256, 3 * steps + 16, device=args.device, dtype=args.dtype)
        engine = llm.engine
        for i, prompt in enumerate(mixed_prompts(c, (16, 256), seed=3)):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=3 * steps + 8, ignore_eos=True))
        started: set[str] = set()
        while len(started) < c:  # prefill everything first: only decode steps are profiled
            started.update(u.request_id for u in engine.step() if u.new_token_ids)
        for _ in range(3):
            engine.step()  # warm-up
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                engine.step()
        python = cProfile.Profile()
        python.enable()
        for _ in range(steps):
            engine.step()
        python.disable()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    lines = [f"{args.model} {args.dtype} on {args.device}, concurrency {c}: median decode step "
             f"{statistics.median(times) * 1e3:.2f} ms (min {min(times) * 1e3:.2f}) over {steps} steps"]
    lines.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    if args.device == "cuda":
        lines.append(prof.key_averages().table(sort_by="self_device_time_total", row_limit=15,
                                               max_name_column_width=60))
    stream = io.StringIO()
    pstats.Stats(python, stream=stream).sort_stats("cumulative").print_stats(40)
    lines.append(stream.getvalue())
    report = "\n".join(lines)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"step_profile_{args.device}.txt"), "w") as f:
        f.write(report)
    print(report)
    return report


if __name__ == "__main__":
    main()
