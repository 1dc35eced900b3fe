"""The driver's preflight: every path and model argument of a command, checked before Ray starts.

``check_command(command, args, cfg)`` runs in the CLI (and so in every ``jobs/*.py`` entrypoint)
before ``ray.init``. For each path a command takes it checks existence, kind (file or directory)
and the marker files that make it what the command needs, and raises the specific
``eagle3_ray.errors`` type with a message saying what to pass instead:

    input              command(s)                        what makes it one
    conversations      prepare generate extract run      a JSONL/JSON file (or builtin:<name>) with at
      (--data, data.path)                                least one usable record; prepare/extract need
                                                         one with an assistant turn
    prepared data      extract                           a prepare --out (prepared.parquet) or a .parquet
    feature store      vocab train (--features)          store_meta.json + >= 1 completed shard; train:
                                                         extracted from this target
    existing store     extract (--out)                   extracted from this target (extract adds to it)
    vocab map          train (--vocab, else              vocab_map.safetensors (d2t, t2d) for the store's
                       <features>/../vocab)              target
    checkpoint         export (--checkpoint, --which)    train_state.json, in the layout train writes
                                                         (train/checkpoint.py: never searched deeper);
                                                         --which best: the best checkpoint kept
    drafter            bench (--drafter),                drafter_config.json + drafter.safetensors, or
                       train.init_from                   config.json (EAGLE-3) + model.safetensors
    prompt set         bench (--prompts, bench.prompts)  a JSONL/JSON file (or builtin:<name>) of prompts
    target             every command with a target       target.model's form and files (no conversion)

Only reads: nothing is created, converted or loaded beyond file headers, and no Ray. What only a
worker can see (a corrupt shard deep in a store, a GGUF transformers cannot read) still fails later,
and still reaches the user as one line (cli._user_error).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3_ray.config import PipelineConfig
from eagle3_ray.data.sources import DEFAULT_DATA
from eagle3_ray.errors import ConfigError, DataError, StoreError, require_dir


def check_command(command: str, args: Any, cfg: PipelineConfig | None) -> None:
    """Refuse the command's inputs that cannot work (the table in the module docstring)."""
    if command == "export":
        from eagle3_ray.train.checkpoint import select_checkpoint

        select_checkpoint(args.checkpoint, getattr(args, "which", None))
        return
    assert cfg is not None
    data_arg = getattr(args, "data", None)
    if command in ("prepare", "generate", "extract", "run", "train", "bench"):
        check_target(cfg)
    if command in ("prepare", "generate", "run"):
        check_conversations(cfg, data_arg, need_answers=command == "prepare")
    elif command == "extract":
        check_extract_input(cfg, data_arg)
        check_existing_store_out(cfg, args.out)
    elif command == "vocab":
        check_store(args.features)
    elif command == "train":
        if cfg.train.mode != "offline":
            raise ConfigError(f"`train` reads a feature store (train.mode=offline); train.mode={cfg.train.mode} "
                              "streams from the engines: use `eagle3-ray run` (or jobs/pipeline.py)")
        meta = check_store(args.features)
        check_vocab(args.vocab, args.features, meta.target_fingerprint)
        check_store_fits_target(meta, cfg, f"--features {args.features}")
    elif command == "bench":
        from eagle3_ray.drafter.export import check_drafter_dir

        # SGLang serves the directory as it is, also one exported by another tool
        drafter = check_drafter_dir(args.drafter, "--drafter", foreign_ok=cfg.target.backend == "sglang")
        check_drafter_fits_target(drafter, cfg, f"--drafter {args.drafter}")
        check_prompts(cfg, args.prompts)
    if command in ("train", "run"):
        from eagle3_ray.train.trackers import check_installed

        check_installed(cfg.train.trackers)
    if command in ("train", "run") and cfg.train.init_from:
        from eagle3_ray.drafter.export import check_drafter_dir

        drafter = check_drafter_dir(cfg.train.init_from, "train.init_from")
        check_drafter_fits_target(drafter, cfg, f"train.init_from={cfg.train.init_from}")
    if command == "run":
        check_prompts(cfg, None)


def check_target(cfg: PipelineConfig) -> None:
    from eagle3_ray.engines.targets import check_target_spec

    check_target_spec(cfg.target.model)


