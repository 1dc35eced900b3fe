"""The one drafter training step: TTT unroll, loss, backward, optimizer step, gradient accumulation.

`TrainStep` runs one micro-batch through `drafter/ttt.py`'s `ttt_forward` and hands the loss to an
engine: a DeepSpeed engine (the Ray Train worker, train/loop.py) or a plain torch model + optimizer
wrapped in `TorchEngine` (benchmarks, and anything that trains in one process). Both engines scale the
loss by 1/grad_accum, clip the gradient norm and step the optimizer (and LR schedule) on every
grad_accum-th micro-batch. `TrainStep.evaluate` gives the held-out metrics with the same forward.

No Ray here: the same step runs inside a Ray Train worker and in a bare process.

    engine = TorchEngine(drafter, adamw(params, lr=1e-3), scheduler, grad_accum=1, grad_clip=0.5)
    step = TrainStep(engine, lm_head, StepConfig(ttt_steps=7, autocast=True, row_tokens=2048))
    out = step(batch)          # TTTOutput; step.stepped: the optimizer stepped after this batch
    held = step.evaluate((batch, tokens) for ...)   # val_loss, val_tau, ..., val_tau_walk3, val_tokens
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterable, Protocol

import torch

from eagle3_ray.drafter.ttt import ttt_forward
from eagle3_ray.drafter.ttt_metrics import WALK_STEPS, TTTOutput, held_out_metrics, held_out_sums
from eagle3_ray.errors import ConfigError
from eagle3_ray.train.context_parallel import CP_ATTENTION, ContextParallelError

# AdamW settings of every drafter optimizer (the DeepSpeed config's and `adamw`'s).
ADAMW_BETAS = (0.9, 0.95)
ADAMW_EPS = 1e-8


class Engine(Protocol):
    """What the step uses of a training engine (DeepSpeed's `DeepSpeedEngine` has it all)."""

    module: torch.nn.Module

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self) -> None: ...

    def get_lr(self) -> list[float]: ...


@dataclass(frozen=True)
class StepConfig:
    """How one micro-batch runs through `ttt_forward` (see its docstring for the arguments)."""

    ttt_steps: int = 7
    loss_decay: float = 0.8
    attention: str = "sdpa"  # "sdpa", "varlen" or "flex" (resolve_attention turns "auto" into one)
    pad_to: int | None = None  # flex: pad every pack to this many tokens (one compiled kernel)
    row_tokens: int | None = None  # sdpa: split a packed [1, N] batch into rows; None when already split
    grad_accum: int = 1  # micro-batches per optimizer step (`stepped` counts them)
    autocast: bool = False  # bf16 autocast on CUDA, for fp32 weights (DeepSpeed's bf16 module needs none)
    loss_kernel: str = "auto"  # "triton", "torch", or "auto" (triton on CUDA where it imports; drafter/soft_ce.py)
    loss_chunk_tokens: int = 0  # logits and soft cross-entropy in checkpointed chunks of this many tokens; 0 = whole
    # TTT steps whose activations the backward recomputes (activation checkpointing): True = all, k = the first k
    recompute_steps: bool | int = False

    @classmethod
    def from_train(cls, t, attention: str, row_tokens: int | None = None, autocast: bool = False,
                   loss_kernel: str | None = None) -> StepConfig:
        """From a `config.TrainConfig` (`attention` resolved; `row_tokens` only where the batches are
        not laid out as rows already, as the worker's prefetch thread does; `loss_kernel` resolved, or
        None for ``t.loss_kernel``)."""
        return cls(ttt_steps=t.ttt_steps, loss_decay=t.loss_decay, attention=attention, pad_to=t.batch_tokens,
                   row_tokens=row_tokens, grad_accum=t.grad_accum, autocast=autocast,
                   loss_kernel=loss_kernel or t.loss_kernel, loss_chunk_tokens=t.loss_chunk_tokens,
                   recompute_steps=t.recompute_ttt_steps)


def resolve_attention(setting: str, device_type: str, head_dim: int | None = None,
                      capability: tuple[int, int] | None = None, context_parallel: int = 1) -> str:
    """``train.attention`` -> the implementation to run.

    ``auto``: varlen on CUDA (each sample's causal prefix through flash attention's varlen kernel,
    the TTT diagonal apart: the fastest, benchmarks/results/README.md "The H200 session of
    2026-12-04"), sdpa elsewhere (varlen's CPU path computes every score explicitly) and on a GPU
    or drafter shape flash attention does not take (``head_dim``, the GPU's compute ``capability``:
    unknown ones are taken as supported). flex trains only on CUDA (no CPU backward). With
    ``context_parallel`` > 1 only sdpa and varlen gather keys over the group (flex is refused).
    """
    if context_parallel > 1 and setting not in ("auto", *CP_ATTENTION):
        raise ContextParallelError(
            f"train.attention={setting} does not gather keys over a context-parallel group; use train.attention="
            "varlen (CUDA), sdpa, or auto, or set train.context_parallel=1")
    flash = flash_varlen_supported(head_dim, capability)
    if setting == "auto":
        return "varlen" if device_type == "cuda" and flash else "sdpa"
    if setting == "flex" and device_type != "cuda":
        raise ConfigError("train.attention=flex needs CUDA (flex_attention has no CPU backward); use sdpa or auto")
    if setting == "varlen" and device_type == "cuda" and not flash:
        raise ConfigError(
            f"train.attention=varlen needs flash attention on the GPU (compute capability 8.0 or newer, the "
            f"drafter's head_dim a multiple of 8 up to 256; here {capability}, head_dim {head_dim}); use sdpa or auto"
        )
    return setting


