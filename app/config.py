"""The serving application's configuration: the ``args:`` of a Serve config, validated.

    configs/*.yaml  applications[].args ──► AppConfig ──► to_worker_config() ──► the workers
                                            (a WorkerConfig, an EngineConfig: engine.config)

``AppConfig`` extends ``WorkerConfig`` with the HTTP layer's fields, so every
engine and worker knob is settable from the YAML and declared once. pydantic
validates the dataclass chain: types are checked (``"16"`` becomes 16,
``"sixteen"`` is an error), unknown fields are errors, and the dataclasses'
own checks (``__post_init__``) come back as a ``ValidationError``.

Deployment placement (replicas, resources, autoscaling) is not here: Serve's
own ``deployments:`` list overrides it by deployment name.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Literal

from pydantic import ConfigDict, Field, TypeAdapter, field_validator
from pydantic.dataclasses import dataclass

from actors.config import WorkerConfig
from engine.config import EVICTION_POLICIES, check_at_least, max_model_len
from engine.model_registry import short_model_name

API_KEY_ENV = "WINDSERVE_API_KEY"
ROLE_PAGES = {"context": "context_num_pages", "generation": "generation_num_pages"}
ROLE_EVICTION = {"context": "context_eviction", "generation": "generation_eviction"}
# A generation replica's cache sees the same slices come back in cycles (keep-hot resists them);
# a context replica's sees every new prompt first (plain LRU).
ROLE_EVICTION_DEFAULT = {"context": "lru", "generation": "keep-hot"}


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class AppConfig(WorkerConfig):
    """One windserve application: a WorkerConfig plus what the HTTP layer needs.

    ``mode``: ``"disagg"`` (context and generation workers, KV moved between them) or
    ``"aggregated"`` (one worker type does both phases).
    ``api_key``: required as ``Authorization: Bearer`` on every ``/v1`` route;
    when unset (or None), read from $WINDSERVE_API_KEY. ``max_queue``: at most
    this many generation requests in flight per ingress replica (app.middleware);
    None admits everything. ``served_model_name`` (vLLM's name for it): the model
    id that ``/v1/models`` lists and requests name; None: the model's short name
    (``served_model`` below). ``local_prefill_max_tokens`` (disagg): a prompt
    whose uncached part (its length less the best generation-side cache hit the
    ingress estimates) is at most this many tokens is prefilled by a generation
    worker itself, with no context hop and no transfer; 0 never does (app.placement).
    ``context_num_pages`` / ``generation_num_pages`` (disagg): pages per layer group of each
    context / generation worker, sized apart (a context worker holds prompts until their
    transfer; a generation worker holds the windowed slices it decodes from and keeps the hot
    ones cached); None: ``num_pages``. ``context_eviction`` / ``generation_eviction`` (disagg):
    each role's cache eviction (kvcache.pool: ``"lru"`` or ``"keep-hot"``); None: the role's
    default, ``"lru"`` for context, ``"keep-hot"`` for generation. ``eviction`` is the
    aggregated worker's. ``handle_transport``: how the ingress's calls to the workers and
    their token streams travel: ``"grpc"``, one gRPC stream per call between the replicas
    (Serve's ``_by_reference=False``); ``"ray"``, Ray actor calls with one Ray object per
    streamed update (Serve's default; ~1.6x the CPU per token on the ingress, docs/benchmarks.md).
    ``engine_in_ingress`` (aggregated only): the ingress replica runs the engine itself, so a
    token reaches the HTTP response with no Serve hop from a worker replica (app.local_backend);
    scale it with the ingress's ``num_replicas`` (Serve's proxy spreads requests over them, with
    no KV-aware placement). ``ttft_slo_s`` / ``tpot_slo_s``: the latency targets a request is counted
    against in the ingress's windowed stats for the P:D planner (app.planner_stats: requests that met
    both); give them the planner's own values (configs/autoscale.yaml's policy_kwargs).
    """

    mode: Literal["disagg", "aggregated"] = "disagg"
    api_key: str | None = Field(None, validate_default=True)
    max_queue: int | None = None
    served_model_name: str | None = None
    local_prefill_max_tokens: int = 0
    context_num_pages: int | None = None
    generation_num_pages: int | None = None
    context_eviction: str | None = None
    generation_eviction: str | None = None
    handle_transport: Literal["grpc", "ray"] = "grpc"
    engine_in_ingress: bool = False
    ttft_slo_s: float = 1.0
    tpot_slo_s: float = 0.05

    @field_validator("api_key", mode="before")
    @classmethod
    def _api_key_from_env(cls, value: object) -> object:
        return (os.environ.get(API_KEY_ENV) or None) if value is None else value

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mode == "disagg" and self.transport != "nixl":
            raise ValueError("mode 'disagg' moves KV between processes and needs transport 'nixl' "
                             f"('{self.transport}' works within one process only)")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be non-empty (leave it unset to turn the check off)")
        if self.max_queue is not None:
            check_at_least(self, ("max_queue",), 0)
        check_at_least(self, ("local_prefill_max_tokens",), 0)
        if not (self.ttft_slo_s > 0 and self.tpot_slo_s > 0):
            raise ValueError("ttft_slo_s and tpot_slo_s must be positive")
        for name in ROLE_PAGES.values():
            if getattr(self, name) is not None:
                if self.mode != "disagg":
                    raise ValueError(f"{name} sizes a disagg role; mode '{self.mode}' takes num_pages only")
                check_at_least(self, (name,), 1)
        self._check_eviction()
        if self.engine_in_ingress and self.mode != "aggregated":
            raise ValueError(f"engine_in_ingress runs one aggregated engine in the ingress; mode '{self.mode}' "
                             "has context and generation workers of its own")
        if self.served_model_name is not None and not self.served_model_name:
            raise ValueError("served_model_name must be non-empty (leave it unset for the model's short name)")

    def _check_eviction(self) -> None:
        if self.mode == "disagg" and self.eviction != "lru":
            raise ValueError("eviction sets an aggregated worker's cache; mode 'disagg' takes "
                             "context_eviction / generation_eviction")
        for name in ROLE_EVICTION.values():
            value = getattr(self, name)
            if value is not None and self.mode != "disagg":
                raise ValueError(f"{name} sets a disagg role's cache; mode '{self.mode}' takes eviction only")
            if value is not None and value not in EVICTION_POLICIES:
                raise ValueError(f"{name} must be one of {list(EVICTION_POLICIES)}, got {value!r}")

    def role_eviction(self, role: str | None) -> str:
        """The eviction of ``role``'s workers: its own field, else its default; ``eviction`` outside a role."""
        if role not in ROLE_EVICTION:
            return self.eviction
        return getattr(self, ROLE_EVICTION[role]) or ROLE_EVICTION_DEFAULT[role]

    @property
    def served_model(self) -> str:
        """What clients call the model: ``served_model_name``, else ``windserve-tiny`` for
        ``model: windserve-tiny`` and ``Qwen2-0.5B`` for ``model: /models/Qwen2-0.5B/``."""
        return self.served_model_name or short_model_name(self.model)

    @classmethod
    def model_validate(cls, args: dict[str, Any] | None) -> AppConfig:
        """The config of a Serve config's ``args:`` (``pydantic.ValidationError`` if invalid)."""
        return _ADAPTER.validate_python(args or {})

    def to_worker_config(self, role: str | None = None) -> WorkerConfig:
        """The workers' part: a plain WorkerConfig (the API key stays with the ingress); for ``role``
        ("context", "generation") with that role's ``num_pages`` and ``eviction``."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(WorkerConfig)}
        role_pages = getattr(self, ROLE_PAGES[role]) if role in ROLE_PAGES else None
        role_fields = {"num_pages": role_pages or self.num_pages, "eviction": self.role_eviction(role)}
        return WorkerConfig(**(fields | role_fields))

    def serving_max_model_len(self, model_path: str) -> int:
        """The longest prompt + output the workers accept (``engine.config.max_model_len``)."""
        from transformers import AutoConfig

        positions = AutoConfig.from_pretrained(model_path, local_files_only=True).max_position_embeddings
        roles = list(ROLE_PAGES) if self.mode == "disagg" else [None]
        return min(max_model_len(self.to_worker_config(role), positions, draft_len=self.max_draft_len,
                                 num_extra_kv_tokens=self.num_extra_kv_tokens) for role in roles)


_ADAPTER = TypeAdapter(AppConfig)
