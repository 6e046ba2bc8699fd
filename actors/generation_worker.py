"""Generation (decode) worker: receives a prompt's windowed KV slice and decodes.

    generate(handle) ─► reserve capacity (get_kv_capacity_tokens, via the engine)
                     ─► claim the context lease ─► plan_slice per group ─► coalesce
                     ─► transport.read (pull) ─► release the context pages
                     ─► decode with continuous batching + drafts, streaming updates

Any failure or abort before decoding frees the reserved pages here and
releases the context side's; a read in flight is waited for before our
pages are freed, so it can never land in another request's pages.
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from actors.config import WorkerConfig
from actors.messages import KVHandle, TransferRecord
from actors.transport import PageRun, coalesce
from actors.worker_base import KVWorker
from engine import RequestUpdate, SamplingParams
from kvcache import plan_slice


class TransferFailed(RuntimeError):
    """The prompt's KV could not be brought over; the request fails, nothing leaks."""


class GenerationWorker(KVWorker):
    role = "generation"

    def __init__(self, config: WorkerConfig | None = None) -> None:
        super().__init__(config)
        self.transfers: list[TransferRecord] = []
        self.num_transfers = 0
        self.total_kv_bytes = 0
        self.total_kv_seconds = 0.0

    async def generate(self, handle: KVHandle, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestUpdate]:
        """Bring the prompt's KV over, then stream the request's updates."""
        self.loop.start()
        self.control.start()
        rid = handle.request_id
        queue = await self._receive(handle, prompt_token_ids, params)
        async for update in self.loop.stream(rid, queue):
            yield update

    async def _receive(self, handle: KVHandle, prompt_token_ids: list[int], params: SamplingParams):
        rid = handle.request_id
        if len(prompt_token_ids) != handle.prompt_len:
            raise TransferFailed(f"request {rid!r}: handle says {handle.prompt_len} prompt tokens, got {len(prompt_token_ids)}")
        await self.receive_kv(handle)
        queue = self.loop.watch(rid)
        try:
            updates = await self.loop.call(self.engine.add_prefilled, rid, prompt_token_ids, handle.first_token_id, params,
                                          handle.first_logprob)
        except BaseException:
            self.loop.unwatch(rid)
            await self.loop.call(self.engine.abort, rid)
            raise
        self.loop.deliver(updates)
        return queue

    async def receive_kv(self, handle: KVHandle) -> TransferRecord:
        """Reserve pages, claim the lease, pull the slice, release the context side.

        The pages stay bound to the request (``abort`` frees them); ``generate``
        continues from here. On any failure both sides' pages are freed.
        """
        self.control.start()
        await self.loop.call(self.engine.check_prompt, handle.prompt_len)
        try:
            await self._reserve(handle)
            await self.control.ask(handle.context_agent, "claim", handle.request_id, timeout_s=self.config.transfer_timeout_s)
            record = await self._pull(handle)
        except BaseException:
            await self.loop.call(self.engine.abort, handle.request_id)
            self._release_context(handle)
            raise
        self._release_context(handle)
        return record

    def _release_context(self, handle: KVHandle) -> None:
        try:
            self.control.tell(handle.context_agent, "release", handle.request_id)
        except Exception:
            pass  # the context worker is gone; its pages went with it

    async def _reserve(self, handle: KVHandle) -> None:
        """Bind pages for the prompt; while the cache is full, extend the context lease and wait."""
        deadline = time.monotonic() + self.config.reserve_timeout_s
        while not await self.loop.call(self.engine.reserve_prefilled, handle.request_id, handle.prompt_len):
            if time.monotonic() > deadline:
                raise TransferFailed(f"no free KV pages for request {handle.request_id!r} within {self.config.reserve_timeout_s}s")
            self.control.tell(handle.context_agent, "extend", handle.request_id, str(self.config.lease_s))
            await asyncio.sleep(0.05)

    def plan(self, handle: KVHandle) -> tuple[list[PageRun], int, int]:
        """Coalesced runs of the windowed slice, the number of pages and the slice's bytes."""
        manager = self.engine.manager
        runs, num_pages, num_bytes = [], 0, 0
        for group in manager.spec.groups:
            pairs = plan_slice(handle.block_ordinals[group.name], manager.get_block_ordinals(handle.request_id, group.name),
                               handle.prompt_len, group.window, manager.spec.tokens_per_block)
            runs += coalesce([(src, dst) for _, src, dst in pairs], group.name)
            num_pages += len(pairs)
            num_bytes += len(pairs) * manager.storage.page_nbytes(group.name)
        return runs, num_pages, num_bytes

    async def _pull(self, handle: KVHandle) -> TransferRecord:
        runs, num_pages, num_bytes = await self.loop.call(self.plan, handle)
        start = time.perf_counter()
        read = asyncio.ensure_future(asyncio.to_thread(self._read, handle.context_agent, runs))
        try:
            moved = await asyncio.shield(read)
        except asyncio.CancelledError:
            await asyncio.wait([read])  # our pages stay bound until the read is over
            raise
        if moved != num_bytes:
            raise TransferFailed(f"request {handle.request_id!r}: moved {moved} bytes, the slice has {num_bytes}")
        record = TransferRecord(handle.request_id, num_pages, len(runs), moved, time.perf_counter() - start)
        self.transfers.append(record)
        del self.transfers[:-1000]
        self.num_transfers += 1
        self.total_kv_bytes += record.num_bytes
        self.total_kv_seconds += record.seconds
        return record

    def _read(self, peer: str, runs: list[PageRun]) -> int:
        self.peers.ensure_connected(peer)
        return self.transport.read(peer, runs, self.config.transfer_timeout_s) if runs else 0

    async def stats(self) -> dict:
        return {**await super().stats(), "kv_transfers": self.num_transfers, "kv_transfer_bytes": self.total_kv_bytes,
                "kv_transfer_seconds": self.total_kv_seconds}

    async def last_transfer(self) -> TransferRecord | None:
        return self.transfers[-1] if self.transfers else None

    async def block_ordinals(self, request_id: str) -> dict[str, list[int]]:
        manager = self.engine.manager
        return await self.loop.call(lambda: {g.name: manager.get_block_ordinals(request_id, g.name) for g in manager.spec.groups})
