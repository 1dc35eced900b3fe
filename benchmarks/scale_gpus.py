"""Throughput scaling from 1 to N GPUs: offline extraction and Ray Train + DeepSpeed training.

    # two H200s, Llama-3.1-8B-shaped random target, 2048-token samples (one Ray instance, ~5 min)
    python benchmarks/scale_gpus.py --target random:.gq/llama8b --gpus 2 --json scale_2gpu.json
    # CPU smoke test of the script itself
    python benchmarks/scale_gpus.py --device cpu --target random:builtin:tiny-llama --samples 8 \
        --seq 128 --batch-tokens 256 --train-steps 3 --run-cap-s 300 --budget-s 1200 --json /tmp/scale_cpu.json

Extraction: `run_extract` (CaptureWriteUDF engine actors, one GPU each) with 1 then N actors on a
fresh store under --store; run n gets n x --samples random samples so each run lasts about as long.
Figure: steady tokens/s, from the shard completion markers' mtimes, counting from the n-th commit
(every actor warm) to the n-th last (no actor idle at the tail).
Training: `run_training` (TorchTrainer + DeepSpeed ZeRO-1, bf16 on GPU) with 1 then N workers on
the store of the first extraction, each worker taking --train-steps optimizer steps. Figure: the
global tokens/s the trainer logs to metrics.jsonl, over the windows after --train-warmup-steps.
Ratio = tokens/s(N) / tokens/s(1); goals at N = 2: extraction >= 1.9, training >= 1.8.

Every run is a Ray task stopped (with everything it started) at its time cap; the budget is shared
so the whole script ends within --budget-s. The JSON is rewritten after every run, so a run cut
short, or a phase that fails, still leaves the other figures (and the error text).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from extract_gpu import _prepared  # noqa: E402  (random-token prepared parquet, same as extract_gpu.py)

GOALS = {"extract": 1.9, "train": 1.8}  # at N = 2 (the GPU issue's goals)
POLL_S = 2.0
# Share of the store filesystem's free space extraction may fill: /dev/shm also holds Ray's object store.
FREE_SPACE_USE = 0.6


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="random:builtin:llama3.1-8b-shape", help="target.model")
    ap.add_argument("--gpus", type=int, default=2, help="N: runs with 1 and N actors / workers")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: smoke test of this script")
    ap.add_argument("--seq", type=int, default=2048, help="tokens per sample")
    ap.add_argument("--samples", type=int, default=None,
                    help="extraction samples per GPU (default: --extract-rate x --extract-seconds / --seq)")
    ap.add_argument("--extract-rate", type=float, default=30000, help="expected tokens/s per GPU, for sizing")
    ap.add_argument("--extract-seconds", type=float, default=40, help="wanted length of each extraction run")
    ap.add_argument("--batch-tokens", type=int, default=8192, help="extract.batch_tokens")
    ap.add_argument("--train-steps", type=int, default=300, help="optimizer steps per worker in each run")
    ap.add_argument("--train-warmup-steps", type=int, default=20, help="steps left out of the figure")
    ap.add_argument("--train-batch-tokens", type=int, default=None, help="train.batch_tokens (default: --seq)")
    ap.add_argument("--train-samples", type=int, default=256, help="samples kept in the training store")
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--store", default="/dev/shm", help="parent of the fresh run directory")
    ap.add_argument("--num-cpus", type=int, default=None, help="local Ray CPUs (default: all; 4 on --device cpu)")
    ap.add_argument("--budget-s", type=float, default=280, help="wall-clock budget of the whole script")
    ap.add_argument("--run-cap-s", type=float, default=100, help="no single run longer, whatever the budget left")
    ap.add_argument("--train-only", action="store_true",
                    help="training scaling only: one 1-actor extraction builds the store, no N-actor run")
    ap.add_argument("--extract-only", action="store_true", help="no training runs")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--md", help="also write a markdown summary here")
    ap.add_argument("overrides", nargs="*", help="extra config overrides, e.g. extract.concurrent_batches=3")
    a = ap.parse_args(argv)
    if a.gpus < 2:
        ap.error("--gpus must be at least 2 (the runs are 1 and N)")
    return a


def make_cfg(a: argparse.Namespace, extra: list[str]):
    from eagle3_ray.config import load_config

    gpu = a.device == "cuda"
    return load_config(None, [
        f"target.model={a.target}", f"target.device={a.device}",
        f"target.dtype={'bfloat16' if gpu else 'float32'}", f"data.max_length={a.seq}",
        f"extract.batch_tokens={a.batch_tokens}", f"extract.num_gpus_per_actor={1 if gpu else 0}",
        f"vocab.draft_vocab_size={a.draft_vocab}", f"train.use_gpu={str(gpu).lower()}",
        f"train.ttt_steps={a.ttt_steps}", "train.zero_stage=1",
        f"ray.num_cpus={'null' if a.num_cpus is None else a.num_cpus}",
        *a.overrides, *extra,
    ])


# --- time-capped runs -------------------------------------------------------------------------

@dataclass
class Outcome:
    status: str  # done | measured (stopped once its figure was in) | capped | error
    seconds: float
    error: str | None = None


def run_capped(fn, args: tuple, cap_s: float, measured=lambda: False) -> Outcome:
    """Run fn(*args) as a Ray task; stop it when `measured()` turns true or after cap_s seconds.

    A task, not a call in this process, so that a run can be stopped: killing the task's worker
    ends the Ray Data actors and the Ray Train controller it owns (and so their GPUs).
    """
    import ray

    task = ray.remote(num_cpus=0, max_retries=0)(fn)
    t0 = time.monotonic()
    ref = task.remote(*args)
    while True:
        ready, _ = ray.wait([ref], timeout=POLL_S)
        seconds = round(time.monotonic() - t0, 1)
        if ready:
            outcome = _result(ref, seconds)
            break
        status = "measured" if measured() else "capped" if seconds > cap_s else None
        if status:
            _stop(ref)
            outcome = Outcome(status, seconds, None if status == "measured" else _worker_tracebacks())
            break
    _wait_idle(timeout_s=30)  # the next run starts on an idle cluster
    return outcome


def _result(ref, seconds: float) -> Outcome:
    import ray

    try:
        ray.get(ref)
        return Outcome("done", seconds)
    except Exception as e:  # the run's own error, reported in the JSON
        return Outcome("error", seconds, (f"{type(e).__name__}: {e}"[-4000:] + "\n" + (_worker_tracebacks() or "")))


def _worker_tracebacks() -> str | None:
    """Tracebacks in the Ray workers' stderr logs (an actor that dies in __init__ leaves its error
    only there; Ray Data reports just "actors died during initialization"). Printed and returned."""
    import glob

    found = []
    for path in sorted(glob.glob("/tmp/ray/session_latest/logs/worker-*.err"), key=os.path.getmtime):
        text = Path(path).read_text(errors="replace")
        if "Traceback" in text:
            found.append(f"--- {os.path.basename(path)}\n{text[text.rindex('Traceback'):][-3000:]}")
    if not found:
        return None
    out = "\n".join(found[-3:])
    print(out, flush=True)
    return out[-6000:]


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
    """Wait until the killed run's actors have given back their CPUs and GPUs."""
    import ray

    total = ray.cluster_resources()
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        free = ray.available_resources()
        if all(free.get(k, 0) >= total.get(k, 0) for k in ("CPU", "GPU")):
            return
        time.sleep(0.5)


