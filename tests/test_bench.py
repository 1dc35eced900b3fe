"""Benchmark: prompt sets, aggregation, the actor on a real tiny target + exported drafter, Ray + resume, report."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3_ray.bench.audit import TIE_ULPS, audit_turn, first_difference, ulp
from eagle3_ray.bench.prompts import load_prompt_sets
from eagle3_ray.bench.plots import ACCEPT_PLOT, TAU_PLOT, THROUGHPUT_PLOT, TRAINING_PLOT
from eagle3_ray.bench.report import REPORT_NAME, headline, lead, read_train_metrics, reference_sentence, write_report
from eagle3_ray.bench.runner import (
    PARTIAL_DIR,
    RESULTS_NAME,
    BenchActor,
    results_body,
    run_bench,
    summarize,
)
from eagle3_ray.config import BenchConfig, PipelineConfig, TargetConfig
from eagle3_ray.errors import ConfigError, DataError

TINY_TARGET = TargetConfig(model="random:builtin:tiny-llama", device="cpu", dtype="float32")
TINY_BENCH = {"max_new_tokens": 6, "num_steps": 3, "topk": 2, "depth": 3, "total_tokens": 6}
PNGS = (TAU_PLOT, ACCEPT_PLOT, THROUGHPUT_PLOT)


# --- prompt sets -------------------------------------------------------------------------------------


def test_builtin_demo_eval_by_category_round_robin():
    sets = load_prompt_sets("builtin:demo_eval")
    assert len(sets) == 8 and all(len(ps) == 3 for ps in sets.values())
    assert all(len(p.turns) == 2 and p.category == cat for cat, ps in sets.items() for p in ps)
    one_each = load_prompt_sets("builtin:demo_eval", max_prompts=8)
    assert list(one_each) == list(sets)
    assert [ps[0].id for ps in one_each.values()] == [ps[0].id for ps in sets.values()]
    two = load_prompt_sets("builtin:demo_eval", max_prompts=10)
    assert [len(ps) for ps in two.values()] == [2, 2, 1, 1, 1, 1, 1, 1]


def test_single_turn_file_takes_category_from_stem(tmp_path):
    f = tmp_path / "gsm8k.jsonl"
    lines = [{"question": "What is 2 + 3?"}, {"instruction": "Sum these.", "input": "1, 2"},
             {"prompt": "Hi", "category": "chat", "task_id": "t7"}]
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    sets = load_prompt_sets(f)
    assert [p.id for p in sets["gsm8k"]] == ["gsm8k-1", "gsm8k-2"]
    assert sets["gsm8k"][1].turns == ["Sum these.\n\n1, 2"]
    assert sets["chat"][0].id == "t7" and sets["chat"][0].turns == ["Hi"]


@pytest.mark.parametrize(
    "bad, message",
    [
        ('{"turns": ["ok"]', "malformed JSON"),
        ('{"turns": []}', "'turns' must be a non-empty list"),
        ('{"turns": ["fine", ""]}', "turns\\[1\\] must be a non-empty string"),
        ('{"answer": "no prompt here"}', "has no prompt"),
        ('{"question_id": 1, "turns": ["again"]}', "duplicate prompt id '1'"),
        ('["a", "list"]', "not a JSON object"),
        ('{"turns": ["a", "b", "c"], "answers": ["only one"]}', "'answers' must be a list of the replies"),
        ('{"turns": ["a", "b"], "answers": ["fine", ""]}', "answers\\[1\\] must be a non-empty string"),
    ],
)
def test_bad_record_names_file_and_line(tmp_path, bad, message):
    f = tmp_path / "mt.jsonl"
    f.write_text('{"question_id": 1, "category": "x", "turns": ["first"]}\n' + bad + "\n")
    with pytest.raises(DataError, match=rf"mt.jsonl:2: .*{message}"):
        load_prompt_sets(f)


# --- aggregation -------------------------------------------------------------------------------------


def _rec(pid, new_tokens, seconds, tau=None, steps=None, accept=(), identical=True, parts=None, divergence=None):
    stats = {"new_tokens": new_tokens, "seconds": seconds, "tau": tau, "verify_steps": steps,
             "accept_by_position": list(accept), "tokens_per_s": new_tokens / seconds, "parts": parts or {}}
    return {"prompt_id": pid, "turn": 0, "prompt_tokens": 10, "identical": identical, "divergence": divergence,
            "stats": stats}


def test_summarize_weights_turns_by_tokens_and_verify_steps():
    per_cat = {
        "a": {"baseline": [_rec("1", 10, 1.0), _rec("2", 30, 1.0)],
              "chain": [_rec("1", 10, 0.5, tau=2.0, steps=5, accept=[1.0, 0.0]),
                        _rec("2", 30, 0.5, tau=3.0, steps=10, accept=[0.9, 0.6], identical=False)]},
        "b": {"baseline": [_rec("3", 20, 2.0)],
              "chain": [_rec("3", 20, 1.0, tau=4.0, steps=5, accept=[1.0, 1.0])]},
    }
    r = summarize(per_cat, ["chain"])
    assert r["tau"]["chain"] == pytest.approx((2 * 5 + 3 * 10 + 4 * 5) / 20)
    assert r["baseline"]["tokens_per_s"] == pytest.approx(60 / 4.0)
    assert r["tokens_per_s"]["chain"] == pytest.approx(60 / 2.0)
    assert r["speedup"]["chain"] == pytest.approx(2.0)
    assert r["accept_by_position"]["chain"] == pytest.approx([(5 + 9 + 5) / 20, (0 + 6 + 5) / 20])
    assert r["per_category"]["a"]["chain"]["speedup"] == pytest.approx((40 / 1.0) / (40 / 2.0))
    assert r["per_category"]["b"]["chain"]["tau"] == pytest.approx(4.0)
    assert r["modes"]["chain"]["identical_to_baseline"] == pytest.approx(2 / 3)
    assert r["num_prompts"] == 3 and r["num_turns"] == 3
    assert r["prompt_lookup"] is None and r["untrained"] is None


def test_parts_per_cycle_divergences_and_summary_keys():
    explained = {"position": 3, "gap": 0.0, "explained": True}
    bug = {"position": 5, "gap": 4.0, "explained": False}
    per_cat = {"a": {
        "baseline": [_rec("1", 10, 1.0, steps=9, parts={"prefill": 0.1, "verify": 0.8, "accept": 0.1})],
        "chain": [_rec("1", 10, 0.5, tau=2.0, steps=4, identical=False, divergence=explained,
                       parts={"prefill": 0.1, "draft": 0.2, "verify": 0.12, "accept": 0.04, "commit": 0.04})],
        "tree": [_rec("1", 10, 2.0, tau=2.0, steps=4, identical=False, divergence=bug)],
    }}
    graphed = {"device": "cuda:0", "dtype": "bfloat16", "graphed_baseline": True, "draft_graphs": True}
    r = results_body(per_cat, BenchConfig(), graphed, sglang_plain_tokens_per_s=40.0)
    assert r["modes"]["chain"]["ms_per_cycle"] == pytest.approx(
        {"prefill": 100.0, "draft": 50.0, "verify": 30.0, "accept": 10.0, "commit": 10.0})
    assert r["baseline"]["ms_per_cycle"]["verify"] == pytest.approx(800 / 9)
    summary = r["summary"]
    assert summary["spec_vs_graphed_chain"] == pytest.approx(2.0)
    assert summary["spec_vs_graphed_tree"] == pytest.approx(0.5)
    assert summary["spec_vs_sglang_plain"] == pytest.approx({"chain": 0.5, "tree": 0.125})
    assert summary["bf16_divergent_turns"] == 2 and summary["bf16_unexplained_divergences"] == 1
    assert "bfloat16" in summary["divergence_bound"]
    assert [(d["kind"], d["position"]) for d in r["divergences"]] == [("chain", 3), ("tree", 5)]
    # Not graphed (CPU), no SGLang figure, sampling: those keys are null, not a number.
    cpu = results_body(per_cat, BenchConfig(temperature=0.7), {"device": "cpu", "dtype": "float32"})["summary"]
    assert cpu["spec_vs_graphed_chain"] is None and cpu["spec_vs_sglang_plain"] is None
    assert cpu["bf16_divergent_turns"] is None and cpu["bf16_unexplained_divergences"] is None


def test_rounding_bound_and_first_difference():
    assert ulp(20.0, torch.bfloat16) == 0.125 and ulp(-20.0, torch.bfloat16) == 0.125
    assert ulp(1.0, torch.bfloat16) == 2.0**-7 and ulp(1.0, torch.float32) == 2.0**-23
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2  # stopped early (EOS) counts as a difference
    top2 = [(30.0, 20.0), (20.0, 20.0 - TIE_ULPS * 0.125), (20.0, 19.0)]
    assert audit_turn([4, 5, 6], [4, 5, 6], top2, torch.bfloat16) is None
    tie = audit_turn([4, 5, 6], [4, 7, 6], top2, torch.bfloat16)
    assert tie["position"] == 1 and tie["gap_ulps"] == pytest.approx(TIE_ULPS) and tie["explained"] is True
    bug = audit_turn([4, 5, 6], [4, 5, 9], top2, torch.bfloat16)
    assert bug["gap_ulps"] == pytest.approx(8.0) and bug["explained"] is False
    assert audit_turn([4, 5, 6], [4, 7, 6], top2, torch.float32)["explained"] is False  # fp32: far tighter
    # The row's largest |logit| sets the scale, not the top two's: rounding moves every entry of a row
    # alike (the H200 turn that diverged at top logits 1.9 / 1.8 in rows reaching |logit| 40).
    small = [(1.875, 1.7734375, 39.75)]
    flat = audit_turn([4], [7], small, torch.bfloat16)
    assert flat["scale"] == 39.75 and flat["ulp"] == 0.25 and flat["explained"] is True
    assert audit_turn([4], [7], [small[0][:2]], torch.bfloat16)["explained"] is False  # at the top two's scale: 13 ulps
    assert audit_turn([4], [7], [(1.875, 0.5, 39.75)], torch.bfloat16)["explained"] is False  # 1.375 > 4 * 0.25


def test_headline_states_a_slowdown_first():
    results = {"tau": {"chain": 1.2, "tree": 1.5}, "speedup": {"chain": 0.5, "tree": 1.25}, "device": "cpu"}
    text = headline(results)
    assert text.startswith("**Slower than plain decoding on `cpu`: chain 0.50x (2.0x slower)")
    assert text.index("Slower") < text.index("Faster: tree 1.25x")
    results["speedup"] = {"chain": 1.5, "tree": 2.0}
    assert headline({**results, "graphed_baseline": True}).startswith(
        "**Faster than CUDA-graphed plain decoding on `cpu`: chain 1.50x, tree 2.00x**")


def test_lead_names_the_fastest_mode_or_says_none_beats_plain_decoding():
    results = {"tau": {"chain": 1.7, "tree": 2.1}, "speedup": {"chain": 1.12, "tree": 0.95}, "device": "cpu",
               "num_turns": 16, "modes": {"chain": {"identical_to_baseline": 1.0}},
               "config": {"bench": {"num_steps": 3, "max_new_tokens": 128}}}
    assert lead(results) == ("**Use chain (K=3) here: tau 1.70, 1.12x plain decoding on `cpu`** (16 turns of up to "
                             "128 new tokens; 100% of its outputs equal plain decoding's).")
    results["speedup"] = {"chain": 0.76, "tree": 0.81}
    slower = lead(results)
    assert slower.startswith("**No mode beats plain decoding on `cpu`; the fastest, tree") and "0.81x" in slower
    assert lead({"device": "cpu"}) == ""


def test_the_reports_opening_cites_the_reference_record_with_its_own_figures(tmp_path):
    record = tmp_path / "records" / "gpu_run.json"
    record.parent.mkdir()
    record.write_text(json.dumps({"values": {"tau_chain": 3.064, "tokens": 67307775}, "machine": "1x H100",
                                  "date": "2026-12-06"}))
    reference = {"record": str(record), "text": "On a GPU: tau {tau_chain:.2f} after {tokens:,} tokens ({machine})"}
    results = {"tau": {"chain": 1.7}, "speedup": {"chain": 1.12}, "tokens_per_s": {"chain": 28.0}, "device": "cpu",
               "num_turns": 4, "baseline": {"tokens_per_s": 25.0},
               "config": {"bench": {"num_steps": 3, "max_new_tokens": 64, "reference": reference}}}
    lines = write_report(results, tmp_path / "run" / "bench").read_text().splitlines()
    assert lines[2].startswith("**Use chain (K=3) here: tau 1.70, 1.12x plain decoding on `cpu`**")
    assert lines[2].endswith(" On a GPU: tau 3.06 after 67,307,775 tokens (1x H100) "
                             "([gpu_run](../../records/gpu_run.json)).")
    assert lines[4] == headline(results)
    with pytest.raises(ConfigError, match=r"'tau_tree'.*tau_chain, tokens"):
        reference_sentence({**reference, "text": "{tau_tree}"}, tmp_path)
    with pytest.raises(ConfigError, match="bench.reference=null"):
        reference_sentence({**reference, "record": str(tmp_path / "missing.json")}, tmp_path)


# --- report ------------------------------------------------------------------------------------------


def test_training_metrics_last_row_per_step_and_bad_line(tmp_path):
    f = tmp_path / "metrics.jsonl"
    rows = [{"step": 10, "loss": 5.0}, {"step": 20, "loss": 4.0}, {"step": 10, "loss": 4.5}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [(r["step"], r["loss"]) for r in read_train_metrics(f)] == [(10, 4.5), (20, 4.0)]
    f.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n')
    with pytest.raises(DataError, match="metrics.jsonl:2"):
        read_train_metrics(f)


# --- the actor on a real tiny target ------------------------------------------------------------------


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    """An exported, untrained (seeded random) drafter for the random tiny-llama target."""
    from eagle3_ray.drafter.export import export_drafter, save_drafter_weights
    from eagle3_ray.drafter.model import DrafterConfig, Eagle3Drafter
    from eagle3_ray.engines.targets import load_target

    target = load_target(TINY_TARGET)
    layers = target.model.config.num_hidden_layers
    cfg = DrafterConfig.from_target(target.model.config, draft_vocab_size=2048, aux_layers=[2, layers // 2, layers - 3])
    torch.manual_seed(1)
    root = tmp_path_factory.mktemp("drafter")
    save_drafter_weights(Eagle3Drafter(cfg), root / "ckpt")
    return str(export_drafter(root / "ckpt", root / "export", engine="sglang"))


@pytest.fixture
def prompt_file(tmp_path):
    f = tmp_path / "tiny_bench.jsonl"
    f.write_text(
        json.dumps({"question_id": 1, "category": "writing", "turns": ["Write a haiku.", "Now a shorter one."]})
        + "\n" + json.dumps({"question_id": 2, "category": "math", "turns": ["What is 12 * 7?"]}) + "\n"
    )
    return f


def _check_results(r, modes, untrained, lookup=True):
    kinds = ["baseline", *modes] + (["prompt_lookup"] if lookup else []) + (["untrained"] if untrained else [])
    assert set(r["tau"]) == set(r["speedup"]) == set(r["tokens_per_s"]) == set(modes)
    assert set(r["per_category"]) == {"writing", "math"}
    for cat in r["per_category"].values():
        assert set(cat) == set(kinds)
        for mode in modes:
            assert cat[mode]["tau"] >= 1.0 and cat[mode]["speedup"] > 0
    for mode in modes:
        assert r["tau"][mode] >= 1.0 and r["speedup"][mode] > 0
        acc = r["accept_by_position"][mode]
        assert acc and all(0.0 <= a <= 1.0 for a in acc)
        assert all(acc[i] >= acc[i + 1] for i in range(len(acc) - 1)), "'>= i accepted' cannot grow with i"
        # Greedy speculative decoding is lossless: every turn must reproduce the baseline's tokens.
        assert r["modes"][mode]["identical_to_baseline"] == 1.0
    assert r["num_prompts"] == 2 and r["num_turns"] == 3
    assert r["baseline"]["new_tokens"] == r["modes"][modes[0]]["new_tokens"] > 0
    assert (r["untrained"] is not None) == untrained
    if untrained:
        assert r["untrained"]["tau"] >= 1.0


def test_bench_actor_in_process_and_report(drafter_dir, prompt_file, tmp_path):
    bench = BenchConfig(**TINY_BENCH)
    actor = BenchActor(TINY_TARGET, drafter_dir, compare_untrained=True)
    results = actor.run(load_prompt_sets(prompt_file), bench)
    _check_results(results, ["chain", "tree"], untrained=True)
    assert results["drafter"] == drafter_dir and results["device"].startswith("cpu")
    summary = results["summary"]
    assert summary["spec_vs_graphed_chain"] is None and summary["graphed_baseline"] is False  # CPU: not graphed
    assert summary["bf16_divergent_turns"] == 0 and summary["bf16_unexplained_divergences"] == 0
    for kind in ("baseline", "chain", "tree"):
        ms = results["modes"][kind]["ms_per_cycle"] if kind != "baseline" else results["baseline"]["ms_per_cycle"]
        assert ms["verify"] > 0 and ms["prefill"] > 0 and (kind == "baseline" or ms["draft"] > 0)
    json.dumps(results)  # results.json must hold plain JSON values only

    report = write_report(results, tmp_path / "report")
    text = report.read_text()
    assert report.name == REPORT_NAME
    for png in PNGS:
        assert (tmp_path / "report" / png).stat().st_size > 0 and f"({png})" in text
    assert not (tmp_path / "report" / TRAINING_PLOT).exists()
    assert "Trained vs untrained" in text and "| writing |" in text
    assert "## Where the time goes" in text and "0 turns of the speculative modes differ" in text
    assert text.splitlines()[2].startswith(("**Use ", "**No mode beats plain decoding"))  # the lead
    assert text.splitlines()[4].startswith(("**Slower than plain decoding", "**Faster than plain decoding"))


def test_the_audit_of_a_differing_turn(drafter_dir, monkeypatch):
    """The actor's audit on the real tiny target (fp32): a turn that differs where the baseline's
    top-2 gap is far over fp32 rounding is reported as unexplained, at the right position; the
    teacher-forced replay stops at the last first difference."""
    from eagle3_ray import decode

    forced_lengths = []
    real_top2 = decode.target_top2

    def recording_top2(*args, forced=None, **kw):
        forced_lengths.append(len(forced))
        return real_top2(*args, forced=forced, **kw)

    monkeypatch.setattr(decode, "target_top2", recording_top2)
    actor = BenchActor(TINY_TARGET, drafter_dir)
    bench = BenchConfig(**TINY_BENCH)
    ids = actor._render([{"role": "user", "content": "Write a haiku."}])
    base = actor._runners(bench)["baseline"](ids, bench.max_new_tokens)[0]
    wrong = base[:2] + [(base[2] + 1) % 100] + base[3:]
    latest = {"baseline": {}, "chain": {}, "tree": {}}
    actor._audit(ids, {"baseline": base, "chain": wrong, "tree": base}, latest, bench)
    audit = latest["chain"]["divergence"]
    assert audit["position"] == 2 and audit["baseline_token"] == base[2] and audit["token"] == wrong[2]
    assert audit["replay_identical"] is True and audit["gap"] >= 0 and audit["explained"] is False
    assert "divergence" not in latest["tree"]
    assert forced_lengths == [3] and len(base) > 3  # positions 0..2, not the whole answer


def test_fixed_answers_are_the_history_so_that_every_drafter_sees_the_same_turns(drafter_dir, tmp_path):
    """A record's "answers" replace the baseline's replies in the history: the second turn's prompt is the
    first turn, the given answer and the second turn, whatever the baseline said; the same record without
    answers takes the baseline's reply."""
    f = tmp_path / "fixed.jsonl"
    turns = ["Write a haiku.", "Now a shorter one."]
    f.write_text(json.dumps({"question_id": "f", "category": "writing", "turns": turns,
                             "answers": ["Leaves fall in silence; the pond keeps every ring."]}) + "\n"
                 + json.dumps({"question_id": "g", "category": "writing", "turns": turns}) + "\n")
    sets = load_prompt_sets(f)
    assert sets["writing"][0].answers == ["Leaves fall in silence; the pond keeps every ring."]
    assert sets["writing"][1].answers is None
    actor = BenchActor(TINY_TARGET, drafter_dir)
    bench = BenchConfig(**{**TINY_BENCH, "modes": ["chain"], "prompt_lookup": False})
    records = actor.run_category(sets["writing"], bench)
    fixed = actor._render([{"role": "user", "content": turns[0]},
                           {"role": "assistant", "content": sets["writing"][0].answers[0]},
                           {"role": "user", "content": turns[1]}])
    second = {(r["prompt_id"], r["turn"]): r["prompt_tokens"] for r in records["chain"]}
    assert second[("f", 1)] == len(fixed)
    base = actor.target.tokenizer.decode(actor._runners(bench)["baseline"](actor._render(
        [{"role": "user", "content": turns[0]}]), bench.max_new_tokens)[0], skip_special_tokens=True)
    assert second[("g", 1)] == len(actor._render([{"role": "user", "content": turns[0]},
                                                   {"role": "assistant", "content": base},
                                                   {"role": "user", "content": turns[1]}]))
    assert second[("f", 1)] != second[("g", 1)]


