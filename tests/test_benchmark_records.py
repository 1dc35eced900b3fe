"""The published benchmark figures are data: benchmarks/results/summary.json and the results README's
table are generated from the records (benchmarks/results/records/*.json) by benchmarks/summary.py,
every key has a record, every record says how, where, when and at which commit it was measured, and
every result file is indexed. Every record reruns at HEAD (the files its command names exist) or says it
cannot (``historical``: the commit where they did, checked against git), and the README's figures come
from records that rerun. The docs point only at files that exist. No Ray, no torch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))

import summary  # noqa: E402  benchmarks/summary.py

RECORDS = summary.load_records()


def test_there_are_records():
    assert len(RECORDS) >= 30


def test_every_summary_key_has_a_record():
    published = json.loads(summary.SUMMARY.read_text())
    keys = {k for k in published if not k.startswith("_")}
    recorded = {k for rec in RECORDS.values() for k in rec.get("values", {})}
    assert sorted(keys - recorded) == [], "summary.json keys with no record (benchmarks/results/records/)"


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_each_record_is_complete(name):
    assert [p for p in summary.problems(RECORDS) if p.startswith(f"records/{name}.json")] == []


def test_problems_are_found():
    good = RECORDS["extract_gpu_8b"]
    gone = "python3 benchmarks/device/gone.py --out $OUT && bash benchmarks/device/{a,b}.sh"
    bad = {
        "no_commit": {k: v for k, v in good.items() if k != "commit"},
        "no_config": {k: v for k, v in good.items() if k not in ("config", "drafter")},
        "twice": dict(good),
        "missing_file": dict(good, values={"x_key": 1}, files=["no_such_file.json"]),
        "bad_date": dict(good, values={"y_key": 1}, date="06.12.2026"),
        "gone_script": dict(good, values={"z_key": 1}, benchmark="benchmarks/device/gone.sh"),
        "gone_command": dict(good, values={"w_key": 1}, command=gone),
        "historical": dict(good, values={"v_key": 1}, command=gone, historical="abc1234"),
        "bad_historical": dict(good, values={"u_key": 1}, command=gone, historical="yesterday"),
    }
    found = "\n".join(summary.problems({"extract_gpu_8b": good, **bad}))
    for expected in ("no_commit.json: missing commit", "no_config.json: needs a config or a drafter",
                     "twice.json: extract_ratio is also in records/extract_gpu_8b.json",
                     "missing_file.json: file no_such_file.json does not exist",
                     "bad_date.json: date '06.12.2026' is not YYYY-MM-DD",
                     "gone_script.json: benchmark benchmarks/device/gone.sh does not exist",
                     "gone_command.json: command names benchmarks/device/gone.py, which does not exist",
                     "gone_command.json: command names benchmarks/device/a.sh",
                     "gone_command.json: command names benchmarks/device/b.sh",
                     "bad_historical.json: historical 'yesterday' is not a git commit id"):
        assert expected in found
    assert "records/historical.json" not in found  # a historical record may name what HEAD lacks


def test_commands_name_the_paths_they_run():
    cmd = ("source benchmarks/device/session.sh {gg1,gg2}; python benchmarks/x.py -c configs/a.yaml --out "
           "benchmarks/results/product8_smollm2_h100* (as `git show ee8d170:benchmarks/device/gone.py` had it; $OUT/benchmarks/z.py)")
    assert summary.named_paths(cmd) == ["benchmarks/device/session.sh", "benchmarks/x.py", "configs/a.yaml",
                                        "benchmarks/results/product8_smollm2_h100*"]
    assert summary.scripts_named(cmd) == ["benchmarks/device/session.sh", "benchmarks/x.py", "configs/a.yaml"]
    assert summary.missing_at_head(cmd) == ["benchmarks/x.py", "configs/a.yaml"]


HISTORICAL = {name: rec for name, rec in RECORDS.items() if "historical" in rec}


def _exists_at(pairs: list[tuple[str, str]]) -> list[bool]:
    """Whether each (commit, path) is in this repository's history (one `git cat-file --batch-check`)."""
    done = subprocess.run(["git", "-C", str(ROOT), "cat-file", "--batch-check"], capture_output=True, text=True,
                          input="".join(f"{c}:{p}\n" for c, p in pairs), check=True)
    return [not line.endswith(" missing") for line in done.stdout.splitlines()]


