"""The capture audit (issue 61): its figures on healthy captures and under each fault, and its cost.

    python benchmarks/capture_audit.py --target smollm2 --faults --out $OUT/capture_audit_smollm2_cpu.json
    python3 benchmarks/capture_audit.py --target smollm2 --backend sglang --device cuda --out $OUT/a.json
    python3 benchmarks/capture_audit.py --target random:builtin:llama3.1-8b-shape --device cuda --sets none \
        --cost 0.1,1 --shape 4096,128256,1 --shape 7168,163840,8 --out $OUT/cost.json

Drives the product: answers are written by ``self_distill`` (greedy ones carry ``greedy_by``), read
back by ``read_samples`` and tokenized with the target's chat template; the engine is
``build_engine(..., audit_share)`` and the figures are the capture actor's (``CaptureAudit``:
per-sample sums, ``check_aux_layers``) judged by ``AuditPolicy``. Three kinds of text: ``greedy``
(the target's own greedy answers), ``sampled`` (its answers at temperature 1) and ``human``
(builtin:ci_tiny's written answers). ``--faults`` repeats them under each fault and counts the rows that
catch it: the HF engine's switches of tests/audit_faults.py, or with ``--backend sglang`` the hooks of
tests/sglang_audit_faults.py, each in an SGLang engine of its own. ``--cost``: the capture's wall time at each
audit share against share 0; ``--shape H,V,SLICES``: the audit's time per row at that lm_head shape
(one vocab slice of V/SLICES, as a TP rank computes it) with its FLOPs, for a cost estimate at
shapes no single device holds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # audit_faults.py: the fault switches live with the tests

from eagle3_ray.audit.figures import AuditPolicy, ShardAudit  # noqa: E402
from eagle3_ray.config import ExtractConfig, TargetConfig  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} ({os.cpu_count()} CPU cores)"
    return f"{platform.machine()} CPU, {os.cpu_count()} cores"


def texts(target: TargetConfig, args, fingerprint: str, work: Path) -> dict[str, list]:
    """{set: tokenized samples}: the target's greedy and sampled answers to the demo prompts (written
    by the generate stage's self_distill, with a generate-mode engine), and builtin:ci_tiny."""
    from eagle3_ray.data.chat import tokenize_conversation
    from eagle3_ray.data.distill import self_distill
    from eagle3_ray.data.sources import read_samples
    from eagle3_ray.engines.describe import load_tokenizer
    from eagle3_ray.engines.factory import build_engine

    tok = load_tokenizer(target)
    prompts = [s for s in read_samples("builtin:demo_prompts", max_samples=args.prompts)]
    out = {}
    engine = build_engine(target, batch_tokens=args.batch_tokens, mode="generate", max_batch=args.prompts) \
        if {"greedy", "sampled"} & set(args.sets) else None
    for name, temperature in (("greedy", 0.0), ("sampled", 1.0)):
        if name in args.sets:
            path = work / f"{name}.jsonl"
            self_distill(engine, tok, prompts, path, args.max_new_tokens, temperature=temperature,
                         batch_size=args.prompts, seed=1, progress=lambda *a: None, answered_by=fingerprint)
            out[name] = list(read_samples(path))
    if engine is not None:
        engine.close()
    if "human" in args.sets:
        out["human"] = list(read_samples("builtin:ci_tiny"))
    return {k: [(tokenize_conversation(tok, s, 4096, truncate=True), s.greedy_by) for s in v] for k, v in out.items()}


def figures(engine, audit, samples) -> dict:
    """The capture actor's figures of one set of (tokenized sample, greedy_by): captured, summed per
    sample, judged as one shard."""
    caps = engine.capture([t.input_ids for t, _ in samples])
    audits = [audit.sample(t.sample_id, t.input_ids, t.loss_mask, c, g) for (t, g), c in zip(samples, caps)]
    shard = ShardAudit(audits)
    fig = shard.to_json()
    fig["failing"] = audit.policy.failing(shard)
    fig["disagreeing_rows"] = int(shard.total("greedy_rows") - shard.total("agree"))
    fig["unnormed_rows"] = int(shard.total("unnormed"))
    fig["rows_to_catch"] = rows_to_catch(fig, audit.policy)
    return fig


