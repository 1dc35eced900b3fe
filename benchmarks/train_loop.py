"""Ray Train + DeepSpeed training-loop throughput at a target's shape, on a synthetic feature store.

    # one H200: the 8B and Kimi-K2.5 shapes, ZeRO-1 and the Kimi preset's stage (benchmarks/device/train_mfu.sh)
    python benchmarks/train_loop.py --runs 8b:1,kimi:preset,kimi:1,8b:2 --peak-tflops 785 --json loop.json
    # CPU smoke test of the script itself
    python benchmarks/train_loop.py --device cpu --runs tiny:1,tiny:2 --seq 128 --samples 4 --steps 3 \\
        --warmup-steps 1 --json /tmp/loop_cpu.json

No extraction: for each shape a store of --samples random samples of --seq tokens is written directly
(features tiled from a small random block; the step's speed does not depend on their values), with a
vocab map (the first draft-vocab ids) and random frozen target heads. Shapes: `8b` (Llama-3.1-8B,
random:builtin:llama3.1-8b-shape, drafter from the target), `kimi` (configs/kimi-k2.5.yaml's drafter
and ZeRO stage over a Llama-typed target of Kimi-K2.5's width, layer count and 163,840-token vocab),
`tiny` (configs/ci-tiny.yaml). A run `SHAPE:STAGE[+KEY=VALUE...]` (STAGE a ZeRO stage or `preset`, the
config's; each `+KEY=VALUE` one more config override for this run, e.g. `8b:1+train.loss_kernel=torch`) is
`run_training` with one worker and --seq-token packs, in a Ray task stopped once --steps are logged
(`run_capped`). Figures: tokens/s over the log windows after --warmup-steps (metrics.jsonl),
MFU = train_step.step_flops per pack / time / --peak-tflops, the packs' input wait, and the GPU's
peak memory.used (nvidia-smi, polled; the caching allocator's reserve included) above its level
before the run. A run that fails (out of memory included) is reported with its error, and the next
one starts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step import step_flops  # noqa: E402

# Kimi-K2.5's width, depth and vocab as a Llama config: only the features' and heads' shapes matter here.
KIMI_TARGET = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 163840, "hidden_size": 7168,
    "intermediate_size": 18432, "num_hidden_layers": 61, "num_attention_heads": 56, "num_key_value_heads": 8,
    "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-06,
    "rope_theta": 50000.0, "tie_word_embeddings": False,
}
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SHAPES = {  # name -> (config file or None, target.model or None = KIMI_TARGET written to the run dir)
    "8b": (None, "random:builtin:llama3.1-8b-shape"),
    "kimi": (CONFIGS / "kimi-k2.5.yaml", None),
    "tiny": (CONFIGS / "ci-tiny.yaml", "random:builtin:tiny-llama"),
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", default="8b:1,kimi:preset,kimi:1,8b:2",
                    help="comma-separated SHAPE:STAGE[+KEY=VALUE...], in order (shapes: 8b, kimi, tiny; STAGE: 0-3 "
                         "or preset; +KEY=VALUE: config overrides of that run only)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--seq", type=int, default=2048, help="tokens per sample = per pack (train.batch_tokens)")
    ap.add_argument("--samples", type=int, default=8, help="samples in each shape's store (epochs repeat them)")
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    ap.add_argument("--warmup-steps", type=int, default=10, help="steps left out of the figure")
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--peak-tflops", type=float, default=None, help="peak FLOP/s for MFU (785 on H200)")
    ap.add_argument("--store", default="/dev/shm", help="parent of the run directory (stores, heads, outputs)")
    ap.add_argument("--num-cpus", type=int, default=None, help="local Ray CPUs (default: all; 4 on --device cpu)")
    ap.add_argument("--run-cap-s", type=float, default=120, help="no run longer than this")
    ap.add_argument("--budget-s", type=float, default=240, help="every run ends within this many seconds")
    ap.add_argument("--min-run-s", type=float, default=20,
                    help="start a run only with this much of the budget left (a Ray Train run's start-up alone "
                         "takes about a minute on a GPU machine)")
    ap.add_argument("--json", help="write the figures here (rewritten after every run)")
    a = ap.parse_args(argv)
    a.run_list = []
    for spec in a.runs.split(","):
        run, *overrides = spec.strip().split("+")
        shape, _, stage = run.partition(":")
        if (shape not in SHAPES or not (stage == "preset" or stage in "0123" and len(stage) == 1)
                or not all("=" in o for o in overrides)):
            ap.error(f"--runs entry {spec!r}: SHAPE:STAGE[+KEY=VALUE...] with SHAPE in {sorted(SHAPES)} and STAGE "
                     "0-3 or preset")
        a.run_list.append((shape, stage, tuple(overrides)))
    if a.warmup_steps >= a.steps:
        ap.error("--warmup-steps must be below --steps")
    if a.device == "cpu" and a.num_cpus is None:
        a.num_cpus = 4
    return a


def make_cfg(a, shape: str, root: Path, extra: list[str]):
    from eagle3_ray.config import load_config

    path, target = SHAPES[shape]
    if target is None:
        d = root / "kimi-target"
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(KIMI_TARGET), encoding="utf-8")
        target = f"random:{d / 'config.json'}"
    gpu = a.device == "cuda"
    return load_config(path, [
        f"target.model={target}", "target.backend=hf", "target.tp_size=1", f"target.device={a.device}",
        f"target.dtype={'bfloat16' if gpu else 'float32'}", f"vocab.draft_vocab_size={a.draft_vocab}",
        f"train.use_gpu={str(gpu).lower()}", "train.num_workers=1", f"train.batch_tokens={a.seq}",
        f"ray.num_cpus={'null' if a.num_cpus is None else a.num_cpus}", *extra,
    ])


def write_store(cfg, info, root: Path, samples: int, seq: int, draft_vocab: int) -> tuple[Path, Path, Path]:
    """(store, vocab map, heads) of random features for `info`'s shape."""
    import numpy as np
    import torch

    from eagle3_ray.data.vocab import VOCAB_FILE, save_vocab_map
    from eagle3_ray.features.store import FeatureStoreWriter, StoreMeta

    store = root / "store"
    g = torch.Generator().manual_seed(0)
    h = info.hidden_size
    block = torch.randn((64, 4 * h), generator=g, dtype=torch.bfloat16)  # [64, 4H], tiled over the tokens
    feats = block.repeat(math.ceil(seq / 64), 1)[:seq]
    with FeatureStoreWriter(store, StoreMeta.from_engine_info(info), "synthetic",
                            shard_max_bytes=2 * seq * 8 * h) as w:
        for i in range(samples):
            w.add({"sample_id": f"s{i:05d}",
                   "input_ids": torch.randint(0, info.vocab_size, (seq,), generator=g, dtype=torch.int32),
                   "loss_mask": torch.ones(seq, dtype=torch.uint8),
                   "aux_hidden": feats[:, : 3 * h].contiguous(), "last_hidden": feats[:, 3 * h:].contiguous()})
    t2d = np.zeros(info.vocab_size, dtype=np.bool_)
    t2d[:draft_vocab] = True
    vocab = save_vocab_map(root / "vocab" / VOCAB_FILE, np.zeros(draft_vocab, dtype=np.int64), t2d,
                           {"target_fingerprint": info.fingerprint, "draft_vocab_size": draft_vocab})
    heads = write_heads(cfg.target.model, info, root / "heads" / "target_heads.safetensors")
    return store, vocab.parent, heads


