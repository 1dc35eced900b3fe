"""CPU smoke tests of every benchmark script (benchmarks/, benchmarks/device/): each is listed in
benchmarks/README.md; each Python script answers --help (or, with no command line, imports); each
shell script parses (bash -n); each override file loads with the preset it is run with; and the
scripts that have a run of a few seconds on a CPU do that run, through the product's own entry
points (TrainStep, the bench's prompt sets, the training reader). None starts Ray.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
README = (BENCH / "README.md").read_text()

DIRS = (BENCH, BENCH / "device", BENCH / "peers")  # peers: the side-by-side runs (benchmarks/peers/README.md)
PY = sorted(p for d in DIRS for p in d.glob("*.py"))
SH = sorted(p for d in DIRS for p in d.glob("*.sh"))
OVERRIDES = sorted((BENCH / "device" / "overrides").glob("*.txt"))
SCRIPTS = sorted([*PY, *SH, *OVERRIDES, *[p for d in DIRS[1:] for p in d.iterdir()
                                         if p.is_file() and p.name != "README.md"]])


def _id(path: Path) -> str:
    return str(path.relative_to(BENCH))


def _env() -> dict[str, str]:
    # one thread per process: tiny ops on a shared 2-core machine (tests/conftest.py, one_torch_thread)
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _run(args: list[str], cwd: Path = ROOT, timeout: int = 240) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{args[0]} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


# ------------------------------------------------------------------ listed in benchmarks/README.md

@pytest.mark.parametrize("path", sorted(set(SCRIPTS)), ids=_id)
def test_every_benchmark_file_is_listed_in_the_readme(path):
    rel = path.relative_to(ROOT)
    assert f"`{rel}`" in README, f"{rel} is not in benchmarks/README.md: list it (what, command, machine) or delete it"


def test_the_readme_lists_only_files_that_exist():
    listed = set(re.findall(r"`(benchmarks/[\w./-]+\.(?:py|sh|txt))`", README))
    assert listed and sorted(p for p in listed if not (ROOT / p).exists()) == []


# ------------------------------------------------------------------ --help, import, bash -n

HELP_DRIVER = r"""
import contextlib, io, json, os, runpy, sys, traceback
results = {}
for path in sys.argv[2:]:
    cli = "__name__ == \"__main__\"" in open(path).read()
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [path, "--help"]
    sys.path.insert(0, os.path.dirname(path))
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(path, run_name="__main__" if cli else "smoke_import")
        code = "returned" if cli else 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        code = "raised"
        out.write(traceback.format_exc())
    finally:
        sys.argv, sys.path = saved_argv, saved_path
    text = out.getvalue()
    results[path] = {"cli": cli, "code": code, "out": text[:1500] + "\n...\n" + text[-2500:]}
with open(sys.argv[1], "w") as f:
    json.dump(results, f)
"""


@pytest.fixture(scope="module")
def helped(tmp_path_factory):
    """Every script's --help (or import) in one process: torch is imported once, not per script."""
    out = tmp_path_factory.mktemp("help") / "help.json"
    _run(["-c", HELP_DRIVER, str(out), *map(str, PY)], timeout=600)
    return json.loads(out.read_text())


@pytest.mark.parametrize("path", PY, ids=_id)
def test_python_script_answers_help_or_imports(path, helped):
    got = helped[str(path)]
    assert got["code"] == 0, got["out"]
    if got["cli"]:
        assert "usage:" in got["out"], got["out"]


@pytest.mark.parametrize("path", SH, ids=_id)
def test_shell_script_parses(path):
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("path", OVERRIDES, ids=_id)
def test_override_file_loads_with_the_preset(path):
    """product_run.sh passes EXTRA="$(cat <file>)" unquoted to `eagle3-ray run -c configs/smollm2-h200.yaml`."""
    from eagle3_ray.config import load_config

    words = path.read_text().split()
    cfg = load_config(ROOT / "configs" / "smollm2-h200.yaml", words)
    assert cfg.bench.untrained is False and words


# ------------------------------------------------------------------ tiny CPU runs

def test_train_step_tiny_cpu_run(tmp_path):
    out = tmp_path / "step.json"
    _run(["benchmarks/train_step.py", "--preset", "smollm2", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
          "--head-dim", "16", "--intermediate", "128", "--vocab", "512", "--draft-vocab", "256", "--seq", "64",
          "--ttt-steps", "2", "--steps", "1", "--warmup", "1", "--json", str(out)])
    got = json.loads(out.read_text())
    assert got["best_mode"] and got["tokens_per_s"]


