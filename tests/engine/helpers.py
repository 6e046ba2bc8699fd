"""Tiny ``transformers`` reference models, our model loaded from their checkpoint, and a test page allocator.

The allocator binds a fresh page per (request, group, ordinal) and, for a
sliding group, unbinds (-1) every ordinal no future query reads and fills
its page with NaN, so a read of a released page poisons the logits.
Fresh pages start as NaN too: a slot past a request's last position is never read.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

from engine.forward import ForwardBatch
from engine.layout import kv_cache_spec
from engine.models import build_model
from kvcache.spec import KVCacheSpec

WINDOW = 8
_COMMON = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, initializer_range=0.15, max_position_embeddings=512,
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)
CONFIGS = {
    "gpt_oss": lambda: GptOssConfig(
        **{**_COMMON, "intermediate_size": 32, "max_position_embeddings": 131072},
        num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
    ),  # rope_parameters default to GPT-OSS's YaRN (factor 32, original 4096)
    "gemma3": lambda: Gemma3TextConfig(
        **{**_COMMON, "hidden_activation": "gelu_pytorch_tanh"}, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
    ),  # Gemma's pattern (sliding layers, then a full one); a query scale that is not head_dim ** -0.5
    "llama": lambda: LlamaConfig(**_COMMON, tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    "mistral": lambda: MistralConfig(**_COMMON, sliding_window=WINDOW),
    "qwen2": lambda: Qwen2Config(**_COMMON),
    "qwen2_sliding": lambda: Qwen2Config(
        **_COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2
    ),  # layers 2, 3 slide
}


def load_pair(arch: str, dtype: torch.dtype = torch.float32):
    """(transformers model with eager attention, our model on the same weights, the checkpoint's config)."""
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(CONFIGS[arch](), attn_implementation="eager").eval()
    if arch == "gemma3":  # its norms start at 0 (a scale of 1 + 0): random ones test the 1 + w form
        with torch.no_grad():
            for name, param in reference.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0, 0.5)
    with tempfile.TemporaryDirectory() as tmp:
        reference.save_pretrained(tmp)
        config = AutoConfig.from_pretrained(tmp)
        state = load_file(str(Path(tmp) / "model.safetensors"))
    ours = build_model(config, dtype=dtype)
    ours.load_state_dict(state, strict=True)
    return reference, ours, config


class PagedKV:
    """Per-request block tables over NaN-initialised pages, one tensor per layer group."""

    def __init__(self, spec: KVCacheSpec, num_pages: int = 256, device: str = "cpu") -> None:
        self.spec, self.device = spec, device
        self.kv = {
            g.name: torch.full((num_pages, *spec.page_shape(g)), float("nan"), dtype=spec.dtype, device=device)
            for g in spec.groups
        }
        self.free = {g.name: list(range(num_pages)) for g in spec.groups}
        self.tables: dict[int, dict[str, list[int]]] = {}

    @classmethod
    def for_config(cls, config, tokens_per_block: int, dtype=torch.float32, device: str = "cpu") -> PagedKV:
        return cls(kv_cache_spec(config, tokens_per_block, dtype), device=device)

    def prepare(self, request: int, start: int, end: int) -> None:
        """Bind pages for positions < ``end``; unbind sliding ordinals no query at >= ``start`` reads."""
        block = self.spec.tokens_per_block
        tables = self.tables.setdefault(request, {g.name: [] for g in self.spec.groups})
        for g in self.spec.groups:
            table = tables[g.name]
            while len(table) * block < end:
                table.append(self.free[g.name].pop(0))
            if g.window is None:
                continue
            for ordinal in range(max(0, (start - g.window + 1) // block)):
                if table[ordinal] >= 0:
                    self.kv[g.name][table[ordinal]] = float("nan")
                    table[ordinal] = -1

    def batch(self, steps: list[tuple[int, list[int], int]], logits_indices=None) -> ForwardBatch:
        """``steps``: (request, new token ids, position of the first one); binds pages as needed."""
        for request, tokens, start in steps:
            self.prepare(request, start, start + len(tokens))
        ids = dict(dtype=torch.long, device=self.device)
        return ForwardBatch(
            input_ids=torch.tensor([t for _, tokens, _ in steps for t in tokens], **ids),
            positions=torch.tensor([p for _, tokens, s in steps for p in range(s, s + len(tokens))], **ids),
            query_lens=[len(tokens) for _, tokens, _ in steps],
            seq_lens=[s + len(tokens) for _, tokens, s in steps],
            block_tables={g: [self.tables[r][g] for r, _, _ in steps] for g in self.kv},
            kv_caches=self.kv,
            tokens_per_block=self.spec.tokens_per_block,
            logits_indices=None if logits_indices is None else torch.tensor(logits_indices, **ids),
        )


def greedy(model, cache: PagedKV, prompt: list[int], num_tokens: int, request: int = 0) -> list[int]:
    """Prefill, then one-token decode steps, each through a ForwardBatch."""
    logits = model(cache.batch([(request, prompt, 0)], logits_indices=[len(prompt) - 1]))
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < num_tokens:
        position = len(prompt) + len(tokens) - 1
        logits = model(cache.batch([(request, tokens[-1:], position)]))
        tokens.append(int(logits[-1].argmax()))
    return tokens


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours.float() - reference.float()).abs().max() / reference.float().abs().max())
