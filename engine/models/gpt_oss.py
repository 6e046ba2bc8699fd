"""GPT-OSS: alternating sliding/full attention with learned sinks, YaRN RoPE, and a top-k MoE.

The expert MLP is the clamped SwiGLU of ``transformers``' ``GptOssExperts``, with
gate and up *interleaved* in ``gate_up_proj`` (gate = even columns, up = odd)::

    gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
    gate     = min(gate, limit)
    up       = clamp(up, -limit, limit)
    out      = (up + 1) * gate * sigmoid(alpha * gate)

Routing: ``topk`` of ``router(x)`` logits, softmax over the k chosen logits only.
Tokens are grouped per expert (one matmul pair per expert that received any token).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.decoder import AttentionOptions, DecoderForCausalLM


class TopKRouter(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ids [N, k] and their weights [N, k]."""
        top_logits, experts = F.linear(x, self.weight, self.bias).topk(self.top_k, dim=-1)
        return experts, top_logits.softmax(dim=-1)


class Experts(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, alpha: float, limit: float):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, hidden_size, 2 * intermediate_size))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, intermediate_size, hidden_size))
        self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.alpha = alpha
        self.limit = limit

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = torch.addmm(self.gate_up_proj_bias[expert], x, self.gate_up_proj[expert])
        gate = gate_up[:, 0::2].clamp(max=self.limit)
        up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)
        return torch.addmm(self.down_proj_bias[expert], (up + 1) * gate * torch.sigmoid(gate * self.alpha),
                           self.down_proj[expert])

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, H]; experts / weights [N, k] -> sum over k of weight * expert(x), [N, H]."""
        flat_experts = experts.flatten()
        order = flat_experts.argsort(stable=True)
        counts = torch.bincount(flat_experts, minlength=self.gate_up_proj.shape[0]).tolist()
        token_rows = order // experts.shape[1]
        routed = x[token_rows]
        outputs, start = [], 0
        for expert, count in enumerate(counts):
            if count:
                outputs.append(self._expert(expert, routed[start : start + count]))
                start += count
        weighted = torch.cat(outputs) * weights.flatten()[order, None]
        # Back to (token, choice) order and a plain sum over the k choices: deterministic, unlike index_add_ on GPU.
        per_choice = torch.empty_like(weighted).index_copy_(0, order, weighted)
        return per_choice.view(x.shape[0], -1, x.shape[1]).sum(dim=1).to(x.dtype)


class MoeMLP(nn.Module):
    def __init__(self, hf_config) -> None:
        super().__init__()
        hidden, num_experts = hf_config.hidden_size, hf_config.num_local_experts
        self.router = TopKRouter(hidden, num_experts, hf_config.num_experts_per_tok)
        self.experts = Experts(
            hidden,
            hf_config.intermediate_size,
            num_experts,
            alpha=getattr(hf_config, "swiglu_alpha", 1.702),
            limit=getattr(hf_config, "swiglu_limit", 7.0),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.router(x)
        return self.experts(x, experts, weights)


class GptOssForCausalLM(DecoderForCausalLM):
    keep_in_float32 = ("input_layernorm", "post_attention_layernorm", "norm")
    norm_in_float32 = True

    def attention_options(self, hf_config) -> AttentionOptions:
        bias = bool(getattr(hf_config, "attention_bias", True))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, has_sinks=True)

    def make_mlp(self, hf_config) -> nn.Module:
        return MoeMLP(hf_config)
