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
from engine.models.packed import NATIVE_MAX_ROWS, can_pack, gemv_layout, linear, pack
from engine.native import add_weighted_rows_kernel, clamped_swiglu_kernel, moe_experts_kernel, moe_route_kernel

# Rows of one expert chunk: gate_up [256, 2I] of a mid-sized model stays in cache between the
# matmul and the activation (an expert layer of 256 tokens, [512, 1024] experts: 27-29 ms against
# 31-33 ms for one pass over all rows with the earlier, allocating activation).
_CHUNK_ROWS = 256


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
        self.packed: dict[str, list[torch.Tensor]] = {}  # weight name -> per expert (engine.models.packed)

    def pack_weights(self, min_elements: int) -> None:
        """Each expert's two weights, packed for oneDNN (float32 on the CPU only), and stored for the
        one-row matmul (``gemv_layout``: [experts, out, in] in huge pages for engine.native's kernels; without
        them ``down_proj``, narrower out than in, as [experts, out, in] and ``gate_up_proj`` as loaded)."""
        if can_pack(self.gate_up_proj[0], min_elements) and can_pack(self.down_proj[0], min_elements):
            self.packed = {name: [pack(w.t()) for w in getattr(self, name)] for name in ("gate_up_proj", "down_proj")}
            for name in ("gate_up_proj", "down_proj"):
                per_expert = getattr(self, name).detach().transpose(1, 2)  # [experts, out, in]: what a matmul reads
                setattr(self, name, nn.Parameter(gemv_layout(per_expert).transpose(1, 2), requires_grad=False))

    def _matmuls(self, rows: torch.Tensor, name: str, pieces: list[tuple[int, int, int]],
                 offset: int) -> torch.Tensor:
        """Expert ``e``'s ``name`` weight over ``rows[a - offset : b - offset]``, each ``(e, a, b)``; concatenated."""
        weight, bias, packed = getattr(self, name), getattr(self, f"{name}_bias"), self.packed.get(name)
        outputs = [linear(rows[a - offset:b - offset], weight[e].t(), bias[e], packed[e] if packed else None)
                   for e, a, b in pieces]
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]

    def _activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The same operations, in the same order, as transformers: ``glu = gate * sigmoid(gate * alpha)``,
        then ``(up + 1) * glu``. In float32 on the CPU one pass of the native kernel (``engine.native``);
        otherwise the clamps copy the stride-2 halves into contiguous tensors (elementwise ops on stride-2
        views do not vectorise: in place on them measured 2x slower) and the rest runs in place."""
        if gate_up.dtype == torch.float32 and gate_up.device.type == "cpu" and clamped_swiglu_kernel():
            return clamped_swiglu_kernel()(gate_up, self.alpha, self.limit)
        gate = gate_up[:, 0::2].clamp(max=self.limit)
        up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)
        glu = torch.mul(gate, self.alpha).sigmoid_().mul_(gate)
        return glu.mul_(up.add_(1))

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, H]; experts / weights [N, k] -> sum over k of weight * expert(x), [N, H].

        The N*k (token, choice) pairs are sorted by expert, so each expert's rows are one slice::

            sorted row   0 1 2 | 3 4 | 5 ...      counts = [3, 2, ...] (one host sync per layer)
            expert         0   |  1  |  2
            token        order[row] // k

        Experts are taken in chunks of at least ``_CHUNK_ROWS`` rows (a decode step's few rows:
        one chunk; a prefill: about one expert each): two matmuls per expert, the activation once
        per chunk while its rows are still in cache, then the weighted rows: in float32 on the CPU
        added to their tokens by the native kernel (one pass, experts in ascending order); elsewhere
        copied back to (token, choice) order and summed over the choices.
        """
        flat_experts = experts.flatten()
        order = flat_experts.argsort(stable=True)
        counts = torch.bincount(flat_experts, minlength=self.gate_up_proj.shape[0]).tolist()
        tokens, row_weights = order // experts.shape[1], weights.flatten()[order]
        if x.dtype == torch.float32 and x.device.type == "cpu" and add_weighted_rows_kernel():
            return self.forward_sorted(x, tokens, row_weights, counts)
        routed = x.index_select(0, tokens)  # index_select, not x[...]: 6x faster for 256 rows of 512 (generic)
        per_choice = torch.empty_like(routed)  # [N k, H] in (token, choice) order
        for first, last, down in self._chunk_outputs(routed, counts):
            per_choice.index_copy_(0, order[first:last], down.mul_(row_weights[first:last, None]))
        # A plain sum over the k choices: deterministic, unlike index_add_ on GPU.
        return per_choice.view(x.shape[0], -1, x.shape[1]).sum(dim=1).to(x.dtype)

    def forward_sorted(self, x: torch.Tensor, tokens: torch.Tensor, row_weights: torch.Tensor,
                       counts: list[int]) -> torch.Tensor:
        """Float32 on the CPU, the (token, choice) pairs already sorted by expert (``tokens``, ``row_weights``,
        ``counts`` per expert): each weighted row is added to its token by the native kernel (one pass,
        experts in ascending order: transformers' own ``index_add_`` order)."""
        out = x.new_zeros(x.shape)
        for first, last, down in self._chunk_outputs(x.index_select(0, tokens), counts):
            add_weighted_rows_kernel()(out, tokens[first:last], down, row_weights[first:last])
        return out

    def forward_few(self, x: torch.Tensor, tokens: torch.Tensor, row_weights: torch.Tensor,
                    counts: torch.Tensor) -> torch.Tensor | None:
        """``forward_sorted`` for at most ``NATIVE_MAX_ROWS`` tokens (a decode step's) in one native call
        (``moe_experts``: the same kernels in the same order, the same bits), or None where that kernel or
        the weights' [experts, out, in] layout (``pack_weights`` with engine.native built) is missing."""
        kernel = moe_experts_kernel()
        gate_up, down = self.gate_up_proj.transpose(1, 2), self.down_proj.transpose(1, 2)
        if kernel is None or x.shape[0] > NATIVE_MAX_ROWS or not (gate_up.is_contiguous() and down.is_contiguous()):
            return None
        return kernel(x, tokens, row_weights, counts, gate_up, self.gate_up_proj_bias, down, self.down_proj_bias,
                      self.alpha, self.limit)

    def _chunk_outputs(self, routed: torch.Tensor, counts: list[int]):
        """``(first, last, down)`` per chunk of experts: their rows ``routed[first:last]`` through the MLP."""
        for pieces in _chunks(counts):
            first, last = pieces[0][1], pieces[-1][2]
            hidden = self._activation(self._matmuls(routed, "gate_up_proj", pieces, 0))
            yield first, last, self._matmuls(hidden, "down_proj", pieces, first)

    def forward_dense(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, H], weights [N, E] (0 for an expert a token did not choose) -> [N, H]: every expert over
        every token, in batched matmuls of fixed shapes (no per-expert sizes read back, so a CUDA
        graph captures it). For a decode step's few tokens the cost is the weights' bytes, which a
        batch of 64 tokens reads nearly whole anyway::

            gate_up [E, N, 2I] = x @ gate_up_proj[e] + b      down [E, N, H]      out = sum_e weights[:, e] * down[e]
        """
        num_experts, num_tokens = self.gate_up_proj.shape[0], x.shape[0]
        rows = x[None].expand(num_experts, num_tokens, x.shape[1])
        gate_up = torch.baddbmm(self.gate_up_proj_bias[:, None, :], rows, self.gate_up_proj)
        hidden = self._activation(gate_up.view(num_experts * num_tokens, -1)).view(num_experts, num_tokens, -1)
        down = torch.baddbmm(self.down_proj_bias[:, None, :], hidden, self.down_proj)
        return (down.float() * weights.t().float()[:, :, None]).sum(dim=0).to(x.dtype)


def _chunks(counts: list[int]) -> list[list[tuple[int, int, int]]]:
    """``(expert, first row, end row)`` of every expert with rows, grouped into chunks of at least
    ``_CHUNK_ROWS`` rows (the last may have fewer)::

        counts [3, 0, 300, 2]  ->  [[(0, 0, 3), (2, 3, 303)], [(3, 303, 305)]]
    """
    chunks: list[list[tuple[int, int, int]]] = [[]]
    start = rows = 0
    for expert, count in enumerate(counts):
        if count:
            chunks[-1].append((expert, start, start + count))
            start, rows = start + count, rows + count
            if rows >= _CHUNK_ROWS:
                chunks.append([])
                rows = 0
    return [chunk for chunk in chunks if chunk]


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
        """In float32 on the CPU the routing is one native call (top-k, softmax, pairs sorted by expert), and a
        decode step's few tokens go through the experts in one more (``Experts.forward_few``)."""
        route = moe_route_kernel() if x.dtype == torch.float32 and x.device.type == "cpu" else None
        if route is None or add_weighted_rows_kernel() is None:
            experts, weights = self.router(x)
            return self.experts(x, experts, weights)
        logits = linear(x, self.router.weight, self.router.bias, None)  # <= 8 rows: engine.native's kernel
        tokens, row_weights, counts = route(logits, self.router.top_k)
        out = self.experts.forward_few(x, tokens, row_weights, counts)
        return out if out is not None else self.experts.forward_sorted(x, tokens, row_weights, counts.tolist())

    def forward_static(self, x: torch.Tensor) -> torch.Tensor:
        """A static step's variant (engine.models.decoder): the router's top-k weights scattered into a
        dense [N, E] (zeros elsewhere) and ``Experts.forward_dense``: no host sync, no data-dependent shape."""
        experts, weights = self.router(x)
        dense = weights.new_zeros(x.shape[0], self.experts.gate_up_proj.shape[0]).scatter_(1, experts, weights)
        return self.experts.forward_dense(x, dense)


class GptOssForCausalLM(DecoderForCausalLM):
    keep_in_float32 = ("input_layernorm", "post_attention_layernorm", "norm")
    norm_in_float32 = True

    def attention_options(self, hf_config) -> AttentionOptions:
        bias = bool(getattr(hf_config, "attention_bias", True))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, has_sinks=True)

    def make_mlp(self, hf_config) -> nn.Module:
        return MoeMLP(hf_config)
