"""Ray Data stages end to end on a real local Ray: prepare -> extract (+ resume) -> vocab."""

from __future__ import annotations

import json
import shutil
import threading

import numpy as np
import pytest
import torch

from eagle3_ray.config import load_config
from eagle3_ray.errors import PreflightError, StoreError

CI_CONFIG = "configs/ci-tiny.yaml"


@pytest.fixture(scope="module")
def cfg():
    return load_config(CI_CONFIG)


@pytest.fixture(scope="module")
def prepared(ci_tiny_prepared):
    """(directory, PrepareSummary): the session's run_prepare of ci-tiny (the same config as `cfg`)."""
    return ci_tiny_prepared


def _copy_of_session_store(ci_tiny_inputs, dest):
    """This module's own copy of the session's ci-tiny store (run_extract of `cfg` on `prepared`):
    the tests below rerun, append to or damage it."""
    return shutil.copytree(ci_tiny_inputs / "features", dest)


@pytest.fixture(scope="module")
def store_dir(ci_tiny_inputs, tmp_path_factory):
    return _copy_of_session_store(ci_tiny_inputs, tmp_path_factory.mktemp("features") / "store")


def test_prepare_writes_tokenized_samples_and_resolved_config(prepared):
    import pyarrow.parquet as pq

    import pyarrow as pa

    out, summary = prepared
    table = pq.read_table(out / "prepared.parquet")
    assert table.num_rows == summary.samples == 12
    assert table.schema.names == ["sample_id", "source", "greedy_by", "input_ids", "loss_mask", "num_tokens"]
    assert set(table.column("greedy_by").to_pylist()) == {""}  # written answers, none the target's greedy ones
    for col, dtype in (("input_ids", pa.int32()), ("loss_mask", pa.uint8())):  # list columns, not tensors
        assert pa.types.is_list(table.schema.field(col).type) and table.schema.field(col).type.value_type == dtype
    sids = table.column("sample_id").to_pylist()
    assert sids == sorted(sids)
    masks = table.column("loss_mask").to_pylist()
    for ids, mask, n in zip(table.column("input_ids").to_pylist(), masks, table.column("num_tokens").to_pylist()):
        assert len(ids) == len(mask) == n and 0 < sum(mask) < len(mask)
    assert summary.tokens == sum(table.column("num_tokens").to_pylist())
    assert summary.loss_tokens == sum(sum(m) for m in masks)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".tmp-")]  # the staging dir is gone
    assert (out / "config.resolved.yaml").is_file()
    assert json.loads((out / "summary.json").read_text())["tokens"] == summary.tokens


def test_prepare_tokenizes_on_half_the_clusters_cpus():
    from eagle3_ray.extract.prepare_stage import _tokenizer_actors

    assert _tokenizer_actors({"CPU": 16.0, "GPU": 1.0}) == 8
    assert _tokenizer_actors({"CPU": 2.0}) == 2  # never fewer than the former fixed pool
    assert _tokenizer_actors({}) == 2


def test_extract_runs_three_batches_per_gpu_actor_unless_told(cfg):
    # 3 in flight is what the published GPU extraction and SGLang capture figures ran with.
    from eagle3_ray.extract.pipeline import concurrent_batches

    gpu = cfg.extract.model_copy(update={"num_gpus_per_actor": 1.0, "concurrent_batches": None})
    assert concurrent_batches(gpu) == 3
    assert concurrent_batches(gpu.model_copy(update={"num_gpus_per_actor": 0.0})) == 1
    assert concurrent_batches(gpu.model_copy(update={"concurrent_batches": 2})) == 2


def test_prepare_quarantines_bad_lines_and_goes_on(ray_local, cfg, tmp_path):
    from eagle3_ray.extract.prepare_stage import run_prepare

    src = tmp_path / "mixed.jsonl"
    good = {"id": "a", "conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    src.write_bytes(
        (json.dumps(good) + "\n").encode()
        + b"{not json\n"
        + json.dumps({"id": "c", "conversations": [{"role": "user", "content": "only a prompt"}]}).encode()
        + b"\n"
    )
    summary = run_prepare(cfg, str(src), tmp_path / "out")
    assert summary.samples == 1
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert len(rejects) == 2 and all(r["reason"] for r in rejects)
    assert any(":2" in r["source"] for r in rejects)  # file:line of the malformed line