def rows_to_catch(fig: dict, policy: AuditPolicy) -> dict:
    """Per figure past its threshold: the audited rows a shard needs for its SIGMAS bound to fail too."""
    from eagle3_ray.audit.figures import MIN_ROWS, SIGMAS

    out = {}
    p, e, u = fig["agreement"], fig["nll_excess"], fig["unnormed"]
    if p is not None and p < policy.min_agreement:
        out["agreement"] = max(MIN_ROWS, round(SIGMAS ** 2 * max(p * (1 - p), 1e-9) / (policy.min_agreement - p) ** 2))
    if e is not None and e > policy.max_nll_excess:
        out["nll_excess"] = max(MIN_ROWS, round((SIGMAS * fig["nll_excess_std"] / (e - policy.max_nll_excess)) ** 2))
    if u is not None and u > policy.max_unnormed:
        out["unnormed"] = max(MIN_ROWS, round(1 / u))
    return out


def sglang_faults(target, args, extract, fingerprint: str, sets: dict) -> dict:
    """Each fault of tests/sglang_audit_faults.py in an SGLang capture engine of its own (hooks ahead of the
    capture's), its figures on every set, and the rows that catch it."""
    from eagle3_ray.engines.describe import describe_target
    from eagle3_ray.engines.sglang import SGLangEngine
    from eagle3_ray.engines.sglang_args import import_sglang
    from eagle3_ray.engines.sglang_modules import sglang_module_paths
    from eagle3_ray.extract.capture_audit import CaptureAudit
    from sglang_audit_faults import FAULTS, faulty_factory

    # the schedulers import sglang_audit_faults by name: a spawned process gets this sys.path, and the
    # environment's PYTHONPATH covers a start method that does not pass it on
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])])
    info = describe_target(target)
    paths = sglang_module_paths(info.architectures, target.sglang.extra_engine_kwargs)
    out = {}
    for name in FAULTS:
        factory = faulty_factory(name, paths, info.num_layers, import_sglang().Engine)
        engine = SGLangEngine(target, audit_share=args.share, engine_factory=factory)
        try:
            audit = CaptureAudit(engine, target, extract, fingerprint)
            out[name] = {k: figures(engine, audit, v) for k, v in sets.items()}
        finally:
            engine.close()
        log(f"sglang {name}: {json.dumps(out[name])}")
    return out


def time_capture(engine, audit, seqs, shares: list[float], repeats: int) -> dict[float, float]:
    """Per audit share, the best wall time of capturing ``seqs`` and summing the capture actor's audit
    of them (share 0: the capture and the final-norm check, which runs at every share). The shares
    take turns within each round, so that a machine's changing load falls on all of them alike."""
    best = {share: float("inf") for share in shares}
    for _ in range(repeats):
        for share in shares:
            engine.audit_share = audit.share = share
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t = time.perf_counter()
            for s, c in zip(seqs, engine.capture(seqs)):
                audit.sample("s", s, [1] * len(s), c, "")
            best[share] = min(best[share], time.perf_counter() - t)
    return best


