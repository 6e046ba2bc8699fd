"""Worker configuration: an EngineConfig plus transport, lease and timeout settings.

``WorkerConfig`` IS an ``EngineConfig`` (flat inheritance, each field declared
once; see engine.config), so a worker hands its config to ``LLMEngine`` as is.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig, check_at_least

TRANSPORTS = ("nixl", "local")


@dataclass(frozen=True)
class WorkerConfig(EngineConfig):
    """``transport``: how KV pages move between workers: ``"nixl"`` (NIXL over UCX, between
    processes and machines) or ``"local"`` (within one process; the unit tests').
    ``lease_s``: how long a context worker holds prefilled pages for a transfer.
    ``claim_s``: how long a claimed (in-transfer) lease may last.
    ``claim_timeout_s``: how long a generation worker waits for the context side to
    answer a Claim. A live context worker answers in milliseconds (its control
    loop polls every 1 ms, off the engine's step thread); no answer means it is
    gone, and the request falls back to a local prefill, so this bounds the delay
    a dead context side adds before the request's KV is computed here.
    ``transfer_timeout_s``: how long a generation worker waits for a KV read
    (a read from a peer that died under it ends sooner, with NIXL's error).
    ``reserve_timeout_s``: how long a generation worker waits for
    free pages, extending the context side's lease meanwhile, before failing the
    request. ``torch_threads``: torch's intra-op threads in the worker's process
    (None: the CPUs Ray assigned the worker, ``num_cpus`` in its actor options; 1 outside Ray)."""

    transport: str = "nixl"
    lease_s: float = 30.0
    claim_s: float = 60.0
    claim_timeout_s: float = 5.0
    transfer_timeout_s: float = 30.0
    reserve_timeout_s: float = 20.0
    torch_threads: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        for name in ("lease_s", "claim_s", "claim_timeout_s", "transfer_timeout_s", "reserve_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be greater than 0, got {getattr(self, name)}")
        if self.torch_threads is not None:
            check_at_least(self, ("torch_threads",), 1)
