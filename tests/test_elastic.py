"""Elastic extraction pool on a real local Ray: two engine actors share the work, no sample twice.

The pool is the session's ci-tiny extraction (conftest.py's ``ci_tiny_inputs`` runs it with two
engine actors from the start), so the store every other test reads is the one checked here."""

from __future__ import annotations

from collections import Counter


def test_two_engine_actors_capture_every_sample_exactly_once(ci_tiny_prepared, ci_tiny_inputs):
    import pyarrow.parquet as pq

    from eagle3_ray.features import open_store
    from eagle3_ray.features.store import manifest

    features = ci_tiny_inputs / "features"
    want = sorted(pq.read_table(ci_tiny_prepared[1].prepared).column("sample_id").to_pylist())
    markers = manifest(features)
    stored = [sid for entry in markers for sid in entry["sample_ids"]]
    assert sorted(stored) == want and max(Counter(stored).values()) == 1
    assert len(markers) > 2  # the work was split into batches the pool shared
    assert len(open_store(features)) == 12
