"""Gemma 3's text decoder (``Gemma3ForCausalLM``): the Llama skeleton with Gemma's norms, QK-norm, a
tanh-GELU MLP, scaled embeddings and RoPE per layer type.

    h = embed(ids) * sqrt(hidden)
    per layer:  h = h + post_attention_norm(attention(input_norm(h)))        (q, k: RMSNorm per head, then RoPE)
                h = h + post_feedforward_norm(mlp(pre_feedforward_norm(h)))   (mlp: down(gelu_tanh(gate) * up))
    logits = norm(h) @ embed.T                                               (tied head)

Every norm is Gemma's ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` in float32 (the checkpoint stores ``w``
centred on 0). The query scale is ``query_pre_attn_scalar ** -0.5``.

Layers come in a fixed pattern (``layer_types``; 270M: five ``sliding_attention`` layers with a
512-token window, then one ``full_attention``), which engine.layout turns into two KV layer groups,
``sliding`` and ``full``, each with its own block tables: the windowed slice, the prefix cache's window
rule and routing follow from the groups alone. Each layer type rotates with its own RoPE base
(``rope_parameters[layer_type]``: 10,000 sliding, 1,000,000 full), so the forward context carries one
(cos, sin) pair per group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from engine.layout import LayerSlot
from engine.models.decoder import AttentionOptions, DecoderForCausalLM, ForwardContext, PagedSelfAttention
from engine.models.layers import RMSNorm, RotaryEmbedding, apply_rope, rms_norm
from engine.models.llama import GatedMLP
from engine.models.packed import linear

_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
          "q_norm", "k_norm", "norm")


def layer_type(window: int | None) -> str:
    return "full_attention" if window is None else "sliding_attention"


@dataclass(frozen=True)
class GemmaContext(ForwardContext):
    """A forward context with (cos, sin) per layer group (``cos``/``sin`` hold the full group's)."""

    rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaled by ``1 + weight`` in float32; ``1 + weight`` is computed once per weight version."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps, scale_in_float32=True)
        nn.init.zeros_(self.weight)
        self._scale: tuple[tuple[int, int], torch.Tensor] | None = None

    def unit_offset_scale(self) -> torch.Tensor:
        key = (self.weight.data_ptr(), self.weight._version)
        if self._scale is None or self._scale[0] != key:
            self._scale = (key, 1.0 + self.weight.detach().float())
        return self._scale[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.unit_offset_scale(), self.eps, scale_in_float32=True)


class GemmaAttention(PagedSelfAttention):
    """q, k and v projected (fused or not), q and k normed per head, then rotated with the group's RoPE."""

    def __init__(self, hf_config, slot: LayerSlot, options: AttentionOptions) -> None:
        super().__init__(hf_config, slot, options)
        self.scale = float(hf_config.query_pre_attn_scalar) ** -0.5
        self.q_norm = GemmaRMSNorm(self.head_dim, hf_config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, hf_config.rms_norm_eps)

    def _project(self, hidden: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, ...]:
        num_tokens, head = hidden.shape[0], self.head_dim
        if self.qkv is None:
            q, k, v = (proj(hidden).view(num_tokens, -1, head) for proj in (self.q_proj, self.k_proj, self.v_proj))
        else:
            qkv = linear(hidden, *self.qkv).view(num_tokens, -1, head)
            q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        cos, sin = ctx.rope[self.slot.group]
        return apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin), v


class GemmaDecoderLayer(nn.Module):
    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm = GemmaRMSNorm(hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden_size, eps)

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        hidden = hidden + self.post_attention_layernorm(self.self_attn(self.input_layernorm(hidden), ctx))
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class GemmaModel(nn.Module):
    """``model.*`` of the checkpoint: embeddings, layers, final norm; a rotary embedding per layer type."""

    def __init__(self, hf_config, layers: list[nn.Module], head_dim: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(hf_config.vocab_size, hf_config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(hf_config, head_dim, "full_attention")
        self.local_rotary_emb = RotaryEmbedding(hf_config, head_dim, "sliding_attention")


class Gemma3ForCausalLM(DecoderForCausalLM):
    keep_in_float32 = _NORMS  # as transformers computes them: (1 + w) in float32 whatever the model dtype

    def __init__(self, hf_config) -> None:
        _check_supported(hf_config)
        super().__init__(hf_config)
        self.embed_scale = float(hf_config.hidden_size) ** 0.5

    def attention_options(self, hf_config) -> AttentionOptions:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias)

    def make_mlp(self, hf_config) -> nn.Module:
        return GatedMLP(hf_config.hidden_size, hf_config.intermediate_size, False, hf_config.hidden_activation)

    def _make_layer(self, hf_config, slot: LayerSlot) -> nn.Module:
        attn = GemmaAttention(hf_config, slot, self.attention_options(hf_config))
        return GemmaDecoderLayer(attn, self.make_mlp(hf_config), hf_config.hidden_size, hf_config.rms_norm_eps)

    def make_decoder_model(self, hf_config, layers: list[nn.Module]) -> nn.Module:
        return GemmaModel(hf_config, layers, layers[0].self_attn.head_dim)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        # transformers: a float32 buffer cast to the embedding's dtype, then multiplied
        return hidden * torch.tensor(self.embed_scale, dtype=torch.float32).to(hidden.dtype)

    def _context(self, batch) -> GemmaContext:
        base = super()._context(batch)
        local = self.model.local_rotary_emb(batch.positions, self.model.embed_tokens.weight.dtype)
        rope = self._by_group((base.cos, base.sin), local)
        return GemmaContext(base.cos, base.sin, base.attention, base.kv_caches, rope=rope)

    def _by_group(self, full: tuple, local: tuple) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Each layer group's (cos, sin): the full group rotates with the full layers' base, a sliding one
        with the sliding layers'."""
        return {group: full if window is None else local for group, window in self.group_windows.items()}

    def rope_table(self, num_positions: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        """cos, sin of the full layers' RoPE, then of the sliding layers', for positions 0..num_positions-1."""
        positions = torch.arange(num_positions, device=device)
        dtype = self.model.embed_tokens.weight.dtype
        return (*self.model.rotary_emb(positions, dtype), *self.model.local_rotary_emb(positions, dtype))

    def forward_static(self, input_ids, static, rope_table, kv_caches) -> torch.Tensor:
        rows = static.positions.clamp(min=0)
        cos, sin, local_cos, local_sin = (table.index_select(0, rows) for table in rope_table)
        rope = self._by_group((cos, sin), (local_cos, local_sin))
        return self._logits(input_ids, GemmaContext(cos, sin, {}, kv_caches, static, rope=rope), None)


def _check_supported(hf_config) -> None:
    """Gemma 3 variants whose computation differs from the one above fail here, by name."""
    unsupported = {
        "attn_logit_softcapping": getattr(hf_config, "attn_logit_softcapping", None) is not None,
        "final_logit_softcapping": getattr(hf_config, "final_logit_softcapping", None) is not None,
        "use_bidirectional_attention": bool(getattr(hf_config, "use_bidirectional_attention", False)),
    }
    named = [name for name, is_set in unsupported.items() if is_set]
    if named:
        raise ValueError(f"Gemma 3 with {', '.join(named)} is not supported")
