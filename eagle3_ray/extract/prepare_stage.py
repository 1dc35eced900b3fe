"""`eagle3-ray prepare`: read -> tokenize with loss masks on Ray Data -> prepared.parquet.

    read_input (driver, quarantines bad records) -> map_batches(TokenizeUDF) -> kept rows, sorted by
    id -> prepared.parquet (written by a Ray task; the driver reads only counts)

The stage writes its resolved config, rejects.jsonl and a summary.json next to prepared.parquet
(extract/prepared.py), and is atomic: all or nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from eagle3_ray.atomic import tmp_path, write_file
from eagle3_ray.config import PipelineConfig, save_resolved
from eagle3_ray.errors import DataError
from eagle3_ray.extract.prepared import PREPARED_FILE
from eagle3_ray.extract.stage import write_summary
from eagle3_ray.progress import say
from eagle3_ray.rejects import REJECTS_FILE, append_rejects

TOKENIZE_BATCH = 64


@dataclass
class PrepareSummary:
    samples: int
    tokens: int
    loss_tokens: int
    rejected: int
    max_tokens: int
    mean_tokens: float
    seconds: float
    prepared: str


def _tokenizer_actors(resources: dict) -> int:
    """Tokenizer actors for prepare: half the cluster's CPUs, at least 2 (each takes one CPU). A fixed
    2 tokenized 42,040 conversations in 72 s on a 16-CPU H200 host while 14 CPUs stood idle
    (benchmarks/results/README.md, the product's third run)."""
    return max(2, int(resources.get("CPU", 2)) // 2)


def run_prepare(cfg: PipelineConfig, data: str | None, out: str | Path) -> PrepareSummary:
    """Read conversations, quarantine bad records, tokenize with loss masks on Ray Data."""
    import ray

    from eagle3_ray.data.sources import read_input
    from eagle3_ray.engines.describe import tokenizer_path_for
    from eagle3_ray.extract.udfs import TokenizeUDF

    t0 = time.monotonic()
    out = Path(out)
    save_resolved(cfg, out)
    sources, samples, rejected = read_input(data, cfg.data)
    source = ", ".join(str(p) for p in sources)
    rejects = [{**asdict(r), "stage": "prepare"} for r in rejected]
    (out / REJECTS_FILE).unlink(missing_ok=True)
    if not samples:
        append_rejects(out, rejects)
        raise DataError(
            f"no usable samples in {source} ({len(rejects)} rejected, reasons in {out / REJECTS_FILE}); "
            "pass --data with conversations in ShareGPT or OpenAI form"
        )
    rows = [{"sample_id": s.sample_id, "messages": json.dumps(s.messages), "tools": json.dumps(s.tools),
             "source": s.source, "greedy_by": s.greedy_by} for s in samples]

    ds = ray.data.from_items(rows, override_num_blocks=max(1, len(rows) // TOKENIZE_BATCH))
    # Tokenized once; the rows stay in Ray Data (object store): the driver reads back only each row's
    # counts (and a rejected row's id, source and reason), and a Ray task writes the parquet.
    tokenized = ds.map_batches(
        TokenizeUDF,
        fn_constructor_kwargs=dict(
            tokenizer_path=str(tokenizer_path_for(cfg.target)),
            max_length=cfg.data.max_length,
            truncate=cfg.data.truncate,
            run=cfg.name,
        ),
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=_tokenizer_actors(ray.cluster_resources())),
        batch_size=TOKENIZE_BATCH,
        batch_format="numpy",
    ).materialize()
    lengths, loss_tokens = [], 0
    counts = tokenized.select_columns(["sample_id", "source", "num_tokens", "loss_tokens", "reject"])
    for batch in counts.iter_batches(batch_format="numpy", batch_size=None):
        bad = np.asarray([bool(r) for r in batch["reject"]], dtype=bool)
        for sid, origin, reason in zip(batch["sample_id"][bad], batch["source"][bad], batch["reject"][bad]):
            rejects.append({"sample_id": str(sid), "source": str(origin), "reason": str(reason),
                            "stage": "prepare"})
        lengths.append(np.asarray(batch["num_tokens"][~bad], dtype=np.int64))
        loss_tokens += int(np.asarray(batch["loss_tokens"][~bad]).sum())
    append_rejects(out, rejects)
    lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    if not lengths.size:
        raise DataError(
            f"every sample of {source} was rejected (reasons in {out / REJECTS_FILE}); prompt-only data "
            "needs `eagle3-ray generate` first to write the assistant turns"
        )
    target = out / PREPARED_FILE
    _write_prepared(tokenized, target, rows=int(lengths.size))
    summary = PrepareSummary(
        samples=int(lengths.size),
        tokens=int(lengths.sum()),
        loss_tokens=loss_tokens,
        rejected=len(rejects),
        max_tokens=int(lengths.max()),
        mean_tokens=float(lengths.mean()),
        seconds=round(time.monotonic() - t0, 2),
        prepared=str(target),
    )
    write_summary(out, asdict(summary))
    say(
        f"[prepare] {summary.samples} samples, {summary.tokens:,} tokens "
        f"({summary.loss_tokens:,} loss tokens), {summary.rejected} rejected -> {target}"
    )
    return summary


def _kept_rows(batch: pa.Table) -> pa.Table:
    """Tokenized rows -> the kept ones, in the prepared parquet's columns."""
    return batch.filter(pc.equal(batch["reject"], "")).drop_columns(["reject", "loss_tokens"])


def _sorted_by_id(batch: pa.Table) -> pa.Table:
    return batch.sort_by("sample_id")


def _write_prepared(tokenized, target: Path, rows: int) -> None:
    """Write the kept rows of `tokenized` (a Ray Dataset), sorted by sample id, as the one parquet
    file `target` (`rows` rows), published atomically. The file is written by a Ray task on the
    driver's node, where `target` is (prepare's --out need not be shared by the cluster)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    staging = tmp_path(target)  # a directory: Ray Data writes files under a directory
    try:
        (tokenized.map_batches(_kept_rows, batch_format="pyarrow", batch_size=None)
         .repartition(1)
         .map_batches(_sorted_by_id, batch_format="pyarrow", batch_size=None)
         .write_parquet(str(staging), min_rows_per_file=rows, ray_remote_args={"scheduling_strategy": here}))
        written = sorted(staging.glob("*.parquet"))
        if len(written) != 1:
            raise RuntimeError(f"prepare wrote {len(written)} parquet files under {staging}, expected one")
        write_file(target, lambda tmp: os.replace(written[0], tmp))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
