"""Everything an engine loads once: the model on its device, its tokenizer and KV geometry."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig, resolve_device
from engine.layout import kv_cache_spec
from engine.loader import load_config, load_model
from engine.tiny import resolve_model_path
from engine.tokenizer import Tokenizer
from kvcache import KVCacheSpec


@dataclass
class WorkerModel:
    name: str
    path: str
    module: torch.nn.Module
    tokenizer: Tokenizer
    kv_spec: KVCacheSpec
    device: str
    model_max_len: int
    cache_max_len: int

    @classmethod
    def load(cls, config: EngineConfig) -> "WorkerModel":
        path = resolve_model_path(config.model)
        device = resolve_device(config.device)
        hf_config = load_config(path)
        module = load_model(path, dtype=config.torch_dtype, device=device)
        spec = kv_cache_spec(hf_config, config.tokens_per_block, config.torch_dtype)
        model_max = getattr(hf_config, "max_position_embeddings", None) or 4096
        if config.max_model_len is not None:
            model_max = min(model_max, config.max_model_len)
        # A request alone must always fit the cache, so preemption always makes progress.
        reserve = config.max_draft_len + 1
        cache_max = config.num_pages * config.tokens_per_block - reserve
        return cls(config.model, path, module, Tokenizer(path), spec, device, model_max, cache_max)

    @property
    def max_model_len(self) -> int:
        return min(self.model_max_len, self.cache_max_len)
