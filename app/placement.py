"""What the ingress knows of where a prompt's KV is: its routing hint, and the generation side's caches.

    prompt ──► PromptHasher.hint ──► RoutingHint(request_id, P, block names, fingerprint)
                                        │ passed as ``hint=`` with every worker call (app.routing reads it)
                                        ▼
    GenerationCaches.best_hit(hint) ── the largest hit any generation replica would give it,
                                       from their summaries on the WorkerStats board (refreshed every second)

The ingress hashes each prompt once, with the fingerprint the workers use
(``kv_fingerprint`` of the same page geometry and model), so its block names
are the ones the replicas' Bloom filters hold. Workers never take these
names: they hash the prompt themselves.

Conditional disaggregation (``local_prefill_max_tokens``) reads
``best_hit``: a prompt whose uncached part ``P - best_hit`` is short is
prefilled by a generation replica itself. The estimate comes from the
board rather than from the router because the decision (which deployment
to call) precedes routing; it is at most one report period (1 s) old, and a
stale or false-positive estimate only picks the slower path, never changes
the output.
"""

from __future__ import annotations

import asyncio
import logging

from ray.serve.handle import DeploymentHandle

from actors.background import BackgroundTask
from app.routing import ReplicaView, RoutingHint
from engine.config import EngineConfig
from engine.layout import kv_cache_spec
from engine.loader import load_config
from kvcache import block_hashes, kv_fingerprint

log = logging.getLogger(__name__)
REFRESH_PERIOD_S = 1.0


class PromptHasher:
    """Names a prompt's full blocks as the workers of ``config`` name them."""

    def __init__(self, config: EngineConfig, model_path: str) -> None:
        spec = kv_cache_spec(load_config(model_path), config.tokens_per_block, config.torch_dtype)
        self.tokens_per_block = config.tokens_per_block
        self.fingerprint = kv_fingerprint(spec, config.model)
        self.is_enabled = config.enable_prefix_caching

    def hint(self, request_id: str, prompt_token_ids: list[int]) -> RoutingHint:
        """The prompt's hint; no block names when the workers cache nothing."""
        names = block_hashes(prompt_token_ids, self.tokens_per_block, self.fingerprint) if self.is_enabled else []
        return RoutingHint(request_id, len(prompt_token_ids), tuple(names), self.fingerprint)


class GenerationCaches:
    """The generation replicas' cache summaries, read from the WorkerStats board in the background."""

    def __init__(self, board: DeploymentHandle) -> None:
        self.board = board
        self.views: list[ReplicaView] = []
        self._refresher = BackgroundTask(self._refresh_forever)

    def start(self) -> None:
        """Refresh every REFRESH_PERIOD_S (on the running event loop); idempotent."""
        self._refresher.start()

    async def stop(self) -> None:
        await self._refresher.stop()

    def best_hit(self, hint: RoutingHint) -> int:
        """Tokens of the prompt the best-placed generation replica holds (0 before any report)."""
        return max((view.hit(hint) for view in self.views), default=0)

    def update(self, entries: list[dict]) -> None:
        views = (ReplicaView.from_stats(e) for e in entries if e.get("role") == "generation")
        self.views = [view for view in views if view is not None]

    async def _refresh_forever(self) -> None:
        while True:
            try:
                self.update(await self.board.snapshot.remote())
            except Exception:
                log.warning("reading the generation replicas' cache summaries failed", exc_info=True)
            await asyncio.sleep(REFRESH_PERIOD_S)