class Budget:
    """Shares the time left among the runs left, by weight: a training run needs longer than an
    extraction run (worker start-up, DeepSpeed, compilation), and a run that ends early leaves
    its time to the later ones."""

    WEIGHTS = {"extract": 1.0, "vocab": 0.3, "train": 1.6}

    def __init__(self, seconds: float, runs: list[str], run_cap: float):
        self.deadline, self.runs_left, self.run_cap = time.monotonic() + seconds, list(runs), run_cap

    def next_cap(self, kind: str) -> float:
        share = self.WEIGHTS[kind] / sum(self.WEIGHTS[k] for k in self.runs_left)
        self.runs_left.remove(kind)
        return min(self.run_cap, max(10.0, share * (self.deadline - time.monotonic())))


# --- extraction -------------------------------------------------------------------------------

def _extract_task(cfg, prepared: str, store: str) -> None:
    import ray

    from eagle3_ray.extract.pipeline import run_extract

    ray.data.DataContext.get_current().enable_progress_bars = False
    run_extract(cfg, prepared, store)


def commits(store: Path) -> list[tuple[float, int, str]]:
    """(commit time, tokens, producer) of every completed shard, oldest first; the producer (host:pid
    in the marker) is the engine actor that wrote it."""
    out = []
    for p in (store / "shards").glob("*.done.json"):
        m = json.loads(p.read_text())
        out.append((p.stat().st_mtime, int(m["tokens"]), str(m.get("producer", "?"))))
    return sorted(out)


