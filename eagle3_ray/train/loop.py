"""The Ray Train worker: a `Trainer` per worker (setup, step, evaluate, save) and its loop.

Runs in every TorchTrainer worker (`train_func`). `deepspeed.initialize` wraps the drafter (ZeRO stage
from the config; bf16 on GPU, fp32 + gloo on CPU); the training step itself is train/step.py's
`TrainStep`, the one every benchmark runs too. Features arrive as packed micro-batches through
`ray.train.get_dataset_shard("train")`. With `train.keep_best`, an evaluation that beats the earlier ones
is checkpointed at once (Ray Train keeps it: trainer.fit's CheckpointConfig); `train.trackers` get every
metrics row from rank 0 (train/trackers.py).
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import ray.train
import torch

from eagle3_ray import metrics as dashboard
from eagle3_ray.config import TrainConfig
from eagle3_ray.data.vocab import load_vocab_map
from eagle3_ray.drafter.export import init_drafter_from, save_drafter_weights
from eagle3_ray.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3_ray.drafter.soft_ce import resolve_loss_kernel
from eagle3_ray.drafter.ttt_metrics import HELD_OUT_WIDTH, TTTOutput, held_out_metrics, mean_metrics
from eagle3_ray.drafter.ttt_attention import Segments
from eagle3_ray.engines.heads import load_target_heads
from eagle3_ray.progress import say
from eagle3_ray.train import checkpoint as ck
from eagle3_ray.train.context_parallel import ContextParallel, CPShard
from eagle3_ray.train.context_parallel import setup as cp_setup
from eagle3_ray.train.data import CP_KEYS, row_to_batch
from eagle3_ray.train.prefetch import PackPrefetcher, ReplayCache
from eagle3_ray.train.schedule import warmup_cosine, warmup_steps_of
from eagle3_ray.train.step import ADAMW_BETAS, ADAMW_EPS, StepConfig, TrainStep, resolve_attention


@dataclass(frozen=True)
class TrainJob:
    """Everything a worker needs; built once by the driver (trainer.py: train_job), handed to the
    workers as it is (pickled by Ray: the config section stays a `TrainConfig`)."""

    train: TrainConfig
    drafter_config: DrafterConfig
    heads_path: str
    vocab_path: str
    out_dir: str  # metrics.jsonl goes here
    total_steps: int  # optimizer steps the plan allows (LR schedule length)
    identity: dict[str, Any]  # must match to resume a checkpoint
    use_gpu: bool
    run: str  # config `name`: the `run` tag of the dashboard metrics
    storage: str  # Ray Train's storage: searched for a newer checkpoint at every restore (Trainer.restore)
    val_packs: int = 0  # held-out packs in all (train.val_share), 0 = no evaluation
    val_datasets: list[str] = field(default_factory=list)  # "val_<rank>" of the ranks with held-out packs
    val_pack_groups: dict[str, str] = field(default_factory=dict)  # held-out pack key -> its train.val_groups name


def _ds_config(t: TrainConfig, use_gpu: bool) -> dict[str, Any]:
    """The DeepSpeed config of the drafter's training (the optimizer: step.py's AdamW settings)."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": t.zero_stage},
        "bf16": {"enabled": use_gpu},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": t.lr, "betas": list(ADAMW_BETAS), "eps": ADAMW_EPS,
                       "weight_decay": t.weight_decay, "torch_adam": True,
                       # torch's fused AdamW on CUDA: one kernel over the flat fp32 partition, not a
                       # chain of foreach kernels, each a pass over the optimizer state.
                       "fused": use_gpu},
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def build_drafter(job: TrainJob, device: torch.device) -> tuple[Eagle3Drafter, torch.Tensor]:
    """The drafter (seeded, vocab map set, `train.lm_head_init` or `train.init_from` applied, target
    embedding bound) on `device`, and the frozen target lm_head in the training dtype."""
    torch.manual_seed(job.train.seed)
    drafter = Eagle3Drafter(job.drafter_config)
    embed, lm_head = load_target_heads(job.heads_path)
    d2t, t2d, _ = load_vocab_map(job.vocab_path)
    drafter.set_vocab_map(torch.from_numpy(d2t), torch.from_numpy(t2d))
    if job.train.lm_head_init == "target":  # before a restored checkpoint, which replaces it
        drafter.init_lm_head_from_target(lm_head)
    if job.train.init_from:
        drafter.load_state_dict(init_drafter_from(job.train.init_from, job.drafter_config), strict=False)
    dtype = torch.bfloat16 if job.use_gpu else torch.float32
    drafter.to(device)
    drafter.bind_embedding(embed.to(device).float())  # widened on the device, not in host memory
    return drafter, lm_head.to(device=device, dtype=dtype)


