"""The command-line habits users bring from torchtitan, SpecForge and Ray: `eagle3-ray --version`,
`eagle3-ray config -c CFG [overrides] [--explain]` (the resolved config, with every field's description
and default from the one schema), and each command's --help naming the config sections it reads.
No Ray: none of these starts it."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

import eagle3_ray
from eagle3_ray.cli import build_parser, main
from eagle3_ray.config import RESOLVED_CONFIG_NAME, STAGE_SECTIONS, PipelineConfig, load_config, save_resolved

ROOT = Path(__file__).resolve().parent.parent
CI = "configs/ci-tiny.yaml"
OVERRIDES = ["train.lr=0.5", 'train.val_groups={mt_bench: "mtbench-.*"}', "bench.modes=[tree]"]


def _leaves(model: type[BaseModel], prefix: str = ""):
    """(dotted path, FieldInfo) of every value field of the schema (sections walked into)."""
    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield prefix + name, info
            yield from _leaves(ann, f"{prefix}{name}.")
        else:
            yield prefix + name, info


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's --version and --help
        rc = e.code
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_version_names_the_package_python_and_the_libraries_a_run_rests_on(capsys):
    rc, out, _ = _run(["--version"], capsys)
    assert rc == 0
    assert out.startswith(f"eagle3-ray {eagle3_ray.__version__} (Python {sys.version.split()[0]}; "), out
    for lib in ("ray", "torch", "deepspeed", "transformers"):
        assert f"{lib} {metadata.version(lib)}" in out
    # one version, the package's: pyproject reads it from eagle3_ray.__version__
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" in project["project"]["dynamic"] and "version" not in project["project"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "eagle3_ray.__version__"}


def test_the_installed_command_answers_version_in_a_real_process():
    proc = subprocess.run([sys.executable, "-m", "eagle3_ray.cli", "--version"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.startswith("eagle3-ray "), proc.stderr


def test_every_field_of_the_schema_has_a_one_line_description():
    missing = [path for path, info in _leaves(PipelineConfig) if not (info.description or "").strip()]
    assert missing == []
    assert [path for path, info in _leaves(PipelineConfig) if "\n" in info.description] == []


def test_config_prints_the_resolved_config_a_stage_saves(tmp_path, capsys):
    rc, out, err = _run(["config", "-c", CI, *OVERRIDES], capsys)
    assert rc == 0, err
    save_resolved(load_config(CI, OVERRIDES), tmp_path)
    assert out == (tmp_path / RESOLVED_CONFIG_NAME).read_text()
    assert yaml.safe_load(out)["train"]["lr"] == 0.5


def _explained(text: str) -> dict[str, tuple[str, str]]:
    """{dotted path: (its comment, joined; its value as written)} of an --explain output."""
    fields: dict[str, tuple[str, str]] = {}
    comment: list[str] = []
    stack: list[str] = []
    for line in text.splitlines()[1:]:  # the first line is the output's own header
        indent = (len(line) - len(line.lstrip())) // 2
        body = line.strip()
        if body.startswith("#"):
            comment.append(body[2:])
            continue
        key, _, value = body.partition(":")
        stack = stack[:indent] + [key]
        fields[".".join(stack)] = (" ".join(comment), value.strip())
        comment = []
    return fields


def test_explain_gives_every_field_its_description_and_default_and_loads_back(tmp_path, capsys):
    rc, out, err = _run(["config", "-c", CI, "--explain", *OVERRIDES], capsys)
    assert rc == 0, err
    (tmp_path / "explained.yaml").write_text(out)
    assert load_config(tmp_path / "explained.yaml") == load_config(CI, OVERRIDES)  # a config as it is
    fields = _explained(out)
    schema = dict(_leaves(PipelineConfig))
    assert set(fields) == set(schema)
    for path, info in schema.items():
        comment, _ = fields[path]
        assert comment.startswith(" ".join(info.description.split())), path
        is_section = isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel)
        assert ("[default: " in comment) != is_section, path
    # values as resolved (the override, the file), defaults as the schema has them
    assert fields["train.lr"] == (fields["train.lr"][0], "0.5") and fields["train.lr"][0].endswith("[default: 0.0001]")
    assert fields["train.max_steps"][1] == "8" and fields["train.max_steps"][0].endswith("[default: null]")
    assert fields["bench.modes"][1] == "[tree]" and fields["bench.modes"][0].endswith("[default: [chain, tree]]")
    assert fields["train.val_groups"][1] == "{mt_bench: mtbench-.*}"
    assert fields["train.keep_best"][0].endswith("[default: held_out_tau]")
    assert fields["name"][1] == "ci-tiny"
    assert all(len(line) <= 100 for line in out.splitlines() if line.lstrip().startswith("#"))


def test_config_refuses_a_bad_override_in_one_line(capsys):
    rc, out, err = _run(["config", "-c", CI, "train.trackers=[comet]"], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and out == "" and len(lines) == 1, err
    assert re.search(r"eagle3-ray config: error: invalid config .*train\.trackers\.0: Input should be 'tensorboard', "
                     r"'mlflow' or 'wandb' \(got 'comet'\)", lines[0]), lines[0]


def test_each_commands_help_names_the_config_sections_it_reads(capsys):
    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    assert set(STAGE_SECTIONS) == set(commands) - {"export", "config", "verify"}
    for command, sections in STAGE_SECTIONS.items():
        assert set(sections) <= set(PipelineConfig.model_fields) and "ray" in sections
        rc, out, _ = _run([command, "--help"], capsys)
        assert rc == 0
        assert f"Config sections read: {', '.join(sections)} (`eagle3-ray config -c CONFIG --explain`" in " ".join(
            out.split()), out
    assert STAGE_SECTIONS["run"] == tuple(f for f in PipelineConfig.model_fields if f != "name")
    rc, out, _ = _run(["export", "--help"], capsys)
    assert rc == 0 and "Takes no config" in out and "--which {best,latest}" in out
    rc, out, _ = _run(["verify", "--help"], capsys)  # no Ray: eagle3_ray/audit/cli.py
    assert rc == 0 and "Config sections read: target, extract" in " ".join(out.split())


# The modules that hold each command's use of its config (the `cfg` the CLI passes them), read as text.
STAGE_MODULES = {
    "prepare": ["extract/prepare_stage.py"],
    "generate": ["extract/generate_stage.py"],
    "extract": ["extract/pipeline.py", "extract/prepare_stage.py"],
    "vocab": ["extract/vocab_stage.py"],
    "train": ["train/trainer.py"],
    "bench": ["bench/runner.py", "bench/sglang_bench.py"],
}


def test_the_sections_a_help_names_cover_what_the_commands_code_reads():
    for command, modules in STAGE_MODULES.items():
        used = set()
        for module in modules:
            used |= set(re.findall(r"\bcfg\.(\w+)\b", (ROOT / "eagle3_ray" / module).read_text()))
        used &= set(PipelineConfig.model_fields) - {"name"}
        assert used <= set(STAGE_SECTIONS[command]), (command, sorted(used - set(STAGE_SECTIONS[command])))