def steady_rate(marks: list[tuple], actors: int) -> float | None:
    """Tokens/s between the `actors`-th commit and the `actors`-th last one: by then every actor has
    committed once (warm), and until then none has run out of work."""
    first, last = actors - 1, len(marks) - actors
    if last <= first:
        return None
    span = marks[last][0] - marks[first][0]
    return sum(m[1] for m in marks[first + 1:last + 1]) / span if span > 0 else None


def per_writer(marks: list[tuple], start: float) -> dict:
    """Each actor's own steady rate (its first to its last commit), its start and end relative to
    the run's start, and the rate of the window where every actor was committing: separates a slower
    actor (shared host) from actors that start late or finish early (stagger, uneven split)."""
    writers: dict[str, list[tuple]] = {}
    for m in marks:
        writers.setdefault(m[2], []).append(m)
    out = {}
    for w, ms in sorted(writers.items()):
        span = ms[-1][0] - ms[0][0]
        out[w] = {"shards": len(ms), "tokens": sum(m[1] for m in ms),
                  "first_commit_s": round(ms[0][0] - start, 2), "last_commit_s": round(ms[-1][0] - start, 2),
                  "tokens_per_s": sum(m[1] for m in ms[1:]) / span if span > 0 else None}
    lo = max(ms[0][0] for ms in writers.values()) if writers else 0.0
    hi = min(ms[-1][0] for ms in writers.values()) if writers else 0.0
    inside = sum(m[1] for m in marks if lo < m[0] <= hi)
    return {"writers": out, "overlap_s": round(hi - lo, 2),
            "overlap_tokens_per_s": inside / (hi - lo) if hi > lo else None}


def samples_per_gpu(a: argparse.Namespace, root: Path, hidden: int) -> tuple[int, str | None]:
    """--samples, or enough for --extract-seconds; fewer if the N-GPU run would not fit on --store
    next to the training store kept from the first run."""
    from eagle3_ray.features.record import bytes_per_token

    want = a.samples or max(1, math.ceil(a.extract_rate * a.extract_seconds / a.seq))
    sample_bytes = a.seq * bytes_per_token(hidden)
    room = FREE_SPACE_USE * shutil.disk_usage(root).free - a.train_samples * sample_bytes
    fits = int(room / (a.gpus * sample_bytes * 1.1))
    if fits >= want:
        return want, None
    return max(1, fits), f"{want} samples per GPU do not fit in {root}: {fits} used"


