"""Constrained outputs over many generated JSON schemas (issue 47's target: at least 200, every output
that ends with ``stop`` validates; compile p50 and p99 stated).

    python -m bench.structured_schemas [--schemas 200] [--batch 8] [--max-tokens 96] [--seed 0]

A seeded generator writes the schemas (objects, arrays, enums, nesting, string patterns and lengths,
integer and number bounds: the shapes of tests/engine/test_grammar_outputs.py's hypothesis strategy, plus
numbers); each is compiled cold (the compile cache never holds it: every schema differs) and timed, after
one warm-up compile that builds the tokenizer's tables (timed apart: the first schema a process sees).
SmolLM2 then answers them ``--batch`` at a time through the engine, alternately greedy and seeded at
temperature 0.7, and ``jsonschema`` validates every output that ends with ``stop``. Outputs cut by
``max_tokens`` end with ``length`` and are counted, not validated (a cut value: docs/openai_fields.md).
Writes ``structured_schemas.json`` (the failures, if any, with their schema and text).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import jsonschema

from bench.common import progress, write_json
from engine import EngineConfig, FinishReason, LLMEngine, SamplingParams
from engine.grammar import GrammarSpec
from engine.model_registry import SMOLLM2_NAME

NAMES = ["id", "name", "colour", "tags", "size", "owner", "next", "price", "count"]
PATTERNS = [r"^[a-z]{2,6}$", r"^[0-9]{3}-[0-9]{2}$", r"^[A-Z][a-z]{1,5}$", r"^(yes|no)$"]
WORDS = ["red", "green", "blue", "cyan", "large", "small", "north", "south"]


def leaf(rng: random.Random) -> dict:
    kind = rng.randrange(6)
    if kind == 0:
        low = rng.randint(0, 3)
        return {"type": "string", "minLength": low, "maxLength": low + rng.randint(1, 12)}
    if kind == 1:
        return {"type": "boolean"}
    if kind == 2:
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 200)}
    if kind == 3:
        low = round(rng.uniform(-10, 10), 1)
        return {"type": "number", "minimum": low, "maximum": low + rng.randint(1, 100)}
    if kind == 4:
        return {"enum": rng.sample(WORDS, rng.randint(1, 4))}
    return {"type": "string", "pattern": rng.choice(PATTERNS)}


def node(rng: random.Random, depth: int) -> dict:
    """A leaf, or (while ``depth`` lasts) an object or an array of nodes."""
    kind = rng.randrange(4) if depth > 0 else 0
    if kind <= 1:
        return leaf(rng)
    if kind == 2:
        return obj(rng, depth - 1)
    low = rng.randint(0, 2)
    return {"type": "array", "items": node(rng, depth - 1), "minItems": low, "maxItems": low + rng.randint(0, 2)}


def obj(rng: random.Random, depth: int) -> dict:
    names = rng.sample(NAMES, rng.randint(1, 3))
    return {"type": "object", "properties": {name: node(rng, depth) for name in names}, "required": sorted(names)}


def make_schemas(count: int, seed: int) -> list[dict]:
    """``count`` distinct object schemas, the same for the same seed."""
    rng, schemas, seen = random.Random(seed), [], set()
    while len(schemas) < count:
        schema = obj(rng, depth=2)
        key = json.dumps(schema, sort_keys=True)
        if key not in seen:
            seen.add(key)
            schemas.append(schema)
    return schemas


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def answer(engine: LLMEngine, prompt: list[int],
           batch: list[tuple[dict, SamplingParams]]) -> list[tuple[str, FinishReason]]:
    for i, (_, params) in enumerate(batch):
        engine.add_request(f"s{i}", prompt, params)
    texts, reasons = [""] * len(batch), [None] * len(batch)
    while engine.has_unfinished():
        for update in engine.step():
            i = int(update.request_id[1:])
            texts[i] += update.new_text
            reasons[i] = update.finish_reason
    if engine.manager.num_free_pages() != engine.manager.num_total_pages():
        raise AssertionError("pages still held after the batch ended")
    return list(zip(texts, reasons))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemas", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    engine = LLMEngine(EngineConfig(model=SMOLLM2_NAME, device="cpu", tokens_per_block=16, num_pages=512,
                                    max_num_seqs=args.batch))
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Write a short JSON example."}])
    schemas = make_schemas(args.schemas, args.seed)
    started = time.perf_counter()
    engine.grammars.compile(GrammarSpec.json_schema({"type": "object"}))  # builds the tokenizer's tables once
    first_compile_ms = 1e3 * (time.perf_counter() - started)
    compile_ms, specs = [], []
    for schema in schemas:
        spec = GrammarSpec.json_schema(schema)
        started = time.perf_counter()
        engine.grammars.compile(spec)
        compile_ms.append(1e3 * (time.perf_counter() - started))
        specs.append(spec)
    progress(f"compiled {len(specs)} schemas: p50 {statistics.median(compile_ms):.1f} ms")
    counts = {"stop": 0, "length": 0, "valid": 0}
    failures, started = [], time.perf_counter()
    for start in range(0, len(schemas), args.batch):
        batch = [(schemas[i], SamplingParams(max_tokens=args.max_tokens, grammar=specs[i],
                                             **({"temperature": 0.7, "seed": args.seed + i} if i % 2 else {})))
                 for i in range(start, min(start + args.batch, len(schemas)))]
        for (schema, _), (text, reason) in zip(batch, answer(engine, prompt, batch)):
            counts[reason.value] = counts.get(reason.value, 0) + 1
            if reason != FinishReason.STOP:
                continue
            try:
                jsonschema.validate(json.loads(text), schema)
                counts["valid"] += 1
            except (ValueError, jsonschema.ValidationError) as exc:
                failures.append({"schema": schema, "text": text, "error": str(exc)[:300]})
        progress(f"{start + len(batch)}/{len(schemas)}: {counts}")
    figures = {
        "schemas": len(schemas), "max_tokens": args.max_tokens, "counts": counts,
        "valid_of_stopped": counts["valid"] / max(1, counts["stop"]),
        "compile_ms": {"p50": statistics.median(compile_ms), "p99": percentile(compile_ms, 0.99),
                       "max": max(compile_ms), "first_schema_of_the_process": first_compile_ms},
        "generate_s": round(time.perf_counter() - started, 1), "failures": failures,
    }
    path = write_json(args.out, "structured_schemas", figures)
    print(f"{len(schemas)} schemas: {counts['stop']} ended with stop, {counts['valid']} of them valid "
          f"({100 * figures['valid_of_stopped']:.1f}%), {counts['length']} cut by max_tokens; compile p50 "
          f"{figures['compile_ms']['p50']:.1f} ms, p99 {figures['compile_ms']['p99']:.1f} ms -> {path}")
    return figures


if __name__ == "__main__":
    main()
