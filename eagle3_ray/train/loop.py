"""The Ray Train worker loop: build, restore, loop (step, log, checkpoint), close.

Runs in every TorchTrainer worker. `deepspeed.initialize` wraps the drafter (ZeRO stage from the
config; bf16 on GPU, fp32 + gloo on CPU). Features arrive as packed micro-batches through
`ray.train.get_dataset_shard("train")`.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from eagle3_ray.progress import say
from eagle3_ray.train import checkpoint as ck


@dataclass
class TrainJob:
    """Everything a worker needs; built by the driver (trainer.py), JSON-safe."""

    train: dict[str, Any]  # TrainConfig.model_dump()
    drafter_config: dict[str, Any]  # DrafterConfig.to_dict()
    heads_path: str
    vocab_path: str
    out_dir: str  # metrics.jsonl goes here
    total_steps: int  # optimizer steps the plan allows (LR schedule length)
    identity: dict[str, Any] = field(default_factory=dict)  # must match to resume a checkpoint
    use_gpu: bool = False
    run: str = ""  # config `name`: the `run` tag of the dashboard metrics
    resume_from: str | None = None  # newest checkpoint on storage when the driver started (see _restore)
    val_packs: int = 0  # held-out packs in all (train.val_share), 0 = no evaluation
    val_datasets: list[str] = field(default_factory=list)  # "val_<rank>" of the ranks with held-out packs


def _ds_config(t: dict[str, Any], use_gpu: bool) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": t["grad_accum"],
        "gradient_clipping": t["grad_clip"],
        "zero_optimization": {"stage": t["zero_stage"]},
        "bf16": {"enabled": use_gpu},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": t["lr"], "betas": [0.9, 0.95], "eps": 1e-8,
                       "weight_decay": t["weight_decay"], "torch_adam": True},
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _build_drafter(job: TrainJob, device: torch.device):
    from eagle3_ray.data.vocab import load_vocab_map
    from eagle3_ray.drafter.export import init_drafter_from
    from eagle3_ray.drafter.model import DrafterConfig, Eagle3Drafter
    from eagle3_ray.engines.heads import load_target_heads

    torch.manual_seed(job.train["seed"])
    cfg = DrafterConfig.from_dict(job.drafter_config)
    drafter = Eagle3Drafter(cfg)
    embed, lm_head = load_target_heads(job.heads_path)
    d2t, t2d, _ = load_vocab_map(job.vocab_path)
    drafter.set_vocab_map(torch.from_numpy(d2t), torch.from_numpy(t2d))
    if job.train.get("init_from"):
        state = init_drafter_from(job.train["init_from"], cfg)
        drafter.load_state_dict(state, strict=False)
    dtype = torch.bfloat16 if job.use_gpu else torch.float32
    drafter.to(device)
    drafter.bind_embedding(embed.to(device).float())  # widened on the device, not in host memory
    return drafter, lm_head.to(device=device, dtype=dtype)


def resolve_attention(setting: str, device_type: str) -> str:
    """``train.attention`` -> the implementation to run; flex trains only on CUDA (no CPU backward).

    ``auto`` is sdpa everywhere: flex matches sdpa's loss and gradients, and is not the default
    until its speed in the training loop is known (benchmarks/results/README.md).
    """
    from eagle3_ray.errors import ConfigError

    if setting == "auto":
        return "sdpa"
    if setting == "flex" and device_type != "cuda":
        raise ConfigError("train.attention=flex needs CUDA (flex_attention has no CPU backward); use sdpa or auto")
    return setting


def _vote_group():
    """The process group of the per-step has-data vote: gloo, on the host. Through NCCL the vote's
    `.item()` would wait for every step the rank has queued on its GPU. None for one worker."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return None
    return torch.distributed.new_group(backend="gloo")


def _all_have_data(has: bool, group) -> bool:
    """Every rank must take the same number of steps; stop all when any rank runs dry."""
    if group is None:
        return has
    flag = torch.tensor([1 if has else 0], dtype=torch.int32)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _mean_over_ranks(metrics: dict[str, float], device: torch.device) -> dict[str, float]:
    if not torch.distributed.is_initialized():
        return metrics
    keys = sorted(metrics)
    t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    t /= torch.distributed.get_world_size()
    return dict(zip(keys, t.tolist()))


def _save_checkpoint(engine, drafter, job: TrainJob, step: int, consumed: list[str], metrics: dict) -> None:
    import ray.train

    from eagle3_ray.drafter.export import save_drafter_weights

    rank = ray.train.get_context().get_world_rank()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        engine.save_checkpoint(str(d), tag=ck.DS_TAG)
        ck.write_json(d / ck.DATA_STATE_DIR / f"rank-{rank}.json", sorted(consumed))
        gather = _gathered(engine, drafter)
        with gather:
            if rank == 0:
                save_drafter_weights(drafter, d)
                ck.write_json(d / ck.TRAIN_STATE, {"step": step, "metrics": metrics, "identity": job.identity,
                                                   "world_size": ray.train.get_context().get_world_size(),
                                                   "zero_stage": engine.zero_optimization_stage()})
        ray.train.report({**metrics, "step": step}, checkpoint=ray.train.Checkpoint.from_directory(tmp))