def drafter_shape(cfg, info, a) -> argparse.Namespace:
    """The fields `train_step.step_flops` reads, of the drafter this config trains."""
    from eagle3_ray.drafter.model import DrafterConfig
    from eagle3_ray.engines.describe import target_hf_config

    d = DrafterConfig.from_target(target_hf_config(cfg.target), a.draft_vocab, list(info.aux_layers),
                                  cfg.train.drafter.model_dump())
    return argparse.Namespace(hidden=d.hidden_size, heads=d.num_attention_heads, kv_heads=d.num_key_value_heads,
                              head_dim=d.head_dim, intermediate=d.intermediate_size, vocab=d.vocab_size,
                              draft_vocab=d.draft_vocab_size, ttt_steps=cfg.train.ttt_steps)


class GpuMemoryPeak:
    """Polls nvidia-smi's memory.used (MiB) of GPU 0 on a thread; None where there is no nvidia-smi."""

    def __init__(self, every_s: float = 0.5):
        self.every_s, self.peak, self._stop = every_s, None, threading.Event()
        self.base = self.read()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    @staticmethod
    def read() -> float | None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                  "-i", "0"], capture_output=True, text=True, timeout=10)
            return float(out.stdout.strip().splitlines()[0]) if out.returncode == 0 else None
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return None

    def _poll(self) -> None:
        while not self._stop.wait(self.every_s):
            used = self.read()
            if used is not None:
                self.peak = used if self.peak is None else max(self.peak, used)

    def __enter__(self) -> "GpuMemoryPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def gib_above_base(self) -> float | None:
        if self.peak is None or self.base is None:
            return None
        return (self.peak - self.base) / 1024


