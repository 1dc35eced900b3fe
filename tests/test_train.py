"""Ray Train + DeepSpeed drafter training on a real local Ray: train, checkpoint, resume, export."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from eagle3_ray.config import load_config
from eagle3_ray.errors import CheckpointError

CI_CONFIG = "configs/ci-tiny.yaml"
# The ZeRO stage of the Kimi-K2.5 preset, which partitions gradients (ZeRO-1 runs on one worker in
# test_fault_injection.py, test_run_pipeline.py and test_online.py).
ZERO_STAGE = load_config("configs/kimi-k2.5.yaml").train.zero_stage
# One 4-step ci-tiny training on two gloo workers at that stage, with a held-out share, serves the
# two-worker, ZeRO, checkpoint, resume, export and held-out tests (each inspects another aspect of
# the same run; a Ray Train run costs ~30-40 s here) and test_compact_train.py's fp8 comparison:
# conftest.py's session fixture `trained_4_steps`. Two ranks: with one, ZeRO's gradient and
# optimizer-state partitions would be the whole model.
# Two named groups of samples, one of them evaluation-only (never trained on): held-out metrics per group.
GROUPS = ['train.val_groups={late: "ci-1[0-2]", early: "ci-0[1-6]"}', "train.eval_only=[late]"]
# A constant learning rate: the LR schedule's length (max_steps) then changes nothing, so the run resumed to
# 6 steps (trained_4_then_6) trains as one of 6 steps from the start would (test_keep_best.py).
TRAIN_4 = ["train.max_steps=4", "train.checkpoint_every=2", "train.log_every=1", "train.val_share=0.25",
           "train.eval_every=2", "train.num_workers=2", f"train.zero_stage={ZERO_STAGE}", *GROUPS,
           "train.warmup_steps=0", "train.min_lr_ratio=1.0"]
# The fixture's run and its resumption log to every tracker (W&B offline): test_trackers.py reads them back.
TRACKED = ["train.trackers=[tensorboard,mlflow,wandb]", "train.tracking.wandb_mode=offline"]


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _pack_tokens(cfg, features, ci_tiny_inputs, tmp_path) -> dict[str, int]:
    """Sample tokens of every training pack of the plan, by pack key."""
    from eagle3_ray.train.trainer import plan_training

    packs = plan_training(cfg, features, ci_tiny_inputs / "vocab_groups", tmp_path)[0].packs
    return {p.key: p.tokens for p in packs}


def test_packing_plan_is_deterministic_and_covers_every_sample_once_per_epoch():
    from eagle3_ray.train.packing import plan

    lengths = np.random.default_rng(0).integers(5, 300, size=200)
    packs = plan(lengths, 512, epochs=2, seed=3)
    assert packs == plan(lengths, 512, epochs=2, seed=3)
    for epoch in (0, 1):
        seen = sorted(i for p in packs if p.epoch == epoch for i in p.samples)
        assert seen == list(range(200))
    assert all(p.tokens <= 512 for p in packs)


def test_the_train_job_reaches_the_workers_typed(ci_tiny_inputs, tmp_path):
    """The driver's TrainJob crosses to the workers as Ray pickles it: the config sections stay
    pydantic models (validated, attribute access), the drafter config a DrafterConfig."""
    import ray.cloudpickle

    from eagle3_ray.config import TrainConfig
    from eagle3_ray.drafter.model import DrafterConfig
    from eagle3_ray.train.trainer import plan_training, train_job

    cfg = load_config(CI_CONFIG, ["train.grad_accum=3"])
    for section in (cfg, cfg.target, cfg.extract, cfg.train, cfg.bench, cfg.ray):
        assert ray.cloudpickle.loads(ray.cloudpickle.dumps(section)) == section
    train_plan, _ = plan_training(cfg, ci_tiny_inputs / "features", ci_tiny_inputs / "vocab", tmp_path)
    job = train_job(cfg, train_plan, tmp_path, use_gpu=False, storage=tmp_path / "ray_train")
    back = ray.cloudpickle.loads(ray.cloudpickle.dumps({"job": job}))["job"]
    assert isinstance(back.train, TrainConfig) and back.train.grad_accum == 3
    assert isinstance(back.drafter_config, DrafterConfig) and back.drafter_config == job.drafter_config
    with pytest.raises(Exception, match="grad_accum"):
        back.train.grad_accum = 0  # still validated on the worker side


def test_lm_head_init_target_starts_the_drafter_on_the_targets_rows(ci_tiny_inputs, tmp_path):
    """train.lm_head_init=target: the workers' drafter starts with the target's lm_head rows of the
    draft vocabulary (the vocab map's order); random keeps the seeded init; with init_from it is refused."""
    from eagle3_ray.engines.heads import load_target_heads
    from eagle3_ray.errors import ConfigError
    from eagle3_ray.train.loop import build_drafter
    from eagle3_ray.train.trainer import plan_training, train_job

    drafters = {}
    for init in ("random", "target"):
        cfg = load_config(CI_CONFIG, [f"train.lm_head_init={init}"])
        train_plan, _ = plan_training(cfg, ci_tiny_inputs / "features", ci_tiny_inputs / "vocab", tmp_path / init)
        job = train_job(cfg, train_plan, tmp_path / init, use_gpu=False, storage=tmp_path / init / "ray_train")
        drafters[init], _ = build_drafter(job, torch.device("cpu"))
    _, head = load_target_heads(job.heads_path)
    rows = drafters["target"].draft_to_target(torch.arange(drafters["target"].config.draft_vocab_size))
    assert torch.equal(drafters["target"].lm_head.weight, head[rows].float())
    assert not torch.equal(drafters["random"].lm_head.weight, drafters["target"].lm_head.weight)
    assert torch.equal(drafters["random"].fc.weight, drafters["target"].fc.weight)  # nothing else moves
    with pytest.raises(ConfigError, match="leave lm_head_init at random"):
        load_config(CI_CONFIG, ["train.lm_head_init=target", f"train.init_from={tmp_path}"])


def test_holdout_by_prompt_keeps_copies_together_and_the_old_split_without_copies():
    """train.val_share holds a prompt's answers (<id>, <id>#s1, ...: generate.samples_per_prompt) out
    together; ids without a copy suffix give exactly the per-sample split of earlier runs (resumed
    checkpoints and their packs depend on it)."""
    from eagle3_ray.data.groups import base_id, copy_id
    from eagle3_ray.train.packing import holdout, holdout_groups

    plain = [f"p{i}" for i in range(37)] + ["a#sx", "a#s", "data-4", "q#s1b", "7"]
    for share, seed in [(0.0, 0), (0.02, 0), (0.1, 3), (0.25, 7), (0.9, 1)]:
        old = holdout(len(plain), share, seed)
        new = holdout_groups([base_id(i) for i in plain], share, seed)
        assert all(np.array_equal(o, n) for o, n in zip(old, new))
    # Copies, in a store order that is not the prompt order (shards): no prompt on both sides.
    rng = np.random.default_rng(0)
    ids = [copy_id(f"p{i}", c) for i in range(60) for c in range(1 + i % 3)]
    ids = [ids[j] for j in rng.permutation(len(ids))]
    keep, held = holdout_groups([base_id(i) for i in ids], 0.2, seed=3)
    assert sorted(np.concatenate([keep, held]).tolist()) == list(range(len(ids)))
    kept_prompts, held_prompts = ({base_id(ids[j]) for j in part} for part in (keep, held))
    assert not kept_prompts & held_prompts and len(held_prompts) == 12  # 20% of the 60 prompts
    assert np.array_equal(held, holdout_groups([base_id(i) for i in ids], 0.2, seed=3)[1])
    assert len(holdout_groups([base_id("x"), base_id("x#s1")], 0.5, 0)[1]) == 0  # one prompt: none held out


def test_the_store_split_of_ids_without_copies_is_the_per_sample_one(ci_tiny_inputs, tmp_path):
    from eagle3_ray.train.packing import holdout
    from eagle3_ray.train.trainer import plan_training

    cfg = load_config(CI_CONFIG, ["train.val_share=0.25"])
    train_plan, store = plan_training(cfg, ci_tiny_inputs / "features", ci_tiny_inputs / "vocab", tmp_path)
    assert not any("#s" in str(i) for i in store.sample_ids)
    held = sorted(i for p in train_plan.val_packs for i in p.samples)
    assert held == holdout(len(store), 0.25, cfg.train.seed)[1].tolist()
    assert "val_split" not in train_plan.identity  # checkpoints of earlier runs still resume


def test_holdout_splits_every_sample_once_and_remap_returns_store_indices():
    from eagle3_ray.train.packing import holdout, plan, remap

    keep, held = holdout(100, 0.1, seed=3)
    assert len(held) == 10 and sorted(np.concatenate([keep, held]).tolist()) == list(range(100))
    assert np.array_equal(held, holdout(100, 0.1, seed=3)[1]) and not np.array_equal(held, holdout(100, 0.1, 4)[1])
    assert len(holdout(100, 0.0, 0)[1]) == 0 and len(holdout(2, 0.9, 0)[0]) == 1  # one of each at least
    lengths = np.arange(100) + 10
    packs = remap(plan(lengths[held], 64, 1, 0), held)
    assert sorted(i for p in packs for i in p.samples) == held.tolist()
    assert all(p.tokens == sum(int(lengths[i]) for i in p.samples) for p in packs)


def test_held_out_samples_are_evaluated_and_never_trained_on(trained_4_steps, ci_tiny_inputs, tmp_path):
    from eagle3_ray.train.checkpoint import read_train_state
    from eagle3_ray.train.trainer import plan_training, train_job

    out, ckpt, features = trained_4_steps
    cfg = load_config(CI_CONFIG, TRAIN_4)
    train_plan, store = plan_training(cfg, features, ci_tiny_inputs / "vocab_groups", tmp_path / "plan")
    packs, val_packs = train_plan.packs, train_plan.val_packs
    job = train_job(cfg, train_plan, tmp_path, use_gpu=False, storage=tmp_path / "ray_train")
    held = {i for p in val_packs for i in p.samples}
    late = {i for i, sid in enumerate(store.sample_ids) if sid in ("ci-10", "ci-11", "ci-12")}
    # the eval-only group whole, then the share of the other 9 samples
    assert late <= held and len(held - late) == round(0.25 * (len(store) - 3)) and job.val_packs == len(val_packs)
    assert not held & {i for p in packs for i in p.samples}
    assert set(job.val_pack_groups.values()) <= {"late", "early"} and "late" in job.val_pack_groups.values()
    for p in val_packs:  # a pack holds one group's samples (or ungrouped ones) only
        want = job.val_pack_groups.get(p.key)
        assert all((want == "late") == (i in late) for i in p.samples)
    lines = _metrics(out)
    assert [m["step"] for m in lines if "val_tau" in m] == [2, 4]  # every 2 steps, and the last one
    m = lines[-1]
    assert 1.0 <= m["val_tau"] <= 1 + cfg.train.ttt_steps and m["val_loss"] > 0
    assert 1.0 <= m["val_tau_chain3"] <= m["val_tau"]  # served, and over 3 drafts of the ttt_steps
    assert 1.0 <= m["val_tau_walk3"] <= 4.0  # the chain of 3 drafts walked over each held-out answer
    # every held-out pack, once, at each evaluation: the first reads the shard, the second replays it
    assert [e["val_tokens"] for e in lines if "val_tau" in e] == [sum(p.tokens for p in val_packs)] * 2
    # each group's figures over its own packs: the eval-only group's tokens are its samples' tokens
    assert m["val_tokens/late"] == sum(int(store.lengths[i]) for i in late)
    groups = {k.split("/", 1)[1] for k in m if k.startswith("val_tau/")}
    assert groups == set(job.val_pack_groups.values())
    for g in groups:
        assert 1.0 <= m[f"val_tau/{g}"] <= 1 + cfg.train.ttt_steps and m[f"val_tau_chain3/{g}"] <= m[f"val_tau/{g}"]
        assert 1.0 <= m[f"val_tau_walk3/{g}"] <= 4.0
    ungrouped = sum(p.tokens for p in val_packs if p.key not in job.val_pack_groups)
    assert sum(m[f"val_tokens/{g}"] for g in groups) + ungrouped == m["val_tokens"]
    # the overall figure is the token-weighted mean of the parts (ungrouped packs included)
    if not ungrouped:
        assert m["val_tau"] == pytest.approx(sum(m[f"val_tau/{g}"] * m[f"val_tokens/{g}"] for g in groups)
                                             / m["val_tokens"])
    identity = read_train_state(out / ckpt)["identity"]
    assert identity["val_share"] == 0.25 and identity["eval_only"] == {"late": "ci-1[0-2]"}


def test_eval_only_groups_must_exist_and_match_and_leave_something_to_train(ci_tiny_inputs, tmp_path):
    from eagle3_ray.errors import ConfigError
    from eagle3_ray.train.trainer import plan_training

    with pytest.raises(ConfigError, match="val_groups does not define"):
        load_config(CI_CONFIG, ["train.eval_only=[mt_bench]"])
    with pytest.raises(ConfigError, match="not a regular expression"):
        load_config(CI_CONFIG, ['train.val_groups={mt_bench: "mtbench-("}'])
    features, vocab = ci_tiny_inputs / "features", ci_tiny_inputs / "vocab"
    nothing = load_config(CI_CONFIG, ['train.val_groups={mt_bench: "mtbench-.*"}', "train.eval_only=[mt_bench]"])
    with pytest.raises(ConfigError, match="matches no sample id"):
        plan_training(nothing, features, vocab, tmp_path / "a")
    everything = load_config(CI_CONFIG, ['train.val_groups={all: "ci-.*"}', "train.eval_only=[all]"])
    with pytest.raises(ConfigError, match="nothing of .* is left to train on"):
        plan_training(everything, features, vocab, tmp_path / "b")
    # groups without eval_only change nothing of what is trained on, nor the run's identity
    plain = plan_training(load_config(CI_CONFIG, ["train.val_share=0.25"]), features, vocab, tmp_path / "c")
    grouped = plan_training(load_config(CI_CONFIG, ["train.val_share=0.25", 'train.val_groups={x: "ci-0.*"}']),
                            features, vocab, tmp_path / "d")
    assert plain[0].packs == grouped[0].packs and plain[0].identity == grouped[0].identity
    assert sorted(i for p in plain[0].val_packs for i in p.samples) == sorted(
        i for p in grouped[0].val_packs for i in p.samples)


def test_training_refuses_a_vocab_map_that_counted_its_eval_only_samples(ci_tiny_inputs, tmp_path):
    """The draft vocab is chosen by token counts: a map built over this very store with the
    evaluation-only samples counted (`eagle3-ray vocab` without the same train.eval_only) would let
    them shape what the drafter can propose. Training refuses it on the driver, naming the fix; the
    map built with the groups passes, and a map built over other data is not judged."""
    from eagle3_ray.data.vocab import load_vocab_map, save_vocab_map
    from eagle3_ray.errors import ConfigError
    from eagle3_ray.train.trainer import plan_training

    features = ci_tiny_inputs / "features"
    cfg = load_config(CI_CONFIG, ["train.val_share=0.25", *GROUPS])
    with pytest.raises(ConfigError, match=r"counted the 3 samples of train.eval_only \{'late': 'ci-1\[0-2\]'\}.*"
                                          r"eagle3-ray vocab -c <config> --features"):
        plan_training(cfg, features, ci_tiny_inputs / "vocab", tmp_path / "a")
    assert not (tmp_path / "a").exists()  # refused before any output
    plan_training(cfg, features, ci_tiny_inputs / "vocab_groups", tmp_path / "b")
    d2t, t2d, meta = load_vocab_map(ci_tiny_inputs / "vocab" / "vocab_map.safetensors")
    (tmp_path / "other").mkdir()
    save_vocab_map(tmp_path / "other" / "vocab_map.safetensors", d2t, t2d, {**meta, "fingerprint": "0" * 16})
    plan_training(cfg, features, tmp_path / "other", tmp_path / "c")
    # without evaluation-only groups the map that counts every sample is the right one
    plan_training(load_config(CI_CONFIG, ["train.val_share=0.25"]), features, ci_tiny_inputs / "vocab", tmp_path / "d")


def test_online_training_refuses_a_held_out_share(tmp_path):
    from eagle3_ray.errors import ConfigError
    from eagle3_ray.online import run_online_training

    cfg = load_config(CI_CONFIG, ["train.mode=online", "train.val_share=0.1"])
    with pytest.raises(ConfigError, match="train.val_share=0"):
        run_online_training(cfg, tmp_path / "prepared", tmp_path / "vocab", tmp_path / "out")
    cfg = load_config(CI_CONFIG, ["train.mode=online", *GROUPS])
    with pytest.raises(ConfigError, match="evaluates none"):
        run_online_training(cfg, tmp_path / "prepared", tmp_path / "vocab", tmp_path / "out")


def _copy_run(trained, dest):
    """A copy of a finished training --out (a rerun there resumes from its checkpoint): (out, ckpt)."""
    out, ckpt, _ = trained
    return shutil.copytree(out, dest), dest / ckpt


def test_train_checkpoints_resumes_and_exports(trained_4_steps, trained_4_then_6, ci_tiny_inputs, tmp_path):
    from eagle3_ray.drafter import load_drafter
    from eagle3_ray.train.checkpoint import consumed_packs, export_from_training, latest_checkpoint, read_train_state

    out, ckpt = trained_4_steps[0], trained_4_steps[0] / trained_4_steps[1]
    assert latest_checkpoint(out) == ckpt
    state = read_train_state(ckpt)
    assert state["step"] == 4
    assert (ckpt / "ds").is_dir() and (ckpt / "drafter.safetensors").is_file()
    assert len(consumed_packs(ckpt)) == 4 * 2  # one pack per rank and step
    steps = [m["step"] for m in _metrics(out)]
    assert steps == [1, 2, 3, 4]
    m = _metrics(out)[-1]
    for key in ("loss", "acc_0", "tau", "lr", "tokens_per_s"):
        assert key in m and m[key] == m[key]
    # Training tokens: the sample tokens of every pack trained on, both ranks, on every row (the
    # held-out rows too), growing by two packs per step; the checkpoint keeps the count.
    features = trained_4_steps[2]
    tokens = _pack_tokens(load_config(CI_CONFIG, TRAIN_4), features, ci_tiny_inputs, tmp_path / "plan")
    assert m["train_tokens"] == sum(tokens[k] for k in consumed_packs(ckpt)) == state["train_tokens"]
    counts = [r["train_tokens"] for r in _metrics(out)]
    assert all(b - a >= 2 * min(tokens.values()) for a, b in zip([0, *counts], counts))

    # Rerun the same command with a larger budget (conftest.py's trained_4_then_6, in a copy of the out
    # dir): it resumes at step 4 and continues.
    out, ckpt2 = trained_4_then_6
    assert read_train_state(ckpt2)["step"] == 6
    assert [m["step"] for m in _metrics(out)] == [1, 2, 3, 4, 5, 6]
    assert consumed_packs(ckpt2) > consumed_packs(ckpt)
    assert latest_checkpoint(out) == ckpt2
    # The resumed run counts on from the checkpoint's count.
    assert _metrics(out)[-1]["train_tokens"] == sum(tokens[k] for k in consumed_packs(ckpt2))
    assert read_train_state(ckpt2)["train_tokens"] == _metrics(out)[-1]["train_tokens"]

    drafter_dir = export_from_training(out, tmp_path / "drafter", engine="sglang", which="latest")
    drafter = load_drafter(drafter_dir)
    from safetensors.torch import load_file

    trained = load_file(str(ckpt2 / "drafter.safetensors"))
    assert torch.equal(drafter.fc.weight.float(), trained["fc.weight"].to(torch.bfloat16).float())


def test_resume_refuses_a_checkpoint_from_another_config(trained_4_steps, ci_tiny_inputs, tmp_path):
    from eagle3_ray.train.trainer import run_training

    out, _ = _copy_run(trained_4_steps, tmp_path / "train")
    other = load_config(CI_CONFIG, [*TRAIN_4, "train.max_steps=2", "train.batch_tokens=300"])
    with pytest.raises(CheckpointError, match="batch_tokens"):
        run_training(other, trained_4_steps[2], ci_tiny_inputs / "vocab_groups", out)


def test_two_workers_train_at_the_kimi_presets_zero_stage_on_gloo(trained_4_steps, ci_tiny_inputs, tmp_path):
    from safetensors.torch import load_file

    from eagle3_ray.drafter.model import DrafterConfig, Eagle3Drafter
    from eagle3_ray.train.checkpoint import read_train_state
    from eagle3_ray.train.trainer import plan_training

    assert ZERO_STAGE >= 2, "the preset's stage partitions gradients; ZeRO-1 is covered by one-worker runs"
    out, ckpt, features = trained_4_steps
    ckpt = out / ckpt
    cfg = load_config(CI_CONFIG, TRAIN_4)
    state = read_train_state(ckpt)
    assert state["step"] == 4 and state["zero_stage"] == ZERO_STAGE and state["world_size"] == 2
    assert sorted(p.name for p in (ckpt / "data_state").iterdir()) == ["rank-0.json", "rank-1.json"]
    # Each rank saved its own partition of the optimizer state.
    assert len(list((ckpt / "ds").rglob("*optim_states*"))) == 2
    lines = _metrics(out)
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    assert all(m["loss"] == m["loss"] and m["loss"] > 0 for m in lines)
    # The held-out packs are split over the two ranks and their sums added: every token counted once,
    # at every evaluation.
    val_packs = plan_training(cfg, features, ci_tiny_inputs / "vocab_groups", tmp_path / "plan")[0].val_packs
    assert [m["val_tokens"] for m in lines if "val_tokens" in m] == [sum(p.tokens for p in val_packs)] * 2

    # The gathered weights moved from their seeded initialisation, by optimizer-sized steps.
    trained = load_file(str(ckpt / "drafter.safetensors"))
    dcfg = DrafterConfig.from_dict(json.loads((ckpt / "drafter_config.json").read_text()))
    torch.manual_seed(cfg.train.seed)
    init = Eagle3Drafter(dcfg).state_dict()
    moved = (trained["fc.weight"].float() - init["fc.weight"].float()).abs().max().item()
    assert 0 < moved < 100 * cfg.train.lr, moved


def test_train_refuses_a_vocab_map_of_another_size(ci_tiny_inputs, tmp_path):
    from eagle3_ray.data.vocab import build_vocab_map, save_vocab_map
    from eagle3_ray.errors import StoreError
    from eagle3_ray.train.trainer import plan_training

    d2t, t2d = build_vocab_map(np.ones(100, dtype=np.int64), 10)
    save_vocab_map(tmp_path / "vocab_map.safetensors", d2t, t2d, {})
    with pytest.raises(StoreError, match="target ids"):
        plan_training(load_config(CI_CONFIG), ci_tiny_inputs / "features", tmp_path, tmp_path / "out")


def test_the_training_loop_reads_its_shard_in_one_pass(ray_local, tmp_path):
    """Steps take rows from one execution of the dataset: DataIterator.iter_rows() is an iterable
    that re-executes the whole pipeline on every iter(), which once cost seconds per step. The
    prefetch thread skips packs consumed before a resume."""
    import ray
    import torch

    from eagle3_ray.train.loop import pack_stream
    from eagle3_ray.train.prefetch import PackPrefetcher

    log = tmp_path / "loads.txt"
    path = str(log)

    def load(row: dict) -> dict:  # nested: pickled by value for the Ray workers
        with open(path, "a") as f:
            f.write(f"{row['id']}\n")
        return {"key": f"0:{row['id']}", "x": row["id"]}

    ds = ray.data.range(8, override_num_blocks=8).map(load)
    convert = lambda row: ({"x": torch.tensor([int(row["x"])])}, None)  # noqa: E731
    taken = []
    with PackPrefetcher(pack_stream(ds.iterator()), convert, torch.device("cpu"), skip=frozenset({"0:2"})) as rows:
        while (item := rows.next()) is not None:
            key, batch, _ = item
            assert key == f"0:{int(batch['x'])}"
            taken.append(key)
        assert rows.next() is None
    assert sorted(taken) == sorted(f"0:{i}" for i in range(8) if i != 2)
    assert len(log.read_text().split()) == 8  # every row loaded once: one execution


def _vote_worker(rank: int, world: int, init: str, has: list[bool], out: str) -> None:
    import torch.distributed as dist

    from eagle3_ray.train.loop import _all_have_data, _vote_group

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        group = _vote_group()
        votes = [_all_have_data(h, group) for h in has[rank::world]]
        with open(f"{out}.{rank}", "w") as f:
            json.dump(votes, f)
    finally:
        dist.destroy_process_group()


def test_ranks_stop_together_when_any_runs_out_of_packs(tmp_path):
    """The per-step has-data vote (gloo, on the host): a rank that runs dry stops every rank, so an
    uneven shard never leaves the others waiting in a collective; one worker votes alone."""
    import torch.multiprocessing as mp

    from eagle3_ray.train.loop import _all_have_data, _vote_group

    # per step, interleaved by rank: both have data, both, then rank 1 runs dry
    has = [True, True, True, True, True, False]
    out = str(tmp_path / "votes")
    mp.spawn(_vote_worker, args=(2, f"file://{tmp_path / 'store'}", has, out), nprocs=2)
    for rank in (0, 1):
        assert json.loads(open(f"{out}.{rank}").read()) == [True, True, False]
    assert _vote_group() is None  # no process group here: nothing to vote with
    assert _all_have_data(False, None) is False and _all_have_data(True, None) is True


def test_train_refuses_the_triton_loss_on_cpu_before_any_worker_starts(ray_local, ci_tiny_inputs, tmp_path):
    from eagle3_ray.errors import ConfigError
    from eagle3_ray.train.trainer import run_training

    cfg = load_config(CI_CONFIG, ["train.use_gpu=false", "train.loss_kernel=triton"])
    with pytest.raises(ConfigError, match="train.loss_kernel=triton needs CUDA"):
        run_training(cfg, ci_tiny_inputs / "features", ci_tiny_inputs / "vocab", tmp_path / "out")
    assert not (tmp_path / "out" / "ray_train").exists()  # refused on the driver: no Ray Train run began
