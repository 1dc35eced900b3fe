"""The SGLang engine on the lent H200 (SGLang 0.5.17): capture, throughput, generation, EAGLE-3 decoding.

Steps (run in the order given, each writes <out>/sglang_<step>.json, and a failing step is recorded
there with its traceback while the next ones still run):

  convert     SmolLM2-135M-Instruct GGUF -> HF safetensors dir (SGLang reads safetensors)
  capture     SGLangEngine(mode="capture") vs HFEngine on the same token ids: relative error per
              aux layer and for last_hidden (bf16), next to HF bf16 vs HF fp32 (the bf16 yardstick)
  make8b      a Llama-3.1-8B-shaped checkpoint with seeded random weights, saved for both engines
  throughput  8B shape, 2K-token samples: SGLangEngine.capture (features read back as the pipeline's
              bf16->uint16 blocks) vs sglang.Engine prefill with the same settings and no hook,
              and vs prefill with CUDA graphs on
  generate    self-distillation of the demo prompts, DistillActor (the generate stage's engine
              actor) with target.backend=sglang vs hf (the static batch generator)
  spec        SGLang EAGLE3 decoding with an exported drafter vs plain SGLang, and the project's
              HF chain decoding with the same drafter, on the same MT-bench / demo-eval turns

    python3 benchmarks/device/sglang_engine.py convert capture --target /tmp/smollm2 --out $OUT
    # on nvidia-h200-x2 (issue 17 item 8): tp 2 against tp 1 and HF on the same ids
    python3 benchmarks/device/sglang_engine.py make8b capture --target /dev/shm/llama8b --random-ids --seq 2048 \
        --samples 4 --no-fp32 --tp 2 --tag _tp2 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import torch

GGUF = Path("/tmp/SmolLM2-135M-Instruct.Q4_1.gguf")
LLAMA8B_SHAPE = Path(__file__).resolve().parents[2] / "eagle3_ray/resources/llama3.1-8b-shape.json"
ENV = {"attention_backend": "triton", "sampling_backend": "pytorch", "grammar_backend": "none"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def target_cfg(model: str, backend: str, **sglang_extra):
    from eagle3_ray.config import TargetConfig

    sg = {"extra_engine_kwargs": {**ENV, **sglang_extra.pop("extra", {})}, **sglang_extra}
    return TargetConfig(model=model, backend=backend, device="cuda", dtype="bfloat16",
                        sglang=sg if backend == "sglang" else {})


# --- convert / make8b ---------------------------------------------------------------------------------


def step_convert(a) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(a.smollm2)
    tok = AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)
    model = AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name, dtype=torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return {"dir": str(out), "files": sorted(p.name for p in out.iterdir())}


def step_make8b(a) -> dict:
    """Seeded random Llama-3.1-8B-shaped weights (bf16, std 0.02), saved with the SmolLM2 tokenizer."""
    import shutil

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = Path(a.llama8b)
    cfg = LlamaConfig(**json.loads(LLAMA8B_SHAPE.read_text()))
    torch.manual_seed(0)
    t = time.perf_counter()
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(a.smollm2).save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    return {"dir": str(out), "seconds": time.perf_counter() - t, "disk_free_gb": shutil.disk_usage(out).free / 2**30}


# --- capture ------------------------------------------------------------------------------------------


def demo_ids(model_dir: str, n: int) -> list[list[int]]:
    from eagle3_ray.data.chat import render_generation_prompt
    from eagle3_ray.data.sources import resolve_data_path
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    lines = resolve_data_path("builtin:demo_prompts").read_text().splitlines()
    prompts = [json.loads(x)["prompt"] for x in lines if x.strip()][:n]
    return [render_generation_prompt(tok, [{"role": "user", "content": p}]) for p in prompts]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want||_F / ||want||_F, in fp32."""
    got, want = got.float(), want.float()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def per_layer(got, want, hidden: int) -> dict[str, float]:
    """Worst relative error over samples, per aux layer and for last_hidden."""
    out: dict[str, float] = {}
    for g, w in zip(got, want):
        assert g.aux_hidden.shape == w.aux_hidden.shape, (g.aux_hidden.shape, w.aux_hidden.shape)
        for j, (ga, wa) in enumerate(zip(g.aux_hidden.split(hidden, -1), w.aux_hidden.split(hidden, -1))):
            out[f"aux{j}"] = max(out.get(f"aux{j}", 0.0), rel_err(ga, wa))
        out["last_hidden"] = max(out.get("last_hidden", 0.0), rel_err(g.last_hidden, w.last_hidden))
    return out


