"""`eagle3-ray` command line: one subcommand per stage, plus `run` for the whole pipeline.

Every subcommand but `export` takes `-c CONFIG` and trailing `section.field=value` overrides, e.g.

    eagle3-ray extract -c configs/demo-smollm2.yaml --data runs/demo/prepare --out runs/demo/features \\
        extract.batch_tokens=4096 target.aux_layers=[2,15,27]

`eagle3-ray config -c CONFIG [overrides] [--explain]` prints the resolved config (with each field's
description and default); `eagle3-ray <command> --help` names the config sections the command reads.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path

from eagle3_ray import errors, ray_session, version_text
from eagle3_ray.audit.cli import add_verify_parser, verify_command
from eagle3_ray.config import STAGE_SECTIONS, load_config
from eagle3_ray.errors import ConfigError, Eagle3Error
from eagle3_ray.metrics import record_bench
from eagle3_ray.out_lock import out_lock
from eagle3_ray.preflight import check_command
from eagle3_ray.progress import configure_logging

# The stage modules (Ray, torch, transformers) are imported by the command that runs them, so that
# `--help`, a bad argument or a refused path answers without loading them.


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", help="pipeline YAML (see configs/); default: all schema defaults")
    p.add_argument("overrides", nargs="*", metavar="section.field=value", help="config overrides")


def _common(p: argparse.ArgumentParser, data: bool = True, out_required: bool = True) -> None:
    _config_args(p)
    if data:
        p.add_argument("--data", help="input file or directory (overrides data.path)")
    p.add_argument("--out", required=out_required, help="output directory")


def _stage(sub, name: str, help: str):
    """A command's parser; its --help names the config sections the command reads."""
    sections = ", ".join(STAGE_SECTIONS[name])
    return sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".",
                          epilog=f"Config sections read: {sections} (`eagle3-ray config -c CONFIG --explain` "
                                 "describes their fields).")


