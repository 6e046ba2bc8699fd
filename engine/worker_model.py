"""What an engine loads once: the model on its device, its tokenizer and config."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.config import EngineConfig, resolve_device
from engine.loader import load_config, load_model
from engine.model_registry import gguf_source, resolve_model_path
from engine.models.quantized import kernels_available
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


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
        module = load_model(path, dtype=config.torch_dtype, device=device, gguf_path=quantized_source(config),
                            prefill_dtype=config.prefill_torch_dtype)
        return cls(config.model, path, module, Tokenizer(path), load_config(path), device, config.torch_dtype)

    @property
    def max_position_embeddings(self) -> int:
        return getattr(self.hf_config, "max_position_embeddings", None) or 4096


def quantized_source(config: EngineConfig) -> str | None:
    """The GGUF file whose quantized weights the engine keeps in their blocks, or None: ``quantization``
    ``"auto"``, a GGUF model, float32 on the CPU and the native kernels built (else dequantized, logged)."""
    source = gguf_source(config.model)
    if source is None or config.quantization == "none":
        return None
    if resolve_device(config.device) != "cpu" or config.torch_dtype != torch.float32 or not kernels_available():
        logger.info("%s: quantized weights need float32 on the CPU and the native kernels; dequantizing them",
                    config.model)
        return None
    return source

