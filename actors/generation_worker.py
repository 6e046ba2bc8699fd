"""Generation (decode) worker: receives a request's windowed KV slice and decodes.

    generate(handle) ─► reserve num_kv_tokens (the prompt and the handed-over outputs but the
                        last, ``engine.handoff``; blocks our prefix cache holds are bound from it)
                     ─► Claim the context lease ─► plan_pull per group ─► coalesce
                     ─► transport.read (pull) ─► Release the context pages
                     ─► add_prefilled (all k outputs) ─► decode with continuous batching + drafts, streaming
    generate_local(request) ─► the engine prefills and decodes it here: no context hop, no transfer
                               (the ingress sends a prompt whose uncached part is short)

Only the slice ordinals we lack travel: ``plan_pull`` drops, by ordinal,
those our reservation bound from the local cache, so a repeated prompt
moves only its partial last block (and any block evicted here since).

Everything before decoding is the request's *handoff*, with one cleanup: on
any failure or cancel (an ``abort`` of a request in handoff cancels it), a
read in flight is waited for, then our pages are freed and the context side
is told to release its own; so a read can never land in pages another
request was given.

Fallback. When the handoff fails because the context side is unavailable
(``ContextUnavailable``: its Claim is refused, as after a lapsed lease, or
unanswered within ``claim_timeout_s``; its record is gone; a read from it
fails or times out; a lease extension sent while our cache was full cannot
reach it), the request is not lost: after that cleanup it runs
here as a local prefill that keeps the k outputs the context side already
sampled and sent (``engine.resume``: its first update carries them all, as
``add_prefilled``'s does), so the caller's stream is the one a transfer gives.
A peer that did not answer is forgotten (its metadata and connection dropped)
once no other handoff uses it. Other failures (a prompt
that does not match the handle or is too long, no free pages in time, a
cancel, a rejected read) fail the request as before::

    reserve / claim / pull fails ─► cleanup (no read in flight, our pages freed, Release told)
                                 ─► forget the peer (unless it answered) ─► local prefill, the k outputs given
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from actors.config import WorkerConfig
from actors.control import ControlError, ControlTimeout
from actors.messages import Claim, Extend, KVHandle, Release
from actors.peers import PeerNotFoundError, lookup
from actors.transport import PageRun, PeerUnreachable, ReadStats, coalesce
from actors.worker_base import KVWorker
from engine import RequestUpdate, SamplingParams
from engine.handoff import kv_token_ids
from kvcache import plan_pull

log = logging.getLogger(__name__)


class TransferFailed(RuntimeError):
    """The prompt's KV could not be brought over; the request fails, nothing leaks."""


class ContextUnavailable(TransferFailed):
    """The context side cannot hand the KV over (gone, unreachable, lease lapsed): ``generate``
    computes it here instead. ``is_answering``: the peer replied (refused), so it is alive."""

    def __init__(self, why: str, is_answering: bool) -> None:
        super().__init__(why)
        self.is_answering = is_answering


@dataclass
class Handoff:
    """One request's KV on its way here: the task bringing it, and its read once posted."""

    task: asyncio.Task
    context_agent: str
    read: asyncio.Future[ReadStats] | None = None
    over: asyncio.Event = field(default_factory=asyncio.Event)  # set once it succeeded or was undone


