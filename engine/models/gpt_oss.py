"""GPT-OSS: alternating sliding/full attention with learned sinks, YaRN RoPE, and a top-k MoE.

The expert MLP is the clamped SwiGLU of ``transformers``' ``GptOssExperts``, with
gate and up *interleaved* in ``gate_up_proj`` (gate = even columns, up = odd)::

    gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
    gate     = min(gate, limit)
    up       = clamp(up, -limit, limit)
    out      = (up + 1) * gate * sigmoid(alpha * gate)

Routing: ``topk`` of ``router(x)`` logits, softmax over the k chosen logits only.
Tokens are sorted by expert (one matmul pair per expert that received any token; the
elementwise activation and the routing weights run once over all of them).
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

    def _grouped_addmm(self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                       counts: list[int]) -> torch.Tensor:
        """``rows`` sorted by expert, ``counts[e]`` rows each: one addmm per active expert, concatenated.

        (torch._grouped_mm computes the same on the CPU but measured no faster than this loop.)
        """
        outputs, start = [], 0
        for expert, count in enumerate(counts):
            if count:
                outputs.append(torch.addmm(bias[expert], rows[start : start + count], weight[expert]))
                start += count
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]

    def _activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate = gate_up[:, 0::2].clamp(max=self.limit)
        up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, H]; experts / weights [N, k] -> sum over k of weight * expert(x), [N, H].

        The N*k (token, choice) pairs are sorted by expert, so each expert's rows are one slice::

            sorted row   0 1 2 | 3 4 | 5 ...      counts = [3, 2, ...] (one host sync per layer)
            expert         0   |  1  |  2
            token        order[row] // k

        Two matmuls per active expert; the activation and the routing weights run once over all rows.
        """
        flat_experts = experts.flatten()
        order = flat_experts.argsort(stable=True)
        counts = torch.bincount(flat_experts, minlength=self.gate_up_proj.shape[0]).tolist()
        routed = x[order // experts.shape[1]]
        hidden = self._activation(self._grouped_addmm(routed, self.gate_up_proj, self.gate_up_proj_bias, counts))
        down = self._grouped_addmm(hidden, self.down_proj, self.down_proj_bias, counts)
        weighted = down * weights.flatten()[order, None]
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
