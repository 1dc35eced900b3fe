"""`eagle3-ray run` end to end on ci-tiny (real Ray, real DeepSpeed), and a rerun skips every stage.

The run is the session's one whole CLI run (conftest.py's ``ci_tiny_run``: stopped hard
mid-training and rerun to the end; test_fault_injection.py checks the resume)."""

from __future__ import annotations

import json

import pytest

from eagle3_ray.config import load_config

STAGES = ("prepare", "extract", "vocab", "train", "export", "bench")
# Where each stage's _DONE.json sits: beside its output.
MARKER_DIRS = {"prepare": "prepare", "extract": "features", "vocab": "vocab", "train": "train",
               "export": "drafter", "bench": "bench"}


def test_run_writes_drafter_results_and_report_then_resumes(ci_tiny_run, ray_local, capsys):
    from eagle3_ray.drafter import load_drafter
    from eagle3_ray.pipeline import run_pipeline

    out = ci_tiny_run["out"]
    cfg = load_config("configs/ci-tiny.yaml", list(ci_tiny_run["overrides"]))
    drafter = load_drafter(out / "drafter")
    assert drafter.config.draft_vocab_size == cfg.vocab.draft_vocab_size
    results = json.loads((out / "bench" / "results.json").read_text())
    untrained = results["untrained"]
    assert untrained is not None  # seeded random weights: the floor
    for kind in ("chain", "tree", "untrained"):
        run = untrained if kind == "untrained" else results["modes"][kind]
        # fp32 on the CPU: speculative decoding is lossless, every turn equals greedy decoding
        assert run["identical_to_baseline"] == 1.0, (kind, run["identical_to_baseline"])
    # The 12 steps lower the TTT loss and raise the drafter's simulated tau above the untrained
    # drafter's (the first step's, same run). Two 16-token prompts on a random target are too few for
    # the measured tau to tell them apart, so the benchmark's tau is checked against its own counts:
    # per verify step, 1 + the accepted draft tokens = 1 + the sum of the per-position accept rates.
    metrics = [json.loads(line) for line in (out / "train" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["loss"] < metrics[0]["loss"], [m["loss"] for m in metrics]
    assert metrics[-1]["tau"] > metrics[0]["tau"], [m["tau"] for m in metrics]
    for run in (results["modes"]["chain"], untrained):
        assert run["tau"] == pytest.approx((run["new_tokens"] - run["turns"]) / run["verify_steps"]), run
        assert run["tau"] == pytest.approx(1 + sum(run["accept_by_position"])), run
    assert results["tau"]["chain"] == results["modes"]["chain"]["tau"] <= 1 + cfg.bench.num_steps
    assert results["tau"]["tree"] <= 1 + cfg.bench.depth
    for mode in ("chain", "tree"):
        assert results["speedup"][mode] == pytest.approx(
            results["modes"][mode]["tokens_per_s"] / results["baseline"]["tokens_per_s"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tau"] == results["tau"] and summary["untrained_tau"] == untrained["tau"]
    # One report, written by the bench stage, with the training section from metrics.jsonl.
    report = (out / "bench" / "report.md").read_text()
    assert summary["report"] == str(out / "bench" / "report.md") and "training" in report.lower()
    # The report opens with its results' lead (test_fault_injection.py may have rerun the bench into this
    # out since the run wrote summary.json: the report and results.json are then that rerun's).
    from eagle3_ray.bench.report import lead

    assert report.splitlines()[2] == lead(results) and lead(results).startswith(("**Use ", "**No mode beats"))
    assert summary["lead"].startswith(("**Use ", "**No mode beats"))
    assert not (out / "report.md").exists()
    assert (out / "config.resolved.yaml").is_file()
    for stage in STAGES:
        assert (out / MARKER_DIRS[stage] / "_DONE.json").is_file(), stage
        assert MARKER_DIRS[stage] == stage or not (out / stage).exists(), stage

    capsys.readouterr()
    run_pipeline(cfg, data=None, out=out)
    printed = capsys.readouterr().out
    for stage in STAGES:
        assert f"[run] {stage}: done earlier, skipping" in printed


def test_a_stage_marker_left_where_older_runs_wrote_it_still_resumes(tmp_path, capsys):
    """Runs before the markers moved beside their outputs left out/extract/_DONE.json: still skipped."""
    from eagle3_ray.pipeline import DONE, StageRunner, _stage_hash

    cfg = load_config("configs/ci-tiny.yaml")
    (tmp_path / "extract").mkdir()
    (tmp_path / "extract" / DONE).write_text(json.dumps({"hash": _stage_hash(cfg, "extract", None), "result": "x"}))
    stages = StageRunner(cfg, tmp_path, None)
    assert stages.run("extract", lambda d: pytest.fail("a finished stage ran again")) == "x"
    assert "[run] extract: done earlier, skipping" in capsys.readouterr().out
    ran = []
    assert stages.run("export", lambda d: ran.append(d) or "y") == "y"  # no marker: runs, marks its output dir
    assert ran == [tmp_path / "drafter"] and (tmp_path / "drafter" / DONE).is_file()
    assert StageRunner(cfg, tmp_path, None).run("export", lambda d: pytest.fail("ran again")) == "y"


def test_a_finished_stage_resumes_after_its_out_dir_moved(tmp_path, capsys):
    """An out dir renamed, or restored on another machine under another path, resumes: a finished
    stage's recorded output path (the generate stage's conversations, read by prepare) is found in the
    out dir where it is now. The seventh product run's restored generate stage failed that way."""
    from eagle3_ray.pipeline import DONE, StageRunner

    cfg = load_config("configs/ci-tiny.yaml")
    old, new = (tmp_path / "old").resolve(), (tmp_path / "new").resolve()

    def generate(d):
        d.mkdir(parents=True)
        (d / "conversations.jsonl").write_text("{}\n")
        return str(d / "conversations.jsonl")

    assert StageRunner(cfg, old, None).run("generate", generate) == str(old / "generate" / "conversations.jsonl")
    old.rename(new)
    moved = str(new / "generate" / "conversations.jsonl")
    capsys.readouterr()
    assert StageRunner(cfg, new, None).run("generate", lambda d: pytest.fail("ran again")) == moved
    assert f"its output moved with the out dir: {old / 'generate' / 'conversations.jsonl'} is now {moved}" in \
        capsys.readouterr().out
    # A marker written on another machine, under another out dir: the path after the stage's directory.
    marker = new / "generate" / DONE
    saved = json.loads(marker.read_text())
    saved["result"] = "/tmp/product7/out/generate/conversations.jsonl"
    marker.write_text(json.dumps(saved))
    assert StageRunner(cfg, new, None).run("generate", lambda d: pytest.fail("ran again")) == moved
    # Nowhere to be found: returned as recorded, for the stage that reads it to name.
    saved["result"] = "/tmp/product7/out/generate/other.jsonl"
    marker.write_text(json.dumps(saved))
    assert StageRunner(cfg, new, None).run("generate", lambda d: pytest.fail("ran again")) == saved["result"]
    # Results that are not paths are kept as they are.
    assert StageRunner(cfg, new, None).run("export", lambda d: "y") == "y"
    assert StageRunner(cfg, new, None).run("export", lambda d: pytest.fail("ran again")) == "y"


def test_stage_hashes_of_one_answer_per_prompt_match_runs_made_before_copies():
    """generate.samples_per_prompt=1, synthetic_prompts=0 and after_tools=keep (the defaults) hash as the
    config did before the options (an out dir of earlier runs still resumes); more copies, or their
    temperature then, synthetic requests, or regenerated answers after tool results redo the stages."""
    import hashlib

    from eagle3_ray.config import config_to_dict, load_config
    from eagle3_ray.pipeline import STAGE_DEPS, _stage_hash

    cfg = load_config("configs/ci-tiny.yaml")
    full = config_to_dict(cfg)
    for k in ("samples_per_prompt", "sample_temperature", "synthetic_prompts", "after_tools"):
        del full["generate"][k]
    del full["train"]["val_cache_bytes"]  # how evaluation reads, not what a stage writes: never hashed
    del full["train"]["loss_chunk_tokens"], full["train"]["recompute_ttt_steps"]  # what the backward recomputes
    del full["train"]["val_groups"], full["train"]["eval_only"]  # empty: as before the options
    del full["train"]["context_parallel"]  # 1 (off): as before the option
    del full["train"]["warmup_ratio"]  # unset: as before the option
    del full["train"]["keep_best"]  # held_out_tau (the default): as before the option
    del full["train"]["lm_head_init"]  # random (the default): as before the option
    del full["train"]["trackers"], full["train"]["tracking"]  # where metrics go, not what a stage writes: never hashed
    del full["target"]["sglang"]["max_concurrent_calls"]  # how SGLang is called, likewise
    del full["bench"]["engine"], full["bench"]["concurrency"]  # auto on an HF target: as before the options
    del full["generate"]["answers"]  # how the stage gets its answers, not what they say: never hashed
    del full["bench"]["reference"]  # a sentence of the report citing another record: never hashed
    for stage, deps in STAGE_DEPS.items():  # the formula before the option, on the config without it
        old = hashlib.sha256(json.dumps({**{k: full[k] for k in deps}, "_data": "d"}, sort_keys=True)
                             .encode()).hexdigest()[:16]
        assert _stage_hash(cfg, stage, "d") == old
    before = _stage_hash(cfg, "train", "d")
    assert _stage_hash(load_config("configs/ci-tiny.yaml", ["generate.sample_temperature=0.9"]), "train", "d") == before
    assert _stage_hash(load_config("configs/ci-tiny.yaml", ["train.warmup_ratio=0.02"]), "train", "d") != before
    two = load_config("configs/ci-tiny.yaml", ["generate.samples_per_prompt=2"])
    assert _stage_hash(two, "train", "d") != before
    assert _stage_hash(load_config("configs/ci-tiny.yaml", ["generate.after_tools=regenerate"]), "prepare", "d") != \
        _stage_hash(cfg, "prepare", "d")
    assert _stage_hash(two, "train", "d") != _stage_hash(
        load_config("configs/ci-tiny.yaml", ["generate.samples_per_prompt=2", "generate.sample_temperature=0.9"]),
        "train", "d")
    assert _stage_hash(load_config("configs/ci-tiny.yaml", ["train.val_cache_bytes=0"]), "bench", "d") == \
        _stage_hash(cfg, "bench", "d")
    assert _stage_hash(load_config("configs/ci-tiny.yaml", ["train.loss_chunk_tokens=4096",
                                                             "train.recompute_ttt_steps=true"]), "bench", "d") == \
        _stage_hash(cfg, "bench", "d")
    first_two = load_config("configs/ci-tiny.yaml", ["train.recompute_ttt_steps=2"])  # k steps: no stage redone either
    for stage in STAGE_DEPS:
        assert _stage_hash(first_two, stage, "d") == _stage_hash(cfg, stage, "d"), stage
    assert _stage_hash(load_config("configs/ci-tiny.yaml", ["target.sglang.max_concurrent_calls=1"]), "bench", "d") == \
        _stage_hash(cfg, "bench", "d")
    tracked = load_config("configs/ci-tiny.yaml", ["train.trackers=[tensorboard,wandb]", "train.tracking.project=p"])
    taking = load_config("configs/ci-tiny.yaml", ["generate.answers=builtin:demo_answers",
                                                  "bench.reference={record: r.json, text: t}"])
    latest = load_config("configs/ci-tiny.yaml", ["train.keep_best=none"])
    headed = load_config("configs/ci-tiny.yaml", ["train.lm_head_init=target"])
    for stage in STAGE_DEPS:
        # another drafter at step 0: training and what follows it are redone
        assert (_stage_hash(headed, stage, "d") == _stage_hash(cfg, stage, "d")) == (stage not in
                                                                                     ("train", "export", "bench"))
        assert _stage_hash(tracked, stage, "d") == _stage_hash(cfg, stage, "d"), stage
        assert _stage_hash(taking, stage, "d") == _stage_hash(cfg, stage, "d"), stage
        # another checkpoint kept and exported: training and what follows it are redone
        assert (_stage_hash(latest, stage, "d") == _stage_hash(cfg, stage, "d")) == (stage not in
                                                                                     ("train", "export", "bench"))
    # the bench's engine options redo the bench where they change what it measures, and only there
    assert _stage_hash(load_config("configs/ci-tiny.yaml", ["bench.concurrency=[1,4]"]), "bench", "d") == \
        _stage_hash(cfg, "bench", "d")  # the HF bench does not read it
    sglang = load_config("configs/ci-tiny.yaml", ["bench.engine=sglang"])
    assert _stage_hash(sglang, "bench", "d") != _stage_hash(cfg, "bench", "d")
    assert _stage_hash(sglang, "train", "d") == _stage_hash(cfg, "train", "d")
    assert _stage_hash(load_config("configs/ci-tiny.yaml", ["bench.engine=sglang", "bench.concurrency=[1,4]"]),
                       "bench", "d") != _stage_hash(sglang, "bench", "d")
    assert _stage_hash(load_config("configs/ci-tiny.yaml", ["generate.synthetic_prompts=100"]), "generate", "d") != \
        _stage_hash(cfg, "generate", "d")  # the target's own requests: other data
    # evaluation-only groups change what the vocab stage counts and what is trained; groups alone only
    # what training reports; neither touches the stages before
    groups = ['train.val_groups={mt_bench: "mtbench-.*"}']
    only = load_config("configs/ci-tiny.yaml", [*groups, "train.eval_only=[mt_bench]"])
    named = load_config("configs/ci-tiny.yaml", groups)
    for stage in ("vocab", "train", "bench"):
        assert _stage_hash(only, stage, "d") != _stage_hash(cfg, stage, "d")
    assert _stage_hash(named, "vocab", "d") == _stage_hash(cfg, "vocab", "d")
    assert _stage_hash(named, "train", "d") != _stage_hash(cfg, "train", "d")
    for stage in ("generate", "extract"):
        assert _stage_hash(only, stage, "d") == _stage_hash(cfg, stage, "d")


def test_a_rerun_over_edited_input_data_is_refused_before_any_stage(tmp_path):
    """The stages resume by sample id: a rerun whose data file changed under the same ids (here one
    prompt edited) would keep the old answers; run_pipeline refuses it, naming both files, before
    any stage runs (no Ray starts). The same content at another path, and an out dir written before
    the record existed, pass."""
    from eagle3_ray.errors import ConfigError
    from eagle3_ray.pipeline import INPUTS, check_inputs, run_pipeline

    cfg = load_config("configs/ci-tiny.yaml")
    data, out = tmp_path / "prompts.jsonl", tmp_path / "out"
    data.write_text('{"id": "a", "prompt": "Name a prime."}\n{"id": "b", "prompt": "Name a colour."}\n')
    out.mkdir()
    check_inputs(cfg, str(data), out)  # as the first run did
    recorded = json.loads((out / INPUTS).read_text())
    assert recorded["data"] == str(data) and recorded["bytes"] == data.stat().st_size
    (out / "generate").mkdir()
    (out / "generate" / "conversations.part-000.jsonl").write_text('{"id": "a", "conversations": []}\n')

    data.write_text('{"id": "a", "prompt": "Name an even prime."}\n{"id": "b", "prompt": "Name a colour."}\n')
    with pytest.raises(ConfigError, match=r"other input data: .*prompts\.jsonl .*pass another --out"):
        run_pipeline(cfg, str(data), out)
    assert (out / "generate" / "conversations.part-000.jsonl").read_text() == '{"id": "a", "conversations": []}\n'
    assert json.loads((out / INPUTS).read_text()) == recorded  # the record still names the first data

    moved = tmp_path / "moved.jsonl"
    moved.write_bytes(data.read_bytes())
    (out / INPUTS).unlink()  # an out dir of a run before the record: taken as written from this data
    check_inputs(cfg, str(data), out)
    check_inputs(cfg, str(moved), out)  # same content, another path
    assert json.loads((out / INPUTS).read_text())["data"] == str(moved)