def step_capture(a) -> dict:
    from eagle3_ray.engines.hf import HFEngine
    from eagle3_ray.engines.sglang import SGLangEngine
    from eagle3_ray.engines.sglang_args import engine_kwargs

    model = a.target
    if a.random_ids:
        g = torch.Generator().manual_seed(0)
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        seqs = [torch.randint(0, vocab, (a.seq,), generator=g).tolist() for _ in range(a.samples)]
    else:
        seqs = demo_ids(model, a.samples)
    cfg = target_cfg(model, "sglang", mem_fraction_static=0.6).model_copy(update={"tp_size": a.tp})
    t = time.perf_counter()
    sgl = SGLangEngine(cfg, mode="capture")
    started = time.perf_counter() - t
    try:
        got = sgl.capture(seqs)
        info = sgl.info
    finally:
        sgl.close()
    tp1 = None
    if a.tp > 1:  # issue 17 item 8: the same ids captured by a tensor-parallel engine and by one GPU
        sgl1 = SGLangEngine(cfg.model_copy(update={"tp_size": 1}), mode="capture")
        try:
            tp1 = sgl1.capture(seqs)
        finally:
            sgl1.close()
    kwargs = engine_kwargs(cfg, "capture", info=info, capture_dir="/dev/shm/x")
    hf = HFEngine(target_cfg(model, "hf"), batch_tokens=16384)
    want = hf.capture(seqs)
    hf.close()
    want32 = None
    if not a.no_fp32:
        hf32 = HFEngine(target_cfg(model, "hf").model_copy(update={"dtype": "float32"}), batch_tokens=16384)
        want32 = hf32.capture(seqs)
        hf32.close()
    torch.cuda.empty_cache()
    return {
        "target": model, "tp_size": a.tp, "samples": len(seqs), "tokens": sum(map(len, seqs)),
        "aux_layers": info.aux_layers,
        "hidden_size": info.hidden_size, "sglang_start_s": started,
        "forward_hooks": [h["target_modules"] for h in kwargs["forward_hooks"]],
        "rel_err_sglang_vs_hf_bf16": per_layer(got, want, info.hidden_size),
        "rel_err_hf_bf16_vs_hf_fp32": per_layer(want, want32, info.hidden_size) if want32 else None,
        "rel_err_sglang_vs_hf_fp32": per_layer(got, want32, info.hidden_size) if want32 else None,
        "rel_err_tp_vs_tp1": per_layer(got, tp1, info.hidden_size) if tp1 else None,
    }


# --- throughput ---------------------------------------------------------------------------------------


def _batches(vocab: int, seq: int, per_batch: int, n: int) -> list[list[list[int]]]:
    g = torch.Generator().manual_seed(1)
    return [[torch.randint(0, vocab, (seq,), generator=g).tolist() for _ in range(per_batch)] for _ in range(n)]


