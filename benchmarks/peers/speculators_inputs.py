"""vLLM's speculators 0.9.0: its offline trainer's inputs written from one of this project's feature
stores, and its EAGLE-3 checkpoints exported to the directory SGLang loads.

speculators captures hidden states only through a running vLLM server (``speculators
generate-offline-data`` asks vLLM's ExampleHiddenStatesConnector for them); the lent GPU has no
vLLM. Its trainer reads files, so this script writes them from the features this project captured
on the same conversations: the same rows for both trainers, by construction.

    python benchmarks/peers/speculators_inputs.py inputs --features RUN/bf16 \\
        --config RUN/ours1/config.resolved.yaml --out SPEC_DIR

writes, in the layout ``speculators prepare-data`` + ``generate-offline-data`` leave (read back by
its ``ArrowDataset`` and hs_connectors' ``FileTransfer``):
  SPEC_DIR/data/                 --data-path: a datasets ``save_to_disk`` directory (state.json,
                                 dataset_info.json, data-00000-of-00001.arrow; torch format) with
                                 input_ids int64 [T], loss_mask int64 [T], seq_len int64; the training
                                 rows first, then the rows this project's training holds out (the same
                                 split): ``--train-data-ratio`` (inputs.json) splits exactly there
  SPEC_DIR/data/hidden_states/hs_<row>.safetensors
                                 {token_ids int64 [T], hidden_states bf16 [T, 4, H]}: the three aux
                                 states (HF hidden_states indices = vLLM's ids = --target-layer-ids)
                                 and, last, the verifier's last state (see below)
  SPEC_DIR/data/token_freq.pt    {token id: count} of the training rows' loss tokens, from which its
                                 trainer derives d2t-<N>.npy / t2d-<N>.npy for --draft-vocab-size N
  SPEC_DIR/target/               --verifier-name-or-path: the config's target as an HF directory (a
                                 GGUF converted, a random target saved), checked against the store's
                                 target fingerprint
  SPEC_DIR/inputs.json           counts, tokens, bytes per token, the trainer flags these files need

The last state: speculators takes vLLM's output of the final decoder layer, BEFORE the final norm,
and applies the verifier's norm itself (``verifier_lm_head(verifier_norm(h))``); this project stores
the norm's output (the lm_head input). RMSNorm forgets the scale of its input, so ``y / w`` (y ours,
w the final norm's weight) is a pre-norm state whose norm is ``y`` again, up to eps and bf16
rounding (inputs.json reports the largest relative error on the first sample). Checked on 24 real
SmolLM2 samples: the argmax of speculators' own target logits is the next greedy token on 96.9% of
the loss positions, as with ``lm_head(y)``; fed ``y`` itself (normed twice) it is on 37%.

    python benchmarks/peers/speculators_inputs.py export --checkpoint SAVE/<epoch> --out DIR

rewrites a speculators EAGLE-3 checkpoint (``Eagle3DraftModel``, ``speculators_config``) as SGLang 0.5.17's
``LlamaForCausalLMEagle3`` directory (keys unchanged: fc, layers.0.*, norm, input_norm, lm_head,
d2t, t2d; SGLang shares the target's embedding). It refuses what SGLang would serve differently
from how it was trained. ``check`` runs speculators' own loader and a few steps of its model on
the files (speculators importable; on a CPU add ``-- --loss-implementation eager --draft-attn-impl
sdpa``: its Triton loss needs a GPU and FlexAttention has no CPU backward). Like its trainer, it
caches d2t-<N>.npy / t2d-<N>.npy in SPEC_DIR/data.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # eagle3_ray, imported where used: `check`
# runs beside speculators, whose environment need not hold the project's dependencies

# Verifier families whose final norm is x_hat * (1 + w) (speculators' GEMMA_STYLE_FINAL_NORM_MODEL_TYPES):
# y / w would not invert it.
GEMMA_STYLE = {"gemma", "gemma2", "gemma3", "gemma3_text", "qwen3_5", "qwen3_5_text", "recurrent_gemma"}
ARROW = "data-00000-of-00001.arrow"
FEATURES = {"input_ids": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"},
            "loss_mask": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"},
            "seq_len": {"dtype": "int64", "_type": "Value"}}


def pre_norm_state(last: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``last`` [T, H] (an RMSNorm's output, gain ``weight`` [H]) as an input that norm maps back onto it."""
    return (last.float() / weight.float()).to(torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm as speculators' ``verifier_norm`` computes it (fp32, then back to the input dtype)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight.float() * h.to(x.dtype).float()


def verifier(cfg, store, out: Path) -> tuple[Path, torch.Tensor, float]:
    """The verifier's HF directory ``out`` (the config's target files linked, or a random target saved),
    its final norm's gain and eps. Refuses a config whose target is not the one that made the features."""
    from safetensors import safe_open

    from eagle3_ray.engines.describe import describe
    from eagle3_ray.engines.targets import load_target

    target = describe(cfg.target)  # the store's fingerprint is this one: config + weight-file identity
    if target.info.fingerprint != store.meta.target_fingerprint:
        raise SystemExit(f"[speculators_inputs] target.model={cfg.target.model!r} (fingerprint "
                         f"{target.info.fingerprint}) is not the target that made the features (store fingerprint "
                         f"{store.meta.target_fingerprint}): pass the --config of the run that captured them")
    out.mkdir(parents=True, exist_ok=True)
    if target.resolved.model_path is None:  # a random:<config> target: its seeded weights, saved once
        if not (out / "config.json").exists():
            loaded = load_target(cfg.target, device="cpu")
            loaded.model.save_pretrained(out)
            loaded.tokenizer.save_pretrained(out)
    else:  # a GGUF is converted (and cached) by resolve_target
        for f in sorted(Path(target.resolved.model_path).iterdir()):
            if f.is_file() and not (out / f.name).exists():
                (out / f.name).symlink_to(f.resolve())
    hf = json.loads((out / "config.json").read_text())
    hf = hf.get("text_config") or hf
    if hf["model_type"] in GEMMA_STYLE:
        raise SystemExit(f"[speculators_inputs] a {hf['model_type']} target's final norm is x_hat * (1 + w): "
                         "pre_norm_state inverts x_hat * w only; extend it before converting this store")
    w = None
    for f in sorted(out.glob("*.safetensors")):  # speculators loads model.norm.weight by this name too
        with safe_open(str(f), framework="pt") as st:
            if "model.norm.weight" in st.keys():
                w = st.get_tensor("model.norm.weight").float()
    if w is None:
        raise SystemExit(f"[speculators_inputs] {out}: no model.norm.weight in its safetensors; cannot invert the norm")
    if bool((w == 0).any()):
        # RMSNorm forgets the scale of its input, but a zero gain also forgets those channels: no y / w then
        raise SystemExit(f"[speculators_inputs] {out}: {int((w == 0).sum())} zero final-norm gains; cannot invert")
    return out, w, float(hf["rms_norm_eps"])


def write_rows(store, order: list[int], n_train: int, data: Path, w: torch.Tensor) -> dict:
    """``hs_<row>.safetensors`` for the store samples ``order`` (row k = order[k]; a present file is
    kept, so a cut-off run resumes), and the rows' ids, masks and training loss-token counts."""
    from safetensors.torch import save_file

    H = store.meta.hidden_size
    rows = {"ids": [], "masks": [], "freq": Counter(), "written": 0, "bytes": 0}
    t0 = time.monotonic()
    for k, i in enumerate(order):
        path = data / "hidden_states" / f"hs_{k}.safetensors"
        rec = store[int(i)]
        ids = torch.as_tensor(rec["input_ids"]).to(torch.int64).contiguous()  # [T]
        mask = torch.as_tensor(rec["loss_mask"]).to(torch.int64)  # [T]
        T = int(ids.numel())
        if not path.exists():
            aux = rec["aux_hidden"].to(torch.bfloat16).reshape(T, 3, H)  # [T, 3, H], ids in order
            last = pre_norm_state(rec["last_hidden"], w).reshape(T, 1, H)  # [T, 1, H]
            tmp = path.with_name(f".{path.name}.tmp")
            save_file({"token_ids": ids, "hidden_states": torch.cat([aux, last], dim=1).contiguous()}, str(tmp))
            os.replace(tmp, path)  # a cut-off run leaves no truncated hs file behind
            rows["written"] += 1
        rows["bytes"] += path.stat().st_size
        rows["ids"].append(ids.tolist())
        rows["masks"].append(mask.tolist())
        if k < n_train:  # like its prepare-data: the loss tokens; here of the training rows only
            rows["freq"].update(ids[mask.bool()].tolist())
        if (k + 1) % 2000 == 0:
            print(f"[speculators_inputs] {k + 1}/{len(order)} samples, {time.monotonic() - t0:.0f} s", flush=True)
    return rows


def write_dataset(data: Path, ids: list, masks: list) -> None:
    """The files ``datasets.Dataset.save_to_disk`` writes for one shard in torch format, written with
    pyarrow alone (the project has no ``datasets``); speculators reads them with ``load_from_disk``."""
    import pyarrow as pa

    info = {"citation": "", "description": "", "features": FEATURES, "homepage": "", "license": ""}
    table = pa.table({"input_ids": pa.array(ids, pa.list_(pa.int64())),
                      "loss_mask": pa.array(masks, pa.list_(pa.int64())),
                      "seq_len": pa.array([len(x) for x in ids], pa.int64())})
    table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": FEATURES}})})
    tmp = data / f".{ARROW}.tmp"
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)  # datasets' shards are Arrow IPC streams, not files
    os.replace(tmp, data / ARROW)
    (data / "dataset_info.json").write_text(json.dumps(info, indent=2))
    state = {"_data_files": [{"filename": ARROW}], "_fingerprint": secrets.token_hex(8), "_format_columns": None,
             "_format_kwargs": {}, "_format_type": "torch", "_output_all_columns": False, "_split": None}
    (data / "state.json").write_text(json.dumps(state, indent=2))


