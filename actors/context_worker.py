"""Context (prefill) worker: prefills prompts and holds their pages under a lease.

    prefill(request) ──► engine prefill-only ──► first token, pages parked
                     ──► lease granted ──► KVHandle (ids, ordinals, lengths)

A generation worker then, over control messages (``actors.control``):
``Claim`` (the lease must be live; it cannot expire under the transfer),
pulls the pages itself, and ``Release``s them; it may ``Extend`` the lease
while it waits for free pages. Leases that lapse are reaped: pages freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from actors.config import WorkerConfig
from actors.leases import LeaseTable
from actors.messages import Claim, Extend, KVHandle, Release
from actors.worker_base import KVWorker
from engine import SamplingParams
from engine.outputs import TokenLogprob

log = logging.getLogger(__name__)


class ContextWorker(KVWorker):
    role = "context"

    def __init__(self, config: WorkerConfig | None = None) -> None:
        super().__init__(config)
        self.leases = LeaseTable(self.config.lease_s, self.config.claim_s)
        self.control.on(Claim, self._on_claim)
        self.control.on(Extend, self._on_extend)
        self.control.on(Release, self._on_release)
        self._reaper: asyncio.Task | None = None

    async def start(self) -> None:
        """Also reap lapsed leases."""
        await super().start()
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    async def shutdown(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        await super().shutdown()

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> KVHandle:
        """Prefill, sample the first token, and hold the prompt's pages under a lease."""
        last = None
        async for update in self.loop.generate(request_id, prompt_token_ids, params, prefill_only=True):
            last = update
        if last is None or last.finish_reason in ("error", "abort"):
            raise RuntimeError(f"prefill of {request_id!r} failed: {last.error if last else 'no output'}")
        first_logprob = last.logprobs[0] if last.logprobs else None
        return await self.loop.call(self._lease, request_id, len(prompt_token_ids), last.new_token_ids[0], first_logprob)

    def _lease(self, request_id: str, prompt_len: int, first_token_id: int, first_logprob: TokenLogprob | None) -> KVHandle:
        manager = self.engine.manager
        ordinals = {g.name: manager.get_block_ordinals(request_id, g.name) for g in manager.spec.groups}
        deadline = self.leases.grant(request_id)
        return KVHandle(self.agent_name, request_id, prompt_len, first_token_id, ordinals, deadline,
                        manager.spec.tokens_per_block, first_logprob)

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
            await self.loop.call(self.engine.release, request_id)

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
        return {**await super().stats(), "num_leases": len(self.leases)}
