"""GPU extraction throughput: Ray Data pipeline vs the bare forward, in one run, with a breakdown.

    python benchmarks/extract_gpu.py --samples 160 --seq 2048 --store /dev/shm/e3 --json out.json

Target: random weights of a given shape (default Llama-3.1-8B, bf16 on one GPU); samples are random
token ids of `--seq` tokens. Figures (tokens/s):
  bare      `model.model(...)` with output_hidden_states, batch of `batch_tokens`, nothing else
  stages    in-process, serial, through the engine's own capture path (its CUDA stream, pinned
            device-to-host copy): forward+cat, device-to-host (GB/s reported), validate (the
            writer's record checks), shard write (sha256 + atomic write) -- where the time goes
  pipeline  `run_extract` (Ray Data: read -> CaptureWriteUDF engine actor on the GPU, which commits
            one shard per batch; `--concurrent` batches in flight per actor),
            end to end and in steady state (first to last shard commit), and the stage's time to its
            first shard (Ray is started before; benchmarks/device/extract_e2e.sh times the whole command)
Goal: pipeline steady / bare >= 0.90.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from eagle3_ray.engines.hf import to_host


def _prepared(path: Path, samples: int, seq: int, vocab: int) -> Path:
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, vocab, seq, dtype=np.int32) for _ in range(samples)]
    mask = np.ones(seq, dtype=np.uint8)
    table = pa.table({
        "sample_id": pa.array([f"s{i:05d}" for i in range(samples)]),
        "source": pa.array(["random"] * samples),
        "input_ids": pa.array(ids, pa.list_(pa.int32())),
        "loss_mask": pa.array([mask] * samples, pa.list_(pa.uint8())),
        "num_tokens": pa.array([seq] * samples, pa.int64()),
    })
    path.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path / "prepared.parquet")
    return path


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, sync=_sync):
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t


def _capture_round(engine, ids, mask):
    """The engine's capture path split in timed stages: forward+cat, device-to-host."""
    with engine.capture_stream():  # the calling thread's CUDA stream, as in HFEngine.capture
        (aux_dev, last_dev), t_fwd = _timed(lambda: engine.forward_states(ids, mask))
        (aux, last), t_d2h = _timed(lambda: to_host([aux_dev, last_dev]))
    return aux, last, t_fwd, t_d2h