def trim_store(store: Path, keep: int) -> int:
    """Keep the oldest shards holding >= `keep` samples (a store is its completed shards)."""
    kept = 0
    for marker in sorted((store / "shards").glob("*.done.json"), key=lambda p: p.stat().st_mtime):
        if kept >= keep:
            (marker.parent / json.loads(marker.read_text())["shard"]).unlink(missing_ok=True)
            marker.unlink()
        else:
            kept += int(json.loads(marker.read_text())["num_samples"])
    return kept


def extract_run(a, n: int, root: Path, samples: int, vocab: int, cap: float) -> dict:
    prepared = _prepared(root / f"prepared_{n}", n * samples, a.seq, min(vocab, 49152))
    store = root / f"store_{n}"
    cfg = make_cfg(a, [f"extract.num_actors={n}", f"name=scale-extract-{n}"])
    print(f"[scale] extract: {n} actor(s), {n * samples} samples, cap {cap:.0f}s", flush=True)
    start = time.time()
    out = run_capped(_extract_task, (cfg, str(prepared), str(store)), cap)
    marks = commits(store) if (store / "shards").is_dir() else []
    tokens = sum(m[1] for m in marks)
    run = {
        "actors": n, "samples": n * samples, "status": out.status, "seconds": out.seconds,
        "error": out.error, "shards": len(marks), "tokens": tokens,
        "steady_tokens_per_s": steady_rate(marks, n),
        "end_to_end_tokens_per_s": tokens / (marks[-1][0] - start) if marks else None,
        "store": str(store), **per_writer(marks, start),
    }
    print(f"[scale] extract {n}: {_fmt(run['steady_tokens_per_s'])} tok/s steady, "
          f"{_fmt(run['end_to_end_tokens_per_s'])} end to end, {out.status} in {out.seconds}s; per actor "
          + ", ".join(f"{w['tokens_per_s'] and round(w['tokens_per_s'])} tok/s ({w['first_commit_s']}-"
                      f"{w['last_commit_s']}s)" for w in run["writers"].values())
          + f"; all committing for {run['overlap_s']}s at {_fmt(run['overlap_tokens_per_s'])} tok/s", flush=True)
    return run


def phase_extract(a, root: Path, info, budget: Budget, report) -> Path | None:
    """Both extraction runs; returns the store kept (trimmed) for training."""
    samples, note = samples_per_gpu(a, root, info.hidden_size)
    if note:
        print(f"[scale] {note}", flush=True)
    report["extract_note"] = note
    train_store = None
    for n in (1,) if a.train_only else (1, a.gpus):
        run = extract_run(a, n, root, samples, info.vocab_size, budget.next_cap("extract"))
        report["extract_runs"].append(run)
        report.save()
        store = Path(run["store"])
        if train_store is None and run["shards"]:
            run["kept_for_training"] = trim_store(store, a.train_samples)
            train_store = store
        else:
            shutil.rmtree(store, ignore_errors=True)  # /dev/shm is memory
    return train_store


# --- training ---------------------------------------------------------------------------------

def _vocab_task(cfg, store: str, out: str) -> None:
    from eagle3_ray.extract.vocab_stage import run_vocab

    run_vocab(cfg, store, out)


def _train_task(cfg, store: str, vocab: str, out: str) -> None:
    import ray

    from eagle3_ray.train.trainer import run_training

    ray.data.DataContext.get_current().enable_progress_bars = False
    run_training(cfg, store, vocab, out)


def write_heads(target: str, info, path: Path) -> Path:
    """Frozen target embedding and lm_head of the right shape, random. For a random target
    `save_target_heads` would build the whole model in fp32 on the CPU (32 GB at 8B) to read two
    tensors; their values do not change the speed, so each is tiled from a small random block
    (CPU random number generation is serial: 2 x 525M values at 8B would take tens of seconds)."""
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
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
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


