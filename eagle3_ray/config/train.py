"""The `train` section of the schema: the drafter's training (Ray Train + DeepSpeed), its held-out
evaluation, the best checkpoint kept, and the experiment trackers."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from eagle3_ray.config.sections import Section


class DrafterShape(Section):
    """The drafter's decoder layer; each field defaults to the target's."""

    hidden_size: int | None = Field(None, description="Drafter hidden size. Default: the target's.")
    num_attention_heads: int | None = Field(None, description="Attention heads. Default: the target's.")
    num_key_value_heads: int | None = Field(None, description="Key/value heads (GQA). Default: the target's.")
    head_dim: int | None = Field(None, description="Dimension of one head. Default: the target's.")
    intermediate_size: int | None = Field(None, description="SwiGLU MLP width. Default: the target's.")


# The experiment trackers train.trackers takes -> (the module a run needs, the pip extra that installs it).
TRACKERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow"),
    "wandb": ("wandb", "wandb"),
}


class TrackingConfig(Section):
    """Where train.trackers log (eagle3_ray/train/trackers.py)."""

    project: str | None = Field(None, description="MLflow experiment and W&B project. Default: the config's name.")
    run_name: str | None = Field(None, description="MLflow and W&B run name. Default: the config's name.")
    mlflow_tracking_uri: str | None = Field(
        None, description="MLflow tracking URI. Default: $MLFLOW_TRACKING_URI as the training workers see it, "
        "else a local file store in <train out>/mlruns."
    )
    wandb_mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="W&B mode. Default: W&B's own ($WANDB_MODE as the training workers see it, else "
        "online, which needs WANDB_API_KEY or `wandb login`). offline writes <train out>/wandb/ for `wandb sync`."
    )


class TrainConfig(Section):
    mode: Literal["offline", "online", "hybrid"] = Field(
        "offline", description="offline: extract to the feature store, then train on it; online: stream "
        "captured features into the trainer, no disk; hybrid: stream epoch 0 and write the store, later "
        "epochs read the store."
    )
    ttt_steps: int = Field(7, ge=1, description="Training-time-test unroll length.")
    attention: Literal["auto", "sdpa", "varlen", "flex"] = Field(
        "auto", description="TTT attention, the same function four ways: varlen (each sample's causal prefix "
        "through flash attention's varlen kernel, the TTT diagonal computed apart; CUDA, or a slow reference "
        "elsewhere), sdpa (dense mask over the whole TTT cache, any device), flex (block-sparse "
        "flex_attention, compiled; CUDA only; 5x slower than sdpa on an H200). auto = varlen on CUDA, sdpa "
        "elsewhere."
    )
    loss_kernel: Literal["auto", "triton", "torch"] = Field(
        "auto", description="The TTT loss's soft cross-entropy, the same function two ways: triton (one fused "
        "kernel per direction over the drafter's logits; CUDA) or torch (plain ops, any device; keeps fp32 "
        "copies of the logits for the backward). auto = triton on CUDA where Triton imports, torch elsewhere."
    )
    loss_chunk_tokens: int = Field(
        0, ge=0, description="Long samples: each TTT step's draft logits and soft cross-entropy over chunks of at "
        "most this many tokens, each recomputed in the backward (activation checkpointing), so no step keeps "
        "[tokens, draft vocab] logits for the backward (14.7 GB at 32K tokens, 7 steps, draft vocab 32000); costs "
        "one more lm_head forward. The same loss and gradients. 0 = off (docs/drafter.md, \"Long samples\")."
    )
    recompute_ttt_steps: bool | int = Field(
        False, description="Long samples: recompute TTT steps' drafter activations in the backward (activation "
        "checkpointing) instead of keeping them; of a recomputed step only its hidden state and keys/values are "
        "kept. true = every step, false or 0 = none, k (1..ttt_steps) = the first k steps (0..k-1): recompute "
        "only as many as the sample needs to fit. Each recomputed step costs one more drafter forward of that "
        "step. The same loss and gradients."
    )
    compile: bool = Field(False, description="torch.compile the drafter layer (GPU training; ~1 min warm-up).")
    loss_decay: float = Field(0.8, gt=0.0, le=1.0, description="Weight of step i is decay**i.")
    lr: float = Field(1e-4, gt=0.0, description="Peak learning rate of AdamW (docs/drafter.md, \"Learning rate\").")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Cosine floor as a fraction of lr.")
    warmup_steps: int = Field(50, ge=0, description="Optimizer steps of linear warmup before the cosine decay "
                              "(unless warmup_ratio).")
    warmup_ratio: float | None = Field(
        None, ge=0.0, lt=1.0, description="Warmup as a share of the run's optimizer steps (SpecForge's default "
        "is 0.015), overriding warmup_steps: the same share of the schedule whatever the data size. A fixed "
        "warmup_steps longer than a short run leaves its learning rate rising to the end, never decayed."
    )
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    grad_clip: float = Field(0.5, gt=0.0, description="Gradient norm clipping.")
    epochs: int = Field(1, ge=1, description="Passes over the training samples.")
    max_steps: int | None = Field(None, ge=1, description="Stop after N optimizer steps.")
    val_share: float = Field(
        0.0, ge=0.0, lt=1.0, description="Share of the feature store's samples held out of training (seeded "
        "by `seed`); their simulated tau (val_tau, val_acc_0, val_loss in metrics.jsonl) shows over-fitting "
        "as it happens. Offline mode only."
    )
    val_groups: dict[str, str] = Field(
        default_factory=dict, description="Named groups of samples, {name: regex}: a sample belongs to the first "
        "group whose regex matches its whole id (generate's copies are <id>#s<k>). Every held-out evaluation "
        "also reports each group's held-out samples apart (val_tau/<name>, val_tau_chain3/<name>, "
        "val_acc_0/<name>, val_tokens/<name> in metrics.jsonl). Offline mode only."
    )
    eval_only: list[str] = Field(
        default_factory=list, description="Groups of val_groups never trained on: all their samples are held out "
        "(val_share then splits the rest) and left out of the vocab map's token counts. For an evaluation set "
        "answered by the target with the training data, e.g. MT-bench's questions added to --data: its "
        "simulated tau at every evaluation, the tau-against-tokens curve of that set (docs/pipeline.md)."
    )
    eval_every: int = Field(
        200, ge=1, description="Optimizer steps between held-out evaluations (at the first logged step at or "
        "after each multiple, and at the last step)."
    )
    val_cache_bytes: int = Field(
        4 * 2**30, ge=0, description="Held-out rows a worker keeps in host memory after its first evaluation, "
        "up to this many bytes, so that later evaluations start no Ray Data execution (each one cost 14-16 s "
        "on an H200); over it, every evaluation reads the store again. 0 = always read."
    )
    batch_tokens: int = Field(4096, ge=1, description="Tokens per micro-batch per worker (packing budget).")
    row_tokens: int | None = Field(
        2048, ge=1, description="sdpa attention: lay a pack out as rows of whole samples of about this many "
        "tokens (the same loss; dense attention then costs rows x R^2 instead of N^2). None = one row."
    )
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    prefetch_packs: int = Field(
        2, ge=1, description="Packs each worker fetches and copies to its device ahead of the running step."
    )
    pack_loaders: int = Field(
        2, ge=1, description="Ray Data actors per training worker reading packs from the store (at the 8B "
        "shape a pack is 64 MB and a worker takes ~9 per second: two keep it fed)."
    )
    num_workers: int = Field(1, ge=1, description="Ray Train workers.")
    context_parallel: int = Field(
        1, ge=1, description="Context parallelism: workers per group that split one pack's tokens (one sample "
        "longer than a worker's memory holds); the groups (num_workers / context_parallel) are data parallel. A "
        "group trains on packs of up to context_parallel x batch_tokens tokens, split contiguously; the drafter's "
        "attention gathers the keys it needs, the loss and gradients are those of one worker (docs/drafter.md, "
        "\"Context parallelism\"). Needs num_workers a multiple of it, train.mode=offline, attention sdpa, varlen "
        "or auto. 1 = off."
    )
    cpus_per_worker: int = Field(1, ge=1, description="CPUs (and torch threads on CPU) per training worker.")
    use_gpu: bool | None = Field(None, description="Default: True when the cluster has GPUs.")
    zero_stage: int = Field(1, ge=0, le=3, description="DeepSpeed ZeRO stage.")
    log_every: int = Field(10, ge=1, description="Optimizer steps between metrics rows (metrics.jsonl, the "
                           "dashboard, train.trackers).")
    checkpoint_every: int = Field(200, ge=1, description="Optimizer steps between checkpoints.")
    max_failures: int = Field(3, ge=0, description="Ray Train FailureConfig.max_failures.")
    init_from: str | None = Field(None, description="Exported drafter dir to finetune (default: from scratch).")
    lm_head_init: Literal["random", "target"] = Field(
        "random", description="The drafter's lm_head at step 0: random (the default, EAGLE-3's), or target: the "
        "target's own lm_head rows of the draft vocabulary (row i = target token i + d2t[i]). The head then "
        "starts out reading a state as the target reads its last one. Measured on the demo's store it did not "
        "pay (held-out tau 1.33 against 1.35; docs/drafter.md says why). Needs the drafter's hidden size to be "
        "the target's. Not with init_from, which loads an lm_head."
    )
    keep_best: Literal["held_out_tau", "none"] = Field(
        "held_out_tau", description="held_out_tau: keep the checkpoint with the best held-out tau (val_tau) beside "
        "the latest; an evaluation that beats the earlier ones is checkpointed at once, and Ray Train keeps the "
        "two best by it (CheckpointConfig's score) and the latest. `eagle3-ray export` takes it unless given "
        "--which latest. Needs held-out samples (val_share or eval_only). none: the two latest only."
    )
    trackers: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(
        default_factory=list, description="Experiment trackers that get every metrics.jsonl row from rank 0: "
        "tensorboard (<train out>/tensorboard), mlflow (Ray's setup_mlflow), wandb (Ray's setup_wandb). Each is "
        "an optional extra: pip install 'eagle3-ray[tensorboard,mlflow,wandb]'."
    )
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="Where the trackers log.")
    seed: int = Field(0, description="Seed of the drafter's initialisation, the packing plan and the held-out split.")
    drafter: DrafterShape = Field(default_factory=DrafterShape, description="The drafter's shape.")

    @field_validator("val_groups")
    @classmethod
    def _group_patterns(cls, groups: dict[str, str]) -> dict[str, str]:
        for name, pattern in groups.items():
            if not name or "/" in name:
                raise ValueError(f"group name {name!r}: give a non-empty name without '/' (metrics are "
                                 "named val_tau/<name>)")
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"group {name!r}: {pattern!r} is not a regular expression ({e}); a group is "
                                 "{name: regex matching whole sample ids}, e.g. {mt_bench: 'mtbench-.*'}") from None
        return groups

    @field_validator("trackers")
    @classmethod
    def _trackers_once(cls, trackers: list[str]) -> list[str]:
        twice = sorted({name for name in trackers if trackers.count(name) > 1})
        if twice:
            raise ValueError(f"{twice} listed more than once; name each tracker once, e.g. [tensorboard, mlflow]")
        return trackers

    @model_validator(mode="after")
    def _context_parallel_layout(self) -> "TrainConfig":
        if self.context_parallel > 1:  # torch only then: the config loads without it otherwise
            from eagle3_ray.train.context_parallel import check_config

            check_config(self.context_parallel, self.num_workers, self.mode, self.attention, self.compile)
        return self

    @model_validator(mode="after")
    def _recomputed_steps(self) -> "TrainConfig":
        k = self.recompute_ttt_steps
        if not isinstance(k, bool) and not 0 <= k <= self.ttt_steps:
            raise ValueError(f"train.recompute_ttt_steps={k}: give true (every TTT step), false (none), or k from 0 "
                             f"to train.ttt_steps={self.ttt_steps} (the first k steps recomputed)")
        return self

    @model_validator(mode="after")
    def _one_lm_head_init(self) -> "TrainConfig":
        if self.lm_head_init == "target" and self.init_from:
            raise ValueError(f"train.lm_head_init=target with train.init_from={self.init_from}: the drafter of "
                             "init_from brings its own lm_head; leave lm_head_init at random to finetune it, or "
                             "unset init_from")
        return self

    @model_validator(mode="after")
    def _eval_only_groups(self) -> "TrainConfig":
        unknown = [g for g in self.eval_only if g not in self.val_groups]
        if unknown:
            raise ValueError(f"eval_only names {unknown}, which train.val_groups does not define "
                             f"({sorted(self.val_groups) or 'none'}); define each as val_groups.<name>=<regex>")
        return self

