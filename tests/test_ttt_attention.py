"""varlen TTT attention (drafter/ttt_attention.py): each sample's causal prefix plus the TTT diagonal,
merged by log-sum-exp, against the dense-mask sdpa path it replaces on CUDA."""

from __future__ import annotations

import pytest
import torch

from eagle3_ray.drafter.ttt import ttt_forward
from eagle3_ray.drafter.ttt_attention import Segments, TTTCache, ttt_attention
from tests.test_ttt import _drafter, _lm_head, _pack, _sample, assert_same_ttt

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_segments_are_runs_of_one_sample_within_a_row():
    seq = torch.tensor([[0, 0, 0, 1, 1, -1], [2, 2, 3, -1, -1, -1]])
    s = Segments.of(seq)
    assert s.cu_seqlens.tolist() == [0, 3, 5, 6, 8, 9, 12]  # the padding runs are segments of their own
    assert s.cu_seqlens.dtype == torch.int32 and s.max_len == 3
    assert s.token_segment.tolist() == [0, 0, 0, 1, 1, 2, 3, 3, 4, 5, 5, 5]
    assert s.token_offset.tolist() == [0, 1, 2, 0, 1, 0, 0, 1, 0, 0, 1, 2]
    m = s.mask()
    assert m[2, :3].all() and not m[2, 3:].any()  # causal within its sample
    assert not m[0, 1] and not m[3, 2] and not m[6, 5]  # never ahead, never across samples or rows


@pytest.mark.parametrize("rows", [None, 16])
def test_varlen_gives_the_dense_mask_loss_and_gradients(rows):
    """One pack of 4 samples and padding (rows=None), or the same split into rows of whole samples."""
    batch = _pack([_sample(n, 40 + n) for n in (13, 5, 9, 11)], pad_to=45)
    if rows:
        from eagle3_ray.drafter.ttt import split_rows

        batch = split_rows(batch, rows)
        assert batch["seq_ids"].shape[0] > 1
    res = {}
    for attention in ("sdpa", "varlen"):
        d = _drafter(seed=5)
        out = ttt_forward(d, batch, _lm_head(d, seed=5), ttt_steps=4, attention=attention)
        out.loss.backward()
        res[attention] = (out, [p.grad for p in d.parameters() if p.requires_grad])
    assert_same_ttt(*res["varlen"], *res["sdpa"], steps=4)


@pytest.mark.parametrize("steps", [1, 3])
def test_the_hand_written_backward_is_the_gradient(steps):
    """gradcheck in float64 of the merged attention of TTT step ``steps - 1`` (grouped heads: 4 over 2)."""
    g = torch.Generator().manual_seed(steps)
    b, h, kv, t, d = 2, 4, 2, 7, 5
    seq = torch.tensor([[0, 0, 0, 1, 1, 1, -1], [2, 2, 2, 2, 2, 3, 3]])
    segments = Segments.of(seq)
    q = torch.randn(b, h, t, d, generator=g, dtype=torch.float64, requires_grad=True)
    keys = [torch.randn(b, kv, t, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(steps)]
    values = [torch.randn(b, kv, t, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(steps)]

    def f(q, *kv_pairs):
        cache = TTTCache()
        for k, v in zip(kv_pairs[:steps], kv_pairs[steps:]):
            cache.append(k, v)
        return ttt_attention(q, cache, segments, fused=False)

    assert torch.autograd.gradcheck(f, (q, *keys, *values))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: flash attention's varlen kernel")
def test_flash_varlen_matches_the_reference():
    dev = torch.device("cuda")
    seq = torch.tensor([[0] * 100 + [1] * 60 + [-1] * 8]).to(dev)
    segments = Segments.of(seq)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, 8, 168, 64, device=dev, generator=g, dtype=torch.bfloat16, requires_grad=True)
    cache = TTTCache()
    for _ in range(3):
        cache.append(torch.randn(1, 2, 168, 64, device=dev, generator=g, dtype=torch.bfloat16, requires_grad=True),
                     torch.randn(1, 2, 168, 64, device=dev, generator=g, dtype=torch.bfloat16, requires_grad=True))
    outs = []
    for fused in (True, False):
        out = ttt_attention(q, cache, segments, fused=fused)
        grads = torch.autograd.grad(out.float().square().sum(), [q, *cache.keys, *cache.values])
        outs.append((out, grads))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=2e-2, atol=2e-2)
    for a, b in zip(outs[0][1], outs[1][1]):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2)


def test_auto_attention_is_varlen_on_cuda():
    from eagle3_ray.train.step import resolve_attention

    assert resolve_attention("auto", "cuda") == "varlen"
    assert resolve_attention("varlen", "cpu") == "varlen"  # runs anywhere (the reference off CUDA)


def test_the_prefetch_thread_finds_the_segments_on_the_host():
    """row_to_batch(segments=True) adds the pack's Segments (found before the device copy, so that the
    step needs no device sync); ttt_forward uses them and gives the loss it computes without them."""
    import numpy as np

    from eagle3_ray.features.record import bf16_to_uint16
    from eagle3_ray.train.data import row_to_batch

    packed = _pack([_sample(n, 70 + n) for n in (9, 4, 7)], pad_to=24)
    row = {k: bf16_to_uint16(v[0].to(torch.bfloat16)) if k.endswith("_hidden")
           else v[0].numpy().astype(np.bool_ if k == "loss_mask" else np.int64) for k, v in packed.items()}
    batch = row_to_batch(row, torch.device("cpu"), torch.float32, segments=True)
    found, again = batch["segments"], Segments.of(batch["seq_ids"])
    assert torch.equal(found.cu_seqlens, again.cu_seqlens) and found.cu_seqlens.tolist() == [0, 9, 13, 20, 24]
    d = _drafter(seed=6)
    with torch.no_grad():
        ahead = ttt_forward(d, batch, _lm_head(d, seed=6), ttt_steps=3, attention="varlen")
        found_here = ttt_forward(d, {k: v for k, v in batch.items() if k != "segments"}, _lm_head(d, seed=6),
                                 ttt_steps=3, attention="varlen")
    assert ahead.loss.item() == found_here.loss.item()


def test_varlen_is_chosen_only_where_flash_attention_runs():
    from eagle3_ray.errors import ConfigError
    from eagle3_ray.train.step import resolve_attention

    assert resolve_attention("auto", "cuda", head_dim=128, capability=(9, 0)) == "varlen"
    assert resolve_attention("auto", "cuda", head_dim=128, capability=(7, 5)) == "sdpa"  # e.g. a T4
    assert resolve_attention("auto", "cuda", head_dim=100) == "sdpa"
    with pytest.raises(ConfigError, match="train.attention=varlen needs flash attention.*use sdpa or auto"):
        resolve_attention("varlen", "cuda", head_dim=128, capability=(7, 0))


def test_varlen_under_autocast_matches_sdpa_under_autocast():
    """fp32 weights under bf16 autocast (StepConfig(autocast=True)): varlen takes q, k, v in the
    autocast dtype, as sdpa does there, and keeps its own fp32 parts in fp32."""
    batch = _pack([_sample(n, 90 + n) for n in (11, 6, 8)], pad_to=28)
    losses = {}
    for attention in ("sdpa", "varlen"):
        d = _drafter(seed=7)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ttt_forward(d, batch, _lm_head(d, seed=7), ttt_steps=3, attention=attention)
        out.loss.backward()
        losses[attention] = out.loss.item()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in d.parameters() if p.requires_grad)
    assert losses["varlen"] == pytest.approx(losses["sdpa"], rel=2e-2)