def _gathered(engine, drafter):
    """ZeRO-3 partitions parameters: gather them (on every rank) while rank 0 saves."""
    import contextlib

    if engine.zero_optimization_stage() == 3:
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(drafter.parameters()), modifier_rank=None)
    return contextlib.nullcontext()


def _restore(engine, job: TrainJob) -> tuple[int, set[str]]:
    import ray.train

    ckpt = ray.train.get_checkpoint()
    if ckpt is None and job.resume_from:
        # Ray Train registers a checkpoint only after its upload; a job killed in between leaves it on
        # storage but not in Ray Train's snapshot, and the rerun would silently start from step 0.
        ckpt = ray.train.Checkpoint.from_directory(job.resume_from)
    if ckpt is None:
        return 0, set()
    with ckpt.as_directory() as d:
        d = Path(d)
        state = ck.read_train_state(d)
        ck.check_identity(state.get("identity", {}), job.identity, d)
        engine.load_checkpoint(str(d), tag=ck.DS_TAG)
        consumed = ck.consumed_packs(d)
    say(f"[train] resumed at step {state['step']} ({len(consumed)} packs already consumed)")
    return int(state["step"]), consumed


def pack_stream(shard) -> Iterator[dict]:
    """One pass over a worker's dataset shard, as an iterator.

    ``DataIterator.iter_rows()`` returns an *iterable* that starts a new execution of the whole
    dataset on every ``iter()``, so the pass takes one iterator and draws every step's rows from it.
    """
    return iter(shard.iter_rows())


