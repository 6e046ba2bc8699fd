"""The decoder skeleton every supported architecture shares, with ``transformers``' parameter names.

    lm_head / model.embed_tokens / model.norm
    model.layers.{i}.input_layernorm, .self_attn.{q,k,v,o}_proj[, .self_attn.sinks],
                     .post_attention_layernorm, .mlp.*            (the MLP is per architecture)

A subclass supplies the MLP and the bias / sink choices; the forward pass is here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from engine.attention import paged_attention
from engine.attention_plan import GroupAttention, build_group_attention
from engine.forward import ForwardBatch
from engine.gpu.paged_attention import paged_decode_attention, write_kv
from engine.layout import LayerSlot, head_dim, layer_slots, num_kv_heads
from engine.models import native_stack
from engine.models.layers import RMSNorm, RotaryEmbedding, apply_rope
from engine.models.packed import can_pack, gemv_layout, linear, pack
from engine.models.quantized import QuantizedWeight


@dataclass(frozen=True)
class StaticAttention:
    """A decode/verify step over fixed buffers (engine.gpu.step_buffers): token t is in block-table row
    ``table_rows[t]`` at ``positions[t]`` (-1: a padded token, which writes and reads nothing); its K/V
    goes to slot ``slots[group][t]`` (page * B + offset). Fixed shapes, no host sync: a CUDA graph
    captures the forward over these tensors."""

    positions: torch.Tensor  # [N] int64
    table_rows: torch.Tensor  # [N] int32
    block_tables: dict[str, torch.Tensor]  # group -> [R, M] int32
    slots: dict[str, torch.Tensor]  # group -> [N] int64
    num_splits: dict[str, int] = field(default_factory=dict)  # group -> split-KV ranges (absent: 1)


@dataclass(frozen=True)
class ForwardContext:
    """What every layer of one forward pass shares: a plan per group (``attention``), or for a
    static step (``static``) the buffers that engine.gpu's paged kernels read."""

    cos: torch.Tensor
    sin: torch.Tensor
    attention: dict[str, GroupAttention]
    kv_caches: dict[str, torch.Tensor]
    static: StaticAttention | None = None


@dataclass(frozen=True)
class AttentionOptions:
    qkv_bias: bool = False
    o_bias: bool = False
    has_sinks: bool = False


