"""Resume skips checkpoints a killed job left half-copied on storage (truncated DeepSpeed pickles,
missing rank files, a short safetensors) and takes the newest whole one; export is unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle3_ray.train.checkpoint import incomplete_reason, latest_checkpoint


def _checkpoint(root: Path, name: str, step: int, world: int = 2) -> Path:
    d = root / name
    (d / "ds").mkdir(parents=True)
    torch.save({"module": torch.zeros(4)}, d / "ds" / "mp_rank_00_model_states.pt")
    for r in range(world):
        torch.save({"optimizer": torch.zeros(4)}, d / "ds" / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
        (d / "data_state").mkdir(exist_ok=True)
        (d / "data_state" / f"rank-{r}.json").write_text(json.dumps([f"0:{r}"]))
    save_file({"w": torch.ones(8, 8)}, str(d / "drafter.safetensors"))
    (d / "train_state.json").write_text(json.dumps({"step": step, "world_size": world, "zero_stage": 1}))
    return d


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def test_resume_takes_the_newest_whole_checkpoint(tmp_path, capsys):
    old = _checkpoint(tmp_path, "checkpoint_a", 4)
    new = _checkpoint(tmp_path, "checkpoint_b", 8)
    assert incomplete_reason(old) is None and latest_checkpoint(tmp_path, complete_only=True) == new
    _truncate(new / "ds" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert "truncated DeepSpeed files" in incomplete_reason(new)
    assert latest_checkpoint(tmp_path, complete_only=True) == old
    assert f"skipping incomplete checkpoint {new}" in capsys.readouterr().out
    assert latest_checkpoint(tmp_path) == new  # export and inspection still see it (and fail loudly)


def test_each_kind_of_missing_or_short_file_is_named(tmp_path):
    cases = {
        "rank file": (lambda d: (d / "data_state" / "rank-1.json").unlink(), "data state of ranks [1] missing"),
        "optimizer file": (lambda d: (d / "ds" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink(),
                           "optimizer state of 1 of 2 ranks"),
        "weights": (lambda d: _truncate(d / "drafter.safetensors", 0.9), "drafter.safetensors is truncated"),
        "no weights": (lambda d: (d / "drafter.safetensors").unlink(), "missing or has no readable header"),
        "state json": (lambda d: (d / "data_state" / "rank-0.json").write_text("[\"0:"), "not readable JSON"),
        "no ds": (lambda d: [p.unlink() for p in (d / "ds").iterdir()], "no DeepSpeed state"),
    }
    for i, (name, (damage, reason)) in enumerate(cases.items()):
        d = _checkpoint(tmp_path, f"c{i}", 1)
        damage(d)
        assert reason in (incomplete_reason(d) or ""), name