@dataclass
class Outcome:
    status: str  # done | measured (stopped once its figure was in) | capped | error
    seconds: float
    error: str | None = None


def run_capped(fn, args: tuple, cap_s: float, measured) -> Outcome:
    """Run fn(*args) as a Ray task; stop it when `measured()` turns true or after cap_s seconds.

    A task, not a call in this process, so that a run can be stopped: killing the task's worker
    ends the Ray Train controller it owns (and so its GPUs).
    """
    import ray

    t0 = time.monotonic()
    ref = ray.remote(num_cpus=0, max_retries=0)(fn).remote(*args)
    while True:
        ready, _ = ray.wait([ref], timeout=2.0)
        seconds = round(time.monotonic() - t0, 1)
        if ready:
            try:
                ray.get(ref)
                outcome = Outcome("done", seconds)
            except Exception as e:  # the run's own error, reported in the JSON
                outcome = Outcome("error", seconds, f"{type(e).__name__}: {e}"[-4000:])
            break
        status = "measured" if measured() else "capped" if seconds > cap_s else None
        if status:
            _stop(ref)
            outcome = Outcome(status, seconds)
            break
    _wait_idle(timeout_s=30)  # the next run starts on an idle cluster
    return outcome


def _stop(ref) -> None:
    import ray
    from ray.util import placement_group_table, remove_placement_group
    from ray.util.placement_group import PlacementGroup

    ray.cancel(ref, force=True)
    # Placement groups live as long as the job, not as their creator: free Ray Train's by hand.
    for pg_id, pg in placement_group_table().items():
        if pg["state"] != "REMOVED":
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))


def _wait_idle(timeout_s: float) -> None:
    """Wait until the stopped run's actors have given back their CPUs and GPUs."""
    import ray

    total, end = ray.cluster_resources(), time.monotonic() + timeout_s
    while time.monotonic() < end:
        free = ray.available_resources()
        if all(free.get(k, 0) >= total.get(k, 0) for k in ("CPU", "GPU")):
            return
        time.sleep(0.5)


def _train_task(cfg, store: str, vocab: str, out: str) -> None:
    import ray

    from eagle3_ray.train.trainer import run_training

    ray.data.DataContext.get_current().enable_progress_bars = False
    run_training(cfg, store, vocab, out)


def write_heads(target: str, info, path: Path) -> Path:
    """Frozen target embedding and lm_head of the right shape, each tiled from a small random block: their
    values do not change the speed, and `save_target_heads` would build a random 8B target on the CPU."""
    import torch
    from safetensors.torch import save_file

    from eagle3_ray.engines.heads import EMBED, LM_HEAD

    g = torch.Generator().manual_seed(0)
    vocab, hidden = info.vocab_size, info.hidden_size
    heads = {}
    for name in (EMBED, LM_HEAD):
        block = torch.randn((1024, hidden), generator=g, dtype=torch.bfloat16).mul_(0.02)  # [1024, H]
        heads[name] = block.repeat(math.ceil(vocab / 1024), 1)[:vocab].contiguous()  # [V, H]
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(heads, str(path), metadata={"target": target})
    return path


def metric_lines(path: Path) -> list[dict]:
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    return [json.loads(s) for s in lines if s.strip().endswith("}")]  # the last may be half-written


def steady_train_rate(lines: list[dict], warmup: int) -> tuple[float | None, int]:
    """Global tokens/s over the log windows ending after `warmup` steps. Every step trains the same
    tokens, so a window's time is its steps / its rate (tokens_per_s is already summed over workers)."""
    steps, seconds, prev = 0, 0.0, 0
    for m in lines:
        width, prev = m["step"] - prev, m["step"]
        if m["step"] - width >= warmup and m["tokens_per_s"] > 0:
            steps += width
            seconds += width / m["tokens_per_s"]
    return (steps / seconds if seconds else None), steps


