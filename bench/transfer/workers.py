"""Benchmark-only actors: a context worker that holds pages without prefilling, a generation
worker that can fragment its pool, and a plain NIXL peer with one buffer (the baseline)."""

from __future__ import annotations

import asyncio
import time

import torch

from actors.context_worker import ContextWorker
from actors.generation_worker import GenerationWorker
from actors.messages import KVHandle
from actors.transport import PageRun, unique_agent_name
from actors.transport.nixl import NixlTransport


class SyntheticContextWorker(ContextWorker):
    """A ContextWorker that can also hold a prompt's pages without computing them (benchmark only).

    ``hold_synthetic`` binds what admitting a prefill binds (every ordinal of
    the prompt, lowest free pages first) and grants the same lease, so the
    KVHandle, the slice and its page runs are those a prefill would give; a
    prefill then unbinds some stale window pages, which are outside the slice.
    ``cross_check`` compares the two at the smallest sizes.
    """

    async def hold_synthetic(self, request_id: str, prompt_len: int):
        return await self.loop.call(self._hold, request_id, prompt_len)

    def _hold(self, request_id: str, prompt_len: int):
        engine = self.engine
        engine.check_prompt(prompt_len)
        # What the scheduler's admission of a prefill-only request binds (context side: no drafts).
        manager = engine.manager
        manager.allocate(request_id, prompt_len, num_extra_kv_tokens=engine.num_extra_kv_tokens, include_drafts=False)
        return KVHandle(context_agent=self.agent_name, request_id=request_id, prompt_len=prompt_len,
                        output_token_ids=[0],
                        block_ordinals={g.name: manager.get_block_ordinals(request_id, g.name)
                                        for g in manager.spec.groups},
                        lease_deadline=self.leases.grant(request_id), tokens_per_block=manager.spec.tokens_per_block)

    async def fill_random(self, seed: int) -> None:
        for tensor in self.engine.manager.storage.tensors.values():
            tensor.normal_(generator=torch.Generator(device=tensor.device).manual_seed(seed))

    async def page_sums(self, group: str, pages: list[int]) -> list[float]:
        return _page_sums(self.engine.manager.storage.tensors[group], pages)

    async def num_leases(self) -> int:
        return len(self.leases)


class BenchGenerationWorker(GenerationWorker):
    async def page_sums(self, group: str, pages: list[int]) -> list[float]:
        return _page_sums(self.engine.manager.storage.tensors[group], pages)

    async def fragment(self) -> int:
        """Hold every other page of every pool with one-token requests, so no two free pages are adjacent."""
        manager, count = self.engine.manager, 0
        while manager.can_allocate(1, draft_len=self.engine.draft_len):
            manager.allocate(f"hold-{count}", 1, draft_len=self.engine.draft_len)
            count += 1
        for i in range(0, count, 2):
            manager.free(f"hold-{i}")
        return manager.num_free_pages()


class BufferPeer:
    """A plain actor with one NIXL-registered buffer per size on ``device``: the single-descriptor baseline."""

    def __init__(self, sizes: dict[str, int], seed: int, device: str = "cpu") -> None:
        torch.set_num_threads(1)
        self.transport = NixlTransport(unique_agent_name("buffer"))
        generator = torch.Generator().manual_seed(seed)
        self.transport.register({name: torch.randint(0, 256, (1, n), dtype=torch.uint8, generator=generator).to(device)
                                 for name, n in sizes.items()})

    def agent(self) -> tuple[str, bytes]:
        return self.transport.agent_name, self.transport.metadata()

    def connect(self, name: str, metadata: bytes) -> None:
        self.transport.connect(name, metadata)

    async def read(self, peer: str, name: str) -> float:
        start = time.perf_counter()
        await asyncio.to_thread(self.transport.read, peer, [PageRun(name, 0, 0, 1)])
        return time.perf_counter() - start


def _page_sums(tensor: torch.Tensor, pages: list[int]) -> list[float]:
    return [float(tensor[p].sum(dtype=torch.float64)) for p in pages]
