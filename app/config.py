"""The serving application's configuration: the ``args:`` of a Serve config, validated.

    configs/*.yaml  applications[].args ──► AppConfig ──► WorkerConfig (actors)
                                                     └──► EngineConfig (engine)

Deployment placement (replicas, resources, autoscaling) is not here: Serve's
own ``deployments:`` list overrides it by deployment name.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from actors.config import WorkerConfig
from engine.config import EngineConfig, max_model_len

API_KEY_ENV = "WINDSERVE_API_KEY"


class AppConfig(BaseModel):
    """One windserve application. Unknown fields are errors, not ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["disagg", "aggregated"] = "disagg"
    model: str = Field("windserve-tiny", min_length=1)
    # engine.EngineConfig fields
    tokens_per_block: int = Field(16, ge=1)
    num_pages: int = Field(512, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(1024, ge=1)
    max_model_len: int | None = Field(None, ge=2)
    max_draft_len: int = Field(0, ge=0)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "auto"
    # actors.config.WorkerConfig fields
    transport: Literal["nixl", "local"] = "nixl"
    lease_s: float = Field(30.0, gt=0)
    # HTTP layer
    api_key: str | None = None
    max_queue: int | None = Field(None, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _api_key_from_env(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("api_key") is None and os.environ.get(API_KEY_ENV):
            return {**data, "api_key": os.environ[API_KEY_ENV]}
        return data

    @model_validator(mode="after")
    def _check(self) -> AppConfig:
        if self.mode == "disagg" and self.transport != "nixl":
            raise ValueError("mode 'disagg' moves KV between processes and needs transport 'nixl' "
                             f"('{self.transport}' works within one process only)")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be non-empty (leave it unset to turn the check off)")
        self.to_worker_config()  # EngineConfig's own checks (e.g. device) as validation errors
        return self

    def to_engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model, tokens_per_block=self.tokens_per_block, num_pages=self.num_pages,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len, max_draft_len=self.max_draft_len,
            dtype=self.dtype, device=self.device,
        )

    def to_worker_config(self) -> WorkerConfig:
        return WorkerConfig(engine=self.to_engine_config(), transport=self.transport, lease_s=self.lease_s)

    def serving_max_model_len(self, model_path: str) -> int:
        """The longest prompt + output the workers accept (``engine.config.max_model_len``)."""
        from transformers import AutoConfig

        positions = AutoConfig.from_pretrained(model_path, local_files_only=True).max_position_embeddings
        return max_model_len(self.to_engine_config(), positions, draft_len=self.max_draft_len)