class PagedSelfAttention(nn.Module):
    def __init__(self, hf_config, slot: LayerSlot, options: AttentionOptions) -> None:
        super().__init__()
        self.slot = slot
        self.head_dim = head_dim(hf_config)
        self.scale = self.head_dim**-0.5
        hidden, heads, kv_heads = hf_config.hidden_size, hf_config.num_attention_heads, num_kv_heads(hf_config)
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=options.qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=options.qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=options.qkv_bias)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=options.o_bias)
        self.sinks = nn.Parameter(torch.zeros(heads)) if options.has_sinks else None
        self.num_heads, self.num_kv_heads = heads, kv_heads
        self.qkv: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None  # fuse_qkv

    def fuse_qkv(self) -> None:
        """q, k and v in one matmul, and RoPE over q and k at once (a decode step's layer: two matmuls
        and a RoPE's seven ops fewer). The three weights (and biases) become views of one concatenated
        tensor: parameters, ``state_dict`` and memory stay as they were. Call once the weights are loaded
        and on their device: ``Module.to`` afterwards would part the views from the fused tensor."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        if any(isinstance(p.weight, QuantizedWeight) for p in projs):
            self._fuse_quantized()
            return
        with torch.no_grad():
            weight = torch.cat([p.weight for p in projs])
            bias = torch.cat([p.bias for p in projs]) if self.q_proj.bias is not None else None
            self._share_fused(weight, bias)

    def _fuse_quantized(self) -> None:
        """GGUF blocks of q, k and v (engine.models.quantized) in one weight, when all three are quantized
        alike; q/k/v keep views of its rows. Mixed formats stay three matmuls."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        if not all(isinstance(p.weight, QuantizedWeight) and p.weight.kind == projs[0].weight.kind for p in projs):
            return
        weight = QuantizedWeight.cat([p.weight for p in projs])
        for proj, part in zip(projs, weight.split([p.weight.shape[0] for p in projs])):
            proj.weight = part
        bias = torch.cat([p.bias.detach() for p in projs]) if self.q_proj.bias is not None else None
        self.qkv = (weight, bias, None)

    def _share_fused(self, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None = None):
        """q/k/v's parameters become views of the fused ``weight`` and ``bias``."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        sizes = [p.weight.shape[0] for p in projs]
        for proj, part in zip(projs, weight.split(sizes)):
            proj.weight = nn.Parameter(part, requires_grad=False)
        if bias is not None:
            for proj, part in zip(projs, bias.split(sizes)):
                proj.bias = nn.Parameter(part, requires_grad=False)
        self.qkv = (weight, bias, packed)

    def pack_weights(self, min_elements: int) -> None:
        """The fused q/k/v weight packed for oneDNN (engine.models.packed), like any large linear, and
        stored for the one-row GEMV (``gemv_layout``; q/k/v stay views of it)."""
        if self.qkv is not None and can_pack(self.qkv[0], min_elements):
            weight, bias, _ = self.qkv
            with torch.no_grad():
                self._share_fused(gemv_layout(weight), bias, pack(weight))

    def _project(self, hidden: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, ...]:
        """q, k (rotated) and v, [N, heads, head_dim] each."""
        num_tokens, head = hidden.shape[0], self.head_dim
        if self.qkv is None:
            q = apply_rope(self.q_proj(hidden).view(num_tokens, -1, head), ctx.cos, ctx.sin)
            k = apply_rope(self.k_proj(hidden).view(num_tokens, -1, head), ctx.cos, ctx.sin)
            return q, k, self.v_proj(hidden).view(num_tokens, -1, head)
        num_q, num_kv = self.num_heads, self.num_kv_heads
        qkv = linear(hidden, *self.qkv).view(num_tokens, -1, head)
        qk = apply_rope(qkv[:, : num_q + num_kv], ctx.cos, ctx.sin)
        return qk[:, :num_q], qk[:, num_q:], qkv[:, num_q + num_kv:]

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self._project(hidden, ctx)
        group, index, window = self.slot
        if ctx.static is not None:
            static, cache = ctx.static, ctx.kv_caches[group]
            write_kv(cache, index, static.slots[group], k, v)
            out = paged_decode_attention(q, cache, index, static.block_tables[group], static.table_rows,
                                         static.positions, window=window, scale=self.scale, sinks=self.sinks,
                                         num_splits=static.num_splits.get(group, 1))
        else:
            out = paged_attention(q, k, v, ctx.kv_caches[group], index, ctx.attention[group], self.scale, self.sinks)
        return self.o_proj(out.reshape(num_tokens, -1))


def fuse_projections(model: nn.Module) -> nn.Module:
    """Every attention layer's q/k/v in one matmul (``PagedSelfAttention.fuse_qkv``), and every MLP's gate and
    up where the MLP can (``GatedMLP.fuse_gate_up``: quantized weights); weights loaded first."""
    for module in model.modules():
        if isinstance(module, PagedSelfAttention):
            module.fuse_qkv()
        elif hasattr(module, "fuse_gate_up"):
            module.fuse_gate_up()
    return model


class DecoderLayer(nn.Module):
    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float, norm_in_float32: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps, norm_in_float32)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, norm_in_float32)
        self.mlp = mlp

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), ctx)
        # A static step takes the MLP's fixed-shape variant where it has one (GPT-OSS's MoE).
        mlp = self.mlp if ctx.static is None else getattr(self.mlp, "forward_static", self.mlp)
        return hidden + mlp(self.post_attention_layernorm(hidden))


class DecoderModel(nn.Module):
    def __init__(self, hf_config, layers: list[DecoderLayer], norm_in_float32: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(hf_config.vocab_size, hf_config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, norm_in_float32)
        self.rotary_emb = RotaryEmbedding(hf_config, head_dim(hf_config))


class DecoderForCausalLM(nn.Module):
    """Base of every model: ``forward(ForwardBatch) -> float32 logits [len(logits_indices) or N, vocab]``."""

    # Submodule names whose parameters stay float32 whatever the model dtype (as transformers keeps them).
    keep_in_float32: tuple[str, ...] = ()
    norm_in_float32 = False

    def __init__(self, hf_config) -> None:
        super().__init__()
        self.config = hf_config
        self.slots = layer_slots(hf_config)
        self.group_windows = {slot.group: slot.window for slot in self.slots}
        layers = [self._make_layer(hf_config, slot) for slot in self.slots]
        self.model = self.make_decoder_model(hf_config, layers)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(hf_config.hidden_size, hf_config.vocab_size, bias=False)
        # A tied checkpoint may still carry lm_head.weight: it is the embedding, drop it.
        self.register_load_state_dict_pre_hook(self._drop_tied_head)
        self.packed_head: torch.Tensor | None = None

    def pack_weights(self, min_elements: int) -> None:
        """A tied LM head (the embedding) packed for oneDNN, and the embedding stored for the head's
        one-row matmul (``gemv_layout``). With engine.native's few-row kernel that is [vocab, hidden], the
        embedding's own layout, in huge pages; without it MKL's GEMV wants [hidden, vocab] (SmolLM2's head
        10.5 -> 5.8 ms a decode step, while looking up 32 tokens' rows takes 0.18 instead of 0.01 ms and
        2,048 prompt tokens' 18 instead of 1 ms). An untied ``lm_head`` is an ``nn.Linear`` that
        engine.models.packed.pack_for_cpu packs."""
        head = self.model.embed_tokens.weight
        if not (self.tie_word_embeddings and can_pack(head, min_elements)):
            self.packed_head = None
            return
        self.packed_head = pack(head)
        self.model.embed_tokens.weight = nn.Parameter(gemv_layout(head.detach()), requires_grad=head.requires_grad)

    def _make_layer(self, hf_config, slot: LayerSlot) -> DecoderLayer:
        attn = PagedSelfAttention(hf_config, slot, self.attention_options(hf_config))
        return DecoderLayer(attn, self.make_mlp(hf_config), hf_config.hidden_size, hf_config.rms_norm_eps,
                            self.norm_in_float32)

    def make_decoder_model(self, hf_config, layers: list[nn.Module]) -> DecoderModel:
        return DecoderModel(hf_config, layers, self.norm_in_float32)

    def attention_options(self, hf_config) -> AttentionOptions:
        raise NotImplementedError

    def make_mlp(self, hf_config) -> nn.Module:
        raise NotImplementedError

    def _drop_tied_head(self, module, state_dict, prefix, *args) -> None:
        if self.tie_word_embeddings:
            state_dict.pop(prefix + "lm_head.weight", None)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self._logits(batch.input_ids, self._context(batch), batch.logits_indices)

    def forward_static(self, input_ids: torch.Tensor, static: StaticAttention, rope_table: tuple[torch.Tensor, ...],
                       kv_caches: dict[str, torch.Tensor]) -> torch.Tensor:
        """Logits [N, vocab] of every token of a static step (engine.gpu): fixed shapes, no host sync.
        ``rope_table``: (cos, sin) [P, head_dim // 2] of positions 0..P-1 (``rope_table``); a padded
        token's position -1 reads row 0 (its output is never used)."""
        rows = static.positions.clamp(min=0)
        cos, sin = (table.index_select(0, rows) for table in rope_table)
        return self._logits(input_ids, ForwardContext(cos, sin, {}, kv_caches, static), None)

    def rope_table(self, num_positions: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of positions 0..num_positions-1: what ``forward`` computes per step, once."""
        positions = torch.arange(num_positions, device=device)
        return self.model.rotary_emb(positions, self.model.embed_tokens.weight.dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def _logits(self, input_ids: torch.Tensor, ctx: ForwardContext, logits_indices: torch.Tensor | None):
        hidden = self.embed(input_ids)
        stack = self._native_stack()
        if stack is not None and stack.fits(hidden, ctx):
            hidden = stack(hidden, ctx)
        else:
            for layer in self.model.layers:
                hidden = layer(hidden, ctx)
        if logits_indices is not None:
            hidden = hidden.index_select(0, logits_indices)
        hidden = self.model.norm(hidden)
        if self.tie_word_embeddings:
            return linear(hidden, self.model.embed_tokens.weight, None, self.packed_head).float()
        return self.lm_head(hidden).float()

    def _native_stack(self):
        """engine.models.native_stack's one-call layers for few-row steps, built at the first step (weights
        loaded, fused and packed by then); None where the model's layers are not ones it runs."""
        if not native_stack.enabled() or self.model.embed_tokens.weight.device.type != "cpu":
            return None  # CPU kernels: never built (~1 min of compiling) for a model on a GPU
        if not hasattr(self, "_stack"):
            self._stack = native_stack.build(self)
        return self._stack

    def _context(self, batch: ForwardBatch) -> ForwardContext:
        device = batch.input_ids.device
        groups = set(self.group_windows)
        missing = sorted((groups - set(batch.block_tables)) | (groups - set(batch.kv_caches)))
        if missing:
            raise ValueError(f"ForwardBatch lacks block tables or KV pages for layer groups {missing}")
        attention = {
            group: build_group_attention(batch, group, window, device) for group, window in self.group_windows.items()
        }
        cos, sin = self.model.rotary_emb(batch.positions, self.model.embed_tokens.weight.dtype)
        return ForwardContext(cos, sin, attention, batch.kv_caches)
