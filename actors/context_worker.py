"""Context (prefill) worker: prefills prompts and holds their pages under a lease.

    prefill(request) ──► engine prefill-only ──► first token, pages parked
                     ──► lease granted ──► KVHandle (ids, ordinals, lengths)

A generation worker then, over control messages (``actors.control``):
``claim`` (the lease must be live; it cannot expire under the transfer),
pulls the pages itself, and ``release``s them; it may ``extend`` the lease
while it waits for free pages. Leases that lapse are reaped: pages freed.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from actors.compat import compat_descriptor
from actors.config import WorkerConfig
from actors.control import ControlChannel
from actors.engine_loop import EngineLoop
from actors.leases import LeaseTable
from actors.messages import KVHandle
from actors.peers import PeerDirectory
from actors.transport import make_transport, unique_agent_name
from engine import LLMEngine, SamplingParams

log = logging.getLogger(__name__)


class ContextWorker:
    def __init__(self, config: WorkerConfig | None = None) -> None:
        self.config = config or WorkerConfig()
        torch.set_num_threads(self.config.torch_threads)
        self.engine = LLMEngine(self.config.engine, role="context")
        self.loop = EngineLoop(self.engine)
        self.transport = make_transport(self.config.transport, unique_agent_name("context"))
        self.transport.register(self.engine.manager.storage.tensors)
        self.peers = PeerDirectory(self.transport, compat_descriptor(self.engine))
        self.peers.publish()
        self.leases = LeaseTable(self.config.lease_s, self.config.claim_s)
        self.control = ControlChannel(self.transport, self.peers)
        self.control.on("claim", self._on_claim)
        self.control.on("extend", self._on_extend)
        self.control.on("release", self._on_release)
        self._reaper: asyncio.Task | None = None

    @property
    def agent_name(self) -> str:
        return self.transport.agent_name

    def _start(self) -> None:
        self.loop.start()
        self.control.start()
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> KVHandle:
        """Prefill, sample the first token, and hold the prompt's pages under a lease."""
        self._start()
        last = None
        async for update in self.loop.generate(request_id, prompt_token_ids, params, prefill_only=True):
            last = update
        if last is None or last.finish_reason in ("error", "abort"):
            raise RuntimeError(f"prefill of {request_id!r} failed: {last.error if last else 'no output'}")
        return await self.loop.call(self._lease, request_id, len(prompt_token_ids), last.new_token_ids[0])

    def _lease(self, request_id: str, prompt_len: int, first_token_id: int) -> KVHandle:
        manager = self.engine.manager
        ordinals = {g.name: manager.get_block_ordinals(request_id, g.name) for g in manager.spec.groups}
        deadline = self.leases.grant(request_id)
        return KVHandle(self.agent_name, request_id, prompt_len, first_token_id, ordinals, deadline,
                        manager.spec.tokens_per_block)

    async def abort(self, request_id: str) -> bool:
        """Stop a prefill or drop a lease; its pages are freed either way."""
        self.leases.end(request_id, "aborted")
        return await self.loop.abort(request_id)

    async def _on_claim(self, peer: str, args: list[str]) -> str:
        self.leases.claim(args[0])
        return "claimed"

    async def _on_extend(self, peer: str, args: list[str]) -> str:
        self.leases.extend(args[0], float(args[1]))
        return "extended"

    async def _on_release(self, peer: str, args: list[str]) -> str:
        await self._free(args[0], "released after transfer")
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
        self._start()
        stats = await self.loop.call(self.engine.stats)
        return {"role": "context", "agent": self.agent_name, "num_leases": len(self.leases), **stats}

    async def check_integrity(self) -> None:
        await self.loop.call(self.engine.manager.check_integrity)

    async def read_pages(self, group: str, pages: list[int]) -> torch.Tensor:
        """A copy of some pages (tests compare them with what a transfer landed)."""
        return await self.loop.call(lambda: self.engine.manager.storage.tensors[group][pages].clone())
