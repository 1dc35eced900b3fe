"""The TTT loss's soft cross-entropy (drafter/soft_ce.py): the Triton kernels against the torch expression.

The kernels run here in Triton's CPU interpreter (a subprocess: TRITON_INTERPRET must be set before
Triton compiles anything), and compiled on CUDA where there is a GPU; the checks are the same
(tests/soft_ce_checks.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3_ray.config import TrainConfig
from eagle3_ray.drafter.soft_ce import resolve_loss_kernel, soft_cross_entropy, triton_available
from eagle3_ray.errors import ConfigError
from tests import soft_ce_checks

ROOT = Path(__file__).resolve().parents[1]


def test_the_triton_kernels_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", "from tests.soft_ce_checks import run_all; run_all('cpu')"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    assert "soft_ce checks passed on cpu" in r.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the kernels compiled for a GPU")
def test_the_triton_kernels_on_cuda():
    soft_ce_checks.run_all("cuda")
    # the 8B/Kimi drafter's step: a 2048-token pack over a 32,000-token draft vocab, bf16 logits
    soft_ce_checks.check_kernel("cuda", 1, 2048, 32000, 3, torch.bfloat16)


def test_torch_kernel_is_the_plain_expression():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 7, 50, generator=g, requires_grad=True)
    p = torch.softmax(torch.randn(2, 7, 50, generator=g), dim=-1)
    ce, pred = soft_cross_entropy(z, p, 2, "torch")
    logp = z.log_softmax(-1)
    shifted = torch.cat([p[:, 2:], torch.zeros(2, 2, 50)], dim=1)
    torch.testing.assert_close(ce, -(shifted * logp).sum(-1))
    assert torch.equal(pred, logp.argmax(-1))


def test_loss_kernel_choice():
    assert triton_available()  # a dev dependency (pyproject's dev extra): its absence must fail, not skip
    assert resolve_loss_kernel("auto", "cpu") == "torch"
    assert resolve_loss_kernel("auto", "cuda") == "triton"
    assert resolve_loss_kernel("torch", "cuda") == "torch"
    with pytest.raises(ConfigError, match="loss_kernel=triton needs CUDA"):
        resolve_loss_kernel("triton", "cpu")
    assert TrainConfig().loss_kernel == "auto"
    with pytest.raises(ValueError):
        TrainConfig(loss_kernel="fused")
