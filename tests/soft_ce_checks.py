"""Checks of the Triton soft cross-entropy (drafter/soft_ce.py) against the torch expression, shared by
the CPU test (run in a subprocess under Triton's interpreter, TRITON_INTERPRET=1, which must be set
before Triton compiles anything) and the CUDA test (in process, compiled for the GPU).

    TRITON_INTERPRET=1 python -c "from tests.soft_ce_checks import run_all; run_all('cpu')"
"""

from __future__ import annotations

import torch

from eagle3_ray.drafter.soft_ce import BLOCK_V, soft_cross_entropy


def _both(z: torch.Tensor, p: torch.Tensor, shift: int, dce: torch.Tensor):
    """(ce, pred, dz) of each kernel for the same inputs."""
    out = {}
    for kernel in ("triton", "torch"):
        zk = z.detach().clone().requires_grad_()
        ce, pred = soft_cross_entropy(zk, p, shift, kernel)
        (ce * dce).sum().backward()
        out[kernel] = (ce.detach(), pred, zk.grad)
    return out["triton"], out["torch"]


def check_kernel(device: str, b: int, t: int, v: int, shift: int, dtype: torch.dtype, seed: int = 0) -> None:
    """ce and pred as the torch expression's; the logits' gradient within the dtype's rounding."""
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(b, t, v, generator=g) * 3).to(dtype).to(device)
    p = torch.softmax(torch.randn(b, t, v, generator=g) * 2, dim=-1).to(device)
    dce = torch.randn(b, t, generator=g).to(device)
    (ce, pred, dz), (ce_ref, pred_ref, dz_ref) = _both(z, p, shift, dce)
    assert ce.dtype == torch.float32 and pred.dtype == torch.long and dz.dtype == dtype
    torch.testing.assert_close(ce, ce_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(pred, pred_ref), (pred, pred_ref)
    torch.testing.assert_close(dz, dz_ref)  # the dtype's default tolerance (bf16: 1.6e-2 relative)
    if shift >= t:  # no row has a target: no loss, no gradient
        assert not ce.any() and not dz.any()
    else:
        assert not ce[:, t - shift:].any() and not dz[:, t - shift:].any()
        assert dz[:, : t - shift].abs().amax() > 0


def check_ties(device: str) -> None:
    """The argmax keeps the first of equal maxima, within a block and across blocks, as torch.argmax."""
    v = BLOCK_V + 200
    z = torch.zeros(1, 3, v)
    z[0, 1, [7, 9]] = 2.0  # a tie inside the first block
    z[0, 2, [5, BLOCK_V + 3]] = 2.0  # a tie across blocks
    p = torch.full((1, 3, v), 1.0 / v)
    (ce, pred, _), (ce_ref, pred_ref, _) = _both(z.to(device), p.to(device), 0, torch.ones(1, 3, device=device))
    assert pred.tolist() == [[0, 7, 5]] == pred_ref.tolist()
    torch.testing.assert_close(ce, ce_ref)


def check_ttt(device: str) -> None:
    """ttt_forward with each kernel: the same loss, metrics and gradients (a pack of 3 samples + padding);
    the Triton kernel also over chunks of 8 tokens with recomputed steps (the long-sample options)."""
    from tests.test_ttt import _drafter, _lm_head, _pack, _sample, assert_same_ttt

    from eagle3_ray.drafter.ttt import ttt_forward

    batch = {k: v.to(device) for k, v in _pack([_sample(n, 60 + n) for n in (11, 4, 9)], pad_to=30).items()}
    res = {}
    long = dict(loss_chunk_tokens=8, recompute_steps=True)
    for name, kernel, options in (("triton", "triton", {}), ("torch", "torch", {}), ("long", "triton", long)):
        d = _drafter(seed=8)
        lm_head = _lm_head(d, seed=8).to(device)
        d = d.to(device)
        out = ttt_forward(d, batch, lm_head, ttt_steps=3, attention="sdpa", loss_kernel=kernel, **options)
        out.loss.backward()
        res[name] = (out, [p.grad for p in d.parameters() if p.requires_grad])
    assert_same_ttt(*res["triton"], *res["torch"], steps=3)
    assert_same_ttt(*res["long"], *res["torch"], steps=3)


def run_all(device: str) -> None:
    for b, t, v, shift, dtype in [
        (2, 9, 1000, 3, torch.bfloat16),  # rows of one block; targets from the next rows of the same batch row
        (1, 5, 2 * BLOCK_V + 37, 0, torch.float32),  # three blocks, the last one partial
        (2, 6, BLOCK_V + 1, 5, torch.bfloat16),  # one row per batch row has a target
        (2, 4, 300, 4, torch.float32),  # shift >= T: nothing to score
    ]:
        check_kernel(device, b, t, v, shift, dtype)
    check_ties(device)
    check_ttt(device)
    print("soft_ce checks passed on", device)
