"""The bad-input corpus: every kind of bad input gets a specific error naming the fix, or is quarantined.

One table, one row per kind. A row either
  - quarantines: the bad record becomes a reject with its reason and the good records around it are kept;
  - raises: a specific ``eagle3_ray.errors`` type whose message matches;
  - goes through the CLI: exit code 2 and exactly one ``eagle3-ray <cmd>: error: ...`` line, no traceback.
Each kind of bad agentic record (tool calls, tool results, tools, reasoning) has two rows: quarantined
among good records, and alone, refused by `prepare` with the record's file:line and fix in that line.
Files live in tests/data/bad/; inputs too large to ship (a multi-megabyte line) or that need a real
store/checkpoint are made in tmp_path by the row itself. No Ray: every check here runs before Ray
would start, which is the point (fail before spending cluster time). Wrong *paths* (a directory that
is no store, checkpoint, drafter or data file, for every path argument of every command) are in
tests/test_cli_paths.py.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from eagle3_ray.config import load_config
from eagle3_ray.errors import ConfigError, DataError, Eagle3Error, SampleRejected, StoreError

BAD = Path(__file__).parent / "data" / "bad"
CI_CONFIG = "configs/ci-tiny.yaml"
HIDDEN = 64  # the ci-tiny target's hidden size
VOCAB = 49152


@dataclass
class Case:
    kind: str
    run: Callable[[Path], Any]
    expect: type[Exception] | str  # an error type, "quarantine", or "cli"
    match: str  # regex the reason / message / error line must contain
    kept: int = 0  # good records that must survive a quarantine
    blocked: tuple[str, ...] = ()  # modules made unimportable for the row (a package that is not installed)


# ---------------------------------------------------------------- triggers


def _read(name_or_path: str | Path) -> tuple[list[str], int]:
    """(reject reasons, samples kept) of reading one data file."""
    from eagle3_ray.data.sources import Reject, read_samples

    items = list(read_samples(name_or_path if isinstance(name_or_path, Path) else BAD / name_or_path))
    return [i.reason for i in items if isinstance(i, Reject)], sum(not isinstance(i, Reject) for i in items)


def _huge_line(tmp: Path) -> tuple[list[str], int]:
    """A 4 MB line that never closes its JSON, between two good records."""
    good = (BAD / "malformed_json.jsonl").read_text(encoding="utf-8").splitlines()[0]
    path = tmp / "huge_line.jsonl"
    path.write_text(good + "\n" + '{"id": "huge", "conversations": [{"role": "user", "content": "'
                    + "x" * (4 * 2**20) + "\n" + good.replace("ok-1", "ok-2") + "\n", encoding="utf-8")
    reasons, kept = _read(path)
    assert all(len(r) < 200 for r in reasons), "a reject reason must not echo the huge line"
    return reasons, kept


_TOKENIZER: list[Any] = []


def _tokenize(name: str, max_length: int = 512) -> tuple[list[str], int]:
    """Read then tokenize with the ci-tiny target's tokenizer, as the prepare stage does."""
    from transformers import AutoTokenizer

    from eagle3_ray.data.chat import tokenize_conversation
    from eagle3_ray.data.sources import Sample, read_samples
    from eagle3_ray.engines.describe import tokenizer_path_for

    if not _TOKENIZER:
        _TOKENIZER.append(AutoTokenizer.from_pretrained(tokenizer_path_for(load_config(CI_CONFIG).target)))
    reasons, kept = [], 0
    for item in read_samples(BAD / name):
        assert isinstance(item, Sample), f"{name} should pass the reader and fail tokenization"
        try:
            tokenize_conversation(_TOKENIZER[0], item, max_length)
            kept += 1
        except SampleRejected as e:
            reasons.append(str(e))
    return reasons, kept


def _describe(name: str) -> None:
    from eagle3_ray.engines.describe import describe_target

    describe_target(load_config(BAD / name).target)


def _record(sid: str, n_tok: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "sample_id": sid,
        "input_ids": torch.randint(0, VOCAB, (n_tok,), generator=g, dtype=torch.int32),  # [T]
        "loss_mask": torch.ones(n_tok, dtype=torch.uint8),  # [T]
        "aux_hidden": torch.randn(n_tok, 3 * HIDDEN, generator=g).to(torch.bfloat16),  # [T, 3H]
        "last_hidden": torch.randn(n_tok, HIDDEN, generator=g).to(torch.bfloat16),  # [T, H]
    }


