"""Every path argument of every command: a wrong one is refused before Ray starts, in one line, exit 2.

The CLI runs in-process (``eagle3_ray.cli.main``) with a tripwire on ``init_ray``: a case that got
as far as starting Ray fails the test instead of starting it. One subprocess case proves the real
process exit status, the single stderr line and that no Ray session directory appears.
The inputs are real artefacts made through the package's own writers (feature store, vocab map,
drafter checkpoint, exported drafter), sized for the ci-tiny target, and then broken one way each.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from eagle3_ray.cli import build_parser, main

CI = "configs/ci-tiny.yaml"
HIDDEN, VOCAB, DRAFT_VOCAB = 64, 49152, 256  # the ci-tiny target's shapes, its config's draft vocab
# Per in-process case: under 0.3 s each once the package is imported (the first case of a session
# pays the torch/transformers imports); the bound leaves room for a loaded 2-core CI machine.
FAST_S = 20.0


# ---------------------------------------------------------------- real artefacts


@functools.lru_cache(maxsize=1)
def _ci_fingerprint() -> str:
    """The ci-tiny target's fingerprint, as extract writes it into a store (config only, no weights)."""
    from eagle3_ray.config import load_config
    from eagle3_ray.engines.describe import describe_target

    return describe_target(load_config(CI).target).fingerprint


def _store(root: Path, shards: int = 1, hidden: int = HIDDEN) -> Path:
    """A feature store of the ci-tiny target (or of a target of width ``hidden``), through the real writer."""
    import torch

    from eagle3_ray.features.store import FeatureStoreWriter, StoreMeta

    meta = StoreMeta(hidden_size=hidden, aux_layers=[2, 4, 5], model_type="llama", vocab_size=VOCAB,
                     target_fingerprint=_ci_fingerprint() if hidden == HIDDEN else "other")
    with FeatureStoreWriter(root, meta, writer_id="test", shard_max_bytes=2**40) as w:
        for s in range(shards):
            n = 6
            w.add({"sample_id": f"s{s}", "input_ids": torch.arange(n, dtype=torch.int32),  # [T]
                   "loss_mask": torch.ones(n, dtype=torch.uint8),  # [T]
                   "aux_hidden": torch.zeros(n, 3 * hidden, dtype=torch.bfloat16),  # [T, 3H]
                   "last_hidden": torch.zeros(n, hidden, dtype=torch.bfloat16)})  # [T, H]
            w.flush()
    return root


def _vocab(out: Path, target: str | None = None) -> Path:
    from eagle3_ray.data.vocab import build_vocab_map, save_vocab_map

    d2t, t2d = build_vocab_map(np.ones(VOCAB, dtype=np.int64), DRAFT_VOCAB)
    save_vocab_map(out / "vocab_map.safetensors", d2t, t2d, {"target_fingerprint": target or _ci_fingerprint()})
    return out


def _checkpoint(ckpt: Path, state: str = '{"step": 4}', hidden: int = HIDDEN) -> Path:
    """A training checkpoint of a drafter for the ci-tiny target (or for a target of width ``hidden``)."""
    from eagle3_ray.drafter.export import save_drafter_weights
    from eagle3_ray.drafter.model import DrafterConfig, Eagle3Drafter

    cfg = DrafterConfig(hidden_size=hidden, num_attention_heads=4, num_key_value_heads=4, head_dim=hidden // 4,
                        intermediate_size=128, vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB,
                        target_hidden_size=hidden, aux_layers=[2, 4, 5])
    save_drafter_weights(Eagle3Drafter(cfg), ckpt)
    (ckpt / "train_state.json").write_text(state, encoding="utf-8")
    return ckpt


def _drafter(out: Path, hidden: int = HIDDEN) -> Path:
    from eagle3_ray.drafter.export import export_drafter

    return export_drafter(_checkpoint(out.parent / f"{out.name}-ckpt", hidden=hidden), out, engine="sglang")


