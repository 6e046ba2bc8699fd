"""Llama, Mistral and Qwen2: one dense decoder, differing only in biases and windows.

| architecture | q/k/v bias       | o bias           | MLP bias     | window (see engine.layout)         |
| ------------ | ---------------- | ---------------- | ------------ | ---------------------------------- |
| Llama        | attention_bias   | attention_bias   | mlp_bias     | none                               |
| Mistral      | no               | no               | no           | sliding_window on every layer      |
| Qwen2        | yes              | no               | no           | layer_types (use_sliding_window,   |
|              |                  |                  |              | max_window_layers)                 |
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.decoder import AttentionOptions, DecoderForCausalLM
from engine.models.packed import linear
from engine.models.quantized import QuantizedWeight


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# transformers' names (ACT2FN) of the gate activations supported: Llama's SiLU, Gemma's tanh GELU
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": _gelu_tanh}


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``; gate and up in one matmul once ``fuse_gate_up`` found them both
    GGUF blocks of one format (engine.models.quantized)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, hidden_act: str) -> None:
        super().__init__()
        if hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; supported: {sorted(ACTIVATIONS)}")
        self.act_fn = ACTIVATIONS[hidden_act]
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.gate_up: tuple[QuantizedWeight, torch.Tensor | None] | None = None

    def fuse_gate_up(self) -> None:
        """Quantized gate and up weights as one weight [2I, in] (one kernel call and one fork of the
        threads instead of two a decode step's layer); gate_proj / up_proj keep views of its rows."""
        gate, up = self.gate_proj.weight, self.up_proj.weight
        if not (isinstance(gate, QuantizedWeight) and isinstance(up, QuantizedWeight) and gate.kind == up.kind):
            return
        weight = QuantizedWeight.cat([gate, up])
        self.gate_proj.weight, self.up_proj.weight = weight.split([gate.shape[0], up.shape[0]])
        bias = None
        if self.gate_proj.bias is not None:
            bias = torch.cat([self.gate_proj.bias.detach(), self.up_proj.bias.detach()])
        self.gate_up = (weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        rows = x.reshape(-1, x.shape[-1])
        gate, up = linear(rows, *self.gate_up, None).chunk(2, dim=-1)
        return self.down_proj((self.act_fn(gate) * up).view(*x.shape[:-1], -1))


class LlamaForCausalLM(DecoderForCausalLM):
    def attention_options(self, hf_config) -> AttentionOptions:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias)

    def mlp_bias(self, hf_config) -> bool:
        return bool(getattr(hf_config, "mlp_bias", False))

    def make_mlp(self, hf_config) -> nn.Module:
        return GatedMLP(hf_config.hidden_size, hf_config.intermediate_size, self.mlp_bias(hf_config),
                        getattr(hf_config, "hidden_act", "silu"))


class MistralForCausalLM(LlamaForCausalLM):
    def attention_options(self, hf_config) -> AttentionOptions:
        return AttentionOptions()

    def mlp_bias(self, hf_config) -> bool:
        return False


class Qwen2ForCausalLM(LlamaForCausalLM):
    def attention_options(self, hf_config) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True)

    def mlp_bias(self, hf_config) -> bool:
        return False
