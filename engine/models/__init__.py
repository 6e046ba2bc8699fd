"""Model registry: Hugging Face architecture name -> our paged implementation.

``build_model(hf_config)`` returns a module whose parameter names equal
``transformers``' state-dict names, so a ``save_pretrained`` checkpoint loads
with ``model.load_state_dict(safetensors_state_dict)``.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.decoder import DecoderForCausalLM
from engine.models.gpt_oss import GptOssForCausalLM
from engine.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM

MODEL_REGISTRY: dict[str, type[DecoderForCausalLM]] = {
    "GptOssForCausalLM": GptOssForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}


def architecture(hf_config) -> str:
    names = getattr(hf_config, "architectures", None) or []
    if len(names) != 1:
        raise ValueError(f"config must name exactly one architecture, got {names}; supported: {sorted(MODEL_REGISTRY)}")
    return names[0]


def build_model(hf_config, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> nn.Module:
    """Instantiate (uninitialised weights) the model for ``hf_config.architectures[0]`` in eval mode."""
    name = architecture(hf_config)
    if name not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {name!r}; supported: {sorted(MODEL_REGISTRY)}")
    model_cls = MODEL_REGISTRY[name]
    with torch.device(device):
        model = model_cls(hf_config)
    _cast_parameters(model, dtype, model_cls.keep_in_float32)
    return model.eval().requires_grad_(False)


def _cast_parameters(model: nn.Module, dtype: torch.dtype, keep_in_float32: tuple[str, ...]) -> None:
    """Cast parameters only: buffers such as RoPE inverse frequencies stay float32."""
    for name, param in model.named_parameters():
        keep = any(part in keep_in_float32 for part in name.split(".")[:-1])
        param.data = param.data.to(torch.float32 if keep else dtype)
