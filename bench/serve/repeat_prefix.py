"""``--workload repeat-prefix``: a few long system prompts, each asked several short questions (issue 28).

The trace, in rounds that cycle over the prompts (``P`` prompts of ``S`` tokens, ``Q`` questions each)::

    round 0    sys0 + q00, sys1 + q10, ..., sys(P-1) + q(P-1)0     every prefix new
    round 1    sys0 + q01, sys1 + q11, ...                         every request a repeat
    ...
    round Q-1

    sequential   one request at a time
    burst        round 0 all at once (concurrency P: every new prefix inside one report period),
                 then one request at a time

A repeat is a hit when its ``usage.prompt_tokens_details.cached_tokens`` covers at least
``HIT_FRACTION`` of its system prompt (windserve-tiny: one token per character). Sized so that the
prompts fill more than one context replica's pages but fewer than all of them together (the issue:
6 x ~2,190 tokens on 2 replicas of 512 pages of 16 tokens, ~80% of both), only a router that places
each new prefix by what the replicas will hold keeps every prompt cached: one replica given more than
its share evicts a prompt before its next question.

One app per router serves ``--runs`` runs of each pattern, each run with its own prompts (seed + run
index): the first on empty caches, the later ones on caches full of the earlier runs' prompts (a
server's steady state). Target: hit fraction >= 0.9 in each run, both arrival patterns, with the
KV-aware router. ``--routers kv,default`` runs Serve's default router the same way, one app at a time.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import asdict

from bench.common import print_table, progress, write_json
from bench.serve.client import RequestResult, run_load
from bench.serve.compare import load_serve_config, serving
from bench.serve.routing import worker_options
from bench.serve.trace import RequestSpec, chat_turn, random_text

HIT_FRACTION = 0.8
HIT_TARGET = 0.9
PATTERNS = ("sequential", "burst")
SIZES = {
    "full": dict(num_prompts=6, num_questions=5, system_len=2190, question_len=24, answer_len=8),
    "quick": dict(num_prompts=4, num_questions=3, system_len=600, question_len=16, answer_len=4),
}


def make_repeat_trace(num_prompts: int, num_questions: int, system_len: int, question_len: int, answer_len: int,
                      *, seed: int = 0) -> list[RequestSpec]:
    """Rounds cycling over the prompts (module docstring); ``turn`` is the round."""
    import random

    rng = random.Random(seed)
    systems = [random_text(rng, system_len) for _ in range(num_prompts)]
    return [RequestSpec(q * num_prompts + p, 0.0, systems[p] + chat_turn(random_text(rng, question_len)),
                        answer_len, turn=q)
            for q in range(num_questions) for p in range(num_prompts)]


async def send_in_pattern(url: str, model: str, trace: list[RequestSpec], pattern: str,
                          max_seconds: float) -> list[RequestResult]:
    """``burst``: round 0 at once, then one at a time; ``sequential``: one at a time throughout."""
    first = [spec for spec in trace if spec.turn == 0] if pattern == "burst" else []
    results = (await run_load(url, model, first, len(first), max_seconds))[0] if first else []
    rest = [spec for spec in trace if spec not in first]
    results += (await run_load(url, model, rest, 1, max_seconds))[0]
    return sorted(results, key=lambda r: r.index)


def hit_figures(trace: list[RequestSpec], results: list[RequestResult], system_len: int) -> dict:
    """Of the repeats: how many were hits, and each one's cached tokens (misses show where it went wrong)."""
    turn = {spec.index: spec.turn for spec in trace}
    repeats = [r for r in results if turn[r.index] > 0]
    hits = [r for r in repeats if r.ok and r.num_cached_tokens >= HIT_FRACTION * system_len]
    return {"num_repeats": len(repeats), "num_hits": len(hits),
            "hit_fraction": len(hits) / len(repeats) if repeats else None,
            "num_failed": sum(not r.ok for r in results),
            "cached_tokens_of_misses": [r.num_cached_tokens for r in repeats if r not in hits]}


def request_paths(app_name: str) -> dict[str, str]:
    """The ingress's path of each recent request (app.serve_backend: context, local, fell back, ...)."""
    from ray import serve

    return serve.get_deployment_handle("Ingress", app_name=app_name).request_paths.remote().result(timeout_s=30)


def runs_of_router(args: argparse.Namespace, router: str, sizes: dict) -> list[dict]:
    """Every pattern's runs, one app: the first run on empty caches, each later one on caches full of
    the earlier runs' prompts (a server's steady state: nothing free, the old prefixes to evict)."""
    model = load_serve_config(args.config)[0]["args"]["model"]
    overrides = {router: {"num_pages": args.num_pages, "context_num_pages": args.num_pages}} if args.num_pages else {}
    runs = []
    with serving({router: args.config}, args.port, args.max_seconds, overrides,
                 worker_options={router: worker_options(args, router)}) as urls:
        for pattern in PATTERNS:
            for _ in range(args.runs):
                seed = args.seed + len(runs)
                trace = make_repeat_trace(**sizes, seed=seed)
                results = asyncio.run(send_in_pattern(urls[router], model, trace, pattern, args.max_seconds))
                figures = hit_figures(trace, results, sizes["system_len"])
                paths = request_paths(router)
                figures["paths_of_misses"] = [paths.get(r.request_id, "unknown") for r in results
                                              if r.index >= sizes["num_prompts"]
                                              and r.num_cached_tokens < HIT_FRACTION * sizes["system_len"]]
                progress(f"{router} router, {pattern}, seed {seed}: {figures['num_hits']}/{figures['num_repeats']} "
                         f"repeats hit, misses cached {figures['cached_tokens_of_misses']} "
                         f"by {figures['paths_of_misses']}")
                runs.append({"router": router, "pattern": pattern, "seed": seed, "is_fresh": not runs, **figures,
                             "requests": [asdict(r) for r in results]})
    return runs


def repeat_prefix(args: argparse.Namespace) -> dict:
    sizes = SIZES["quick" if args.quick else "full"]
    if args.conversations:
        sizes = {**sizes, "num_prompts": args.conversations}
    if args.turns:
        sizes = {**sizes, "num_questions": args.turns}
    routers = args.routers.split(",")
    runs = [run for router in routers for run in runs_of_router(args, router, sizes)]
    write_json(args.out, "serve_repeat_prefix", {"sizes": sizes, "config": args.config, "num_pages": args.num_pages,
                                                 "context_replicas": args.context_replicas,
                                                 "generation_replicas": args.generation_replicas, "runs": runs})
    print_table("repeated prefixes: hits (cached >= 80% of the system prompt) of the repeats",
                ["router", "pattern", "seed", "caches", "hits", "hit fraction", "failed"],
                [[r["router"], r["pattern"], r["seed"], "empty" if r["is_fresh"] else "full",
                  f"{r['num_hits']}/{r['num_repeats']}", r["hit_fraction"], r["num_failed"]] for r in runs])
    kv_runs = [r for r in runs if r["router"] == "kv"]
    verdict = all((r["hit_fraction"] or 0.0) >= HIT_TARGET for r in kv_runs)
    print(f"kv router: every run >= {HIT_TARGET}: {'met' if verdict else 'NOT met'}")
    return {"sizes": sizes, "runs": [{k: v for k, v in r.items() if k != "requests"} for r in runs]}
