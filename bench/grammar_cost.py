"""What a grammar costs a decode step: SmolLM2 through the engine, c requests decoding together, plain
against under a JSON schema (a string of at least 400 characters: no request ends before max_tokens),
alternated run by run; the median step after the prefill, the median over runs.

    python -m bench.grammar_cost [--concurrency 1 4 8] [--runs 3] [--max-tokens 40]
"""

from __future__ import annotations

import argparse
import statistics
import time

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.grammar import GrammarSpec
from engine.model_registry import SMOLLM2_NAME

SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 400}}, "required": ["text"]}


def median_step_ms(engine: LLMEngine, prompt: list[int], concurrency: int, grammar: GrammarSpec | None,
                   max_tokens: int) -> float:
    for i in range(concurrency):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=grammar is None, grammar=grammar)
        engine.add_request(f"{time.monotonic_ns()}-{i}", prompt, params)
    engine.step()  # the prefill
    steps = []
    while engine.has_unfinished():
        started = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - started)
    return 1e3 * statistics.median(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=40)
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model=SMOLLM2_NAME, device="cpu", tokens_per_block=16, num_pages=256,
                                    max_num_seqs=max(args.concurrency)))
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Describe a kite in a long sentence."}])
    spec = GrammarSpec.json_schema(SCHEMA)
    engine.grammars.compile(spec)
    median_step_ms(engine, prompt, 1, None, 4)  # warm up
    for c in args.concurrency:
        plain, constrained = [], []
        for _ in range(args.runs):
            plain.append(median_step_ms(engine, prompt, c, None, args.max_tokens))
            constrained.append(median_step_ms(engine, prompt, c, spec, args.max_tokens))
        p, g = statistics.median(plain), statistics.median(constrained)
        print(f"c={c}: step p50 plain {p:.2f} ms, JSON schema {g:.2f} ms, {g / p:.3f}x "
              f"(runs {[round(x, 1) for x in plain]} / {[round(x, 1) for x in constrained]})")


if __name__ == "__main__":
    main()