def shape_cost(spec: str, rows: int, device: str, repeats: int) -> dict:
    """The audit's math (vocab_partials: one vocab slice, as one TP rank; combine_partials) at an
    lm_head of H x V split into SLICES, bf16 on a GPU (fp32 on a CPU), random values."""
    from eagle3_ray.audit.rows import combine_partials, vocab_partials

    h, v, slices = (int(x) for x in spec.split(","))
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    weight = torch.randn(v // slices, h, device=device, dtype=dtype, generator=gen) * 0.02
    hidden = torch.randn(rows, h, device=device, dtype=dtype, generator=gen)
    nxt = torch.randint(0, v // slices, (rows,), device=device, generator=gen)
    best = float("inf")
    for _ in range(repeats + 1):  # the first call warms up
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        part = vocab_partials(hidden, weight, nxt)
        combine_partials(part[None].expand(slices, -1, -1))
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return {"hidden": h, "vocab": v, "slices": slices, "rows": rows, "dtype": str(dtype).removeprefix("torch."),
            "us_per_row": round(best / rows * 1e6, 3), "gflop_per_row": round(2 * h * v / slices / 1e9, 4),
            "tflops": round(2 * h * v / slices * rows / best / 1e12, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2", help="target.model")
    ap.add_argument("--backend", choices=["hf", "sglang"], default="hf")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (HF engine)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tp", type=int, default=1, help="target.tp_size (SGLang)")
    ap.add_argument("--mem-fraction", type=float, help="target.sglang.mem_fraction_static (SGLang): what the engine "
                    "may hold of the GPU, less what the GPU already holds; for a run beside others")
    ap.add_argument("--sglang-kwargs", default="{}", help="target.sglang.extra_engine_kwargs as JSON, e.g. "
                    "'{\"attention_backend\": \"triton\", \"sampling_backend\": \"pytorch\"}' where flashinfer is absent")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--share", type=float, default=1.0, help="extract.audit_rows of the figure runs")
    ap.add_argument("--sets", default="greedy,sampled,human", help="comma list of greedy,sampled,human; none")
    ap.add_argument("--faults", action="store_true", help="repeat under each fault: tests/audit_faults.py (HF), "
                    "tests/sglang_audit_faults.py (SGLang: an engine per fault)")
    ap.add_argument("--cost", default="", help="comma list of audit shares to time the capture at (HF)")
    ap.add_argument("--cost-seqs", default="8x2048", metavar="NxT",
                    help="--cost without --sets: N random sequences of T tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shape", action="append", default=[], metavar="H,V,SLICES")
    ap.add_argument("--shape-rows", type=int, default=4096)
    ap.add_argument("--work", type=Path, help="keep the answers here (a rerun resumes them); default: a temp dir")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.sets = [s for s in args.sets.split(",") if s and s != "none"]
    torch.set_num_threads(max(1, torch.get_num_threads()))

    from eagle3_ray.engines.describe import describe_target
    from eagle3_ray.engines.factory import build_engine
    from eagle3_ray.extract.capture_audit import CaptureAudit, check_aux_layers
    from audit_faults import FAULTS

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    target = TargetConfig(model=args.target, backend=args.backend, device=args.device, dtype=args.dtype,
                          tp_size=args.tp, sglang={"mem_fraction_static": args.mem_fraction,
                                                   "extra_engine_kwargs": json.loads(args.sglang_kwargs)})
    extract = ExtractConfig(audit_rows=args.share)
    result = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
              "commit": commit, "machine": machine(), "date": time.strftime("%Y-%m-%d"), "target": args.target,
              "backend": args.backend, "share": args.share, "thresholds": vars(AuditPolicy.from_config(extract))}
    fingerprint = describe_target(target).fingerprint
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        sets = texts(target, args, fingerprint, work) if args.sets else {}
    result["samples"] = {k: len(v) for k, v in sets.items()}
    if sets or args.cost:
        engine = build_engine(target, batch_tokens=args.batch_tokens, audit_share=args.share)
        audit = CaptureAudit(engine, target, extract, fingerprint)  # checks the aux layers first
        result["healthy"] = {k: figures(engine, audit, v) for k, v in sets.items()}
        log(f"healthy: {json.dumps(result['healthy'])}")
        if args.faults and args.backend == "hf":
            result["faults"] = {}
            for name, switch in FAULTS.items():
                with switch(engine):
                    if name == "aux_off_by_one":
                        try:
                            check_aux_layers(engine)
                            got = {"caught": False}
                        except Exception as e:  # noqa: BLE001 (the audit's AuditFailed is the measurement)
                            got = {"caught": True, "rows": 32, "line": str(e)[:200]}
                        got["lm_head_figures"] = {k: figures(engine, audit, v) for k, v in sets.items()}
                    else:
                        got = {k: figures(engine, audit, v) for k, v in sets.items()}
                result["faults"][name] = got
                log(f"{name}: {json.dumps(got)}")
        if args.cost:
            seqs = [t.input_ids for v in sets.values() for t, _ in v]
            if not seqs:
                n, length = (int(x) for x in args.cost_seqs.split("x"))
                seqs = torch.randint(0, engine.info.vocab_size, (n, length), generator=torch.Generator().manual_seed(0)).tolist()
            shares = [float(s) for s in args.cost.split(",")]
            best = time_capture(engine, audit, seqs, [0.0, *shares], args.repeats)
            result["cost"] = {"tokens": sum(map(len, seqs)), "repeats": args.repeats,
                              "seconds_share_0": round(best[0.0], 4)}
            for share in shares:
                result["cost"][f"overhead_share_{share:g}"] = round(best[share] / best[0.0] - 1.0, 4)
            log(f"cost: {result['cost']}")
        engine.close()
    if args.faults and args.backend == "sglang" and sets:  # after the healthy engine: one engine at a time
        result["faults"] = sglang_faults(target, args, extract, fingerprint, sets)
    if args.shape:
        result["shape"] = [shape_cost(s, args.shape_rows, args.device, args.repeats) for s in args.shape]
        log(f"shape: {result['shape']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
