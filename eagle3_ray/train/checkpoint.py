"""Training checkpoint layout, compatibility checks, and export from a training run.

A checkpoint directory (one per `ray.train.report`, merged over ranks by Ray Train):
    ds/                     DeepSpeed state of every rank: module, optimizer, LR scheduler
    drafter.safetensors     full drafter weights (rank 0), + drafter_config.json
    train_state.json        step, epoch, metrics, and the run identity used to refuse other configs
    data_state/rank-R.json  packs (epoch:index) rank R consumed: the data position
DeepSpeed's `ds/` files are torch pickles written by this run; only resume from checkpoints your own
runs wrote. Exported drafters and drafter weights are safetensors only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3_ray.errors import CheckpointError

TRAIN_STATE = "train_state.json"
DATA_STATE_DIR = "data_state"
DS_TAG = "ds"


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True), encoding="utf-8")
    tmp.replace(path)


def read_train_state(ckpt: Path) -> dict[str, Any]:
    path = Path(ckpt) / TRAIN_STATE
    if not path.is_file():
        raise CheckpointError(f"{ckpt} has no {TRAIN_STATE}; it is not an eagle3-ray training checkpoint")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is corrupt ({e}); delete that checkpoint to resume from an older one") from e


def consumed_packs(ckpt: Path) -> set[str]:
    keys: set[str] = set()
    for f in sorted((Path(ckpt) / DATA_STATE_DIR).glob("rank-*.json")):
        keys.update(json.loads(f.read_text(encoding="utf-8")))
    return keys


def check_identity(saved: dict[str, Any], current: dict[str, Any], ckpt: Path) -> None:
    """Refuse to resume a checkpoint written under another configuration, naming the keys."""
    diffs = [
        f"{k}: checkpoint {saved.get(k)!r} vs config {current.get(k)!r}"
        for k in sorted(set(saved) | set(current))
        if saved.get(k) != current.get(k)
    ]
    if diffs:
        raise CheckpointError(
            f"checkpoint {ckpt} was written by another configuration ({'; '.join(diffs)}); "
            "rerun with the original config, or give a new --out to train from scratch"
        )


def latest_checkpoint(train_out: Path) -> Path | None:
    """Newest complete checkpoint under a `train --out` directory (or the dir itself if it is one)."""
    train_out = Path(train_out)
    if (train_out / TRAIN_STATE).is_file():
        return train_out
    cands = [p.parent for p in train_out.glob("**/" + TRAIN_STATE)]
    if not cands:
        return None
    return max(cands, key=lambda p: read_train_state(p).get("step", -1))


def export_from_training(checkpoint: str | Path, out: str | Path, engine: str = "sglang") -> Path:
    from eagle3_ray.drafter.export import export_drafter

    ckpt = latest_checkpoint(Path(checkpoint))
    if ckpt is None:
        raise CheckpointError(
            f"no training checkpoint under {checkpoint}; pass the --out of `eagle3-ray train` or a checkpoint dir"
        )
    return export_drafter(ckpt, out, engine=engine)
