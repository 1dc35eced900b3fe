"""Drafter quality on real weights, in one process on one GPU (no Ray): SmolLM2-135M-Instruct.

    python benchmarks/quality_smollm2.py --gguf /tmp/SmolLM2-135M-Instruct.Q4_1.gguf \
        --prompts .gq/train_prompts.jsonl --eval-dir .gq/eval --out $OUT/quality.json
    # or in two calls of a 10-minute device limit (the drafter is kept under --work in between):
    ... --phase train --deadline 560      then      ... --phase eval --deadline 560

self-distill (target answers several thousand training prompts, greedy) -> tokenize with loss
masks -> capture aux/last hidden states -> vocab map -> TTT training (time-bounded) -> evaluate
chain(K) and tree speculative decoding against plain generation on held-out sets (MT-bench etc.),
batch 1, temperature 0, same prompts in the same run. Uses the package's own modules throughout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from eagle3_ray.config import TrainConfig

_TRAIN_DEFAULTS = TrainConfig()  # the product's training defaults, where this script has no reason to differ


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def distill(engine, tok, prompts_path: Path, work: Path, a) -> list:
    from eagle3_ray.data.chat import render_generation_prompt
    from eagle3_ray.data.distill import self_distill
    from eagle3_ray.data.sources import Sample, read_samples

    samples = [s for s in read_samples(prompts_path, max_samples=a.num_prompts) if isinstance(s, Sample)]
    k, n_shards = a.shard
    samples = samples[k::n_shards]  # one process per GPU, each answering its own share
    t = time.perf_counter()
    if a.synthetic_prompts:
        samples += synthetic_prompts(engine, tok, a)
    # Prompts whose answers would not fit --max-length teach nothing (training truncates them away).
    n = len(samples)
    samples = [s for s in samples if len(render_generation_prompt(tok, s.messages)) +
               a.max_new_tokens * sum(m["role"] == "user" for m in s.messages) <= a.max_length]
    log(f"{len(samples)} prompts to answer ({n - len(samples)} too long for --max-length {a.max_length})")
    # Similar lengths batch together (less padding; the static decoder keeps one graph longer), within
    # windows of a shuffled order, so a time budget that stops early still leaves the whole mix.
    random.Random(0).shuffle(samples)
    window = 8 * a.gen_batch
    samples = [s for w in range(0, len(samples), window)
               for s in sorted(samples[w : w + window], key=lambda s: sum(len(m["content"]) for m in s.messages))]
    out = work / "distilled.jsonl"
    n_before = sum(isinstance(s, Sample) for s in read_samples(out)) if out.exists() else 0
    t_answers = time.perf_counter()
    chunk = 4 * a.gen_batch
    for start in range(0, len(samples), chunk):  # self_distill appends and resumes: stop between chunks
        if time.perf_counter() - t > a.distill_seconds:
            log(f"distillation time budget reached after {start} prompts")
            break
        self_distill(engine, tok, samples[start : start + chunk], out, max_new_tokens=a.max_new_tokens,
                     batch_size=a.gen_batch)
    done = [s for s in read_samples(out) if isinstance(s, Sample)]
    log(f"self-distilled {len(done)} prompts ({len(done) - n_before} in this run) in "
        f"{time.perf_counter() - t_answers:.0f}s after the synthetic prompts "
        f"({(len(done) - n_before) / (time.perf_counter() - t_answers):.1f} answers/s)")
    # More data from the same prompts: sampled answers (temperature > 0) are other trajectories of
    # the same target; the drafter still learns the target's distribution at every position.
    extra_out = work / "distilled_sampled.jsonl"
    for copy in range(1, a.samples_per_prompt):
        if time.perf_counter() - t > a.distill_seconds:
            log(f"distillation time budget reached before sampled copy {copy}")
            break
        answered = {s.sample_id for s in done}
        copies = [dataclasses.replace(s, sample_id=f"{s.sample_id}#s{copy}") for s in samples if s.sample_id in answered]
        for start in range(0, len(copies), chunk):
            if time.perf_counter() - t > a.distill_seconds:
                break
            self_distill(engine, tok, copies[start : start + chunk], extra_out, max_new_tokens=a.max_new_tokens,
                         batch_size=a.gen_batch, temperature=a.sample_temperature, seed=copy)
    if extra_out.exists():
        extra = [s for s in read_samples(extra_out) if isinstance(s, Sample)]
        log(f"+ {len(extra)} sampled answers (temperature {a.sample_temperature}) in {time.perf_counter() - t:.0f}s")
        done += extra
    if hasattr(engine, "release_generate_state"):
        engine.release_generate_state()  # its KV storage is not needed for capture and training
    return done


def synthetic_prompts(engine, tok, a) -> list:
    """Magpie-style prompts: the target writes user turns itself, sampled from the chat template's
    user header (the system prompt the template adds by default, then the user role)."""
    from eagle3_ray.data.sources import Sample

    marker = "\ue000"
    text = tok.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    ids = tok(text[: text.index(marker)], add_special_tokens=False)["input_ids"]
    t, out, seen, call = time.perf_counter(), [], set(), 0
    while len(out) < a.synthetic_prompts and time.perf_counter() - t < a.synthetic_seconds:
        answers = engine.generate([ids] * a.gen_batch, 160, temperature=1.0, top_p=0.98,
                                  seed=10_000 + call + 1_000_000 * a.shard[0])
        call += 1
        for new in answers:
            if not new or new[-1] not in engine.eos_ids:  # the user turn never ended
                continue
            q = tok.decode(new, skip_special_tokens=True).strip()
            if len(q.split()) < 4 or q in seen:
                continue
            seen.add(q)
            out.append(Sample(f"magpie{a.shard[0]}-{len(out):06d}", [{"role": "user", "content": q}], "synthetic"))
    log(f"{len(out)} synthetic prompts from {call * a.gen_batch} samples in {time.perf_counter() - t:.0f}s; "
        f"e.g. {[s.messages[0]['content'][:80] for s in out[:3]]}")
    return out[: a.synthetic_prompts]


_TOKENIZE: tuple = ()  # (tokenizer, conversations, max_length) for the forked tokenizer processes


def _tokenize_one(i: int):
    from eagle3_ray.data.chat import tokenize_conversation
    from eagle3_ray.errors import SampleRejected

    tok, convs, max_length = _TOKENIZE
    try:
        c = tokenize_conversation(tok, convs[i], max_length, truncate=True)
    except SampleRejected:
        return None
    return np.asarray(c.input_ids, dtype=np.int32), np.asarray(c.loss_mask, dtype=np.uint8)


def tokenize_all(tok, convs, order, max_length, procs):
    """Tokenized (input_ids, loss_mask) of convs[i] for i in order (None where rejected); the chat
    template renders in Python, so large sets tokenize in forked processes (67K conversations took
    82 s in one)."""
    global _TOKENIZE
    _TOKENIZE = (tok, convs, max_length)
    if procs <= 1 or len(order) < 2000:
        return [_tokenize_one(i) for i in order]
    import multiprocessing as mp
    import os

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the children tokenize one text at a time
    with mp.get_context("fork").Pool(procs) as pool:  # children never touch CUDA
        try:
            return pool.map_async(_tokenize_one, order, chunksize=256).get(timeout=180)
        except mp.TimeoutError:  # a child stuck on a lock inherited through fork: do it here instead
            log("forked tokenizers timed out; tokenizing in this process")
    return [_tokenize_one(i) for i in order]


def featurize(engine, tok, convs, a):
    import os

    from eagle3_ray.engines.hf import plan_groups, right_padded

    dev = engine.target.device
    # Features stay on the training device: cap the tokens at a share of its free memory, taking a
    # random share of the conversations (not the tail of the mix).
    hidden = engine.target.model.config.hidden_size
    per_token = (len(engine.info.aux_layers) + 1) * hidden * 2  # bf16 aux + last hidden
    if dev.type == "cuda":
        free = torch.cuda.mem_get_info(dev)[0] + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        budget = int(a.feature_memory * free) // per_token
    else:
        budget = 1 << 62
    order = list(range(len(convs)))
    random.Random(0).shuffle(order)
    t = time.perf_counter()
    procs = min(16, os.cpu_count() or 1)
    toks, groups, n = [], [], 0
    for i, c in zip(order, tokenize_all(tok, convs, order, a.max_length, procs)):
        if c is None:
            continue
        if n + len(c[0]) > budget:
            log(f"features of {len(toks)} of {len(convs)} conversations fit {a.feature_memory:.0%} of free device "
                f"memory ({budget:,} tokens); the rest are left out")
            break
        n += len(c[0])
        toks.append(c)
        groups.append(convs[i].sample_id.split("#")[0])  # sampled answers share their prompt's group
    log(f"tokenized {len(toks)} conversations in {time.perf_counter() - t:.0f}s ({procs} processes)")
    t = time.perf_counter()
    records: list = [None] * len(toks)
    # The target's forward straight into device copies (engine.capture would bring them to the host,
    # as extraction needs, and this script would copy them back).
    with torch.no_grad():  # not inference mode: training saves these features for backward
        for group in plan_groups([len(c[0]) for c in toks], 65536):
            aux, last = engine.forward_states(*right_padded([torch.from_numpy(toks[i][0]) for i in group]))
            for row, i in enumerate(group):
                m = len(toks[i][0])
                records[i] = {
                    "group": groups[i],
                    "input_ids": torch.from_numpy(toks[i][0]).long(),
                    "loss_mask": torch.from_numpy(toks[i][1]),
                    # Kept on the training device: no host-to-device copy per training step. Copies,
                    # not views: a view would keep its whole padded batch alive.
                    "aux_hidden": aux[row, :m].to(dtype=torch.bfloat16, copy=True),
                    "last_hidden": last[row, :m].to(dtype=torch.bfloat16, copy=True),
                }
            del aux, last
    n = sum(r["input_ids"].numel() for r in records)
    log(f"captured {len(records)} samples, {n:,} tokens in {time.perf_counter() - t:.0f}s")
    return records


def train(engine, records, a, device):
    """The product's training step (eagle3_ray/train/step.py) over features held on the device: a
    fused AdamW on fp32 weights under bf16 autocast, the product's gradient clipping and schedule."""
    from eagle3_ray.data.vocab import build_vocab_map, count_tokens, vocab_coverage
    from eagle3_ray.drafter.model import DrafterConfig, Eagle3Drafter
    from eagle3_ray.train.packing import collate, plan
    from eagle3_ray.train.schedule import warmup_cosine
    from eagle3_ray.train.step import StepConfig, TorchEngine, TrainStep, adamw, resolve_attention

    model = engine.target.model
    V = model.get_input_embeddings().num_embeddings
    counts = sum(count_tokens(r["input_ids"], r["loss_mask"], V) for r in records)
    d2t, t2d = build_vocab_map(counts, a.draft_vocab)
    cfg = DrafterConfig.from_target(model.config, a.draft_vocab, engine.info.aux_layers)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg)
    drafter.bind_embedding(model.get_input_embeddings().weight.float())
    drafter.set_vocab_map(torch.from_numpy(d2t), torch.from_numpy(t2d))
    drafter.to(device)
    lm_head = model.get_output_embeddings().weight.detach()  # target dtype: fp32 logits in TF32 (exact)
    opt = adamw([p for p in drafter.parameters() if p.requires_grad], lr=a.lr, weight_decay=a.weight_decay)
    # Held out: every answer of a few prompts (simulated tau on them shows over-fitting as it happens).
    groups = sorted({r["group"] for r in records})
    val_groups = set(random.Random(0).sample(groups, min(a.val_samples, len(groups) // 10)))
    val = [r for r in records if r["group"] in val_groups]
    records = [r for r in records if r["group"] not in val_groups]
    val_packs = plan(np.array([r["input_ids"].numel() for r in val]), a.batch_tokens, 1, seed=0)
    lengths = np.array([r["input_ids"].numel() for r in records])
    packs = plan(lengths, a.batch_tokens, a.epochs, seed=0)
    # The cosine runs over the steps the time budget allows, re-estimated once the speed is known.
    horizon = [len(packs)]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, a.warmup, horizon[0], a.min_lr_ratio))
    # The training loop's rule (varlen on CUDA for auto); off CUDA always sdpa, as before (flex has no CPU backward).
    attention = resolve_attention(a.attention, device.type) if device.type == "cuda" else "sdpa"
    step_fn = TrainStep(TorchEngine(drafter, opt, sched, grad_accum=1, grad_clip=a.grad_clip), lm_head,
                        StepConfig(ttt_steps=a.ttt_steps, loss_decay=a.loss_decay, attention=attention,
                                   pad_to=a.batch_tokens, row_tokens=a.row_tokens, autocast=True))
    log(f"training: {len(records)} samples, {len(packs)} packs of <= {a.batch_tokens} tokens over {a.epochs} epochs "
        f"(at most); draft vocab {a.draft_vocab} covers {vocab_coverage(counts, t2d):.1%} of loss tokens")
    t0 = time.perf_counter()
    hist, tokens, step = [], 0, 0
    for step, pack in enumerate(packs):
        elapsed = time.perf_counter() - t0
        if elapsed > a.train_seconds:
            log(f"training time budget reached at step {step}/{len(packs)}")
            break
        # Re-estimated as start-up and validation costs amortise: estimated only at steps 40 and
        # 200, the 67K-conversation runs planned 2079 steps and took 2944-2962, ~30% at the floor lr.
        if step in (40, 200, 1000, 2000, 4000):
            horizon[0] = min(len(packs), int(step * a.train_seconds / elapsed))
            log(f"schedule: {horizon[0]} steps fit the {a.train_seconds:.0f}s budget")
        out = step_fn({k: v.to(device) for k, v in collate([records[i] for i in pack.samples]).items()})
        tokens += pack.tokens
        if step % 50 == 0 or step == len(packs) - 1:
            m = out.metrics
            hist.append({"step": step, "loss": m["loss"], "tau": m["tau"], "acc_0": m["acc_0"],
                         "epoch": pack.epoch, "lr": sched.get_last_lr()[0]})
            if step % 250 == 0 and val_packs:
                hist[-1].update(_validate(step_fn, val, val_packs, device))
            log(f"step {step}/{horizon[0]} ep {pack.epoch} loss {m['loss']:.3f} acc0 {m['acc_0']:.3f} "
                f"tau {m['tau']:.2f} {tokens / (time.perf_counter() - t0):,.0f} tok/s ({attention})"
                + (f"; held out: tau {hist[-1]['val_tau']:.2f} acc0 {hist[-1]['val_acc_0']:.3f}"
                   if "val_tau" in hist[-1] else ""))
    seconds = time.perf_counter() - t0
    final = _validate(step_fn, val, val_packs, device) if val_packs else {}
    log(f"held out ({len(val)} conversations of {len(val_groups)} prompts): {final}")
    return drafter.eval(), hist, {"steps": step + 1, "seconds": seconds, "tokens_per_s": tokens / seconds,
                                   "epochs_seen": packs[step].epoch + 1, "attention": attention,
                                   "coverage": vocab_coverage(counts, t2d), "train_samples": len(records),
                                   "train_tokens": int(lengths.sum()), "held_out": final}


def _validate(step_fn, val, val_packs, device) -> dict:
    """Token-weighted simulated tau / acc_0 / loss of the TTT unroll on the held-out conversations
    (the product's evaluation: `TrainStep.evaluate`)."""
    from eagle3_ray.train.packing import collate

    return step_fn.evaluate(({k: v.to(device) for k, v in collate([val[i] for i in pack.samples]).items()},
                             pack.tokens) for pack in val_packs)


def eval_sets(eval_dir: Path, per_set: int) -> dict[str, list[list[str]]]:
    """name -> list of turn lists; single-turn sets give one-turn lists."""
    sets = {}
    for name, key in (("mt_bench", "turns"), ("spec_bench", "turns"), ("gsm8k_test", "question"),
                      ("humaneval", "prompt")):
        path = eval_dir / f"{name}.jsonl"
        if not path.is_file():
            continue
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        random.Random(0).shuffle(rows)
        sets[name] = [r[key] if isinstance(r[key], list) else [r[key]] for r in rows[:per_set]]
    return sets


def hf_generate(model, ids: torch.Tensor, n: int) -> tuple[list[int], float]:
    """The baseline: transformers ``generate``, greedy, batch 1, default (dynamic) cache."""
    from eagle3_ray.decode.stats import Stopwatch

    dev = model.get_input_embeddings().weight.device
    eos = model.generation_config.eos_token_id
    clock = Stopwatch(dev)
    # The baseline at its best: without cuDNN's per-shape sdpa plans (the key length grows every step).
    from eagle3_ray.drafter.model import sdpa_for_growing_keys

    with sdpa_for_growing_keys(dev):
        out = model.generate(ids[None].to(dev), attention_mask=torch.ones_like(ids)[None].to(dev), max_new_tokens=n,
                             do_sample=False, top_p=None, top_k=None, temperature=None, repetition_penalty=1.0)
    seconds = clock.seconds()
    tokens = out[0, ids.shape[0]:].tolist()
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:cut], seconds


