"""xgrammar against llguidance on this CPU: compile time of a few JSON schemas, and per-token mask fill,
through each library's Hugging Face tokenizer integration (SmolLM2's 49,152-token vocabulary).

    python -m bench.grammar_libs [--repeats 3]

"compile" is xgrammar's ``compile_json_schema`` (the masks it precomputes included), and for llguidance
(which compiles lazily) building the ``LLMatcher`` plus its first mask. "mask" is one
``fill_next_token_bitmask`` per token of a valid instance, tokenized by the model's tokenizer, the
matcher advanced by each token (the median over the instance's tokens). engine.grammar quotes the result.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMAS = {
    "flat": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}, {"name": "Ada", "age": 36}),
    "enum+array": ({"type": "object", "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
        "required": ["colour", "tags"]}, {"colour": "green", "tags": ["a", "bb"]}),
    "nested+bounds": ({"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "owner": {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
                                                   "score": {"type": "number"}}, "required": ["email", "score"]},
        "items": {"type": "array", "items": {"type": "object", "properties": {"sku": {"type": "string"}},
                                             "required": ["sku"]}}},
        "required": ["id", "owner", "items"]},
        {"id": 42, "owner": {"email": "ada@lovelace.com", "score": 9.5}, "items": [{"sku": "x1"}, {"sku": "y2"}]}),
    "oneOf": ({"oneOf": [{"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}},
                          "required": ["kind", "r"]},
                         {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "number"}},
                          "required": ["kind", "side"]}]}, {"kind": "square", "side": 2}),
}


def bench_xgrammar(hf, vocab_size: int, repeats: int) -> dict:
    import xgrammar as xgr

    started = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size)
    setup_s = time.perf_counter() - started
    results = {"setup_s": setup_s}
    for name, (schema, instance) in SCHEMAS.items():
        compile_s = []
        for _ in range(repeats):
            compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            started = time.perf_counter()
            compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=True)
            compile_s.append(time.perf_counter() - started)
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        fills = []
        for token in hf.encode(json.dumps(instance, separators=(",", ":")), add_special_tokens=False):
            started = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            fills.append(time.perf_counter() - started)
            assert matcher.accept_token(token), (name, token)
        results[name] = {"compile_ms": 1e3 * min(compile_s), "mask_us": 1e6 * statistics.median(fills),
                         "mask_max_us": 1e6 * max(fills)}
    return results


def bench_llguidance(hf, vocab_size: int, repeats: int) -> dict:
    import llguidance
    import llguidance.hf
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    started = time.perf_counter()
    tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size)
    setup_s = time.perf_counter() - started
    results = {"setup_s": setup_s}
    bitmask = allocate_token_bitmask(1, vocab_size)
    for name, (schema, instance) in SCHEMAS.items():
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        compile_s = []
        for _ in range(repeats):
            started = time.perf_counter()
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            fill_next_token_bitmask(matcher, bitmask)
            compile_s.append(time.perf_counter() - started)
            assert not matcher.is_error(), matcher.get_error()
        fills = []
        for token in hf.encode(json.dumps(instance, separators=(",", ":")), add_special_tokens=False):
            started = time.perf_counter()
            fill_next_token_bitmask(matcher, bitmask)
            fills.append(time.perf_counter() - started)
            assert matcher.consume_token(token), (name, token, matcher.get_error())
        results[name] = {"compile_ms": 1e3 * min(compile_s), "mask_us": 1e6 * statistics.median(fills),
                         "mask_max_us": 1e6 * max(fills)}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from engine.model_registry import SMOLLM2_NAME, resolve_model_path

    hf = AutoTokenizer.from_pretrained(resolve_model_path(SMOLLM2_NAME), local_files_only=True)
    vocab_size = len(hf)
    for name, bench in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
        print(name, json.dumps(bench(hf, vocab_size, args.repeats), indent=1))


if __name__ == "__main__":
    main()
