"""A restarted worker group resumes from the newest complete checkpoint on storage, not only from the
one Ray Train offers: Ray Train registers a checkpoint only when its controller next polls, after
`ray.train.report` returned from the upload, so a worker killed in between is restarted with the
checkpoint before it (or none) while a newer whole one is on storage. Rank 0 chooses; every rank loads
its choice."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file

from eagle3_ray.train import checkpoint as ck


def _checkpoint(run_dir: Path, name: str, step: int, world: int = 2) -> Path:
    """A checkpoint in the layout Trainer.save reports (ds/, data_state/rank-R.json, drafter weights,
    train_state.json), under a Ray Train run dir."""
    d = run_dir / name
    for r in range(world):
        torch.save({"optimizer": torch.zeros(4)}, _mk(d / ck.DS_TAG / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
        ck.write_json(d / ck.DATA_STATE_DIR / f"rank-{r}.json", [f"0:{step}-{r}"])
    torch.save({"module": torch.zeros(4)}, d / ck.DS_TAG / "mp_rank_00_model_states.pt")
    save_file({"w": torch.ones(8, 8)}, str(d / "drafter.safetensors"))
    ck.write_json(d / ck.TRAIN_STATE, {"step": step, "world_size": world, "zero_stage": 1, "identity": {}})
    return d


def _mk(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def test_a_newer_complete_checkpoint_on_storage_beats_the_one_ray_train_offers(tmp_path, capsys):
    storage = tmp_path / "ray_train"
    run_dir = storage / "ci-tiny-train"
    registered = _checkpoint(run_dir, "checkpoint_2026-01-01_00-00-01.000000", 4)  # Ray Train knows this one
    unregistered = _checkpoint(run_dir, "checkpoint_2026-01-01_00-00-02.000000", 8)  # uploaded, not yet polled
    half = _checkpoint(run_dir, "checkpoint_2026-01-01_00-00-03.000000", 12)  # killed mid-copy
    opt = half / ck.DS_TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    opt.write_bytes(opt.read_bytes()[:20])

    assert ck.checkpoint_to_resume(str(registered), storage) == unregistered
    assert f"skipping incomplete checkpoint {half}" in capsys.readouterr().out
    assert ck.checkpoint_to_resume(None, storage) == unregistered  # Ray Train offered none (the bug's case)
    assert ck.checkpoint_to_resume(None, run_dir) == unregistered  # the run dir itself works too


def test_ray_train_keeps_ties_and_newer_ones_and_nothing_gives_none(tmp_path):
    storage = tmp_path / "ray_train"
    on_storage = _checkpoint(storage / "x-train", "checkpoint_b", 8)
    same_step = _checkpoint(tmp_path / "elsewhere", "checkpoint_a", 8)
    newer = _checkpoint(tmp_path / "elsewhere", "checkpoint_c", 12)
    assert ck.checkpoint_to_resume(same_step, storage) == same_step  # a tie goes to Ray Train's
    assert ck.checkpoint_to_resume(on_storage, storage) == on_storage
    assert ck.checkpoint_to_resume(newer, storage) == newer
    assert ck.checkpoint_to_resume(newer, None) == newer
    assert ck.checkpoint_to_resume(None, tmp_path / "missing") is None
    assert ck.checkpoint_to_resume(None, None) is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _broadcast_worker(rank: int, world: int, port: int, cases: list[tuple[str, str | None]], out: str) -> None:
    from eagle3_ray.train.loop import _broadcast_path, _vote_group

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=world)
    try:
        group = _vote_group()
        for case, chosen in cases:  # one after the other in one group, as successive restores would
            mine = Path(chosen) if rank == 0 and chosen is not None else None  # only rank 0 chooses
            got = _broadcast_path(mine, group)
            Path(out, case, f"rank-{rank}.json").write_text(json.dumps(None if got is None else str(got)))
    finally:
        torch.distributed.destroy_process_group()


def test_every_rank_loads_the_checkpoint_rank_0_chose(tmp_path):
    chosen = str(tmp_path / "ray_train" / "ci-tiny-train" / "checkpoint_ü 2")  # any path survives the trip
    cases = [("path", chosen), ("none", None)]
    for case, _ in cases:
        (tmp_path / case).mkdir()
    # One spawn of three ranks for both cases: each rank process imports torch and the training loop.
    mp.spawn(_broadcast_worker, args=(3, _free_port(), cases, str(tmp_path)), nprocs=3, join=True)
    for case, value in cases:
        got = [json.loads((tmp_path / case / f"rank-{r}.json").read_text()) for r in range(3)]
        assert got == [value] * 3, case
