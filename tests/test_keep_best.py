"""train.keep_best: the checkpoint with the best held-out tau is kept beside the latest, across a resume
exactly as in one run, and `eagle3-ray export` takes it unless told --which latest.

Four layers, each real: the workers' record (`KeepBest`) over a held-out tau that rises, falls and ties,
resumed from a checkpoint midway; Ray Train's own keeping of those checkpoints under our CheckpointConfig
(a Ray Train run that reports them); the selection on real checkpoint directories; and a whole Ray Train
+ DeepSpeed training (conftest.py's ``trained_4_then_6``: 4 steps, then resumed to 6) against the same
training in one go. The ci-tiny target is random, so that training's held-out tau stays 1.0 at every
evaluation (every evaluation ties, and the latest wins): the sequences that rise and fall are the first two
layers'.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3_ray.errors import CheckpointError
from eagle3_ray.train.checkpoint import (
    SCORE, KeepBest, best_summary, checkpoint_dirs, export_from_training, improves, read_train_state,
    select_checkpoint,
)
from test_cli_paths import _checkpoint
from test_train import CI_CONFIG, TRAIN_4

RUN = Path("ray_train") / "ci-tiny-train"


def _run(root: Path, steps: dict[int, dict], best: dict | None) -> Path:
    """A training --out holding checkpoints of ``steps`` ({step: train_state extras}); the newest records
    ``best``. Each checkpoint's drafter weights differ (seeded by the step)."""
    newest = max(steps)
    for i, (step, extra) in enumerate(sorted(steps.items())):
        state = {"step": step, "identity": {}, **extra}
        if step == newest and best is not None:
            state["best"] = best
        torch.manual_seed(step)
        _checkpoint(root / RUN / f"checkpoint_{i:06d}", json.dumps(state))
    return root


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "drafter.safetensors"))


def test_a_tie_goes_to_the_later_evaluation_as_ray_train_keeps_it():
    assert improves(None, 1.0)
    assert improves({"step": 2, "val_tau": 1.5}, 1.5) and improves({"step": 2, "val_tau": 1.5}, 1.6)
    assert not improves({"step": 2, "val_tau": 1.5}, 1.49)


# Held-out tau at each evaluation of a 10-step run with checkpoints every 4 steps: it rises, falls, ties.
EVALS = {2: 1.8, 4: 2.1, 6: 1.9, 8: 2.1, 10: 1.7}
EVERY, LAST = 4, 10


def _train(evals: dict[int, float], resumed_at: int | None = None, enabled: bool = True):
    """The worker loop's keep-best decisions: ({checkpointed step: (its score, its train_state entries)},
    the record at the end). ``resumed_at``: the run stops after that step and a new attempt restores the
    newest checkpoint from the state it saved, and trains the steps after it again."""
    keeper, saved, step = KeepBest(enabled), {}, 1
    while step <= LAST:
        new_best = step in evals and keeper.evaluated(step, evals[step])
        if step % EVERY == 0 or step == LAST or new_best:
            saved[step] = (keeper.score(step), keeper.state())
        if step == resumed_at:  # no checkpoint yet: the new attempt starts from scratch
            resumed_at, step = None, max(saved, default=0)
            keeper = KeepBest(enabled, saved[step][1] if step else None)
        step += 1
    return saved, keeper


def test_the_workers_record_keeps_the_best_evaluation_across_a_resume():
    saved, keeper = _train(EVALS)
    # 2 and 4 rise (checkpointed at once), 6 falls, 8 ties 4 (the later wins), 10 falls (the last step)
    assert {s: score for s, (score, _) in saved.items()} == {2: {SCORE: 1.8}, 4: {SCORE: 2.1}, 8: {SCORE: 2.1},
                                                             10: {SCORE: 1.7}}
    assert keeper.best == {"step": 8, "val_tau": 2.1} and keeper.last == {"step": 10, "val_tau": 1.7}
    assert saved[10][1] == {"best": {"step": 8, "val_tau": 2.1}, "last_eval": {"step": 10, "val_tau": 1.7}}
    for stop in range(1, LAST):  # killed after any step: the resumed attempt ends as the run in one go
        again, record = _train(EVALS, resumed_at=stop)
        assert again == saved and (record.best, record.last) == (keeper.best, keeper.last), stop
    # without the restored record a resumed attempt would take its first evaluation for the best
    fresh = KeepBest(True)
    assert fresh.evaluated(10, 1.7) and fresh.best["step"] == 10
    # not keeping: no score for Ray Train, no best in train_state.json, no checkpoint off the grid
    off, record = _train(EVALS, enabled=False)
    assert sorted(off) == [4, 8, 10] and all(score == {} for score, _ in off.values()) and record.best is None
    assert off[10][1] == {"last_eval": {"step": 10, "val_tau": 1.7}}


