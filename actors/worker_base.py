"""What every worker has: an engine driven by an EngineLoop; KV workers add a transport.

    EngineWorker            engine + loop, abort, stats, integrity checks
      ├── AggregatedWorker
      └── KVWorker          + transport (pages registered once), peer directory, control channel
            ├── ContextWorker
            └── GenerationWorker
"""

from __future__ import annotations

import torch

from actors.compat import compat_descriptor
from actors.config import WorkerConfig
from actors.control import ControlChannel
from actors.engine_loop import EngineLoop
from actors.peers import PeerDirectory
from actors.transport import make_transport, unique_agent_name
from engine import LLMEngine


class EngineWorker:
    role = "both"

    def __init__(self, config: WorkerConfig | None = None) -> None:
        self.config = config or WorkerConfig()
        torch.set_num_threads(self.config.torch_threads)
        self.engine = LLMEngine(self.config, role=self.role)
        self.loop = EngineLoop(self.engine)

    async def abort(self, request_id: str) -> bool:
        """Stop the request wherever it is; its pages are freed."""
        return await self.loop.abort(request_id)

    async def stats(self) -> dict:
        stats = await self.loop.call(self.engine.stats)
        return {"role": self.role, **stats}

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
        self.peers.publish()
        self.control = ControlChannel(self.transport, self.peers)

    @property
    def agent_name(self) -> str:
        return self.transport.agent_name

    async def stats(self) -> dict:
        return {**await super().stats(), "agent": self.agent_name}
