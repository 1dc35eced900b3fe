"""Where the time of one CUDA-graphed plain decode step goes: the graph's own GPU time vs the host
work between replays, and what the graph holds.

    python3 benchmarks/device/decode_profile.py --target /tmp/SmolLM2-135M-Instruct.Q4_1.gguf --out $OUT
    python3 benchmarks/device/decode_profile.py --random --out $OUT     # SmolLM2-135M shape, random weights
    python3 benchmarks/device/decode_profile.py --tiny --out /tmp/dp    # CPU smoke run (tiny random Llama,
                                                                        # 100 + 16 tokens, max_length 512)

The target is loaded as the bench loads it (``load_target``, bf16 on CUDA) and decoded through
``StaticTarget(model, aux_layers=[], max_length=2048)`` (preallocated KV storage, one CUDA graph per
(width, attention span)), as the bench's plain baseline does (it builds the StaticTarget with the
drafter's aux layers: one concat more in the graph). A seeded random ``--prompt-tokens`` (400)
prompt, EOS off, ``--new-tokens`` (128). Measured, printed as a table and written to
``<out>/decode_profile.json``:

a) ms/token of ``target_generate(static, prompt, N)`` (median of ``--reps`` after a warm-up call),
   as the bench counts it (seconds / new tokens, prefill included), and the decode step alone:
   (seconds(N) - seconds(1)) / (N - 1), the 1-token run being the prefill and the first pick;
b) ms per bare graph replay, width 1, for each span the decode crosses: ``--replays`` (200)
   ``graph.replay()`` back to back, one synchronize at the end = the step's GPU time with no host
   work between (also the host time to issue them: if it is not well below, the loop was
   launch-bound, flagged). Also the shortest host loop around it: replay + argmax + ``.item()``
   per token (the per-token sync the decode needs);
c) host part = a's decode step - b (weighted by the steps at each span), and per token, from
   torch.profiler over ``--profile-steps`` (16) decode steps (a run of 1 + 16 tokens minus a run
   of 1): CUDA runtime calls by name (cudaLaunchKernel, cudaGraphLaunch, cudaMemcpyAsync,
   cudaStreamSynchronize, ...) and their host time, aten ops, kernels outside the graph; between
   consecutive graph launches: the host gap, the part of it waiting in a sync, the rest (host
   work), and the GPU's idle time between two graphs' kernels (profiler-inflated host times: read
   the counts, take the times from a and b);
d) the eager forward of one width-1 step (``static._run`` on the graph's inputs, no graph) under
   torch.profiler: CUDA kernels per forward, the sum of their GPU durations, the top 10 kernels by
   total time (name, count, total us); b - that sum over the kernel count = the per-kernel cost
   of the replay beyond the kernels themselves;
e) b and d for width 4 (a chain(3) verify).
On CPU the CUDA-only parts print "n/a (CPU)"; a and d run with host times (d: aten ops by self
CPU time).

Expected runtime on an H200 (an estimate from the work done, not yet timed there): ~10-20 s of
measurement after the load (a GGUF is converted to safetensors on
first use: + 15-20 s on a fresh machine), under 60 s in all. ``--trace`` keeps the profiler traces
(gzipped chrome traces) in ``<out>``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from pathlib import Path

T0 = time.perf_counter()
RUNTIME_CATS = ("cuda_runtime", "cuda_driver")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def soft(errors: list, what: str, fn, default=None):
    """fn(), or ``default`` with the traceback kept in ``errors``: one analysis failing (a trace
    format this script did not expect) leaves the others and the timings standing."""
    try:
        return fn()
    except Exception:  # noqa: BLE001 - reported in the JSON and the log
        errors.append({"what": what, "traceback": traceback.format_exc()})
        log(f"{what} FAILED:\n{errors[-1]['traceback']}")
        return default


def is_wait(name: str) -> bool:
    """A host call that waits for the GPU (a sync, or a blocking memcpy)."""
    return "Synchronize" in name or (name.startswith(("cudaMemcpy", "cuMemcpy")) and "Async" not in name)


def is_launch(name: str) -> bool:
    return "LaunchKernel" in name or name in ("cudaLaunchCooperativeKernel", "cuLaunchKernelEx")


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


def load_model(a):
    """(model, device): the bench's load_target, or a random SmolLM2-135M-shaped Llama (--random)."""
    import torch

    if a.random:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/shapes.py
        from shapes import random_llama

        shape = argparse.Namespace(layers=30, hidden=576, heads=9, kv_heads=3, intermediate=1536, vocab=49152)
        _, model = random_llama(shape, torch.device(a.device))
        return model, torch.device(a.device)
    from eagle3_ray.config import TargetConfig
    from eagle3_ray.engines.targets import load_target

    target = load_target(TargetConfig(model=a.target, device=a.device, dtype=a.dtype))
    return target.model, target.device


