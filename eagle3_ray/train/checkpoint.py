"""Training checkpoint layout, compatibility checks, and export from a training run.

A checkpoint directory (one per `ray.train.report`, merged over ranks by Ray Train):
    ds/                     DeepSpeed state of every rank: module, optimizer, LR scheduler
    drafter.safetensors     full drafter weights (rank 0), + drafter_config.json
    train_state.json        step, epoch, metrics, the run identity used to refuse other configs, and with
                            train.keep_best the best held-out evaluation so far (`best`) and the last one
    data_state/rank-R.json  packs (epoch:index) rank R consumed: the data position
DeepSpeed's `ds/` files are torch pickles written by this run; only resume from checkpoints your own
runs wrote. Exported drafters and drafter weights are safetensors only.

Where checkpoints are looked for (``checkpoint_dirs``): only in the directory named and the fixed
layout this project writes below it, never anywhere else under it:
    <dir>/train_state.json                             <dir> is a checkpoint
    <dir>/checkpoint_*/                                <dir> is a Ray Train run dir
    <dir>/<name>-train/checkpoint_*/                   <dir> is Ray Train storage (ray.storage_path)
    <dir>/ray_train/<name>-train/checkpoint_*/         <dir> is the --out of `eagle3-ray train`

The best checkpoint (train.keep_best): the newest checkpoint's `best` names the step whose held-out tau
no later evaluation beat; that checkpoint is kept beside the newest (Ray Train's CheckpointConfig
scores checkpoints by ``SCORE``), and ``select_checkpoint`` finds it for `eagle3-ray export`.
"""

from __future__ import annotations

import json
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_ray import atomic
from eagle3_ray.drafter.export import CHECKPOINT_WEIGHTS, export_drafter
from eagle3_ray.errors import CheckpointError, require_dir
from eagle3_ray.progress import say

TRAIN_STATE = "train_state.json"
DATA_STATE_DIR = "data_state"
DS_TAG = "ds"
TRAIN_STORAGE = "ray_train"  # <train --out>/ray_train: Ray Train's storage unless ray.storage_path is set
RUN_DIR_GLOB = "*-train"  # Ray Train run dirs are named "<config name>-train" (trainer.fit)
CHECKPOINT_GLOB = "checkpoint_*"
# The metric Ray Train keeps checkpoints by under train.keep_best: the held-out tau of the checkpoint's own
# weights, 0 for a checkpoint not evaluated at its step (a measured tau is at least 1).
SCORE = "checkpoint_val_tau"
# The only places below a named directory where checkpoints are looked for (module docstring).
_LAYOUT = (f"{CHECKPOINT_GLOB}/{TRAIN_STATE}", f"{RUN_DIR_GLOB}/{CHECKPOINT_GLOB}/{TRAIN_STATE}",
           f"{TRAIN_STORAGE}/{RUN_DIR_GLOB}/{CHECKPOINT_GLOB}/{TRAIN_STATE}")


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_json(path, obj, sort_keys=True, newline=False)


def read_train_state(ckpt: Path) -> dict[str, Any]:
    path = Path(ckpt) / TRAIN_STATE
    if not path.is_file():
        raise CheckpointError(f"{ckpt} has no {TRAIN_STATE}; it is not an eagle3-ray training checkpoint")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{path} is corrupt ({e}); that checkpoint was not written completely: pass an older checkpoint_* "
            "directory of the same run, or move this one away to resume training from the older one"
        ) from e


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


def checkpoint_dirs(path: str | Path) -> list[Path]:
    """The checkpoints ``path`` names: itself, or those in the layout this project writes below it
    (module docstring). Nothing else under ``path`` is searched, so a directory that is not a
    training output yields [] however many checkpoints of other runs lie deeper in it."""
    path = Path(path)
    if (path / TRAIN_STATE).is_file():
        return [path]
    for pattern in _LAYOUT:
        found = sorted(p.parent for p in path.glob(pattern))
        if found:
            return found
    return []


def find_checkpoint(path: str | Path, what: str = "--checkpoint") -> Path:
    """The newest checkpoint ``path`` names (checkpoint_dirs); a CheckpointError saying what to pass
    when ``path`` is missing, a file, or a directory that is neither a training output nor a checkpoint."""
    want = "pass the --out of `eagle3-ray train` or one of its checkpoint_* directories"
    path = require_dir(path, what, want, CheckpointError)
    ckpt = latest_checkpoint(path)
    if ckpt is None:
        hint = ""
        if checkpoint_dirs(path / "train"):
            hint = f" (it looks like the --out of `eagle3-ray run`: pass {path / 'train'})"
        raise CheckpointError(
            f"{what} {path} is neither a training output nor a checkpoint: it holds no {TRAIN_STATE}, "
            f"no {CHECKPOINT_GLOB}/ and no {TRAIN_STORAGE}/{RUN_DIR_GLOB}/{CHECKPOINT_GLOB}/{hint}; {want}"
        )
    return ckpt


