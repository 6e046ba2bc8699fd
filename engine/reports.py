"""What an engine reports: counters for metrics, and what a KV-aware router weighs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcache import BlockSummary

if TYPE_CHECKING:
    from engine.engine import LLMEngine


def engine_stats(engine: LLMEngine) -> dict:
    return {
        "num_waiting": len(engine.scheduler.waiting),
        "num_running": len(engine.scheduler.running),
        "num_free_pages": engine.manager.num_free_pages(),
        "num_empty_pages": engine.manager.num_empty_pages(),
        "num_total_pages": engine.manager.num_total_pages(),
        "num_preemptions": engine.scheduler.num_preemptions,
        "num_forward_passes": engine.runner.num_forward_passes,
        "num_steps_launched_ahead": engine.num_steps_launched_ahead,
        "num_decode_rows": engine.runner.num_decode_rows,  # decode / verify requests run, step by step
        "num_static_decode_rows": engine.runner.num_static_decode_rows,  # of them, on the static path
        "graph_capture_reserved_bytes": engine.runner.capture_reserved_bytes(),
        "num_drafts_proposed": engine.num_drafts_proposed,
        "num_drafts_accepted": engine.num_drafts_accepted,
        **_prefix_cache_stats(engine),
    }


def _prefix_cache_stats(engine: LLMEngine) -> dict:
    """Tokens looked up in the prefix cache and found, cumulative: at admission
    (a prompt's computed part), and on the generation side for transfers."""
    scheduler = engine.scheduler
    return {
        "prefix_cache_queries": scheduler.num_prefix_queried_tokens + engine.num_transfer_queried_tokens,
        "prefix_cache_hits": scheduler.num_prefix_hit_tokens + engine.num_transfer_hit_tokens,
        "num_cached_blocks": engine.manager.num_cached_blocks(),
    }


def routing_stats(engine: LLMEngine) -> dict:
    """What a KV-aware router (app.routing) weighs besides ``stats()``' page counts.

    ``queued_prefill_tokens``: prompt tokens still to compute here, the waiting
    requests' whole and the running ones' uncomputed prompt part. ``cached_block_names``:
    per group, a copy of the names its pool caches and the pool's page count, for the
    caller to summarize (``summarize_cache``) outside whatever lock guards the engine.
    """
    scheduler, manager = engine.scheduler, engine.manager
    queued = sum(r.num_uncomputed_tokens for r in scheduler.waiting)
    queued += sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in scheduler.running)
    groups = manager.spec.groups
    return {
        "queued_prefill_tokens": queued,
        "tokens_per_block": manager.spec.tokens_per_block,
        "windows": {g.name: g.window for g in groups},
        "kv_fingerprint": engine.hash_extra,
        "cached_block_names": {g.name: (list(manager.cached_block_hashes(g.name)), manager.num_total_pages(g.name))
                               for g in groups},
    }


def summarize_cache(report: dict) -> dict:
    """``report`` (``routing_stats``) with each group's cached names replaced by a Bloom filter
    (kvcache.summary) sized by the pool's pages: about 1.2 bytes a page at 1% false
    positives, so a report stays bounded however many blocks are cached."""
    names = report["cached_block_names"]
    summaries = {g: BlockSummary.of(hashes, capacity=num_pages).to_bytes() for g, (hashes, num_pages) in names.items()}
    return {k: v for k, v in report.items() if k != "cached_block_names"} | {"cache_summaries": summaries}
