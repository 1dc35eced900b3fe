"""GPU extraction throughput: Ray Data pipeline vs the bare forward, in one run, with a breakdown.

    python benchmarks/extract_gpu.py --samples 160 --seq 2048 --store /dev/shm/e3 --json out.json

Target: random weights of a given shape (default Llama-3.1-8B, bf16 on one GPU); samples are random
token ids of `--seq` tokens. Figures (tokens/s):
  bare      `model.model(...)` with output_hidden_states, batch of `batch_tokens`, nothing else
  stages    in-process: forward+cat, device-to-host, bf16->uint16 numpy + copy (serialization),
            atomic shard write -- where the time goes
  pipeline  `run_extract` (Ray Data: read -> CaptureWriteUDF engine actor on the GPU, which commits
            one shard per batch; `--concurrent` batches in flight per actor),
            end to end and in steady state (first to last shard commit)
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


def bare_and_stages(cfg, prepared: Path, store: Path, rounds: int) -> dict:
    from eagle3_ray.engines.describe import describe_target
    from eagle3_ray.engines.hf import HFEngine
    from eagle3_ray.features.record import bf16_to_uint16, uint16_to_bf16
    from eagle3_ray.features.store import FeatureStoreWriter, StoreMeta

    engine = HFEngine(cfg.target, batch_tokens=cfg.extract.batch_tokens)
    model, dev = engine.target.model, engine.target.device
    table = pq.read_table(prepared / "prepared.parquet")
    seq = int(table.column("num_tokens")[0].as_py())
    rows = max(1, cfg.extract.batch_tokens // seq)
    ids = torch.tensor(np.stack(table.column("input_ids").to_numpy(zero_copy_only=False)[:rows]), device=dev)
    layers = engine.info.aux_layers
    with torch.inference_mode():
        for _ in range(2):  # warm-up
            model.model(input_ids=ids.long(), output_hidden_states=layers, use_cache=False)
        _sync()
        t_fwd = t_d2h = t_ser = t_write = 0.0
        t0 = time.perf_counter()
        for _ in range(rounds):
            model.model(input_ids=ids.long(), output_hidden_states=layers, use_cache=False)
        _sync()
        bare = rounds * rows * seq / (time.perf_counter() - t0)

        writer = FeatureStoreWriter(store, StoreMeta.from_engine_info(describe_target(cfg.target)), "bench",
                                    cfg.extract.shard_max_bytes)
        for r in range(rounds):
            def fwd():
                out = model.model(input_ids=ids.long(), output_hidden_states=layers, use_cache=False)
                return torch.cat([out.hidden_states[k] for k in layers], -1), out.last_hidden_state
            (aux, last), dt = _timed(fwd)
            t_fwd += dt
            (aux, last), dt = _timed(lambda: (aux.to("cpu", torch.bfloat16), last.to("cpu", torch.bfloat16)))
            t_d2h += dt
            t = time.perf_counter()
            arrays = [(bf16_to_uint16(aux[i]).copy(), bf16_to_uint16(last[i]).copy()) for i in range(rows)]
            t_ser += time.perf_counter() - t
            t = time.perf_counter()
            for i, (a, l) in enumerate(arrays):
                writer.add({"sample_id": f"r{r}-{i}", "input_ids": ids[i].cpu().int(),
                            "loss_mask": torch.ones(seq, dtype=torch.uint8),
                            "aux_hidden": uint16_to_bf16(a), "last_hidden": uint16_to_bf16(l)})
            writer.flush()
            t_write += time.perf_counter() - t
        writer.close()
    tokens = rounds * rows * seq
    engine.close()
    del engine, model
    torch.cuda.empty_cache()
    total = t_fwd + t_d2h + t_ser + t_write
    return {
        "bare_tokens_per_s": bare,
        "stages_seconds": {"forward": t_fwd, "device_to_host": t_d2h, "serialization": t_ser, "write": t_write},
        "stages_share": {k: v / total for k, v in
                         {"forward": t_fwd, "device_to_host": t_d2h, "serialization": t_ser, "write": t_write}.items()},
        "serial_tokens_per_s": tokens / total,
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
            "bytes": nbytes, "bytes_per_token": nbytes / summary.tokens}


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
        f"extract.concurrent_batches={a.concurrent}",
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
        "command": " ".join([sys.executable, *sys.argv]),
        "cpus": os.cpu_count(),
    }
    print(json.dumps(result, indent=2))
    print(f"bare {stages['bare_tokens_per_s']:,.0f} tok/s | pipeline steady "
          f"{pipe['steady_tokens_per_s'] or 0:,.0f} tok/s (x{result['extract_ratio']:.3f}, goal >= 0.90), "
          f"end-to-end {pipe['tokens_per_s']:,.0f} | bytes/token x{result['bytes_per_token_ratio']:.4f} of 4*H*2")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