def test_ray_train_keeps_the_two_best_and_the_latest_under_our_checkpoint_config(ray_local, tmp_path):
    """What the keeping rests on, in Ray Train itself: with `checkpoint_config(keep_best=True)` a best
    checkpoint older than the two latest stays, and the export finds it; without, the two latest stay."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from eagle3_ray.train.trainer import checkpoint_config

    def report_checkpoints(config: dict) -> None:  # nested: pickled by value for the Ray Train worker
        """Report the checkpoints of ``config["saved"]`` as train/loop.py's `save` does."""
        import tempfile

        for step, score, state in config["saved"]:
            with tempfile.TemporaryDirectory() as tmp:
                (Path(tmp) / "train_state.json").write_text(json.dumps({"step": step, **state}))
                ray.train.report({"step": step, **score}, checkpoint=ray.train.Checkpoint.from_directory(tmp))

    falling = {2: 2.5, 4: 2.0, 6: 1.9, 8: 1.8, 10: 1.7}  # the best is the first evaluation
    for keep, want in ((True, [2, 4, 10]), (False, [8, 10])):
        saved, _ = _train(falling, enabled=keep)
        assert sorted(saved) == ([2, 4, 8, 10] if keep else [4, 8, 10])
        storage = tmp_path / f"keep-{keep}"
        TorchTrainer(report_checkpoints, train_loop_config={"saved": [(s, *saved[s]) for s in sorted(saved)]},
                     scaling_config=ray.train.ScalingConfig(num_workers=1),
                     run_config=ray.train.RunConfig(name="ci-tiny-train", storage_path=str(storage),
                                                    checkpoint_config=checkpoint_config(keep))).fit()
        assert sorted(read_train_state(p)["step"] for p in checkpoint_dirs(storage)) == want, keep
        chosen = select_checkpoint(storage)
        assert (chosen.which, chosen.step) == (("best", 2) if keep else ("latest", 10))


def test_export_takes_the_best_checkpoint_unless_told_latest(tmp_path):
    best = {"step": 4, "val_tau": 1.8}
    out = _run(tmp_path / "train", {2: {}, 4: {}, 6: {"last_eval": {"step": 6, "val_tau": 1.7}}}, best)
    chosen = select_checkpoint(out)
    assert (chosen.which, chosen.step, chosen.path.name) == ("best", 4, "checkpoint_000001")
    assert select_checkpoint(out, "best") == chosen
    assert select_checkpoint(out / "ray_train") == chosen  # Ray Train storage, and the run dir: the same
    assert select_checkpoint(out / RUN) == chosen
    latest = select_checkpoint(out, "latest")
    assert (latest.which, latest.step) == ("latest", 6)
    named = select_checkpoint(out / RUN / "checkpoint_000000")  # one checkpoint named: taken as it is
    assert (named.which, named.step) == ("named", 2)
    # the exported weights are those of the checkpoint chosen
    for which, src in ((None, chosen.path), ("latest", latest.path)):
        exported = export_from_training(out, tmp_path / f"drafter-{which}", which=which)
        assert torch.equal(load_file(str(exported / "model.safetensors"))["fc.weight"],
                           _weights(src)["fc.weight"].to(torch.bfloat16))
    assert not torch.equal(_weights(chosen.path)["fc.weight"], _weights(latest.path)["fc.weight"])
    assert best_summary(out / RUN) == {"step": 4, "val_tau": 1.8, "last_eval_step": 6, "last_eval_val_tau": 1.7,
                                       "margin": pytest.approx(0.1)}


def test_a_run_that_kept_no_best_exports_its_latest_and_refuses_which_best(tmp_path):
    out = _run(tmp_path / "train", {2: {}, 4: {}}, best=None)  # no held-out samples, or keep_best=none
    chosen = select_checkpoint(out)
    assert (chosen.which, chosen.step) == ("latest", 4)
    with pytest.raises(CheckpointError, match=r"--which best: the run in --checkpoint .* kept no best checkpoint "
                                              r".*pass --which latest"):
        select_checkpoint(out, "best")
    assert best_summary(out / RUN) is None