def bare_and_stages(cfg, prepared: Path, store: Path, rounds: int) -> dict:
    from eagle3_ray.engines.describe import describe_target
    from eagle3_ray.engines.hf import HFEngine
    from eagle3_ray.features.store import FeatureStoreWriter, StoreMeta

    engine = HFEngine(cfg.target, batch_tokens=cfg.extract.batch_tokens)
    model, dev = engine.target.model, engine.target.device
    table = pq.read_table(prepared / "prepared.parquet")
    seq = int(table.column("num_tokens")[0].as_py())
    rows = max(1, cfg.extract.batch_tokens // seq)
    ids = torch.tensor(np.stack(table.column("input_ids").to_numpy(zero_copy_only=False)[:rows])).long()  # [rows, seq]
    mask = torch.ones_like(ids)  # [rows, seq]
    layers = engine.info.aux_layers
    with torch.inference_mode():
        ids_dev = ids.to(dev)
        for _ in range(2):  # warm-up: kernels, and the pinned host blocks the allocator then reuses
            model.model(input_ids=ids_dev, output_hidden_states=layers, use_cache=False)
            _capture_round(engine, ids, mask)
        t0 = time.perf_counter()
        for _ in range(rounds):
            model.model(input_ids=ids_dev, output_hidden_states=layers, use_cache=False)
        _sync()
        bare = rounds * rows * seq / (time.perf_counter() - t0)

        writer = FeatureStoreWriter(store, StoreMeta.from_engine_info(describe_target(cfg.target)), "bench",
                                    cfg.extract.shard_max_bytes)
        t_fwd = t_d2h = t_val = t_write = 0.0
        d2h_bytes = 0
        for r in range(rounds):
            aux, last, dt_fwd, dt_d2h = _capture_round(engine, ids, mask)
            t_fwd, t_d2h, d2h_bytes = t_fwd + dt_fwd, t_d2h + dt_d2h, d2h_bytes + aux.nbytes + last.nbytes
            # What CaptureWriteUDF does per batch: validate + buffer every record, then one shard.
            t = time.perf_counter()
            for i in range(rows):
                writer.add({"sample_id": f"r{r}-{i}", "input_ids": ids[i].int(),
                            "loss_mask": torch.ones(seq, dtype=torch.uint8),
                            "aux_hidden": aux[i].to(torch.bfloat16), "last_hidden": last[i].to(torch.bfloat16)})
            t_val += time.perf_counter() - t
            t = time.perf_counter()
            writer.flush()
            t_write += time.perf_counter() - t
            del aux, last  # back to the pinned cache before the next round allocates
        writer.close()
    tokens = rounds * rows * seq
    engine.close()
    del engine, model, ids_dev
    torch.cuda.empty_cache()  # the pipeline's engine actor loads its own copy of the weights
    stages = {"forward": t_fwd, "device_to_host": t_d2h, "validate": t_val, "write": t_write}
    total = sum(stages.values())
    return {
        "bare_tokens_per_s": bare,
        "stages_seconds": stages,
        "stages_share": {k: v / total for k, v in stages.items()},
        "serial_tokens_per_s": tokens / total,
        "d2h_gb_per_s": d2h_bytes / t_d2h / 1e9,
        "d2h_pinned": dev.type == "cuda",
        "rows_per_forward": rows,
    }


def pipeline(cfg, prepared: Path, store: Path) -> dict:
    from eagle3_ray.extract.pipeline import run_extract

    t0 = time.perf_counter()
    summary = run_extract(cfg, prepared, store)
    seconds = time.perf_counter() - t0
    marks = sorted((store / "shards").glob("*.done.json"), key=lambda p: p.stat().st_mtime)
    later = sum(int(json.loads(p.read_text())["tokens"]) for p in marks[1:])
    span = marks[-1].stat().st_mtime - marks[0].stat().st_mtime if len(marks) > 1 else 0
    nbytes = sum(int(json.loads(p.read_text())["bytes"]) for p in marks)
    return {"tokens": summary.tokens, "seconds": seconds, "tokens_per_s": summary.tokens / seconds,
            "steady_tokens_per_s": later / span if span > 0 else None, "shards": len(marks),
            "bytes": nbytes, "bytes_per_token": nbytes / summary.tokens,
            # the stage's own timeline (from run_extract's start; Ray already up here)
            **{k: getattr(summary, k) for k in ("plan_s", "engine_ready_s", "engine_s", "first_shard_s")}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="random:builtin:llama3.1-8b-shape")
    ap.add_argument("--samples", type=int, default=160)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=8, help="forwards timed in the bare/stages phase")
    ap.add_argument("--store", default=None, help="where stores are written (default: a temp dir)")
    ap.add_argument("--writers-bytes", type=int, default=256 * 2**20, help="extract.shard_max_bytes")
    ap.add_argument("--concurrent", type=int, default=3, help="extract.concurrent_batches")
    ap.add_argument("--cpus-per-actor", type=float, default=1.0,
                    help="extract.num_cpus_per_actor (Ray sets the actor's torch threads from it)")
    ap.add_argument("--device", default="cuda", help="cpu only for a smoke test of this script")
    ap.add_argument("--json")
    a = ap.parse_args(argv)

    from eagle3_ray.config import load_config
    from eagle3_ray.engines.describe import describe_target
    from eagle3_ray.ray_session import init_ray

    cfg = load_config(None, [
        f"target.model={a.target}", f"target.device={a.device}",
        f"target.dtype={'bfloat16' if a.device == 'cuda' else 'float32'}",
        f"extract.batch_tokens={a.batch_tokens}", f"extract.num_gpus_per_actor={1 if a.device == 'cuda' else 0}",
        f"extract.shard_max_bytes={a.writers_bytes}", f"data.max_length={a.seq}",
        f"extract.concurrent_batches={a.concurrent}", f"extract.num_cpus_per_actor={a.cpus_per_actor}",
    ])
    root = Path(a.store or tempfile.mkdtemp())
    root.mkdir(parents=True, exist_ok=True)
    info = describe_target(cfg.target)
    prepared = _prepared(root / "prepared", a.samples, a.seq, min(info.vocab_size, 49152))
    stages = bare_and_stages(cfg, prepared, root / "stages_store", a.rounds)
    init_ray(cfg.ray)
    pipe = pipeline(cfg, prepared, root / "pipeline_store")
    H = info.hidden_size
    result = {
        "target": a.target, "hidden_size": H, "seq": a.seq, "samples": a.samples,
        "device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu", "store": str(root),
        **stages, "pipeline": pipe,
        "extract_ratio": (pipe["steady_tokens_per_s"] or pipe["tokens_per_s"]) / stages["bare_tokens_per_s"],
        "extract_ratio_end_to_end": pipe["tokens_per_s"] / stages["bare_tokens_per_s"],
        "bytes_per_token_ratio": pipe["bytes_per_token"] / (4 * H * 2),
        "concurrent_batches": cfg.extract.concurrent_batches, "cpus_per_actor": cfg.extract.num_cpus_per_actor,
        "command": " ".join([sys.executable, *sys.argv]),
        "cpus": os.cpu_count(),
    }
    print(json.dumps(result, indent=2))
    print(f"device-to-host {stages['d2h_gb_per_s']:.2f} GB/s ({'pinned' if stages['d2h_pinned'] else 'cpu copy'}) | "
          f"stages " + ", ".join(f"{k} {v:.0%}" for k, v in stages["stages_share"].items()))
    print(f"bare {stages['bare_tokens_per_s']:,.0f} tok/s | pipeline steady "
          f"{pipe['steady_tokens_per_s'] or 0:,.0f} tok/s (x{result['extract_ratio']:.3f}, goal >= 0.90), "
          f"end-to-end {pipe['tokens_per_s']:,.0f} | bytes/token x{result['bytes_per_token_ratio']:.4f} of 4*H*2")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
