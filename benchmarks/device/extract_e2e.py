"""Extraction end to end against the bare forward, on a job of about `--job-seconds` of forward work.

    python benchmarks/device/extract_e2e.py --out $OUT                       # one H200, ~6 min
    python benchmarks/device/extract_e2e.py --out /tmp/e2e --device cpu      # tiny shape: smoke test

1. bare: the HF engine's model built in this process (timed), then `model.model(...)` with the aux
   hidden states at `extract.batch_tokens` tokens per forward, nothing else, for `--bare-seconds`.
2. a prepared dataset of random token ids (`--seq` tokens each), sized so that the bare forward
   would take `--job-seconds` over it at `--rate` tokens/s (default: the bare rate measured in
   benchmarks/results/extract_gpu_8b_pinned.json on CUDA, this call's on CPU); `--samples` overrides.
3. `eagle3-ray extract --data <prepared> --out <store> target.model=<target> ...` as a fresh process
   (its Python start, Ray start, planning, engine actor start and model build all counted), timed
   from its launch to its exit, while this process records every shard's commit (its marker's
   mtime and tokens).

Writes <out>/extract_e2e.json: extract_ratio_end_to_end = (tokens / extract wall time) / bare
tokens/s, extract_ratio_steady (tokens after the first shard / the span from first to last commit,
over bare), time to the first committed shard (from launch, and from the stage's own start as its
summary.json reports it), and the stage's startup breakdown.

Storage: at the 8B shape a token of features is 32 KiB (aux 3H + last H, bf16), so 5 minutes of
extraction write ~300 GB, more than the H200 machine holds. When the job's features do not fit in
`--budget-gb` (default: 45% of the store's free space), the recorder deletes the oldest committed
shards (data file, then marker) while the store holds more than half the budget, and stops deleting
for good once what is still to come fits in the other half, so nothing is deleted while the stage
finishes (it opens every remaining shard). The stage's disk preflight is then asked about the bytes
the store holds at once (the budget), not the whole job: the one change to the product's run, made in
the `--cli` wrapper process. Deleting a tmpfs file costs milliseconds; the figures are the stage's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "extract_gpu_8b_pinned.json"
BUDGET_ENV = "EXTRACT_E2E_STORE_BUDGET_TOKENS"


class _PatchOnImport:
    """A sys.meta_path finder: runs `patch(module)` right after the module `name` is first imported."""

    def __init__(self, name: str, patch):
        self.name, self.patch = name, patch

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            self.patch(module)

        spec.loader.exec_module = exec_module
        return spec


def cli_wrapper(argv: list[str]) -> int:
    """`eagle3-ray <argv>`, with the disk preflight asked about the tokens the store holds at once."""
    budget = os.environ.get(BUDGET_ENV)
    if budget:
        # Patched when the stage imports it, not imported here: its import brings torch, which the
        # CLI itself imports only while Ray starts (importing it here would add seconds to the start).
        def patch(preflight) -> None:
            real = preflight.check_disk

            def check_disk(out_dir, num_tokens, hidden_size, **kw):
                return real(out_dir, min(num_tokens, int(budget)), hidden_size, **kw)

            preflight.check_disk = check_disk

        sys.meta_path.insert(0, _PatchOnImport("eagle3_ray.features.preflight", patch))
    from eagle3_ray.cli import main

    return main(argv)


# ------------------------------------------------------------------------------------------ bare


def bare_forward(cfg, seq: int, seconds: float) -> dict:
    import numpy as np
    import torch

    from eagle3_ray.engines.hf import HFEngine

    sync = torch.cuda.synchronize if cfg.target.device.startswith("cuda") else (lambda: None)
    t = time.perf_counter()
    engine = HFEngine(cfg.target, batch_tokens=cfg.extract.batch_tokens)
    sync()
    build_s = time.perf_counter() - t
    model, dev, layers = engine.target.model, engine.target.device, engine.info.aux_layers
    rows = max(1, cfg.extract.batch_tokens // seq)
    vocab = engine.info.vocab_size
    ids = torch.from_numpy(np.random.default_rng(1).integers(0, vocab, (rows, seq))).to(dev)  # [rows, seq]
    with torch.inference_mode():
        t = time.perf_counter()
        for _ in range(2):  # kernels, cuBLAS handles
            model.model(input_ids=ids, output_hidden_states=layers, use_cache=False)
        sync()
        warm_s = time.perf_counter() - t
        n, t = 0, time.perf_counter()
        while n < 3 or time.perf_counter() - t < seconds:
            model.model(input_ids=ids, output_hidden_states=layers, use_cache=False)
            n += 1
            if n % 4 == 0:
                sync()
        sync()
        dt = time.perf_counter() - t
    info = engine.info
    engine.close()
    del engine, model, ids
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # the engine actor loads its own copy
    return {"bare_tokens_per_s": n * rows * seq / dt, "bare_forwards": n, "bare_seconds": dt,
            "rows_per_forward": rows, "engine_build_s_in_process": build_s, "warmup_s": warm_s,
            "hidden_size": info.hidden_size, "vocab_size": info.vocab_size}


def write_prepared(path: Path, samples: int, seq: int, vocab: int) -> Path:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, (samples, seq), dtype=np.int32)  # [N, seq]
    mask = np.ones(seq, dtype=np.uint8)
    table = pa.table({
        "sample_id": pa.array([f"s{i:06d}" for i in range(samples)]),
        "source": pa.array(["random"] * samples),
        "input_ids": pa.array(list(ids), pa.list_(pa.int32())),
        "loss_mask": pa.array([mask] * samples, pa.list_(pa.uint8())),
        "num_tokens": pa.array([seq] * samples, pa.int64()),
    })
    path.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path / "prepared.parquet")
    return path


# ------------------------------------------------------------------------------- commit recorder


class Recorder(threading.Thread):
    """Polls <store>/shards for completion markers: records each (mtime, tokens, bytes) and, when
    `reap` is set, deletes the oldest committed shards as the module docstring says."""

    def __init__(self, store: Path, total_tokens: int, bytes_per_token: int, budget_bytes: int, reap: bool):
        super().__init__(daemon=True)
        self.dir = store / "shards"
        self.total, self.bpt, self.half, self.reap = total_tokens, bytes_per_token, budget_bytes // 2, reap
        self.seen: dict[str, dict] = {}
        self.kept: list[str] = []  # marker names still on disk, oldest first
        self.kept_bytes = self.reaped = self.peak_bytes = 0
        self.reaping_stopped_at: float | None = None
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.poll()
            self.done.wait(0.2)
        self.poll()

    def poll(self) -> None:
        try:
            names = sorted(p.name for p in self.dir.iterdir() if p.name.endswith(".done.json"))
        except FileNotFoundError:
            return
        new = []
        for name in names:
            if name in self.seen:
                continue
            p = self.dir / name
            try:
                m = json.loads(p.read_text())
                mtime = p.stat().st_mtime
            except (OSError, ValueError):
                continue  # deleted by a cleanup, or not ours
            self.seen[name] = {"mtime": mtime, "tokens": int(m["tokens"]), "bytes": int(m["bytes"])}
            new.append(name)
        for name in sorted(new, key=lambda n: self.seen[n]["mtime"]):
            self.kept.append(name)
            self.kept_bytes += self.seen[name]["bytes"]
        self.peak_bytes = max(self.peak_bytes, self.kept_bytes)
        if not self.reap or self.reaping_stopped_at is not None:
            return
        # Checked before deleting: in the poll that sees the last shards nothing is deleted, and the
        # stage only opens its store once they are all there (so no deletion overlaps that).
        committed = sum(s["tokens"] for s in self.seen.values())
        if (self.total - committed) * self.bpt <= self.half:  # the rest fits beside what is kept: stop for good
            self.reaping_stopped_at = time.time()
            return
        while self.kept_bytes > self.half and len(self.kept) > 1:
            name = self.kept.pop(0)
            marker = self.dir / name
            shard = self.dir / (name[: -len(".done.json")] + ".safetensors")
            shard.unlink(missing_ok=True)
            marker.unlink(missing_ok=True)
            self.kept_bytes -= self.seen[name]["bytes"]
            self.reaped += 1


# ------------------------------------------------------------------------------------------ main


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--cli"]:
        return cli_wrapper(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="results directory (extract_e2e.json, extract_e2e.log)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: tiny shape, a smoke test")
    ap.add_argument("--target", default=None, help="default random:builtin:llama3.1-8b-shape (cpu: tiny-llama)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sample (default 2048; cpu 256)")
    ap.add_argument("--batch-tokens", type=int, default=None, help="extract.batch_tokens (default 8192; cpu 1024)")
    ap.add_argument("--job-seconds", type=float, default=None,
                    help="size of the job in seconds of bare forward at --rate (default 270; cpu 20)")
    ap.add_argument("--rate", type=float, default=None,
                    help="bare tokens/s used to size the job (default: benchmarks/results/"
                         "extract_gpu_8b_pinned.json on cuda, this call's bare forward on cpu)")
    ap.add_argument("--samples", type=int, default=None, help="job size in samples (overrides --job-seconds)")
    ap.add_argument("--bare-seconds", type=float, default=None, help="timed bare forward (default 8; cpu 3)")
    ap.add_argument("--work", default=None, help="prepared data + store, deleted at the end (default "
                    "/dev/shm/extract_e2e on cuda where /dev/shm has 16 GB free, else $TMPDIR/extract_e2e)")
    ap.add_argument("--budget-gb", type=float, default=None,
                    help="bytes the store may hold at once (default 45%% of its free space)")
    ap.add_argument("--timeout", type=float, default=None, help="cap of the extract run, s (default 3 x job)")
    ap.add_argument("overrides", nargs="*", help="extra section.field=value for eagle3-ray extract")
    a = ap.parse_args(argv)
    cuda = a.device == "cuda"
    target = a.target or ("random:builtin:llama3.1-8b-shape" if cuda else "random:builtin:tiny-llama")
    seq = a.seq or (2048 if cuda else 256)
    batch_tokens = a.batch_tokens or (8192 if cuda else 1024)
    job_s = a.job_seconds or (270.0 if cuda else 20.0)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    shm = Path("/dev/shm")
    roomy_shm = cuda and shm.is_dir() and shutil.disk_usage(shm).free > 16e9  # tmpfs: no disk write bound
    # Never under --out: the store is tens of GB, and $OUT comes back from the device machine.
    work = Path(a.work or (shm / "extract_e2e" if roomy_shm else Path(tempfile.gettempdir()) / "extract_e2e"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    overrides = [f"target.model={target}", f"target.device={a.device}",
                 f"target.dtype={'bfloat16' if cuda else 'float32'}", f"extract.batch_tokens={batch_tokens}",
                 f"extract.num_gpus_per_actor={1 if cuda else 0}", f"data.max_length={seq}",
                 f"extract.concurrent_batches={3 if cuda else 1}",
                 *([] if cuda else ["ray.num_cpus=2"]), *a.overrides]

    from eagle3_ray.config import load_config

    cfg = load_config(None, overrides)
    log = open(out / "extract_e2e.log", "w")

    def say(line: str) -> None:
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    try:
        return _run(a, cfg, cuda, target, seq, job_s, out, work, overrides, say, log)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(a, cfg, cuda, target, seq, job_s, out, work, overrides, say, log) -> int:
    """The three phases of the module docstring; results to <out>/extract_e2e.json."""
    from eagle3_ray.engines.targets import resolve_target
    from eagle3_ray.features.record import bytes_per_token

    t = time.perf_counter()
    resolve_target(cfg.target.model, cfg.target.cache_dir)  # a random target's tokenizer: a GGUF conversion, once
    resolve_s = time.perf_counter() - t
    say(f"[e2e] 1/3 bare forward of {target} on {a.device} (target files resolved in {resolve_s:.1f}s)")
    bare = bare_forward(cfg, seq, a.bare_seconds or (8.0 if cuda else 3.0))
    bare["resolve_target_s"] = resolve_s
    say(f"[e2e] bare {bare['bare_tokens_per_s']:,.0f} tokens/s; engine built in "
        f"{bare['engine_build_s_in_process']:.1f}s in this process")
    rate_src = "--rate"
    rate = a.rate
    if rate is None and cuda and RESULTS.is_file():
        rate, rate_src = float(json.loads(RESULTS.read_text())["bare_tokens_per_s"]), str(RESULTS.relative_to(ROOT))
    if rate is None:
        rate, rate_src = bare["bare_tokens_per_s"], "this call's bare forward"
    samples = a.samples or max(4, math.ceil(job_s * rate / seq))
    tokens = samples * seq
    prepared = write_prepared(work / "prepared", samples, seq, min(bare["vocab_size"], 49152))
    bpt = bytes_per_token(bare["hidden_size"], cfg.extract.compact)
    free = shutil.disk_usage(work).free
    budget = int(a.budget_gb * 1e9) if a.budget_gb else int(0.45 * free)
    reap = tokens * bpt * cfg.extract.disk_margin > budget
    say(f"[e2e] 2/3 job: {samples} samples x {seq} tokens = {tokens:,} tokens ({job_s:.0f}s of forward at "
        f"{rate:,.0f} tokens/s from {rate_src}); features {tokens * bpt / 1e9:.1f} GB, store budget "
        f"{budget / 1e9:.1f} GB of {free / 1e9:.1f} GB free in {work}: "
        f"{'oldest shards deleted as the job runs' if reap else 'all kept'}")

    store = work / "store"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    if reap:
        env[BUDGET_ENV] = str(budget // bpt)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--cli", "extract", "--data", str(prepared),
           "--out", str(store), *overrides]
    say("[e2e] 3/3 " + " ".join(cmd[2:]))
    rec = Recorder(store, tokens, bpt, budget, reap)
    rec.start()
    launched = time.time()
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    reader = threading.Thread(target=lambda: [lines.append(ln) or log.write(ln) for ln in proc.stdout], daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=a.timeout or 3 * job_s + 120)
    except subprocess.TimeoutExpired:
        proc.terminate()
        rc = proc.wait()
    wall = time.perf_counter() - t
    reader.join(5)
    rec.done.set()
    rec.join()
    log.flush()
    for ln in lines:
        if ln.startswith("[extract]") or "Error" in ln:
            say("  " + ln.rstrip())

    # The stage's planning steps (its "extract planning: imports 0.03s, describe_target 2.89s, ..." log line).
    planning = {}
    for ln in lines:
        if "extract planning:" in ln:
            for part in ln.split("extract planning:", 1)[1].split(","):
                name, _, secs = part.strip().rpartition(" ")
                if name and secs.endswith("s"):
                    planning[name] = float(secs[:-1])
    commits = sorted(rec.seen.values(), key=lambda s: s["mtime"])
    done_tokens = sum(s["tokens"] for s in commits)
    summary_path = store / "summary.json"
    stage = json.loads(summary_path.read_text()) if rc == 0 and summary_path.is_file() else {}
    first = commits[0]["mtime"] - launched if commits else None
    last = commits[-1]["mtime"] - launched if commits else None
    span = (commits[-1]["mtime"] - commits[0]["mtime"]) if len(commits) > 1 else 0.0
    steady = sum(s["tokens"] for s in commits[1:]) / span if span > 0 else None
    e2e = done_tokens / wall
    result = {
        "target": target, "device": _device_name(cuda), "seq": seq, "samples": samples, "tokens": tokens,
        "job_seconds_at_rate": job_s, "sizing_rate_tokens_per_s": rate, "sizing_rate_from": rate_src,
        **bare,
        "extract_rc": rc, "extract_tokens_committed": done_tokens, "extract_wall_s": wall,
        "extract_tokens_per_s_end_to_end": e2e, "extract_tokens_per_s_steady": steady,
        "extract_ratio_end_to_end": e2e / bare["bare_tokens_per_s"] if rc == 0 else None,
        "extract_ratio_steady": steady / bare["bare_tokens_per_s"] if steady and rc == 0 else None,
        "first_shard_s_from_launch": first, "last_shard_s_from_launch": last,
        "exit_after_last_shard_s": wall - last if last is not None else None,
        "stage_summary": stage,  # first_shard_s, plan_s, engine_s, steady_tokens_per_s from the stage itself
        "stage_planning_s": planning,  # plan_s by step (describe_target: the wait for the CLI's describe thread)
        # launch -> run_extract called (Python start, CLI imports and checks, Ray start), from the two clocks
        # of the first shard (its marker's mtime here, its report to the stage's driver there): approximate
        "stage_start_s_from_launch": first - stage["first_shard_s"] if stage.get("first_shard_s") and first else None,
        "shards": len(commits), "shards_deleted_while_running": rec.reaped,
        "store_peak_gb": rec.peak_bytes / 1e9, "store_budget_gb": budget / 1e9,
        "command": " ".join([sys.executable, *sys.argv]), "extract_command": " ".join(cmd[2:]),
        "cpus": os.cpu_count(),
    }
    (out / "extract_e2e.json").write_text(json.dumps(result, indent=2))
    say(json.dumps({k: result[k] for k in ("extract_ratio_end_to_end", "extract_ratio_steady",
                                           "first_shard_s_from_launch", "extract_wall_s")}))
    say(f"[e2e] bare {bare['bare_tokens_per_s']:,.0f} tokens/s | extract end to end {e2e:,.0f} tokens/s "
        f"over {wall:.1f}s incl. start (x{result['extract_ratio_end_to_end'] or 0:.3f}, goal >= 0.80), steady "
        f"{steady or 0:,.0f} (x{result['extract_ratio_steady'] or 0:.3f}) | first shard {first or 0:.1f}s after "
        f"launch ({stage.get('first_shard_s')}s after the stage's start) -> {out / 'extract_e2e.json'}")
    return 0 if rc == 0 else 1


def _device_name(cuda: bool) -> str:
    if not cuda:
        return "cpu"
    import torch

    return torch.cuda.get_device_name(0)


if __name__ == "__main__":
    sys.exit(main())