def _meta(hidden: int = HIDDEN):
    from eagle3_ray.features.store import StoreMeta

    return StoreMeta(hidden_size=hidden, aux_layers=[2, 4, 5], target_fingerprint="ci-tiny", model_type="llama",
                     vocab_size=VOCAB)


def make_store(root: Path, shards: int = 3, per_shard: int = 2) -> list[Path]:
    """A real feature store (through the real writer) of shards x per_shard samples."""
    from eagle3_ray.features.store import FeatureStoreWriter

    with FeatureStoreWriter(root, _meta(), writer_id="test", shard_max_bytes=2**40) as w:
        for s in range(shards):
            for j in range(per_shard):
                w.add(_record(f"s{s}-{j}", 5 + j, seed=10 * s + j))
            w.flush()
    return sorted((root / "shards").glob("*.safetensors"))


def _corrupt_shard(tmp: Path) -> None:
    from eagle3_ray.features import open_store

    shards = make_store(tmp / "store")
    with open(shards[1], "r+b") as f:  # same size, garbage header: only reading it can tell
        f.write(b"\xff" * 16)
    kept = open_store(tmp / "store", on_corrupt="skip")
    assert len(kept) == 4 and len(kept.skipped_shards) == 1, "the intact shards must stay readable"
    open_store(tmp / "store")


def _store_of_other_target(tmp: Path) -> None:
    from eagle3_ray.features import open_store
    from eagle3_ray.features.store import FeatureStoreWriter

    make_store(tmp / "store")
    try:
        FeatureStoreWriter(tmp / "store", _meta(hidden=96), writer_id="other")
    finally:
        assert len(open_store(tmp / "store")) == 6, "a refused writer must not touch the existing store"


