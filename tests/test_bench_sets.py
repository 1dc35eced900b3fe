"""Several prompt sets in one benchmark (bench.prompts as a list): loading, config, per_set, report.

The records are copied from the public sets the project benchmarks on (MT-bench, Spec-Bench,
GSM8K test, HumanEval), a few of each, so that the tests read nothing outside tmp_path.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_ray.bench.prompts import categories_by_set, load_prompt_sets
from eagle3_ray.bench.report import REPORT_NAME, headline, write_report
from eagle3_ray.bench.runner import _partial_key, _partial_path, results_body, summarize
from eagle3_ray.config import BenchConfig, PipelineConfig, PromptSetEntry, config_to_dict, load_config
from eagle3_ray.errors import ConfigError, DataError

MT_BENCH = [
    {"question_id": 81, "category": "writing", "turns": [
        "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences "
        "and must-see attractions.", "Rewrite your previous response. Start every sentence with the letter A."]},
    {"question_id": 87, "category": "writing", "turns": [
        "Could you write a captivating short story beginning with the sentence: The old abandoned house at the "
        "end of the street held a secret that no one had ever discovered.",
        "Now, do the same task again but only use four-word sentences."]},
    {"question_id": 117, "category": "math", "turns": [
        "How many integers are in the solution of the inequality |x + 5| < 10", "What about |x + 10| < 5"],
     "reference": ["19 integers (-14, ..., 4)", "9 integers (-14, ..., -6)"]},
    {"question_id": 120, "category": "math", "turns": [
        "Given that f(x) = 4x^3 - 9x - 14, find the value of f(2).", "Find x such that f(x) = 0."],
     "reference": ["f(2) = 0", "x = 2"]},
]
# Spec-Bench opens with MT-bench (same ids, same category names), then its own categories.
SPEC_BENCH = MT_BENCH[:1] + [
    {"question_id": 228, "category": "translation", "turns": [
        "Translate German to English: Es gibt nicht viel auszusetzen ."],
     "reference": ["There is not a lot you can criticise ."]},
]
GSM8K = [
    {"question": "Janet\u2019s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes "
     "muffins for her friends every day with four. She sells the remainder at the farmers' market daily for $2 "
     "per fresh duck egg. How much in dollars does she make every day at the farmers' market?",
     "answer": "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\nShe makes 9 * 2 = $<<9*2=18>>18 every "
     "day at the farmer\u2019s market.\n#### 18"},
    {"question": "A robe takes 2 bolts of blue fiber and half that much white fiber.  How many bolts in total "
     "does it take?", "answer": "It takes 2/2=<<2/2=1>>1 bolt of white fiber\nSo the total amount of fabric is "
     "2+1=<<2+1=3>>3 bolts of fabric\n#### 3"},
]
HUMANEVAL = [
    {"task_id": "HumanEval/53", "prompt": "\n\ndef add(x: int, y: int):\n    \"\"\"Add two numbers x and y\n"
     "    >>> add(2, 3)\n    5\n    >>> add(5, 7)\n    12\n    \"\"\"\n"},
    {"task_id": "HumanEval/55", "prompt": "\n\ndef fib(n: int):\n    \"\"\"Return n-th Fibonacci number.\n"
     "    >>> fib(10)\n    55\n    >>> fib(1)\n    1\n    >>> fib(8)\n    21\n    \"\"\"\n"},
]


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture
def sets_dir(tmp_path):
    _write(tmp_path / "mt_bench.jsonl", MT_BENCH)
    _write(tmp_path / "spec_bench.jsonl", SPEC_BENCH)
    _write(tmp_path / "gsm8k_test.jsonl", GSM8K)
    _write(tmp_path / "humaneval.jsonl", HUMANEVAL)
    return tmp_path


# --- loading -------------------------------------------------------------------------------------------


def test_one_entry_in_any_form_loads_as_a_single_file_did(sets_dir):
    mt = str(sets_dir / "mt_bench.jsonl")
    plain = load_prompt_sets(mt)
    assert list(plain) == ["writing", "math"]
    assert [p.id for p in plain["math"]] == ["117", "120"] and plain["math"][0].category == "math"
    assert categories_by_set(plain) == {"writing": "mt_bench", "math": "mt_bench"}
    for same in ([mt], {"path": mt}, [{"path": mt, "name": "mt"}], PromptSetEntry(path=mt)):
        loaded = load_prompt_sets(same)
        assert list(loaded) == ["writing", "math"]
        assert [(p.id, p.category, p.turns) for ps in loaded.values() for p in ps] == \
            [(p.id, p.category, p.turns) for ps in plain.values() for p in ps]
    # The global cap, and an entry's own cap in its place.
    assert [len(ps) for ps in load_prompt_sets(mt, max_prompts=3).values()] == [2, 1]
    assert [len(ps) for ps in load_prompt_sets({"path": mt, "max_prompts": 2}, max_prompts=3).values()] == [1, 1]


def test_several_sets_are_namespaced_capped_per_set_and_keep_their_ids(sets_dir):
    entries = [str(sets_dir / "mt_bench.jsonl"),
               {"path": str(sets_dir / "gsm8k_test.jsonl"), "max_prompts": 1, "name": "gsm8k"},
               {"path": str(sets_dir / "humaneval.jsonl")},
               str(sets_dir / "spec_bench.jsonl")]
    sets = load_prompt_sets(entries)
    assert list(sets) == ["mt_bench/writing", "mt_bench/math", "gsm8k/gsm8k_test", "humaneval/humaneval",
                          "spec_bench/writing", "spec_bench/translation"]
    # MT-bench's "writing" and Spec-Bench's (the same question, the same id) stay apart.
    assert [p.id for p in sets["mt_bench/writing"]] == ["81", "87"]
    assert [p.id for p in sets["spec_bench/writing"]] == ["81"]
    assert all(p.category == cat for cat, ps in sets.items() for p in ps)
    assert categories_by_set(sets) == {"mt_bench/writing": "mt_bench", "mt_bench/math": "mt_bench",
                                       "gsm8k/gsm8k_test": "gsm8k", "humaneval/humaneval": "humaneval",
                                       "spec_bench/writing": "spec_bench", "spec_bench/translation": "spec_bench"}
    assert [p.id for p in sets["gsm8k/gsm8k_test"]] == ["gsm8k_test-1"]  # its own cap: 1
    assert sets["humaneval/humaneval"][1].id == "HumanEval/55" and sets["humaneval/humaneval"][1].turns[0].startswith(
        "\n\ndef fib")
    # bench.max_prompts caps each set (round-robin over that set's categories), not the total.
    capped = load_prompt_sets(entries, max_prompts=2)
    assert {cat: len(ps) for cat, ps in capped.items()} == {
        "mt_bench/writing": 1, "mt_bench/math": 1, "gsm8k/gsm8k_test": 1, "humaneval/humaneval": 2,
        "spec_bench/writing": 1, "spec_bench/translation": 1}


def test_builtin_sets_are_named_by_their_builtin_name():
    sets = load_prompt_sets(["builtin:demo_eval", {"path": "builtin:demo_eval", "name": "again"}], max_prompts=8)
    assert len(sets) == 16 and set(categories_by_set(sets).values()) == {"demo_eval", "again"}
    assert next(iter(sets)).startswith("demo_eval/")


@pytest.mark.parametrize(
    "entries, message",
    [
        (lambda d: [{"path": str(d / "mt_bench.jsonl"), "max_promps": 3}],
         r"bench.prompts\[0\]: unknown key\(s\) \['max_promps'\].*"
         r"an entry takes only \['path', 'max_prompts', 'name'\]"),
        (lambda d: [str(d / "mt_bench.jsonl"), str(d / "nope.jsonl")],
         r"bench.prompts\[1\]: prompt file .*nope.jsonl does not exist; pass a JSONL/JSON file of prompts"),
        (lambda d: [str(d)], r"bench.prompts\[0\]: prompt file .* is a directory"),
        (lambda d: [str(d / "mt_bench.jsonl"), {"path": str(d / "mt_bench.jsonl")}],
         r"bench.prompts\[1\]: a second prompt set named 'mt_bench' \(first: bench.prompts\[0\]\).*give one of them "
         r"another name"),
        (lambda d: [{"path": str(d / "gsm8k_test.jsonl"), "name": "a/b"}], r"'name' must be .* without '/'"),
        (lambda d: [{"path": str(d / "gsm8k_test.jsonl"), "max_prompts": 0}], r"'max_prompts' must be an integer >= 1"),
        (lambda d: [{"max_prompts": 3}], r"bench.prompts\[0\]: 'path' must be a prompt file"),
        (lambda d: [], r"bench.prompts is an empty list"),
        (lambda d: [3], r"bench.prompts\[0\]: 3 is not a prompt set"),
        (lambda d: ["builtin:nope"], r"unknown builtin data set 'builtin:nope'"),
    ],
)
def test_bad_entries_say_what_to_change(sets_dir, entries, message):
    with pytest.raises(DataError, match=message):
        load_prompt_sets(entries(sets_dir))


# --- config --------------------------------------------------------------------------------------------


CONFIG = Path(__file__).resolve().parents[1] / "configs" / "smollm2-h200.yaml"


def _documented_override() -> str:
    """The several-sets override as configs/smollm2-h200.yaml's comment writes it (its lines joined)."""
    lines = [line.strip().lstrip("#").strip() for line in CONFIG.read_text().splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith("bench.prompts='["))
    text = lines[start]
    for line in lines[start + 1:]:
        if text.endswith("'"):
            break
        text += " " + line
    return text


