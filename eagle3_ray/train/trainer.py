"""`eagle3-ray train`: plan, check, and launch the Ray Train + DeepSpeed drafter training.

The driver refuses mismatched inputs before any worker starts (store vs target vs vocab map),
writes the frozen target heads once, plans the packs, and hands workers a TrainJob (typed config
sections, pickled by Ray as they are).
Rerunning with the same --out resumes from the latest checkpoint (same RunConfig name + storage).
With train.keep_best and held-out samples, Ray Train keeps checkpoints by their held-out tau beside the
latest, and the summary (summary.json, the last line) says which step won and by how much.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import ray
import ray.train
from ray.train.torch import TorchTrainer

from eagle3_ray.config import PipelineConfig, save_resolved
from eagle3_ray.data.groups import base_id
from eagle3_ray.data.vocab import VOCAB_FILE, data_fingerprint, load_vocab_map, vocab_fingerprint
from eagle3_ray.drafter.model import DrafterConfig
from eagle3_ray.drafter.soft_ce import resolve_loss_kernel
from eagle3_ray.engines.describe import DescribedTarget, describe
from eagle3_ray.engines.heads import save_target_heads
from eagle3_ray.errors import CheckpointError, ConfigError, StoreError
from eagle3_ray.features import open_store
from eagle3_ray.features.store import check_compatible
from eagle3_ray.progress import say
from eagle3_ray.ray_session import check_shared_dirs
from eagle3_ray.train.checkpoint import (
    SCORE, TRAIN_STORAGE, best_summary, check_identity, latest_checkpoint, read_train_state, select_checkpoint,
    write_json,
)
from eagle3_ray.train.data import build_train_dataset
from eagle3_ray.train.loop import TrainJob, train_func
from eagle3_ray.train.packing import Pack, padding_efficiency, plan, plan_held_out, remap, split_store
from eagle3_ray.train.schedule import warmup_steps_of
from eagle3_ray.train.step import resolve_attention
from eagle3_ray.train.trackers import check_installed


def _vocab_file(vocab: str | Path) -> Path:
    p = Path(vocab)
    p = p / VOCAB_FILE if p.is_dir() else p
    if not p.is_file():
        raise StoreError(f"vocab map {p} does not exist; run `eagle3-ray vocab --features ... --out ...` first")
    return p


def _short_hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def trains_on_gpu(cfg: PipelineConfig) -> bool:
    """``train.use_gpu``, or when unset whether the Ray cluster has GPUs."""
    if cfg.train.use_gpu is not None:
        return cfg.train.use_gpu
    return ray.cluster_resources().get("GPU", 0) > 0


@dataclass(frozen=True)
class TrainPlan:
    """The driver's plan of a training run: what its workers' ``TrainJob`` holds (``train_job``) apart
    from how they run, and the packs to train on and to evaluate."""

    drafter_config: DrafterConfig
    heads_path: str
    vocab_path: str
    total_steps: int  # optimizer steps the plan allows (LR schedule length)
    identity: dict[str, Any]  # must match to resume a checkpoint
    packs: list[Pack]
    val_packs: list[Pack] = field(default_factory=list)  # held out (train.val_share, train.eval_only)
    val_pack_groups: dict[str, str] = field(default_factory=dict)  # held-out pack key -> its train.val_groups name


def plan_training(cfg: PipelineConfig, features: str | Path, vocab: str | Path, out: Path):
    """Checks + plan, no Ray: returns (TrainPlan, the feature store)."""
    store = open_store(features, on_corrupt=cfg.extract.on_corrupt_shard)
    if len(store) == 0:
        raise StoreError(f"feature store {features} is empty; run `eagle3-ray extract` first")
    target = describe(cfg.target)
    info = target.info
    check_compatible(
        store.meta,
        {"hidden_size": info.hidden_size, "aux_layers": list(info.aux_layers),
         "vocab_size": info.vocab_size, "target_fingerprint": info.fingerprint},
    )
    t = cfg.train
    # A prompt's answers (generate.samples_per_prompt: <id>, <id>#s1, ...) are held out together: a
    # held-out answer whose twin was trained on would inflate the held-out tau. Without copies (every
    # base id distinct) this is the plain per-sample split of earlier runs. Samples of the eval_only
    # groups are all held out; the share splits the rest.
    sample_ids = [str(sid) for sid in store.sample_ids]
    keep, held, only, groups = split_store(sample_ids, t.val_share, t.seed, t.val_groups, t.eval_only)
    for name in t.eval_only:
        if name not in groups:
            raise ConfigError(f"train.eval_only group {name!r} ({t.val_groups[name]!r}) matches no sample id of "
                              f"{features} (ids look like {sample_ids[:3]}); fix val_groups.{name} or drop it "
                              "from train.eval_only")
    rest = np.flatnonzero(~only)
    n_prompts = len({base_id(sample_ids[i]) for i in rest})
    if t.val_share > 0 and len(held) == int(only.sum()):
        raise ConfigError(f"train.val_share={t.val_share} holds out nothing of a {len(rest)}-sample store "
                          f"({n_prompts} prompts; a prompt's answers are held out together); give a store of "
                          "at least 2 prompts or set train.val_share=0")
    if len(keep) == 0:
        raise ConfigError(f"nothing of {features} is left to train on: train.eval_only {t.eval_only} holds out "
                          f"{int(only.sum())} of its {len(store)} samples; narrow those groups' val_groups patterns")
    data_fp = data_fingerprint(store.sample_ids, store.lengths)
    if only.any():
        _check_vocab_left_out(vocab, data_fp, info.fingerprint, int(only.sum()), t, features)
    identity = {}
    if t.val_share and n_prompts < len(rest):  # the split differs from the per-sample one of earlier code
        identity["val_split"] = "by_prompt"
    if t.eval_only:  # which samples are trained on depends on them
        identity["eval_only"] = {g: t.val_groups[g] for g in t.eval_only}
    # Under context parallelism a group evaluates a held-out pack split over its ranks, as it trains: packs of
    # up to context_parallel x batch_tokens tokens, so that a held-out sample as long as a training one fits.
    val_packs, val_pack_groups = plan_held_out(store.lengths, held, groups, t.batch_tokens * t.context_parallel,
                                               t.seed)
    train_plan = plan_run(cfg, store.lengths, data_fp, vocab, out, target, keep=keep, identity=identity,
                          val_packs=val_packs, val_pack_groups=val_pack_groups)
    if val_packs:
        named = Counter(groups[i] for i in held if groups[i] is not None)
        say(f"[train] {len(held)} samples ({int(store.lengths[held].sum()):,} tokens) held out of training: "
            f"{len(val_packs)} packs evaluated every {t.eval_every} steps"
            + ("; by group: " + ", ".join(f"{g} {n}" + (" (eval only)" if g in t.eval_only else "")
                                          for g, n in sorted(named.items())) if named else ""))
    return train_plan, store


def _check_vocab_left_out(vocab: str | Path, data_fp: str, target_fp: str, n_only: int, t, features) -> None:
    """``ConfigError`` when the vocab map was built over this very store with its evaluation-only
    samples counted (`eagle3-ray vocab` without the same ``train.eval_only``): their tokens would have
    chosen the draft vocab. A map built over other data is not judged."""
    path = _vocab_file(vocab)
    _, _, meta = load_vocab_map(path)
    size = meta.get("draft_vocab_size")
    if size is not None and meta.get("fingerprint") == vocab_fingerprint(data_fp, target_fp, int(size)):
        groups = {g: t.val_groups[g] for g in t.eval_only}
        raise ConfigError(
            f"vocab map {path} counted the {n_only} samples of train.eval_only {groups} in {features}: their "
            f"tokens chose the draft vocab, so their evaluation would not be held out. Rebuild the map with "
            f"this training's config and overrides (the same train.val_groups and train.eval_only): "
            f"`eagle3-ray vocab -c <config> --features {features} --out <dir> <overrides>`"
        )


def plan_run(cfg: PipelineConfig, lengths, data_fp: str, vocab: str | Path, out: Path, target: DescribedTarget,
             keep=None, identity: dict[str, Any] | None = None, val_packs: list[Pack] | None = None,
             val_pack_groups: dict[str, str] | None = None) -> TrainPlan:
    """Vocab checks, drafter shape, frozen heads, pack plan and run identity for samples of `lengths`
    (int [N]); shared by offline training (store) and online training (prepared data). `target`:
    `cfg.target` described (once per run). `keep`: the sample indices to train on (default all; the
    rest are held out, in `val_packs`); `identity`: what else a resumed checkpoint must match."""
    info = target.info
    vocab_path = _vocab_file(vocab)
    d2t, t2d, vmeta = load_vocab_map(vocab_path)
    if vmeta.get("target_fingerprint") not in (None, info.fingerprint):
        raise StoreError(
            f"vocab map {vocab_path} was built for target {vmeta.get('target_fingerprint')}, "
            f"not this target ({info.fingerprint}); rerun `eagle3-ray vocab` on this store"
        )
    if len(t2d) != info.vocab_size:
        raise StoreError(f"vocab map {vocab_path} covers {len(t2d)} target ids, the target has {info.vocab_size}")
    drafter_cfg = DrafterConfig.from_target(
        target.hf_config, len(d2t), list(info.aux_layers), cfg.train.drafter.model_dump()
    )
    heads = save_target_heads(cfg.target, target.resolved, out)
    t = cfg.train
    # A context-parallel group of workers trains on one pack at a time, split over its workers: packs of up
    # to context_parallel x batch_tokens tokens, one per group and micro-step.
    cp = t.context_parallel
    pack_tokens = t.batch_tokens * cp
    if keep is None:
        packs = plan(lengths, pack_tokens, t.epochs, t.seed)
    else:
        packs = remap(plan(np.asarray(lengths)[keep], pack_tokens, t.epochs, t.seed), keep)
    per_step = t.num_workers // cp * t.grad_accum
    total = max(1, len(packs) // per_step)
    if t.max_steps:
        total = min(total, t.max_steps)
    run_identity = {
        "drafter": drafter_cfg.to_dict(),
        "data": data_fp,
        "vocab": _short_hash(d2t.tolist()),
        "batch_tokens": t.batch_tokens, "epochs": t.epochs, "seed": t.seed,
        "num_workers": t.num_workers, "grad_accum": t.grad_accum, "zero_stage": t.zero_stage,
    }
    if t.val_share:  # the training packs depend on it (absent when 0: older checkpoints still match)
        run_identity["val_share"] = t.val_share
    if cp > 1:  # so do the packs and the ranks' data (absent when off: older checkpoints still match)
        run_identity["context_parallel"] = cp
    n_train = len(lengths) if keep is None else len(keep)
    say(
        f"[train] {n_train} samples, {sum(p.tokens for p in packs if p.epoch == 0):,} tokens -> {len(packs)} packs over {t.epochs} "
        f"epoch(s) (padding efficiency {padding_efficiency(packs, pack_tokens):.1%}); {total} optimizer "
        f"steps on {t.num_workers} worker(s)"
        + (f" in {t.num_workers // cp} context-parallel group(s) of {cp}" if cp > 1 else "")
        + f"; drafter H={drafter_cfg.hidden_size} "
        f"draft vocab {drafter_cfg.draft_vocab_size}"
    )
    warmup = warmup_steps_of(t.warmup_steps, t.warmup_ratio, total)
    if warmup >= total:
        say(f"[train] warning: {warmup} warmup steps for a run of {total} optimizer steps: the learning rate "
            f"rises to the end and never decays; set train.warmup_ratio (e.g. 0.02) or a smaller train.warmup_steps")
    return TrainPlan(drafter_config=drafter_cfg, heads_path=str(heads.resolve()), vocab_path=str(vocab_path.resolve()),
                     total_steps=total, identity={**run_identity, **(identity or {})}, packs=packs,
                     val_packs=val_packs or [], val_pack_groups=val_pack_groups or {})


def train_job(cfg: PipelineConfig, train_plan: TrainPlan, out: Path, use_gpu: bool, storage: Path,
              val_datasets=()) -> TrainJob:
    """The workers' TrainJob of ``train_plan``: on the GPU or not, checkpoints in ``storage``, the
    held-out datasets of the ranks that have some (``val_datasets``: their names)."""
    p = train_plan
    return TrainJob(train=cfg.train, drafter_config=p.drafter_config, heads_path=p.heads_path,
                    vocab_path=p.vocab_path, out_dir=str(out.resolve()), total_steps=p.total_steps,
                    identity=p.identity, use_gpu=use_gpu, run=cfg.name, storage=str(storage),
                    val_packs=len(p.val_packs), val_datasets=sorted(val_datasets), val_pack_groups=p.val_pack_groups)


def run_training(cfg: PipelineConfig, features: str | Path, vocab: str | Path, out: str | Path) -> Path:
    """Train; returns the directory of the final checkpoint."""
    t0 = time.monotonic()
    out = Path(out).resolve()
    save_resolved(cfg, out)
    train_plan, _ = plan_training(cfg, features, vocab, out)
    root = str(Path(features).resolve())
    t = cfg.train
    if t.context_parallel > 1:  # rank r reads its own shard of every pack of its group (train_<r>)
        dataset = cp_datasets(train_plan.packs, root, cfg.extract.on_corrupt_shard, t)
    else:
        dataset = build_train_dataset(train_plan.packs, root, cfg.extract.on_corrupt_shard,
                                      loaders=t.pack_loaders * t.num_workers)
    # Held-out packs, dealt to the ranks here: Ray Train's split is equal-sized and would drop the
    # packs that do not divide evenly. Each rank reads only its own "val_<rank>" (unsplit); its loader
    # takes no CPU reservation, so evaluating can never wait on the training loaders' CPUs. Under context
    # parallelism the deal is per group, and each rank of a group reads its shards of the group's packs.
    workers, cp, val_packs = t.num_workers, t.context_parallel, train_plan.val_packs
    groups = workers // cp
    val = {f"val_{r}": build_train_dataset(val_packs[r // cp :: groups], root, cfg.extract.on_corrupt_shard,
                                           loaders=1, num_cpus=0, cp=(cp, r % cp, t.ttt_steps) if cp > 1 else None)
           for r in range(workers) if val_packs[r // cp :: groups]}
    return fit(cfg, train_plan, dataset, out, t0, trains_on_gpu(cfg), val_datasets=val)


def cp_datasets(packs: list[Pack], root: str, on_corrupt: str, t) -> dict:
    """Context parallelism: {"train_<rank>": that rank's shards of its group's packs} (group g of G takes
    packs g, g + G, ...; every rank of it the same ones, in the same order), `t.pack_loaders` loaders each."""
    cp, workers = t.context_parallel, t.num_workers
    groups = workers // cp
    return {f"train_{r}": build_train_dataset(packs[r // cp :: groups], root, on_corrupt, loaders=t.pack_loaders,
                                              cp=(cp, r % cp, t.ttt_steps))
            for r in range(workers)}


def cp_data_config(datasets: dict):
    """Ray Train's DataConfig of `cp_datasets` (and the held-out ones): none split (each rank reads its own
    whole), their order preserved (a group's ranks meet on the same pack at every step)."""
    options = ray.train.DataConfig.default_ingest_options()
    options.preserve_order = True
    return ray.train.DataConfig(datasets_to_split=[], execution_options={name: options for name in datasets})


def fit_off_main_thread(trainer):
    """``trainer.fit()`` on a thread of its own; the main thread waits for it and stays free for
    Ctrl-C. Called from the main thread, Ray Train installs its own SIGINT handler, which waits for
    the controller to abort the run: tens of seconds while the worker group starts, with no word to
    the user. Every stage resumes (training from its latest checkpoint), so the CLI stops at once
    instead and says so (cli.py); the run's actors end with the driver."""
    outcome: dict = {}

    def work() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as e:  # noqa: BLE001 (raised again on the main thread, as itself)
            outcome["error"] = e

    thread = threading.Thread(target=work, name="ray-train-fit", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.5)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def fit(cfg: PipelineConfig, train_plan: TrainPlan, dataset, out: Path, t0: float, use_gpu: bool,
        dataset_config=None, val_datasets=None) -> Path:
    """Run the TorchTrainer on `dataset` (rows of packed micro-batches; with train.context_parallel,
    `cp_datasets`' dict of per-rank datasets); resume from the latest checkpoint of the same run; returns
    the final checkpoint directory. `val_datasets`: held-out packs per rank ("val_<rank>", not split),
    evaluated every `train.eval_every` steps."""
    # Refuse an impossible attention setting here, not after the workers have started.
    resolve_attention(cfg.train.attention, "cuda" if use_gpu else "cpu", train_plan.drafter_config.head_dim,
                      context_parallel=cfg.train.context_parallel)
    train_sets = dataset if isinstance(dataset, dict) else {"train": dataset}
    if dataset_config is None:
        dataset_config = (cp_data_config({**train_sets, **(val_datasets or {})}) if cfg.train.context_parallel > 1
                          else ray.train.DataConfig(datasets_to_split=["train"]))
    if not use_gpu:  # the Triton loss on CPU; on GPUs each worker checks that Triton imports
        resolve_loss_kernel(cfg.train.loss_kernel, "cpu")
    check_installed(cfg.train.trackers)  # here, as on every worker's node
    storage = Path(cfg.ray.storage_path).resolve() if cfg.ray.storage_path else out / TRAIN_STORAGE
    previous = latest_checkpoint(storage, complete_only=True) if storage.is_dir() else None
    if previous is not None:  # refuse before any worker starts (workers re-check on every restore)
        check_identity(read_train_state(previous).get("identity", {}), train_plan.identity, previous)
        say(f"[train] resuming from {previous}")
    # Every (re)start of the workers resumes from the newer of Ray Train's checkpoint and the newest
    # complete one here (Trainer.restore): one Ray Train has not registered yet is still taken.
    job = train_job(cfg, train_plan, out, use_gpu, storage, val_datasets or {})
    keep_best = cfg.train.keep_best == "held_out_tau" and bool(train_plan.val_packs)  # held-out tau to keep by
    # Every worker writes its checkpoint shards to storage and reads the heads under out: refuse a
    # directory that a node of the cluster does not see, before any worker starts.
    check_shared_dirs({storage: "ray.storage_path (Ray Train's checkpoints)", out: "--out"})
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"job": job},
        scaling_config=ray.train.ScalingConfig(
            num_workers=cfg.train.num_workers,
            use_gpu=use_gpu,
            resources_per_worker={"CPU": cfg.train.cpus_per_worker, **({"GPU": 1} if use_gpu else {})},
        ),
        run_config=ray.train.RunConfig(
            name=f"{cfg.name}-train",
            storage_path=str(storage),
            failure_config=ray.train.FailureConfig(max_failures=cfg.train.max_failures),
            checkpoint_config=checkpoint_config(keep_best),
        ),
        datasets={**train_sets, **(val_datasets or {})},
        dataset_config=dataset_config,
    )
    result = fit_off_main_thread(trainer)
    if result.error is not None:
        raise result.error
    ckpt = latest_checkpoint(storage)
    if ckpt is None:
        raise CheckpointError(f"training finished without a checkpoint under {storage}")
    summary = {"checkpoint": str(ckpt), "metrics": result.metrics, "seconds": round(time.monotonic() - t0, 1)}
    run_dir = storage / f"{cfg.name}-train"  # this run's checkpoints (the storage may hold other runs')
    best = best_summary(run_dir)
    if best is not None:
        summary["best"] = {**best, "checkpoint": str(select_checkpoint(run_dir, "best").path)}
    write_json(out / "summary.json", summary)
    say(f"[train] done: checkpoint {ckpt}")
    if best is not None:
        say(_best_line(summary["best"]))
    return ckpt


def checkpoint_config(keep_best: bool) -> ray.train.CheckpointConfig:
    """The checkpoints Ray Train keeps: with ``keep_best`` (train.keep_best and held-out samples to evaluate)
    the two of the highest held-out tau (``SCORE``) and the latest, which Ray Train never deletes; else
    the two latest."""
    if keep_best:
        return ray.train.CheckpointConfig(num_to_keep=2, checkpoint_score_attribute=SCORE,
                                          checkpoint_score_order="max")
    return ray.train.CheckpointConfig(num_to_keep=2)


def _best_line(best: dict) -> str:
    """The summary's line on the best checkpoint: which step won, and by how much over the last evaluation."""
    head = f"[train] best held-out tau {best['val_tau']:.3f} at step {best['step']}"
    if best["step"] == best["last_eval_step"]:
        return f"{head}, the last evaluation; `eagle3-ray export` takes it ({best['checkpoint']})"
    return (f"{head}, {best['margin']:+.3f} over the last evaluation's {best['last_eval_val_tau']:.3f} at step "
            f"{best['last_eval_step']}; `eagle3-ray export` takes it (--which latest: the latest) "
            f"({best['checkpoint']})")