def train_run(a, n: int, root: Path, store: Path, vocab: Path, heads: Path, cap: float) -> dict:
    from eagle3_ray.engines.heads import HEADS_FILE
    from eagle3_ray.features import open_store
    from eagle3_ray.train.packing import plan_epoch

    bt = a.train_batch_tokens or a.seq
    per_epoch = len(plan_epoch(open_store(store).lengths, bt, 0, 0))
    epochs = math.ceil(1.2 * a.train_steps * n / per_epoch) + 1  # each worker needs its own packs
    log_every = max(1, min(10, a.train_steps // 10))
    warmup = min(a.train_warmup_steps, a.train_steps - log_every)
    out = root / f"train_{n}"
    out.mkdir(parents=True, exist_ok=True)
    os.link(heads, out / HEADS_FILE)
    cfg = make_cfg(a, [f"train.num_workers={n}", f"train.max_steps={a.train_steps}",
                       f"train.batch_tokens={bt}", f"train.epochs={epochs}", f"train.log_every={log_every}",
                       f"train.checkpoint_every={a.train_steps}", f"name=scale-train-{n}"])
    metrics = out / "metrics.jsonl"

    t_start, first_log = time.monotonic(), []

    def measured() -> bool:  # the last step is logged before the final checkpoint, not needed here
        lines = metric_lines(metrics)
        if lines and not first_log:  # start-up cost: Ray Train workers, DeepSpeed, first packs
            first_log.append(round(time.monotonic() - t_start, 1))
        return bool(lines) and lines[-1]["step"] >= a.train_steps

    print(f"[scale] train: {n} worker(s), {a.train_steps} steps of {bt} tokens, cap {cap:.0f}s", flush=True)
    res = run_capped(_train_task, (cfg, str(store), str(vocab), str(out)), cap, measured)
    lines = metric_lines(metrics)
    rate, steps = steady_train_rate(lines, warmup)
    run = {
        "workers": n, "status": res.status, "seconds": res.seconds, "error": res.error,
        "steps_done": lines[-1]["step"] if lines else 0, "steps_measured": steps, "warmup_steps": warmup,
        "batch_tokens": bt, "tokens_per_s": rate, "windows": [round(m["tokens_per_s"], 1) for m in lines],
        "first_log_s": first_log[0] if first_log else None, "log_every": log_every,
    }
    print(f"[scale] train {n}: {_fmt(rate)} tok/s over {steps} steps, {res.status} in {res.seconds}s", flush=True)
    return run


def phase_train(a, root: Path, store: Path | None, info, budget: Budget, report) -> None:
    if store is None:
        raise RuntimeError("no feature store to train on: every extraction run failed")
    vocab = root / "vocab"
    out = run_capped(_vocab_task, (make_cfg(a, []), str(store), str(vocab)), budget.next_cap("vocab"))
    if out.status != "done":
        raise RuntimeError(f"vocab map: {out.status} after {out.seconds}s: {out.error}")
    heads = write_heads(a.target, info, root / "heads" / "target_heads.safetensors")
    for n in (1, a.gpus):
        report["train_runs"].append(train_run(a, n, root, store, vocab, heads, budget.next_cap("train")))
        report.save()


# --- report -----------------------------------------------------------------------------------

class Report(dict):
    """The JSON result, saved after every run."""

    def __init__(self, path: str | None, **fields):
        super().__init__(fields)
        self.path = path

    def save(self) -> None:
        self.update(scaling(self))
        if self.path:
            tmp = Path(self.path + ".tmp")
            tmp.write_text(json.dumps(self, indent=2), encoding="utf-8")
            tmp.replace(self.path)


def scaling(r: dict) -> dict:
    n = r["gpus"]
    ext = {run["actors"]: run["steady_tokens_per_s"] for run in r["extract_runs"]}
    e2e = {run["actors"]: run["end_to_end_tokens_per_s"] for run in r["extract_runs"]}
    tr = {run["workers"]: run["tokens_per_s"] for run in r["train_runs"]}
    extract = _ratio(ext.get(1), ext.get(n), n, "extract", r.get("extract_error"))
    extract["end_to_end_ratio"] = _ratio(e2e.get(1), e2e.get(n), n, "extract", None)["ratio"]
    return {
        f"scale_extract_{n}gpu": extract,
        f"scale_train_{n}gpu": _ratio(tr.get(1), tr.get(n), n, "train", r.get("train_error")),
    }


def _ratio(one: float | None, many: float | None, n: int, phase: str, error: str | None) -> dict:
    return {"tokens_per_s_1": one, f"tokens_per_s_{n}": many,
            "ratio": many / one if one and many else None,
            "goal": GOALS[phase] if n == 2 else None, "error": error}


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:,.0f}"


def machine(a) -> dict:
    import torch

    gpu = a.device == "cuda" and torch.cuda.is_available()
    return {"device": torch.cuda.get_device_name(0) if gpu else "cpu",
            "gpus_visible": torch.cuda.device_count() if gpu else 0, "cpus": os.cpu_count()}


def markdown(r: dict) -> str:
    n = r["gpus"]
    rows = []
    for phase in ("extract", "train"):
        s = r[f"scale_{phase}_{n}gpu"]
        ratio = "n/a" if s["ratio"] is None else f"{s['ratio']:.2f}x"
        rows.append(f"| {phase} | {_fmt(s['tokens_per_s_1'])} | {_fmt(s[f'tokens_per_s_{n}'])} | **{ratio}** | "
                    f"{s['goal'] or '-'} | {s['error'] or ''} |")
    return "\n".join([
        f"# Throughput scaling 1 -> {n} GPUs",
        "",
        f"Machine: {r['gpus_visible']}x {r['device']}, {r['cpus']} CPUs. Target `{r['target']}`, "
        f"{r['seq']}-token samples. Command: `{r['command']}`",
        "",
        f"| phase | tokens/s at 1 | tokens/s at {n} | ratio | goal | error |",
        "|---|---|---|---|---|---|",
        *rows, "",
    ])


def main(argv=None) -> int:
    a = parse_args(argv)
    from eagle3_ray.engines.describe import describe_target
    from eagle3_ray.ray_session import init_ray

    if a.device == "cpu" and a.num_cpus is None:
        a.num_cpus = 4
    cfg = make_cfg(a, [])
    info = describe_target(cfg.target)
    root = Path(a.store) / f"scale_gpus-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    root.mkdir(parents=True)
    report = Report(a.json, target=a.target, gpus=a.gpus, seq=a.seq, hidden_size=info.hidden_size,
                    draft_vocab=a.draft_vocab, ttt_steps=a.ttt_steps, root=str(root), **machine(a),
                    command=" ".join([sys.executable, *sys.argv]), extract_runs=[], train_runs=[])
    budget = Budget(a.budget_s, ["extract"] * (1 if a.train_only else 2)
                    + ([] if a.extract_only else ["vocab", "train", "train"]), a.run_cap_s)
    init_ray(cfg.ray)
    store = None
    try:
        store = phase_extract(a, root, info, budget, report)
    except Exception as e:  # keep going: training has its own figure to report
        report["extract_error"] = f"{type(e).__name__}: {e}"
    try:
        if not a.extract_only:
            phase_train(a, root, store, info, budget, report)
    except Exception as e:
        report["train_error"] = f"{type(e).__name__}: {e}"
    report.save()
    for phase in ("extract", "train"):
        s = report[f"scale_{phase}_{a.gpus}gpu"]
        ratio = "n/a" if s["ratio"] is None else f"{s['ratio']:.3f}x"
        print(f"[scale] {phase}: {_fmt(s['tokens_per_s_1'])} -> {_fmt(s[f'tokens_per_s_{a.gpus}'])} tok/s "
              f"= {ratio} (goal {s['goal']}){' ERROR ' + s['error'] if s['error'] else ''}", flush=True)
    if a.md:
        Path(a.md).write_text(markdown(report), encoding="utf-8")
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