def test_the_documented_override_parses_through_load_config(sets_dir):
    override = _documented_override()
    assert override.startswith("bench.prompts='[{path: mt_bench.jsonl") and override.endswith("]'")
    value = override.split("=", 1)[1][1:-1]  # what the shell passes: the quotes removed
    cfg = load_config(CONFIG, [f"bench.prompts={value}"])
    entries = cfg.bench.prompts
    assert isinstance(entries, list) and all(isinstance(e, PromptSetEntry) for e in entries)
    assert [(e.path, e.max_prompts) for e in entries[:3]] == [
        ("mt_bench.jsonl", 80), ("gsm8k_test.jsonl", 20), ("humaneval.jsonl", 20)]
    assert entries[3].name == "spec_bench"
    assert cfg.bench.max_prompts == 30  # the rest of the section as in the file
    assert load_config(CONFIG).bench.prompts is None  # one set by default (passed on the command line)
    # The same form over the files here loads, the sets in the order given.
    cwd_free = value.replace("{path: ", "{path: " + str(sets_dir) + "/")
    sets = load_prompt_sets(load_config(CONFIG, [f"bench.prompts={cwd_free}"]).bench.prompts, 30)
    assert list(dict.fromkeys(categories_by_set(sets).values())) == ["mt_bench", "gsm8k_test", "humaneval",
                                                                    "spec_bench"]