def check_drafter_fits_target(drafter, cfg: PipelineConfig, what: str) -> None:
    """The drafter reads hidden states the target has (what ``spec.prepare_drafter`` checks in the
    actor), when the target's config can be read without converting it."""
    from eagle3_ray.engines.targets import peek_text_config

    target = peek_text_config(cfg.target.model, cfg.target.cache_dir) if drafter is not None else None
    if target is None:
        return
    hidden, layers = target.get("hidden_size"), target.get("num_hidden_layers")
    if isinstance(hidden, int) and drafter.target_hidden_size != hidden:
        raise ConfigError(
            f"{what} reads target states of width {drafter.target_hidden_size}, target.model={cfg.target.model}'s "
            f"are {hidden}; use a drafter trained for this target"
        )
    if isinstance(layers, int) and drafter.aux_layers and max(drafter.aux_layers) > layers:
        raise ConfigError(
            f"{what} reads target hidden_states {drafter.aux_layers}, target.model={cfg.target.model} has "
            f"{layers} layers (indices 0..{layers}); use a drafter trained for this target"
        )


def _data_source(cfg: PipelineConfig, data: str | None) -> tuple[str | list[str], str]:
    """(the path or paths, how the user gave them) of a stage's conversations."""
    if data:
        return data, f"--data {data}"
    if cfg.data.path:
        return cfg.data.path, f"data.path={cfg.data.path}"
    return DEFAULT_DATA, f"the default data {DEFAULT_DATA}"


def _existing_file(path: str, what: str, kind: str, alternative: str = "") -> Path:
    """``path`` resolved (builtin:<name> included) and checked to be a readable file."""
    from eagle3_ray.data.sources import BUILTIN_PREFIX, builtin_names, resolve_data_path

    builtins = f"builtin:<name> (one of {[BUILTIN_PREFIX + n for n in builtin_names()]})"
    p = Path(path).expanduser()
    if not path.startswith(BUILTIN_PREFIX) and not p.exists():
        raise DataError(f"{what} does not exist; pass a JSONL/JSON file of {kind}{alternative} or {builtins}")
    file = resolve_data_path(path)  # unknown builtin names raise here
    if file.is_dir():
        raise DataError(f"{what} is a directory; pass a JSONL/JSON file of {kind}{alternative} or {builtins}")
    return file


def check_conversations(cfg: PipelineConfig, data: str | None, need_answers: bool = False,
                        alternative: str = "") -> None:
    """The data exists, is a file, and holds a usable record (with an assistant turn if ``need_answers``).

    Reads only up to the first such record, so a good file costs milliseconds."""
    from eagle3_ray.data.sources import Reject, read_samples

    from eagle3_ray.data.sources import path_list

    path, what = _data_source(cfg, data)
    files = [_existing_file(p, what if isinstance(path, str) else f"{p} (in {what})", "conversations", alternative)
             for p in path_list(path)]
    rejected: list[str] = []
    prompts = 0
    for item in read_samples(files, cfg.data.format, None, cfg.data.system_prompt):
        if isinstance(item, Reject):
            rejected.append(f"{item.source}: {item.reason}")
        elif need_answers and not any(m["role"] == "assistant" for m in item.messages):
            prompts += 1
        else:
            return
    if prompts:
        bad = f", {len(rejected)} bad records" if rejected else ""
        raise DataError(
            f"{what} holds only prompts ({prompts}, no assistant turns{bad}); "
            "run `eagle3-ray generate` on it first and pass its conversations.jsonl, or use `eagle3-ray run`"
        )
    first = f", e.g. {rejected[0]}" if rejected else ""
    raise DataError(
        f"{what} holds no usable conversations ({len(rejected)} records, all rejected{first}); "
        "pass a JSONL/JSON file of conversations in ShareGPT or OpenAI form"
    )


def check_extract_input(cfg: PipelineConfig, data: str | None) -> None:
    """extract takes a prepared dataset, or raw conversations it prepares first."""
    from eagle3_ray.extract.prepared import PREPARED_FILE, prepared_path

    path, what = _data_source(cfg, data)
    if isinstance(path, list):  # several files of conversations, prepared first
        check_conversations(cfg, data, need_answers=True)
        return
    if prepared_path(path) is not None:
        return
    p = Path(path).expanduser()
    if p.is_dir():
        raise DataError(
            f"{what} is a directory without {PREPARED_FILE}; pass the --out of `eagle3-ray prepare` "
            "or a JSONL/JSON file of conversations"
        )
    check_conversations(cfg, data, need_answers=True, alternative=", the --out of `eagle3-ray prepare`,")


