"""What every worker has: an engine driven by an EngineLoop; KV workers add a transport.

    EngineWorker            engine + loop, abort, stats, integrity checks
      ├── AggregatedWorker
      └── KVWorker          + transport (pages registered once), peer directory, control channel
            ├── ContextWorker
            └── GenerationWorker

Lifecycle: whoever creates a worker awaits ``start()`` once, on the event
loop that will serve it (the Serve replica's async ``__init__``, or a test's
Ray actor right after creation), and ``shutdown()`` when done with it::

               EngineWorker      KVWorker                                        ContextWorker
    start      the engine loop   + publish, control channel                      + lease reaper
    shutdown   (nothing)         - control channel, unpublish, close transport   - reaper
"""

from __future__ import annotations

import asyncio

import torch

from actors.compat import compat_descriptor
from actors.config import WorkerConfig
from actors.control import ControlChannel
from actors.engine_loop import EngineLoop
from actors.peers import PeerDirectory
from actors.transport import make_transport, unique_agent_name
from engine import LLMEngine
from engine.reports import summarize_cache


def resolve_torch_threads(configured: int | None) -> int:
    """``configured``, else the whole CPUs Ray assigned this actor (``num_cpus``), at least 1.

    Outside Ray, or with ``num_cpus: 0`` (the actor reserved nothing), one thread: more
    threads than reserved cores would contend with whatever else Ray puts on the node.
    """
    if configured is not None:
        return configured
    try:
        import ray

        if not ray.is_initialized():
            return 1
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 0)
    except Exception:  # not in a Ray worker (a unit test, a script)
        return 1
    return max(1, int(cpus))


class EngineWorker:
    role = "both"

    def __init__(self, config: WorkerConfig | None = None) -> None:
        self.config = config or WorkerConfig()
        torch.set_num_threads(resolve_torch_threads(self.config.torch_threads))
        self.engine = LLMEngine(self.config, role=self.role)
        self.loop = EngineLoop(self.engine)

    async def start(self) -> None:
        """Start stepping the engine (on the engine loop's own thread, updates to this event loop)."""
        self.loop.start()

    async def shutdown(self) -> None:
        """Nothing to give back here: the engine loop holds only this process's memory."""

    async def abort(self, request_id: str) -> bool:
        """Stop the request wherever it is; its pages are freed."""
        return await self.loop.abort(request_id)

    async def stats(self) -> dict:
        stats = await self.loop.call(self.engine.stats)
        return {"role": self.role, **stats}

    async def routing_stats(self) -> dict:
        """What a KV-aware router weighs (``LLMEngine.routing_stats``)."""
        stats = await self.loop.call(self.engine.routing_stats)  # names copied on the step thread, between steps
        return await asyncio.to_thread(summarize_cache, stats)  # the filter built outside it

    async def check_integrity(self) -> None:
        await self.loop.call(self.engine.manager.check_integrity)

    async def read_pages(self, group: str, pages: list[int]) -> torch.Tensor:
        """A copy of some pages (tests compare them with what a transfer landed)."""
        return await self.loop.call(lambda: self.engine.manager.storage.tensors[group][pages].clone())


class KVWorker(EngineWorker):
    def __init__(self, config: WorkerConfig | None = None) -> None:
        super().__init__(config)
        self.transport = make_transport(self.config.transport, unique_agent_name(self.role))
        self.transport.register(self.engine.manager.storage.tensors)
        self.peers = PeerDirectory(self.transport, compat_descriptor(self.engine))
        self.control = ControlChannel(self.transport, self.peers)

    async def start(self) -> None:
        """Also publish our transport and answer control messages.

        Publishing here, not at construction, keeps a peer from finding a
        worker that could not yet answer its claim.
        """
        await super().start()
        self.peers.publish()
        self.control.start()

    async def shutdown(self) -> None:
        """Stop answering, unpublish (no peer finds a stale record), close the transport.

        Call it once no transfer of ours is in flight (Serve drains a
        replica's requests before its ``__del__``): closing deregisters the
        page memory a read would land in.
        """
        await self.control.stop()
        self.peers.unpublish()
        self.transport.close()
        await super().shutdown()

    @property
    def agent_name(self) -> str:
        return self.transport.agent_name

    async def stats(self) -> dict:
        return {**await super().stats(), "agent": self.agent_name}
