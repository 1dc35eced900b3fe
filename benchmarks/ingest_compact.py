"""Training ingest from an fp8 feature store: the pack loader before and after moving the
dequantization from the loader's CPU to the training device. CPU only, one process, no Ray.

    python benchmarks/ingest_compact.py --out benchmarks/results/ingest_compact_cpu.json

1. Writes the same synthetic samples (SmolLM2 shape, H = 576; lengths 256..2048 tokens; the three
   aux layers at magnitudes 1e3 apart) into a bf16 store and an fp8 store (`extract.compact`).
2. Plans ~16K-token packs with the product's planner and times the product's pack loader
   (`train/data.py` LoadPackUDF, one call per pack, as its Ray Data actor runs it) at `--threads`
   torch threads (a loader actor reserves 1 CPU) over three arms:
   - bf16: the bf16 store;
   - fp8_host: the fp8 store dequantized on the loader's CPU (`HostDequantLoader` below: the path
     before this change, per record in features/shards.read_sample);
   - fp8: the fp8 store as stored (fp8 bits + scales: the path now).
3. Times `row_to_batch` on each arm's rows, made read-only as Ray Data hands them over, to the CPU
   "device", packed and in `--row-tokens` rows (sdpa). For fp8 this includes the dequantization,
   which a GPU run does on the device after the copy; it is also timed alone.

Shards are read from the page cache (written just before): disk reads are not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from compact_format import cpu_name  # benchmarks/compact_format.py

ARMS = ("bf16", "fp8_host", "fp8")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def synthetic(i: int, t: int, hidden: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(i)
    aux = torch.randn(t, 3, hidden, generator=g) * torch.tensor([0.05, 3.0, 400.0])[:, None]
    return {"sample_id": f"s{i:05d}", "input_ids": torch.randint(0, vocab, (t,), generator=g, dtype=torch.int32),
            "loss_mask": (torch.arange(t) >= t // 3).to(torch.uint8),
            "aux_hidden": aux.reshape(t, 3 * hidden).bfloat16(),
            "last_hidden": torch.randn(t, hidden, generator=g).bfloat16()}


def write_stores(work: Path, lengths: list[int], hidden: int, vocab: int) -> dict[str, Path]:
    from eagle3_ray.features import FeatureStoreWriter, StoreMeta

    roots = {c: work / f"store-{c}" for c in ("none", "fp8")}
    writers = {c: FeatureStoreWriter(root, StoreMeta(hidden_size=hidden, aux_layers=[1, 15, 27],
                                                     target_fingerprint="synthetic", model_type="llama",
                                                     vocab_size=vocab, compact=c), "w0")
               for c, root in roots.items()}
    for i, t in enumerate(lengths):
        rec = synthetic(i, t, hidden, vocab)
        for w in writers.values():
            w.add(rec)
    for w in writers.values():
        w.close()
    return roots


def loader_arm(roots: dict[str, Path], arm: str):
    from eagle3_ray.train.data import LoadPackUDF

    class HostDequantLoader(LoadPackUDF):
        """The loader before this change: an fp8 store's samples read dequantized (bf16) on its CPU."""

        def __init__(self, store_root: str):
            super().__init__(store_root)
            self.as_stored = False

    if arm == "bf16":
        return LoadPackUDF(str(roots["none"]))
    return (HostDequantLoader if arm == "fp8_host" else LoadPackUDF)(str(roots["fp8"]))


def _one(samples) -> dict:
    col = np.empty(1, dtype=object)
    col[0] = np.asarray(samples, dtype=np.int64)
    return {"key": np.array(["0:0"]), "samples": col}


def time_loader(udf, packs, repeats: int) -> tuple[float, list[dict]]:
    """Seconds per pack (best pass of `repeats`, after a warm-up pack) and the last pass's rows."""
    udf(_one(packs[0].samples))  # opens the shards
    best, rows = float("inf"), []
    for _ in range(repeats):
        rows = []
        t0 = time.perf_counter()
        for p in packs:
            out = udf(_one(p.samples))
            rows.append({k: v[0] for k, v in out.items() if k != "key"})
        best = min(best, (time.perf_counter() - t0) / len(packs))
    return best, rows


def read_only(row: dict) -> dict:
    """As Ray Data hands a row over: arrays in object store memory, not writeable."""
    out = {}
    for k, v in row.items():
        v = v.copy()
        v.setflags(write=False)
        out[k] = v
    return out


