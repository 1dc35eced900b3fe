"""Real vs simulated acceptance of one drafter on the same held-out text (fp32, CPU, batch 1).

    python benchmarks/tau_consistency.py --drafter /tmp/demo1/drafter --num-prompts 16 --max-new-tokens 64
    python benchmarks/tau_consistency.py --drafter <drafter> --prompts mt_bench.jsonl --as-bench --num-prompts 24 \
        --max-new-tokens 256

For each held-out prompt (first turn of eagle3_ray/resources/demo_eval.jsonl, chat template):

1. real: ``spec.generate(mode="chain", num_steps=K)``; tau = (new tokens - 1) / verify steps, and
   the output must equal ``spec.target_generate`` (fp32 greedy: token for token). The proposer is
   wrapped only to record, per verify cycle, the drafter position it drafted from and its drafts.
2. simulated: the prompt + the target's greedy answer (K tokens longer than the real run, so that
   every draft near the end has a reference) is captured with ``HFEngine.capture``, and
   ``ttt_forward(ttt_steps=K)`` runs on it with loss_mask = 1 on the M answer tokens: acc_i and
   its tau = 1 + sum_k prod_{j<=k} acc_j.
3. teacher-forced chain: the TTT unroll of ``ttt_forward`` (same mask, positions, shifts) run here
   to get, per position t, the K draft tokens; step i at t predicts x[t+2+i]. ``L(t)`` = number of
   leading steps that equal the greedy text. Real chain decoding that starts a cycle with x[n] as
   the last committed token drafts exactly the unroll at t = n - 1 (its cache holds step-0 keys of
   the committed pairs; draft step i sits at position n - 1 + i and sees that prefix plus its own
   earlier draft keys: the TTT diagonal). So:
   - ``tf_all`` = 1 + mean L(t) over every cycle start the answer allows (all t);
   - ``tf_walk`` = the chain walked over L: start after the prefill token, append min(L + 1, left)
     tokens per cycle. Equal to the real tau when training and decoding compute the same function;
   - per cycle, the real drafts are compared with the unroll's tokens at the same t (up to the
     first rejected draft, after which real decoding feeds its own wrong token).
4. the product's walk: ``ttt_forward(walk_steps=K).walk`` (``drafter.ttt.chain_walk``, the trainer's
   held-out ``val_tau_walk3``) on the same batch: it should give the real run's cycles and tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROMPTS = ROOT / "eagle3_ray" / "resources" / "demo_eval.jsonl"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "tau_consistency_cpu.json"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class RecordingProposer:
    """An ``Eagle3Proposer`` that records (committed drafter positions, draft ids) per verify cycle."""

    def __init__(self, inner):
        self.inner = inner
        self.aux_layers = inner.aux_layers
        self.cycles: list[tuple[int, list[int]]] = []

    def begin(self, prompt):
        self.cycles = []
        self.inner.begin(prompt)

    def extend(self, next_ids, aux):
        self.inner.extend(next_ids, aux)

    def draft_chain(self, k, s):
        draft = self.inner.draft_chain(k, s)
        self.cycles.append((self.inner.committed, list(draft.ids)))
        return draft

    def draft_tree(self, topk, depth, total_tokens):
        return self.inner.draft_tree(topk, depth, total_tokens)


def first_turns(path: Path, n: int, as_bench: bool = False) -> list[str]:
    """First turns of the first ``n`` records, or (``as_bench``) of the ``n`` prompts the bench takes
    from the file (``bench.max_prompts``: round-robin over its categories), category by category."""
    if as_bench:
        from eagle3_ray.bench.prompts import load_prompt_sets

        return [p.turns[0] for prompts in load_prompt_sets(str(path), n).values() for p in prompts]
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r["turns"][0] for r in rows[:n]]


@torch.no_grad()
def unroll(drafter, seq: torch.Tensor, aux: torch.Tensor, k: int) -> torch.Tensor:
    """[K, T] target-vocab draft tokens of the TTT unroll (``ttt_forward``'s loop, one sample):
    row i, column t = the drafter's argmax at step i from position t, a guess of seq[t + 2 + i]."""
    from eagle3_ray.drafter.model import DrafterKVCache
    from eagle3_ray.drafter.ttt import _shift, ttt_attention_mask

    ids = seq[None]  # [1, T]
    pos = torch.arange(seq.shape[0])[None]  # [1, T]
    seq_ids = torch.zeros_like(ids)
    hidden = drafter.fuse(aux[None])  # [1, T, H]
    cache = DrafterKVCache()
    rows = []
    for i in range(k):
        mask = ttt_attention_mask(seq_ids, i)
        hidden = drafter(_shift(ids, i + 1), hidden, pos + i, attention_mask=mask, cache=cache)
        rows.append(drafter.draft_to_target(drafter.logits(hidden).argmax(dim=-1))[0])
    return torch.stack(rows)  # [K, T]


def leading_correct(preds: torch.Tensor, seq: torch.Tensor) -> list[int]:
    """Per t: how many of steps 0..K-1 equal seq[t + 2 + i], counting from step 0 (stops at the
    first miss or at the end of seq). Columns t = 0..T-2."""
    k, t_len = preds.shape
    out = []
    for t in range(t_len - 1):
        n = 0
        for i in range(k):
            j = t + 2 + i
            if j >= t_len or int(preds[i, t]) != int(seq[j]):
                break
            n += 1
        out.append(n)
    return out


def walk(lead: list[int], a: int, total: int, k: int) -> tuple[float | None, list[int], list[int]]:
    """Chain decoding replayed on L: (tau, per-cycle start t, accept histogram [K+1]).

    The prefill gives seq[a]; a cycle whose last committed token is seq[a + produced - 1] drafts
    from t = a + produced - 2 and appends min(L + 1, total - produced) tokens (the length cut)."""
    produced, appended, starts, hist = 1, [], [], [0] * (k + 1)
    while produced < total:
        t = a + produced - 2
        n = min(lead[t], k)
        hist[n] += 1
        starts.append(t)
        add = min(n + 1, total - produced)
        appended.append(add)
        produced += add
    return (sum(appended) / len(appended) if appended else None), starts, hist


def sim_tau(accs: list[float]) -> float:
    tau, chain = 1.0, 1.0
    for acc in accs:
        chain *= acc
        tau += chain
    return tau


def measure(engine, drafter, proposer, prompt: list[int], a_args) -> dict:
    import eagle3_ray.decode as spec
    from eagle3_ray.drafter.ttt import target_distribution, ttt_forward

    model, k, m = engine.target.model, a_args.num_steps, a_args.max_new_tokens
    ids = torch.tensor(prompt)
    a = ids.shape[0]

    t0 = time.perf_counter()
    ref, ref_stats = spec.target_generate(model, ids, m + k)  # K extra tokens: references for late drafts
    base = ref[:m]
    t_base = time.perf_counter() - t0
    t0 = time.perf_counter()
    out, st = spec.generate(model, proposer, ids, m, mode="chain", num_steps=k)
    t_chain = time.perf_counter() - t0
    real_tau = (st.new_tokens - 1) / st.verify_steps if st.verify_steps else None

    seq = torch.cat([ids, torch.tensor(ref)])  # [T] prompt + greedy answer (+ K)
    cap = engine.capture([seq.tolist()])[0]
    aux, last = cap.aux_hidden, cap.last_hidden  # [T, 3H], [T, H] in the target dtype, as training reads them
    lm_head = model.get_output_embeddings().weight.detach()
    total = len(base)  # tokens the real run produced (EOS or the length limit)
    loss_mask = torch.zeros(seq.shape[0], dtype=torch.long)
    loss_mask[a : a + total] = 1
    batch = {
        "input_ids": seq[None], "aux_hidden": aux[None], "last_hidden": last[None], "loss_mask": loss_mask[None],
        "position_ids": torch.arange(seq.shape[0])[None], "seq_ids": torch.zeros(1, seq.shape[0], dtype=torch.long),
    }
    with torch.no_grad():
        out_ttt = ttt_forward(drafter, batch, lm_head, ttt_steps=k, walk_steps=k)
    ttt = out_ttt.metrics
    walk_tokens, walk_cycles = (int(x) for x in out_ttt.walk.tolist())  # the product's walk (val_tau_walk3)

    preds = unroll(drafter, seq, aux, k)  # [K, T]
    # Same positions/denominators as ttt_forward, to show the unroll here is its loop.
    target_p, in_draft = target_distribution(last[None], lm_head, drafter.d2t, drafter.t2d)
    target_tok = drafter.draft_to_target(target_p.argmax(-1))[0]  # [T] restricted argmax, target ids
    full_argmax = (last.float() @ lm_head.float().T).argmax(-1)  # [T]
    # greedy text vs the capture's argmax (fp32 batch forward vs the incremental decode)
    argmax_agree = float((full_argmax[a - 1 : -1] == seq[a:]).float().mean())
    repl_acc, oov_as_miss_acc = [], []
    for i in range(k):
        ahead = i + 1
        lm = torch.zeros(seq.shape[0], dtype=torch.bool)
        lm[: seq.shape[0] - i] = loss_mask[i:].bool()  # _shift(loss_mask, i)
        ind = torch.zeros(seq.shape[0], dtype=torch.bool)
        ind[: seq.shape[0] - ahead] = in_draft[0, ahead:]
        valid = lm & ind
        ref_tok = torch.zeros_like(seq)
        ref_tok[: seq.shape[0] - ahead] = target_tok[ahead:]
        hits = ((preds[i] == ref_tok) & valid).sum()
        repl_acc.append(float(hits) / max(int(valid.sum()), 1))
        # The same positions with out-of-draft-vocab targets kept in the denominator (as misses).
        inside = torch.zeros(seq.shape[0], dtype=torch.bool)
        inside[: seq.shape[0] - ahead] = True
        kept = lm & inside
        oov_as_miss_acc.append(float(((preds[i] == ref_tok) & kept & ind).sum()) / max(int(kept.sum()), 1))

    lead = leading_correct(preds, seq)  # index t
    starts_all = list(range(a - 1, a + total - 1))  # every t a cycle could start from
    tf_all = 1 + sum(min(lead[t], k) for t in starts_all) / len(starts_all) if total > 1 else None
    tf_walk, walk_starts, walk_hist = walk(lead, a, total, k)

    # Marginal acc_i with the real-decoding rule (vs the greedy token, out-of-draft-vocab = miss)
    # over the cycle starts t in [a-1, a+total-2], and the share of answer tokens outside the vocab.
    acc_real_rule = []
    for i in range(k):
        cols = [t for t in starts_all if t + 2 + i < seq.shape[0]]
        acc_real_rule.append(sum(int(preds[i, t]) == int(seq[t + 2 + i]) for t in cols) / max(len(cols), 1))
    answer = seq[a : a + total]
    oov = float((~drafter.t2d[answer]).float().mean())

    # Real cycles vs the unroll at the same t: drafts up to and including the first rejected one.
    real_starts = [c - 1 for c, _ in proposer.cycles]
    mismatched = 0
    real_hist = list(st.accept_hist)
    for (committed, drafts) in proposer.cycles:
        t = committed - 1
        n = min(lead[t], k)
        upto = min(n + 1, k)
        if [int(preds[i, t]) for i in range(upto)] != drafts[:upto]:
            mismatched += 1

    return {
        "prompt_tokens": a,
        "new_tokens": st.new_tokens,
        "equal_to_greedy": out == base,
        "real": {"tau": real_tau, "verify_steps": st.verify_steps, "accept_hist": real_hist,
                 "accept_by_position": st.accept_by_position},
        "ttt_forward": {"tau": ttt["tau"], **{f"acc_{i}": ttt[f"acc_{i}"] for i in range(k)},
                        **{f"tokens_{i}": ttt[f"tokens_{i}"] for i in range(k)}},
        "ttt_loop_replicated_acc": repl_acc,
        "ttt_positions_oov_as_miss_acc": oov_as_miss_acc,
        "ttt_positions_oov_as_miss_tokens": [int(loss_mask[i:].sum()) for i in range(k)],
        "teacher_forced": {"tau_all_positions": tf_all, "positions": len(starts_all),
                           "tau_walk": tf_walk, "walk_hist": walk_hist, "walk_cycles": len(walk_starts),
                           "walk_cycles_same_as_real": walk_starts == real_starts,
                           "real_cycles_with_other_drafts": mismatched,
                           "acc_real_rule": acc_real_rule, "sim_tau_real_rule": sim_tau(acc_real_rule)},
        "product_walk": {"tokens": walk_tokens, "cycles": walk_cycles,
                         "tau": walk_tokens / walk_cycles if walk_cycles else None},
        "answer_tokens_outside_draft_vocab": oov,
        "capture_argmax_agrees_with_greedy": argmax_agree,
        "seconds": {"target_generate": t_base, "chain": t_chain},
        "_lead": lead, "_a": a, "_total": total,
    }


def aggregate(rows: list[dict], k: int) -> dict:
    def wmean(get, weight):
        pairs = [(get(r), weight(r)) for r in rows if get(r) is not None]
        return sum(v * w for v, w in pairs) / max(sum(w for _, w in pairs), 1e-9)

    steps = sum(r["real"]["verify_steps"] for r in rows)
    real_tau = sum(r["new_tokens"] - 1 for r in rows) / max(steps, 1)
    walk_cycles = sum(r["teacher_forced"]["walk_cycles"] for r in rows)
    walk_tau = sum(r["teacher_forced"]["tau_walk"] * r["teacher_forced"]["walk_cycles"] for r in rows
                   if r["teacher_forced"]["tau_walk"] is not None) / max(walk_cycles, 1)
    tf_all = wmean(lambda r: r["teacher_forced"]["tau_all_positions"], lambda r: r["teacher_forced"]["positions"])
    ttt_acc = [wmean(lambda r, i=i: r["ttt_forward"][f"acc_{i}"], lambda r, i=i: r["ttt_forward"][f"tokens_{i}"])
               for i in range(k)]
    oov_miss_acc = [wmean(lambda r, i=i: r["ttt_positions_oov_as_miss_acc"][i],
                          lambda r, i=i: r["ttt_positions_oov_as_miss_tokens"][i]) for i in range(k)]
    rule_acc = [wmean(lambda r, i=i: r["teacher_forced"]["acc_real_rule"][i],
                      lambda r: r["teacher_forced"]["positions"])
                for i in range(k)]
    real_hist = [sum(r["real"]["accept_hist"][i] for r in rows) for i in range(k + 1)]
    walk_hist = [sum(r["teacher_forced"]["walk_hist"][i] for r in rows) for i in range(k + 1)]
    return {
        "prompts": len(rows),
        "new_tokens": sum(r["new_tokens"] for r in rows),
        "all_equal_to_greedy": all(r["equal_to_greedy"] for r in rows),
        "real_tau": real_tau,
        "real_verify_steps": steps,
        "real_accept_hist": real_hist,
        "teacher_forced_walk_tau": walk_tau,
        "teacher_forced_walk_hist": walk_hist,
        "product_walk_tau": sum(r["product_walk"]["tokens"] for r in rows)
        / max(sum(r["product_walk"]["cycles"] for r in rows), 1),
        "product_walk_same_as_real_prompts": sum(
            r["product_walk"]["cycles"] == r["real"]["verify_steps"]
            and r["product_walk"]["tokens"] == r["new_tokens"] - 1 for r in rows),
        "walk_cycles_same_as_real_prompts": sum(r["teacher_forced"]["walk_cycles_same_as_real"] for r in rows),
        "real_cycles_with_other_drafts": sum(r["teacher_forced"]["real_cycles_with_other_drafts"] for r in rows),
        "teacher_forced_all_positions_tau": tf_all,
        "ttt_forward_acc": ttt_acc,
        "ttt_forward_sim_tau": sim_tau(ttt_acc),
        "ttt_forward_sim_tau_mean_of_prompts": sum(r["ttt_forward"]["tau"] for r in rows) / len(rows),
        "ttt_loop_replicated_matches": max(abs(r["ttt_loop_replicated_acc"][i] - r["ttt_forward"][f"acc_{i}"])
                                           for r in rows for i in range(k)) < 1e-5,
        "ttt_positions_oov_as_miss_acc": oov_miss_acc,
        "ttt_positions_oov_as_miss_sim_tau": sim_tau(oov_miss_acc),
        "real_rule_acc": rule_acc,
        "real_rule_sim_tau": sim_tau(rule_acc),
        "answer_tokens_outside_draft_vocab": wmean(lambda r: r["answer_tokens_outside_draft_vocab"],
                                                   lambda r: r["new_tokens"]),
        "capture_argmax_agrees_with_greedy": min(r["capture_argmax_agrees_with_greedy"] for r in rows),
    }


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return (f"{model}, {os.cpu_count()} cores, {platform.system()}, CPU only, {torch.get_num_threads()} torch "
            f"threads; torch {torch.__version__}")


def write_markdown(path: Path, res: dict) -> None:
    o, k = res["overall"], res["args"]["num_steps"]
    acc = lambda xs: ", ".join(f"{x:.3f}" for x in xs)  # noqa: E731
    lines = [
        f"# Real vs simulated acceptance on the same held-out text ({res['args']['dtype']}, CPU)",
        "",
        f"Command: `{res['command']}`",
        f"Machine: {res['machine']}. Wall time {res['seconds']:.0f}s; 1-min load average {res['load_start']:.1f} "
        f"at start, {res['load_end']:.1f} at the end.",
        "",
        f"Target SmolLM2-135M-Instruct {res['args']['dtype']}; drafter `{res['args']['drafter']}`; "
        f"{o['prompts']} prompts (first turn "
        f"of `{Path(res['args']['prompts']).name}`), chain({k}), {res['args']['max_new_tokens']} new tokens max, "
        f"{o['new_tokens']} tokens in all. Outputs equal to target greedy: **{o['all_equal_to_greedy']}**.",
        "",
        "| measure | tau | acc_0..acc_{K-1} |".replace("{K-1}", str(k - 1)),
        "|---|---|---|",
        f"| 1. `ttt_forward(ttt_steps={k})` simulated tau (its acc_i, token-weighted) | {o['ttt_forward_sim_tau']:.3f} "
        f"| {acc(o['ttt_forward_acc'])} |",
        f"| 2. as 1, out-of-draft-vocab targets kept as misses | {o['ttt_positions_oov_as_miss_sim_tau']:.3f} "
        f"| {acc(o['ttt_positions_oov_as_miss_acc'])} |",
        f"| 3. as 2, on the positions a cycle can start from (t = a-1..a+M-2; a = prompt length) "
        f"| {o['real_rule_sim_tau']:.3f} "
        f"| {acc(o['real_rule_acc'])} |",
        f"| 4. teacher-forced chain (leading correct drafts + 1), every position | "
        f"{o['teacher_forced_all_positions_tau']:.3f} | |",
        f"| 5. teacher-forced chain walked from the prefill token (the real cycle starts) | "
        f"**{o['teacher_forced_walk_tau']:.3f}** | |",
        f"| 6. real chain({k}) decoding: (new - 1) / verify steps | **{o['real_tau']:.3f}** | |",
        f"| 7. the product's walk: `ttt_forward(walk_steps={k})` (the trainer's `val_tau_walk3`) | "
        f"**{o['product_walk_tau']:.3f}** | |",
        "",
        f"Prompts whose product walk has the real run's verify cycles and tokens: "
        f"{o['product_walk_same_as_real_prompts']}/{o['prompts']}.",
        f"Accept histogram (0..{k} drafts accepted per verify): real {o['real_accept_hist']}, "
        f"walk {o['teacher_forced_walk_hist']}. Prompts whose walk visits exactly the real cycle starts: "
        f"{o['walk_cycles_same_as_real_prompts']}/{o['prompts']}; real cycles whose drafts differ from the TTT "
        f"unroll at the same position: {o['real_cycles_with_other_drafts']}/{o['real_verify_steps']}.",
        f"Answer tokens outside the {res['draft_vocab_size']}-token draft vocab: "
        f"{o['answer_tokens_outside_draft_vocab']:.1%}. Capture argmax = greedy token (worst prompt): "
        f"{o['capture_argmax_agrees_with_greedy']:.1%}.",
        "",
        "## Per prompt",
        "",
        "| # | prompt tok | new | equal | real tau | walk tau | tf all | ttt_forward tau | acc (ttt_forward) | OOV |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(res["per_prompt"]):
        tf, tt = r["teacher_forced"], r["ttt_forward"]
        f = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        lines.append(
            f"| {i} | {r['prompt_tokens']} | {r['new_tokens']} | {r['equal_to_greedy']} | {f(r['real']['tau'])} | "
            f"{f(tf['tau_walk'])} | {f(tf['tau_all_positions'])} | {tt['tau']:.2f} | "
            f"{acc([tt[f'acc_{j}'] for j in range(k)])} | {r['answer_tokens_outside_draft_vocab']:.0%} |"
        )
    lines.append("")
    path.write_text("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", default="/tmp/demo1/drafter", help="exported drafter (or training checkpoint) dir")
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--as-bench", action="store_true",
                    help="take the prompts the bench takes (round-robin over categories), not the first ones")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--num-steps", type=int, default=3, help="chain K = TTT steps evaluated")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="target (and drafter) dtype; the greedy-equality check is only guaranteed in float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    t_start, load_start = time.perf_counter(), os.getloadavg()[0]

    import eagle3_ray.decode as spec
    from eagle3_ray.config import TargetConfig
    from eagle3_ray.data.chat import render_generation_prompt
    from eagle3_ray.drafter.export import load_drafter
    from eagle3_ray.engines.hf import HFEngine

    engine = HFEngine(TargetConfig(model=a.target, device="cpu", dtype=a.dtype))
    model, tok = engine.target.model, engine.tokenizer
    drafter = load_drafter(a.drafter, model.get_input_embeddings())
    if list(drafter.config.aux_layers) != list(engine.info.aux_layers):
        raise SystemExit(f"drafter aux layers {drafter.config.aux_layers} != engine's {engine.info.aux_layers}")
    spec.prepare_drafter(drafter, model)
    proposer = RecordingProposer(spec.Eagle3Proposer(drafter))
    log(f"target + drafter loaded ({time.perf_counter() - t_start:.0f}s); aux layers {engine.info.aux_layers}, "
        f"draft vocab {drafter.config.draft_vocab_size}")

    prompts = [render_generation_prompt(tok, [{"role": "user", "content": p}])
               for p in first_turns(Path(a.prompts), a.num_prompts, a.as_bench)]
    # The wrapper only records: on the first prompt the plain drafter must give the same run.
    plain_out, plain_st = spec.generate(model, drafter, torch.tensor(prompts[0]), a.max_new_tokens,
                                        mode="chain", num_steps=a.num_steps)
    rows = []
    for i, p in enumerate(prompts):
        r = measure(engine, drafter, proposer, p, a)
        rows.append(r)
        tf = r["teacher_forced"]
        log(f"prompt {i}: {r['prompt_tokens']}+{r['new_tokens']} tok, equal {r['equal_to_greedy']}, real tau "
            f"{r['real']['tau']:.3f}, walk {tf['tau_walk']:.3f}, tf-all {tf['tau_all_positions']:.3f}, ttt_forward "
            f"{r['ttt_forward']['tau']:.3f}, product walk {r['product_walk']['tau'] or 0:.3f} "
            f"(acc {[round(r['ttt_forward'][f'acc_{j}'], 3) for j in range(a.num_steps)]}),"
            f" other drafts {tf['real_cycles_with_other_drafts']}/{r['real']['verify_steps']}")
    wrapper_ok = (plain_out == spec.target_generate(model, torch.tensor(prompts[0]), a.max_new_tokens)[0]
                  and plain_st.verify_steps == rows[0]["real"]["verify_steps"])
    overall = aggregate(rows, a.num_steps)
    overall["recording_wrapper_matches_plain_drafter"] = wrapper_ok
    res = {
        "what": "real chain(K) acceptance vs ttt_forward's simulated acceptance on the same held-out text",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(),
        "args": vars(a),
        "draft_vocab_size": drafter.config.draft_vocab_size,
        "aux_layers": engine.info.aux_layers,
        "overall": overall,
        "per_prompt": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows],
        "seconds": time.perf_counter() - t_start,
        "load_start": load_start,
        "load_end": os.getloadavg()[0],
    }
    log(json.dumps(overall, indent=1))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    write_markdown(out.with_suffix(".md"), res)
    log(f"wrote {out} and {out.with_suffix('.md')} ({res['seconds']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
