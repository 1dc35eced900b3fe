"""The SGLang engine on the H200, second call (issue 17 remainder, issue 24 item 3), SGLang 0.5.17.

One call, parts run in order, each in its own child process (a hung or crashed part costs only its
own time; GPU memory is freed between parts) under what is left of --budget-s; each part writes
$OUT/sglang2_<part>.json when it ends, and $OUT/sglang2_summary.json is rewritten after every part
with the keys sglang_extract_ratio, sglang_generate_vs_hf, deepseek_capture_max_rel_err,
sglang_kill_every_sample_once.

  a  throughput  Llama-3.1-8B shape (dummy weights), 16 x 2048-token samples per call: sglang.Engine
                 prefill with the capture settings and no hook, then SGLangEngine.capture (hooks, the
                 writer threads, the mapped files, the bf16 views CaptureWriteUDF takes) with --min-callers
                 .. --max-callers concurrent callers (3: CaptureWriteUDF's default on a GPU actor), once per
                 --writers count (the hook's writer threads), with the writers' account of each measurement
                 (seconds per batch: in the forward's thread, blocked on a full queue, waiting for the copy,
                 writing) and the callers' (seconds per call: waiting for a call slot, inside SGLang,
                 collecting the files, and the engine idle with no call of ours inside), once per
                 --call-limits value (target.sglang.max_concurrent_calls). SGLang's own prefill is
                 timed two ways: one call per batch, and every timed prompt in one call;
                 sglang_extract_ratio is capture at the product's defaults in steady state (calls
                 ending after the first one's end, over the time between the ends: one pipeline
                 latency left out) over the better of the two; ratio_whole_run_* keep fill and drain.
  d  deepseek    a 6-layer DeepSeek-V3/Kimi-shaped target (MLA + MoE, seeded random bf16 weights saved
                 once): SGLangEngine capture (0.5.17: layer hooks) vs HFEngine on the same ids: relative
                 error per aux layer and last_hidden, and which HF hidden_states index each captured
                 slot matches best (must be target.aux_layers).
  b  kill        `eagle3-ray extract` (target.backend=sglang, Ray, SmolLM2 real weights, 1-sample
                 batches) while a watcher SIGKILLs the SGLang scheduler after the first committed shard:
                 the store must end with every prepared sample exactly once; whether the engine
                 restarted inside its actor (same parent pid) or Ray restarted the actor.
  c  generate    self-distillation of the demo prompts, DistillActor with target.backend=sglang vs hf
                 (the static batch generator), answers/s.
  e  plain       batch-1 plain (greedy, no drafter) decoding of the same MT-bench turns, SmolLM2 real
                 weights: SGLang with CUDA graphs on (replayed turn by turn as the bench replays them)
                 vs the product's CUDA-graphed StaticTarget baseline (BenchActor, bench.modes=[]):
                 tokens/s of each and sglang_plain_vs_graphed_plain = SGLang / ours. Multiplied by a
                 run's spec_vs_graphed_* this gives spec_vs_sglang_plain.

The SmolLM2 GGUF is converted (and part b's data prepared) in a background process at the start.

    source benchmarks/device/session.sh sgl3   # after its base, gg1, gg2, sgl1, sgl2 steps
    PYTHONUNBUFFERED=1 python3 benchmarks/device/sglang_capture.py --out $OUT --budget-s 330
CPU check of the script's own paths (no SGLang engine; fakes where named):
    python benchmarks/device/sglang_capture.py --out /tmp/s2 --cpu
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("SGLANG_IS_FLASHINFER_AVAILABLE", "false")

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # benchmarks.device.sglang_capture_probe, which SGLang's schedulers import too
sys.path.insert(0, str(REPO / "benchmarks" / "device"))
from sglang_engine import per_layer, rel_err  # noqa: E402  (the first call's error measures)
GGUF = Path("/tmp/SmolLM2-135M-Instruct.Q4_1.gguf")
SMOLLM2 = Path("/tmp/smollm2")
WORK = Path("/tmp/sglang2")
LLAMA8B_SHAPE = REPO / "eagle3_ray/resources/llama3.1-8b-shape.json"
ENV = {"attention_backend": "triton", "sampling_backend": "pytorch", "grammar_backend": "none"}
DEEPSEEK_TINY = dict(
    hidden_size=1024, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=384,
    kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=16,
    num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1, moe_intermediate_size=256,
    moe_layer_freq=1,  # SGLang's DeepseekV2DecoderLayer reads it; transformers' config does not define it
    topk_method="noaux_tc", scoring_func="sigmoid",  # SGLang's MoEGate reads them (V3's router); HF's V3 is that router
    intermediate_size=2048, n_group=1, topk_group=1, routed_scaling_factor=2.5, vocab_size=8192,
    max_position_embeddings=4096, rope_scaling=None, tie_word_embeddings=False,
)
DEEPSEEK_AUX = [2, 3, 4]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def target_cfg(model: str, backend: str, cpu: bool = False, **sglang):
    from eagle3_ray.config import TargetConfig

    sg = {"extra_engine_kwargs": dict(ENV), **sglang}
    return TargetConfig(model=model, backend=backend, device="cpu" if cpu else "cuda",
                        dtype="float32" if cpu else "bfloat16", sglang=sg if backend == "sglang" else {})


def fake_factory():
    """--cpu only: the FAKE sglang.Engine of tests/sglang_contract/test_restart.py (the real one needs CUDA)."""
    sys.path.insert(0, str(REPO / "tests" / "sglang_contract"))
    sys.path.insert(0, str(REPO / "tests" / "sglang_contract" / "fakes"))  # SGLang 0.5.17 imports torchvision
    from test_restart import FakeSGLangEngine

    return lambda **kw: FakeSGLangEngine(delay=0.0, **kw)


# --- background: GGUF -> HF dir, part b's conversations prepared ---------------------------------------


def prep(a) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (SMOLLM2 / "config.json").is_file():
        if a.cpu:
            from eagle3_ray.engines.targets import resolve_target

            src = resolve_target("smollm2").model_path  # the embedded GGUF, converted by the project
            tok, model = AutoTokenizer.from_pretrained(src), AutoModelForCausalLM.from_pretrained(src)
        else:
            tok = AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)
            model = AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name, dtype=torch.bfloat16)
        model.save_pretrained(SMOLLM2)
        tok.save_pretrained(SMOLLM2)
    log(f"smollm2 at {SMOLLM2}")
    # Part b's data: the demo prompts with synthetic answers, several variants each (distinct samples).
    from eagle3_ray.data.sources import resolve_data_path

    prompts = [json.loads(x)["prompt"] for x in resolve_data_path("builtin:demo_prompts").read_text().splitlines()
               if x.strip()][: 40 if a.cpu else None]
    convs = WORK / "kill_convs.jsonl"
    WORK.mkdir(parents=True, exist_ok=True)
    with open(convs, "w") as f:
        for v in range(a.kill_variants):
            for i, p in enumerate(prompts):
                answer = f"Variant {v}. " + " ".join([p] * (2 + (i + v) % 4))
                f.write(json.dumps({"id": f"k{v}-{i}", "conversations": [
                    {"role": "user", "content": p}, {"role": "assistant", "content": answer}]}) + "\n")
    rc = run_cli(["prepare", "-c", "configs/demo-smollm2.yaml", "--data", str(convs), "--out",
                  str(WORK / "kill_prep"), f"target.model={SMOLLM2}"], WORK / "prepare.log")
    if rc:
        raise RuntimeError(f"eagle3-ray prepare failed (rc {rc}): {(WORK / 'prepare.log').read_text()[-2000:]}")
    log("part b data prepared")
    return {"prepare_rc": rc}


def run_cli(args: list[str], logfile: Path, timeout: float | None = None) -> int:
    with open(logfile, "w") as f:
        return subprocess.run([sys.executable, "-m", "eagle3_ray.cli", *args], cwd=REPO, stdout=f,
                              stderr=subprocess.STDOUT, timeout=timeout).returncode


# --- a: capture throughput ---------------------------------------------------------------------------


def _batches(vocab: int, seq: int, per_batch: int, n: int):
    import torch

    g = torch.Generator().manual_seed(1)
    return [[torch.randint(0, vocab, (seq,), generator=g).tolist() for _ in range(per_batch)] for _ in range(n)]


def _rate(fn, batches, threads: int = 1) -> dict:
    """Tokens/s over every batch after the first, ``threads`` calls in flight, two ways:
    ``tokens_per_s`` from the first timed call's start to the last one's end (the pipeline's fill and
    drain included: the last call's file write and read are not hidden behind any forward), and
    ``steady_tokens_per_s``, the tokens of the calls that ended after the first one ended, over the
    time between those two ends (the steady state: one pipeline latency left out, which a run of
    thousands of batches pays once). ``ends_s``: when each timed call ended. Untimed warm-up: the
    first batch ``threads`` times at once, so the host buffers those calls need (pinned blocks in the
    scheduler process) exist before the timing, whichever measurement comes first on an engine."""
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(fn, [batches[0]] * threads))
    ends: list[tuple[float, int]] = []
    lock = threading.Lock()

    def timed(b):
        fn(b)
        now = time.perf_counter()
        with lock:
            ends.append((now, sum(len(s) for s in b)))

    t = time.perf_counter()
    if threads == 1:
        for b in batches[1:]:
            timed(b)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(timed, batches[1:]))
    dt = time.perf_counter() - t
    tokens = sum(len(s) for b in batches[1:] for s in b)
    ends.sort()
    steady = (sum(n for _, n in ends[1:]) / (ends[-1][0] - ends[0][0])) if len(ends) >= 3 else None
    return {"tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt, "steady_tokens_per_s": steady,
            "threads": threads, "ends_s": [round(e - t, 3) for e, _ in ends]}


def _steady(r: dict) -> float:
    """A measurement's steady-state tokens/s (its whole-run figure where it had too few calls)."""
    return r.get("steady_tokens_per_s") or r["tokens_per_s"]


def _save_partial(a, res: dict) -> None:
    """Part a's figures so far, kept should the part be killed at its time limit (a hung engine)."""
    (Path(a.out) / "sglang2_throughput.partial.json").write_text(json.dumps(res, indent=1, default=str))


def part_a(a) -> dict:
    import torch

    from eagle3_ray.engines.sglang import SGLangEngine
    from eagle3_ray.engines.sglang_args import engine_kwargs
    from benchmarks.device.sglang_capture_probe import probe_hooks, read_writer_stats
    from eagle3_ray.engines.sglang_hooks import DEFAULT_WRITERS, WRITERS_ENV
    from eagle3_ray.extract.pipeline import GPU_CONCURRENT_BATCHES
    from eagle3_ray.features.record import bf16_to_uint16

    shape = WORK / "llama8b-shape"
    shape.mkdir(parents=True, exist_ok=True)
    cfg_json = json.loads(LLAMA8B_SHAPE.read_text())
    if a.cpu:  # a tiny Llama: the same code path
        cfg_json = json.loads((REPO / "eagle3_ray/resources/tiny-llama.json").read_text())
        cfg_json["hidden_size"] = 64
    (shape / "config.json").write_text(json.dumps(cfg_json))
    model = f"random:{shape}"
    seq, per_batch = (a.seq, a.per_batch) if not a.cpu else (64, 4)
    batches = _batches(cfg_json["vocab_size"], seq, per_batch, a.batches)
    cfg = target_cfg(model, "sglang", cpu=a.cpu, mem_fraction_static=0.6)
    res: dict = {"target": "Llama-3.1-8B shape, dummy weights" if not a.cpu else "tiny (cpu check)",
                 "seq": seq, "per_batch": per_batch, "batches": a.batches}
    factory = fake_factory() if a.cpu else None

    def prefill_rates(kw: dict) -> tuple[dict, dict]:
        """sglang.Engine(**kw) on the batches, no SGLangEngine: one call per batch, one at a time (the
        baseline of the runs up to 2026-12-04), and every timed prompt in one call (SGLang's best for these prompts: its
        scheduler fills every forward and never waits for a call)."""
        t = time.perf_counter()
        if a.cpu:
            engine = factory(**{"forward_hooks": [], **kw})
        else:
            import sglang

            engine = sglang.Engine(**kw)
        start = time.perf_counter() - t

        def generate(b):
            return engine.generate(input_ids=b, sampling_params=[{"max_new_tokens": 1, "temperature": 0.0}] * len(b),
                                   rid=[f"p{time.monotonic_ns()}-{i}" for i in range(len(b))])

        try:
            per_call = _rate(generate, batches)
            one_call = _rate(generate, [batches[0], [s for b in batches[1:] for s in b]])
        finally:
            engine.shutdown()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        return {**per_call, "start_s": start}, one_call

    # SGLang's own prefill: the capture settings (radix cache off, chunked prefill off, graphs off), no hook.
    kw = {**engine_kwargs(cfg, "generate"), "disable_radix_cache": True, "chunked_prefill_size": -1,
          "disable_cuda_graph": True}
    res["prefill"], res["prefill_one_call"] = prefill_rates(kw)
    log(f"prefill: {res['prefill']}; all prompts in one call: {res['prefill_one_call']}")
    _save_partial(a, res)
    # The same with the capture hook cut short (--probes; benchmarks/device/sglang_capture_probe.py),
    # files in a scratch dir: where between SGLang's forward and the files the capture's cost lies.
    for probe in [p for p in a.probes.split(",") if p]:
        scratch = Path(tempfile.mkdtemp(prefix="probe_", dir=cfg.sglang.capture_dir))
        kw = engine_kwargs(cfg, "capture", capture_dir=scratch)
        kw["forward_hooks"] = probe_hooks(kw["forward_hooks"], probe)
        res[f"prefill_probe_{probe}"], res[f"prefill_one_call_probe_{probe}"] = prefill_rates(kw)
        shutil.rmtree(scratch, ignore_errors=True)
        log(f"prefill, hook probe {probe}: {res[f'prefill_probe_{probe}']}; one call: {res[f'prefill_one_call_probe_{probe}']}")
        _save_partial(a, res)

    # SGLang's prefill figures: one call per batch, in steady state, and all prompts in one call (one
    # timed call: its whole-run figure); `best` is the better of the two.
    p = _steady(res["prefill"])
    best = max(p, _steady(res["prefill_one_call"]))
    # One capture engine per writer-thread count of the hook (EAGLE3_RAY_CAPTURE_WRITERS, inherited by
    # SGLang's scheduler processes) and per target.sglang.max_concurrent_calls; keys of the defaults
    # (1 writer, no call bound) carry no suffix.
    for writers, limit in [(int(w), int(c)) for w in a.writers.split(",") for c in a.call_limits.split(",")]:
        os.environ[WRITERS_ENV] = str(writers)
        sfx = ("" if writers == DEFAULT_WRITERS else f"_{writers}_writers") + ("" if limit == 0 else f"_{limit}_in_flight")
        t = time.perf_counter()
        try:
            engine = SGLangEngine(cfg.model_copy(update={"sglang": cfg.sglang.model_copy(update={"max_concurrent_calls": limit})}),
                                  mode="capture", engine_factory=factory)
        except Exception:  # recorded; the figures so far stay, and the next engine is tried
            res[f"capture_error{sfx}"] = traceback.format_exc()
            log(res[f"capture_error{sfx}"])
            continue
        start = time.perf_counter() - t

        def capture(b):
            # What CaptureWriteUDF hands on to the store writer, each capture's bytes read once (as the
            # writer does): the engine maps the hook's files, so nothing is read until something touches it.
            for c in engine.capture(b):
                bf16_to_uint16(c.aux_hidden.to(torch.bfloat16)).copy()
                bf16_to_uint16(c.last_hidden.to(torch.bfloat16)).copy()

        try:
            for n in range(a.min_callers, a.max_callers + 1):
                key = f"capture_{n}_caller{'s' if n > 1 else ''}{sfx}"
                before = read_writer_stats(engine._dir) or {}
                calls_before = dict(engine.capture_seconds)
                res[key] = {**_rate(capture, batches, threads=n), "start_s": start}
                # where the capture calls spent their time: seconds per call (SGLangEngine.capture_seconds)
                calls = {k: engine.capture_seconds[k] - calls_before[k] for k in calls_before}
                res[key]["engine"] = {k: v / max(calls["calls"], 1) for k, v in calls.items()
                                      if k not in ("calls", "max_in_flight")} | {
                    "calls": calls["calls"], "max_in_flight": engine.capture_seconds["max_in_flight"]}
                # where the hook's time went over this measurement (warm-up batch included): seconds per batch
                after = read_writer_stats(engine._dir) or {}
                done = after.get("batches", 0) - before.get("batches", 0)
                res[key]["writer"] = {k: (after[k] - before.get(k, 0)) / max(done, 1) for k in
                                      ("hook_s", "put_blocked_s", "copy_wait_s", "write_s")} | {
                                          "batches": done, "writers": after.get("writers")}
                tag = f"{n}_caller{'s' if n > 1 else ''}{sfx}"
                # steady state over steady state (the figure), and the whole-run figure (fill and
                # drain included) over the better prefill figure
                res[f"ratio_{tag}"] = _steady(res[key]) / p
                res[f"ratio_best_{tag}"] = _steady(res[key]) / best
                res[f"ratio_whole_run_{tag}"] = res[key]["tokens_per_s"] / best
                log(f"capture, {n} callers, {writers} writer threads, call limit {limit}: {res[key]}")
                _save_partial(a, res)
            res[f"restarts{sfx}"] = engine.restarts
        except Exception:
            res[f"capture_error{sfx}"] = traceback.format_exc()
            log(res[f"capture_error{sfx}"])
        finally:
            engine.close()
    os.environ.pop(WRITERS_ENV, None)
    # The product's capture runs extract.concurrent_batches calls at once (GPU_CONCURRENT_BATCHES on a GPU
    # actor unless set): the ratio reported is the one at the product's defaults in steady state, against
    # the better of SGLang's two prefill figures; the others say what the settings buy.
    res["sglang_extract_ratio"] = res.get(f"ratio_best_{GPU_CONCURRENT_BATCHES}_callers")
    return res


# --- d: DeepSeek-shaped capture ----------------------------------------------------------------------


def word_tokenizer(vocab: int):
    """A word-level tokenizer over ``vocab`` ids (t0 .. t<vocab-1>; t2 is EOS and pad): the random
    target needs one for the HF engine, and none of its text is read."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t2", pad_token="t2", unk_token="t0")


def part_d(a) -> dict:
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from eagle3_ray.engines.aux_layers import translate_aux_ids
    from eagle3_ray.engines.hf import HFEngine
    from eagle3_ray.engines.sglang import SGLangEngine
    from eagle3_ray.engines.sglang_args import engine_kwargs

    dims = dict(DEEPSEEK_TINY)
    if a.cpu:
        dims.update(hidden_size=256, q_lora_rank=128, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32,
                    v_head_dim=32, num_attention_heads=4, num_key_value_heads=4, intermediate_size=512,
                    moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2, vocab_size=1024)
    import hashlib  # one directory per config: a saved model is reused only for the same dims

    out = WORK / f"deepseek-tiny-{hashlib.sha1(json.dumps(dims, sort_keys=True).encode()).hexdigest()[:10]}"
    if not (out / "config.json").is_file():
        torch.manual_seed(0)
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**dims)).to(torch.bfloat16)
        model.save_pretrained(out)
        del model
        word_tokenizer(dims["vocab_size"]).save_pretrained(out)  # the HF engine reads EOS / pad from it
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, dims["vocab_size"], (n,), generator=g).tolist() for n in (512, 300, 1024, 77)]
    res: dict = {"config": dims, "aux_layers": DEEPSEEK_AUX, "tokens": sum(map(len, seqs)),
                 "sglang_ids_rule": translate_aux_ids(DEEPSEEK_AUX, "deepseek_v3", "sglang")}

    def cfg(backend):
        c = target_cfg(str(out), backend, cpu=a.cpu, mem_fraction_static=0.5)
        return c.model_copy(update={"aux_layers": DEEPSEEK_AUX})

    # HF: the features the engine captures, and every hidden_states index to match the slots against.
    hf = HFEngine(cfg("hf"), batch_tokens=16384)
    want = hf.capture(seqs)
    model = hf.target.model
    every = []
    if True:
        with torch.no_grad():
            for s in seqs:
                o = model.model(input_ids=torch.tensor([s], device=model.device), output_hidden_states=True)
                every.append([h[0].float().cpu() for h in o.hidden_states])
    hf.close()
    if a.cpu:
        got, kwargs = want, {"forward_hooks": "cpu check: no SGLang"}  # the comparison code still runs
    else:
        t = time.perf_counter()
        sgl = SGLangEngine(cfg("sglang"), mode="capture")
        res["sglang_start_s"] = time.perf_counter() - t
        try:
            got = sgl.capture(seqs)
            info = sgl.info
        finally:
            sgl.close()
        kwargs = engine_kwargs(cfg("sglang"), "capture", info=info, capture_dir="/dev/shm/x")
        kwargs = [h["target_modules"] for h in kwargs["forward_hooks"]]
    res["forward_hooks"] = kwargs
    H = dims["hidden_size"]
    errs = per_layer(got, want, H)
    res["rel_err_sglang_vs_hf"] = errs
    res["deepseek_capture_max_rel_err"] = max(errs.values())
    if every:  # which HF index each captured slot is closest to (a wrong rule shows as another index)
        matched = []
        for j in range(len(DEEPSEEK_AUX)):
            per_k = [sum(rel_err(gc.aux_hidden.split(H, -1)[j], hs[k]) for gc, hs in zip(got, every)) / len(got)
                     for k in range(len(every[0]))]
            matched.append(min(range(len(per_k)), key=per_k.__getitem__))
            res.setdefault("rel_err_slot_vs_every_hf_index", []).append(per_k)
        res["matched_hf_indices"] = matched
        res["aux_ids_rule_ok"] = matched == DEEPSEEK_AUX
    return res


# --- b: SIGKILL of the scheduler mid-extraction --------------------------------------------------------


def _schedulers():
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "ppid", "cmdline", "name"]):
        cmd = " ".join(p.info["cmdline"] or []) or (p.info["name"] or "")
        if cmd.startswith("sglang::scheduler") or (p.info["name"] or "").startswith("sglang::sched"):
            out.append((p.info["pid"], p.info["ppid"]))
    return out


def part_b(a) -> dict:
    import signal

    from eagle3_ray.features.store import manifest

    prepared = WORK / "kill_prep"
    store = WORK / "kill_store"
    if store.exists():
        import shutil

        shutil.rmtree(store)
    backend = "hf" if a.cpu else "sglang"
    overrides = [f"target.model={SMOLLM2}", f"target.backend={backend}", f"extract.batch_tokens={a.kill_batch_tokens}",
                 "extract.num_actors=1", "ray.num_cpus=8" if not a.cpu else "ray.num_cpus=4"]
    if not a.cpu:
        overrides += ["extract.num_gpus_per_actor=1", "target.sglang.mem_fraction_static=0.5",
                      "target.sglang.extra_engine_kwargs=" + json.dumps(ENV)]
    killed: dict = {}

    def watcher():
        first = None
        while "stop" not in killed:
            if a.cpu:
                return
            scheds = _schedulers()
            if scheds and store.exists() and len(manifest(store)) >= a.kill_after_shards:
                first = scheds[0]
                os.kill(first[0], signal.SIGKILL)
                killed.update(pid=first[0], parent=first[1], at=time.time(), shards_before=len(manifest(store)))
                break
            time.sleep(0.05)
        while "stop" not in killed:  # the scheduler that replaces it, and who started it
            scheds = [s for s in _schedulers() if s[0] != killed.get("pid")]
            if scheds:
                killed.update(new_pid=scheds[0][0], new_parent=scheds[0][1], new_after_s=time.time() - killed["at"])
                return
            time.sleep(0.1)

    th = threading.Thread(target=watcher, daemon=True)
    th.start()
    t = time.perf_counter()
    rc = run_cli(["extract", "-c", "configs/demo-smollm2.yaml", "--data", str(prepared), "--out", str(store),
                  *overrides], Path(a.out) / "sglang2_kill_extract.log", timeout=max(30, a.part_timeout - 15))
    killed["stop"] = True
    th.join(timeout=5)
    killed.pop("stop", None)
    res: dict = {"rc": rc, "seconds": time.perf_counter() - t, "kill": killed, "backend": backend}
    import pyarrow.parquet as pq

    from eagle3_ray.extract.prepared import prepared_path

    want = pq.read_table(prepared_path(prepared), columns=["sample_id"]).column("sample_id").to_pylist()
    ids = [sid for m in manifest(store) for sid in m["sample_ids"]]
    res.update(prepared=len(want), stored=len(ids), distinct=len(set(ids)), missing=len(set(want) - set(ids)),
               duplicates=len(ids) - len(set(ids)), killed_mid_run=bool(killed.get("pid")))
    res["engine_restarted_in_its_actor"] = (killed.get("parent") == killed.get("new_parent")) if killed.get("pid") else None
    res["sglang_kill_every_sample_once"] = (rc == 0 and res["missing"] == 0 and res["duplicates"] == 0
                                            and len(ids) == len(want) and (a.cpu or res["killed_mid_run"]))
    return res


# --- c: self-distillation, SGLang vs HF -----------------------------------------------------------------


def part_c(a) -> dict:
    import torch

    from eagle3_ray.config import GenerateConfig
    from eagle3_ray.data.sources import read_samples, resolve_data_path
    from eagle3_ray.extract.generate_stage import DistillActor

    n = a.prompts if not a.cpu else 4
    samples = list(read_samples(resolve_data_path("builtin:demo_prompts"), "auto", n, None))
    gen = GenerateConfig(max_new_tokens=a.new_tokens if not a.cpu else 8, batch_size=a.gen_batch)
    res: dict = {"prompts": len(samples), "max_new_tokens": gen.max_new_tokens, "batch_size": a.gen_batch}
    answers = {}
    for backend in (("hf",) if a.cpu else ("sglang", "hf")):
        extra = {"cuda_graph_max_bs_decode": a.gen_batch} if backend == "sglang" else {}
        cfg = target_cfg(str(SMOLLM2), backend, cpu=a.cpu, mem_fraction_static=0.5)
        if extra:
            cfg.sglang.extra_engine_kwargs.update(extra)
        t = time.perf_counter()
        actor = DistillActor(cfg, 16384)
        started = time.perf_counter() - t
        part = WORK / f"distill-{backend}.jsonl"
        part.unlink(missing_ok=True)
        t = time.perf_counter()
        summary = actor.run(samples, str(part), gen)
        dt = time.perf_counter() - t
        actor.close() if hasattr(actor, "close") else actor.engine.close()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        rows = [json.loads(x) for x in part.read_text().splitlines() if x.strip()]
        answers[backend] = {r["id"]: r["conversations"][-1]["content"] for r in rows}
        res[backend] = {"start_s": started, "seconds": dt, "answers": len(rows), "answers_per_s": len(rows) / dt,
                        "summary": summary}
        log(f"generate {backend}: {res[backend]}")
    if "sglang" in answers:
        same = [sid for sid in answers["hf"] if answers["sglang"].get(sid) == answers["hf"][sid]]
        res["identical_answers"] = len(same) / max(1, len(answers["hf"]))
        res["sglang_generate_vs_hf"] = res["sglang"]["answers_per_s"] / res["hf"]["answers_per_s"]
    return res


# --- e: plain decoding, SGLang (CUDA graphs) vs the product's graphed baseline ---------------------------


def part_e(a) -> dict:
    import tempfile

    import torch

    from eagle3_ray.bench.prompts import load_prompt_sets
    from eagle3_ray.bench import sglang_bench as sb
    from eagle3_ray.config import BenchConfig, PipelineConfig

    sys.path.insert(0, str(REPO / "benchmarks" / "device"))
    from spec_graphed import bench_actor, random_drafter_dir, tiny_prompts

    work = Path(tempfile.mkdtemp(prefix="plain_"))
    mt = str(tiny_prompts(work)) if a.cpu else a.mt_bench
    sets = load_prompt_sets(mt, a.mt_prompts)
    turns = sum(len(p.turns) for ps in sets.values() for p in ps)
    new = 12 if a.cpu else a.new_tokens
    res: dict = {"prompts": sum(map(len, sets.values())), "turns": turns, "max_new_tokens": new}
    bench = BenchConfig(modes=[], max_new_tokens=new, temperature=0.0, prompt_lookup=False, num_gpus=0 if a.cpu else 1)
    if not a.cpu:  # SGLang needs CUDA
        # the product's SGLang bench, plain mode only, one request at a time (CUDA graphs up to batch 1)
        cfg = PipelineConfig(target=target_cfg(str(SMOLLM2), "sglang", mem_fraction_static=0.5),
                             bench=bench.model_copy(update={"concurrency": [1]}))
        t = time.perf_counter()
        part = sb.run_mode(cfg, "plain", "", sb.conversations_of(sets))
        raw = part["by_concurrency"]["1"]
        res["sglang"] = {"tokens_per_s": raw["tokens_per_s"], "completion_tokens": raw["completion_tokens"],
                         "seconds": raw["seconds"], "wall_s_with_start": time.perf_counter() - t,
                         "cuda_graphs": "disable_cuda_graph" not in part["server_args"]}
        log(f"sglang plain: {res['sglang']}")
        torch.cuda.empty_cache()
    tcfg = target_cfg(str(SMOLLM2), "hf", cpu=a.cpu)
    # the drafter is loaded, never run (modes=[]); with --cpu the StaticTarget path runs eagerly
    actor = bench_actor(tcfg, random_drafter_dir(tcfg, work), static_off_cuda=a.cpu)
    ours = actor.run(sets, bench)
    res["ours"] = {"tokens_per_s": ours["baseline"]["tokens_per_s"], "graphed": ours.get("graphed_baseline"),
                   "static_target": ours.get("static_target"), "max_length": bench.max_length}
    log(f"ours plain: {res['ours']}")
    # The same baseline with other StaticTarget capacities (bench.max_length): what capacity costs a decode step.
    res["ours_by_max_length"] = {}
    for n in [int(x) for x in a.plain_max_lengths.split(",") if x and int(x) != bench.max_length]:
        r = actor.run(sets, bench.model_copy(update={"max_length": 256 if a.cpu else n}))
        res["ours_by_max_length"][n] = {"tokens_per_s": r["baseline"]["tokens_per_s"], "static_target": r.get("static_target")}
        log(f"ours plain, max_length {n}: {res['ours_by_max_length'][n]}")
    if res.get("sglang") and res["ours"]["tokens_per_s"]:
        res["sglang_plain_vs_graphed_plain"] = res["sglang"]["tokens_per_s"] / res["ours"]["tokens_per_s"]
    return res


# part: (name, function, seconds it needs at least, seconds it may take at most)
PARTS = {"a": ("throughput", part_a, 100, 450), "d": ("deepseek", part_d, 45, 150), "b": ("kill", part_b, 120, 270),
         "c": ("generate", part_c, 60, 120), "e": ("plain", part_e, 60, 180), "prep": ("prep", prep, 0, 0)}
KEYS = {"a": "sglang_extract_ratio", "c": "sglang_generate_vs_hf", "d": "deepseek_capture_max_rel_err",
        "b": "sglang_kill_every_sample_once", "e": "sglang_plain_vs_graphed_plain"}


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def run_part(a) -> None:
    name, fn, _, _ = PARTS[a.part]
    t = time.perf_counter()
    try:
        res = {"ok": True, **fn(a)}
    except BaseException as e:  # recorded; the driver goes on with the next part
        res = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        log(res["traceback"])
    res["part_seconds"] = time.perf_counter() - t
    res["command"] = " ".join(["python3", *sys.argv])  # this part's own process (--part)
    res["device"] = _device_name()
    if a.part != "prep":
        (Path(a.out) / f"sglang2_{name}.json").write_text(json.dumps(res, indent=1, default=str))
    log(f"part {a.part} ({name}) done in {res['part_seconds']:.0f}s ok={res['ok']}")


def driver(a) -> None:
    t0 = time.monotonic()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    base = [sys.executable, "-u", __file__, "--out", str(out), "--cpu"] if a.cpu else \
        [sys.executable, "-u", __file__, "--out", str(out)]
    passthrough = ["--seq", str(a.seq), "--per-batch", str(a.per_batch), "--batches", str(a.batches),
                   "--min-callers", str(a.min_callers), "--max-callers", str(a.max_callers), "--writers", a.writers, "--call-limits", a.call_limits, "--probes", a.probes, "--prompts", str(a.prompts), "--gen-batch", str(a.gen_batch), "--new-tokens", str(a.new_tokens),
                   "--kill-variants", str(a.kill_variants), "--kill-after-shards", str(a.kill_after_shards)]
    bg_log = open(out / "sglang2_prep.log", "w")
    bg = subprocess.Popen([*base, *passthrough, "--part", "prep"], stdout=bg_log, stderr=subprocess.STDOUT)
    summary: dict = {"budget_s": a.budget_s, "parts": {}}
    for p in a.parts.split(","):
        name, _, need, cap = PARTS[p]
        if p in ("a", "b", "c", "e"):  # b, c, e need the converted model / prepared data; a is timed (no CPU load beside it)
            try:
                bg.wait(timeout=max(1, a.budget_s - (time.monotonic() - t0) - need))
            except subprocess.TimeoutExpired:
                summary["parts"][p] = "skipped: background preparation not done"
                continue
        left = a.budget_s - (time.monotonic() - t0)
        if left < need * (0 if a.cpu else 1):
            summary["parts"][p] = f"skipped: {left:.0f}s left, the part needs about {need}s"
            log(summary["parts"][p])
            continue
        limit = left if a.cpu else min(left, cap)
        log(f"part {p} ({name}), {left:.0f}s left, at most {limit:.0f}s")
        # Its own process group: at the limit the part goes with every process it started (SGLang's too).
        proc = subprocess.Popen([*base, *passthrough, "--part", p, "--part-timeout", str(int(limit))],
                                start_new_session=True)
        try:
            summary["parts"][p] = f"rc {proc.wait(timeout=limit)}"
        except subprocess.TimeoutExpired:
            summary["parts"][p] = f"killed after {limit:.0f}s"
            os.killpg(proc.pid, 9)
            proc.wait()
        f = out / f"sglang2_{name}.json"
        if f.is_file():
            res = json.loads(f.read_text())
            summary[KEYS[p]] = res.get(KEYS[p])
        summary["elapsed_s"] = time.monotonic() - t0
        (out / "sglang2_summary.json").write_text(json.dumps(summary, indent=1))
    if bg.poll() is None:
        bg.kill()
    summary["elapsed_s"] = time.monotonic() - t0
    (out / "sglang2_summary.json").write_text(json.dumps(summary, indent=1))
    log(f"summary: {summary}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--budget-s", type=float, default=330)
    p.add_argument("--parts", default="d,a,e,b", help="comma-separated, run in this order")
    p.add_argument("--part", help=argparse.SUPPRESS)  # internal: run one part in this process
    p.add_argument("--part-timeout", type=float, default=120, help=argparse.SUPPRESS)
    p.add_argument("--cpu", action="store_true", help="check the script's paths on CPU (fakes, tiny shapes)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--per-batch", type=int, default=16)
    p.add_argument("--batches", type=int, default=7)
    p.add_argument("--min-callers", type=int, default=1, help="part a: capture with this many .. --max-callers")
    p.add_argument("--max-callers", type=int, default=3, help="part a: capture with --min-callers .. this many "
                   "concurrent callers (the product's default on a GPU actor is 3)")
    p.add_argument("--writers", default="1", help="part a: the hook's writer threads, one capture engine per count")
    p.add_argument("--probes", default="", help="part a: also time SGLang's prefill with the capture hook cut "
                   "short at each of these (rows, copy: benchmarks/device/sglang_capture_probe.py)")
    p.add_argument("--call-limits", default="0", help="part a: target.sglang.max_concurrent_calls, one capture "
                   "engine per value (0: no bound, the product's default; 1: one call in SGLang at a time)")
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--gen-batch", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--kill-variants", type=int, default=1, help="part b: samples = 300 demo prompts x this")
    p.add_argument("--kill-after-shards", type=int, default=2)
    p.add_argument("--kill-batch-tokens", type=int, default=4096, help="part b: extract.batch_tokens")
    p.add_argument("--mt-bench", default=".gq/mt_bench.jsonl", help="part e: MT-bench questions")
    p.add_argument("--mt-prompts", type=int, default=4, help="part e: questions (2 turns each)")
    p.add_argument("--plain-max-lengths", default="2048,8192", help="part e: other StaticTarget capacities to time")
    a = p.parse_args()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    if a.part:
        run_part(a)
    else:
        driver(a)


if __name__ == "__main__":
    main()
