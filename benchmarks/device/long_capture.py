"""Capture of one long sample on one GPU: the HF engine and SGLang's, against a capture of its first tokens.

A Llama-3.1-8B-shaped target with random weights (eagle3_ray/resources/llama3.1-8b-shape.json, its window
raised to 131,072 tokens as Llama-3.1's; plain RoPE, no llama3 scaling: the weights are random, and each
engine is only compared with itself) and one sample of --seq random token ids (32,768). Parts, each in a
child process of its own (GPU memory freed between them; a crash or an out-of-memory costs only its part),
each writes <out>/long_capture_<part>.json, and <out>/long_capture.json gathers them:

  hf              HFEngine (bf16): rows of the long capture, its time, torch.cuda.max_memory_allocated over
                  it (and over the weights alone), then a capture of the first --prefix tokens (2,048) and
                  the error of the long capture's first --prefix rows against it.
  sglang          SGLangEngine(mode="capture") with the settings capture forces (chunked prefill off: the
                  whole sample in one forward): the same, with GPU memory read device-wide
                  (torch.cuda.mem_get_info, polled every 10 ms from this process: SGLang's scheduler is
                  another process) before the engine, after it started (weights + KV pool), and at the peak
                  of each capture call; SGLang's own limits (context_len, max_req_input_len, the KV pool);
                  and a sample of max_req_input_len tokens, which SGLang must refuse (not cut).
  sglang_chunked  the same engine with chunked prefill on (--chunk tokens per forward), which capture
                  refuses (engines/sglang_args.py CAPTURE_FORCED; swapped here in this process only): does
                  the capture of the long sample succeed, and do its rows agree; its memory, for the peak
                  that forcing chunked prefill off costs.

Errors per aux layer and for last_hidden: the Frobenius relative error (benchmarks/device/sglang_engine.py's
measure) and the largest element error over its row's largest magnitude; `bit_equal` when identical.

    source benchmarks/device/session.sh sgl3   # after its sgl1, sgl2 steps (SGLang 0.5.17, with pydantic)
    python3 benchmarks/device/long_capture.py --out $OUT --tokenizer runs/lc_tok
    # runs/lc_tok (git-ignored, carried): tokenizer.json, tokenizer_config.json, chat_template.jinja of the
    # converted SmolLM2 (eagle3_ray.engines.targets.smollm2_dir()); without it the GGUF (gg1, gg2) is needed
    python3 benchmarks/device/long_capture.py --out $OUT --tokenizer runs/lc_tok --parts hf   # HF only: needs
    # only pydantic's four wheels besides the image's packages
    python3 benchmarks/device/long_capture.py --out $OUT --parts hf --seq 65536     # how far HF goes
CPU check of the HF path (tiny random Llama, fp32, 4,096 tokens; tests/test_benchmark_scripts.py):
    python benchmarks/device/long_capture.py --tiny --out /tmp/lc
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("SGLANG_IS_FLASHINFER_AVAILABLE", "false")

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
RESOURCES = REPO / "eagle3_ray" / "resources"
ENV = {"attention_backend": "triton", "sampling_backend": "pytorch", "grammar_backend": "none"}
PARTS = ("hf", "sglang", "sglang_chunked")
WINDOW = 131072  # Llama-3.1's max_position_embeddings


def log(msg: str) -> None:
    print(f"[long_capture {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def target_dir(a) -> Path:
    """A config.json of the shape with a window that holds --seq tokens (SGLang's context_len is read from it)."""
    cfg = json.loads((RESOURCES / ("tiny-llama.json" if a.tiny else "llama3.1-8b-shape.json")).read_text())
    cfg["max_position_embeddings"] = max(cfg["max_position_embeddings"], WINDOW if not a.tiny else a.seq, a.seq + 64)
    d = Path(a.work) / ("tiny" if a.tiny else "llama8b")
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    if a.tokenizer:  # the HF engine loads a tokenizer: this one, instead of converting the SmolLM2 GGUF
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
            if (Path(a.tokenizer) / name).is_file():
                shutil.copy(Path(a.tokenizer) / name, d / name)
    return d


def sample_ids(a, vocab: int) -> list[int]:
    import torch

    return torch.randint(0, vocab, (a.seq,), generator=torch.Generator().manual_seed(a.seed)).tolist()


def prefix_error(long, short, n: int, hidden: int) -> dict:
    """The first n rows of the long capture against the short capture, per aux layer and last_hidden."""
    import torch

    out: dict = {}
    pairs = [(f"aux{j}", long.aux_hidden[:n, j * hidden:(j + 1) * hidden], short.aux_hidden[:, j * hidden:(j + 1) * hidden])
             for j in range(3)] + [("last_hidden", long.last_hidden[:n], short.last_hidden)]
    for name, got, want in pairs:
        assert got.shape == want.shape, (name, tuple(got.shape), tuple(want.shape))
        g, w = got.float(), want.float()
        scale = w.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        out[name] = {"rel_fro": ((g - w).norm() / w.norm().clamp_min(1e-30)).item(),
                     "max_rel_to_row": ((g - w).abs() / scale).max().item(), "bit_equal": torch.equal(got, want)}
    out["max_rel_fro"] = max(v["rel_fro"] for k, v in out.items() if isinstance(v, dict))
    out["max_rel_to_row"] = max(v["max_rel_to_row"] for k, v in out.items() if isinstance(v, dict))
    return out


def rows_of(cap, n: int, hidden: int) -> dict:
    return {"rows": int(cap.aux_hidden.shape[0]), "expected": n, "exact": tuple(cap.aux_hidden.shape) == (n, 3 * hidden)
            and tuple(cap.last_hidden.shape) == (n, hidden), "dtype": str(cap.aux_hidden.dtype).removeprefix("torch.")}


class DeviceMemory:
    """Device-wide used bytes (torch.cuda.mem_get_info), polled on a thread: the peak over a block."""

    def __init__(self, every_s: float = 0.01):
        import torch

        self.torch, self.every_s = torch, every_s
        self.total = torch.cuda.mem_get_info()[1]

    def used(self) -> int:
        free, total = self.torch.cuda.mem_get_info()
        return total - free

    def peak_of(self, fn):
        peak, stop = [self.used()], threading.Event()

        def poll():
            while not stop.is_set():
                peak[0] = max(peak[0], self.used())
                time.sleep(self.every_s)

        t = threading.Thread(target=poll, daemon=True)
        t.start()
        try:
            result = fn()
        finally:
            stop.set()
            t.join()
        return result, max(peak[0], self.used())


def _timed(fn, cuda: bool):
    import torch

    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


GB = 2**30


# --- parts ----------------------------------------------------------------------------------------


def part_hf(a) -> dict:
    import torch

    from eagle3_ray.config import TargetConfig
    from eagle3_ray.engines.hf import HFEngine

    cuda = not a.tiny
    device = "cuda" if cuda else "cpu"
    cfg = TargetConfig(model=f"random:{target_dir(a)}", seed=0, dtype="float32" if a.tiny else "bfloat16", device=device)
    t = time.perf_counter()
    eng = HFEngine(cfg, batch_tokens=a.seq, device=device)
    built = time.perf_counter() - t
    h = eng.info.hidden_size
    ids = sample_ids(a, eng.info.vocab_size)
    try:
        eng.capture([ids[:256]])  # first-call costs (kernels, allocator) out of the timings
        res: dict = {"engine": "hf", "device": device, "dtype": eng.info.dtype, "build_s": built,
                     "aux_layers": eng.info.aux_layers, "hidden_size": h}
        if cuda:
            torch.cuda.synchronize()
            res["weights_gb"] = torch.cuda.memory_allocated() / GB
            torch.cuda.reset_peak_memory_stats()
        (long,), dt = _timed(lambda: eng.capture([ids]), cuda)
        res["long"] = {**rows_of(long, a.seq, h), "seconds": dt, "tokens_per_s": a.seq / dt}
        if cuda:
            res["long"]["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / GB
            res["long"]["peak_over_weights_gb"] = res["long"]["peak_allocated_gb"] - res["weights_gb"]
            torch.cuda.reset_peak_memory_stats()
        (short,), dt = _timed(lambda: eng.capture([ids[:a.prefix]]), cuda)
        res["prefix"] = {**rows_of(short, a.prefix, h), "seconds": dt}
        if cuda:
            res["prefix"]["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / GB
        res["prefix_error"] = prefix_error(long, short, a.prefix, h)
    finally:
        eng.close()
    return res


def _sglang_limits(eng) -> dict:
    """SGLang's own limits for this engine (read from its tokenizer manager; None where absent)."""
    inner = getattr(eng, "_engine", None)
    tm = getattr(inner, "tokenizer_manager", None)
    out = {"context_len": getattr(tm, "context_len", None), "max_req_input_len": getattr(tm, "max_req_input_len", None)}
    # Read directly, not through Engine.get_server_info: that runs the engine's event loop, which is
    # already running in the product's engine ("this event loop is already running", 2026-12-07)
    try:
        args = vars(inner.server_args)
        infos = getattr(getattr(inner, "_scheduler_init_result", None), "scheduler_infos", None) or [{}]
        info = {**args, **infos[0]}
        out.update({k: info.get(k) for k in ("max_total_num_tokens", "max_prefill_tokens", "chunked_prefill_size",
                                             "mem_fraction_static", "context_length")})
    except Exception as e:  # noqa: BLE001  (a version without these attributes)
        out["server_info_error"] = repr(e)[:300]
    return out


def part_sglang(a, chunk: int | None = None) -> dict:
    from eagle3_ray.config import TargetConfig
    from eagle3_ray.engines import sglang_args
    from eagle3_ray.engines.sglang import SGLangEngine

    mem = DeviceMemory()
    sg = {"extra_engine_kwargs": dict(ENV), "capture_dir": "/dev/shm"}
    if a.mem_fraction is not None:
        sg["mem_fraction_static"] = a.mem_fraction
    if a.max_prefill_tokens is not None:
        sg["extra_engine_kwargs"]["max_prefill_tokens"] = a.max_prefill_tokens
    cfg = TargetConfig(model=f"random:{target_dir(a)}", backend="sglang", dtype="bfloat16", device="cuda", sglang=sg)
    forced = sglang_args.CAPTURE_FORCED["chunked_prefill_size"]
    if chunk:  # a probe: capture refuses chunked prefill; this process only, restored below
        sglang_args.CAPTURE_FORCED["chunked_prefill_size"] = (chunk, "benchmark probe")
    res: dict = {"engine": "sglang", "chunked_prefill_size": chunk or -1, "used_before_engine_gb": mem.used() / GB,
                 "total_gb": mem.total / GB}
    try:
        t = time.perf_counter()
        eng = SGLangEngine(cfg, mode="capture")
        res["start_s"] = time.perf_counter() - t
    finally:
        sglang_args.CAPTURE_FORCED["chunked_prefill_size"] = forced
    h = eng.info.hidden_size
    ids = sample_ids(a, eng.info.vocab_size)
    try:
        res["limits"] = _sglang_limits(eng)
        eng.capture([ids[:256]])
        res["used_after_start_gb"] = mem.used() / GB  # weights + KV pool + both processes' contexts
        t = time.perf_counter()
        try:
            (long,), peak = mem.peak_of(lambda: eng.capture([ids]))
            dt = time.perf_counter() - t
            res["long"] = {**rows_of(long, a.seq, h), "seconds": dt, "tokens_per_s": a.seq / dt}
        except Exception as e:  # noqa: BLE001  (chunked: the capture's row check; or out of memory)
            long, peak = None, mem.used()
            res["long"] = {"error": f"{type(e).__name__}: {e}"[:2000], "seconds": time.perf_counter() - t}
        res["long"]["peak_used_gb"] = peak / GB
        res["long"]["peak_over_started_gb"] = peak / GB - res["used_after_start_gb"]
        t = time.perf_counter()
        (short,), peak = mem.peak_of(lambda: eng.capture([ids[:a.prefix]]))
        res["prefix"] = {**rows_of(short, a.prefix, h), "seconds": time.perf_counter() - t,
                         "peak_over_started_gb": peak / GB - res["used_after_start_gb"]}
        if long is not None:
            res["prefix_error"] = prefix_error(long, short, a.prefix, h)
        limit = res["limits"].get("max_req_input_len")
        if not chunk and limit:  # SGLang refuses an input of max_req_input_len tokens: refused, or cut?
            t = time.perf_counter()
            try:
                (cut,) = eng.capture([ids[:1] * limit])
                res["at_limit"] = {"tokens": limit, "refused": False, "rows": int(cut.aux_hidden.shape[0])}
            except Exception as e:  # noqa: BLE001
                res["at_limit"] = {"tokens": limit, "refused": True, "error": f"{type(e).__name__}: {e}"[:600]}
            res["at_limit"]["seconds"] = time.perf_counter() - t
        res["capture_seconds"] = dict(eng.capture_seconds)
    finally:
        eng.close()
    return res


RUNNERS = {"hf": part_hf, "sglang": part_sglang, "sglang_chunked": lambda a: part_sglang(a, chunk=a.chunk)}


def run_part(a, part: str) -> dict:
    t = time.perf_counter()
    try:
        res = RUNNERS[part](a)
    except Exception as e:  # noqa: BLE001  (recorded; the next part still runs)
        res = {"error": f"{type(e).__name__}: {e}"[:3000], "traceback": traceback.format_exc()[-6000:]}
    res["part"], res["wall_s"] = part, time.perf_counter() - t
    return res


def summary(results: dict, a) -> dict:
    out = {"seq": a.seq, "prefix": a.prefix}
    for part, r in results.items():
        long = r.get("long") or {}
        out[part] = {"rows_exact": long.get("exact"), "seconds": long.get("seconds"),
                     "prefix_max_rel_fro": (r.get("prefix_error") or {}).get("max_rel_fro"),
                     "peak_gb": long.get("peak_allocated_gb", long.get("peak_used_gb")),
                     "peak_over_gb": long.get("peak_over_weights_gb", long.get("peak_over_started_gb")),
                     "error": r.get("error") or long.get("error")}
    if "sglang" in results and "sglang_chunked" in results:
        off, on = results["sglang"].get("long") or {}, results["sglang_chunked"].get("long") or {}
        if "peak_over_started_gb" in off and "peak_over_started_gb" in on:
            out["chunked_prefill_off_costs_gb"] = off["peak_over_started_gb"] - on["peak_over_started_gb"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory: long_capture.json (+ one file per part)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, in this order; of {PARTS}")
    p.add_argument("--seq", type=int, default=None, help="tokens of the long sample (default 32768; --tiny 4096)")
    p.add_argument("--prefix", type=int, default=2048, help="tokens of the separate short capture")
    p.add_argument("--chunk", type=int, default=8192, help="sglang_chunked: chunked_prefill_size")
    p.add_argument("--mem-fraction", type=float, default=None, help="target.sglang.mem_fraction_static (default SGLang's)")
    p.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="SGLang max_prefill_tokens (with chunked prefill off it sizes SGLang's activation reserve)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default="/tmp/long_capture", help="where the target's config.json is written")
    p.add_argument("--tokenizer", default=None, help="a directory with tokenizer.json (e.g. SmolLM2's converted dir), "
                   "copied beside the config; default: the SmolLM2 tokenizer from its GGUF (EAGLE3_RAY_SMOLLM2_GGUF)")
    p.add_argument("--part-timeout", type=float, default=480, help="seconds per part (its child process)")
    p.add_argument("--tiny", action="store_true", help="CPU check: tiny random Llama, fp32, HF only, in-process")
    p.add_argument("--part", help=argparse.SUPPRESS)  # internal: run one part in this process
    a = p.parse_args(argv)
    a.seq = a.seq or (4096 if a.tiny else 32768)
    if not 0 < a.prefix < a.seq:
        p.error(f"--prefix must lie in (0, --seq={a.seq}), got {a.prefix}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = ["hf"] if a.tiny else [x for x in a.parts.split(",") if x]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        p.error(f"unknown parts {unknown}; use {PARTS}")
    if a.part:  # the child: one part, its JSON
        res = run_part(a, a.part)
        (out / f"long_capture_{a.part}.json").write_text(json.dumps(res, indent=1, default=str))
        return 0
    results = {}
    for part in parts:
        log(f"part {part}")
        if a.tiny:
            results[part] = run_part(a, part)
            continue
        args = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--part", part]
        try:
            rc = subprocess.run(args, timeout=a.part_timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        f = out / f"long_capture_{part}.json"
        results[part] = json.loads(f.read_text()) if f.is_file() else {"part": part, "error": f"child exited {rc}"}
        log(f"part {part}: {json.dumps(summary({part: results[part]}, a)[part])}")
    report = {"command": " ".join(["python3", *sys.argv]), "seq": a.seq, "prefix": a.prefix, "tiny": a.tiny,
              "target": "tiny-llama" if a.tiny else "llama3.1-8b-shape (random weights, window 131072)",
              "summary": summary(results, a), "parts": results}
    (out / "long_capture.json").write_text(json.dumps(report, indent=1, default=str))
    log(json.dumps(report["summary"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