def test_run_bench_on_ray_resumes_from_partials(ray_local, drafter_dir, prompt_file, tmp_path):
    bench = BenchConfig(**TINY_BENCH, modes=["chain"], prompt_lookup=False)
    cfg = PipelineConfig(target=TINY_TARGET, bench=bench)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 9.0 / s, "acc_0": 0.1 * s, "tau": 1 + 0.1 * s})
                               + "\n" for s in (1, 2, 3)))
    out = tmp_path / "bench"
    results = run_bench(cfg, drafter_dir, str(prompt_file), out=out, train_metrics=metrics)
    on_disk = json.loads((out / RESULTS_NAME).read_text())
    assert on_disk == results
    _check_results(on_disk, ["chain"], untrained=False, lookup=False)
    assert on_disk["prompt_lookup"] is None
    assert on_disk["config"]["prompts"] == str(prompt_file) and on_disk["config"]["bench"]["num_steps"] == 3
    # One prompt set: per_set names it by its file and holds the overall figures.
    assert list(on_disk["per_set"]) == ["tiny_bench"]
    assert on_disk["per_set"]["tiny_bench"]["chain"] == on_disk["modes"]["chain"]
    assert {"device", "target", "drafter"} <= set(on_disk)
    for png in (*PNGS, TRAINING_PLOT):
        assert (out / png).is_file()
    assert "## Training" in (out / REPORT_NAME).read_text()

    # Resume: a kept partial is reused as is (the marked number survives), a deleted one is measured again.
    parts = {json.loads(p.read_text())["category"]: p for p in (out / PARTIAL_DIR).glob("*.json")}
    assert set(parts) == {"writing", "math"}
    kept = json.loads(parts["writing"].read_text())
    kept["records"]["chain"][0]["stats"]["seconds"] = 1e6
    parts["writing"].write_text(json.dumps(kept))
    parts["math"].unlink()
    again = run_bench(cfg, drafter_dir, str(prompt_file), out=out)
    assert parts["math"].is_file()
    assert again["per_category"]["writing"]["chain"]["seconds"] >= 1e6
    assert again["per_category"]["math"]["chain"]["seconds"] < 1e6