def _rate(fn, batches) -> dict:
    """Tokens/s over every batch after the first (warm-up)."""
    fn(batches[0])
    t = time.perf_counter()
    for b in batches[1:]:
        fn(b)
    dt = time.perf_counter() - t
    tokens = sum(len(s) for b in batches[1:] for s in b)
    return {"tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt}


def _plain_prefill(model: str, batches, graphs: bool) -> dict:
    import sglang

    from eagle3_ray.engines.sglang_args import engine_kwargs

    cfg = target_cfg(model, "sglang", mem_fraction_static=0.6)
    kw = {**engine_kwargs(cfg, "generate"), "disable_radix_cache": True, "chunked_prefill_size": -1,
          "disable_cuda_graph": not graphs}
    t = time.perf_counter()
    engine = sglang.Engine(**kw)
    started = time.perf_counter() - t
    try:
        rate = _rate(lambda b: engine.generate(input_ids=b, sampling_params={"max_new_tokens": 1, "temperature": 0.0}),
                     batches)
    finally:
        engine.shutdown()
    torch.cuda.empty_cache()
    return {**rate, "start_s": started, "cuda_graphs": graphs}


def _capture_rate(model: str, batches) -> dict:
    from eagle3_ray.engines.sglang import SGLangEngine
    from eagle3_ray.features.record import bf16_to_uint16

    cfg = target_cfg(model, "sglang", mem_fraction_static=0.6)
    t = time.perf_counter()
    engine = SGLangEngine(cfg, mode="capture")
    started = time.perf_counter() - t

    def capture(b):
        for c in engine.capture(b):  # what CaptureUDF hands to Ray Data
            bf16_to_uint16(c.aux_hidden.to(torch.bfloat16))
            bf16_to_uint16(c.last_hidden.to(torch.bfloat16))

    try:
        rate = _rate(capture, batches)
    finally:
        engine.close()
    torch.cuda.empty_cache()
    return {**rate, "start_s": started}


def step_throughput(a) -> dict:
    vocab = json.loads((Path(a.target) / "config.json").read_text())["vocab_size"]
    batches = _batches(vocab, a.seq, a.per_batch, a.batches)
    res = {"target": a.target, "seq": a.seq, "per_batch": a.per_batch, "batches": a.batches}
    res["prefill_graphs_off"] = _plain_prefill(a.target, batches, graphs=False)
    log(f"prefill (graphs off): {res['prefill_graphs_off']}")
    res["capture"] = _capture_rate(a.target, batches)
    log(f"capture: {res['capture']}")
    res["extract_ratio"] = res["capture"]["tokens_per_s"] / res["prefill_graphs_off"]["tokens_per_s"]
    if a.with_graphs:
        res["prefill_graphs_on"] = _plain_prefill(a.target, batches, graphs=True)
        res["graphs_off_cost"] = 1 - res["prefill_graphs_off"]["tokens_per_s"] / res["prefill_graphs_on"]["tokens_per_s"]
        res["extract_ratio_vs_graphs_on"] = res["capture"]["tokens_per_s"] / res["prefill_graphs_on"]["tokens_per_s"]
    return res


# --- generate -----------------------------------------------------------------------------------------


def step_generate(a) -> dict:
    from eagle3_ray.config import GenerateConfig
    from eagle3_ray.data.sources import read_samples, resolve_data_path
    from eagle3_ray.extract.generate_stage import DistillActor

    samples = list(read_samples(resolve_data_path("builtin:demo_prompts"), "auto", a.prompts, None))
    gen = GenerateConfig(max_new_tokens=a.new_tokens, batch_size=a.gen_batch)
    res: dict = {"prompts": len(samples), "max_new_tokens": a.new_tokens, "batch_size": a.gen_batch}
    answers = {}
    for backend in ("sglang", "hf"):
        t = time.perf_counter()
        actor = DistillActor(target_cfg(a.target, backend, mem_fraction_static=0.5), 16384)
        started = time.perf_counter() - t
        part = Path(f"/tmp/distill-{backend}.jsonl")
        part.unlink(missing_ok=True)
        t = time.perf_counter()
        summary = actor.run(samples, str(part), gen)
        dt = time.perf_counter() - t
        actor.close()
        torch.cuda.empty_cache()
        rows = [json.loads(x) for x in part.read_text().splitlines() if x.strip()]
        answers[backend] = {r["id"]: r["conversations"][-1]["content"] for r in rows}  # data/distill.py layout
        res[backend] = {"start_s": started, "seconds": dt, "answers": len(rows), "answers_per_s": len(rows) / dt,
                        "summary": summary}
        log(f"generate {backend}: {res[backend]}")
    same = [sid for sid in answers["hf"] if answers["sglang"].get(sid) == answers["hf"][sid]]
    res["identical_answers"] = len(same) / max(1, len(answers["hf"]))
    res["sglang_vs_hf_answers_per_s"] = res["sglang"]["answers_per_s"] / res["hf"]["answers_per_s"]
    res["examples"] = {sid: {b: answers[b].get(sid, "")[:300] for b in answers} for sid in list(answers["hf"])[:3]}
    return res


# --- spec ---------------------------------------------------------------------------------------------


def step_spec(a) -> dict:
    from eagle3_ray.bench.prompts import load_prompt_sets
    from eagle3_ray.bench.runner import BenchActor
    from eagle3_ray.bench.sglang_bench import run_sglang_bench
    from eagle3_ray.config import BenchConfig, PipelineConfig

    res: dict = {"drafter": a.drafter}
    bench = BenchConfig(modes=["chain"], num_steps=a.num_steps, max_new_tokens=a.new_tokens, num_gpus=1)
    for name, path, n in (("mt_bench", a.mt_bench, a.mt_prompts), ("demo_eval", "builtin:demo_eval", None)):
        sets = load_prompt_sets(path, n)
        row: dict = {"prompts": sum(map(len, sets.values())), "turns": sum(len(p.turns) for ps in sets.values() for p in ps)}
        t = time.perf_counter()
        cfg = PipelineConfig(target=target_cfg(a.target, "sglang", mem_fraction_static=0.5,
                                               extra={"disable_cuda_graph": True} if a.no_graphs else
                                               {"cuda_graph_max_bs_decode": 1} if a.graph_bs1 else {}),
                             bench=bench)
        raw = run_sglang_bench(cfg, a.drafter, {cat: [p.turns for p in ps] for cat, ps in sets.items()}) \
            if "sglang" in a.spec_engines else None
        row["sglang"] = None if raw is None else {"tau": raw["eagle3"]["tau"], "tokens_per_s": raw["eagle3"]["tokens_per_s"],
                         "baseline_tokens_per_s": raw["baseline"]["tokens_per_s"], "speedup": raw["eagle3"]["speedup"],
                         "engine": raw["engine"], "seconds": time.perf_counter() - t,
                         "per_category_tau": {c: r["tau"] for c, r in raw["eagle3"]["per_category"].items()}}
        log(f"{name} sglang: {row['sglang']}")
        res[name] = row
        (Path(a.out) / f"sglang_spec{a.tag}.partial.json").write_text(json.dumps(res, indent=1, default=str))
        torch.cuda.empty_cache()
        if "hf" not in a.spec_engines:
            continue
        t = time.perf_counter()
        actor = BenchActor(target_cfg(a.target, "hf").model_dump(), a.drafter)
        hf = actor.run(sets, bench.model_dump())
        del actor
        torch.cuda.empty_cache()
        row["hf"] = {"tau": hf["tau"]["chain"], "tokens_per_s": hf["tokens_per_s"]["chain"],
                     "baseline_tokens_per_s": hf["baseline"]["tokens_per_s"], "speedup": hf["speedup"]["chain"],
                     "seconds": time.perf_counter() - t}
        if row["sglang"]:
            row["tau_diff_sglang_minus_hf"] = row["sglang"]["tau"] - row["hf"]["tau"]
        log(f"{name} hf: {row['hf']}")
        res[name] = row
    return res


STEPS = {"convert": step_convert, "make8b": step_make8b, "capture": step_capture, "throughput": step_throughput,
         "generate": step_generate, "spec": step_spec}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("steps", nargs="+", choices=list(STEPS))
    p.add_argument("--out", required=True)
    p.add_argument("--tag", default="", help="suffix of the result file names")
    p.add_argument("--target", default="/tmp/smollm2")
    p.add_argument("--smollm2", default="/tmp/smollm2")
    p.add_argument("--llama8b", default="/dev/shm/llama8b")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--random-ids", action="store_true")
    p.add_argument("--tp", type=int, default=1, help="capture: SGLang's tp_size; above 1 the same ids are also "
                   "captured at tp 1 and compared (rel_err_tp_vs_tp1)")
    p.add_argument("--no-fp32", action="store_true", help="skip the HF fp32 yardstick")
    p.add_argument("--per-batch", type=int, default=16)
    p.add_argument("--batches", type=int, default=6)
    p.add_argument("--with-graphs", action="store_true")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--gen-batch", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--drafter", default="/tmp/demo/drafter")
    p.add_argument("--mt-bench", default="mt_bench.jsonl")
    p.add_argument("--mt-prompts", type=int, default=16)
    p.add_argument("--num-steps", type=int, default=3)
    p.add_argument("--graph-bs1", action="store_true")
    p.add_argument("--no-graphs", action="store_true", help="CUDA graphs off in the spec benchmark's engines")
    p.add_argument("--spec-engines", default="sglang,hf")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in a.steps:
        log(f"step {name}")
        t = time.perf_counter()
        try:
            res = {"ok": True, **STEPS[name](a)}
        except Exception as e:  # recorded, and the next step still runs
            res = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            log(res["traceback"])
        res["step_seconds"] = time.perf_counter() - t
        (out / f"sglang_{name}{a.tag}.json").write_text(json.dumps(res, indent=1, default=str))
        log(f"step {name} done in {res['step_seconds']:.0f}s ok={res['ok']}")


if __name__ == "__main__":
    main()
