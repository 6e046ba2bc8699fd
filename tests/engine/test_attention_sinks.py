"""The fused-kernel sink attention against the softmax written out: sinks only enlarge the denominator."""

from __future__ import annotations

import pytest
import torch

from engine.attention import attend, attend_with_prefix


def reference(q, k, v, mask, scale, sinks):
    """softmax over [scores, sink] per head, the sink column dropped before the weighted sum."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("rqhd,rkhd->rhqk", q, k) * scale
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    sink = sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("rhqk,rkhd->rqhd", probs, v)


# float32: the kernel's logsumexp rescales the output; bf16: the sink is a key column (and keys are padded)
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(("num_req", "num_q", "num_k"), [(1, 12, 12), (3, 1, 20), (2, 4, 9)])
def test_sink_attention_matches_written_out_softmax(num_req, num_q, num_k, dtype, tolerance):
    gen = torch.Generator().manual_seed(num_req * 100 + num_k)
    q = torch.randn(num_req, num_q, 4, 8, generator=gen)
    k, v = (torch.randn(num_req, num_k, 2, 8, generator=gen) for _ in range(2))
    positions = torch.arange(num_q) + num_k - num_q  # the new tokens are the last num_q keys
    mask = (torch.arange(num_k)[None] <= positions[:, None])[None].repeat(num_req, 1, 1)
    mask[0, :, 0] = False  # a key out of the window
    sinks = torch.tensor([-1.0, 0.0, 2.0, 8.0])  # a large sink takes most of the mass
    q, k, v = (t.to(dtype) for t in (q, k, v))
    out = attend(q, k, v, mask, 0.3, sinks)
    want = reference(*(t.float() for t in (q, k, v)), mask, 0.3, sinks)
    torch.testing.assert_close(out.float(), want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (6, 2), (4, 4)])
def test_decode_attention_matches_written_out_softmax(num_heads, num_kv_heads):
    """One query per request (a decode bucket): grouped heads are folded into one KV head's rows."""
    gen = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads)
    q = torch.randn(5, 1, num_heads, 8, generator=gen)
    k, v = (torch.randn(5, 24, num_kv_heads, 8, generator=gen) for _ in range(2))
    key_lens = torch.tensor([24, 3, 17, 1, 9])
    mask = (torch.arange(24)[None] < key_lens[:, None])[:, None]  # [R, 1, K]
    no_sinks = torch.full((num_heads,), float("-inf"))
    out = attend(q, k, v, mask, 0.3)
    torch.testing.assert_close(out, reference(q, k, v, mask, 0.3, no_sinks), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("with_sinks", [True, False])
@pytest.mark.parametrize("num_q", [2, 7, 40])
def test_causal_attention_matches_written_out_softmax(num_q, with_sinks, dtype, tolerance):
    """``mask=None`` (a fresh prompt's own keys): query j attends keys 0..j, as the explicit
    lower-triangular mask would; float32 takes the kernel's causal mode, bf16 the mask."""
    gen = torch.Generator().manual_seed(num_q)
    q = torch.randn(3, num_q, 4, 8, generator=gen)
    k, v = (torch.randn(3, num_q, 2, 8, generator=gen) for _ in range(2))
    sinks = torch.tensor([-1.0, 0.0, 2.0, 8.0]) if with_sinks else None
    tril = torch.ones(num_q, num_q, dtype=torch.bool).tril().expand(3, -1, -1)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    out = attend(q, k, v, None, 0.3, sinks)
    want = reference(*(t.float() for t in (q, k, v)), tril, 0.3,
                     sinks if with_sinks else torch.full((4,), float("-inf")))
    torch.testing.assert_close(out.float(), want, rtol=tolerance, atol=tolerance)
    if dtype == torch.float32:  # the kernel's causal mode gives the explicit mask's bits
        assert torch.equal(out, attend(q, k, v, tril, 0.3, sinks))


@pytest.mark.parametrize("with_sinks", [True, False])
@pytest.mark.parametrize(("num_prefix", "num_q", "num_kv_heads"), [(1, 64, 2), (37, 70, 2), (300, 65, 4)])
def test_prefix_then_causal_matches_written_out_softmax(num_prefix, num_q, num_kv_heads, with_sinks):
    """A chunk after ``num_prefix`` cached keys: every query reads all of them and its own chunk's keys
    up to itself; two kernel calls merged by logsumexp give the one softmax over all of it."""
    gen = torch.Generator().manual_seed(num_prefix + num_q)
    q = torch.randn(1, num_q, 4, 8, generator=gen)
    k, v = (torch.randn(1, num_prefix + num_q, num_kv_heads, 8, generator=gen) * 2 for _ in range(2))
    sinks = torch.tensor([-1.0, 0.0, 2.0, 8.0]) if with_sinks else None
    prefix = (k[:, :num_prefix], v[:, :num_prefix])
    out = attend_with_prefix(q, k[:, num_prefix:], v[:, num_prefix:], prefix, 0.3, sinks)
    positions = torch.arange(num_q) + num_prefix
    mask = (torch.arange(num_prefix + num_q)[None] <= positions[:, None])[None]
    want = reference(q, k, v, mask, 0.3, sinks if with_sinks else torch.full((4,), float("-inf")))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_q", [1, 40])
def test_grouped_kv_heads_reach_the_kernel_unrepeated_with_the_same_bits(num_q, monkeypatch):
    """torch 2.13's CPU flash kernel maps query head h to KV head h // G itself: the engine hands it the
    KV heads as they are, and gets the bits the repeated heads give (prefill, sinks, float32)."""
    import engine.attention as attention

    assert attention._kernel_takes_grouped_heads()
    gen = torch.Generator().manual_seed(num_q)
    q = torch.randn(3, num_q, 6, 8, generator=gen)
    k, v = (torch.randn(3, num_q, 2, 8, generator=gen) for _ in range(2))
    sinks = torch.tensor([-1.0, 0.0, 2.0, 8.0, 0.5, -3.0])
    mask = None if num_q > 1 else torch.ones(3, 1, 1, dtype=torch.bool)
    grouped = attend(q, k, v, mask, 0.3, sinks)
    prefix = (k[:, :1], v[:, :1])
    grouped_prefix = attend_with_prefix(q, k, v, prefix, 0.3, sinks)
    monkeypatch.setattr(attention, "_kernel_takes_grouped_heads", lambda: False)
    assert torch.equal(grouped, attend(q, k, v, mask, 0.3, sinks))
    assert torch.equal(grouped_prefix, attend_with_prefix(q, k, v, prefix, 0.3, sinks))
