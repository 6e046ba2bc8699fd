"""Worker configuration: the engine's, plus transport and lease settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine import EngineConfig

TRANSPORTS = ("nixl", "local")


@dataclass(frozen=True)
class WorkerConfig:
    """``lease_s``: how long a context worker holds prefilled pages for a transfer.
    ``claim_s``: how long a claimed (in-transfer) lease may last.
    ``reserve_timeout_s``: how long a generation worker waits for free pages,
    extending the context side's lease meanwhile, before failing the request."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    transport: str = "nixl"
    lease_s: float = 30.0
    claim_s: float = 60.0
    transfer_timeout_s: float = 30.0
    reserve_timeout_s: float = 20.0
    torch_threads: int = 1

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        for name in ("lease_s", "claim_s", "transfer_timeout_s", "reserve_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