def build_parser() -> argparse.ArgumentParser:
    # Raw: argparse would wrap --version's one line at the terminal's width
    parser = argparse.ArgumentParser(prog="eagle3-ray", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", required=True)

    p = _stage(sub, "prepare", "read conversations, quarantine bad ones, tokenize with loss masks")
    _common(p)
    p = _stage(sub, "generate", "self-distillation: the target writes the assistant turns")
    _common(p)
    p = _stage(sub, "extract", "capture target hidden states into the feature store")
    _common(p)
    p = _stage(sub, "vocab", "draft vocabulary map (d2t/t2d) from loss-masked token counts")
    _common(p, data=False)
    p.add_argument("--features", required=True, help="feature store directory")
    p = _stage(sub, "train", "train the drafter on Ray Train + DeepSpeed")
    _common(p, data=False)
    p.add_argument("--features", required=True, help="feature store directory")
    p.add_argument("--vocab", help="vocab map file or dir (default: <features>/../vocab)")
    p = sub.add_parser("export", help="write the SGLang/vLLM drafter directory from a checkpoint",
                       epilog="Takes no config: the checkpoint holds the drafter's.")
    p.add_argument("--checkpoint", required=True,
                   help="the --out of `eagle3-ray train` (or its Ray Train storage), or one checkpoint_* dir")
    p.add_argument("--which", choices=["best", "latest"],
                   help="which checkpoint of the run: best = the best held-out tau (train.keep_best), latest = the "
                        "newest; default: best where the run kept one, else latest")
    p.add_argument("--out", required=True, help="export directory")
    p.add_argument("--engine", choices=["sglang", "vllm"], default="sglang")
    p = _stage(sub, "bench", "benchmark speculative decoding with a trained drafter")
    _common(p, data=False)
    p.add_argument("--drafter", required=True, help="exported drafter directory")
    p.add_argument("--prompts", help="MT-bench-style JSONL (overrides bench.prompts)")
    p = _stage(sub, "run", "the whole pipeline, resumable stage by stage")
    _common(p, out_required=False)
    p.add_argument("--stop-after", choices=["generate", "prepare", "extract", "vocab", "train", "export"],
                   help="end the run after this stage (rerun without it to continue)")
    p = sub.add_parser("config", help="print the resolved config (YAML); --explain adds every field's meaning",
                       description="Print the resolved config: -c CONFIG with the overrides applied and validated, "
                                   "as YAML that loads again with -c (the config.resolved.yaml each stage saves).")
    _config_args(p)
    p.add_argument("--explain", action="store_true",
                   help="precede each field with its description and default, as YAML comments")
    add_verify_parser(sub)
    return parser


def _load(args):
    overrides = list(args.overrides or [])
    return load_config(args.config, overrides)


def _ray(cfg):
    return ray_session.init_ray(cfg.ray)


def _interrupted(command: str, while_stopping: BaseException | None = None) -> int:
    also = f" (and while stopping: {type(while_stopping).__name__}: {while_stopping})" if while_stopping else ""
    print(f"eagle3-ray {command}: interrupted{also}. Finished stages, committed shards and the latest "
          "checkpoint are kept: run the same command again to resume", file=sys.stderr)
    return 130


def _during_interrupt(e: BaseException) -> bool:
    """``e`` was raised while a KeyboardInterrupt was being handled. A Ctrl-C that lands inside
    ``threading.Condition.wait`` (a queue's ``get``) can leave its lock released, and leaving the
    ``with`` then raises ``RuntimeError: release unlocked lock`` in place of the interrupt (seen on
    the H200 when a call's time limit sent SIGINT during extraction)."""
    seen = 0
    while e is not None and seen < 16:
        if isinstance(e, KeyboardInterrupt):
            return True
        e, seen = e.__context__, seen + 1
    return False


def main(argv: list[str] | None = None) -> int:
    # Ray starts only where the CLI says so (init_ray): a Ray call from a thread that outlives its
    # stage raises instead of starting a local Ray of its own (read by Ray when it is imported,
    # which the commands do later; a value of the user's own is kept).
    os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
    args = build_parser().parse_args(argv)
    configure_logging()  # the package's diagnostics at INFO and above, as plain lines on stderr
    try:
        return _dispatch(args)
    except KeyboardInterrupt:
        return _interrupted(args.command)
    except Exception as e:
        if _during_interrupt(e):
            return _interrupted(args.command, e)
        user_error = _user_error(e)
        if user_error is None:
            raise
        print(f"eagle3-ray {args.command}: error: {_one_line(user_error)}", file=sys.stderr)
        return 2


def _user_error(e: BaseException) -> Eagle3Error | None:
    """The Eagle3Error behind ``e``, if any. An error raised inside a Ray task or actor arrives wrapped
    (RayTaskError, Ray Data's UserCodeException, Ray Train's worker-group error) with the remote
    traceback as its text; the user needs the original message. An actor whose constructor raised
    arrives as ActorDiedError with no exception object at all: the error is read from its text."""
    seen: set[int] = set()
    found: Eagle3Error | None = None
    remote: Eagle3Error | None = None
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, Eagle3Error):
            found = e  # keep walking: RayTaskError(StoreError) is one too, with the traceback as text
        elif remote is None and type(e).__module__.split(".")[0] == "ray":
            remote = _from_remote_text(str(e))
        e = getattr(e, "cause", None) or e.__cause__
    return found or remote


# The last line of a remote traceback naming one of our errors: "eagle3_ray.errors.StoreError: <message>".
_REMOTE_ERROR = re.compile(r"^eagle3_ray\.errors\.(\w+): ", re.MULTILINE)