class Profiled:
    """A torch.profiler run (CPU, + CUDA on a GPU) and its chrome trace's complete events."""

    def __init__(self, dev, name: str, keep: Path | None):
        import torch

        self.cuda = dev.type == "cuda"
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if self.cuda else [])
        self.prof = torch.profiler.profile(activities=acts)
        self.name, self.keep, self.dev = name, keep, dev
        self.events: list[dict] = []

    def __enter__(self):
        self._sync()
        self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        self._sync()
        self.prof.__exit__(*exc)
        if exc[0] is None:
            with tempfile.TemporaryDirectory() as d:
                path = Path(d) / "trace.json"
                self.prof.export_chrome_trace(str(path))
                raw = path.read_bytes()
            if self.keep is not None:
                (self.keep / f"trace_{self.name}.json.gz").write_bytes(gzip.compress(raw))
            self.events = [e for e in json.loads(raw)["traceEvents"] if e.get("ph") == "X" and "ts" in e]
            for e in self.events:  # microseconds; some writers quote them
                e["ts"], e["dur"] = float(e["ts"]), float(e.get("dur", 0))
        return False

    def _sync(self):
        import torch

        if self.cuda:
            torch.cuda.synchronize(self.dev)

    def cat(self, *cats: str) -> list[dict]:
        return [e for e in self.events if e.get("cat") in cats]


def corr(e: dict):
    return (e.get("args") or {}).get("correlation")


def per_token_counts(long: Profiled, short: Profiled, steps: int) -> dict:
    """Per decode token: runtime calls by name (count, host us), aten ops, kernels outside graphs."""
    out: dict = {}
    calls: dict[str, list[float]] = {}
    for tag, p, sign in (("long", long, 1), ("short", short, -1)):
        for e in p.cat(*RUNTIME_CATS):
            c = calls.setdefault(e["name"], [0.0, 0.0])
            c[0] += sign
            c[1] += sign * float(e.get("dur", 0))
    out["runtime_calls"] = {k: {"count": v[0] / steps, "host_us": v[1] / steps}
                            for k, v in sorted(calls.items(), key=lambda kv: -abs(kv[1][0])) if abs(v[0]) > 0}
    groups = {"kernel_launches": is_launch, "graph_launches": lambda n: "GraphLaunch" in n,
              "memcpy_async": lambda n: "Memcpy" in n and "Async" in n, "waits": is_wait,
              "event_records": lambda n: "EventRecord" in n}
    out["by_kind"] = {g: {"count": sum(v["count"] for k, v in out["runtime_calls"].items() if f(k)),
                          "host_us": sum(v["host_us"] for k, v in out["runtime_calls"].items() if f(k))}
                      for g, f in groups.items()}
    ops = Counter(e["name"] for e in long.cat("cpu_op"))
    ops.subtract(Counter(e["name"] for e in short.cat("cpu_op")))
    out["aten_ops"] = sum(ops.values()) / steps
    out["top_aten_ops"] = [(k, v / steps) for k, v in ops.most_common(12) if v > 0]
    if long.cuda:
        def outside(p: Profiled) -> int:
            graph_corr = {corr(e) for e in p.cat(*RUNTIME_CATS) if "GraphLaunch" in e["name"]}
            return sum(1 for e in p.cat(*GPU_CATS) if corr(e) not in graph_corr)

        out["gpu_ops_outside_graph"] = (outside(long) - outside(short)) / steps
    return out


