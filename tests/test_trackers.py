"""train.trackers: TensorBoard, MLflow and W&B get the rows metrics.jsonl gets, read back from their own files.

TensorBoard's event files through TensorBoard's EventAccumulator; MLflow's local file store through its
client; W&B in offline mode, its run file (LevelDB-log framing of W&B's own protobuf records, which W&B
ships no Python reader for) parsed here. First the trackers alone, without Ray; then a real Ray Train run
and its resumption (conftest.py's ``trained_4_then_6``, with test_train.py's TRACKED).
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from eagle3_ray.config import load_config
from eagle3_ray.errors import ConfigError
from eagle3_ray.train.trackers import RUNS_FILE, Trackers, check_installed
from test_train import CI_CONFIG, TRACKED

ROWS = [  # as the worker logs them: metrics.jsonl rows
    {"step": 1, "loss": 4.5, "acc_0": 0.1, "tau": 1.2, "tokens_per_s": 900.0, "resumed_from": 0},
    {"step": 2, "loss": 4.0, "acc_0": 0.2, "tau": 1.3, "tokens_per_s": 950.0, "resumed_from": 0,
     "val_tau": 1.25, "val_tau/late": 1.5},
]
AGAIN = [  # the attempt resumed from the checkpoint of step 1: step 2 trained again, then step 3
    {"step": 2, "loss": 3.9, "acc_0": 0.2, "tau": 1.3, "tokens_per_s": 800.0, "resumed_from": 1,
     "val_tau": 1.26, "val_tau/late": 1.5},
    {"step": 3, "loss": 3.5, "acc_0": 0.3, "tau": 1.4, "tokens_per_s": 990.0, "resumed_from": 1},
]


def tensorboard_scalars(out: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def mlflow_runs(out: Path, experiment: str = "ci-tiny"):
    """(the client, the runs of ``experiment``) of the file store in ``out``/mlruns (MLflow 3 reads one only
    when told to: MLFLOW_ALLOW_FILE_STORE, which the tests using this set)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient((out / "mlruns").as_uri())
    exp = client.get_experiment_by_name(experiment)
    return client, client.search_runs([exp.experiment_id]) if exp else []


def wandb_records(run_file: Path) -> list:
    """The protobuf records of an offline W&B run file: 7-byte header, then 32 KiB blocks of chunks
    (crc32 4, length 2, type 1: full, first, middle, last)."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, block, pending, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(out: Path) -> tuple[set[str], list[dict]]:
    """(the run ids, every history row in log order) of the offline W&B runs under ``out``/wandb."""
    ids, rows = set(), []
    for run_file in sorted((out / "wandb").glob("offline-run-*/run-*.wandb")):
        for record in wandb_records(run_file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
            elif kind == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return ids, rows


def _start(out: Path, resumed_from: int) -> Trackers:
    cfg = load_config(CI_CONFIG, TRACKED)
    return Trackers.start(cfg.train, cfg.name, out, resumed_from)


def test_each_tracker_gets_every_row_and_a_resumed_attempt_continues_its_run(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    out = tmp_path / "train"
    trackers = _start(out, resumed_from=0)
    for row in ROWS:
        trackers.log(row)
    trackers.close()
    runs = json.loads((out / RUNS_FILE).read_text())
    again = _start(out, resumed_from=1)
    for row in AGAIN:
        again.log(row)
    again.close()
    assert json.loads((out / RUNS_FILE).read_text()) == runs  # the same MLflow and W&B runs, continued

    scalars = tensorboard_scalars(out)
    keys = {k for row in ROWS + AGAIN for k in row} - {"step"}
    assert set(scalars) == keys
    # the resumed attempt's step 2 replaces the first's (float32 in the event files)
    assert scalars["loss"] == {1: 4.5, 2: pytest.approx(3.9), 3: 3.5}
    assert scalars["val_tau/late"] == {2: 1.5} and scalars["resumed_from"] == {1: 0, 2: 1, 3: 1}

    client, found = mlflow_runs(out)
    assert [r.info.run_id for r in found] == [runs["mlflow"]["run_id"]] and found[0].info.status == "FINISHED"
    history = [(m.step, m.value) for m in client.get_metric_history(runs["mlflow"]["run_id"], "loss")]
    assert sorted(history) == [(1, 4.5), (2, 3.9), (2, 4.0), (3, 3.5)]  # MLflow keeps both attempts' step 2
    assert [m.value for m in client.get_metric_history(runs["mlflow"]["run_id"], "val_tau.late")] == [1.5, 1.5]
    assert found[0].data.params["name"] == "ci-tiny" and found[0].data.params["train/trackers"] == str(
        ["tensorboard", "mlflow", "wandb"])

    ids, rows = wandb_history(out)
    assert ids == {runs["wandb"]["id"]}
    assert [{k: v for k, v in r.items() if not k.startswith("_")} | {"step": r["_step"]} for r in rows] == \
        [{k: float(v) for k, v in row.items()} for row in ROWS + AGAIN]


def test_a_tracker_not_installed_is_named_with_the_extra_to_install(monkeypatch):
    check_installed(["tensorboard", "mlflow", "wandb"])  # the dev extra has them all
    monkeypatch.setitem(sys.modules, "mlflow", None)  # `import mlflow` now fails, as without the package
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ConfigError, match=r"train\.trackers lists \['tensorboard', 'mlflow'\], not installed here: "
                                          r"pip install 'eagle3-ray\[tensorboard,mlflow\]'.* leave them out"):
        check_installed(["tensorboard", "mlflow", "wandb"])


def test_a_training_logs_its_metrics_rows_to_every_tracker(trained_4_then_6, monkeypatch):
    """The real run: two Ray Train workers, rank 0 logging; 4 steps, then resumed to 6."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    out, _ = trained_4_then_6
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and {"val_tau", "val_tau/late"} <= set(rows[-1])
    runs = json.loads((out / RUNS_FILE).read_text())

    scalars = tensorboard_scalars(out)
    assert set(scalars) == {k for r in rows for k in r} - {"step"}
    for r in rows:
        for key, value in r.items():
            if key != "step":
                assert scalars[key][r["step"]] == pytest.approx(value, rel=1e-6), key  # float32 in the event file

    client, found = mlflow_runs(out)
    assert [x.info.run_id for x in found] == [runs["mlflow"]["run_id"]]  # the resumed attempt continued it
    for key in ("loss", "acc_0", "tau", "tokens_per_s", "val_tau", "val_tau/late", "train_tokens"):
        # MLflow's name of a group's metric: val_tau.late
        logged = {m.step: m.value for m in client.get_metric_history(runs["mlflow"]["run_id"], key.replace("/", "."))}
        assert logged == {r["step"]: pytest.approx(r[key]) for r in rows if key in r}, key

    ids, history = wandb_history(out)
    assert ids == {runs["wandb"]["id"]}
    assert [{k: v for k, v in h.items() if not k.startswith("_")} for h in history] == [
        {k: pytest.approx(v) for k, v in r.items() if k != "step"} for r in rows]
    assert [h["_step"] for h in history] == [1, 2, 3, 4, 5, 6]