def check_store(features: str):
    """A feature store: store_meta.json readable and at least one completed shard. Returns its meta."""
    from eagle3_ray.features.shards import MARKERS_GLOB, marker_files
    from eagle3_ray.features.store import META_FILE, read_meta

    want = "pass the --out of `eagle3-ray extract`"
    p = require_dir(features, "--features", want, StoreError)
    if not (p / META_FILE).is_file():
        hint = f" (did you mean {p / 'features'}?)" if (p / "features" / META_FILE).is_file() else ""
        raise StoreError(f"--features {p} is not a feature store (no {META_FILE}){hint}; {want}")
    meta = read_meta(p)
    if not marker_files(p):
        raise StoreError(
            f"--features {p} holds no completed shards ({MARKERS_GLOB}); run or resume "
            f"`eagle3-ray extract --out {p}`"
        )
    return meta


def check_store_fits_target(meta, cfg: PipelineConfig, what: str) -> None:
    """The store was extracted from this target (the check ``train`` makes when planning). Describing the
    target reads its config only; a GGUF target is converted here once, as planning would anyway."""
    from eagle3_ray.engines.describe import describe_target
    from eagle3_ray.features.store import check_compatible

    info = describe_target(cfg.target)
    try:
        check_compatible(meta, {"hidden_size": info.hidden_size, "aux_layers": list(info.aux_layers),
                                "vocab_size": info.vocab_size, "target_fingerprint": info.fingerprint})
    except StoreError as e:
        raise StoreError(f"{what}: {e}") from None


def check_existing_store_out(cfg: PipelineConfig, out: str | None) -> None:
    """extract adds to the store at --out: one that is there already must be this target's."""
    if out is None or not Path(out).is_dir() or not any(Path(out).iterdir()):
        return  # a new --out: nothing to read, and torch (the features package's import) is left to Ray's start
    from eagle3_ray.engines.describe import describe_target
    from eagle3_ray.features.store import META_FILE, StoreMeta, ensure_meta

    if not (Path(out) / META_FILE).is_file():
        return
    info = describe_target(cfg.target)
    # the meta run_extract writes; the file exists, so ensure_meta only reads and compares
    ensure_meta(out, StoreMeta.from_engine_info(info, compact=cfg.extract.compact))


def check_vocab(vocab: str | None, features: str, store_target: str | None) -> None:
    """The vocab map file (``--vocab`` file or dir, default ``<features>/../vocab``), for this store's target."""
    from safetensors import SafetensorError, safe_open

    from eagle3_ray.data.vocab import VOCAB_FILE

    given = vocab is not None
    base = Path(vocab) if given else Path(features).parent / "vocab"
    what = f"--vocab {base}" if given else f"the default vocab map dir {base} (<features>/../vocab)"
    want = "pass --vocab with the --out of `eagle3-ray vocab`, or run `eagle3-ray vocab` first"
    if not base.exists():
        raise StoreError(f"{what} does not exist; {want}")
    file = base / VOCAB_FILE if base.is_dir() else base
    if not file.is_file():
        raise StoreError(f"{what} has no {VOCAB_FILE}; {want}")
    try:
        with safe_open(str(file), framework="np") as f:
            keys, raw = set(f.keys()), f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise StoreError(f"{what}: {file.name} is not a readable vocab map ({e}); {want}") from None
    if keys != {"d2t", "t2d"}:
        raise StoreError(f"{what}: {file.name} holds {sorted(keys)}, not a vocab map (d2t, t2d); {want}")
    try:
        built_for = json.loads(raw.get("target_fingerprint", "null"))
    except ValueError:
        built_for = None
    if built_for is not None and store_target is not None and built_for != store_target:
        raise StoreError(
            f"{what} was built for target {built_for}, the store at --features {features} holds target "
            f"{store_target}; rerun `eagle3-ray vocab` on this store"
        )


def check_prompts(cfg: PipelineConfig, prompts: str | None) -> None:
    """The benchmark prompt set parses (it is small; the same reader the benchmark uses)."""
    from eagle3_ray.bench.prompts import load_prompt_sets
    from eagle3_ray.bench.runner import DEFAULT_PROMPTS

    if prompts:
        path, what = prompts, f"--prompts {prompts}"
    elif cfg.bench.prompts:
        if not isinstance(cfg.bench.prompts, str):  # several sets or a mapping: the reader checks each entry
            load_prompt_sets(cfg.bench.prompts, cfg.bench.max_prompts)
            return
        path, what = cfg.bench.prompts, f"bench.prompts={cfg.bench.prompts}"
    else:
        path, what = DEFAULT_PROMPTS, f"the default prompts {DEFAULT_PROMPTS}"
    load_prompt_sets(_existing_file(path, what, "prompts"), cfg.bench.max_prompts)

