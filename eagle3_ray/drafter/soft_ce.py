"""The TTT loss's soft cross-entropy, and the drafter's prediction, from one pass over the logits.

For draft logits ``z`` [B, T, V] and the target's draft-vocab distribution ``p`` [B, T, V] (fp32),
TTT step i needs, per position t (s = i + 1, the step's shift):

    ce[t]   = -sum_v p[t + s, v] * log_softmax(z[t])_v      (0 where t + s >= T)
    pred[t] = argmax_v z[t]

Two implementations of the same function (``kernel``):

- ``"torch"``: the plain expression, any device. Autograd keeps the fp32 log-probabilities
  ([B, T, V]) and the backward makes several more passes over them.
- ``"triton"`` (CUDA): one Triton kernel per direction, one program per row. The forward reads the
  logits and the shifted targets once (an online log-sum-exp over blocks of the vocabulary) and
  writes ce, the row's log-sum-exp, sum(p) and the argmax; the backward reads them again and writes
  ``dz = (softmax(z) * sum(p) - p) * dce`` in the logits' dtype. No [B, T, V] temporaries and no
  compiler at run time (no guards to check per call): a launch per direction.

`resolve_loss_kernel` turns ``train.loss_kernel`` (auto, triton, torch) into one of them.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from eagle3_ray.errors import ConfigError

BLOCK_V = 4096  # vocabulary entries a program reads at a time
NUM_WARPS = 8


def soft_cross_entropy(
    logits: torch.Tensor, target_p: torch.Tensor, shift: int, kernel: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ce [B, T] fp32, differentiable in ``logits``; pred [B, T] long): see the module docstring.

    ``logits`` [B, T, V] any float dtype; ``target_p`` [B, T, V] fp32, not differentiated; ``shift``
    >= 0: row t is scored against ``target_p[:, t + shift]``. ``kernel``: "torch", "triton" or "auto"
    (`resolve_loss_kernel` for the logits' device).
    """
    if kernel == "auto":
        kernel = resolve_loss_kernel("auto", logits.device.type)
    if kernel == "triton":
        return _TritonSoftCE.apply(logits, target_p, shift)
    if kernel != "torch":
        raise ValueError(f"unknown soft cross-entropy kernel {kernel!r}")
    logp = logits.float().log_softmax(dim=-1)
    t = logits.shape[1]
    n = max(t - shift, 0)  # rows with a target
    ce = -(target_p[:, shift : shift + n] * logp[:, :n]).sum(dim=-1)
    return torch.nn.functional.pad(ce, (0, t - n)), logp.argmax(dim=-1)


def resolve_loss_kernel(setting: str, device_type: str) -> str:
    """``train.loss_kernel`` -> the implementation to run: ``auto`` is triton on CUDA where Triton
    imports, torch elsewhere; an explicit ``triton`` without CUDA or Triton is a `ConfigError`."""
    if setting == "auto":
        return "triton" if device_type == "cuda" and triton_available() else "torch"
    if setting == "triton" and (device_type != "cuda" or not triton_available()):
        why = "Triton is not installed" if device_type == "cuda" else f"training runs on {device_type}"
        raise ConfigError(f"train.loss_kernel=triton needs CUDA and Triton ({why}); use torch or auto")
    return setting


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class _TritonSoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target_p, shift):
        assert logits.shape == target_p.shape, (logits.shape, target_p.shape)
        logits, target_p = logits.contiguous(), target_p.contiguous()
        b, t, v = logits.shape
        rows = b * t
        ce = torch.empty(b, t, dtype=torch.float32, device=logits.device)
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
        p_sum = torch.empty(rows, dtype=torch.float32, device=logits.device)
        pred = torch.empty(b, t, dtype=torch.int32, device=logits.device)
        if rows:
            _kernels().forward[(rows,)](logits, target_p, ce, lse, p_sum, pred, t, shift,
                                        V=v, BLOCK=BLOCK_V, num_warps=NUM_WARPS)
        ctx.save_for_backward(logits, target_p, lse, p_sum)
        ctx.shift = shift
        pred = pred.long()
        ctx.mark_non_differentiable(pred)
        return ce, pred

    @staticmethod
    def backward(ctx, grad_ce, _grad_pred):
        logits, target_p, lse, p_sum = ctx.saved_tensors
        b, t, v = logits.shape
        grad = torch.empty_like(logits)
        if b * t:
            grad_ce = grad_ce.float().contiguous()
            _kernels().backward[(b * t,)](logits, target_p, lse, p_sum, grad_ce, grad, t, ctx.shift,
                                          V=v, BLOCK=BLOCK_V, num_warps=NUM_WARPS)
        return grad, None, None


@functools.cache
def _kernels():
    """The two Triton kernels, defined on first use: this module imports without Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def forward(z_ptr, p_ptr, ce_ptr, lse_ptr, psum_ptr, pred_ptr, T, shift, V: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        p_cols = tl.where((row % T) + shift < T, V, 0)  # targets past the batch row's end read as 0
        z_row = z_ptr + row * V
        p_row = p_ptr + (row + shift) * V
        m = float("-inf")
        s = 0.0
        pz = 0.0
        ps = 0.0
        best = float("-inf")
        best_at = 0
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < V
            z = tl.load(z_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
            p = tl.load(p_row + cols, mask=cols < p_cols, other=0.0)
            block_max = tl.max(z, axis=0)
            block_at = tl.argmax(z, axis=0) + start
            new_m = tl.maximum(m, block_max)
            s = s * tl.exp(m - new_m) + tl.sum(tl.exp(z - new_m), axis=0)
            m = new_m
            pz += tl.sum(p * tl.where(ok, z, 0.0), axis=0)
            ps += tl.sum(p, axis=0)
            better = block_max > best  # strict: ties keep the lowest index, as torch.argmax
            best_at = tl.where(better, block_at, best_at)
            best = tl.maximum(best, block_max)
        lse = m + tl.log(s)
        tl.store(ce_ptr + row, lse * ps - pz)
        tl.store(lse_ptr + row, lse)
        tl.store(psum_ptr + row, ps)
        tl.store(pred_ptr + row, best_at)

    @triton.jit
    def backward(z_ptr, p_ptr, lse_ptr, psum_ptr, dce_ptr, dz_ptr, T, shift, V: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        p_cols = tl.where((row % T) + shift < T, V, 0)
        z_row = z_ptr + row * V
        p_row = p_ptr + (row + shift) * V
        lse = tl.load(lse_ptr + row)
        ps = tl.load(psum_ptr + row)
        dce = tl.load(dce_ptr + row)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < V
            z = tl.load(z_row + cols, mask=ok, other=0.0).to(tl.float32)
            p = tl.load(p_row + cols, mask=cols < p_cols, other=0.0)
            dz = (tl.exp(z - lse) * ps - p) * dce
            tl.store(dz_ptr + row * V + cols, dz.to(dz_ptr.dtype.element_ty), mask=ok)

    return SimpleNamespace(forward=forward, backward=backward)