def test_extract_captures_every_sample_exactly_as_the_engine(store_dir, prepared, cfg):
    import pyarrow.parquet as pq

    from eagle3_ray.engines.hf import HFEngine
    from eagle3_ray.features import open_store

    store = open_store(store_dir)
    table = pq.read_table(prepared[0] / "prepared.parquet")
    assert sorted(store.sample_ids) == sorted(table.column("sample_id").to_pylist())
    assert store.meta.aux_layers == [2, 4, 5]  # default [2, L//2, L-3] for the 8-layer tiny Llama
    engine = HFEngine(cfg.target, batch_tokens=4096)
    rec = store[0]
    cap = engine.capture([rec["input_ids"].tolist()])[0]
    # Stored in bf16: compare with the engine's own output rounded the same way.
    assert torch.equal(rec["aux_hidden"], cap.aux_hidden.to(torch.bfloat16))
    assert torch.equal(rec["last_hidden"], cap.last_hidden.to(torch.bfloat16))
    H = engine.info.hidden_size
    assert rec["aux_hidden"].shape == (rec["input_ids"].numel(), 3 * H)


def test_extract_audits_every_shard_and_sums_the_figures_in_its_summary(store_dir):
    from eagle3_ray.features import open_store
    from eagle3_ray.features.store import manifest

    store, markers = open_store(store_dir), manifest(store_dir)
    assert len(markers) == len(store.shards) > 1
    for m in markers:
        audit = m["audit"]
        assert audit["norm_rows"] == m["tokens"] and audit["unnormed"] == 0.0  # every row is the norm's output
        assert audit["rows"] > 0 and abs(audit["nll_excess"]) < 0.2  # a random target: NLL = entropy = log V
        assert audit["greedy_rows"] == 0 and audit["agreement"] is None and m["greedy_ids"] == []
    summary = json.loads((store_dir / "summary.json").read_text())["audit"]
    assert summary["norm_rows"] == store.num_tokens
    assert summary["rows"] == sum(m["audit"]["rows"] for m in markers)


def test_extract_rerun_skips_completed_samples(store_dir, prepared, cfg):
    from eagle3_ray.extract.pipeline import run_extract
    from eagle3_ray.features import open_store

    before = sorted(p.name for p in (store_dir / "shards").iterdir())
    summary = run_extract(cfg, prepared[0], store_dir)
    assert summary.skipped_done == 12
    assert summary.run_tokens == 0 and summary.first_shard_s is None and summary.steady_tokens_per_s is None
    assert sorted(p.name for p in (store_dir / "shards").iterdir()) == before
    assert len(open_store(store_dir)) == 12 and not open_store(store_dir).duplicate_ids


def test_extract_resumes_after_losing_a_shard(ci_tiny_inputs, prepared, cfg, tmp_path):
    """A run stopped midway (simulated by deleting a committed shard) completes only what is missing."""
    from eagle3_ray.extract.pipeline import run_extract
    from eagle3_ray.features import open_store

    out = _copy_of_session_store(ci_tiny_inputs, tmp_path / "features")  # a completed run_extract
    shards = sorted((out / "shards").glob("*.safetensors"))
    assert len(shards) >= 2, "ci-tiny's extract.batch_tokens should split the store (one shard a batch)"
    victim = shards[0]
    lost = json.loads(victim.with_name(victim.stem + ".done.json").read_text())["sample_ids"]
    victim.with_name(victim.stem + ".done.json").unlink()
    summary = run_extract(cfg, prepared[0], out)
    assert summary.skipped_done == 12 - len(lost)
    store = open_store(out)
    assert sorted(store.sample_ids) == sorted(set(store.sample_ids)) and len(store) == 12
    # This run's timeline: its own tokens, and planning -> first shard -> end in that order.
    redone = sum(store[i]["input_ids"].numel() for i in range(len(store)) if store.sample_ids[i] in lost)
    assert summary.run_tokens == redone
    assert 0 < summary.plan_s <= summary.first_shard_s <= summary.seconds
    # The engine actor reports its build time and when it was ready (its clock; one node here).
    assert summary.engine_s > 0 and summary.plan_s < summary.engine_ready_s <= summary.first_shard_s
    # ... and its start-up before the build: process (possibly started by Ray in advance), constructor, imports.
    assert summary.actor_process_s <= summary.actor_init_s <= summary.actor_imported_s <= summary.engine_ready_s
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["first_shard_s"] == summary.first_shard_s and on_disk["run_tokens"] == redone