def test_train_step_length_sweep_tiny_cpu_run(tmp_path):
    """The long-sample wall's command (issue 49) at a tiny shape: two lengths of one sample per step, with
    the memory options on and --check comparing them with the plain step."""
    out = tmp_path / "sweep.json"
    _run(["benchmarks/train_step.py", "--preset", "smollm2", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
          "--head-dim", "16", "--intermediate", "128", "--vocab", "512", "--draft-vocab", "256", "--lengths", "64,128",
          "--ttt-steps", "7", "--steps", "1", "--warmup", "1", "--peak-tflops", "1", "--loss-chunk-tokens", "32",
          "--recompute-ttt-steps", "--check", "--json", str(out)])
    got = json.loads(out.read_text())
    assert got["memory_options"] == {"loss_chunk_tokens": 32, "recompute_steps": True}
    (mode, curve), = got["sweep"].items()
    assert [p["length"] for p in curve] == [64, 128] and not any(p["oom"] for p in curve)
    assert all(p["tokens_per_s"] > 0 and p["mfu"] > 0 for p in curve)
    assert got["longest_trained"] == {mode: 128}
    assert got["check"]["grad_rel_diff_max_sdpa/torch+options"] < 1e-5


def test_train_step_sweep_records_out_of_memory_and_stops():
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("train_step_bench", BENCH / "train_step.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    a = bench.parse_args(["--sweep", "--seq", "2048", "--max-length", "40000", "--device", "cpu"])
    assert bench.sweep_lengths(a) == [2048, 4096, 8192, 16384, 32768]
    assert bench.sweep_lengths(bench.parse_args(["--lengths", "64,128", "--device", "cpu"])) == [64, 128]

    class Engine:
        module = torch.nn.Linear(2, 2)

    def oom(batch):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    def bad(batch):
        raise ValueError("bad")

    got = bench._sweep_point(oom, lambda n: None, 65536, Engine(), torch.device("cpu"))
    assert got["oom"] and got["length"] == 65536 and "out of memory" in got["error"]
    with pytest.raises(ValueError):  # anything else is not an out-of-memory point
        bench._sweep_point(bad, lambda n: None, 64, Engine(), torch.device("cpu"))


def test_train_prompts_holds_out_the_evaluation_sets(tmp_path):
    """benchmarks/train_prompts.py on a tiny copy of ../shared/data's layout: a training prompt that is
    also an evaluation prompt is dropped; --eval-only-mt-bench appends MT-bench as mtbench-<id>."""
    sys.path.insert(0, str(BENCH))
    import train_prompts

    data = tmp_path / "data"
    data.mkdir()

    def write(name, rows):
        (data / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    write("gsm8k_train.jsonl", [{"question": "What is 2 + 2?"}, {"question": "What is 3 + 5?"}])
    write("alpaca_eval_prompts.jsonl", [{"id": 1, "instruction": "Write a haiku."}])
    write("arena_hard_v0.1.jsonl", [{"uid": "a", "prompt": "Name a prime."}])
    write("arena_hard_v2.0.jsonl", [])
    write("sharegpt500_prompts.jsonl", [{"id": "s1", "conversations": [{"role": "user", "content": "Hi there"}]}])
    write("oasst_prompt_lottery_en_250.jsonl", ["Tell me a joke."])
    write("oasst_en100_chat.jsonl", [])
    write("alpaca_seed_chat.jsonl", [])
    write("mt_bench.jsonl", [{"question_id": 81, "turns": ["Write a haiku.", "Shorter."]}])
    write("spec_bench.jsonl", [])
    write("gsm8k_test.jsonl", [{"question": "What is 3 + 5?"}])
    write("humaneval.jsonl", [])
    out = tmp_path / "prompts.jsonl"
    assert train_prompts.main(["--data", str(data), "--out", str(out), "--eval-only-mt-bench"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    prompts = {r["turns"][0] for r in rows if not r["id"].startswith("mtbench-")}
    assert prompts == {"What is 2 + 2?", "Name a prime.", "Hi there", "Tell me a joke."}
    assert [r for r in rows if r["id"].startswith("mtbench-")] == \
        [{"id": "mtbench-81", "turns": ["Write a haiku.", "Shorter."]}]


def _long_eval_data(tmp_path):
    """A tiny copy of ../shared/data's held-out sets (the layout benchmarks/long_eval_set.py reads)."""
    data = tmp_path / "data"
    data.mkdir()

    def write(name, rows):
        (data / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "it", "rains"]

    def text(i, n):
        return " ".join(words[(i + k) % len(words)] for k in range(n)) + f" ({i})"

    write("mt_bench.jsonl", [{"question_id": 81 + i, "category": "writing", "turns": [text(i, 20), f"Shorter {i}."]}
                             for i in range(6)])
    write("spec_bench.jsonl", [{"question_id": 81, "category": "writing", "turns": [text(0, 20), "Shorter 0."]}] +
          [{"question_id": 200 + i, "category": "summarization", "turns": [text(i, 60)]} for i in range(6)])
    write("gsm8k_test.jsonl", [{"question": f"What is {i} + {i}?", "answer": "x"} for i in range(12)])
    write("humaneval.jsonl", [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    return x\n"} for i in range(6)])
    return data


def test_long_eval_set_builds_length_buckets_splits_and_pools_tau(tmp_path):
    """benchmarks/long_eval_set.py: build (held-out sets -> MT-bench-form conversations whose rendered length
    lies in their bucket, deterministic, each source record once, its turns together, read by both the bench and
    the training reader), split (answered conversations -> pieces of whole exchanges within the limit) and tau
    (per-turn bench records pooled by prompt tokens)."""
    sys.path.insert(0, str(BENCH))
    import long_eval_set as les
    import long_tau

    from eagle3_ray.bench.prompts import load_prompt_sets
    from eagle3_ray.data.sources import Sample, read_samples

    data = _long_eval_data(tmp_path)
    out = tmp_path / "long.jsonl"
    argv = ["build", "--data", str(data), "--out", str(out), "--buckets", "256,512", "--per-bucket", "2",
            "--answer-tokens", "16", "--margin", "8"]
    assert les.main(argv) == 0
    text = out.read_text()
    assert les.main([*argv[:4], str(tmp_path / "again.jsonl"), *argv[5:]]) == 0
    assert (tmp_path / "again.jsonl").read_text() == text  # seeded: the same file
    rows = [json.loads(line) for line in text.splitlines()]
    assert [r["category"] for r in rows] == ["256", "512", "256", "512"]
    tok = les.load_tokenizer("smollm2")
    lengths = les.Lengths(tok, 16)
    used = []
    for r in rows:
        lower, upper = {256: 128, 512: 256}[r["bucket_tokens"]], r["bucket_tokens"] - 8
        assert r["estimated_tokens"] == lengths.ntok(lengths.text(r["turns"])) + 16
        assert lower < r["estimated_tokens"] <= upper
        flat = [t for p in r["provenance"] for t in [p["id"]] * p["turns"]]
        assert len(flat) == len(r["turns"]) == r["num_turns"]
        for i, t in enumerate(r["turns"]):  # an MT-bench record's second turn right after its first
            if t.startswith("Shorter "):
                assert flat[i - 1] == flat[i] and r["turns"][i - 1].endswith(f"({t.split()[1][:-1]})")
        used += [p["id"] for p in r["provenance"]]
    assert len(used) == len(set(used)) and not any(u == "spec_bench:81" for u in used)  # Spec-Bench's MT-bench copy out
    sets = load_prompt_sets(str(out))
    assert {c: len(p) for c, p in sets.items()} == {"256": 2, "512": 2}
    assert les.main(["thin", "--input", str(out), "--out", str(tmp_path / "half.jsonl"), "--every", "2"]) == 0
    assert [json.loads(line) for line in (tmp_path / "half.jsonl").read_text().splitlines()] == rows[:2]  # 1 a bucket
    assert les.main(["thin", "--input", str(out), "--out", str(tmp_path / "512.jsonl"), "--every", "1",
                     "--categories", "512"]) == 0
    assert [json.loads(line) for line in (tmp_path / "512.jsonl").read_text().splitlines()] == rows[1::2]
    samples = [s for s in read_samples(out) if isinstance(s, Sample)]
    assert [len(s.messages) for s in samples] == [r["num_turns"] for r in rows]

    # split: one answered conversation of 10 exchanges, a copy's id
    convo = {"id": "q7#s1", "conversations": [m for i in range(10) for m in (
        {"role": "user", "content": f"Question {i}: " + "tell me more " * 10},
        {"role": "assistant", "content": f"Answer {i}: " + "here it is " * 30})]}
    pieces = les.split_conversation(tok, convo, max_tokens=300)
    assert len(pieces) > 2 and all(p["tokens"] <= 300 for p in pieces)
    assert [p["id"] for p in pieces] == [f"q7@p{k}#s1" for k in range(len(pieces))]
    assert [m for p in pieces for m in p["conversations"]] == convo["conversations"]

    # history: a generate stage's replies become the records' fixed answers (matched by id; a copy's
    # suffix ignored); a record without its conversation keeps none, and the bench reads them
    answered = [{"id": f"{rows[0]['question_id']}#s1", "conversations": [
        m for i, t in enumerate(rows[0]["turns"]) for m in ({"role": "user", "content": t},
                                                           {"role": "assistant", "content": f"reply {i}"})]}]
    (tmp_path / "conv.jsonl").write_text("".join(json.dumps(c) + "\n" for c in answered))
    assert les.main(["history", "--input", str(out), "--conversations", str(tmp_path / "conv.jsonl"),
                     "--out", str(tmp_path / "fixed.jsonl")]) == 0
    fixed = [json.loads(line) for line in (tmp_path / "fixed.jsonl").read_text().splitlines()]
    assert fixed[0]["answers"] == [f"reply {i}" for i in range(len(rows[0]["turns"]))]
    assert all("answers" not in r for r in fixed[1:]) and [r["turns"] for r in fixed] == [r["turns"] for r in rows]
    by_id = {p.id: p for ps in load_prompt_sets(str(tmp_path / "fixed.jsonl")).values() for p in ps}
    assert by_id[str(rows[0]["question_id"])].answers == fixed[0]["answers"]

    # tau: two turns under 256 prompt tokens, one over
    bench = tmp_path / "bench"
    (bench / "partial").mkdir(parents=True)

    def rec(prompt_tokens, tau, steps):
        stats = {"new_tokens": int((tau or 1) * (steps or 16)), "seconds": 1.0, "tau": tau, "verify_steps": steps,
                 "accept_by_position": [0.5], "parts": {}}
        return {"prompt_id": "x", "turn": 0, "prompt_tokens": prompt_tokens, "identical": True, "divergence": None,
                "stats": stats}

    (bench / "partial" / "256.json").write_text(json.dumps({"records": {"chain": [rec(100, 2.0, 10), rec(200, 3.0, 30)],
                                                                        "baseline": [rec(100, None, 0)]}}))
    (bench / "partial" / "512.json").write_text(json.dumps({"records": {"chain": [rec(300, 1.5, 20)]}}))
    got = long_tau.tau_by_length(bench, [256, 512])
    assert got["chain"]["<256"]["tau"] == pytest.approx((2.0 * 10 + 3.0 * 30) / 40) and got["chain"]["<256"]["turns"] == 2
    assert got["chain"]["256-512"]["tau"] == 1.5 and ">=512" not in got["chain"]
    assert les.main(["tau", "--bench", str(bench), "--buckets", "256,512", "--out", str(tmp_path / "tau.json")]) == 0
    assert json.loads((tmp_path / "tau.json").read_text())["tau_by_prompt_tokens"][str(bench)]["chain"]["256-512"]["turns"] == 1

    # paired: two benches' same turns (one only in the first, not compared), by the first's prompt tokens
    def turns(spec):
        return {"records": {"chain": [{**rec(n, tau, steps), "prompt_id": pid, "turn": t}
                                      for pid, t, n, tau, steps in spec]}}

    first, second = tmp_path / "first", tmp_path / "second"
    for d, spec in ((first, [("a", 0, 100, 2.0, 10), ("a", 1, 300, 3.0, 10), ("b", 0, 50, 1.0, 5)]),
                    (second, [("a", 0, 100, 1.0, 10), ("a", 1, 290, 2.0, 30)])):
        (d / "partial").mkdir(parents=True)
        (d / "partial" / "x.json").write_text(json.dumps(turns(spec)))
    pair = long_tau.paired(first, second, [256, 512], draws=200)
    assert pair["all"]["turns"] == 2 and pair["same_prompt"] == 1
    assert pair["all"]["first"] == pytest.approx(2.5) and pair["all"]["second"] == pytest.approx((10 + 60) / 40)
    assert pair["all"]["ci95"][0] <= pair["all"]["diff"] <= pair["all"]["ci95"][1]
    assert pair["by_bucket"]["<256"]["diff"] == pytest.approx(1.0) and pair["by_bucket"]["256-512"]["diff"] == pytest.approx(1.0)
    assert les.main(["tau", "--bench", str(first), str(second), "--labels", "x,y", "--buckets", "256,512",
                     "--out", str(tmp_path / "pair.json")]) == 0
    assert json.loads((tmp_path / "pair.json").read_text())["paired"]["all"]["turns"] == 2


def test_capture_audit_tiny_cpu_run(tmp_path):
    """benchmarks/capture_audit.py on the tiny random target: answers, figures, every fault, the cost
    and one lm_head shape, through the product's engine and capture audit."""
    out = tmp_path / "audit.json"
    _run(["benchmarks/capture_audit.py", "--target", "random:builtin:tiny-llama", "--prompts", "2",
          "--max-new-tokens", "8", "--sets", "greedy,human", "--faults", "--cost", "0.1", "--repeats", "1",
          "--shape", "64,1024,2", "--shape-rows", "16", "--out", str(out)])
    got = json.loads(out.read_text())
    assert got["healthy"]["greedy"]["failing"] is None and got["healthy"]["greedy"]["greedy_rows"] > 0
    assert got["faults"]["aux_as_last"]["human"]["failing"] == "unnormed"
    assert got["faults"]["aux_off_by_one"]["caught"] is True
    assert "overhead_share_0.1" in got["cost"] and got["shape"][0]["gflop_per_row"] > 0