@pytest.mark.parametrize("name", sorted(HISTORICAL))
def test_a_historical_record_names_what_its_commit_holds(name):
    """``historical`` is where the command reruns: every script and config it names is in that commit's tree."""
    rec = HISTORICAL[name]
    pairs = [(rec["historical"], p) for p in summary.scripts_named(rec["command"])]
    assert [p for (_, p), ok in zip(pairs, _exists_at(pairs)) if not ok] == [], \
        f"records/{name}.json: files its command names that {rec['historical']} does not hold"


def test_the_history_check_can_fail():
    assert _exists_at([("HEAD", "benchmarks/summary.py"), ("HEAD", "benchmarks/device/gone.py")]) == [True, False]


README_RECORD = re.compile(r"benchmarks/results/records/([\w-]+)\.json")


def test_the_readme_figures_come_from_records_that_rerun_at_head():
    """README.md's results table links its records; none is historical (a reader can rerun each at HEAD)."""
    linked = README_RECORD.findall((ROOT / "README.md").read_text())
    assert len(linked) >= 5
    assert sorted(n for n in linked if n not in RECORDS) == [], "README.md links records that do not exist"
    assert sorted(n for n in linked if n in HISTORICAL) == [], "README.md cites historical records"


def test_summary_json_is_generated_from_the_records():
    assert summary.SUMMARY.read_text() == summary.render(RECORDS), \
        "summary.json differs from the records: run python benchmarks/summary.py"


def test_the_results_readme_table_is_generated_from_the_records():
    readme = summary.README.read_text()
    assert readme == summary.with_index(readme, RECORDS), \
        "the table in benchmarks/results/README.md differs from the records: run python benchmarks/summary.py"
    assert len(readme.splitlines()) < 300


def test_summary_check_passes_from_the_command_line(capsys):
    assert summary.main(["--check"]) == 0


def test_every_result_file_is_named_by_a_record_or_the_readme():
    named = {f.rstrip("/") for rec in RECORDS.values() for f in rec["files"]}
    other = summary.README.read_text().split("## Other files", 1)[1]
    named |= {m.rstrip("/") for m in re.findall(r"`([^`\s]+)`", other)}
    present = {p.name for p in RESULTS.iterdir()} - {"README.md", "summary.json", "records"}
    assert sorted(present - named) == [], \
        "result files no record lists and benchmarks/results/README.md's 'Other files' does not name"


# ------------------------------------------------------------ the docs point at files that exist

DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", RESULTS / "README.md",
        *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "configs").glob("*.yaml"))]
PATH = re.compile(r"(?<![:\w/.-])benchmarks/[\w./{},*-]+")


def _cited(text: str) -> set[str]:
    """benchmarks/... paths in the text, except `git show <commit>:benchmarks/...` (history)."""
    return {m.group(0).rstrip(".,;:") for m in PATH.finditer(text)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_cite_only_existing_benchmark_files(doc):
    missing = []
    for cited in sorted(_cited(doc.read_text())):
        for path in summary.expand(cited):
            if not (list(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()):
                missing.append(path)
    assert missing == [], f"{doc.relative_to(ROOT)} points at benchmark files that do not exist"


def test_the_citation_scan_skips_history_and_expands_braces():
    text = "see `benchmarks/a{1,2}.json`, and `git show ee8d170:benchmarks/device/gone.py`."
    assert _cited(text) == {"benchmarks/a{1,2}.json"}
    assert summary.expand("benchmarks/a{1,2}.json") == ["benchmarks/a1.json", "benchmarks/a2.json"]
