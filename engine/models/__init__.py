"""Model registry: Hugging Face architecture name -> our paged implementation.

``build_model(hf_config)`` returns a module whose parameter names equal
``transformers``' state-dict names, so a ``save_pretrained`` checkpoint loads
with ``model.load_state_dict(safetensors_state_dict)``.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.loader import check_architecture
from engine.models.decoder import DecoderForCausalLM
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.gpt_oss import GptOssForCausalLM
from engine.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM

MODEL_REGISTRY: dict[str, type[DecoderForCausalLM]] = {
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}


def build_model(hf_config, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> nn.Module:
    """Instantiate (uninitialised weights) the model for ``hf_config.architectures[0]`` in eval mode.

    Raises ``ModelLoadError`` (a ValueError) unless the config names exactly one registered architecture.
    """
    model_cls = MODEL_REGISTRY[check_architecture(hf_config, MODEL_REGISTRY)]
    with torch.device(device):
        model = model_cls(hf_config)
    _cast_parameters(model, dtype, model_cls.keep_in_float32)
    return model.eval().requires_grad_(False)


def _cast_parameters(model: nn.Module, dtype: torch.dtype, keep_in_float32: tuple[str, ...]) -> None:
    """Cast parameters only: buffers such as RoPE inverse frequencies stay float32."""
    for name, param in model.named_parameters():
        keep = any(part in keep_in_float32 for part in name.split(".")[:-1])
        param.data = param.data.to(torch.float32 if keep else dtype)