def evaluate(model, tok, drafter, sets, a, on_set) -> dict:
    """Per set and mode: tokens/s over the same turns, tau, and speedup over HF ``generate``.

    Modes: ``plain`` (our greedy loop) and ``chain``/``tree`` (EAGLE-3), each on a ``StaticTarget``
    (preallocated cache, CUDA graphs; the default), and for the first ``--eager-turns`` turns also on
    the plain DynamicCache path (``*_eager``) to show what the graphs buy.
    """
    import eagle3_ray.decode as spec
    from eagle3_ray.data.chat import render_generation_prompt

    static = spec.StaticTarget(model, drafter.config.aux_layers, max_length=a.max_length + a.eval_new_tokens + 64,
                               cuda_graphs=not a.no_graphs)
    spec_modes = {"chain": dict(mode="chain", num_steps=a.chain_k),
                  "tree": dict(mode="tree", topk=a.topk, depth=a.depth, total_tokens=a.total_tokens)}

    def run(mode, ids, eager=False):
        target = model if eager else static
        if mode == "plain":
            return spec.target_generate(target, ids, a.eval_new_tokens)
        return spec.generate(target, drafter, ids, a.eval_new_tokens, **spec_modes[mode])

    modes = ["plain", *spec_modes]
    warm = torch.tensor(render_generation_prompt(tok, [{"role": "user", "content": "Hello"}]))
    hf_generate(model, warm, 16)
    t = time.perf_counter()
    try:
        for m in modes:  # captures the graphs of every width these modes use
            run(m, warm)
    except Exception:  # noqa: BLE001 - keep measuring without graphs, and say why
        log("graph capture failed, StaticTarget falls back to eager forwards:\n" + traceback.format_exc())
        static = spec.StaticTarget(model, drafter.config.aux_layers, max_length=static.max_length, cuda_graphs=False)
        for m in modes:
            run(m, warm)
    log(f"warm-up and graph capture {time.perf_counter() - t:.1f}s, graphs for widths {static.captured}")
    if a.profile and sets:
        _profile(lambda ids: hf_generate(model, ids, a.eval_new_tokens), lambda ids: run("chain", ids),
                 torch.tensor(render_generation_prompt(tok, [{"role": "user", "content": next(iter(sets.values()))[0][0]}])),
                 Path(a.out).with_suffix(".prof.txt"))
    results, eager_left = {}, a.eager_turns
    shares = {"mt_bench": a.mt_share}  # MT-bench is the headline set; the others share the rest
    rest = (1 - shares["mt_bench"]) / max(1, len([n for n in sets if n != "mt_bench"]))
    all_modes = ["baseline", *modes, *(f"{m}_eager" for m in modes)]
    for name, convs in sets.items():
        # Per mode: all turns (tau, tokens/s) and the turns HF generate also ran (speedup on the same turns).
        zero = {"tokens": 0, "verified": 0, "steps": 0, "seconds": 0.0, "turns": 0, "differ": 0,
                "tokens_b": 0, "seconds_b": 0.0}
        agg = {m: dict(zero) for m in all_modes}
        t_set, budget = time.perf_counter(), a.eval_seconds * shares.get(name, rest)
        turns_done = 0
        for turns in convs:
            if time.perf_counter() - t_set > budget:
                break
            messages = []
            for turn in turns[: a.max_turns]:
                messages.append({"role": "user", "content": turn})
                ids = torch.tensor(render_generation_prompt(tok, messages)[-a.max_length:])
                base = None
                if turns_done < a.baseline_turns:
                    base, seconds = hf_generate(model, ids, a.eval_new_tokens)
                    for k, x in (("tokens", len(base)), ("tokens_b", len(base)), ("seconds", seconds),
                                 ("seconds_b", seconds), ("turns", 1)):
                        agg["baseline"][k] += x
                todo = [(m, False) for m in modes] + ([(m, True) for m in modes] if eager_left > 0 else [])
                eager_left -= 1
                answer = base
                for m, eager in todo:
                    out, st = run(m, ids, eager)
                    answer = out if answer is None else answer  # without a baseline: plain greedy's answer
                    v = agg[f"{m}_eager" if eager else m]
                    v["differ"] += int(base is not None and out != base)
                    v["tokens"] += st.new_tokens
                    v["verified"] += st.new_tokens - 1  # the prefill's token is no verify step
                    v["steps"] += st.verify_steps
                    v["seconds"] += st.seconds
                    v["turns"] += 1
                    if base is not None:
                        v["tokens_b"] += st.new_tokens
                        v["seconds_b"] += st.seconds
                messages.append({"role": "assistant", "content": tok.decode(answer, skip_special_tokens=True)})
                turns_done += 1
        if agg["baseline"]["tokens"] == 0:  # the evaluation time budget ran out before this set
            continue
        results[name] = {"turns": turns_done}
        for m, v in agg.items():
            if not v["turns"]:
                continue
            tps = v["tokens"] / max(v["seconds"], 1e-9)
            results[name][m] = {"tau": v["verified"] / max(v["steps"], 1) if m.startswith(("chain", "tree")) else None,
                                "tokens_per_s": tps, "tokens": v["tokens"], "turns": v["turns"],
                                "tokens_per_s_baseline_turns": v["tokens_b"] / max(v["seconds_b"], 1e-9),
                                "outputs_differing_from_hf_greedy": v["differ"]}
        base_tps = results[name]["baseline"]["tokens_per_s"]
        plain_tps = results[name]["plain"]["tokens_per_s"]
        for m, r in results[name].items():
            if isinstance(r, dict):
                # over HF generate (the goal's baseline), on the turns both ran
                r["speedup"] = r["tokens_per_s_baseline_turns"] / base_tps
                r["speedup_vs_plain_static"] = r["tokens_per_s"] / plain_tps  # same machinery, no drafter
        on_set(results)
        log(f"{name}: {turns_done} turns; " + ", ".join(
            f"{m} {r['tokens_per_s']:.0f} tok/s tau {r['tau'] or 1:.2f} x{r['speedup']:.2f}"
            for m, r in results[name].items() if isinstance(r, dict)))
    return results


