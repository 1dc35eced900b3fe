"""SpecForge 0.2.0's offline trainer inputs, written from one of this project's feature stores.

SpecForge captures with ``scripts/prepare_hidden_states.py``, which imports SGLang 0.5.14 internals
that SGLang 0.5.17 no longer has (``get_attention_tp_group``, ``compute_dp_attention_local_info``),
so on the lent GPU (SGLang 0.5.17) its capture cannot run. Its trainer reads per-sample files, so
this script writes them from the features this project captured on the same conversations: the
same rows for both trainers, by construction.

    python benchmarks/peers/specforge_inputs.py --features RUN/features --config RUN/train/config.yaml \\
        --target TARGET_HF_DIR --out SF_DIR

writes, in SpecForge's layout (``prepare_hidden_states.py``'s ``_get_file_path`` and record):
  SF_DIR/train/rows_<g>-<g+2000>/data_<i>.ckpt   {input_ids int64 [T], loss_mask int64 [T],
                                                  hidden_state bf16 [1, T, H], aux_hidden_state bf16 [1, T, 3H]}
  SF_DIR/eval/...                                the samples this project's training holds out (the same split)
  SF_DIR/target/                                 the target's files plus the ``*.safetensors.index.json``
                                                 SpecForge's target head needs (SmolLM2 ties lm_head to the
                                                 embedding: pass model.lm_head_key=model.embed_tokens.weight)
  SF_DIR/inputs.json                             counts, tokens and bytes on disk per token of both formats

``hidden_state`` is the final norm's output, the lm_head input, in both projects (SpecForge's
``TargetHead`` is the lm_head alone). Files are written atomically and an existing one is kept, so
a cut-off run resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from eagle3_ray.config import load_config  # noqa: E402
from eagle3_ray.features import open_store  # noqa: E402
from eagle3_ray.train.packing import split_store  # noqa: E402

GROUP = 2000  # SpecForge's file_group_size


def sample_file(root: Path, idx: int) -> Path:
    g = idx // GROUP * GROUP
    return root / f"rows_{g}-{g + GROUP}" / f"data_{idx}.ckpt"


def specforge_record(rec: dict) -> dict[str, torch.Tensor]:
    """One sample of this project's store as SpecForge's offline EAGLE-3 record."""
    return {
        "input_ids": torch.as_tensor(rec["input_ids"]).to(torch.int64).clone(),  # [T]
        "loss_mask": torch.as_tensor(rec["loss_mask"]).to(torch.int64).clone(),  # [T]
        "hidden_state": rec["last_hidden"].to(torch.bfloat16).unsqueeze(0).clone(),  # [1, T, H]
        # copies: torch.save of a view of the shard would write the whole shard
        "aux_hidden_state": rec["aux_hidden"].to(torch.bfloat16).unsqueeze(0).clone(),  # [1, T, 3H]
    }


def write_split(store, indices, root: Path) -> dict[str, int]:
    n_bytes = n_tokens = written = 0
    t0 = time.monotonic()
    for k, i in enumerate(indices):
        path = sample_file(root, k)
        rec = store[int(i)]
        n_tokens += int(len(rec["input_ids"]))
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            torch.save(specforge_record(rec), tmp)
            os.replace(tmp, path)
            written += 1
        n_bytes += path.stat().st_size
        if (k + 1) % 2000 == 0:
            print(f"[specforge_inputs] {root.name}: {k + 1}/{len(indices)} samples, "
                  f"{time.monotonic() - t0:.0f} s", flush=True)
    return {"samples": len(indices), "written": written, "tokens": n_tokens, "bytes": n_bytes}


def target_dir(hf_dir: Path, out: Path) -> Path:
    """``hf_dir``'s files linked into ``out`` with a ``model.safetensors.index.json`` (SpecForge's
    target head and embedding loader find the weights through an index only)."""
    from safetensors import safe_open

    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for f in sorted(hf_dir.iterdir()):
        link = out / f.name
        if not link.exists():
            link.symlink_to(f.resolve())
        if f.suffix == ".safetensors":
            with safe_open(str(f), framework="pt") as st:
                weight_map.update({k: f.name for k in st.keys()})
    index = out / "model.safetensors.index.json"
    if not any(out.glob("*.index.json")):
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    return out


def store_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "shards").glob("*.safetensors"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--features", required=True, help="this project's feature store (RUN/features)")
    ap.add_argument("--config", required=True, help="the run's resolved config (for train.val_share, seed)")
    ap.add_argument("--target", help="the target's HF directory (safetensors); linked with an index")
    ap.add_argument("--out", required=True)
    ap.add_argument("--compare", nargs="*", default=[], help="more stores whose bytes per token to report")
    a = ap.parse_args(argv)
    cfg = load_config(a.config)
    store = open_store(a.features)
    t = cfg.train
    keep, held, _, _ = split_store(store.sample_ids, t.val_share, t.seed, t.val_groups, t.eval_only)
    out = Path(a.out)
    summary: dict = {"features": a.features, "val_share": t.val_share, "seed": t.seed}
    summary["train"] = write_split(store, keep, out / "train")
    summary["eval"] = write_split(store, held, out / "eval")
    if a.target:
        summary["target"] = str(target_dir(Path(a.target), out / "target"))
    sf_bytes = summary["train"]["bytes"] + summary["eval"]["bytes"]
    sf_tokens = summary["train"]["tokens"] + summary["eval"]["tokens"]
    summary["specforge_bytes_per_token"] = round(sf_bytes / sf_tokens, 1)
    stores = {a.features: store.meta.compact, **{p: open_store(p).meta.compact for p in a.compare}}
    summary["eagle3ray_bytes_per_token"] = {
        compact: round(store_bytes(Path(p)) / open_store(p).num_tokens, 1) for p, compact in stores.items()}
    (out / "inputs.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