def replay_gaps(p: Profiled) -> dict | None:
    """Between consecutive graph launches of a decode trace: host gap, its sync wait, the host
    work left, the GPU idle time between the graphs' kernels, kernels per graph (medians, us)."""
    launches = sorted((e for e in p.cat(*RUNTIME_CATS) if "GraphLaunch" in e["name"]), key=lambda e: e["ts"])
    if len(launches) < 2:
        return None
    waits = [e for e in p.cat(*RUNTIME_CATS) if is_wait(e["name"])]
    by_corr = defaultdict(list)
    for e in p.cat(*GPU_CATS):
        by_corr[corr(e)].append(e)
    rows = []
    for one, nxt in zip(launches, launches[1:]):
        end = one["ts"] + one["dur"]
        gap = nxt["ts"] - end
        wait = sum(min(w["ts"] + w["dur"], nxt["ts"]) - max(w["ts"], end)
                   for w in waits if w["ts"] < nxt["ts"] and w["ts"] + w["dur"] > end)
        k1, k2 = by_corr.get(corr(one), []), by_corr.get(corr(nxt), [])
        gpu_idle = (min(k["ts"] for k in k2) - max(k["ts"] + k["dur"] for k in k1)) if k1 and k2 else None
        gpu_span = (max(k["ts"] + k["dur"] for k in k1) - min(k["ts"] for k in k1)) if k1 else None
        rows.append({"period": nxt["ts"] - one["ts"], "launch_call": one["dur"], "host_gap": gap, "sync_wait": wait,
                     "host_work": gap - wait, "gpu_idle_between_graphs": gpu_idle,
                     "graph_gpu_span": gpu_span, "graph_kernels": len(k1)})

    def med(key):
        vals = [r[key] for r in rows if r[key] is not None]
        return statistics.median(vals) if vals else None

    return {"steps": len(rows), **{f"{k}_us": med(k) for k in rows[0] if k != "graph_kernels"},
            "graph_kernels": med("graph_kernels")}


def kernel_summary(p: Profiled, calls: int) -> dict:
    """Per forward: GPU ops (kernels, memcpy, memset), their summed GPU us, top 10 kernels."""
    if not p.cuda:
        return {}
    kernels = p.cat("kernel")
    others = p.cat("gpu_memcpy", "gpu_memset")
    tot: dict[str, list[float]] = {}
    for e in kernels:
        t = tot.setdefault(e["name"], [0, 0.0])
        t[0] += 1
        t[1] += float(e["dur"])
    top = sorted(tot.items(), key=lambda kv: -kv[1][1])[:10]
    launches = sum(1 for e in p.cat(*RUNTIME_CATS) if is_launch(e["name"]))
    return {"kernels": len(kernels) / calls, "kernel_gpu_us": sum(float(e["dur"]) for e in kernels) / calls,
            "memcpy_memset": len(others) / calls, "memcpy_memset_gpu_us": sum(float(e["dur"]) for e in others) / calls,
            "kernel_launch_calls": launches / calls,
            "top_kernels": [{"name": n[:160], "count": c / calls, "total_us": us / calls} for n, (c, us) in top]}