def _without_shm_comm_op() -> None:
    """On CPU, gradients are reduced through gloo. DeepSpeed would first compile its shared-memory
    allreduce op (C++, ~47 s on 2 cores the first time on a machine, then a build check in every
    worker) to speed up reductions that a drafter trained on CPU does not need: mark the op
    unavailable, as DeepSpeed itself does for an op that cannot build here."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def train_func(job_dict: dict[str, Any]) -> None:
    import deepspeed
    import ray.train

    from eagle3_ray.train.prefetch import PackPrefetcher
    from eagle3_ray.train.schedule import warmup_cosine

    job = TrainJob(**job_dict)
    t = job.train
    ctx = ray.train.get_context()
    device = torch.device(f"cuda:{ctx.get_local_rank()}" if job.use_gpu else "cpu")
    if job.use_gpu:
        torch.cuda.set_device(device)
    else:  # Ray pins OMP threads to 1 per CPU-less actor; use the CPUs this worker reserved
        torch.set_num_threads(t["cpus_per_worker"])
        _without_shm_comm_op()
    drafter, lm_head = _build_drafter(job, device)
    params = [p for p in drafter.parameters() if p.requires_grad]
    attention = resolve_attention(t["attention"], device.type)
    if t["compile"]:
        drafter.midlayer.compile()

    def lr_lambda(step: int) -> float:
        return warmup_cosine(step, t["warmup_steps"], job.total_steps, t["min_lr_ratio"])

    engine, _, _, _ = deepspeed.initialize(
        model=drafter,
        model_parameters=params,
        config=_ds_config(t, job.use_gpu),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda),
    )
    step, consumed = _restore(engine, job)
    hidden_dtype = torch.bfloat16 if job.use_gpu else torch.float32
    metrics_path = Path(job.out_dir) / "metrics.jsonl"
    max_steps = min(job.total_steps, t["max_steps"] or job.total_steps)

    def convert(row):
        return _convert(row, device, hidden_dtype, t["row_tokens"] if attention == "sdpa" else None)

    # Packs are fetched and copied to the device on a background thread while the step runs.
    prefetch = PackPrefetcher(pack_stream(ray.train.get_dataset_shard("train")), convert,
                              device, skip=frozenset(consumed), depth=t["prefetch_packs"])
    vote_group = _vote_group()
    evaluate = None
    if job.val_packs:
        name = f"val_{ctx.get_world_rank()}"
        val_shard = ray.train.get_dataset_shard(name) if name in job.val_datasets else None

        def evaluate() -> dict[str, float]:
            return _evaluate(engine.module, val_shard, convert, lm_head, t, attention, vote_group)

    try:
        _loop(engine, job, prefetch, lm_head, consumed, step, max_steps, attention, device, metrics_path,
              vote_group, evaluate)
    finally:
        prefetch.close()


def _evaluate(drafter, val_shard, convert, lm_head, t: dict[str, Any], attention: str, group) -> dict[str, float]:
    """Held-out metrics over this rank's share of the held-out packs (`val_shard`, None when it has
    none), summed over the ranks (on the host gloo group; None for one worker)."""
    from eagle3_ray.drafter.ttt import held_out_metrics, held_out_sums, ttt_forward

    rows = pack_stream(val_shard) if val_shard is not None else ()  # a fresh pass each time
    sums = held_out_sums(drafter, (convert(row) for row in rows),
                         lambda batch: ttt_forward(drafter, batch, lm_head, t["ttt_steps"], t["loss_decay"],
                                                   attention, pad_to=t["batch_tokens"]))
    if group is not None:
        torch.distributed.all_reduce(sums, group=group)
    return held_out_metrics(sums)


def _convert(row: dict, device: torch.device, hidden_dtype: torch.dtype, row_tokens: int | None):
    """Prefetch thread: a packed row -> (device batch, the pack's sample tokens)."""
    from eagle3_ray.train.data import row_to_batch

    return row_to_batch(row, device, hidden_dtype, row_tokens), len(row["input_ids"])


def _loop(engine, job: TrainJob, prefetch, lm_head, consumed: set[str], step: int, max_steps: int,
          attention: str, device: torch.device, metrics_path: Path, vote_group, evaluate=None) -> None:
    import ray.train

    from eagle3_ray.drafter.ttt import mean_metrics, ttt_forward

    t = job.train
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    window: list[torch.Tensor] = []  # each step's TTT stats, read back once per logged step
    tokens, wait, t0 = 0, 0.0, time.monotonic()
    micro, saved_step = 0, step
    next_eval = (step // t["eval_every"] + 1) * t["eval_every"]  # held-out evaluation due at this step
    last_metrics: dict[str, float] = {}
    while step < max_steps:
        t_wait = time.monotonic()
        item = prefetch.next()
        wait += time.monotonic() - t_wait
        if not _all_have_data(item is not None, vote_group):
            break
        key, batch, pack_tokens = item
        consumed.add(key)
        out = ttt_forward(engine.module, batch, lm_head, t["ttt_steps"], t["loss_decay"], attention,
                          pad_to=t["batch_tokens"])  # sdpa rows: laid out by the prefetch thread
        engine.backward(out.loss)
        engine.step()
        micro += 1
        tokens += pack_tokens
        window.append(out.stats)
        if micro % t["grad_accum"]:
            continue
        step += 1
        if step % t["log_every"] == 0 or step == max_steps:
            m = mean_metrics(window, t["loss_decay"])  # waits for the window's steps to finish
            elapsed = time.monotonic() - t0  # so measured after that wait: the window's real time
            m["tokens_per_s"] = tokens / max(elapsed, 1e-9)
            m["input_wait"] = wait / max(elapsed, 1e-9)  # share of the time spent waiting for packs
            m = _mean_over_ranks(m, device)
            m["tokens_per_s"] *= ctx.get_world_size()
            m["lr"] = engine.get_lr()[0]
            m["step"] = step
            if evaluate is not None and (step >= next_eval or step == max_steps):
                m.update(evaluate())  # every rank: its share of the held-out packs, summed
                next_eval = (step // t["eval_every"] + 1) * t["eval_every"]
            last_metrics = m
            if rank == 0:
                from eagle3_ray import metrics

                metrics.record_train_step(m, job.run, t["ttt_steps"])
                with open(metrics_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(m) + "\n")
                accs = " ".join(f"{m.get(f'acc_{i}', 0):.2f}" for i in range(t["ttt_steps"]))
                say(f"[train] step {step}/{max_steps} loss {m['loss']:.3f} tau {m['tau']:.2f} "
                     f"(served {m['tau_served']:.2f}) acc [{accs}] "
                     f"lr {m['lr']:.2e} {m['tokens_per_s']:,.0f} tok/s (input wait {m['input_wait']:.0%})"
                     + (f"; held out: loss {m['val_loss']:.3f} tau {m['val_tau']:.2f} acc0 {m['val_acc_0']:.2f}"
                        if "val_tau" in m else ""))
            # No metrics-only ray.train.report here: each one waits for Ray Train's controller poll
            # (2 s by default), a stall per logged step; metrics go to metrics.jsonl and Prometheus,
            # and Ray Train gets them with every checkpoint.
            window, tokens, wait, t0 = [], 0, 0.0, time.monotonic()
        if step % t["checkpoint_every"] == 0 or step == max_steps:
            _save_checkpoint(engine, engine.module, job, step, sorted(consumed), last_metrics)
            saved_step = step
    if step != saved_step:  # the data ran out between checkpoints: keep the final state
        _save_checkpoint(engine, engine.module, job, step, sorted(consumed), last_metrics)
