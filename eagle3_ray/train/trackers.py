"""Experiment trackers of a training run (`train.trackers`): TensorBoard, MLflow and W&B, on rank 0.

MLflow and W&B start through Ray's own integrations (`ray.air.integrations.mlflow.setup_mlflow`,
`ray.air.integrations.wandb.setup_wandb`); TensorBoard, for which Ray Train has none (Ray's TBX logger
is a Tune callback), through torch's `SummaryWriter`. Each gets every row metrics.jsonl gets, at its
optimizer step: loss, acc_i, tau, tau_served, lr, tokens/s, input_wait, train_tokens, and the held-out
metrics (val_tau, val_loss, ..., per group) where an evaluation ran.

Where they log (`train.tracking`): TensorBoard event files in <out>/tensorboard; MLflow to
`mlflow_tracking_uri`, else $MLFLOW_TRACKING_URI, else a file store in <out>/mlruns; W&B to its
project (offline: <out>/wandb, for `wandb sync`). A resumed training continues the same MLflow and W&B
runs (their ids are kept in <out>/trackers.json). The steps a resumed attempt trains again are logged
again: TensorBoard shows the new values only (`purge_step`), MLflow keeps both, W&B keeps the first
(it takes no step below its last). MLflow names a group's metrics `val_tau.<group>` (its file store keeps
a metric per file, where `val_tau` and `val_tau/<group>` cannot both live). A tracker that fails to log a
row, or to close, is named in a warning; training goes on (the row is in metrics.jsonl).

Each tracker is an optional extra (`pip install 'eagle3-ray[tensorboard,mlflow,wandb]'`): the driver
checks that they are installed before any worker starts (`check_installed`), and the worker again.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any, Iterator, Protocol

from eagle3_ray import atomic
from eagle3_ray.config import TRACKERS, TrackingConfig, TrainConfig
from eagle3_ray.errors import ConfigError, exception_line

log = logging.getLogger(__name__)

RUNS_FILE = "trackers.json"  # in the training --out: the MLflow and W&B runs a resumed training continues
TENSORBOARD_DIR = "tensorboard"
MLRUNS_DIR = "mlruns"
# What to look at when a tracker cannot start.
_FIX = {
    "tensorboard": f"<train --out>/{TENSORBOARD_DIR} must be writable",
    "mlflow": "check train.tracking.mlflow_tracking_uri (or $MLFLOW_TRACKING_URI) and train.tracking.project",
    "wandb": "online W&B needs WANDB_API_KEY on the training workers' nodes (ray.env_vars), or set "
             "train.tracking.wandb_mode=offline",
}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules (import blocked)
        return False


def check_installed(trackers: list[str]) -> None:
    """ConfigError naming the extra to install for each tracker of ``trackers`` whose package is missing."""
    absent = [name for name in trackers if not _importable(TRACKERS[name][0])]
    if absent:
        extras = ",".join(TRACKERS[name][1] for name in absent)
        raise ConfigError(
            f"train.trackers lists {absent}, not installed here: pip install 'eagle3-ray[{extras}]' (on every node "
            f"that runs training workers), or leave {'it' if len(absent) == 1 else 'them'} out of train.trackers"
        )


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self, failed: bool) -> None: ...

    def record(self) -> dict[str, Any] | None:
        """What a resumed training needs to continue this tracker's run (None: nothing)."""


class TensorBoard:
    def __init__(self, out: Path, resumed_from: int):
        from torch.utils.tensorboard import SummaryWriter

        # A resumed attempt logs the steps after its checkpoint again: the earlier attempt's are hidden.
        self.writer = SummaryWriter(log_dir=str(out / TENSORBOARD_DIR),
                                    purge_step=resumed_from + 1 if resumed_from else None)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a row every train.log_every steps: on disk before a crash can take it

    def close(self, failed: bool) -> None:
        self.writer.close()

    def record(self) -> None:
        return None


