"""A CPU target's verify forward: its linear layers over a few rows as ``W @ xᵀ``.

A verify forward multiplies every weight matrix by the few tokens of a draft (a chain's root and K
drafts, or a tree's nodes). On a CPU, torch's ``linear`` of 2-64 rows (``x @ Wᵀ``) takes a general
GEMM path that costs far more than the matrix-vector product of one row, so a 4-token verify of
SmolLM2-135M cost about 1.6 plain decoding steps (`benchmarks/results/product8_mt128_cpu_report/`,
"Where the time goes"): a chain (K=3) cycle cost 1.8 plain steps, so a drafter needed tau 1.8 only to
break even. The same product written ``(W @ xᵀ)ᵀ`` runs close to the one-row product's cost;
`benchmarks/cpu_linear.py` measures both over the target's layers by row count.

Only the operand order changes, not the function: the rows' dot products are summed in another
order, within fp32 rounding of the other path (the bench's divergence audit tells a near-tie that
rounds differently from a bug). Plain decoding (one row) and prompts of more than NARROW_MAX_ROWS
tokens keep torch's own path; so does every device but the CPU.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

NARROW_MAX_ROWS = 64  # verify widths: a chain of K drafts, a tree's total_tokens + 1


def narrow_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as ``(weight @ xᵀ)ᵀ``: x [..., in], weight [out, in] -> [..., out]."""
    rows = x.reshape(-1, x.shape[-1])  # [R, in]
    out = (weight @ rows.T).T.contiguous()  # [R, out]: later views (heads) need it contiguous
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


class _NarrowLinearMode(TorchFunctionMode):
    """Routes ``F.linear`` of 2..NARROW_MAX_ROWS rows to ``narrow_linear`` (inside the mode's handler
    the mode is off, so the ops it calls run as usual)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, bias = _linear_args(*args, **kwargs)
            if 1 < x.numel() // x.shape[-1] <= NARROW_MAX_ROWS:
                return narrow_linear(x, weight, bias)
        return func(*args, **kwargs)


def _linear_args(input, weight, bias=None):  # F.linear's own parameter names
    return input, weight, bias


def narrow_rows(device: torch.device, rows: int):
    """A context for a target forward of ``rows`` new tokens on ``device``: on the CPU with 2 to
    NARROW_MAX_ROWS rows, its linear layers run as ``narrow_linear``; otherwise nothing changes."""
    if device.type != "cpu" or not 1 < rows <= NARROW_MAX_ROWS:
        return contextlib.nullcontext()
    return _NarrowLinearMode()