def latest_checkpoint(train_out: Path, complete_only: bool = False) -> Path | None:
    """Newest checkpoint that ``train_out`` names (``checkpoint_dirs``): a `train --out` directory,
    Ray Train storage or run dir, or a checkpoint itself.

    ``complete_only``: skip (and say so) checkpoints with missing or truncated files, as a job killed
    while Ray Train copied a checkpoint to storage leaves them; resuming takes the newest whole one.
    """
    cands = checkpoint_dirs(train_out)
    if complete_only:
        whole = []
        for c in cands:
            reason = incomplete_reason(c)
            if reason:
                say(f"[train] skipping incomplete checkpoint {c}: {reason}")
            else:
                whole.append(c)
        cands = whole
    if not cands:
        return None
    return max(cands, key=lambda p: read_train_state(p).get("step", -1))


def checkpoint_to_resume(offered: str | Path | None, storage: str | Path | None) -> Path | None:
    """The checkpoint a (re)started worker group loads: the newer, by train_state step, of the one Ray
    Train offers (``ray.train.get_checkpoint()``'s path; None for none) and the newest complete one on
    ``storage`` (Ray Train's storage path; None or a missing directory for none). A tie goes to Ray
    Train's; None when neither has one.

    Ray Train registers a checkpoint only when its controller next polls, after ``ray.train.report``
    has returned from the upload. A worker killed in between leaves a whole checkpoint on storage that
    the restarted group is not offered (it would restart from the one before, or from step 0); a job
    killed in between leaves the same for its rerun.
    """
    offered = Path(offered) if offered is not None else None
    on_storage = latest_checkpoint(Path(storage), complete_only=True) if storage is not None else None
    if on_storage is None:
        return offered
    if offered is None:
        return on_storage
    newer = read_train_state(on_storage).get("step", -1) > read_train_state(offered).get("step", -1)
    return on_storage if newer else offered


def incomplete_reason(ckpt: Path) -> str | None:
    """Why ``ckpt`` cannot be resumed from (None = every file is there and whole).

    Ray Train registers a checkpoint only after copying all its files to storage, but the files
    appear one by one: a job killed mid-copy leaves a readable train_state.json next to truncated
    DeepSpeed pickles (zip archives without their end record) or missing rank files.
    """
    ckpt = Path(ckpt)
    try:
        state = read_train_state(ckpt)
    except CheckpointError as e:
        return str(e)
    pts = sorted((ckpt / DS_TAG).glob("**/*.pt"))
    if not pts:
        return f"no DeepSpeed state under {ckpt / DS_TAG}"
    broken = [p.name for p in pts if not zipfile.is_zipfile(p)]
    if broken:
        return f"truncated DeepSpeed files {broken}"
    world = state.get("world_size")
    if world is not None:
        ranks = {p.name for p in (ckpt / DATA_STATE_DIR).glob("rank-*.json")}
        missing = [r for r in range(world) if f"rank-{r}.json" not in ranks]
        if missing:
            return f"data state of ranks {missing} missing"
        optim = [p for p in pts if p.name.endswith("optim_states.pt")]  # one per rank under ZeRO >= 1
        if state.get("zero_stage", 0) >= 1 and len(optim) < world:
            return f"optimizer state of {len(optim)} of {world} ranks"
    for f in (ckpt / DATA_STATE_DIR).glob("rank-*.json"):
        try:
            json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return f"{f.name} is not readable JSON"
    return _safetensors_problem(ckpt / CHECKPOINT_WEIGHTS)


def _safetensors_problem(path: Path) -> str | None:
    """None when ``path`` holds its header and every byte the header promises."""
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        size = path.stat().st_size
    except (OSError, ValueError, struct.error):
        return f"{path.name} is missing or has no readable header"
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    return None if size == 8 + n + end else f"{path.name} is truncated ({size} of {8 + n + end} bytes)"


def improves(best: dict[str, Any] | None, val_tau: float) -> bool:
    """An evaluation of held-out tau ``val_tau`` becomes the best (``best``: the best so far, None for none).
    A tie goes to the later evaluation, as Ray Train's CheckpointConfig breaks ties of ``SCORE``."""
    return best is None or val_tau >= best["val_tau"]