def cpu_op_summary(prof, calls: int) -> dict:
    """CPU: aten ops per forward and the top 10 by self CPU time (us per forward)."""
    avgs = sorted(prof.key_averages(), key=lambda k: -k.self_cpu_time_total)
    return {"aten_ops": sum(k.count for k in avgs) / calls,
            "top_ops": [{"name": k.key, "count": k.count / calls, "self_cpu_us": k.self_cpu_time_total / calls}
                        for k in avgs[:10]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", help="GGUF path, HF model dir, or any target.model spec")
    ap.add_argument("--random", action="store_true", help="random weights in the SmolLM2-135M shape (no files)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: random tiny Llama, fp32")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--prompt-tokens", type=int, default=400)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3, help="timed target_generate calls (median)")
    ap.add_argument("--replays", type=int, default=200, help="bare graph replays per (width, span)")
    ap.add_argument("--profile-steps", type=int, default=16, help="decode steps under the profiler")
    ap.add_argument("--eager-calls", type=int, default=3, help="profiled eager forwards per width (averaged)")
    ap.add_argument("--sglang-ms", type=float, default=2.28, help="SGLang's ms/token on the same model, for the summary")
    ap.add_argument("--trace", action="store_true", help="keep the profiler traces in --out (gzipped)")
    a = ap.parse_args(argv)
    import torch

    with torch.inference_mode():  # the graphs' buffers are inference tensors
        return measure(ap, a)


def measure(ap: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    if a.tiny:
        a.target, a.device, a.dtype = a.target or "random:builtin:tiny-llama", "cpu", "float32"
        a.replays, a.reps, a.profile_steps = min(a.replays, 20), 1, min(a.profile_steps, 4)
        a.prompt_tokens, a.new_tokens, a.max_length = min(a.prompt_tokens, 100), min(a.new_tokens, 16), 512
    if not a.target and not a.random:
        ap.error("give --target (or --random / --tiny)")
    if a.prompt_tokens + a.new_tokens + 4 > a.max_length:
        ap.error(f"--prompt-tokens + --new-tokens + 4 must fit --max-length {a.max_length}")

    import torch
    import transformers

    from eagle3_ray.spec import StaticTarget, target_generate

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    keep = out if a.trace else None
    path = out / "decode_profile.json"
    model, dev = load_model(a)
    cuda = dev.type == "cuda"
    log(f"loaded {a.target or 'random SmolLM2-135M shape'} on {dev} ({next(model.parameters()).dtype})")

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    static = StaticTarget(model, aux_layers=[], max_length=a.max_length)
    text = model.config.get_text_config()
    P, N = a.prompt_tokens, a.new_tokens
    prompt = torch.randint(3, text.vocab_size, (P,), generator=torch.Generator().manual_seed(0)).to(dev)
    res: dict = {"command": " ".join([sys.executable, *sys.argv]), "torch": torch.__version__,
                 "transformers": transformers.__version__,
                 "device": torch.cuda.get_device_name(dev) if cuda else "cpu", "target": a.target or "random",
                 "dtype": str(next(model.parameters()).dtype), "attn_implementation": model.config._attn_implementation,
                 "layers": text.num_hidden_layers, "prompt_tokens": P, "new_tokens": N,
                 "max_length": a.max_length, "cuda_graphs": static.cuda_graphs, "spans": static.spans,
                 "errors": []}
    errors = res["errors"]
    # Decode forwards: width 1 at past = P .. P+N-2, i.e. n = past + 1 committed+new tokens.
    span_steps = Counter(static.span(n) for n in range(P + 1, P + N))
    res["decode_spans"] = dict(span_steps)

    # ---- a) target_generate ------------------------------------------------------------------
    gen = lambda n: target_generate(static, prompt, n, eos_token_id=[])  # noqa: E731
    gen(N)  # warm-up: kernels, allocator, the width-1 graph of every span the decode meets
    gen(1)
    full, one = [], []
    for _ in range(a.reps):
        toks, st = gen(N)
        assert len(toks) == N, f"EOS is off, yet {len(toks)} of {N} tokens"
        full.append(st)
        one.append(gen(1)[1])
    sec_n = statistics.median(s.seconds for s in full)
    sec_1 = statistics.median(s.seconds for s in one)
    decode_ms = 1000 * (sec_n - sec_1) / (N - 1)
    mid = full[len(full) // 2]
    res["a"] = {"ms_per_token": 1000 * sec_n / N, "tokens_per_s": N / sec_n, "seconds": [s.seconds for s in full],
                "one_token_seconds": [s.seconds for s in one], "decode_ms_per_step": decode_ms,
                "prefill_and_first_pick_ms": 1000 * sec_1,
                "parts_ms_per_token": {k: 1000 * v / N for k, v in mid.parts.items()}}
    log(f"a) target_generate: {res['a']['ms_per_token']:.3f} ms/token ({res['a']['tokens_per_s']:.0f} tok/s), "
        f"decode step {decode_ms:.3f} ms, prefill+first {1000 * sec_1:.2f} ms")
    write_json(path, res)

    def buffers(w: int, span: int):
        """(graph or None, inputs) of a width-w forward whose committed+new tokens end at the span's
        last decode position: the graph's own buffers on CUDA, the same tensors built here elsewhere."""
        past = min(span, P + N) - w
        graph = static._graph(w, span)
        if graph is not None:
            g, buf, _ = graph
        else:
            g, buf = None, {"ids": torch.zeros(w, dtype=torch.long, device=dev), "past": torch.tensor(0, device=dev),
                            "depth": torch.arange(w, device=dev),
                            "tree": torch.ones(w, w, dtype=torch.bool, device=dev).tril()}
        buf["ids"].copy_(prompt[:w])
        buf["past"].fill_(past)
        return g, buf

    # ---- b) bare replays ----------------------------------------------------------------------
    def bare(w: int, span: int) -> dict | None:
        g, _ = buffers(w, span)
        if g is None:
            return None
        for _ in range(10):
            g.replay()
        sync()
        t = time.perf_counter()
        for _ in range(a.replays):
            g.replay()
        issued = time.perf_counter() - t
        sync()
        total = time.perf_counter() - t
        ms, issue_ms = 1000 * total / a.replays, 1000 * issued / a.replays
        return {"ms_per_replay": ms, "issue_ms_per_replay": issue_ms, "launch_bound": issue_ms > 0.8 * ms}

    def sync_loop(span: int) -> dict | None:
        """replay + argmax + .item() per token, the next ids fed back on the device."""
        g, buf = buffers(1, span)
        if g is None:
            return None
        logits = static._graphs[1, span][2][0]
        past = int(buf["past"])
        times = []
        for _ in range(a.replays + 10):
            t = time.perf_counter()
            buf["past"].fill_(past)
            g.replay()
            nxt = logits[-1].argmax()[None]
            int(nxt[0])
            buf["ids"].copy_(nxt)
            times.append(time.perf_counter() - t)
        return {"ms_per_token": 1000 * statistics.median(times[10:])}

    res["b"] = {"width1": {}, "sync_loop": {}}
    for span in span_steps:
        res["b"]["width1"][str(span)] = bare(1, span)
        res["b"]["sync_loop"][str(span)] = sync_loop(span)
    if cuda:
        weighted = sum(c * res["b"]["width1"][str(s)]["ms_per_replay"] for s, c in span_steps.items()) / (N - 1)
        loop = sum(c * res["b"]["sync_loop"][str(s)]["ms_per_token"] for s, c in span_steps.items()) / (N - 1)
        res["b"]["weighted_ms_per_replay"], res["b"]["weighted_sync_loop_ms"] = weighted, loop
        log(f"b) bare replay width 1: {weighted:.3f} ms (by span: " + ", ".join(
            f"{s}: {v['ms_per_replay']:.3f}" for s, v in res["b"]["width1"].items()) +
            f"); replay+argmax+item loop {loop:.3f} ms")
    else:
        log("b) bare replay: n/a (CPU)")
    write_json(path, res)

    # ---- c) host part, per-token calls ----------------------------------------------------------
    S = a.profile_steps
    with Profiled(dev, "decode_1", keep) as short:
        gen(1)
    with Profiled(dev, f"decode_{S + 1}", keep) as long:
        gen(S + 1)
    res["c"] = {"host_ms_per_step": decode_ms - res["b"]["weighted_ms_per_replay"] if cuda else None,
                "profiled_steps": S,
                "per_token": soft(errors, "c) per-token counts", lambda: per_token_counts(long, short, S),
                                  {"runtime_calls": {}, "by_kind": {}, "aten_ops": float("nan"), "top_aten_ops": []}),
                "between_replays": soft(errors, "c) replay gaps", lambda: replay_gaps(long)) if cuda else None}
    pt = res["c"]["per_token"]
    log(f"c) per token: {pt['aten_ops']:.1f} aten ops; runtime calls " +
        (", ".join(f"{k} {v['count']:.1f}" for k, v in pt["by_kind"].items()) if cuda else "n/a (CPU)"))
    write_json(path, res)

    # ---- d/e) eager forward per width, and width 4's bare replay --------------------------------
    main_span = span_steps.most_common(1)[0][0]

    def eager(w: int) -> dict:
        _, buf = buffers(w, main_span)
        run = lambda: static._run(**buf, span=main_span)  # noqa: E731
        for _ in range(3):
            run()
        sync()
        issue, total = [], []
        for _ in range(20):
            t = time.perf_counter()
            run()
            issue.append(time.perf_counter() - t)
            sync()
            total.append(time.perf_counter() - t)
        with Profiled(dev, f"eager_w{w}", keep) as p:
            for _ in range(a.eager_calls):
                run()
        row = {"span": main_span, "wall_ms": 1000 * statistics.median(total),
               "host_issue_ms": 1000 * statistics.median(issue)}
        summary = (lambda: kernel_summary(p, a.eager_calls)) if cuda else (lambda: cpu_op_summary(p.prof, a.eager_calls))
        row.update(soft(errors, f"eager w={w} summary", summary, {}))
        row.update(cpu_ops=len(p.cat("cpu_op")) / a.eager_calls)
        return row

    res["d"] = {"width1": eager(1)}
    res["e"] = {"width4": {"span": main_span, "replay": bare(4, main_span)}}
    res["e"]["width4"]["eager"] = eager(4)
    for w, row in ((1, res["d"]["width1"]), (4, res["e"]["width4"]["eager"])):
        replay = res["b"]["width1"][str(main_span)] if w == 1 else res["e"]["width4"]["replay"]
        if cuda and replay and row.get("kernels"):
            row["replay_minus_kernels_us_per_kernel"] = (1000 * replay["ms_per_replay"] - row["kernel_gpu_us"] -
                                                         row["memcpy_memset_gpu_us"]) / (row["kernels"] + row["memcpy_memset"])
    res["elapsed_seconds"] = time.perf_counter() - T0
    if cuda and "kernels" in res["d"]["width1"]:
        b1 = res["b"]["weighted_ms_per_replay"]
        d1 = res["d"]["width1"]
        res["summary"] = {
            "decode_step_ms": decode_ms, "graph_gpu_ms": b1, "host_ms": decode_ms - b1,
            "host_share": (decode_ms - b1) / decode_ms, "kernels_per_step": d1["kernels"] + d1["memcpy_memset"],
            "kernel_gpu_ms": (d1["kernel_gpu_us"] + d1["memcpy_memset_gpu_us"]) / 1000,
            # the main span's replay beyond its kernels' own GPU time: the graph's inter-kernel gaps
            "graph_gaps_ms": res["b"]["width1"][str(main_span)]["ms_per_replay"]
            - (d1["kernel_gpu_us"] + d1["memcpy_memset_gpu_us"]) / 1000,
            "sglang_ms_per_token": a.sglang_ms, "gap_to_sglang_ms": res["a"]["ms_per_token"] - a.sglang_ms,
        }
    write_json(path, res)
    print_table(res, cuda)
    log(f"wrote {path}" + (f"; {len(errors)} analyses FAILED (see 'errors')" if errors else ""))
    return 1 if errors else 0


def print_table(res: dict, cuda: bool) -> None:
    na = "n/a (CPU)"

    def f(v, unit="ms", nd=3):
        return na if v is None else f"{v:.{nd}f} {unit}"

    a, b, c = res["a"], res["b"], res["c"]
    rows = [("a) ms/token, target_generate (bench's count)", f(a["ms_per_token"]) + f"  ({a['tokens_per_s']:.0f} tok/s)"),
            ("a) decode step alone", f(a["decode_ms_per_step"])),
            ("a) prefill + first pick", f(a["prefill_and_first_pick_ms"], nd=2))]
    for span, v in b["width1"].items():
        rows.append((f"b) bare replay w=1 span {span} ({res['decode_spans'][int(span)]} steps)",
                     na if v is None else f"{v['ms_per_replay']:.3f} ms (issue {v['issue_ms_per_replay']:.3f} ms"
                                          f"{', LAUNCH-BOUND' if v['launch_bound'] else ''})"))
    rows.append(("b) bare replay w=1, weighted", f(b.get("weighted_ms_per_replay"))))
    rows.append(("b) replay + argmax + .item() loop", f(b.get("weighted_sync_loop_ms"))))
    rows.append(("c) host part = a decode - b", f(c["host_ms_per_step"])))
    pt = c["per_token"]
    for kind, v in pt["by_kind"].items():
        rows.append((f"c) {kind} per token", f"{v['count']:.1f} ({v['host_us']:.0f} us host)" if cuda else na))
    rows.append(("c) aten ops per token (host)", f"{pt['aten_ops']:.1f}"))
    outside = pt.get("gpu_ops_outside_graph")
    rows.append(("c) GPU ops outside the graph per token", na if not cuda else "-" if outside is None else f"{outside:.1f}"))
    gaps = c["between_replays"]
    if gaps:
        for k in ("period_us", "launch_call_us", "host_gap_us", "sync_wait_us", "host_work_us",
                  "gpu_idle_between_graphs_us", "graph_gpu_span_us", "graph_kernels"):
            rows.append((f"c) between replays (profiled), {k}", "-" if gaps[k] is None else f"{gaps[k]:.1f}"))
    else:
        rows.append(("c) between replays", na if not cuda else "no graph launches seen"))
    for label, row, replay in (("d) w=1", res["d"]["width1"], None),
                               ("e) w=4", res["e"]["width4"]["eager"], res["e"]["width4"]["replay"])):
        if label.startswith("e"):
            rows.append((f"{label} bare replay span {res['e']['width4']['span']}",
                         na if replay is None else f"{replay['ms_per_replay']:.3f} ms"))
        rows.append((f"{label} eager forward wall / host issue",
                     f"{row['wall_ms']:.3f} / {row['host_issue_ms']:.3f} ms"))
        if cuda and "kernels" in row:
            rows.append((f"{label} kernels per forward (+ memcpy/memset)",
                         f"{row['kernels']:.0f} (+{row['memcpy_memset']:.0f}), {row['kernel_gpu_us']:.0f} us GPU"))
            if row.get("replay_minus_kernels_us_per_kernel") is not None:
                rows.append((f"{label} replay - kernel time, per kernel", f"{row['replay_minus_kernels_us_per_kernel']:.2f} us"))
        elif not cuda:
            rows.append((f"{label} kernels per forward", na))
            rows.append((f"{label} aten ops per forward", f"{row.get('aten_ops', float('nan')):.0f}"))
    width = max(len(r[0]) for r in rows)
    print()
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    for label, row in (("d) w=1", res["d"]["width1"]), ("e) w=4", res["e"]["width4"]["eager"])):
        print(f"\n{label} top 10 " + ("kernels (count, total us per forward)" if cuda else "aten ops (count, self CPU us)"))
        for t in row.get("top_kernels") or row.get("top_ops") or []:
            us = t.get("total_us", t.get("self_cpu_us"))
            print(f"  {us:9.1f} us  x{t['count']:<6.1f} {t['name'][:110]}")
    if pt.get("top_aten_ops"):
        print("\nc) aten ops per decode token (host)")
        for name, n in pt["top_aten_ops"]:
            print(f"  x{n:<6.1f} {name}")
    if "summary" in res:
        s = res["summary"]
        print(f"\nsummary: decode step {s['decode_step_ms']:.3f} ms = graph GPU {s['graph_gpu_ms']:.3f} ms "
              f"({s['kernels_per_step']:.0f} GPU ops, {s['kernel_gpu_ms']:.3f} ms of kernels) + host "
              f"{s['host_ms']:.3f} ms ({100 * s['host_share']:.0f}%); SGLang {s['sglang_ms_per_token']:.2f} ms/token")


if __name__ == "__main__":
    sys.exit(main())
