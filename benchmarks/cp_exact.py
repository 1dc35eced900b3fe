"""Context parallelism against one worker on CPU (gloo, spawned processes, a tiny fp32 drafter): the largest
loss, gradient and held-out metric differences of `cp_exactness` (tests/cp_exactness.py, the harness of
tests/test_context_parallel.py), the figure `cp_exact_cpu` publishes.

    python benchmarks/cp_exact.py --out benchmarks/results/cp_exact_cpu.json     # ~30 s on 2 cores

Cases: 2 ranks (sdpa and varlen, each alone and with loss_chunk_tokens + recompute_ttt_steps) on packs
split inside a sample and at sample ends; 2 groups of 2 (data parallel over groups); one group of 4.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.cp_exactness import cp_exactness  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the figures here (JSON)")
    a = p.parse_args()
    t = time.perf_counter()
    runs = {
        "cp2": cp_exactness(context_parallel=2),
        "cp2_dp2": cp_exactness(context_parallel=2, data_parallel=2, packs=[(10, 12, 9, 13), (37,)]),
        "cp4": cp_exactness(context_parallel=4, packs=[(3, 30, 4), (5, 6)]),
    }
    worst = {k: max(r["max"][k] for r in runs.values())
             for k in ("loss", "loss_sum", "stats", "grad", "grad_rel", "held_out", "walk")}
    out = {"max": worst, "runs": runs, "seconds": time.perf_counter() - t, "machine": platform.platform(),
           "dtype": "float32", "backend": "gloo"}
    print(json.dumps({"max": worst}, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