def inputs(a) -> int:
    from eagle3_ray.config import load_config
    from eagle3_ray.features import open_store
    from eagle3_ray.train.packing import split_store

    cfg = load_config(a.config)
    store = open_store(a.features)
    t = cfg.train
    keep, held, _, _ = split_store(store.sample_ids, t.val_share, t.seed, t.val_groups, t.eval_only)
    if len(held) == 0:
        # its trainer requires 0 < --train-data-ratio < 1, and the held-out rows are what it validates on
        raise SystemExit(f"[speculators_inputs] {a.config}: train.val_share={t.val_share} holds no sample out; "
                         "speculators' trainer needs a validation split: use a run with train.val_share > 0")
    out = Path(a.out)
    data = out / "data"
    (data / "hidden_states").mkdir(parents=True, exist_ok=True)
    target, w, eps = verifier(cfg, store, out / "target")
    order = [int(i) for i in keep] + [int(i) for i in held]
    rows = write_rows(store, order, len(keep), data, w)
    ids = rows["ids"]
    write_dataset(data, ids, rows["masks"])
    torch.save(dict(rows["freq"]), data / "token_freq.pt")
    first = store[order[0]]
    y = first["last_hidden"].to(torch.bfloat16)
    back = rms_norm(pre_norm_state(y, w), w, eps)
    err = float(((back - y.float()).abs().max() / y.float().abs().max()).item())
    n, shards = len(order), (Path(a.features) / "shards").glob("*.safetensors")
    summary = {
        "features": a.features, "val_share": t.val_share, "seed": t.seed, "verifier": str(target),
        "train_samples": len(keep), "eval_samples": len(held),
        "train_tokens": sum(len(x) for x in ids[:len(keep)]), "eval_tokens": sum(len(x) for x in ids[len(keep):]),
        "hs_written": rows["written"],
        # int(n * ratio) == len(keep) exactly: its ArrowDataset cuts the rows there
        "train_data_ratio": (len(keep) + 0.5) / n,
        "target_layer_ids": list(store.meta.aux_layers),
        "last_state_relative_error": err,
        "speculators_bytes_per_token": round(rows["bytes"] / sum(len(x) for x in ids), 1),
        "eagle3ray_bytes_per_token": round(sum(p.stat().st_size for p in shards) / store.num_tokens, 1),
    }
    (out / "inputs.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary), flush=True)
    return 0


def export(a) -> int:
    """A speculators EAGLE-3 checkpoint directory -> SGLang 0.5.17's LlamaForCausalLMEagle3 directory."""
    from safetensors.torch import load_file, save_file

    from eagle3_ray.engines.aux_layers import translate_aux_ids

    ckpt = Path(a.checkpoint)
    raw = json.loads((ckpt / "config.json").read_text())
    if raw.get("speculators_model_type") != "eagle3":
        raise SystemExit(f"[speculators_inputs] {ckpt}: not a speculators EAGLE-3 checkpoint "
                         f"(speculators_model_type {raw.get('speculators_model_type')!r})")
    if raw.get("norm_before_residual"):
        # SGLang 0.5.17's first layer keeps the residual before hidden_norm (llama_eagle3.py); served so,
        # a drafter trained with norm_before_residual=True (speculators' default) adds a different residual
        raise SystemExit(f"[speculators_inputs] {ckpt}: trained with norm_before_residual=True, which SGLang 0.5.17 "
                         "cannot serve as trained; train with --no-norm-before-residual")
    tlc = dict(raw["transformer_layer_config"])
    if "sliding_attention" in (tlc.get("layer_types") or []):
        raise SystemExit(f"[speculators_inputs] {ckpt}: draft layers with sliding-window attention "
                         f"({tlc.get('layer_types')}); SGLang serves full attention unless told a window: "
                         "train with --full-attention-indices 0 .. num_layers-1")
    hf_ids = list(raw["eagle_aux_hidden_state_layer_ids"])
    vpath = (raw.get("speculators_config") or {}).get("verifier", {}).get("name_or_path")
    if not a.target_model_type and not (vpath and (Path(vpath) / "config.json").is_file()):
        raise SystemExit(f"[speculators_inputs] {ckpt}: its verifier {vpath!r} has no config.json here; "
                         "pass --target-model-type (e.g. llama) to translate the aux ids for SGLang")
    model_type = a.target_model_type or json.loads((Path(vpath) / "config.json").read_text())["model_type"]
    eagle = {"eagle_aux_hidden_state_layer_ids": translate_aux_ids(hf_ids, model_type, "sglang"),
             "use_aux_hidden_state": True, "norm_before_fc": bool(raw.get("norm_before_fc"))}
    for k in ("sliding_window", "use_sliding_window", "layer_types", "architectures", "_name_or_path"):
        tlc.pop(k, None)
    config = {**tlc, "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
              "draft_vocab_size": int(raw["draft_vocab_size"]), "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "norm_before_fc": bool(raw.get("norm_before_fc")),
              "norm_output": bool(raw.get("norm_output")), "fc_norm": bool(raw.get("fc_norm")), "eagle_config": eagle,
              "speculators_source": {"checkpoint": str(ckpt.resolve()), "aux_hidden_state_indices": hf_ids,
                                     "target_model_type": model_type}}
    state = load_file(str(ckpt / "model.safetensors"))
    keep = {k: v.to(torch.int64 if k == "d2t" else torch.bool if k == "t2d" else torch.bfloat16).contiguous()
            for k, v in state.items() if not k.startswith(("verifier_", "embed_tokens."))}
    if "d2t" not in keep or "lm_head.weight" not in keep:
        raise SystemExit(f"[speculators_inputs] {ckpt}: no d2t / lm_head.weight (keys {sorted(state)}): train with "
                         "--draft-vocab-size below the target vocabulary")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(keep, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    print(f"[speculators_inputs] {ckpt} -> {out} (SGLang aux ids {eagle['eagle_aux_hidden_state_layer_ids']}, "
          f"{len(keep)} tensors)", flush=True)
    return 0


@torch.no_grad()
def target_agreement(model, batch: dict) -> float:
    """Share of the loss positions where speculators' own target (``verifier_lm_head(verifier_norm(h))``
    on the converted last state) puts its argmax on the token that follows in the data: on greedy
    self-distilled answers about 1 when the last state, its norm and the alignment are right."""
    logits = model.verifier_lm_head(model.verifier_norm(batch["verifier_last_hidden_states"].float()))[0]  # [S, Vd]
    top = logits.argmax(-1)  # [S], draft ids
    if model.d2t is not None:
        top = top + model.d2t[top]  # d2t holds target id - draft id
    ids, mask = batch["input_ids"][0], batch["loss_mask"][0].bool()  # [S]
    # after its shift_batch, position t holds the state of token t+1, which predicts input_ids[t+1]
    hit = (top[:-1] == ids[1:]) & mask[1:]
    return float(hit.sum() / mask[1:].sum().clamp(min=1))


def check(a) -> int:
    """speculators' own loader over the files, and ``--steps`` steps of its EAGLE-3 model and loss on them."""
    from speculators.model import SpeculatorModel
    from speculators.train.cli import build_draft_model, parse_vocab_mappings
    from speculators.train.config import TrainConfig
    from speculators.train.dataloader import create_train_val_loaders
    from speculators.models.eagle3.data import shift_batch

    spec = json.loads((Path(a.inputs) / "inputs.json").read_text())
    data = str(Path(a.inputs) / "data")
    argv = ["--verifier-name-or-path", spec["verifier"], "--data-path", data, "--on-missing", "raise",
            "--target-layer-ids", *map(str, spec["target_layer_ids"]),
            "--train-data-ratio", str(spec["train_data_ratio"]), "--num-workers", "0",
            "--total-seq-len", str(a.total_seq_len), *a.flags]
    args = argparse.Namespace(**TrainConfig.resolve(argv).flatten())
    d2t, t2d, dvs = parse_vocab_mappings(args)
    model = build_draft_model(args, SpeculatorModel.registry["eagle3"], t2d, d2t, dvs)
    train, val = create_train_val_loaders(
        data_path=data, total_seq_len=args.total_seq_len, hidden_states_dtype=torch.bfloat16, transfer=None,
        vllm_endpoint=args.vllm_endpoint, on_missing="raise", verifier_name_or_path=args.verifier_name_or_path,
        request_timeout=None, max_retries=0, generation_validation_retries=0, max_consecutive_generation_failures=1,
        hidden_size=model.config.transformer_layer_config.hidden_size, num_target_layers=len(model.target_layer_ids),
        num_workers=0, prefetch_factor=None, preprocess=shift_batch, train_data_ratio=args.train_data_ratio)
    kwargs, _ = type(model).get_trainer_kwargs(**vars(args))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr)
    result = {"train_batches": len(train), "val_batches": len(val), "draft_vocab_size": dvs, "steps": []}
    for step, batch in zip(range(a.steps), train):
        if batch["error_records"]:  # a row whose hs file it refused (token ids differ) is dropped silently
            raise SystemExit(f"[speculators_inputs] its loader dropped {batch['error_records']} rows of batch {step}")
        batch = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        if step == 0:
            result["target_agreement"] = target_agreement(model, batch)
        _, loss, metrics = model(**batch, **kwargs)
        opt.zero_grad()
        loss.backward()
        opt.step()
        result["steps"].append({"loss": float(loss.detach()), "tokens": int((batch["document_ids"] != -1).sum())})
    print(json.dumps(result), flush=True)
    return 0 if all(torch.isfinite(torch.tensor(s["loss"])) for s in result["steps"]) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("inputs", help="its trainer's files from a feature store")
    p.add_argument("--features", required=True, help="this project's feature store (bf16: RUN/bf16)")
    p.add_argument("--config", required=True,
                   help="the capturing run's resolved config (its target; train.val_share, seed)")
    p.add_argument("--out", required=True)
    p.set_defaults(fn=inputs)
    p = sub.add_parser("export", help="a speculators EAGLE-3 checkpoint -> the directory SGLang loads")
    p.add_argument("--checkpoint", required=True, help="speculators' SAVE_PATH/<epoch> directory")
    p.add_argument("--target-model-type", help="default: the verifier's config.json model_type")
    p.add_argument("--out", required=True)
    p.set_defaults(fn=export)
    p = sub.add_parser("check", help="its loader and a few steps of its model on `inputs`' files")
    p.add_argument("--inputs", required=True, help="`inputs`' --out")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--total-seq-len", type=int, default=1024)
    p.add_argument("flags", nargs="*", help="more `speculators train` flags, after --")
    p.set_defaults(fn=check)
    a = ap.parse_args(argv)
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