def time_call(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=576, help="SmolLM2-135M")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--pack-tokens", type=int, default=16384, help="train.batch_tokens")
    ap.add_argument("--packs", type=int, default=4, help="about this many packs of samples are written")
    ap.add_argument("--min-len", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--row-tokens", type=int, default=2048, help="train.row_tokens (sdpa rows)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a loader actor reserves 1 CPU)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--work", type=Path, default=None, help="temp dir for the two stores (default: mkdtemp)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/ingest_compact_cpu.json"))
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    from eagle3_ray.features import open_store
    from eagle3_ray.features.compact import FIELD_BLOCKS, dequantize_fp8_bits, scale_name
    from eagle3_ray.features.record import bytes_per_token
    from eagle3_ray.train.data import row_to_batch
    from eagle3_ray.train.packing import plan

    t_start, load_start = time.perf_counter(), os.getloadavg()[0]
    rng = np.random.default_rng(0)
    lengths: list[int] = []
    while sum(lengths) < a.packs * a.pack_tokens * 0.97:  # packs are ~97% full
        lengths.append(int(rng.integers(a.min_len, a.max_len + 1)))
    work = a.work or Path(tempfile.mkdtemp(prefix="ingest-compact-"))
    try:
        roots = write_stores(work, lengths, a.hidden, a.vocab)
        log(f"wrote {len(lengths)} samples, {sum(lengths):,} tokens to {work} ({time.perf_counter() - t_start:.0f}s)")
        store = open_store(roots["fp8"])
        packs = [p for p in plan(store.lengths, a.pack_tokens, 1, 0)]
        packs = [p for p in packs if p.tokens >= a.pack_tokens // 2] or packs  # leave out a small last pack
        tokens = float(np.mean([p.tokens for p in packs]))
        log(f"{len(packs)} packs of {tokens:,.0f} tokens on average")

        loader, rows = {}, {}
        for arm in ARMS:
            s, rows[arm] = time_loader(loader_arm(roots, arm), packs, a.repeats)
            row_bytes = float(np.mean([sum(v.nbytes for v in r.values()) for r in rows[arm]]))
            loader[arm] = {"ms_per_pack": 1e3 * s, "packs_per_s": 1 / s, "tokens_per_s": tokens / s,
                           "row_bytes_per_token": row_bytes / tokens}
            log(f"loader {arm:8s}: {1e3 * s:7.1f} ms/pack, {1 / s:6.2f} packs/s, "
                f"{row_bytes / tokens:,.0f} row bytes/token")

        convert = {}
        for arm in ARMS:
            ro = [read_only(r) for r in rows[arm]]
            convert[arm] = {}
            for name, rt in (("packed", None), ("rows", a.row_tokens)):
                s = time_call(lambda: [row_to_batch(r, torch.device("cpu"), torch.bfloat16, rt) for r in ro],
                              a.repeats) / len(ro)
                convert[arm][f"{name}_ms_per_pack"] = 1e3 * s
            log(f"row_to_batch {arm:8s}: packed {convert[arm]['packed_ms_per_pack']:6.1f} ms/pack, "
                f"rows of {a.row_tokens} {convert[arm]['rows_ms_per_pack']:6.1f} ms/pack")
        # the dequantization alone: what moves to the device in a GPU run
        r = rows["fp8"][0]
        bits = {k: torch.from_numpy(r[k])[None] for k in FIELD_BLOCKS}
        scales = {k: torch.from_numpy(r[scale_name(k)])[None] for k in FIELD_BLOCKS}
        s = time_call(lambda: [dequantize_fp8_bits(bits[k], scales[k], b) for k, b in FIELD_BLOCKS.items()],
                      a.repeats)
        convert["fp8"]["dequant_alone_ms_per_pack"] = 1e3 * s * tokens / len(r["input_ids"])
        log(f"dequantization alone on this CPU: {convert['fp8']['dequant_alone_ms_per_pack']:.1f} ms/pack")

        ratios = {
            "loader_packs_per_s_fp8_over_fp8_host": loader["fp8"]["packs_per_s"] / loader["fp8_host"]["packs_per_s"],
            "loader_packs_per_s_fp8_over_bf16": loader["fp8"]["packs_per_s"] / loader["bf16"]["packs_per_s"],
            "loader_packs_per_s_fp8_host_over_bf16": loader["fp8_host"]["packs_per_s"] / loader["bf16"]["packs_per_s"],
            "row_bytes_fp8_over_bf16": loader["fp8"]["row_bytes_per_token"] / loader["bf16"]["row_bytes_per_token"],
            "row_to_batch_packed_fp8_over_bf16":
                convert["fp8"]["packed_ms_per_pack"] / convert["bf16"]["packed_ms_per_pack"],
        }
        for k, v in ratios.items():
            log(f"{k}: {v:.2f}")
        result = {
            "command": " ".join(["python", "benchmarks/ingest_compact.py", *(sys.argv[1:] if argv is None else argv)]),
            "machine": f"{cpu_name()}, {os.cpu_count()} cores, {platform.system()}, CPU only",
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "load_average_1min": [load_start, os.getloadavg()[0]],
            "hidden_size": a.hidden, "samples": len(lengths), "tokens": sum(lengths), "packs": len(packs),
            "mean_pack_tokens": tokens, "row_tokens": a.row_tokens,
            "store_bytes_per_token": {"bf16": bytes_per_token(a.hidden), "fp8": bytes_per_token(a.hidden, "fp8")},
            "loader": loader, "row_to_batch": convert, "ratios": ratios,
            "notes": "best of --repeats passes; shards in the page cache; row_to_batch to the CPU device "
                     "(fp8 includes the dequantization a GPU run does on the device); rows read-only as "
                     "Ray Data hands them over",
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
            "seconds": time.perf_counter() - t_start,
        }
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {a.out} ({result['seconds']:.0f}s)")
    finally:
        if a.work is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
