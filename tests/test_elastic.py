"""Elastic extraction pool on a real local Ray: two engine actors share the work, no sample twice."""

from __future__ import annotations

from collections import Counter

from eagle3_ray.config import load_config

CI_CONFIG = "configs/ci-tiny.yaml"


def test_two_engine_actors_capture_every_sample_exactly_once(ci_tiny_prepared, tmp_path):
    import pyarrow.parquet as pq

    from eagle3_ray.extract.pipeline import run_extract
    from eagle3_ray.features import open_store
    from eagle3_ray.features.store import manifest

    cfg = load_config(CI_CONFIG, ["extract.num_actors=1", "extract.max_actors=2", "extract.batch_tokens=256"])
    prepared = ci_tiny_prepared[1].prepared  # prepare does not read the extract section changed here
    cfg.extract.num_actors = 2  # both actors up from the start: the pool's upper bound in use
    summary = run_extract(cfg, prepared, tmp_path / "features")
    want = sorted(pq.read_table(prepared).column("sample_id").to_pylist())
    stored = [sid for entry in manifest(tmp_path / "features") for sid in entry["sample_ids"]]
    assert sorted(stored) == want and max(Counter(stored).values()) == 1
    assert len(manifest(tmp_path / "features")) > 2  # the work was split into batches the pool shared
    assert summary.samples == len(open_store(tmp_path / "features")) == 12