def _vote_group():
    """The process group of the per-step has-data vote: gloo, on the host. Through NCCL the vote's
    `.item()` would wait for every step the rank has queued on its GPU. None for one worker."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return None
    return torch.distributed.new_group(backend="gloo")


def _broadcast_path(path: Path | None, group) -> Path | None:
    """Rank 0's ``path`` on every rank (the host group; as it is without one)."""
    if group is None:
        return path
    data = torch.tensor(list(str(path).encode()) if path is not None else [], dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    torch.distributed.broadcast(size, src=0, group=group)
    if torch.distributed.get_rank() != 0:
        data = torch.empty(int(size.item()), dtype=torch.uint8)
    if data.numel():
        torch.distributed.broadcast(data, src=0, group=group)
    return Path(bytes(data.tolist()).decode()) if data.numel() else None


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
    import deepspeed.ops  # heavy: only in a worker that trains on CPU

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _chain3(m: dict[str, float], suffix: str) -> str:
    """The log line's chain(3) figures of a held-out set: per-position mean, and walked where it was."""
    walk = m.get(f"val_tau_walk3{suffix}")
    return f"chain3 {m[f'val_tau_chain3{suffix}']:.2f}" + (f", walk3 {walk:.2f}" if walk is not None else "")


class Trainer:
    """One Ray Train worker's training, as torchtitan's Trainer: `setup` builds the drafter, the
    DeepSpeed engine and the step and restores the latest checkpoint; `step` trains one micro-batch;
    `evaluate` gives the held-out metrics; `save` reports a checkpoint; `fit` runs the loop (step,
    log, evaluate, checkpoint) over the worker's shard."""

    def __init__(self, job: TrainJob):
        self.job, self.t = job, job.train
        ctx = ray.train.get_context()
        self.rank, self.world_size = ctx.get_world_rank(), ctx.get_world_size()
        self.device = torch.device(f"cuda:{ctx.get_local_rank()}" if job.use_gpu else "cpu")
        self.hidden_dtype = torch.bfloat16 if job.use_gpu else torch.float32
        self.attention = resolve_attention(
            self.t.attention, self.device.type, job.drafter_config.head_dim,
            torch.cuda.get_device_capability(self.device) if job.use_gpu else None, self.t.context_parallel)
        self.loss_kernel = resolve_loss_kernel(self.t.loss_kernel, self.device.type)
        self.max_steps = min(job.total_steps, self.t.max_steps or job.total_steps)
        self.metrics_path = Path(job.out_dir) / "metrics.jsonl"
        self.global_step = 0  # optimizer steps taken (restored on resume)
        self.resumed_from = 0  # the checkpoint step this attempt started from (0: a fresh start)
        self.consumed: set[str] = set()  # pack keys trained on (the data position)
        # Training tokens: the sample tokens of every pack the optimizer has trained on, summed over
        # the ranks (`train_tokens` in metrics.jsonl and train_state.json). `train_tokens` is that sum
        # as of the last `_sync_tokens` (the same on every rank; None when resumed from a checkpoint
        # that predates the count); `unsynced_tokens` this rank's tokens since.
        self.train_tokens: int | None = 0
        self.unsynced_tokens = 0
        self.engine = self.train_step = self.vote_group = self.val_shard = self.val_rows = None
        self.cp = ContextParallel()  # this rank's context-parallel group (setup)
        # train.keep_best: the best held-out evaluation so far and the last one (restored with the checkpoint)
        self.keep_best = ck.KeepBest(self.t.keep_best == "held_out_tau" and job.val_packs > 0)
        self.trackers = None  # rank 0's train.trackers (setup)

    def setup(self) -> Trainer:
        import deepspeed  # heavy: imported in the worker only

        t, job = self.t, self.job
        if job.use_gpu:
            torch.cuda.set_device(self.device)
        else:  # Ray pins OMP threads to 1 per CPU-less actor; use the CPUs this worker reserved
            torch.set_num_threads(t.cpus_per_worker)
            _without_shm_comm_op()
        drafter, lm_head = build_drafter(job, self.device)
        if t.compile:
            drafter.midlayer.compile()

        warmup = warmup_steps_of(t.warmup_steps, t.warmup_ratio, job.total_steps)

        def lr_lambda(step: int) -> float:
            return warmup_cosine(step, warmup, job.total_steps, t.min_lr_ratio)

        self.engine, _, _, _ = deepspeed.initialize(
            model=drafter,
            model_parameters=[p for p in drafter.parameters() if p.requires_grad],
            config=_ds_config(t, job.use_gpu),
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda),
        )
        self.vote_group = _vote_group()  # before restore: rank 0 broadcasts its choice of checkpoint on it
        self.cp = cp_setup(t.context_parallel)  # every rank, in the same order: it makes the groups
        # Rows reach the step already laid out by the prefetch thread (row_to_batch): no row_tokens here.
        self.train_step = TrainStep(self.engine, lm_head,
                                    StepConfig.from_train(t, self.attention, loss_kernel=self.loss_kernel),
                                    cp=self.cp)
        self.global_step, self.consumed = self.restore()
        self.resumed_from = self.global_step
        name = f"val_{self.rank}"
        if job.val_packs and name in job.val_datasets:
            self.val_shard = ray.train.get_dataset_shard(name)
            # read once, then replayed: each pass over the shard is a new execution of its dataset
            self.val_rows = ReplayCache(lambda: pack_stream(self.val_shard), t.val_cache_bytes)
        if self.rank == 0 and t.trackers:
            from eagle3_ray.train.trackers import Trackers  # the trackers' libraries: rank 0 only

            self.trackers = Trackers.start(t, job.run, Path(job.out_dir), self.resumed_from)
        return self

    def restore(self) -> tuple[int, set[str]]:
        """(optimizer step, consumed pack keys) of the checkpoint to resume from; (0, {}) for none.

        The newer of Ray Train's checkpoint and the newest complete one on storage
        (`ck.checkpoint_to_resume`): Ray Train registers a checkpoint only after its upload, so a worker
        or job killed in between restarts without being offered it. Rank 0 chooses and broadcasts the
        choice, so that every rank loads the same checkpoint.
        """
        offered = ray.train.get_checkpoint()
        path = None
        if self.rank == 0:
            path = ck.checkpoint_to_resume(offered.path if offered is not None else None, self.job.storage)
        d = _broadcast_path(path, self.vote_group)
        if d is None:
            return 0, set()
        state = ck.read_train_state(d)
        ck.check_identity(state.get("identity", {}), self.job.identity, d)
        self.engine.load_checkpoint(str(d), tag=ck.DS_TAG)
        consumed = ck.consumed_packs(d)
        self.train_tokens = state.get("train_tokens")  # absent in checkpoints older than the count
        self.keep_best = ck.KeepBest(self.keep_best.enabled, state)
        if offered is not None and Path(offered.path) == d:
            source = "from Ray Train's checkpoint ("
        else:
            was = f"step {ck.read_train_state(Path(offered.path))['step']}" if offered is not None else "none"
            source = f"from storage, {d.name} (Ray Train offered {was}; "
        say(f"[train] resumed at step {state['step']} {source}{len(consumed)} packs already consumed"
            + (f", {self.train_tokens:,} training tokens)" if self.train_tokens is not None else ")"))
        return int(state["step"]), consumed

    def step(self, batch: dict[str, torch.Tensor]) -> TTTOutput:
        """One micro-batch through the training step (the optimizer steps once per grad_accum)."""
        return self.train_step(batch)

    def _sync_tokens(self) -> int | None:
        """Add every rank's tokens since the last sync to `train_tokens` (a host all-reduce on the vote
        group; every rank calls it at the same steps: logged steps and checkpoints)."""
        new = self.unsynced_tokens
        if self.vote_group is not None:
            t = torch.tensor([new], dtype=torch.int64)
            torch.distributed.all_reduce(t, group=self.vote_group)
            new = int(t.item())
        self.unsynced_tokens = 0
        if self.train_tokens is not None:
            self.train_tokens += new
        return self.train_tokens

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics over this rank's share of the held-out packs (none when it has none),
        summed over the ranks (on the host gloo group) before the token-weighted means; with
        train.val_groups, each group's too ("val_tau/<name>", ...). Under context parallelism the
        share is the group's packs, each rank its shard of them, in step with its group."""
        rows = self.val_rows if self.val_rows is not None else ()
        of = self.job.val_pack_groups
        names = sorted(set(of.values()))
        sums = torch.zeros(1 + len(names), HELD_OUT_WIDTH, dtype=torch.float64)  # all, then each group
        for row in rows:
            if self.cp.enabled:
                self.cp.check_same_pack(str(row["key"]))
            s = self.train_step.held_out_sums([self._convert(row)])
            sums[0] += s
            if (name := of.get(str(row["key"]))) is not None:
                sums[1 + names.index(name)] += s
        if self.vote_group is not None:
            torch.distributed.all_reduce(sums, group=self.vote_group)
        m = held_out_metrics(sums[0])
        for i, name in enumerate(names):
            m |= held_out_metrics(sums[1 + i], suffix=f"/{name}")
        return m

    def save(self, metrics: dict[str, float]) -> None:
        """Report a checkpoint of the current step: DeepSpeed state (every rank), each rank's consumed
        packs, and on rank 0 the full drafter weights and train_state.json."""
        engine, drafter = self.engine, self.engine.module
        train_tokens = self._sync_tokens()
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp)
            engine.save_checkpoint(str(d), tag=ck.DS_TAG)
            ck.write_json(d / ck.DATA_STATE_DIR / f"rank-{self.rank}.json", sorted(self.consumed))
            with self._gathered():
                if self.rank == 0:
                    save_drafter_weights(drafter, d)
                    state = {"step": self.global_step, "metrics": metrics, "identity": self.job.identity,
                             "world_size": self.world_size, "zero_stage": engine.zero_optimization_stage()}
                    if train_tokens is not None:
                        state["train_tokens"] = train_tokens
                    ck.write_json(d / ck.TRAIN_STATE, {**state, **self.keep_best.state()})
            # with train.keep_best, the score Ray Train keeps the best checkpoints by (trainer.checkpoint_config)
            ray.train.report({**metrics, "step": self.global_step, **self.keep_best.score(self.global_step)},
                             checkpoint=ray.train.Checkpoint.from_directory(tmp))

    def fit(self) -> None:
        """Train on this worker's shard until `max_steps` or the data runs out on any rank."""
        # Packs are fetched and copied to the device on a background thread while the step runs.
        # With context parallelism each rank reads its own shards of its group's packs (trainer.py: cp_datasets).
        name = f"train_{self.rank}" if self.cp.enabled else "train"
        prefetch = PackPrefetcher(pack_stream(ray.train.get_dataset_shard(name)), self._convert, self.device,
                                  skip=frozenset(self.consumed), depth=self.t.prefetch_packs)
        failed = True
        try:
            self._loop(prefetch)
            failed = False
        finally:
            prefetch.close()
            if self.trackers is not None:
                self.trackers.close(failed)

    def _loop(self, prefetch: PackPrefetcher) -> None:
        t = self.t
        window: list[torch.Tensor] = []  # each step's TTT stats, read back once per logged step
        tokens, wait, t0 = 0, 0.0, time.monotonic()
        saved_step = self.global_step
        next_eval = (self.global_step // t.eval_every + 1) * t.eval_every  # held-out evaluation due at this step
        last_metrics: dict[str, float] = {}
        while self.global_step < self.max_steps:
            t_wait = time.monotonic()
            item = prefetch.next()
            wait += time.monotonic() - t_wait
            if not _all_have_data(item is not None, self.vote_group):
                break
            key, batch, pack_tokens = item
            if self.cp.enabled:
                self.cp.check_same_pack(key)
            self.consumed.add(key)
            out = self.step(batch)
            tokens += pack_tokens
            self.unsynced_tokens += pack_tokens
            window.append(out.stats)
            if not self.train_step.stepped:
                continue
            self.global_step += 1
            step = self.global_step
            new_best = False
            if step % t.log_every == 0 or step == self.max_steps:
                m = mean_metrics(window, t.loss_decay)  # waits for the window's steps to finish
                elapsed = time.monotonic() - t0  # so measured after that wait: the window's real time
                m["tokens_per_s"] = tokens / max(elapsed, 1e-9)
                m["input_wait"] = wait / max(elapsed, 1e-9)  # share of the time spent waiting for packs
                m = _mean_over_ranks(m, self.device)
                m["tokens_per_s"] *= self.world_size
                m["lr"] = self.engine.get_lr()[0]
                m["step"] = step
                m["resumed_from"] = self.resumed_from  # which attempt logged the row (a restart may not repeat a step)
                if self._sync_tokens() is not None:
                    m["train_tokens"] = self.train_tokens  # cumulative, all ranks: the x axis of the tau curve
                if self.job.val_packs and (step >= next_eval or step == self.max_steps):
                    m.update(self.evaluate())  # every rank: its share of the held-out packs, summed
                    next_eval = (step // t.eval_every + 1) * t.eval_every
                    new_best = self.keep_best.evaluated(step, m["val_tau"])  # the same on every rank
                last_metrics = m
                if self.rank == 0:
                    self._log(m)
                # No metrics-only ray.train.report here: each one waits for Ray Train's controller poll
                # (2 s by default), a stall per logged step; metrics go to metrics.jsonl and Prometheus,
                # and Ray Train gets them with every checkpoint.
                window, tokens, wait, t0 = [], 0, 0.0, time.monotonic()
            if step % t.checkpoint_every == 0 or step == self.max_steps or new_best:
                self.save(last_metrics)
                saved_step = step
        if self.global_step != saved_step:  # the data ran out between checkpoints: keep the final state
            self.save(last_metrics)

    def _log(self, m: dict[str, float]) -> None:
        t = self.t
        dashboard.record_train_step(m, self.job.run, t.ttt_steps)
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(m) + "\n")
        if self.trackers is not None:
            self.trackers.log(m)
        accs = " ".join(f"{m.get(f'acc_{i}', 0):.2f}" for i in range(t.ttt_steps))
        say(f"[train] step {m['step']}/{self.max_steps} loss {m['loss']:.3f} tau {m['tau']:.2f} "
            f"(served {m['tau_served']:.2f}) acc [{accs}] "
            f"lr {m['lr']:.2e} {m['tokens_per_s']:,.0f} tok/s (input wait {m['input_wait']:.0%})"
            + (f"; held out: loss {m['val_loss']:.3f} tau {m['val_tau']:.2f} ({_chain3(m, '')}) "
               f"acc0 {m['val_acc_0']:.2f}" if "val_tau" in m else "")
            + "".join(f"; {k[len('val_tau/'):]} tau {v:.2f} ({_chain3(m, k[len('val_tau'):])})"
                      for k, v in m.items() if k.startswith("val_tau/")))

    def _convert(self, row: dict) -> tuple[dict[str, torch.Tensor], int]:
        """Prefetch thread: a packed row -> (device batch, the pack's sample tokens); a context-parallel
        shard's row -> (its batch with its `CPShard`, the sample tokens the rank owns)."""
        if CP_KEYS[0] in row:
            shard = CPShard(*(int(row[k]) for k in CP_KEYS))
            batch = row_to_batch(row, self.device, self.hidden_dtype)
            batch["cp_shard"] = shard
            if self.attention == "varlen":
                batch["segments"] = Segments.of(torch.from_numpy(np.asarray(row["seq_ids"][: shard.local],
                                                                           dtype=np.int64))[None],
                                                self.device, key_shift=shard.key_shift)
            return batch, shard.tokens
        row_tokens = self.t.row_tokens if self.attention == "sdpa" else None
        return (row_to_batch(row, self.device, self.hidden_dtype, row_tokens, segments=self.attention == "varlen"),
                len(row["input_ids"]))

    def _gathered(self):
        """ZeRO-3 partitions parameters: gather them (on every rank) while rank 0 saves."""
        if self.engine.zero_optimization_stage() == 3:
            import deepspeed  # heavy: imported in the worker only

            return deepspeed.zero.GatheredParameters(list(self.engine.module.parameters()), modifier_rank=None)
        return contextlib.nullcontext()


def train_func(config: dict[str, Any]) -> None:
    """The TorchTrainer's per-worker function: ``config["job"]`` is the driver's TrainJob."""
    Trainer(config["job"]).setup().fit()