def test_prompts_config_forms_and_errors():
    assert load_config(None, ["bench.prompts=mt.jsonl"]).bench.prompts == "mt.jsonl"  # as before: a string
    listed = load_config(None, ["bench.prompts=[a.jsonl, b.jsonl]"]).bench.prompts
    assert listed == ["a.jsonl", "b.jsonl"]
    one = load_config(None, ["bench.prompts={path: a.jsonl, max_prompts: 5}"]).bench.prompts
    assert one == PromptSetEntry(path="a.jsonl", max_prompts=5)
    # The resolved config is plain JSON, and reads back to the same thing.
    cfg = load_config(None, ["bench.prompts=[a.jsonl, {path: b.jsonl, name: bee}]"])
    dumped = config_to_dict(cfg)["bench"]["prompts"]
    assert dumped == ["a.jsonl", {"path": "b.jsonl", "max_prompts": None, "name": "bee"}]
    assert PipelineConfig.model_validate(config_to_dict(cfg)).bench.prompts == cfg.bench.prompts
    for bad, message in [
        ("[a.jsonl, {path: b.jsonl, max_promts: 5}]",
         r"bench.prompts: .*entry 1 has unknown key\(s\) \['max_promts'\]"),
        ("[{path: b.jsonl, max_prompts: 0}]", r"bench.prompts: .*entry 0 .*max_prompts: Input should be greater"),
        ("[{name: x}]", r"entry 0 .*path: Field required"),
        ("[]", r"an empty list; give at least one prompt set"),
        ("[[a.jsonl]]", r"entry 0 \['a.jsonl'\] is not a prompt set"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, [f"bench.prompts={bad}"])


# --- per_set -------------------------------------------------------------------------------------------


def _rec(pid, new_tokens, seconds, tau=None, steps=None, turn=0):
    stats = {"new_tokens": new_tokens, "seconds": seconds, "tau": tau, "verify_steps": steps,
             "accept_by_position": [], "tokens_per_s": new_tokens / seconds, "parts": {}}
    return {"prompt_id": pid, "turn": turn, "prompt_tokens": 10, "identical": True, "divergence": None, "stats": stats}


PER_CAT = {
    "mt/writing": {"baseline": [_rec("1", 10, 1.0), _rec("2", 30, 1.0)],
                   "chain": [_rec("1", 10, 0.5, tau=2.0, steps=5), _rec("2", 30, 0.5, tau=3.0, steps=10)]},
    "mt/math": {"baseline": [_rec("1", 20, 2.0)], "chain": [_rec("1", 20, 1.0, tau=4.0, steps=5)]},
    "gsm8k/gsm8k": {"baseline": [_rec("1", 40, 1.0)], "chain": [_rec("1", 40, 2.0, tau=1.5, steps=20)]},
}
SET_OF = {"mt/writing": "mt", "mt/math": "mt", "gsm8k/gsm8k": "gsm8k"}


def test_per_set_pools_each_sets_turns_like_the_overall_figures():
    r = summarize(PER_CAT, ["chain"], SET_OF)
    assert list(r["per_set"]) == ["mt", "gsm8k"]
    mt, gsm = r["per_set"]["mt"], r["per_set"]["gsm8k"]
    assert mt["chain"]["tau"] == pytest.approx((2 * 5 + 3 * 10 + 4 * 5) / 20)  # token-weighted over its turns
    assert mt["chain"]["tokens_per_s"] == pytest.approx(60 / 2.0)
    assert mt["chain"]["speedup"] == pytest.approx((60 / 2.0) / (60 / 4.0))  # over the set's own baseline
    assert mt["chain"]["turns"] == 3 and mt["baseline"]["speedup"] == pytest.approx(1.0)
    assert gsm["chain"]["tau"] == pytest.approx(1.5) and gsm["chain"]["speedup"] == pytest.approx(0.5)
    # Each set's figures are those the overall aggregation gives on that set's categories alone.
    alone = summarize({c: PER_CAT[c] for c in ("mt/writing", "mt/math")}, ["chain"])
    assert mt == alone["modes"] | {"baseline": alone["baseline"]}
    assert r["tau"]["chain"] == pytest.approx((2 * 5 + 3 * 10 + 4 * 5 + 1.5 * 20) / 40)
    assert r["speedup"]["chain"] == pytest.approx((100 / 4.0) / (100 / 5.0))
    # No set names: one set, the overall figures.
    single = summarize(PER_CAT, ["chain"])
    assert list(single["per_set"]) == ["all"] and single["per_set"]["all"]["chain"] == single["modes"]["chain"]
    body = results_body(PER_CAT, BenchConfig(modes=["chain"]), {"device": "cpu", "dtype": "float32"},
                        set_of=SET_OF)
    assert body["per_set"] == r["per_set"]
    json.dumps(body)


def test_per_turn_pools_each_multi_turn_sets_turns_by_their_index(tmp_path):
    two_turns = {  # prompt 1 has two turns in writing; prompt 2 one in math (a set of 1- and 2-turn prompts)
        "mt/writing": {"baseline": [_rec("1", 10, 1.0), _rec("1", 30, 1.0, turn=1)],
                       "chain": [_rec("1", 10, 0.5, tau=2.0, steps=5), _rec("1", 30, 0.5, tau=3.0, steps=10, turn=1)]},
        "mt/math": {"baseline": [_rec("2", 20, 2.0)], "chain": [_rec("2", 20, 1.0, tau=4.0, steps=5)]},
        "gsm8k/gsm8k": PER_CAT["gsm8k/gsm8k"],
    }
    r = summarize(two_turns, ["chain"], SET_OF)
    assert list(r["per_turn"]) == ["mt"]  # gsm8k has first turns only: no rows of its own
    first, second = r["per_turn"]["mt"]["1"], r["per_turn"]["mt"]["2"]
    assert first["chain"]["tau"] == pytest.approx((2 * 5 + 4 * 5) / 10) and first["chain"]["turns"] == 2
    assert second["chain"]["tau"] == pytest.approx(3.0) and second["baseline"]["turns"] == 1
    assert second["chain"]["speedup"] == pytest.approx((30 / 0.5) / (30 / 1.0))  # over the same turns' baseline
    assert summarize(PER_CAT, ["chain"], SET_OF)["per_turn"] == {}
    body = results_body(two_turns, BenchConfig(modes=["chain"], prompt_lookup=False),
                        {"device": "cpu", "dtype": "float32"}, set_of=SET_OF)
    text = write_report(body, tmp_path / "turns").read_text()
    assert "## Per turn" in text and "| mt turn 2 | 1 | 3.00 | 2.00x |" in text
    text = write_report(results_body(PER_CAT, BenchConfig(modes=["chain"], prompt_lookup=False),
                                     {"device": "cpu", "dtype": "float32"}, set_of=SET_OF), tmp_path / "one").read_text()
    assert "## Per turn" not in text


def test_one_set_keeps_its_partial_names_and_keys(sets_dir, tmp_path):
    """An out dir of a run before several sets existed keeps its partial results: one entry, in any form,
    gives the categories, partial paths and partial keys of the plain path."""
    cfg = PipelineConfig()
    mt = str(sets_dir / "mt_bench.jsonl")
    drafter = str(tmp_path / "drafter")

    def partials(source):
        return {cat: (_partial_path(tmp_path, cat).name, _partial_key(cfg, drafter, False, ps))
                for cat, ps in load_prompt_sets(source).items()}

    assert partials([{"path": mt, "name": "renamed"}]) == partials(mt)
    several = partials([mt, str(sets_dir / "spec_bench.jsonl")])
    assert several["mt_bench/writing"][1] == partials(mt)["writing"][1]  # the same prompts measure the same
    assert several["mt_bench/writing"][0] != several["spec_bench/writing"][0]


# --- report --------------------------------------------------------------------------------------------


def test_report_has_a_per_set_table_and_names_the_first_sets_tau(tmp_path):
    results = results_body(PER_CAT, BenchConfig(modes=["chain"], prompt_lookup=False),
                           {"device": "cpu", "dtype": "float32"}, set_of=SET_OF)
    results["config"] = {"prompts": ["mt.jsonl", {"path": "gsm8k_test.jsonl", "max_prompts": 20, "name": "gsm8k"}]}
    text = write_report(results, tmp_path / "several").read_text()
    assert "## Per set" in text and text.index("## Per set") < text.index("## Per category")
    assert "| set | turns | chain tau | chain speedup |" in text
    assert "| mt | 3 | 3.00 | 2.00x |" in text and "| gsm8k | 1 | 1.50 | 0.50x |" in text
    assert "| mt/writing |" in text
    assert "- prompts: `mt.jsonl`, `gsm8k_test.jsonl` (name gsm8k, max_prompts 20), 4 prompts, 4 turns" in text
    assert text.splitlines()[2].startswith("**Use chain here: tau 2.25, 1.25x")  # the lead: the fastest mode
    line = text.splitlines()[4]
    assert line == headline(results)
    assert line.startswith("**Faster than plain decoding on `cpu`: chain 1.25x**")  # the overall figure
    assert line.endswith("**tau on mt** (first of 2 prompt sets): chain 3.00.")

    one = summarize({c: PER_CAT[c] for c in ("mt/writing", "mt/math")}, ["chain"], SET_OF)
    one.update(device="cpu", config={"prompts": "mt.jsonl"})
    report = write_report(one, tmp_path / "one")
    assert report.name == REPORT_NAME
    text = report.read_text()
    assert "## Per set" not in text and "tau on" not in text and "- prompts: `mt.jsonl`," in text


def test_preflight_checks_every_set_of_a_list(sets_dir):
    """The run's preflight reads several sets (it used to pass the list to a one-file check and crash)."""
    from eagle3_ray.preflight import check_prompts

    ok = load_config(None, [f"bench.prompts=[{sets_dir / 'mt_bench.jsonl'}, {{path: {sets_dir / 'gsm8k_test.jsonl'}, "
                            "max_prompts: 1}]"])
    check_prompts(ok, None)
    missing = load_config(None, [f"bench.prompts=[{sets_dir / 'mt_bench.jsonl'}, {sets_dir / 'nope.jsonl'}]"])
    with pytest.raises(DataError, match="nope.jsonl"):
        check_prompts(missing, None)