def _profile(hf, chain, ids, path: Path) -> None:
    """cProfile of one HF generate and one chain generation of the same turn (where the time goes)."""
    import cProfile
    import io
    import pstats

    text = io.StringIO()
    for name, fn in (("hf_generate", hf), ("chain_static", chain)):
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        fn(ids)
        prof.disable()
        text.write(f"=== {name}: {time.perf_counter() - t:.3f}s wall\n")
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(35)
    path.write_text(text.getvalue())
    log(f"profile written: {path}")


def _shard(text: str) -> tuple[int, int]:
    k, _, n = text.partition("/")
    if not (k.isdigit() and n.isdigit() and 0 <= int(k) < int(n)):
        raise argparse.ArgumentTypeError(f"--shard wants K/N with 0 <= K < N, got {text!r}")
    return int(k), int(n)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--eval-dir", required=True)
    ap.add_argument("--out", required=True, help="JSON written here (the drafter export goes next to it)")
    ap.add_argument("--work", default="/tmp/quality", help="keeps the drafter between --phase train and eval")
    ap.add_argument("--phase", choices=("all", "distill", "train", "eval"), default="all",
                    help="distill: answers only (kept under --work; a later train phase with "
                    "--distill-seconds 0 --synthetic-prompts 0 reuses them and trains for its whole call)")
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds this process may run (all phases)")
    ap.add_argument("--device", default="cuda", help="cpu only for a smoke test of this script")
    ap.add_argument("--num-prompts", type=int, default=4000)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--gen-batch", type=int, default=256)
    ap.add_argument("--distill-seconds", type=float, default=240)
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--draft-vocab", type=int, default=16384)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--row-tokens", type=int, default=2048, help="sdpa: attention rows of whole samples")
    ap.add_argument("--samples-per-prompt", type=int, default=1, help="1 greedy answer + N-1 sampled ones")
    ap.add_argument("--sample-temperature", type=float, default=0.7)
    ap.add_argument("--synthetic-prompts", type=int, default=0, help="Magpie-style prompts the target writes")
    ap.add_argument("--synthetic-seconds", type=float, default=60)
    ap.add_argument("--shard", type=_shard, default=(0, 1), metavar="K/N",
                    help="distill: answer prompts K, K+N, ... (one process per GPU; seeds differ per shard)")
    ap.add_argument("--feature-memory", type=float, default=0.7,
                    help="share of free device memory the captured training features may take")
    ap.add_argument("--val-samples", type=int, default=256, help="conversations held out of training")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--lr", type=float, default=1e-3, help="1e-3 beat 5e-4 (held-out tau 2.70 vs 2.30, 67K convs)")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--ttt-steps", type=int, default=_TRAIN_DEFAULTS.ttt_steps)
    ap.add_argument("--loss-decay", type=float, default=_TRAIN_DEFAULTS.loss_decay, help="default: the product's")
    ap.add_argument("--grad-clip", type=float, default=_TRAIN_DEFAULTS.grad_clip, help="default: the product's")
    ap.add_argument("--weight-decay", type=float, default=_TRAIN_DEFAULTS.weight_decay, help="default: the product's")
    ap.add_argument("--min-lr-ratio", type=float, default=0.05, help="cosine floor as a share of --lr")
    ap.add_argument("--attention", choices=("auto", "sdpa", "varlen", "flex"), default="auto",
                    help="the TTT attention (train.attention); auto: varlen on CUDA, as the training loop")
    ap.add_argument("--train-seconds", type=float, default=240)
    ap.add_argument("--chain-k", type=int, default=3)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--total-tokens", type=int, default=48)
    ap.add_argument("--per-set", type=int, default=10)
    ap.add_argument("--max-turns", type=int, default=2)
    ap.add_argument("--eval-new-tokens", type=int, default=192)
    ap.add_argument("--baseline-turns", type=int, default=1 << 30,
                    help="per set, HF generate (the speedup's baseline) runs on the first N turns only")
    ap.add_argument("--mt-share", type=float, default=0.4, help="share of --eval-seconds for MT-bench")
    ap.add_argument("--eval-seconds", type=float, default=300)
    ap.add_argument("--eager-turns", type=int, default=2, help="turns also decoded without the StaticTarget")
    ap.add_argument("--no-graphs", action="store_true", help="StaticTarget without CUDA graphs")
    ap.add_argument("--profile", action="store_true", help="cProfile one HF generate and one chain turn")
    ap.add_argument("--static-generate", choices=("auto", "on", "off"), default="auto",
                    help="self-distil through StaticBatchGenerator (auto: on CUDA)")
    ap.add_argument("--sdpa-backends", default=None,
                    help="comma list of torch sdpa backends to allow (flash,efficient,math,cudnn); default: torch's")
    a = ap.parse_args(argv)
    if a.sdpa_backends:
        allowed = set(a.sdpa_backends.split(","))
        for name in ("flash", "efficient", "math", "cudnn"):
            getattr(torch.backends.cuda, f"enable_{'mem_efficient' if name == 'efficient' else name}_sdp")(name in allowed)

    from eagle3_ray.config import TargetConfig
    from eagle3_ray.engines.hf import HFEngine

    t0 = time.perf_counter()
    left = lambda: a.deadline - (time.perf_counter() - t0)  # noqa: E731
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    cfg = TargetConfig(model=a.gguf, device=a.device, dtype="bfloat16" if a.device == "cuda" else "float32",
                       cache_dir=str(work / "cache"))
    engine = HFEngine(cfg, batch_tokens=65536)
    tok, model, device = engine.tokenizer, engine.target.model, engine.target.device
    if a.static_generate != "auto":
        engine.static_generate = a.static_generate == "on"
    log(f"target loaded ({time.perf_counter() - t0:.0f}s), aux layers {engine.info.aux_layers}")
    summary = {
        "device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu",
        "target": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized, bf16)",
        "phase": a.phase, "args": vars(a), "command": " ".join([sys.executable, *sys.argv]),
    }
    out = Path(a.out)

    def write(**kw) -> None:
        summary.update(kw, seconds=time.perf_counter() - t0)
        out.write_text(json.dumps(summary, indent=2))

    if a.phase == "distill":
        a.distill_seconds = min(a.distill_seconds, left() - 10)
        convs = distill(engine, tok, Path(a.prompts), work, a)
        write(train_prompts=len(convs))
        return 0
    if a.phase in ("all", "train"):
        drafter = train_phase(engine, a, work, out.parent, left, write)
    else:
        drafter = _load_checkpoint(work / "ckpt")
    if a.phase == "train":
        return 0
    drafter = drafter.to(device=device, dtype=torch.bfloat16)
    drafter.bind_embedding(model.get_input_embeddings())
    a.eval_seconds = min(a.eval_seconds, left() - 20)
    sets = eval_sets(Path(a.eval_dir), a.per_set)

    def on_set(results):
        def overall(mode, key):
            vals = [(r[mode][key], r[mode]["tokens"]) for r in results.values() if r[mode][key] is not None]
            return sum(v * w for v, w in vals) / max(sum(w for _, w in vals), 1)

        mt = results.get("mt_bench", {})
        write(eval=results, tau_chain=overall("chain", "tau"), tau_tree=overall("tree", "tau"),
              tau_chain_mtbench=mt.get("chain", {}).get("tau"), tau_tree_mtbench=mt.get("tree", {}).get("tau"),
              speedup_chain_mtbench=mt.get("chain", {}).get("speedup"),
              speedup_tree_mtbench=mt.get("tree", {}).get("speedup"),
              speedup_chain=overall("chain", "speedup"), speedup_tree=overall("tree", "speedup"),
              speedup_chain_vs_plain_static=overall("chain", "speedup_vs_plain_static"),
              speedup_tree_vs_plain_static=overall("tree", "speedup_vs_plain_static"),
              speedup_plain_static=overall("plain", "speedup"))

    evaluate(model, tok, drafter, sets, a, on_set)
    log(json.dumps({k: v for k, v in summary.items() if k.startswith(("tau", "speedup"))}))
    return 0


