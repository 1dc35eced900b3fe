"""The figures `benchmarks/scale_gpus.py` derives from shard completion markers (the scaling goal's
arithmetic), on markers written by the real FeatureStoreWriter."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import scale_gpus  # noqa: E402  (the benchmark script itself)


def _marks(store: Path, shards: list[tuple[str, float, int]]):
    """Write one real shard per (producer, commit time, tokens), then rewrite its marker's producer
    and time as an actor on another process would have left them."""
    from eagle3_ray.features.store import FeatureStoreWriter, StoreMeta

    meta = StoreMeta(hidden_size=4, aux_layers=[0, 1, 2], vocab_size=32, target_fingerprint="t", model_type="llama")
    for k, (producer, at, tokens) in enumerate(shards):
        with FeatureStoreWriter(store, meta, writer_id=f"b{k:03d}", shard_max_bytes=2**62) as w:
            w.add({"sample_id": f"s{k}", "input_ids": (torch.arange(tokens) % 32).int(),
                   "loss_mask": torch.ones(tokens, dtype=torch.uint8),
                   "aux_hidden": torch.zeros(tokens, 12, dtype=torch.bfloat16),
                   "last_hidden": torch.zeros(tokens, 4, dtype=torch.bfloat16)})
        marker = store / "shards" / f"b{k:03d}-000000.done.json"
        m = json.loads(marker.read_text())
        marker.write_text(json.dumps({**m, "producer": producer}))
        os.utime(marker, (at, at))


def test_per_actor_rates_and_the_overlap_window(tmp_path):
    # Actor A commits 10 tokens every second from t=1..5; B starts late (t=3) and ends at 6.
    shards = [("A", 100 + t, 10) for t in range(1, 6)] + [("B", 100 + t, 10) for t in range(3, 7)]
    _marks(tmp_path, shards)
    marks = scale_gpus.commits(tmp_path)
    assert [m[2] for m in marks] == ["A", "A", "A", "B", "A", "B", "A", "B", "B"]
    r = scale_gpus.per_writer(marks, start=100.0)
    assert r["writers"]["A"] == {"shards": 5, "tokens": 50, "first_commit_s": 1.0, "last_commit_s": 5.0,
                                 "tokens_per_s": 10.0}
    assert r["writers"]["B"]["first_commit_s"] == 3.0 and r["writers"]["B"]["tokens_per_s"] == 10.0
    # Both committing from t=3 to t=5: commits at 4 and 5 of A and B after the window opens.
    assert r["overlap_s"] == 2.0 and r["overlap_tokens_per_s"] == 40 / 2
    # The steady figure: the commits after the 2nd (t=102) up to the 2nd last (t=105), whatever
    # actor made them: 6 shards in 3 s.
    assert scale_gpus.steady_rate(marks, 2) == pytest.approx(60 / 3)