def flash_varlen_supported(head_dim: int | None, capability: tuple[int, int] | None) -> bool:
    """Whether flash attention's kernels take this head size on this GPU (None: not known, taken as yes)."""
    if head_dim is not None and (head_dim % 8 or head_dim > 256):
        return False
    return capability is None or tuple(capability) >= (8, 0)


def adamw(params, lr: float, weight_decay: float = 0.0, fused: bool | None = None) -> torch.optim.AdamW:
    """The drafter's AdamW; fused (one kernel for all parameters) when they are on CUDA."""
    params = list(params)
    if fused is None:
        fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=ADAMW_BETAS, eps=ADAMW_EPS, weight_decay=weight_decay, fused=fused)


class TorchEngine:
    """A plain torch module + optimizer behind the part of DeepSpeed's engine interface the step uses.

    As DeepSpeed does: `backward` scales the loss by 1/grad_accum; `step` counts micro-batches and on
    every grad_accum-th clips the gradient norm to `grad_clip`, steps the optimizer, zeroes the
    gradients and steps `lr_scheduler`.
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler=None,
                 grad_accum: int = 1, grad_clip: float | None = None):
        if grad_accum < 1:
            raise ValueError(f"grad_accum must be at least 1, got {grad_accum}")
        self.module, self.optimizer, self.lr_scheduler = module, optimizer, lr_scheduler
        self.grad_accum, self.grad_clip = grad_accum, grad_clip
        self.micro_steps = 0
        self._params = [p for g in optimizer.param_groups for p in g["params"]]

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.grad_accum if self.grad_accum > 1 else loss).backward()

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.grad_accum == 0

    def step(self) -> None:
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self._params, self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]


class TrainStep:
    """The training step over an `Engine` (DeepSpeed's, or `TorchEngine`) and the frozen target lm_head.

    ``cp`` (`train.context_parallel.ContextParallel`): batches that are context-parallel shards (their
    ``cp_shard``) run with its group; the rank's loss is backpropagated times the group's size, since the
    engine averages gradients over every rank of the world and the group's gradient is the sum over its
    ranks (train/context_parallel.py). Held-out evaluation runs whole packs, without it."""

    def __init__(self, engine: Engine, lm_head: torch.Tensor, cfg: StepConfig, cp=None):
        self.engine, self.lm_head, self.cfg = engine, lm_head, cfg
        self.cp = cp if cp is not None and cp.size > 1 else None
        self.micro_steps = 0

    @property
    def drafter(self) -> torch.nn.Module:
        return self.engine.module

    def forward(self, batch: dict[str, torch.Tensor], walk_steps: int = 0) -> TTTOutput:
        """The TTT loss and stats of one batch (on the drafter's device), with gradients unless the
        caller disables them; ``walk_steps``: also the walked chain (`drafter.ttt_metrics.chain_walk`)."""
        c = self.cfg
        cp = self.cp if "cp_shard" in batch else None
        with self._autocast(batch["input_ids"]):
            return ttt_forward(self.engine.module, batch, self.lm_head, c.ttt_steps, c.loss_decay, c.attention,
                               pad_to=c.pad_to, row_tokens=c.row_tokens, loss_kernel=c.loss_kernel,
                               walk_steps=walk_steps, loss_chunk_tokens=c.loss_chunk_tokens,
                               recompute_steps=c.recompute_steps, cp=cp)

    def __call__(self, batch: dict[str, torch.Tensor]) -> TTTOutput:
        """Forward, backward, and the engine's step (the optimizer steps at the end of each window)."""
        out = self.forward(batch)
        shard = "cp_shard" in batch and self.cp is not None
        self.engine.backward(out.loss * self.cp.size if shard else out.loss)
        self.engine.step()
        self.micro_steps += 1
        return out

    @property
    def stepped(self) -> bool:
        """The last call ended a gradient-accumulation window: the optimizer stepped."""
        return self.micro_steps > 0 and self.micro_steps % self.cfg.grad_accum == 0

    def held_out_sums(self, batches: Iterable[tuple[dict[str, torch.Tensor], int]]) -> torch.Tensor:
        """`drafter.ttt_metrics.held_out_sums` of (batch, tokens) pairs through this step's forward, the chain
        of `WALK_STEPS` drafts (at most ttt_steps) walked over their assistant turns; sums, so that
        ranks can add theirs before `held_out_metrics`."""
        walk = min(WALK_STEPS, self.cfg.ttt_steps)
        return held_out_sums(self.engine.module, batches, lambda b: self.forward(b, walk_steps=walk))

    def evaluate(self, batches: Iterable[tuple[dict[str, torch.Tensor], int]]) -> dict[str, float]:
        """val_loss, val_tau, val_acc_0, val_tau_chain3, val_tokens over (batch, tokens) pairs, token-weighted,
        and val_tau_walk3 (the walked chain's tokens per cycle)."""
        return held_out_metrics(self.held_out_sums(batches))

    def _autocast(self, ids: torch.Tensor):
        if self.cfg.autocast and ids.is_cuda:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()