class GenerationWorker(KVWorker):
    role = "generation"

    def __init__(self, config: WorkerConfig | None = None) -> None:
        super().__init__(config)
        self._handoffs: dict[str, Handoff] = {}
        self.num_transfer_fallbacks = 0

    async def generate(self, handle: KVHandle, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestUpdate]:
        """reserve ─► claim ─► pull ─► release ─► add ─► stream the request's updates;
        a local prefill instead when the context side is unavailable."""
        try:
            queue = await self._receive(handle, prompt_token_ids, params)
        except ContextUnavailable as lost:
            queue = await self._fall_back(handle, prompt_token_ids, params, lost)
        async for update in self.loop.stream(handle.request_id, queue):
            yield update

    async def _receive(self, handle: KVHandle, prompt_token_ids: list[int],
                       params: SamplingParams) -> asyncio.Queue[RequestUpdate]:
        rid = handle.request_id
        async with self._handoff(handle) as handoff:
            await self.loop.compile_grammar(params)  # a failure undoes the handoff: the context pages go back
            await self._transfer(handoff, handle, prompt_token_ids)  # reserve, claim, pull, release
            queue = self.loop.watch(rid)
            # its first updates (the context side's outputs) reach the queue before any step's
            await self.loop.call_and_deliver(self.engine.add_prefilled, rid, prompt_token_ids, handle.output_token_ids,
                                             params, handle.output_logprobs, handle.num_cached_tokens)
        return queue

    async def _fall_back(self, handle: KVHandle, prompt_token_ids: list[int], params: SamplingParams,
                         lost: ContextUnavailable) -> asyncio.Queue[RequestUpdate]:
        """Prefill here, keeping the context side's k outputs (the handoff is already undone)."""
        rid, agent = handle.request_id, handle.context_agent
        log.warning("request %s: context side %s unavailable (%s); prefilling here", rid, agent, lost)
        self.num_transfer_fallbacks += 1
        if not lost.is_answering and not self._is_reading_from(agent):
            self.peers.forget(agent)
        queue = self.loop.watch(rid)
        try:
            await self.loop.compile_grammar(params)
            await self.loop.call(self.engine.resume, rid, prompt_token_ids, handle.output_token_ids, params,
                                 handle.output_logprobs)
        except BaseException:
            self.loop.unwatch(rid)
            await asyncio.shield(self.loop.call(self.engine.abort, rid))
            raise
        return queue

    async def generate_local(self, request_id: str, prompt_token_ids: list[int],
                             params: SamplingParams) -> AsyncIterator[RequestUpdate]:
        """Prefill and decode here, no context hop and no transfer (conditional disaggregation:
        the ingress sends a prompt whose uncached part is short). The engine admits it at its
        own prefix-cache hit and computes the rest, as an aggregated worker would."""
        async for update in self.loop.generate(request_id, prompt_token_ids, params):
            yield update

    async def receive_kv(self, handle: KVHandle, prompt_token_ids: list[int] | None = None) -> ReadStats:
        """The handoff without decoding (tests, benchmarks): the pages stay bound, ``abort`` frees them.

        With ``prompt_token_ids``, blocks our cache holds are reused as ``generate`` reuses them;
        without (a benchmark's synthetic pages), the whole slice is pulled.
        """
        if prompt_token_ids is None:
            prompt_token_ids = _matching_nothing(handle.prompt_len)
        async with self._handoff(handle) as handoff:
            return await self._transfer(handoff, handle, prompt_token_ids)

    async def abort(self, request_id: str) -> bool:
        """A request in handoff is cancelled (its cleanup frees the pages once no read is in flight)."""
        handoff = self._handoffs.get(request_id)
        if handoff is None:
            return await super().abort(request_id)
        handoff.task.cancel()
        await handoff.over.wait()
        return True

    @contextlib.asynccontextmanager
    async def _handoff(self, handle: KVHandle) -> AsyncIterator[Handoff]:
        """The one cleanup of a handoff, shielded so a second cancel cannot skip it."""
        rid = handle.request_id
        if rid in self._handoffs:
            raise TransferFailed(f"request {rid!r} is already being received")
        handoff = self._handoffs[rid] = Handoff(asyncio.current_task(), handle.context_agent)
        try:
            yield handoff
        except BaseException:
            await asyncio.shield(self._undo(handoff, handle))
            raise
        self._end(rid)

    async def _undo(self, handoff: Handoff, handle: KVHandle) -> None:
        try:
            if handoff.read is not None:
                await asyncio.wait([handoff.read])  # our pages stay bound until the read is over
            self.loop.unwatch(handle.request_id)
            await self.loop.call(self.engine.abort, handle.request_id)
            self._release_context(handle)
        finally:
            self._end(handle.request_id)

    def _end(self, request_id: str) -> None:
        self._handoffs.pop(request_id).over.set()

    async def _transfer(self, handoff: Handoff, handle: KVHandle, prompt_token_ids: list[int]) -> ReadStats:
        """reserve ─► claim ─► pull ─► release."""
        if len(prompt_token_ids) != handle.prompt_len:
            raise TransferFailed(f"request {handle.request_id!r}: handle says {handle.prompt_len} prompt tokens, "
                                 f"got {len(prompt_token_ids)}")
        await self.loop.call(self.engine.check_prompt, handle.prompt_len)
        await self._reserve(handle, kv_token_ids(prompt_token_ids, handle.output_token_ids))
        await self._claim(handle)
        stats = await self._pull(handoff, handle)
        self._release_context(handle)
        return stats

    async def _claim(self, handle: KVHandle) -> None:
        """Hold the context lease for the pull, over a connection to the peer's current record
        (one Ray KV read per request: a replacement that re-published its name is reconnected).
        A dead peer delays this by at most ``claim_timeout_s``."""
        rid, agent = handle.request_id, handle.context_agent
        try:
            record = await asyncio.to_thread(lookup, agent)
            if not self._is_reading_from(agent):
                self.peers.ensure_current(agent, record)
            await self.control.ask(agent, Claim(rid), timeout_s=self.config.claim_timeout_s)
        except (PeerNotFoundError, PeerUnreachable, ControlTimeout) as e:
            raise ContextUnavailable(f"claim of {rid!r} on {agent}: {e}", is_answering=False) from e
        except ControlError as e:
            raise ContextUnavailable(f"claim of {rid!r} refused by {agent}: {e}", is_answering=True) from e

    def _is_reading_from(self, agent: str) -> bool:
        """A read from ``agent`` is in flight: its connection must not change (nor be dropped) under it."""
        return any(h.context_agent == agent and h.read is not None and not h.read.done()
                   for h in self._handoffs.values())

    def _release_context(self, handle: KVHandle) -> None:
        try:
            self.control.tell(handle.context_agent, Release(handle.request_id))
        except Exception:
            pass  # the context worker is gone; its pages went with it

    async def _reserve(self, handle: KVHandle, kv_token_ids: list[int]) -> None:
        """Bind pages for the tokens whose KV travels, cached blocks from our cache; while the
        cache is full, extend the context lease and wait. An extension that finds the context
        side gone raises ContextUnavailable (the request is prefilled here)."""
        deadline = time.monotonic() + self.config.reserve_timeout_s
        while not await self.loop.call(self.engine.reserve_prefilled, handle.request_id, kv_token_ids):
            if time.monotonic() > deadline:
                raise TransferFailed(f"no free KV pages for request {handle.request_id!r} "
                                     f"within {self.config.reserve_timeout_s}s")
            try:
                self.control.tell(handle.context_agent, Extend(handle.request_id, self.config.lease_s))
            except (PeerNotFoundError, PeerUnreachable) as e:  # it died while we waited: prefill here instead
                raise ContextUnavailable(f"lease extension of {handle.request_id!r} on {handle.context_agent}: {e}",
                                         is_answering=False) from e
            await asyncio.sleep(0.05)

    def _plan(self, handle: KVHandle) -> tuple[list[PageRun], int]:
        """Coalesced runs of the slice ordinals we lack, and their bytes."""
        manager, rid = self.engine.manager, handle.request_id
        runs, num_bytes = [], 0
        for group in manager.spec.groups:
            pairs = plan_pull(handle.block_ordinals[group.name], manager.get_block_ordinals(rid, group.name),
                              manager.get_cached_ordinals(rid, group.name), handle.num_kv_tokens, group.window,
                              manager.spec.tokens_per_block)
            runs += coalesce([(src, dst) for _, src, dst in pairs], group.name)
            num_bytes += len(pairs) * manager.storage.page_nbytes(group.name)
        return runs, num_bytes

    async def _pull(self, handoff: Handoff, handle: KVHandle) -> ReadStats:
        runs, num_bytes = await self.loop.call(self._plan, handle)
        agent = handle.context_agent
        try:
            self.peers.ensure_connected(agent)  # on this loop, not in the read's thread: connections change here only
            handoff.read = asyncio.ensure_future(asyncio.to_thread(self._read, agent, runs))
            stats = await asyncio.shield(handoff.read)  # a cancel leaves the read running; _undo waits for it
        except (PeerNotFoundError, PeerUnreachable) as e:
            raise ContextUnavailable(f"pull of {handle.request_id!r} from {agent}: {e}", is_answering=False) from e
        if stats.num_bytes != num_bytes:
            raise TransferFailed(f"request {handle.request_id!r}: moved {stats.num_bytes} bytes, "
                                 f"the slice has {num_bytes}")
        return stats

    def _read(self, peer: str, runs: list[PageRun]) -> ReadStats:
        """In a worker thread; the connection it uses was made on the event loop (``_pull``)."""
        return self.transport.read(peer, runs, self.config.transfer_timeout_s)

    async def stats(self) -> dict:
        total = self.transport.total
        return {**await super().stats(), "kv_transfers": total.num_reads,
                "kv_transfer_bytes": total.num_bytes, "kv_transfer_seconds": total.seconds,
                "num_transfer_fallbacks": self.num_transfer_fallbacks}

    async def block_ordinals(self, request_id: str) -> dict[str, list[int]]:
        manager = self.engine.manager
        groups = manager.spec.groups
        return await self.loop.call(lambda: {g.name: manager.get_block_ordinals(request_id, g.name) for g in groups})


def _matching_nothing(prompt_len: int) -> list[int]:
    """Stand-in token ids for a prompt whose tokens are unknown: no prompt has a negative id,
    so no cached block's name matches them and nothing is reused."""
    return [-1] * prompt_len