def train_run(a, index: int, shape: str, stage: str, overrides: tuple[str, ...], root: Path, inputs: dict,
              cap: float) -> dict:
    from eagle3_ray.engines.heads import HEADS_FILE
    from eagle3_ray.features import open_store
    from eagle3_ray.train.packing import plan_epoch

    cfg0, info, (store, vocab, heads) = inputs[shape]
    zero = cfg0.train.zero_stage if stage == "preset" else int(stage)
    per_epoch = len(plan_epoch(open_store(store).lengths, a.seq, 0, 0))
    label = f"{shape}_zero{zero}" + "".join(f"+{o}" for o in overrides)
    out = root / f"train_{index}"
    out.mkdir(parents=True, exist_ok=True)
    os.link(heads, out / HEADS_FILE)
    cfg = make_cfg(a, shape, root, [
        f"train.zero_stage={zero}", f"train.max_steps={a.steps}", f"train.epochs={math.ceil(1.2 * a.steps / per_epoch) + 1}",
        f"train.log_every={a.log_every}", f"train.checkpoint_every={a.steps}", "train.val_share=0",
        f"name=loop-{index}-{shape}-z{zero}", *overrides,
    ])
    metrics = out / "metrics.jsonl"

    def measured() -> bool:  # the final checkpoint is not part of the figure
        lines = metric_lines(metrics)
        return bool(lines) and lines[-1]["step"] >= a.steps

    print(f"[loop] {label}: {a.steps} steps of {a.seq} tokens, cap {cap:.0f}s", flush=True)
    with GpuMemoryPeak() as mem:
        res = run_capped(_train_task, (cfg, str(store), str(vocab), str(out)), cap, measured)
    lines = metric_lines(metrics)
    rate, steps = steady_train_rate(lines, a.warmup_steps)
    flops = step_flops(drafter_shape(cfg, info, a), a.seq)  # per pack of a.seq tokens
    tflops = rate * flops / a.seq / 1e12 if rate else None
    waits = [m["input_wait"] for m in lines if m["step"] - a.log_every >= a.warmup_steps]
    error = res.error or ""
    run = {
        "shape": shape, "zero_stage": zero, "overrides": list(overrides), "label": label,
        "status": res.status, "seconds": res.seconds,
        "oom": "out of memory" in error.lower() or "OutOfMemoryError" in error,
        "error": res.error, "steps_done": lines[-1]["step"] if lines else 0, "steps_measured": steps,
        "tokens_per_s": rate, "achieved_tflops": tflops,
        "mfu": tflops / a.peak_tflops if tflops and a.peak_tflops else None,
        "input_wait": sum(waits) / len(waits) if waits else None,
        "peak_gpu_gib_nvidia_smi": mem.gib_above_base(),
        "windows_tokens_per_s": [round(m["tokens_per_s"], 1) for m in lines],
    }
    mfu = f", MFU {run['mfu']:.1%}" if run["mfu"] is not None else ""
    print(f"[loop] {label}: {_fmt(rate)} tok/s over {steps} steps{mfu}, input wait "
          f"{run['input_wait']}, peak {run['peak_gpu_gib_nvidia_smi']} GiB; {res.status} in {res.seconds}s"
          + (" (OUT OF MEMORY)" if run["oom"] else ""), flush=True)
    shutil.rmtree(out, ignore_errors=True)
    return run


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.0f}"


def main(argv=None) -> int:
    a = parse_args(argv)
    from eagle3_ray.engines.describe import describe_target
    from eagle3_ray.ray_session import init_ray

    # A caller's timeout (SIGTERM) still saves the figures and stops Ray and its GPU workers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    root = Path(a.store) / f"train_loop-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    root.mkdir(parents=True)
    t0 = time.monotonic()
    report = {"command": " ".join([sys.executable, *sys.argv]), "seq": a.seq, "steps": a.steps,
              "warmup_steps": a.warmup_steps, "peak_tflops": a.peak_tflops, "runs": []}

    def save() -> None:
        if a.json:
            Path(a.json).write_text(json.dumps(report, indent=2), encoding="utf-8")

    try:
        inputs = {}
        for shape in dict.fromkeys(s for s, _, _ in a.run_list):
            cfg = make_cfg(a, shape, root / shape, [])
            info = describe_target(cfg.target)
            t = time.monotonic()
            inputs[shape] = (cfg, info, write_store(cfg, info, root / shape, a.samples, a.seq, a.draft_vocab))
            print(f"[loop] {shape}: store, vocab map and heads written in {time.monotonic() - t:.1f}s", flush=True)
        init_ray(make_cfg(a, a.run_list[0][0], root / a.run_list[0][0], []).ray)
        for index, (shape, stage, overrides) in enumerate(a.run_list):
            left = a.budget_s - (time.monotonic() - t0)
            run = {"shape": shape, "zero_stage": stage, "overrides": list(overrides)}
            if left < a.min_run_s:
                report["runs"].append(run | {"status": "skipped (budget)"})
                continue
            try:
                report["runs"].append(train_run(a, index, shape, stage, overrides, root / shape, inputs,
                                                min(a.run_cap_s, left)))
            except Exception as e:  # report it; the next run may still work
                report["runs"].append(run | {"status": "error", "error": f"{type(e).__name__}: {e}"})
            save()
    finally:
        save()
        shutil.rmtree(root, ignore_errors=True)
        import ray

        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