class KeepBest:
    """train.keep_best's record on a training worker: the best held-out evaluation so far and the last one
    ({"step", "val_tau"}), restored from a checkpoint's train_state.json (``state``), so that a resumed
    attempt compares its evaluations with those of the attempts before it. Every rank keeps one and takes
    the same decisions (the held-out sums are added over the ranks before ``evaluated``)."""

    def __init__(self, enabled: bool, state: dict[str, Any] | None = None):
        self.enabled = enabled
        state = state or {}
        self.best: dict[str, Any] | None = state.get("best")
        self.last: dict[str, Any] | None = state.get("last_eval")

    def evaluated(self, step: int, val_tau: float) -> bool:
        """Record an evaluation; True when it is the best so far, so that its step is checkpointed now."""
        new_best = self.enabled and improves(self.best, val_tau)
        self.last = {"step": step, "val_tau": val_tau}
        if new_best:
            self.best = self.last
        return new_best

    def state(self) -> dict[str, Any]:
        """The entries of a checkpoint's train_state.json."""
        return {**({"last_eval": self.last} if self.last is not None else {}),
                **({"best": self.best} if self.enabled else {})}

    def score(self, step: int) -> dict[str, float]:
        """The metric Ray Train keeps checkpoints by, for a checkpoint of ``step`` ({} when not keeping)."""
        if not self.enabled:
            return {}
        evaluated = self.last is not None and self.last["step"] == step
        return {SCORE: self.last["val_tau"] if evaluated else 0.0}


@dataclass(frozen=True)
class Selected:
    """The checkpoint `export` takes, and why (``which``: "best", "latest", or "named" for a checkpoint
    named itself); ``best``: the run's best evaluation ({"step", "val_tau"}) where it kept one."""

    path: Path
    step: int
    which: str
    best: dict[str, Any] | None = None

    def describe(self) -> str:
        if self.which == "best":
            return f"the best checkpoint, step {self.step} (held-out tau {self.best['val_tau']:.3f})"
        if self.which == "named":
            return f"checkpoint {self.path.name}, step {self.step}"
        return f"the latest checkpoint, step {self.step}"


def select_checkpoint(path: str | Path, which: str | None = None, what: str = "--checkpoint") -> Selected:
    """The checkpoint of ``path`` that `export` takes: ``which`` = "best" (the run's best held-out tau,
    kept by train.keep_best), "latest", or None: the best where the run kept one, else the latest. A
    checkpoint named itself is taken as it is (``which`` must then be None). CheckpointError, saying what
    to pass, where there is no such checkpoint."""
    path = require_dir(path, what, "pass the --out of `eagle3-ray train` or one of its checkpoint_* directories",
                       CheckpointError)
    if (path / TRAIN_STATE).is_file():
        if which is not None:
            raise CheckpointError(
                f"--which {which}: {what} {path} is one checkpoint, not a training run; drop --which to export "
                "it, or pass the --out of `eagle3-ray train` to choose among its checkpoints"
            )
        return Selected(path, int(read_train_state(path).get("step", 0)), "named")
    latest = find_checkpoint(path, what)
    state = read_train_state(latest)
    best, step = state.get("best"), int(state.get("step", 0))
    if which == "latest" or (which is None and best is None):
        return Selected(latest, step, "latest", best)
    if best is None:
        raise CheckpointError(
            f"--which best: the run in {what} {path} kept no best checkpoint (its training evaluated no held-out "
            "samples, train.val_share=0 and no train.eval_only, or ran with train.keep_best=none); pass --which "
            "latest, or train with train.val_share > 0"
        )
    for ckpt in checkpoint_dirs(path):
        if read_train_state(ckpt).get("step") == best["step"]:
            return Selected(ckpt, int(best["step"]), "best", best)
    raise CheckpointError(
        f"the run in {what} {path} kept its best checkpoint at step {best['step']} (held-out tau "
        f"{best['val_tau']:.3f}), and no checkpoint_* of that step is there any more; pass --which latest to "
        f"export step {step}, or put that checkpoint back"
    )


def best_summary(path: str | Path) -> dict[str, Any] | None:
    """Which evaluation won, and by how much over the last one (the newest checkpoint's record): for the
    training summary; None where the run kept no best."""
    state = read_train_state(latest_checkpoint(Path(path)) or Path(path))
    best, last = state.get("best"), state.get("last_eval")
    if best is None or last is None:
        return None
    return {"step": best["step"], "val_tau": best["val_tau"], "last_eval_step": last["step"],
            "last_eval_val_tau": last["val_tau"], "margin": best["val_tau"] - last["val_tau"]}


def export_from_training(checkpoint: str | Path, out: str | Path, engine: str = "sglang",
                         which: str | None = None) -> Path:
    """Export the checkpoint ``select_checkpoint`` picks (the best by default, where the run kept one)."""
    selected = select_checkpoint(checkpoint, which)
    say(f"[export] {selected.describe()}: {selected.path}")
    return export_drafter(selected.path, out, engine=engine)