def _foreign_drafter(out: Path) -> Path:
    """An EAGLE-3 drafter as another tool exports it: our config.json without its eagle3_ray section."""
    _drafter(out)
    raw = json.loads((out / "config.json").read_text(encoding="utf-8"))
    del raw["eagle3_ray"]
    (out / "config.json").write_text(json.dumps(raw), encoding="utf-8")
    return out


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _hf_dir(path: Path, weights: bool) -> Path:
    """A directory that looks like a target model: config.json (+ weights)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": HIDDEN}), encoding="utf-8")
    if weights:
        (path / "model.safetensors").write_bytes(b"\0" * 16)
    return path


def _tmp_like(root: Path) -> Path:
    """A directory like /tmp: unrelated files, and a corrupt checkpoint of some other test deep inside."""
    _checkpoint(root / "pytest-of-someone" / "test_x0" / "train" / "checkpoint_000000", state='{"step": 4, "ide')
    (root / "notes.txt").write_text("unrelated", encoding="utf-8")
    (root / "some-dir").mkdir()
    return root


# ---------------------------------------------------------------- the cases


Argv = Callable[[Path], list]
CASES: list[tuple[str, Argv, str]] = [
    # the three reports
    ("export_checkpoint_is_an_unrelated_dir",
     lambda t: ["export", "--checkpoint", str(_tmp_like(t / "tmp")), "--out", str(t / "x")],
     r"--checkpoint .*/tmp is neither a training output nor a checkpoint.*pass the --out of `eagle3-ray train`"),
    ("bench_drafter_is_an_unrelated_dir",
     lambda t: ["bench", "-c", CI, "--drafter", str(_tmp_like(t / "tmp")), "--out", str(t / "x")],
     r"--drafter .*/tmp holds neither drafter_config\.json .* nor config\.json .*"
     r"pass the --out of `eagle3-ray export`"),
    ("train_features_without_a_store",
     lambda t: ["train", "-c", CI, "--features", str(_tmp_like(t / "tmp")), "--out", str(t / "x")],
     r"--features .*/tmp is not a feature store \(no store_meta\.json\); pass the --out of `eagle3-ray extract`"),
    ("extract_data_is_a_directory",
     lambda t: ["extract", "-c", CI, "--data", str(_tmp_like(t / "tmp")), "--out", str(t / "x")],
     r"--data .*/tmp is a directory without prepared\.parquet; pass the --out of `eagle3-ray prepare`"),
    ("prepare_data_holds_no_conversations",
     lambda t: ["prepare", "-c", CI, "--data", str(_jsonl(t / "d.jsonl", [{"text": "x"}, [1, 2]])),
                "--out", str(t / "x")],
     r"--data .*d\.jsonl holds no usable conversations \(2 records, all rejected, e\.g\. .*d\.jsonl:1: "),
    ("prepare_target_is_a_missing_gguf",
     lambda t: ["prepare", "-c", CI, "--out", str(t / "x"), f"target.model={t}/model.gguf"],
     r"target\.model='.*/model\.gguf': GGUF file .* does not exist; pass 'smollm2'"),
    # -c, the same for every command
    ("prepare_config_is_a_directory", lambda t: ["prepare", "-c", "configs", "--out", str(t / "x")],
     r"config file configs is a directory; pass -c with a YAML file"),
    ("train_config_is_not_text",
     lambda t: ((t / "c.yaml").write_bytes(b"\xff\xfe\x00bad"),
                ["train", "-c", str(t / "c.yaml"), "--features", str(t), "--out", str(t / "x")])[1],
     r"config file .*c\.yaml is not valid YAML"),
    # prepare
    ("prepare_data_missing", lambda t: ["prepare", "-c", CI, "--data", str(t / "no.jsonl"), "--out", str(t / "x")],
     r"--data .*no\.jsonl does not exist; pass a JSONL/JSON file of conversations or builtin:<name>"),
    ("prepare_data_is_a_directory", lambda t: ["prepare", "-c", CI, "--data", str(t), "--out", str(t / "x")],
     r"--data .* is a directory; pass a JSONL/JSON file of conversations"),
    ("prepare_data_holds_only_prompts",
     lambda t: ["prepare", "-c", CI, "--data", str(_jsonl(t / "p.jsonl", [{"prompt": "hi"}])), "--out", str(t / "x")],
     r"holds only prompts \(1, no assistant turns\); run `eagle3-ray generate` on it first"),
    ("prepare_unknown_builtin", lambda t: ["prepare", "-c", CI, "--data", "builtin:nope", "--out", str(t / "x")],
     r"unknown builtin data set 'builtin:nope'; use one of"),
    ("prepare_target_dir_without_config",
     lambda t: ["prepare", "-c", CI, "--out", str(t / "x"), f"target.model={t}"],
     r"target\.model='.*': directory .* has no config\.json"),
    # generate
    ("generate_data_path_missing",
     lambda t: ["generate", "-c", CI, "--out", str(t / "x"), f"data.path={t}/none.jsonl"],
     r"data\.path=.*none\.jsonl does not exist"),
    ("generate_target_without_weights",
     lambda t: ["generate", "-c", CI, "--out", str(t / "x"), f"target.model={_hf_dir(t / 'm', weights=False)}"],
     r"has a config\.json but no weights .*random:"),
    # extract
    ("extract_data_missing", lambda t: ["extract", "-c", CI, "--data", str(t / "p.parquet"), "--out", str(t / "x")],
     r"--data .*p\.parquet does not exist; pass a JSONL/JSON file of conversations, the --out of `eagle3-ray prepare`"),
    ("extract_out_is_a_store_of_another_target",
     lambda t: ["extract", "-c", CI, "--out", str(_store(t / "f", hidden=96))],
     r"feature store .*/f was written for another target or config: .*hidden_size.*Use a new --out"),
    ("extract_target_unknown_form", lambda t: ["extract", "-c", CI, "--out", str(t / "x"), "target.model=llama-8b"],
     r"target\.model='llama-8b' is neither an existing path nor a known form"),
    # vocab
    ("vocab_features_missing", lambda t: ["vocab", "-c", CI, "--features", str(t / "f"), "--out", str(t / "x")],
     r"--features .*/f does not exist; pass the --out of `eagle3-ray extract`"),
    ("vocab_features_is_a_file",
     lambda t: ["vocab", "-c", CI, "--features", str(_jsonl(t / "f.jsonl", [])), "--out", str(t / "x")],
     r"--features .*f\.jsonl is a file, not a directory"),
    ("vocab_features_of_a_run_out",
     lambda t: (_store(t / "run" / "features"),
                ["vocab", "-c", CI, "--features", str(t / "run"), "--out", str(t / "x")])[1],
     r"is not a feature store \(no store_meta\.json\) \(did you mean .*run/features\?\)"),
    ("vocab_store_without_shards",
     lambda t: (_store(t / "f", shards=0), ["vocab", "-c", CI, "--features", str(t / "f"), "--out", str(t / "x")])[1],
     r"holds no completed shards .*run or resume `eagle3-ray extract --out"),
    # verify
    ("verify_features_missing", lambda t: ["verify", "--features", str(t / "f")],
     r"--features .*/f does not exist; pass the --out of `eagle3-ray extract`"),
    ("verify_features_is_a_file", lambda t: ["verify", "--features", str(_jsonl(t / "f.jsonl", []))],
     r"--features .*f\.jsonl is a file, not a directory"),
    ("verify_features_without_its_config", lambda t: ["verify", "--features", str(_store(t / "f"))],
     r"--features .*/f has no config\.resolved\.yaml; pass -c with the config it was extracted with"),
    ("verify_features_without_a_store", lambda t: ["verify", "-c", CI, "--features", str(t)],
     r"no feature store at .* \(store_meta\.json missing\)"),
    # train
    ("train_vocab_missing",
     lambda t: ["train", "-c", CI, "--features", str(_store(t / "f")), "--vocab", str(t / "v"), "--out", str(t / "x")],
     r"--vocab .*/v does not exist; pass --vocab with the --out of `eagle3-ray vocab`"),
    ("train_default_vocab_missing",
     lambda t: ["train", "-c", CI, "--features", str(_store(t / "f")), "--out", str(t / "x")],
     r"the default vocab map dir .*/vocab \(<features>/\.\./vocab\) does not exist"),
    ("train_vocab_dir_without_map",
     lambda t: ["train", "-c", CI, "--features", str(_store(t / "f")), "--vocab", str(t), "--out", str(t / "x")],
     r"--vocab .* has no vocab_map\.safetensors"),
    ("train_vocab_of_another_target",
     lambda t: ["train", "-c", CI, "--features", str(_store(t / "f")), "--vocab", str(_vocab(t / "v", "other")),
                "--out", str(t / "x")],
     r"was built for target other, the store at --features .* holds target \w+; rerun `eagle3-ray vocab`"),
    ("train_features_of_another_target",
     lambda t: ["train", "-c", CI, "--features", str(_store(t / "f", hidden=96)),
                "--vocab", str(_vocab(t / "v", "other")), "--out", str(t / "x")],
     r"--features .*/f: feature store does not match this run: .*hidden_size.*Extract features for this target"),
    ("train_init_from_not_a_drafter",
     lambda t: ["train", "-c", CI, "--features", str(_store(t / "f")), "--vocab", str(_vocab(t / "v")),
                "--out", str(t / "x"), f"train.init_from={t}/nothing"],
     r"train\.init_from .*/nothing does not exist; pass the --out of `eagle3-ray export`"),
    ("train_online_mode",
     lambda t: ["train", "-c", CI, "--features", str(t), "--out", str(t / "x"), "train.mode=online"],
     r"`train` reads a feature store \(train\.mode=offline\)"),
    # export
    ("export_checkpoint_missing", lambda t: ["export", "--checkpoint", str(t / "train"), "--out", str(t / "x")],
     r"--checkpoint .*/train does not exist"),
    ("export_checkpoint_is_a_file",
     lambda t: ["export", "--checkpoint", str(_jsonl(t / "a.json", [])), "--out", str(t / "x")],
     r"--checkpoint .*a\.json is a file, not a directory"),
    ("export_checkpoint_is_a_run_out",
     lambda t: (_checkpoint(t / "run" / "train" / "ray_train" / "ci-tiny-train" / "checkpoint_000000"),
                ["export", "--checkpoint", str(t / "run"), "--out", str(t / "x")])[1],
     r"it looks like the --out of `eagle3-ray run`: pass .*run/train"),
    # bench
    ("bench_drafter_missing", lambda t: ["bench", "-c", CI, "--drafter", str(t / "d"), "--out", str(t / "x")],
     r"--drafter .*/d does not exist; pass the --out of `eagle3-ray export`"),
    ("bench_drafter_is_a_target_model",
     lambda t: ["bench", "-c", CI, "--drafter", str(_hf_dir(t / "m", weights=True)), "--out", str(t / "x")],
     r"its config\.json is not an EAGLE-3 drafter's \(no eagle_config or Eagle3 architecture; a target model"),
    ("bench_drafter_truncated",
     lambda t: (_drafter(t / "d"), (t / "d" / "model.safetensors").write_bytes(
         (t / "d" / "model.safetensors").read_bytes()[:-100]),
         ["bench", "-c", CI, "--drafter", str(t / "d"), "--out", str(t / "x")])[2],
     r"model\.safetensors is not a readable safetensors file: truncated"),
    ("bench_drafter_for_another_target",
     lambda t: ["bench", "-c", CI, "--drafter", str(_drafter(t / "d", hidden=96)), "--out", str(t / "x")],
     r"--drafter .*/d reads target states of width 96, target\.model=random:builtin:tiny-llama's are 64; use a "
     r"drafter trained for this target"),
    ("bench_drafter_foreign_on_the_hf_backend",
     lambda t: ["bench", "-c", CI, "--drafter", str(_foreign_drafter(t / "d")), "--out", str(t / "x")],
     r"config\.json does not say which target hidden states it reads"),
    ("bench_prompts_missing",
     lambda t: ["bench", "-c", CI, "--drafter", str(_drafter(t / "d")), "--prompts", str(t / "p.jsonl"),
                "--out", str(t / "x")],
     r"--prompts .*p\.jsonl does not exist; pass a JSONL/JSON file of prompts"),
    ("bench_prompts_is_a_directory",
     lambda t: ["bench", "-c", CI, "--drafter", str(_drafter(t / "d")), "--prompts", str(t), "--out", str(t / "x")],
     r"--prompts .* is a directory; pass a JSONL/JSON file of prompts"),
    ("bench_config_prompts_missing",
     lambda t: ["bench", "-c", CI, "--drafter", str(_drafter(t / "d")), "--out", str(t / "x"),
                f"bench.prompts={t}/mt.jsonl"],
     r"bench\.prompts=.*mt\.jsonl does not exist"),
    # config (prints the resolved config; reads no path but -c)
    ("config_config_file_missing", lambda t: ["config", "-c", str(t / "no.yaml")],
     r"config file .*no\.yaml does not exist; pass -c with a YAML file"),
    # run
    ("run_data_missing", lambda t: ["run", "-c", CI, "--data", str(t / "c.jsonl"), "--out", str(t / "x")],
     r"--data .*c\.jsonl does not exist"),
    ("run_target_missing_gguf", lambda t: ["run", "-c", CI, "--out", str(t / "x"), "target.model=/no/such.gguf"],
     r"GGUF file /no/such\.gguf does not exist"),
    ("run_init_from_not_a_drafter",
     lambda t: ["run", "-c", CI, "--out", str(t / "x"), f"train.init_from={_tmp_like(t / 'tmp')}"],
     r"train\.init_from .*/tmp holds neither drafter_config\.json"),
    ("run_bench_prompts_missing", lambda t: ["run", "-c", CI, "--out", str(t / "x"), "bench.prompts=builtin:nope"],
     r"unknown builtin data set 'builtin:nope'"),
    # --out under a file: refused once the inputs passed, before anything is written
    ("run_out_is_a_file", lambda t: ["run", "-c", CI, "--out", str(_jsonl(t / "o", []) / "run")],
     r"--out .* is not a writable directory"),
    ("prepare_out_is_a_file", lambda t: ["prepare", "-c", CI, "--out", str(_jsonl(t / "o", []) / "p")],
     r"--out .* is not a writable directory"),
    ("generate_out_is_a_file", lambda t: ["generate", "-c", CI, "--out", str(_jsonl(t / "o", []) / "g")],
     r"--out .* is not a writable directory"),
    ("extract_out_is_a_file", lambda t: ["extract", "-c", CI, "--out", str(_jsonl(t / "o", []) / "f")],
     r"--out .* is not a writable directory"),
    ("vocab_out_is_a_file",
     lambda t: ["vocab", "-c", CI, "--features", str(_store(t / "f")), "--out", str(_jsonl(t / "o", []) / "v")],
     r"--out .* is not a writable directory"),
    ("train_out_is_a_file",
     lambda t: ["train", "-c", CI, "--features", str(_store(t / "f")), "--vocab", str(_vocab(t / "v")),
                "--out", str(_jsonl(t / "o", []) / "t")],
     r"--out .* is not a writable directory"),
    ("export_out_is_a_file",
     lambda t: ["export", "--checkpoint", str(_checkpoint(t / "c")), "--out", str(_jsonl(t / "o", []) / "d")],
     r"--out .* is not a writable directory"),
    ("bench_out_is_a_file",
     lambda t: ["bench", "-c", CI, "--drafter", str(_drafter(t / "d")), "--out", str(_jsonl(t / "o", []) / "b")],
     r"--out .* is not a writable directory"),
]


@pytest.fixture
def no_ray(monkeypatch):
    """A tripwire on the one place the CLI starts (or connects to) Ray."""
    import eagle3_ray.ray_session

    def tripwire(cfg):
        raise AssertionError("the command started Ray before refusing its input")

    ray = sys.modules.get("ray")
    was = ray is not None and ray.is_initialized()
    monkeypatch.setattr(eagle3_ray.ray_session, "init_ray", tripwire)
    yield
    ray = sys.modules.get("ray")
    assert was or ray is None or not ray.is_initialized(), "Ray was initialized"


def test_every_command_and_path_argument_is_covered():
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    covered = {argv_cmd for argv_cmd in (c[0].split("_")[0] for c in CASES)}
    assert covered == set(commands), set(commands) - covered
    names = {c[0] for c in CASES}
    assert len(names) == len(CASES)
    for cmd, sub in commands.items():
        for action in sub._actions:
            flag = next((o for o in action.option_strings if o.startswith("--")), None)
            if flag in ("--data", "--features", "--vocab", "--checkpoint", "--drafter", "--prompts", "--out"):
                assert any(n.startswith(f"{cmd}_{flag[2:]}") for n in names), f"{cmd} {flag} has no case"


@pytest.mark.parametrize("name,argv,match", CASES, ids=[c[0] for c in CASES])
def test_wrong_path_is_refused_in_one_line_before_ray(name, argv, match, tmp_path, capsys, no_ray):
    args = argv(tmp_path)
    capsys.readouterr()
    t0 = time.monotonic()
    rc = main(args)
    elapsed = time.monotonic() - t0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith(f"eagle3-ray {args[0]}: error: "), err
    assert re.search(match, lines[0]), lines[0]
    assert "delete" not in lines[0] and "corrupt" not in lines[0], lines[0]
    assert elapsed < FAST_S, f"{name}: refused after {elapsed:.1f}s"


def test_good_inputs_pass_the_preflight(tmp_path, no_ray):
    """The preflight refuses nothing that works: real inputs of every command pass it."""
    from eagle3_ray.config import load_config
    from eagle3_ray.preflight import check_command

    store, vocab = _store(tmp_path / "features", shards=2), _vocab(tmp_path / "vocab")
    _checkpoint(tmp_path / "train" / "ray_train" / "ci-tiny-train" / "checkpoint_000000")
    drafter = _drafter(tmp_path / "drafter")
    convs = _jsonl(tmp_path / "c.jsonl", [{"conversations": [{"from": "human", "value": "hi"},
                                                              {"from": "gpt", "value": "hello"}]}])
    prepared = tmp_path / "prepare"
    prepared.mkdir()
    (prepared / "prepared.parquet").write_bytes(b"PAR1")
    runs = [
        ["prepare", "-c", CI, "--data", str(convs), "--out", "o"],
        ["prepare", "-c", CI, "--out", "o"],  # data.path=builtin:ci_tiny
        ["generate", "-c", CI, "--data", "builtin:demo_prompts", "--out", "o"],
        ["extract", "-c", CI, "--data", str(prepared), "--out", "o"],
        ["extract", "-c", CI, "--data", str(convs), "--out", "o"],
        ["vocab", "-c", CI, "--features", str(store), "--out", "o"],
        ["train", "-c", CI, "--features", str(store), "--out", "o"],  # default vocab: <features>/../vocab
        ["train", "-c", CI, "--features", str(store), "--vocab", str(vocab / "vocab_map.safetensors"),
         "--out", "o", f"train.init_from={drafter}"],
        ["export", "--checkpoint", str(tmp_path / "train"), "--out", "o"],
        ["export", "--checkpoint", str(tmp_path / "train" / "ray_train"), "--out", "o"],
        ["bench", "-c", CI, "--drafter", str(drafter), "--out", "o"],
        ["bench", "-c", CI, "--drafter", str(tmp_path / "drafter-ckpt"), "--prompts", "builtin:demo_eval",
         "--out", "o"],
        ["run", "-c", CI, "--out", "o"],
        # SGLang serves another tool's export as it is
        ["bench", "-c", CI, "--drafter", str(_foreign_drafter(tmp_path / "foreign")), "--out", "o",
         "target.backend=sglang"],
    ]
    for argv in runs:
        args = build_parser().parse_args(argv)
        cfg = None if args.command == "export" else load_config(args.config, args.overrides)
        check_command(args.command, args, cfg)


def test_checkpoints_are_looked_for_only_in_the_layout_train_writes(tmp_path):
    from eagle3_ray.errors import CheckpointError
    from eagle3_ray.train.checkpoint import checkpoint_dirs, find_checkpoint

    out = tmp_path / "train"
    old = _checkpoint(out / "ray_train" / "ci-tiny-train" / "checkpoint_000000", '{"step": 4}')
    new = _checkpoint(out / "ray_train" / "ci-tiny-train" / "checkpoint_000001", '{"step": 8}')
    assert find_checkpoint(out) == new  # train --out
    assert find_checkpoint(out / "ray_train") == new  # Ray Train storage
    assert find_checkpoint(out / "ray_train" / "ci-tiny-train") == new  # run dir
    assert find_checkpoint(old) == old  # a checkpoint itself
    # one level further than the layout is not searched, however the checkpoints got there
    for deeper in (tmp_path, tmp_path / "elsewhere"):
        _checkpoint(tmp_path / "elsewhere" / "a" / "b" / "checkpoint_000000")
        assert checkpoint_dirs(deeper) == []
        with pytest.raises(CheckpointError, match="is neither a training output nor a checkpoint"):
            find_checkpoint(deeper)


def test_actor_construction_error_reaches_the_user_as_its_one_line(capsys):
    """An actor whose __init__ raised reaches ray.get as ActorDiedError holding only the creation task's
    traceback text (Ray 2.x keeps no exception object); the CLI turns it back into the one line."""
    from ray.exceptions import ActorDiedError, RayTaskError

    from eagle3_ray.cli import _one_line, _user_error
    from eagle3_ray.errors import CheckpointError

    try:
        raise CheckpointError("/x holds neither drafter_config.json nor config.json\npass a drafter directory")
    except CheckpointError as e:
        tb = "".join(traceback.format_exception(e))
        task_error = RayTaskError("BenchActor.__init__", tb, e, pid=1, ip="127.0.0.1")
    died = ActorDiedError(cause=task_error)
    assert not isinstance(died, CheckpointError) and getattr(died, "cause", None) is None  # only text
    wrapped = RuntimeError("bench failed")
    wrapped.__cause__ = died
    found = _user_error(wrapped)
    assert isinstance(found, CheckpointError)
    assert _one_line(found) == "/x holds neither drafter_config.json nor config.json: pass a drafter directory"
    assert _user_error(ActorDiedError()) is None  # a system death is not a user error: it stays a traceback
    try:  # our error handled, then a bug: the bug's traceback is what the user must see
        try:
            raise CheckpointError("handled")
        except CheckpointError:
            {}["missing"]
    except KeyError as bug:
        later = ActorDiedError(cause=RayTaskError("BenchActor.__init__", "".join(traceback.format_exception(bug)),
                                                  bug, pid=1, ip="127.0.0.1"))
    assert "eagle3_ray.errors.CheckpointError: handled" in str(later) and _user_error(later) is None


def test_real_process_exit_status_and_single_stderr_line(tmp_path):
    """One real process: exit status 2, one stderr line, and no Ray session directory created."""
    ray_tmp = tmp_path / "ray"
    ray_tmp.mkdir()
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmp), "RAY_ADDRESS": ""}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "eagle3_ray.cli", "bench", "-c", CI, "--drafter", str(_tmp_like(tmp_path / "tmp")),
         "--out", str(tmp_path / "x")],
        capture_output=True, text=True, env=env, timeout=120, cwd=Path(__file__).resolve().parent.parent,
    )
    elapsed = time.monotonic() - t0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("eagle3-ray bench: error: --drafter "), proc.stderr
    assert list(ray_tmp.iterdir()) == [], "a Ray session was started"
    assert not (tmp_path / "x").exists(), "--out was created for a refused command"
    assert elapsed < 60, f"refused after {elapsed:.0f}s"