def train_phase(engine, a, work: Path, out_dir: Path, left, write):
    """Distil, capture, train within the deadline; keep the checkpoint under work/ and an export in out_dir."""
    from eagle3_ray.drafter.export import export_drafter, save_drafter_weights

    tok, device = engine.tokenizer, engine.target.device
    a.distill_seconds = min(a.distill_seconds, left() - 120)
    convs = distill(engine, tok, Path(a.prompts), work, a)
    records = featurize(engine, tok, convs, a)
    a.train_seconds = min(a.train_seconds, left() - 25)
    drafter, hist, info = train(engine, records, a, device)
    del records
    save_drafter_weights(drafter, work / "ckpt")
    export_drafter(work / "ckpt", out_dir / "drafter_smollm2", engine="sglang")
    write(train_prompts=len(convs), train=info, history=hist)
    log(f"drafter saved: {work / 'ckpt'}, export {out_dir / 'drafter_smollm2'}")
    return drafter


def _load_checkpoint(path: Path):
    from eagle3_ray.drafter.export import load_drafter_weights
    from eagle3_ray.drafter.model import Eagle3Drafter

    cfg, state = load_drafter_weights(path)
    drafter = Eagle3Drafter(cfg)
    drafter.load_state_dict(state, strict=False)  # embed_tokens is the target's, bound later
    return drafter.eval()


if __name__ == "__main__":
    sys.exit(main())
