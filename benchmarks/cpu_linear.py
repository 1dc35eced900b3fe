"""The CPU verify forward by width: torch's ``linear`` against ``narrow_linear`` (decode/narrow_linear.py).

Two measurements on the demo's target (SmolLM2-135M-Instruct, fp32), both in one process, the
variants interleaved, the minimum of ``--repeats`` kept:
- ``linears``: every linear layer of the target over R random rows, ``F.linear`` and ``narrow_linear``;
- ``forward``: a ``TargetRunner`` forward of R new tokens over a ``--context``-token cache, the aux
  states on (a verify), with the narrow path on (as the decoder runs it) and off, in plain decoding
  steps (one token, no aux states: the baseline's forward).

    PYTHONPATH=. python benchmarks/cpu_linear.py --threads 2 --out cpu_linear.json

Run it on an otherwise idle machine: other processes on the cores make the minimum meaningless.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import time

import torch
import torch.nn.functional as F

from eagle3_ray.config import TargetConfig
from eagle3_ray.decode import narrow_linear as nl
from eagle3_ray.decode.target import TargetRunner
from eagle3_ray.engines.targets import load_target

AUX = [2, 15, 27]  # the demo's aux layers (HF hidden_states indices)


def best_ms(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return round(best * 1e3, 2)


@contextlib.contextmanager
def narrow_off():
    """The decoder as it ran before decode/narrow_linear.py: every row count through ``F.linear``."""
    before = nl.NARROW_MAX_ROWS
    nl.NARROW_MAX_ROWS = 1
    try:
        yield
    finally:
        nl.NARROW_MAX_ROWS = before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,3,4,5,6,8,12,16,32,48")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_target(TargetConfig(model="smollm2")).model
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    rows = [int(r) for r in args.rows.split(",")]
    gen = torch.Generator().manual_seed(0)
    out = {"threads": args.threads, "context": args.context, "repeats": args.repeats, "torch": torch.__version__,
           "machine": f"{platform.machine()}, {platform.processor() or '?'}", "linears_ms": {}, "forward_ms": {}}
    with torch.inference_mode():
        for r in rows:
            xs = [torch.randn(r, w.shape[1], generator=gen) for w in weights]
            out["linears_ms"][r] = {
                "linear": best_ms(lambda: [F.linear(x, w) for x, w in zip(xs, weights)], args.repeats),
                "narrow": best_ms(lambda: [nl.narrow_linear(x, w) for x, w in zip(xs, weights)], args.repeats),
            }
        prompt = torch.randint(100, 40000, (args.context,), generator=gen)
        plain, verify = TargetRunner(model), TargetRunner(model, AUX)
        plain.forward(prompt)
        verify.forward(prompt)

        def step(runner: TargetRunner, r: int) -> None:
            runner.forward(torch.randint(100, 40000, (r,), generator=gen))
            runner.crop(args.context)

        base = best_ms(lambda: step(plain, 1), args.repeats)
        out["plain_step_ms"] = base
        for r in rows:
            on = best_ms(lambda: step(verify, r), args.repeats)
            with narrow_off():
                off = best_ms(lambda: step(verify, r), args.repeats)
            out["forward_ms"][r] = {"narrow": on, "linear": off, "narrow_in_plain_steps": round(on / base, 3),
                                    "linear_in_plain_steps": round(off / base, 3)}
            print(f"rows {r:3d}: verify {on:7.1f} ms narrow, {off:7.1f} ms linear ({on / base:.2f} / "
                  f"{off / base:.2f} plain steps)", flush=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
