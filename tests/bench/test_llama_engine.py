"""bench.llama_engine's own logic: the llama-bench command and how its JSON becomes ms per token (the bench itself
needs a llama.cpp build, ~10 min: run by hand, figures in docs/benchmarks.md)."""

from __future__ import annotations

import json
import sys

import pytest

from bench import llama_engine


def test_the_command_decodes_after_a_filled_context_without_a_prompt_test():
    command = llama_engine.llama_bench_command("/b/llama-bench", "/m/q.gguf", threads=2, num_tokens=64, depth=400,
                                               reps=3)
    assert command == ["/b/llama-bench", "-m", "/m/q.gguf", "-t", "2", "-p", "0", "-n", "64", "-d", "400",
                       "-r", "3", "-o", "json"]


def test_ms_per_token_is_the_mean_run_time_over_the_tokens_generated():
    # the fields of one test as llama-bench 11434 writes them (values from a run on this machine)
    report = json.dumps([{"n_threads": 2, "n_prompt": 0, "n_gen": 16, "n_depth": 64, "avg_ns": 359100015,
                          "avg_ts": 45.114553, "samples_ns": [399062695, 319137335]}])
    assert llama_engine.llama_ms_per_token(report) == pytest.approx(359.100015 / 16)


def test_a_report_of_several_tests_is_refused():
    one = {"n_gen": 16, "avg_ns": 1}
    with pytest.raises(ValueError):
        llama_engine.llama_ms_per_token(json.dumps([one, one]))


def test_a_llama_bench_that_dies_on_a_signal_runs_without_repacking(tmp_path):
    """As ggml's AMX kernels did on an Intel VM (SIGILL): the command gains --repack 0; one that runs keeps its
    command."""
    dies = tmp_path / "dies"
    dies.write_text(f"#!{sys.executable}\nimport os, signal, sys\n"
                    "if sys.argv[-2:] != ['--repack', '0']: os.kill(os.getpid(), signal.SIGILL)\n")
    runs = tmp_path / "runs"
    runs.write_text(f"#!{sys.executable}\n")
    for binary in (dies, runs):
        binary.chmod(0o755)
    command = llama_engine.llama_bench_command(str(dies), "/m/q.gguf", threads=2, num_tokens=64, depth=400, reps=3)
    assert llama_engine.working_command(command) == [*command, "--repack", "0"]
    command = llama_engine.llama_bench_command(str(runs), "/m/q.gguf", threads=2, num_tokens=64, depth=400, reps=3)
    assert llama_engine.working_command(command) == command
