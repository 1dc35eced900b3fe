"""SpecForge 0.2.0 run files for the side-by-side comparison: its run YAML and draft config JSON.

Run with SpecForge importable (the device's /tmp/sf, or a local venv with the wheel):

    python benchmarks/peers/specforge_config.py --inputs SF_DIR --name aligned --epochs 1 \\
        --draft-vocab 16384 --out SF_DIR/aligned-1ep

The run follows SpecForge's own offline example (`examples/configs/llama3.1-8b-eagle3-offline.yaml`:
batch 1, lr 1e-4 cosine, warmup 1.5%, clip 0.5, TTT 7, sdpa attention) and changes only what must
match this project's run: the features (SF_DIR from `specforge_inputs.py`), max length 2048, the
epochs and, for the aligned run, the draft vocabulary size. The draft config is the one SpecForge
derives from the target itself (`resolve_draft_config`, what it trains when a run names none), with
`draft_vocab_size` replaced when `--draft-vocab` is given (its default is 32,000), and written to a
JSON file as its recipes do, since `specforge export` needs one. The held-out samples are its
evaluation set, evaluated every `--eval-every` steps. No vocab mapping file is named: SpecForge counts
the tokens of the training features itself and caches its mapping under `data.cache_dir`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml


def run_config(inputs: Path, out: Path, name: str, epochs: int, eval_every: int, draft_config: Path) -> dict:
    return {
        "model": {
            "target_model_path": str(inputs / "target"),
            "draft_model_config": str(draft_config),
            "embedding_key": "model.embed_tokens.weight",
            "lm_head_key": "model.embed_tokens.weight",  # SmolLM2 ties lm_head to the embedding
            "torch_dtype": "bfloat16",
        },
        "data": {
            "hidden_states_path": str(inputs / "train"),
            "eval_hidden_states_path": str(inputs / "eval"),
            "max_length": 2048,
            "cache_dir": str(out / "cache"),
        },
        "training": {
            "strategy": "eagle3", "num_epochs": epochs, "batch_size": 1, "learning_rate": 1e-4,
            "max_grad_norm": 0.5, "ttt_length": 7, "attention_backend": "sdpa", "log_interval": 50,
            "eval_interval": eval_every, "seed": 0,
        },
        "tracking": {"report_to": "tensorboard"},
        "run_id": name,
        "output_dir": str(out / "out"),
        "deployment": {"mode": "local_colocated", "trainer": {"nnodes": 1, "nproc_per_node": 1}},
    }


def draft_config(run_yaml: Path, draft_vocab: int | None) -> dict:
    """The draft config SpecForge derives from the target for the run in ``run_yaml`` (written
    without ``model.draft_model_config``)."""
    from specforge.application import resolve_run
    from specforge.config import load_config
    from specforge.training.model_loading import resolve_draft_config

    resolved = resolve_run(load_config(str(run_yaml)))
    d = resolve_draft_config(resolved.config, provider=resolved.algorithm.providers.model.draft_config).to_dict()
    if draft_vocab:
        d["draft_vocab_size"] = draft_vocab
    return d


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inputs", required=True, help="specforge_inputs.py's output directory")
    ap.add_argument("--name", required=True, help="run id, e.g. aligned-1ep")
    ap.add_argument("--epochs", type=int, required=True)
    ap.add_argument("--draft-vocab", type=int, default=None, help="default: SpecForge's own (32,000)")
    ap.add_argument("--eval-every", type=int, default=1000)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    inputs, out = Path(a.inputs).resolve(), Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    dc_path = out / "draft_config.json"
    cfg = run_config(inputs, out, a.name, a.epochs, a.eval_every, dc_path)
    run_yaml = out / "run.yaml"
    derived = {**cfg, "model": {k: v for k, v in cfg["model"].items() if k != "draft_model_config"}}
    run_yaml.write_text(yaml.safe_dump(derived, sort_keys=False))
    dc_path.write_text(json.dumps(draft_config(run_yaml, a.draft_vocab), indent=1, default=str))
    run_yaml.write_text(yaml.safe_dump(cfg, sort_keys=False))
    print(run_yaml)
    return 0


if __name__ == "__main__":
    sys.exit(main())
