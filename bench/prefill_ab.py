"""Long-prompt prefill: this checkout's attention against an earlier revision's, side by side.

    python -m bench.prefill_ab [--rev d294006] [--reps 4] [--models windserve-tiny,gptoss-mid] [--quick]

The earlier revision's ``engine/attention.py`` (``git show REV:engine/attention.py``; a
revision from before ``engine.attention_plan`` was split out, when that one file held the
index builder and the kernels) is loaded as a module and swapped into the decoder for its
runs. Each run: a new engine, 4 prompts of 2,000 random tokens (chunks of 1,024; ``--quick``:
2 of 300, chunks of 128), greedy,
4 output tokens; the two alternate (``bench.common.interleave``), one torch thread, CPU
seconds (``timed_cpu``). Prints every run, the ratio of medians (earlier / this) and
whether the tokens are identical; writes ``prefill_ab.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import statistics
import subprocess
import sys
import tempfile
import types
from functools import partial

import engine.attention
import engine.attention_plan
import engine.models.decoder as decoder
from bench.common import interleave, parse_args, progress, timed_cpu, torch_threads, write_json
from bench.engine_models import available_models, make_llm, mixed_prompts, parse_models
from engine import SamplingParams
from engine.host_memory import keep_freed_memory

CURRENT = types.SimpleNamespace(build_group_attention=engine.attention_plan.build_group_attention,
                                paged_attention=engine.attention.paged_attention)


def load_revision(rev: str, directory: str) -> types.ModuleType:
    """``engine/attention.py`` as it was at ``rev``, as a module of its own."""
    source = subprocess.run(["git", "show", f"{rev}:engine/attention.py"], check=True, capture_output=True,
                            text=True).stdout
    path = f"{directory}/attention_{rev}.py"
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"attention_{rev}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def run(path: str, attention, prompts: list[list[int]], max_tokens: int,
        budget: int) -> tuple[list[list[int]], float]:
    decoder.build_group_attention, decoder.paged_attention = attention.build_group_attention, attention.paged_attention
    try:
        llm = make_llm(path, len(prompts), max(map(len, prompts)), max_tokens, max_num_batched_tokens=budget)
        llm.generate(prompt_token_ids=[p[:20] for p in prompts[:2]],
                     sampling_params=SamplingParams(max_tokens=2, ignore_eos=True))
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        outputs, _, cpu = timed_cpu(llm.generate, prompt_token_ids=prompts, sampling_params=params)
        return [o.token_ids for o in outputs], cpu
    finally:
        decoder.build_group_attention, decoder.paged_attention = CURRENT.build_group_attention, CURRENT.paged_attention


def main(argv: list[str] | None = None) -> dict:
    models, rest = parse_models(argv)
    rev_parser = argparse.ArgumentParser(add_help=False)
    rev_parser.add_argument("--rev", default="d294006")
    known, rest = rev_parser.parse_known_args(rest)
    args = parse_args(__doc__.splitlines()[0], rest)
    models = models or (("windserve-tiny",) if args.quick else ("windserve-tiny", "gptoss-mid"))
    reps = args.reps or (2 if args.quick else 4)
    num_tokens, budget = (300, 128) if args.quick else (2000, 1024)  # quick: chunks of 128, most after a prefix
    prompts = mixed_prompts(2 if args.quick else 4, (num_tokens, num_tokens))
    keep_freed_memory()
    tmp = tempfile.mkdtemp(prefix="windserve-bench-")
    rows = []
    try:
        earlier = load_revision(known.rev, tmp)
        with torch_threads(1):
            for model, path in available_models(models, tmp).items():
                progress(f"{model}: {reps} x ({len(prompts)} prompts of {num_tokens} tokens), {known.rev} and this")
                runs = interleave(reps, {name: partial(run, path, attention, prompts, 4, budget)
                                         for name, attention in ((known.rev, earlier), ("this", CURRENT))})
                cpu = {name: [seconds for _, seconds in results] for name, results in runs.items()}
                tokens = {name: {str(t) for t, _ in results} for name, results in runs.items()}
                row = {"model": model, "cpu_s": cpu, "identical": len(tokens[known.rev] | tokens["this"]) == 1,
                       "ratio": statistics.median(cpu[known.rev]) / statistics.median(cpu["this"])}
                progress(f"{model}: {row}")
                rows.append(row)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    figures = {"rev": known.rev, "prompts": len(prompts), "prompt_tokens": num_tokens, "rows": rows}
    write_json(args.out, "prefill_ab", figures)
    return figures


if __name__ == "__main__":
    main()
