"""The benchmark's geometry: a random GPT-OSS-shaped model, its page size, and the slice's minimum.

    8 layers alternating window-128 / full, 8 KV heads of 64, float32, B = 32 tokens per page:
    a page is 4 layers x 2 (K, V) x 32 x 8 x 64 x 4 B = 512 KiB per layer group.

The generation side reserves ``DRAFTS`` draft tokens (scratch that never travels).
"""

from __future__ import annotations

from actors.config import WorkerConfig
from bench.common import build_gptoss_model

B, W, DRAFTS = 32, 128, 3
LAYERS, KV_HEADS, HEAD_DIM, DTYPE_BYTES = 8, 8, 64, 4
PAGE_NBYTES = (LAYERS // 2) * 2 * B * KV_HEADS * HEAD_DIM * DTYPE_BYTES  # one group holds half the layers


def build_model(directory: str) -> str:
    return build_gptoss_model(directory, num_hidden_layers=LAYERS, num_attention_heads=KV_HEADS,
                              num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, hidden_size=64, intermediate_size=64,
                              num_local_experts=2, num_experts_per_tok=1, sliding_window=W,
                              max_position_embeddings=131072)


def min_slice_pages(prompt_len: int) -> tuple[int, int]:
    """(window group, full group) pages the generation side must receive, from positions alone.

    The first decode query sits at position P and reads keys [P - W + 1, P]
    (window) or [0, P] (full); position P is computed by the generation side.
    So prompt positions max(0, P-W+1) .. P-1 (window) and 0 .. P-1 (full)
    must arrive, in whole pages of B positions.
    """
    last = (prompt_len - 1) // B
    return last - max(0, prompt_len - W + 1) // B + 1, last + 1


def window_unaware_pages(prompt_len: int) -> int:
    return 2 * -(-prompt_len // B)  # both groups send every prompt page


def worker_config(path: str, num_pages: int, drafts: int = 0, device: str = "cpu") -> WorkerConfig:
    return WorkerConfig(model=path, tokens_per_block=B, num_pages=num_pages, max_draft_len=drafts, device=device,
                        transport="nixl")