@contextlib.contextmanager
def _env(**values: str | None) -> Iterator[None]:
    """These environment variables set inside the block (None: left as they are), and every one of them
    as it was before after it (MLflow sets $MLFLOW_TRACKING_URI to the URI it is given)."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update({name: value for name, value in values.items() if value is not None})
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class MLflow:
    def __init__(self, settings: TrackingConfig, out: Path, name: str, params: dict[str, Any], known: dict | None):
        from ray.air.integrations.mlflow import setup_mlflow

        # None: the file store in the run's own --out (wherever that is now: an out dir may move)
        self.given = settings.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        uri = self.given or (out / MLRUNS_DIR).as_uri()
        if "://" not in uri or uri.startswith("file:"):
            # MLflow 3 refuses its file store unless told; a local store is what was asked for here
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.experiment = settings.project or name
        same = known is not None and (known.get("uri"), known.get("experiment")) == (self.given, self.experiment)
        run_id = known["run_id"] if same else None
        with _env(MLFLOW_RUN_ID=run_id, MLFLOW_TRACKING_URI=None):  # start_run continues the run this names
            # A continued run keeps the parameters it was started with (MLflow refuses changing one).
            self.mlflow = setup_mlflow(None if run_id else params, tracking_uri=uri,
                                       experiment_name=self.experiment, run_name=settings.run_name or name,
                                       create_experiment_if_not_exists=True, rank_zero_only=False)
        self.run_id = self.mlflow.active_run().info.run_id

    def log(self, metrics: dict[str, float], step: int) -> None:
        # A file store keeps a metric per file: val_tau and val_tau/<group> cannot both be there.
        self.mlflow.log_metrics({k.replace("/", "."): v for k, v in metrics.items()}, step=step)

    def close(self, failed: bool) -> None:
        self.mlflow.end_run(status="FAILED" if failed else "FINISHED")

    def record(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "uri": self.given, "experiment": self.experiment}


class WandB:
    def __init__(self, settings: TrackingConfig, out: Path, name: str, params: dict[str, Any], known: dict | None):
        from ray.air.integrations.wandb import setup_wandb

        self.project = settings.project or name
        same = known is not None and known.get("project") == self.project
        self.run_id = known["id"] if same else uuid.uuid4().hex[:16]
        with _env(WANDB_MODE=settings.wandb_mode):  # where Ray's setup_wandb reads it (offline: no API key)
            self.run = setup_wandb(params, project=self.project, id=self.run_id, name=settings.run_name or name,
                                   dir=str(out), resume="allow", rank_zero_only=False)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)

    def record(self) -> dict[str, Any]:
        return {"id": self.run_id, "project": self.project}


class Trackers:
    """The run's trackers (rank 0 only): ``log`` a metrics row at its step, ``close`` at the end."""

    def __init__(self, trackers: dict[str, Tracker]):
        self.trackers = trackers

    @classmethod
    def start(cls, t: TrainConfig, name: str, out: Path, resumed_from: int) -> Trackers:
        """Start ``t.trackers`` for the run ``name`` (config name) writing to ``out`` (the training --out);
        ``resumed_from``: the checkpoint step this attempt starts from (0: a fresh start)."""
        check_installed(t.trackers)
        out.mkdir(parents=True, exist_ok=True)
        runs_file = out / RUNS_FILE
        known = json.loads(runs_file.read_text(encoding="utf-8")) if runs_file.is_file() else {}
        params = {"name": name, "train": t.model_dump(mode="json")}
        started: dict[str, Tracker] = {}
        for tracker in t.trackers:
            try:
                if tracker == "tensorboard":
                    started[tracker] = TensorBoard(out, resumed_from)
                elif tracker == "mlflow":
                    started[tracker] = MLflow(t.tracking, out, name, params, known.get(tracker))
                else:
                    started[tracker] = WandB(t.tracking, out, name, params, known.get(tracker))
            except Exception as e:
                cls(started).close(failed=True)
                raise ConfigError(f"train.trackers: {tracker} could not start: {exception_line(e)}; "
                                  f"{_FIX[tracker]}, or leave it out of train.trackers") from e
        records = {k: r for k, tr in started.items() if (r := tr.record()) is not None}
        if any(known.get(k) != r for k, r in records.items()):
            atomic.write_json(runs_file, {**known, **records}, sort_keys=True)
        return cls(started)

    def log(self, metrics: dict[str, Any]) -> None:
        """One metrics.jsonl row, at its optimizer step (``metrics["step"]``)."""
        values = {k: float(v) for k, v in metrics.items() if k != "step"}
        for name, tracker in self.trackers.items():
            try:
                tracker.log(values, int(metrics["step"]))
            except Exception as e:  # a tracker's server or disk: training goes on, metrics.jsonl has the row
                log.warning("train.trackers: %s did not take the metrics of step %s: %s", name, metrics["step"],
                            exception_line(e))

    def close(self, failed: bool = False) -> None:
        for name, tracker in self.trackers.items():
            try:
                tracker.close(failed)
            except Exception as e:  # the run's outcome stands; what the tracker missed is in metrics.jsonl
                log.warning("train.trackers: %s did not close: %s", name, exception_line(e))