def _drafter_config(target_hidden: int = HIDDEN):
    """A drafter config sized for the ci-tiny target, or for a wider sibling of it."""
    from eagle3_ray.drafter.model import DrafterConfig
    from eagle3_ray.engines.describe import target_hf_config

    hf = target_hf_config(load_config(CI_CONFIG).target)
    if target_hidden != HIDDEN:
        hf = hf.__class__(**{**hf.to_dict(), "hidden_size": target_hidden,
                             "num_attention_heads": target_hidden // hf.head_dim})
    return DrafterConfig.from_target(hf, 256, [2, 4, 5])


def _checkpoint(tmp: Path, state: str | None = None) -> Path:
    """A real training-checkpoint layout (drafter weights + config + train_state)."""
    from eagle3_ray.drafter.export import save_drafter_weights
    from eagle3_ray.drafter.model import Eagle3Drafter

    ckpt = tmp / "train" / "checkpoint_000000"
    save_drafter_weights(Eagle3Drafter(_drafter_config()), ckpt)
    (ckpt / "train_state.json").write_text(state or json.dumps({"step": 4, "identity": {}}), encoding="utf-8")
    return ckpt


def _corrupt_train_state(tmp: Path) -> list[str]:
    _checkpoint(tmp, state='{"step": 4, "ident')
    return ["export", "--checkpoint", str(tmp / "train"), "--out", str(tmp / "drafter")]


def _truncated_weights(tmp: Path) -> list[str]:
    weights = _checkpoint(tmp) / "drafter.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return ["export", "--checkpoint", str(tmp / "train"), "--out", str(tmp / "drafter")]


def _drafter_for_other_target(tmp: Path) -> None:
    from eagle3_ray.drafter.model import Eagle3Drafter
    from eagle3_ray.engines.targets import load_target
    from eagle3_ray.decode import prepare_drafter

    target = load_target(load_config(CI_CONFIG).target, device="cpu")
    prepare_drafter(Eagle3Drafter(_drafter_config(target_hidden=96)), target.model)


def _unwritable_out(tmp: Path) -> list[str]:
    (tmp / "a-file").write_text("not a directory")
    return ["prepare", "-c", CI_CONFIG, "--out", str(tmp / "a-file" / "prepare")]


def _run_with_best(tmp: Path, best: dict | None, step: int = 4) -> Path:
    """A training --out whose one checkpoint (of ``step``) records ``best`` (None: the run kept none)."""
    state = {"step": step, "identity": {}, **({"best": best} if best else {})}
    _checkpoint(tmp, json.dumps(state))
    return tmp / "train"


def _export(tmp: Path, run: Path, *extra: str) -> list[str]:
    return ["export", "--checkpoint", str(run), *extra, "--out", str(tmp / "drafter")]


def _tracker_cannot_start(tmp: Path) -> None:
    """MLflow's store under a path that cannot be a directory: the tracker's own error, as a user error."""
    from eagle3_ray.train.trackers import Trackers

    (tmp / "a-file").write_text("not a directory")
    cfg = load_config(CI_CONFIG, ["train.trackers=[mlflow]",
                                  f"train.tracking.mlflow_tracking_uri=file://{tmp}/a-file/x"])
    Trackers.start(cfg.train, cfg.name, tmp / "train", resumed_from=0)


def _config(name: str) -> Callable[[Path], list[str]]:
    return lambda tmp: ["prepare", "-c", str(BAD / name), "--out", str(tmp / "out")]


def _alone(name: str) -> Callable[[Path], list[str]]:
    """`prepare` over the bad record of ``name`` alone (its good "ok-" records left out): nothing is usable,
    so the CLI refuses the data before Ray starts, naming the record's file:line and its fix."""
    def argv(tmp: Path) -> list[str]:
        lines = [line for line in (BAD / name).read_text(encoding="utf-8").splitlines() if '"ok-' not in line]
        (tmp / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
        return ["prepare", "-c", CI_CONFIG, "--data", str(tmp / name), "--out", str(tmp / "out")]
    return argv


def _bench_prompts(name: str) -> Callable[[Path], list[str]]:
    """`run` with ``name`` as its benchmark prompts: refused in the preflight, before any stage."""
    return lambda tmp: ["run", "-c", CI_CONFIG, "--out", str(tmp / "run"), f"bench.prompts={BAD / name}"]


# Agentic records (data/messages.py): each quarantined among good records, and alone refused by the CLI.
AGENTIC = [
    ("tool_result_without_call", r"turn 3 is a tool result, but turn 2 \(assistant\) calls no tool; give that turn "
                                 r"its tool_calls or drop the result"),
    ("missing_tool_result", r"turn 3 \(user\) comes while the tool call 'c1' has no result; give each call of an "
                            r"assistant turn its result"),
    ("unknown_tool_call_id", r"turn 3 \(tool\): tool_call_id 'c9' answers no open call \(open: \['c1'\]\); fix the id"),
    ("tool_arguments_not_json", r"turn 2 \(assistant\): tool_calls\[0\]: the arguments are not JSON .*; write a JSON "
                                r"object"),
    ("tool_call_without_name", r"tool_calls\[0\] has no function name; write \{\"function\": \{\"name\""),
    ("tool_result_not_text", r"turn 3 \(tool\): the result is a JSON object; write it as a string"),
    ("tools_not_a_list", r"'tools' is a JSON object; it must be a list of tool definitions"),
    ("reasoning_not_text", r"turn 2 \(assistant\): reasoning_content is a JSON array, expected a string"),
    ("sharegpt_function_call_not_json", r"turn 2 \(function_call\): the value is not JSON .*; write \{\"name\": "),
]
AGENTIC_CASES = [
    row for kind, reason in AGENTIC for row in (
        Case(kind, lambda t, k=kind: _read(f"{k}.jsonl"), "quarantine", reason, kept=1),
        Case(f"{kind}_alone", _alone(f"{kind}.jsonl"), "cli", rf"{kind}\.jsonl:1: .*{reason}"),
    )
]


CASES = [
    # data files: the reader quarantines the record and goes on
    Case("malformed_json", lambda t: _read("malformed_json.jsonl"), "quarantine", r"malformed JSON.*column", kept=2),
    Case("truncated_jsonl", lambda t: _read("truncated.jsonl"), "quarantine", r"malformed JSON", kept=2),
    Case("non_utf8", lambda t: _read("non_utf8.jsonl"), "quarantine", r"not valid UTF-8: byte 0x", kept=2),
    Case("empty_conversation", lambda t: _read("empty_conversation.jsonl"), "quarantine", r"empty conversation", kept=1),
    Case("empty_content", lambda t: _read("empty_content.jsonl"), "quarantine", r"empty content", kept=1),
    Case("wrong_role_order", lambda t: _read("wrong_role_order.jsonl"), "quarantine", r"wrong role order", kept=1),
    Case("unknown_role", lambda t: _read("unknown_role.jsonl"), "quarantine", r"unknown role 'narrator'", kept=1),
    Case("unrecognised_shape", lambda t: _read("unrecognised_shape.jsonl"), "quarantine", r"expected|no known|record",
         kept=1),
    Case("duplicate_id", lambda t: _read("duplicate_id.jsonl"), "quarantine", r"duplicate id 'ok-1' \(first at", kept=2),
    Case("huge_single_line", _huge_line, "quarantine", r"malformed JSON", kept=2),
    *AGENTIC_CASES,
    # several data files: the list itself, and each file in it
    Case("data_path_empty_list", lambda t: ["prepare", "-c", CI_CONFIG, "--out", str(t / "o"), "data.path=[]"], "cli",
         r"data\.path: .*at least one file"),
    Case("data_path_list_missing_file",
         lambda t: ["prepare", "-c", CI_CONFIG, "--out", str(t / "o"), f"data.path=[builtin:ci_tiny, {t}/none.jsonl]"],
         "cli", r"none\.jsonl \(in data\.path=\[.*\]\) does not exist; pass a JSONL/JSON file"),
    # benchmark prompts in the chat forms: a bad record fails the set, before any stage runs
    Case("bench_chat_tool_without_call", _bench_prompts("bench_chat_tool_without_call.jsonl"), "cli",
         r"bench_chat_tool_without_call\.jsonl:1: wrong role order: turn 3 is a tool result, but turn 2 \(assistant\) "
         r"calls no tool; give that turn its tool_calls or drop the result"),
    Case("bench_chat_with_answers", _bench_prompts("bench_chat_with_answers.jsonl"), "cli",
         r"bench_chat_with_answers\.jsonl:1: 'answers' belongs to the 'turns' form.*drop 'answers'"),
    # tokenization: quarantined with the reason (prepare writes it to rejects.jsonl)
    Case("no_assistant_turn", lambda t: _tokenize("no_assistant_turn.jsonl"), "quarantine",
         r"no assistant turn.*self-distillation"),
    Case("over_max_length", lambda t: _tokenize("over_max_length.jsonl"), "quarantine",
         r"tokens > data.max_length=512; raise data.max_length or set data.truncate"),
    # files that cannot be used at all
    Case("truncated_json_array", lambda t: _read("truncated_array.json"), DataError, r"may be truncated.*JSONL"),
    Case("empty_file", lambda t: _read("empty_file.jsonl"), DataError, r"is empty"),
    Case("data_path_is_a_directory", lambda t: _read(BAD), DataError, r"is a directory"),
    # config: refused through the CLI before Ray starts
    Case("config_unknown_key", _config("config_unknown_key.yaml"), "cli", r"train\.max_step: unknown key"),
    Case("config_wrong_type", _config("config_wrong_type.yaml"), "cli", r"train\.max_steps: .*integer.*'lots'"),
    Case("config_not_a_mapping", _config("config_not_mapping.yaml"), "cli", r"must be a mapping of sections"),
    Case("config_file_missing", _config("no_such_config.yaml"), "cli", r"does not exist; pass -c"),
    Case("bad_override", lambda t: ["prepare", "-c", CI_CONFIG, "--out", str(t / "o"), "train.max_steps"], "cli",
         r"must look like section\.field=value"),
    Case("unwritable_output_dir", _unwritable_out, "cli", r"--out .* is not a writable directory"),
    # target shape: refused on the driver from the target config alone
    Case("aux_layer_past_last_layer", lambda t: _describe("config_aux_layer_too_deep.yaml"), ConfigError,
         r"aux_layers=\[2, 4, 8\] is invalid for a target with 8 layers.*\[1, 7\]"),
    Case("tp_not_dividing_heads", lambda t: _describe("config_tp_not_dividing_heads.yaml"), ConfigError,
         r"tp_size=3 does not divide the target's 4 attention heads"),
    # artefacts on disk
    Case("corrupt_shard", _corrupt_shard, StoreError, r"corrupt feature shard .*test-000001.*on_corrupt_shard=skip"),
    Case("store_of_another_target", _store_of_other_target, StoreError, r"hidden_size: store has 64, expected 96"),
    Case("corrupt_checkpoint_state", _corrupt_train_state, "cli", r"train_state\.json is corrupt"),
    Case("truncated_checkpoint_weights", _truncated_weights, "cli", r"drafter\.safetensors is not a readable safetensors"),
    Case("drafter_for_another_target", _drafter_for_other_target, ConfigError,
         r"states of width 96, this target's are 64; use a drafter trained for this target"),
    # experiment trackers (train.trackers): refused before Ray starts, or when one cannot start
    Case("unknown_tracker", lambda t: ["train", "-c", CI_CONFIG, "--features", str(t), "--out", str(t / "o"),
                                       "train.trackers=[tensorboard,comet]"], "cli",
         r"train\.trackers\.1: Input should be 'tensorboard', 'mlflow' or 'wandb' \(got 'comet'\)"),
    Case("tracker_listed_twice", lambda t: ["prepare", "-c", CI_CONFIG, "--out", str(t / "o"),
                                            "train.trackers=[wandb,mlflow,wandb]"], "cli",
         r"train\.trackers: .*\['wandb'\] listed more than once; name each tracker once"),
    Case("tracker_not_installed", lambda t: ["run", "-c", CI_CONFIG, "--out", str(t / "o"),
                                             "train.trackers=[tensorboard,wandb]"], "cli",
         r"train\.trackers lists \['wandb'\], not installed here: pip install 'eagle3-ray\[wandb\]'",
         blocked=("wandb",)),
    Case("unknown_wandb_mode", lambda t: ["prepare", "-c", CI_CONFIG, "--out", str(t / "o"),
                                          "train.tracking.wandb_mode=cloud"], "cli",
         r"train\.tracking\.wandb_mode: Input should be 'online', 'offline' or 'disabled'"),
    Case("tracker_cannot_start", _tracker_cannot_start, ConfigError,
         r"train\.trackers: mlflow could not start: .*Not a directory.*; check train\.tracking\.mlflow_tracking_uri"),
    # export of the best checkpoint (train.keep_best) where there is none
    Case("export_best_of_a_run_without_one", lambda t: _export(t, _run_with_best(t, None), "--which", "best"), "cli",
         r"--which best: the run in --checkpoint .*/train kept no best checkpoint .*train\.val_share=0.*; "
         r"pass --which latest"),
    Case("export_best_checkpoint_gone", lambda t: _export(t, _run_with_best(t, {"step": 2, "val_tau": 1.5})), "cli",
         r"kept its best checkpoint at step 2 \(held-out tau 1\.500\), and no checkpoint_\* of that step is there "
         r"any more; pass --which latest"),
    Case("export_which_of_one_checkpoint",
         lambda t: _export(t, _run_with_best(t, None) / "checkpoint_000000", "--which", "latest"), "cli",
         r"--which latest: --checkpoint .*checkpoint_000000 is one checkpoint, not a training run; drop --which"),
]


def test_the_corpus_covers_at_least_15_kinds():
    assert len({c.kind for c in CASES}) == len(CASES) >= 15


@pytest.mark.parametrize("case", CASES, ids=[c.kind for c in CASES])
def test_bad_input_gets_a_specific_error_or_quarantine(case: Case, tmp_path, capsys, monkeypatch):
    for module in case.blocked:  # `import module` now fails, as without the package
        monkeypatch.setitem(sys.modules, module, None)
    if case.expect == "quarantine":
        reasons, kept = case.run(tmp_path)
        assert reasons, f"{case.kind}: nothing was rejected"
        assert any(re.search(case.match, r) for r in reasons), reasons
        assert kept == case.kept, f"{case.kind}: good records lost ({kept} kept, want {case.kept})"
    elif case.expect == "cli":
        from eagle3_ray.cli import main

        argv = case.run(tmp_path)
        capsys.readouterr()
        rc = main(argv)
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert rc == 2, err
        assert len(lines) == 1 and lines[0].startswith(f"eagle3-ray {argv[0]}: error: "), err
        assert re.search(case.match, lines[0]), lines[0]
    else:
        assert issubclass(case.expect, Eagle3Error)
        with pytest.raises(case.expect, match=case.match):
            case.run(tmp_path)