def _from_remote_text(text: str) -> Eagle3Error | None:
    """The Eagle3Error a Ray error carries only as text. An actor whose constructor raised reaches the
    caller as ActorDiedError, holding the creation task's traceback as a string and no exception object
    (Ray 2.x); the error is rebuilt from the traceback's last line (its message runs to the end)."""
    matches = list(_REMOTE_ERROR.finditer(text))
    if not matches:
        return None
    last = matches[-1]
    message = text[last.end():].strip()
    if _LATER_TRACEBACK.search(message):  # ours was handled, and something else ended the task
        return None
    cls = getattr(errors, last.group(1), None)
    if not (isinstance(cls, type) and issubclass(cls, Eagle3Error)):
        cls = Eagle3Error
    return cls(message)


_LATER_TRACEBACK = re.compile(r"^(Traceback \(most recent call last\)|During handling of the above exception"
                              r"|The above exception was the direct cause)", re.MULTILINE)


def _one_line(e: Exception) -> str:
    """Multi-line messages (e.g. one line per invalid config key) joined so logs and grep see one line."""
    head, *rest = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
    return head if not rest else head.rstrip(":") + ": " + "; ".join(rest)


def _writable_out(out: str) -> None:
    """Refuse an unusable --out before Ray starts, instead of a traceback from the first write."""
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ConfigError(
            f"--out {out} is not a writable directory ({e.strerror}); pass a directory you can write to"
        ) from None


def _dispatch(args) -> int:
    cmd = args.command
    if cmd == "verify":  # no Ray, no --out: eagle3_ray/audit/cli.py
        return verify_command(args)
    cfg = None if cmd == "export" else _load(args)
    if cmd == "config":
        from eagle3_ray.config.explain import render

        sys.stdout.write(render(cfg, explain=args.explain))
        return 0
    # Every path and model argument, before Ray starts (or --out is created): eagle3_ray/preflight.py.
    check_command(cmd, args, cfg)
    if args.out:
        _writable_out(args.out)
    if cmd == "export":
        from eagle3_ray.train.checkpoint import export_from_training

        path = export_from_training(args.checkpoint, args.out, engine=args.engine, which=args.which)
        print(f"[export] drafter for {args.engine} -> {path}")
        return 0
    if cmd == "run":  # run_pipeline holds the output lock itself
        from eagle3_ray.pipeline import run_pipeline

        _ray(cfg)
        run_pipeline(cfg, data=args.data, out=args.out or f"runs/{cfg.name}", stop_after=args.stop_after)
        return 0
    with out_lock(args.out, cmd):  # before Ray starts: a second writer is refused at once
        return _stage_command(cmd, cfg, args)


def _stage_command(cmd: str, cfg, args) -> int:
    target_info = None
    if cmd == "extract":  # the target's description (transformers' import: seconds) overlaps the Ray start
        from eagle3_ray.extract.pipeline import describe_in_background

        target_info = describe_in_background(cfg.target)
    _ray(cfg)
    if cmd == "prepare":
        from eagle3_ray.extract.prepare_stage import run_prepare

        run_prepare(cfg, args.data, args.out)
    elif cmd == "generate":
        from eagle3_ray.extract.generate_stage import run_generate

        run_generate(cfg, args.data, args.out)
    elif cmd == "extract":
        from eagle3_ray.extract.pipeline import run_extract
        from eagle3_ray.extract.prepare_stage import run_prepare
        from eagle3_ray.extract.prepared import prepared_path

        data = args.data or cfg.data.path
        if data is None or isinstance(data, list) or prepared_path(data) is None:
            data = run_prepare(cfg, data, Path(args.out) / "_prepared").prepared
        run_extract(cfg, data, args.out, target_info=target_info)
    elif cmd == "vocab":
        from eagle3_ray.extract.vocab_stage import run_vocab

        run_vocab(cfg, args.features, args.out)
    elif cmd == "train":
        from eagle3_ray.train.trainer import run_training

        vocab = args.vocab or str(Path(args.features).parent / "vocab")
        run_training(cfg, features=args.features, vocab=vocab, out=args.out)
    elif cmd == "bench":
        from eagle3_ray.bench.runner import run_bench

        record_bench(run_bench(cfg, drafter=args.drafter, prompts=args.prompts, out=args.out), cfg.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