def test_extract_refuses_to_resume_over_samples_prepared_anew_with_other_tokens(ci_tiny_inputs, prepared, cfg,
                                                                                 tmp_path):
    """A prepared dataset redone under other settings (here one sample cut shorter, as a smaller
    data.max_length does, and another's loss mask changed) keeps its ids: the extraction, which
    resumes by id, refuses to keep those samples' old hidden states and names them, before any
    engine actor writes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle3_ray.errors import ConfigError
    from eagle3_ray.extract.pipeline import run_extract
    from eagle3_ray.extract.prepared import PREPARED_FILE

    out = _copy_of_session_store(ci_tiny_inputs, tmp_path / "features")
    before = sorted(p.name for p in (out / "shards").iterdir())
    table = pq.read_table(prepared[0] / PREPARED_FILE)
    rows = table.to_pylist()
    rows[0]["input_ids"] = rows[0]["input_ids"][:-3]
    rows[0]["loss_mask"] = rows[0]["loss_mask"][:-3]
    rows[0]["num_tokens"] -= 3
    rows[1]["loss_mask"] = [0] * len(rows[1]["loss_mask"])
    (tmp_path / "prepared").mkdir()
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), tmp_path / "prepared" / PREPARED_FILE)
    with pytest.raises(ConfigError, match=r"holds 2 of 12 resumed samples .*tokens stored.*another loss mask"):
        run_extract(cfg, tmp_path / "prepared", out)
    assert sorted(p.name for p in (out / "shards").iterdir()) == before


def test_extract_compact_fp8_store_reads_back_close_to_the_full_one(store_dir, prepared, cfg, tmp_path):
    """extract.compact=fp8 end to end: half the bytes on disk, readers see bf16 near the full store."""
    from eagle3_ray.extract.pipeline import run_extract
    from eagle3_ray.features import open_store

    fp8 = cfg.model_copy(deep=True)
    fp8.extract.compact = "fp8"
    run_extract(fp8, prepared[0], tmp_path / "fp8")
    full, small = open_store(store_dir), open_store(tmp_path / "fp8")
    assert small.meta.compact == "fp8" and full.meta.compact == "none"
    size = lambda root: sum(p.stat().st_size for p in (root / "shards").glob("*.safetensors"))  # noqa: E731
    assert size(tmp_path / "fp8") < 0.6 * size(store_dir)
    by_id = {full[i]["sample_id"]: full[i] for i in range(len(full))}
    for i in range(len(small)):
        rec = small[i]
        ref = by_id[rec["sample_id"]]
        assert rec["aux_hidden"].dtype == torch.bfloat16
        scale = ref["aux_hidden"].float().abs().amax()
        assert (rec["aux_hidden"].float() - ref["aux_hidden"].float()).abs().max() <= scale / 16
    with pytest.raises(StoreError, match="compact"):
        run_extract(cfg, prepared[0], tmp_path / "fp8")  # appending the full format is refused


def test_extract_refuses_a_store_of_another_target(store_dir, prepared, cfg):
    from eagle3_ray.extract.pipeline import run_extract

    other = cfg.model_copy(deep=True)
    other.target.aux_layers = [1, 2, 4]
    with pytest.raises(StoreError, match="aux_layers"):
        run_extract(other, prepared[0], store_dir)


def test_extract_preflight_refuses_when_disk_is_too_small(prepared, cfg, tmp_path):
    from eagle3_ray.extract.pipeline import run_extract

    huge = cfg.model_copy(deep=True)
    huge.extract.disk_margin = 1e12
    with pytest.raises(PreflightError, match="free"):
        run_extract(huge, prepared[0], tmp_path / "f")


def test_vocab_counts_loss_tokens_and_is_cached(store_dir, cfg, tmp_path):
    from eagle3_ray.data.vocab import load_vocab_map
    from eagle3_ray.extract.vocab_stage import run_vocab
    from eagle3_ray.features import open_store

    path = run_vocab(cfg, store_dir, tmp_path)
    d2t, t2d, meta = load_vocab_map(path)
    assert d2t.dtype == np.int64 and t2d.dtype == np.bool_ and t2d.sum() == cfg.vocab.draft_vocab_size
    loss_tokens = set()
    for rec in open_store(store_dir):
        loss_tokens.update(rec["input_ids"][rec["loss_mask"].bool()].tolist())
    assert all(t2d[t] for t in loss_tokens)  # the draft vocab covers every trained token here
    assert meta["coverage"] == pytest.approx(1.0)
    mtime = path.stat().st_mtime_ns
    assert run_vocab(cfg, store_dir, tmp_path) == path and path.stat().st_mtime_ns == mtime


def test_describe_in_background_gives_describe_targets_answer_or_its_error(cfg, tmp_path):
    """The CLI describes the target on a thread while Ray starts: the same EngineInfo as describing it
    in run_extract, and a target that cannot be described raises the same error where it is asked for."""
    from eagle3_ray.engines.describe import describe_target
    from eagle3_ray.errors import TargetLoadError
    from eagle3_ray.extract.pipeline import describe_in_background

    assert describe_in_background(cfg.target).result(timeout=300) == describe_target(cfg.target)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    future = describe_in_background(cfg.target.model_copy(update={"model": f"random:{bad}"}))
    with pytest.raises(TargetLoadError):
        future.result(timeout=300)


ENGINE_ACTOR_CLASS = "MapWorker(MapBatches(CaptureWriteUDF))"


def _after_an_engine_actor_is_up(answer, timeout=240.0):
    """A Future, as run_extract's target_info, that resolves to ``answer()`` (or raises its error) only
    once an engine actor of the stage is up (its constructor, the engine's build, returned)."""
    import threading
    import time
    from concurrent.futures import Future

    import ray._private.state as ray_state

    fut: Future = Future()
    earlier = set(ray_state.actors())  # engine actors of earlier runs may still be up

    def work():
        end = time.monotonic() + timeout
        while not any(a["ActorClassName"] == ENGINE_ACTOR_CLASS and a["State"] == "ALIVE" and i not in earlier
                      for i, a in ray_state.actors().items()):
            if time.monotonic() > end:
                fut.set_exception(TimeoutError("no engine actor came up while the target was being described"))
                return
            time.sleep(0.05)
        try:
            fut.set_result(answer())
        except BaseException as e:  # noqa: BLE001
            fut.set_exception(e)

    threading.Thread(target=work, daemon=True).start()
    return fut


def test_extract_engine_actors_start_while_the_target_is_described(prepared, cfg, tmp_path):
    """The engine actors are built while the driver still describes the target (its start-up overlaps
    the planning), and write only once the driver's checks passed."""
    from eagle3_ray.engines.describe import describe_target
    from eagle3_ray.extract.pipeline import START_PREFIX, run_extract
    from eagle3_ray.features import open_store

    out = tmp_path / "store"
    summary = run_extract(cfg, prepared[0], out, target_info=_after_an_engine_actor_is_up(
        lambda: describe_target(cfg.target)))
    assert summary.run_tokens == summary.tokens == prepared[1].tokens
    assert summary.plan_s <= summary.engine_ready_s <= summary.checks_s <= summary.first_shard_s
    assert len(open_store(out)) == prepared[1].samples
    assert not list(out.glob(START_PREFIX + "*"))  # the run's start file is gone with the run


def test_extract_a_failed_check_stops_the_started_engine_actors_before_any_write(prepared, cfg, tmp_path):
    from eagle3_ray.errors import TargetLoadError
    from eagle3_ray.extract.pipeline import run_extract

    def fails():
        raise TargetLoadError("target.model='nowhere': no such model")

    out = tmp_path / "store"
    with pytest.raises(TargetLoadError, match="nowhere"):
        run_extract(cfg, prepared[0], out, target_info=_after_an_engine_actor_is_up(fails))
    assert not (out / "shards").exists() or not any((out / "shards").iterdir())
    assert not (out / "store_meta.json").exists()
    # No thread goes on driving the failed run's dataset (it would call Ray after a caller's shutdown).
    assert not [t for t in threading.enumerate() if t.name == "extract-results" and t.is_alive()]


def test_an_engine_actor_started_after_a_failed_check_loads_no_target_and_stops(cfg, tmp_path):
    """An engine actor whose constructor finds the run's start file already saying stop (the driver's
    checks failed while its process started) builds no engine; its call raises the driver's reason."""
    from eagle3_ray.extract.udfs import CaptureWriteUDF

    start = tmp_path / "start.json"
    start.write_text(json.dumps({"go": False, "reason": "PreflightError: not enough disk"}))
    udf = CaptureWriteUDF(cfg.target, cfg.extract.batch_tokens, str(tmp_path / "store"), None, start_file=str(start))
    assert udf.engine is None
    batch = {"sample_id": np.array(["a"]), "input_ids": [np.array([1, 2, 3])], "loss_mask": [np.array([0, 1, 1])],
             "source": np.array(["x"])}
    with pytest.raises(StoreError, match="stopped before it wrote anything: PreflightError: not enough disk"):
        udf(batch)
    assert not (tmp_path / "store").exists()