def test_a_best_checkpoint_that_is_gone_is_named_not_replaced(tmp_path):
    out = _run(tmp_path / "train", {4: {}, 6: {}}, best={"step": 2, "val_tau": 1.9})  # step 2 deleted by hand
    for which in (None, "best"):
        with pytest.raises(CheckpointError, match=r"kept its best checkpoint at step 2 \(held-out tau 1\.900\), "
                                                  r"and no checkpoint_\* of that step is there any more; pass "
                                                  r"--which latest"):
            select_checkpoint(out, which)
    assert select_checkpoint(out, "latest").step == 6


def test_which_does_not_apply_to_one_named_checkpoint(tmp_path):
    out = _run(tmp_path / "train", {2: {}}, best={"step": 2, "val_tau": 1.2})
    with pytest.raises(CheckpointError, match=r"--which latest: --checkpoint .*checkpoint_000000 is one checkpoint"):
        select_checkpoint(out / RUN / "checkpoint_000000", "latest")


def _evaluated(rows: list[dict]) -> dict[int, float]:
    return {m["step"]: m["val_tau"] for m in rows if "val_tau" in m}


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _kept(out: Path) -> dict[int, Path]:
    return {read_train_state(p)["step"]: p for p in checkpoint_dirs(out)}


def test_the_best_checkpoint_is_kept_across_a_resume_as_in_one_run(trained_4_then_6, trained_4_steps,
                                                                    ci_tiny_inputs, tmp_path):
    """The resumed run (4 steps, then 6; held-out evaluations at 2, 4 and 6) keeps the same best checkpoint
    as the same training in one go, whose checkpoints come every 5 steps: there a checkpoint of step 2 or 4
    exists only because its evaluation was the best so far (a tie counts), and Ray Train kept it by its
    held-out tau (the two best and the latest), not by age: step 5's, never evaluated, is gone."""
    from eagle3_ray.config import load_config
    from eagle3_ray.train.trainer import run_training

    resumed, _ = trained_4_then_6
    one_go = tmp_path / "train"
    run_training(load_config(CI_CONFIG, [*TRAIN_4, "train.max_steps=6", "train.checkpoint_every=5"]),
                 trained_4_steps[2], ci_tiny_inputs / "vocab_groups", one_go)
    rows = {name: _metrics(out) for name, out in (("resumed", resumed), ("one_go", one_go))}
    assert [m["resumed_from"] for m in rows["resumed"]] == [0] * 4 + [4] * 2
    # the same training: the resumed attempt continued exactly where the checkpoint left it
    for key in ("loss", "tau", "val_tau", "val_loss"):
        assert [m.get(key) for m in rows["resumed"]] == [m.get(key) for m in rows["one_go"]], key
    evaluated = _evaluated(rows["one_go"])
    assert sorted(evaluated) == [2, 4, 6]
    best_step = max(evaluated, key=lambda s: (evaluated[s], s))  # a tie goes to the later evaluation
    want = {"step": best_step, "val_tau": evaluated[best_step]}
    for out in (resumed, one_go):
        final = _kept(out)[6]
        assert read_train_state(final)["best"] == want  # the resumed attempt carried the earlier evaluations'
        assert read_train_state(final)["last_eval"] == {"step": 6, "val_tau": evaluated[6]}
        chosen = select_checkpoint(out)
        assert (chosen.which, chosen.step) == ("best", best_step)
        assert read_train_state(chosen.path)["step"] == best_step
        summary = json.loads((out / "summary.json").read_text())["best"]
        assert (summary["step"], summary["val_tau"], summary["last_eval_step"]) == (best_step, want["val_tau"], 6)
        assert summary["margin"] == pytest.approx(want["val_tau"] - evaluated[6])
        assert summary["checkpoint"] == str(chosen.path)
    # In one go: checkpoints at 5 and 6 (checkpoint_every, the last step) and at each evaluation that was
    # the best so far; Ray Train keeps the two of the highest held-out tau (0 for the one not evaluated at
    # its step) and the latest.
    saved, bar = {5: 0.0, 6: evaluated[6]}, None
    for step in (2, 4):
        if improves(bar, evaluated[step]):
            saved[step], bar = evaluated[step], {"val_tau": evaluated[step]}
    ranked = sorted(saved, key=lambda s: (saved[s], sorted(saved).index(s)))
    assert set(_kept(one_go)) == set(ranked[-2:]) | {6}
    assert 5 not in _kept(one_go) and set(_kept(one_go)) & {2, 4}  # kept by held-out tau, not by age
    assert torch.equal(_weights(_kept(one_go)[best_step])["fc.weight"],
                       _weights(_kept(resumed)[best_step])["fc.weight"])
