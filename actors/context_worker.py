"""Context (prefill) worker: prefills prompts and holds their pages under a lease.

    prefill(request) ──► EngineLoop.prefill ──► the parked update: k outputs, pages parked
                     ├─ an output ends the request (max_tokens, EOS, stop) ──► pages freed
                     │      ──► Prefilled(first, kv=None): no generation worker needed
                     └─ else ──► lease granted ──► Prefilled(first, KVHandle (ids, ordinals, lengths))

The engine hands over at the first output with visible text (``engine.handoff``:
k outputs, usually 1, at most ``HANDOFF_MAX_TOKENS``); ``first`` carries them in
one update, which the ingress streams to the client while the generation worker
pulls the KV of ``num_kv_tokens = P + k - 1`` positions.

A generation worker then, over control messages (``actors.control``):
``Claim`` (the lease must be live; it cannot expire under the transfer),
pulls the pages itself, and ``Release``s them; it may ``Extend`` the lease
while it waits for free pages. Leases that lapse are reaped: pages freed.

With the prefix cache, a prompt's hit binds pages that other requests and
leases bind too (pages are reference-counted): ending one lease drops only
its own references, so a shared page stays put, and unwritten, while any
other lease still holds it; once nobody does, it is evictable, not lost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from actors.background import BackgroundTask
from actors.config import WorkerConfig
from actors.leases import LeaseTable
from actors.messages import Claim, Extend, KVHandle, Prefilled, Release
from actors.worker_base import KVWorker
from engine import SamplingParams
from engine.outputs import PrefillResult

log = logging.getLogger(__name__)


class ContextWorker(KVWorker):
    role = "context"

    def __init__(self, config: WorkerConfig | None = None) -> None:
        super().__init__(config)
        self.leases = LeaseTable(self.config.lease_s, self.config.claim_s)
        self.control.on(Claim, self._on_claim)
        self.control.on(Extend, self._on_extend)
        self.control.on(Release, self._on_release)
        self._reaper = BackgroundTask(self._reap_forever)
        self.num_prefills = 0  # prefill calls this replica took up, cumulative

    async def start(self) -> None:
        """Also reap lapsed leases."""
        await super().start()
        self._reaper.start()

    async def shutdown(self) -> None:
        await self._reaper.stop()
        await super().shutdown()

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Prefilled:
        """Prefill and sample up to the handoff; hold the pages under a lease unless an
        output already ends the request (then they are freed at once)."""
        self.num_prefills += 1
        parked = await self.loop.prefill(request_id, prompt_token_ids, params)
        result = parked.prefill
        first = dataclasses.replace(parked, finish_reason=result.finish_reason, prefill=None)
        kv = self._lease(result)  # no await in between: a cancellation cannot strand parked pages
        if result.finish_reason is None:
            return Prefilled(first, kv)
        await asyncio.shield(self._free(request_id, "finished within its handoff"))  # freed even if we are cancelled
        return Prefilled(first, None)

    def _lease(self, result: PrefillResult) -> KVHandle:
        deadline = self.leases.grant(result.request_id)
        tokens_per_block = self.engine.manager.spec.tokens_per_block
        return KVHandle(self.agent_name, result.request_id, result.num_prompt_tokens, result.output_token_ids,
                        result.block_ordinals, deadline, tokens_per_block, result.output_logprobs,
                        result.num_cached_tokens)

    async def abort(self, request_id: str) -> bool:
        """Stop a prefill or drop a lease; its pages are freed either way."""
        self.leases.end(request_id, "aborted")
        return await super().abort(request_id)

    async def _on_claim(self, peer: str, claim: Claim) -> str:
        self.leases.claim(claim.request_id)
        return "claimed"

    async def _on_extend(self, peer: str, extend: Extend) -> str:
        self.leases.extend(extend.request_id, extend.seconds)
        return "extended"

    async def _on_release(self, peer: str, release: Release) -> str:
        await self._free(release.request_id, "released after transfer")
        return "released"

    async def _free(self, request_id: str, why: str) -> None:
        if self.leases.end(request_id, why):
            await self.loop.call(self.engine.abort, request_id)

    async def reap_expired(self) -> list[str]:
        expired = self.leases.expired()
        for request_id in expired:
            log.warning("lease on %s lapsed; freeing its pages", request_id)
            await self._free(request_id, "lease expired")
        return expired

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(min(0.5, self.config.lease_s / 4))
            await self.reap_expired()

    async def stats(self) -> dict:
        return {**await super().stats(), "num_leases": len(self.leases), "num_claimed_leases": self.leases.num_claimed,
                "num_prefills": self.num_prefills}
