"""Where `eagle3-ray extract` spends its start-up before the dataset runs, on CPU (no engine is built).

    python benchmarks/extract_startup.py                  # 3,384 x 2048 tokens, extract_e2e.py's 8B job
    python benchmarks/extract_startup.py --profile 30     # plus cProfile's top 30 (cumulative)

Runs the CLI's own code path, `eagle3_ray.cli.main(["extract", ...])`, in this fresh process (so its
imports count) on a prepared set of random token ids (benchmarks/device/extract_e2e.py's writer,
kept under --work between calls), target random:builtin:llama3.1-8b-shape, and stops it where the
stage hands its dataset to Ray Data (its first iter_batches: the engine actors start there). Two
things are patched, neither on the timed path's work: the store's filesystem reports 1 PB free (the
job's 227 GB of features would not pass the disk preflight here), and iter_batches stops the run.
Prints one JSON line, seconds from the moment the data is ready (nothing of the CLI imported yet):
  cli_import_s   `import eagle3_ray.cli`
  ray_start_s    init_ray called (config loaded, paths checked, output lock taken)
  ray_ready_s    init_ray returned (a local cluster, ray.num_cpus=2)
  submit_s       the dataset submitted (engine actors start)
  plan_steps     the stage's own `extract planning:` log line (seconds per step)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class _Stop(Exception):
    pass


def _prepared(work: Path, samples: int, seq: int) -> Path:
    prepared = work / "prepared"
    marker = work / f"prepared-{samples}x{seq}"
    if not marker.is_file():  # written by a child process: this one must not import numpy/pyarrow first
        import subprocess

        shutil.rmtree(work, ignore_errors=True)
        code = (f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks' / 'device')!r}); "
                f"from extract_e2e import write_prepared; "
                f"from pathlib import Path; write_prepared(Path({str(prepared)!r}), {samples}, {seq}, 32000)")
        subprocess.run([sys.executable, "-c", code], check=True)
        marker.touch()
    return prepared


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=3384)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--target", default="random:builtin:llama3.1-8b-shape")
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "extract_startup"))
    ap.add_argument("--profile", type=int, default=0, help="print cProfile's top N (cumulative)")
    a = ap.parse_args(argv)
    work = Path(a.work)
    prepared = _prepared(work, a.samples, a.seq)
    store = work / "store"
    shutil.rmtree(store, ignore_errors=True)
    base = time.perf_counter()  # the clock's zero: the data is ready, nothing of the CLI imported yet

    real_usage = shutil.disk_usage

    def disk_usage(path):
        u = real_usage(path)
        return u._replace(free=10**15) if str(work) in str(Path(path).absolute()) else u

    shutil.disk_usage = disk_usage
    marks: dict[str, float] = {}
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: lines.append(rec.getMessage())
    logging.getLogger("eagle3_ray").addHandler(handler)

    t = time.perf_counter()
    import eagle3_ray.cli as cli

    marks["cli_import_s"] = time.perf_counter() - t
    from eagle3_ray import ray_session

    real_init = ray_session.init_ray

    def init_ray(cfg):
        marks["ray_start_s"] = time.perf_counter() - base
        ray = real_init(cfg)
        marks["ray_ready_s"] = time.perf_counter() - base

        def iter_batches(self, *args, **kw):
            marks["submit_s"] = time.perf_counter() - base
            raise _Stop

        ray.data.Dataset.iter_batches = iter_batches
        return ray

    ray_session.init_ray = init_ray
    prof = None
    if a.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    try:
        cli.main(["extract", "--data", str(prepared), "--out", str(store), f"target.model={a.target}",
                  "target.device=cpu", "ray.num_cpus=2", f"data.max_length={a.seq}", "extract.batch_tokens=8192"])
    except _Stop:
        pass
    if prof:
        prof.disable()
    steps = next((ln for ln in lines if ln.startswith("extract planning")), None)
    result = {"samples": a.samples, "seq": a.seq, **{k: round(v, 2) for k, v in marks.items()},
              "plan_steps": steps, "cpus": os.cpu_count()}
    print(json.dumps(result), flush=True)
    if prof:
        import pstats

        pstats.Stats(prof).sort_stats("cumulative").print_stats(a.profile)
    import ray

    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
