"""Does a busy scheduler thread slow the capture hook's writer thread (the GIL)? CPU only.

SGLang's scheduler loop runs Python without pause: between forwards it loops over
``recv_requests`` / ``on_idle`` with no sleep (sglang/srt/managers/scheduler.py,
``event_loop_normal``), and during a forward with CUDA graphs off it launches kernels from Python.
The capture writer (``eagle3_ray.engines.sglang_hooks._Writer``) lives in that process. Each
system call it makes (open, write, close, rename) releases the GIL, and taking it back from a
thread that never blocks waits for the switch interval (5 ms by default). This script times the
real writer on the same batches in one process: with the main thread blocked (waiting for the
writer, as an idle process would) and with it spinning in Python (as SGLang's does); with
``--baseline REV`` also the writer of that git revision (its ``sglang_hooks.py``), alternated with
this checkout's. It prints the writers' seconds per batch for each, and their ratios.

    python benchmarks/capture_writer_gil.py --baseline ae38cc2 --json benchmarks/results/capture_writer_gil_cpu.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from eagle3_ray.engines import sglang_hooks

REPO = Path(__file__).resolve().parents[1]


def _module_at(rev: str, directory: Path):
    """``eagle3_ray/engines/sglang_hooks.py`` as it was at git revision ``rev``, imported on its own."""
    src = subprocess.run(["git", "show", f"{rev}:eagle3_ray/engines/sglang_hooks.py"], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    path = directory / f"sglang_hooks_{rev}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"sglang_hooks_{rev}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _batch(requests: int, rows: int, hidden: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    n = requests * rows
    aux = torch.randn(n, 3 * hidden, generator=g).to(torch.bfloat16)  # [N, 3H]
    last = torch.randn(n, hidden, generator=g).to(torch.bfloat16)  # [N, H]
    return aux, last


def _spin_until(cond) -> None:
    """Pure Python work until ``cond()`` (a scheduler loop with nothing to block on)."""
    spins = 0
    while not cond():
        for _ in range(1000):
            spins += 1


def measure(module, directory: Path, batches, requests: int, rows: int, spin: bool) -> dict:
    writer = module._Writer(1)
    before = writer.stats()
    t = time.perf_counter()
    for b, (aux, last) in enumerate(batches):
        reqs = [(f"b{b}-r{i}-{'spin' if spin else 'idle'}", rows, 0) for i in range(requests)]
        writer.put(directory, reqs, aux, last, None)
    if spin:
        target = len(batches)
        _spin_until(lambda: writer._finished >= target)
    else:
        writer.flush()
    wall = time.perf_counter() - t
    after = writer.stats()
    n = after["batches"] - before["batches"]
    files = sorted(directory.glob("*.safetensors"))  # a reader's links (this checkout) or files (before)
    for f in files:
        f.unlink()
    assert not list(directory.glob("*.tmp")), "the writer left temporary files"
    return {"batches": n, "files": len(files), "wall_s": wall, "write_s_per_batch": (after["write_s"] - before["write_s"]) / n,
            "bytes_per_batch": (after["bytes"] - before["bytes"]) / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/dev/shm", help="where the capture files go (tmpfs, as the product's capture_dir)")
    ap.add_argument("--requests", type=int, default=16, help="requests per forward batch")
    ap.add_argument("--rows", type=int, default=512, help="tokens per request")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3, help="idle/spin pairs, alternated")
    ap.add_argument("--baseline", help="also time the writer of this git revision, alternated with this checkout's")
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    batches = [_batch(a.requests, a.rows, a.hidden, s) for s in range(a.batches)]
    directory = Path(tempfile.mkdtemp(prefix="e3r_gil_", dir=a.dir))
    modules = {"this": sglang_hooks}
    try:
        if a.baseline:
            modules["baseline"] = _module_at(a.baseline, Path(tempfile.mkdtemp(prefix="e3r_gil_src_")))
        for m in modules.values():  # warm-up: the page cache, the threads
            measure(m, directory, batches[:1], a.requests, a.rows, spin=False)
        runs = {f"{name}_{kind}": [] for name in modules for kind in ("idle", "spin")}
        for _ in range(a.repeats):
            for name, m in modules.items():
                for kind in ("idle", "spin"):
                    runs[f"{name}_{kind}"].append(measure(m, directory, batches, a.requests, a.rows, spin=kind == "spin"))
                    print(f"{name}_{kind}", json.dumps(runs[f"{name}_{kind}"][-1]), flush=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    med = {k: sorted(r["write_s_per_batch"] for r in v)[len(v) // 2] for k, v in runs.items()}
    batch_bytes = runs["this_idle"][0]["bytes_per_batch"]
    out = {
        "what": "seconds a capture writer spends writing one forward batch (requests x rows), main thread blocked "
                "(idle) vs spinning in Python (spin); medians over repeats. 'this': the checkout's writer; "
                "'baseline': the --baseline revision's",
        **{f"write_s_per_batch_{k}": v for k, v in med.items()},
        **{f"gb_per_s_{k}": batch_bytes / v / 1e9 for k, v in med.items()},
        **{f"{name}_spin_over_idle": med[f"{name}_spin"] / med[f"{name}_idle"] for name in modules},
        **({"this_over_baseline_spin": med["this_spin"] / med["baseline_spin"],
            "this_over_baseline_idle": med["this_idle"] / med["baseline_idle"]} if a.baseline else {}),
        "switch_interval_s": sys.getswitchinterval(), "runs": runs, "args": vars(a),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread, {os.cpu_count()} CPUs",
        "command": "python " + " ".join(sys.argv),
    }
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
