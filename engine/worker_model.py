"""What an engine loads once: the model on its device, its tokenizer and config."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig, resolve_device
from engine.loader import load_config, load_model
from engine.model_registry import resolve_model_path
from engine.tokenizer import Tokenizer


@dataclass
class WorkerModel:
    """Loaded weights, tokenizer and HF config; engines of any page geometry can share one."""

    name: str
    path: str
    module: torch.nn.Module
    tokenizer: Tokenizer
    hf_config: object
    device: str
    dtype: torch.dtype

    @classmethod
    def load(cls, config: EngineConfig) -> WorkerModel:
        path = resolve_model_path(config.model)
        device = resolve_device(config.device)
        module = load_model(path, dtype=config.torch_dtype, device=device)
        return cls(config.model, path, module, Tokenizer(path), load_config(path), device, config.torch_dtype)

    @property
    def max_position_embeddings(self) -> int:
        return getattr(self.hf_config, "max_position_embeddings", None) or 4096
