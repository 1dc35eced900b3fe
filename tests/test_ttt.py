"""TTT loss: the attention mask, a loop-by-loop reference, overfitting, and packing invariance."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from eagle3_ray.drafter import DrafterConfig, Eagle3Drafter, ttt_attention_mask, ttt_forward
from eagle3_ray.drafter.ttt import split_rows

H, HT, VOCAB, DRAFT = 16, 16, 40, 24


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _drafter(seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig(
        hidden_size=H, num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=32,
        vocab_size=VOCAB, draft_vocab_size=DRAFT, target_hidden_size=HT, aux_layers=[2, 3, 4], rms_norm_eps=1e-5,
    )
    d = Eagle3Drafter(cfg)
    d.bind_embedding(torch.randn(VOCAB, H))
    # A random sorted draft vocab, so d2t/t2d are not the identity.
    target_ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:DRAFT].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[target_ids] = True
    d.set_vocab_map(target_ids - torch.arange(DRAFT), t2d)
    return d


def _lm_head(d: Eagle3Drafter, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    """Random target lm_head whose argmax mostly, not always, falls in the draft vocab."""
    w = torch.randn(VOCAB, HT, generator=torch.Generator().manual_seed(seed)) * scale
    w[~d.t2d] *= 0.5
    return w


def _sample(t: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, VOCAB, (t,), generator=g),
        "aux_hidden": torch.randn(t, 3 * HT, generator=g),
        "last_hidden": torch.randn(t, HT, generator=g),
        "loss_mask": (torch.rand(t, generator=g) > 0.2).long(),
    }


def _pack(samples: list[dict[str, torch.Tensor]], pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """One packed row (B=1), the layout the training loop feeds; -1 seq ids mark padding."""
    parts = {k: torch.cat([s[k] for s in samples]) for k in samples[0]}
    parts["position_ids"] = torch.cat([torch.arange(len(s["input_ids"])) for s in samples])
    parts["seq_ids"] = torch.cat([torch.full((len(s["input_ids"]),), i) for i, s in enumerate(samples)])
    n = len(parts["input_ids"])
    if pad_to is not None and pad_to > n:
        fill = {"seq_ids": -1}
        parts = {
            k: torch.cat([v, torch.full((pad_to - n, *v.shape[1:]), fill.get(k, 0), dtype=v.dtype)])
            for k, v in parts.items()
        }
    return {k: v[None] for k, v in parts.items()}


def test_mask_pattern_single_sample():
    expected = torch.tensor(
        [
            # step-0 keys  step-1 keys  step-2 keys
            [1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0],
            [1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0],
            [1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0],
            [1, 1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    seq = torch.zeros(1, 4, dtype=torch.long)
    for step in range(3):
        mask = ttt_attention_mask(seq, step)
        assert mask.shape == (1, 1, 4, 4 * (step + 1))
        assert torch.equal(mask[0, 0], expected[:, : 4 * (step + 1)])


def test_mask_pattern_two_packed_samples_and_padding():
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0],
            [1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0],
            [0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0],  # sample 1 starts: sees nothing of sample 0
            [0, 0, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(ttt_attention_mask(torch.tensor([[0, 0, 1, 1]]), 2)[0, 0], expected)
    padded = ttt_attention_mask(torch.tensor([[0, 0, 1, -1]]), 2)[0, 0]
    assert padded[3].tolist() == [0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1]  # padding sees only itself


def _reference_ttt(d: Eagle3Drafter, batch, w, steps: int, decay: float) -> tuple[float, list[float], list[float]]:
    """TTT written as explicit loops over steps, rows and positions, attention recomputed per query."""
    cfg = d.config
    ids, seq, pos, lm = batch["input_ids"], batch["seq_ids"], batch["position_ids"], batch["loss_mask"]
    b_n, t_n = ids.shape
    full = batch["last_hidden"] @ w.T  # [B, T, V]
    p = full[..., torch.arange(DRAFT) + d.d2t].softmax(-1)
    in_draft = d.t2d[full.argmax(-1)]
    a, m = d.midlayer.self_attn, d.midlayer
    rope = LlamaRotaryEmbedding(LlamaConfig(hidden_size=H, num_attention_heads=2, head_dim=8))

    def rms(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    h = batch["aux_hidden"] @ d.fc.weight.T
    keys: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    total, losses, accs = 0.0, [], []
    for i in range(steps):
        queries = {}
        for b in range(b_n):
            for t in range(t_n):
                tok = ids[b, t + 1 + i] if t + 1 + i < t_n else 0
                x = torch.cat([rms(d.embed_tokens.weight[tok], m.input_layernorm.weight), rms(h[b, t], m.hidden_norm.weight)])
                q = (a.q_proj.weight @ x).view(1, 2, 1, 8)
                k = (a.k_proj.weight @ x).view(1, 1, 1, 8)
                cos, sin = rope(x, pos[b, t].view(1, 1) + i)
                q, k = apply_rotary_pos_emb(q, k, cos, sin)
                keys[(i, b, t)] = (k.flatten(), a.v_proj.weight @ x)
                queries[(b, t)] = q.view(2, 8)
        new_h = torch.zeros_like(h)
        for b in range(b_n):
            for t in range(t_n):
                kv = [keys[(0, b, s)] for s in range(t + 1) if seq[b, s] == seq[b, t]]
                kv += [keys[(j, b, t)] for j in range(1, i + 1)]
                ks, vs = torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])  # [S, 8]
                heads = [torch.softmax(ks @ queries[(b, t)][hd] / math.sqrt(8), 0) @ vs for hd in range(2)]
                hh = h[b, t] + a.o_proj.weight @ torch.cat(heads)
                z = rms(hh, m.post_attention_layernorm.weight)
                new_h[b, t] = hh + m.mlp.down_proj.weight @ (F.silu(m.mlp.gate_proj.weight @ z) * (m.mlp.up_proj.weight @ z))
        h = new_h
        ce_sum, hits, n = 0.0, 0, 0
        for b in range(b_n):
            for t in range(t_n):
                u = t + 1 + i
                if u >= t_n or seq[b, t] < 0 or seq[b, u] != seq[b, t] or not lm[b, t + i] or not in_draft[b, u]:
                    continue
                logp = (rms(h[b, t], d.norm.weight) @ d.lm_head.weight.T).log_softmax(-1)
                ce_sum += float(-(p[b, u] * logp).sum())
                hits += int(logp.argmax() == p[b, u].argmax())
                n += 1
        losses.append(ce_sum / max(n, 1))
        accs.append(hits / max(n, 1))
        total += decay**i * losses[-1]
    return total, losses, accs


def test_loss_and_accuracy_equal_loop_reference():
    d = _drafter()
    w = _lm_head(d)
    batch = _pack([_sample(5, 1), _sample(4, 2)], pad_to=11)
    batch = {k: torch.cat([v, _pack([_sample(11, 3)])[k]]) for k, v in batch.items()}  # B=2
    with torch.no_grad():
        out = ttt_forward(d, batch, w, ttt_steps=3, loss_decay=0.8)
        ref_total, ref_losses, ref_accs = _reference_ttt(d, batch, w, steps=3, decay=0.8)
    assert out.loss.item() == pytest.approx(ref_total, rel=1e-5)
    for i in range(3):
        assert out.metrics[f"loss_{i}"] == pytest.approx(ref_losses[i], rel=1e-5)
        assert out.metrics[f"acc_{i}"] == pytest.approx(ref_accs[i])
    assert out.metrics["loss"] == pytest.approx(ref_total, rel=1e-5)
    accs = [out.metrics[f"acc_{i}"] for i in range(3)]
    tau = 1 + accs[0] + accs[0] * accs[1] + accs[0] * accs[1] * accs[2]
    assert out.metrics["tau"] == pytest.approx(tau)
    assert out.metrics["tokens"] == out.metrics["tokens_0"] > out.metrics["tokens_2"] > 0


def test_gradients_reach_the_drafter_only():
    d = _drafter()
    w = _lm_head(d).requires_grad_(True)
    batch = _pack([_sample(8, 4)])
    batch["aux_hidden"].requires_grad_(True)
    ttt_forward(d, batch, w, ttt_steps=2).loss.backward()
    assert w.grad is None and batch["aux_hidden"].grad is not None
    assert d.embed_tokens.weight.grad is None
    assert all(p.grad is not None for n, p in d.named_parameters() if not n.startswith("embed_tokens"))


def test_packing_and_padding_invariance():
    d = _drafter()
    w = _lm_head(d)
    a, b = _sample(7, 5), _sample(5, 6)
    with torch.no_grad():
        alone = [ttt_forward(d, _pack([s]), w, ttt_steps=3).metrics for s in (a, b)]
        packed = ttt_forward(d, _pack([a, b], pad_to=15), w, ttt_steps=3).metrics
    total = 0.0
    for i in range(3):
        na, nb = alone[0][f"tokens_{i}"], alone[1][f"tokens_{i}"]
        assert packed[f"tokens_{i}"] == na + nb
        combined = (na * alone[0][f"loss_{i}"] + nb * alone[1][f"loss_{i}"]) / (na + nb)
        assert packed[f"loss_{i}"] == pytest.approx(combined, rel=1e-5)
        hits = na * alone[0][f"acc_{i}"] + nb * alone[1][f"acc_{i}"]
        assert packed[f"acc_{i}"] == pytest.approx(hits / (na + nb))
        total += 0.8**i * combined
    assert packed["loss"] == pytest.approx(total, rel=1e-5)


def test_rows_of_whole_samples_give_the_same_loss_and_gradients():
    """split_rows (sdpa's cheaper layout of a long pack) changes the attention's cost, not its result."""
    samples = [_sample(n, 20 + n) for n in (9, 4, 7, 3, 6)]
    batch = _pack(samples, pad_to=33)
    rows = split_rows(batch, 10)
    assert rows["seq_ids"].shape == (3, 10)  # 9 | 7+3 | 6+4 (first fit, longest first)
    assert sorted(rows["seq_ids"][rows["seq_ids"] >= 0].tolist()) == sorted(batch["seq_ids"][0][:29].tolist())
    grads = []
    for row_tokens in (None, 10, 8):
        d = _drafter(seed=4)
        w = _lm_head(d, seed=4)
        out = ttt_forward(d, batch, w, ttt_steps=3, row_tokens=row_tokens)
        out.loss.backward()
        grads.append((out, [p.grad.clone() for p in d.parameters() if p.requires_grad]))
    (ref, ref_grads), *others = grads
    for out, g in others:
        assert_same_ttt(out, g, ref, ref_grads, steps=3)


def assert_same_ttt(out, grads, ref, ref_grads, steps: int) -> None:
    """Two TTT results of the same batch: loss, per-step tokens and accuracy, and every gradient agree."""
    assert out.loss.item() == pytest.approx(ref.loss.item(), rel=1e-5)
    for i in range(steps):
        assert out.metrics[f"tokens_{i}"] == ref.metrics[f"tokens_{i}"]
        assert out.metrics[f"acc_{i}"] == pytest.approx(ref.metrics[f"acc_{i}"])
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_drafter_overfits_a_tiny_batch():
    d = _drafter(seed=3)
    w = _lm_head(d, seed=3, scale=3.0)
    batch = _pack([_sample(12, 7), _sample(12, 8)])
    batch = {k: v.view(2, 12, *v.shape[2:]) for k, v in batch.items()}
    batch["position_ids"] = torch.arange(12).expand(2, 12)
    batch["seq_ids"] = torch.zeros(2, 12, dtype=torch.long)
    opt = torch.optim.Adam([p for p in d.parameters() if p.requires_grad], lr=1e-2)
    first = None
    for _ in range(100):
        out = ttt_forward(d, batch, w, ttt_steps=2)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        first = first if first is not None else out.metrics
    assert out.metrics["acc_0"] > 0.95
    assert out.metrics["loss_0"] < 0.25 * first["loss_0"]
    assert out.metrics["tau"] > first["tau"]


def test_ttt_learns_on_real_smollm2_features(smollm2):
    """Real target states: aux layers [2, L//2, L-3] and the post-norm last state of SmolLM2."""
    model, tok = smollm2
    ids = tok("The quick brown fox jumps over the lazy dog, and the dog sleeps on.", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    n_layers = model.config.num_hidden_layers
    aux_layers = [2, n_layers // 2, n_layers - 3]
    last = out.hidden_states[-1]  # [1, T, Ht], post final norm: the lm_head input
    torch.testing.assert_close(last @ model.lm_head.weight.T, out.logits, atol=1e-3, rtol=1e-3)

    cfg = DrafterConfig.from_target(model.config, 512, aux_layers, {"intermediate_size": 256})
    torch.manual_seed(0)
    d = Eagle3Drafter(cfg)
    d.bind_embedding(model.get_input_embeddings())
    # Draft vocab: every token the target predicts here (from the bf16 features), filled up to 512.
    predicted = (last.bfloat16().float() @ model.lm_head.weight.T).argmax(-1).flatten()
    fill = torch.arange(512)[~torch.isin(torch.arange(512), predicted)]
    draft_ids = torch.cat([predicted.unique(), fill])[:512].sort().values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    d.set_vocab_map(draft_ids - torch.arange(512), t2d)
    t = ids.shape[1]
    batch = {
        "input_ids": ids,
        "aux_hidden": torch.cat([out.hidden_states[k] for k in aux_layers], dim=-1).bfloat16(),
        "last_hidden": last.bfloat16(),
        "loss_mask": torch.ones(1, t, dtype=torch.long),
        "position_ids": torch.arange(t)[None],
        "seq_ids": torch.zeros(1, t, dtype=torch.long),
    }
    opt = torch.optim.Adam([p for p in d.parameters() if p.requires_grad], lr=3e-3)
    history = []
    for _ in range(20):
        res = ttt_forward(d, batch, model.lm_head.weight, ttt_steps=3)
        opt.zero_grad()
        res.loss.backward()
        opt.step()
        history.append(res.metrics)
    assert history[0]["tokens"] == t - 1  # step 0: every position but the last has a target state
    assert history[-1]["loss"] < 0.5 * history[0]["loss"]
    assert history[-1]["acc_0"] > history[0]["acc_0"]


def test_flex_attention_computes_the_same_ttt_loss():
    """The block-sparse flex path (fixed-length cache, T padded to 128) equals the dense-mask path.

    Forward only: flex_attention has no CPU backward; benchmarks/train_step.py --check compares the
    gradients of both paths on a GPU.
    """
    d = _drafter()
    w = _lm_head(d)
    batch = _pack([_sample(37, 1), _sample(50, 2), _sample(20, 3)], pad_to=120)
    with torch.no_grad():
        dense = ttt_forward(d, batch, w, ttt_steps=4, attention="sdpa")
        flex = ttt_forward(d, batch, w, ttt_steps=4, attention="flex")
        padded = ttt_forward(d, batch, w, ttt_steps=4, attention="flex", pad_to=300)  # one compiled shape
    assert flex.loss.item() == pytest.approx(dense.loss.item(), rel=1e-5)
    assert padded.loss.item() == pytest.approx(dense.loss.item(), rel=1e-5)
    for i in range(4):
        assert flex.metrics[f"tokens_{i}"] == dense.metrics[f"tokens_{i}"]
        assert flex.metrics[f"acc_{i}"] == pytest.approx(dense.metrics[f"acc_{i}"])


def test_block_mask_is_the_dense_mask_over_a_fixed_length_cache():
    from torch.nn.attention.flex_attention import create_mask

    from eagle3_ray.drafter.ttt import ttt_block_mask

    seq = torch.tensor([[0, 0, 0, 1, 1, -1]])
    steps = 3
    for step in range(steps):
        block = ttt_block_mask(seq, step, steps)
        got = create_mask(block.mask_mod, 1, 1, 6, 6 * steps, device="cpu")  # [1, 1, T, steps*T]
        dense = ttt_attention_mask(seq, step)  # [1, 1, T, (step+1)*T]
        want = torch.cat([dense, torch.zeros(1, 1, 6, 6 * (steps - 1 - step), dtype=torch.bool)], dim=-1)
        assert torch.equal(got, want), step


def test_attention_setting_resolves_per_device():
    from eagle3_ray.errors import ConfigError
    from eagle3_ray.train.step import resolve_attention

    assert resolve_attention("auto", "cpu") == "sdpa"
    assert resolve_attention("auto", "cuda") == "varlen"
    assert resolve_attention("flex", "cuda") == "flex"
    with pytest.raises(ConfigError, match="train.attention=flex needs CUDA"):
        resolve_attention("flex", "cpu")


def test_bf16_values_are_exact_in_tf32():
    """The premise of computing fp32 target logits with TF32 tensor cores from bf16 inputs:
    rounding a bf16 value to TF32 (10 explicit mantissa bits) changes nothing."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)).mul(1e3).to(torch.bfloat16).float()
    bits = x.view(torch.int32)
    tf32 = ((bits + (1 << 12)) & ~((1 << 13) - 1)).view(torch.float32)  # round to nearest at bit 13
    assert torch.equal(tf32, x)


def test_served_tau_counts_targets_outside_the_draft_vocab_as_misses():
    from eagle3_ray.drafter.ttt import _same_sample, _shift

    d = _drafter()
    w = _lm_head(d)
    batch = _pack([_sample(30, 11), _sample(25, 12)], pad_to=60)
    with torch.no_grad():
        m = ttt_forward(d, batch, w, ttt_steps=3).metrics
    served, chain = 1.0, 1.0
    for i in range(3):
        scored = (_shift(batch["loss_mask"].bool(), i, False) & _same_sample(batch["seq_ids"], i + 1)).sum().item()
        assert scored > m[f"tokens_{i}"]  # some targets fall outside the draft vocab
        chain *= m[f"acc_{i}"] * m[f"tokens_{i}"] / scored  # hits / every scored position
        served += chain
    assert m["tau_served"] == pytest.approx(served)
    assert m["tau_served"] < m["tau"]
    assert m["tau_chain3"] == m["tau_served"]  # three TTT steps: the chain(3) figure is the served one


def test_tau_chain3_is_served_tau_over_the_first_three_drafts_only():
    from eagle3_ray.drafter.ttt_metrics import step_metrics

    # (ce, acc, count, served_acc) of 5 TTT steps
    stats = [[1.0, 0.8, 100, 0.5], [1.0, 0.7, 90, 0.6], [1.0, 0.6, 80, 0.5], [1.0, 0.5, 70, 0.9], [1.0, 0.4, 60, 0.9]]
    m = step_metrics(stats, 0.8)
    assert m["tau_chain3"] == pytest.approx(1 + 0.5 + 0.5 * 0.6 + 0.5 * 0.6 * 0.5)
    assert m["tau_served"] == pytest.approx(m["tau_chain3"] + 0.15 * 0.9 + 0.15 * 0.9 * 0.9)
    assert step_metrics(stats[:2], 0.8)["tau_chain3"] == pytest.approx(1 + 0.5 + 0.3)  # fewer steps: all of them


def test_window_metrics_are_the_mean_of_each_steps_metrics():
    """The training loop keeps each step's stats on the device and reads a logging window back in one
    sync (mean_metrics); the figures are those of averaging every step's own metrics."""
    from eagle3_ray.drafter.ttt_metrics import mean_metrics

    d = _drafter(seed=5)
    w = _lm_head(d, seed=5)
    outs = [ttt_forward(d, _pack([_sample(n, 40 + n)]), w, ttt_steps=3, loss_decay=0.7) for n in (12, 7, 9)]
    expected = {k: sum(o.metrics[k] for o in outs) / 3 for k in outs[0].metrics}
    got = mean_metrics([o.stats for o in outs], 0.7)
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert got[k] == pytest.approx(v, rel=1e-6), k
    assert not outs[0].stats.requires_grad


def test_packed_rows_are_laid_out_on_the_host_as_ttt_forward_would():
    """row_to_batch(row_tokens=R) splits a pack into rows before its device copy; the batch is the
    one ttt_forward(row_tokens=R) builds from the packed row, so the step needs no device sync."""
    import numpy as np

    from eagle3_ray.features.record import bf16_to_uint16
    from eagle3_ray.train.data import row_to_batch

    packed = _pack([_sample(n, 60 + n) for n in (9, 4, 7, 3, 6)])
    row = {}
    for k, v in packed.items():
        v = v[0]
        if k.endswith("_hidden"):
            row[k] = bf16_to_uint16(v.to(torch.bfloat16))
        else:
            row[k] = v.numpy().astype(np.bool_ if k == "loss_mask" else np.int64)
    whole = row_to_batch(row, torch.device("cpu"), torch.float32)
    rows = row_to_batch(row, torch.device("cpu"), torch.float32, row_tokens=10)
    assert whole["seq_ids"].shape == (1, 29) and rows["seq_ids"].shape == (3, 10)
    expected = split_rows(whole, 10)
    assert rows.keys() == expected.keys()
    for k in rows:
        assert rows[k].dtype == expected[k].dtype, k
        torch.testing.assert_close(rows[k], expected[k], rtol=0, atol=0)


class _LiveBytes:
    """Bytes of tensor storage allocated by the ops run inside (a TorchDispatchMode), live and peak;
    storages that existed before (the inputs, and views of them) are not counted. CPU has no
    allocator statistics, so this counts the storages of op outputs until they are freed."""

    def __init__(self, *existing: torch.Tensor):
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        tracker = self
        self.live = self.peak = 0
        self._known = {t.untyped_storage().data_ptr() for t in existing}
        self._refs: dict[int, object] = {}

        def free(key: int, n: int) -> None:
            tracker.live -= n
            tracker._refs.pop(key, None)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if not isinstance(t, torch.Tensor):
                        continue
                    st = t.untyped_storage()
                    key, n = st.data_ptr(), st.nbytes()
                    if n == 0 or key in tracker._known or key in tracker._refs:
                        continue
                    tracker.live += n
                    tracker.peak = max(tracker.peak, tracker.live)
                    tracker._refs[key] = weakref.ref(st, lambda _, k=key, n=n: free(k, n))
                return out

        self.mode = Mode()


def _target_distribution_working_bytes(t: int, token_chunk: int) -> int:
    """Peak bytes `target_distribution` allocates beyond its two outputs, for a [1, t] sequence."""
    from eagle3_ray.drafter.ttt import target_distribution

    vocab, hidden, draft = 3000, 32, 400
    g = torch.Generator().manual_seed(0)
    w = torch.randn(vocab, hidden, generator=g)
    h = torch.randn(1, t, hidden, generator=g)
    d2t = torch.zeros(draft, dtype=torch.long)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:draft] = True
    mem = _LiveBytes(w, h, d2t, t2d)
    with mem.mode:
        p, in_draft = target_distribution(h, w, d2t, t2d, vocab_chunk=1000, token_chunk=token_chunk)
    outputs = p.untyped_storage().nbytes() + in_draft.untyped_storage().nbytes()
    return mem.peak - outputs


def test_target_distribution_working_memory_is_flat_in_sequence_length():
    # Full-vocab logits of 163,840 rows cannot be held per token: beyond its outputs (p [T, Vd] and
    # in_draft [T]), the target distribution's memory must not grow with T. A few bytes per token of
    # index tensors ([T] argmax ids) are allowed; one [T, chunk] fp32 logit block is not.
    short, long = _target_distribution_working_bytes(256, 128), _target_distribution_working_bytes(2048, 128)
    assert long - short < 16 * (2048 - 256), (short, long)
    assert long < 128 * 1000 * 4 * 3  # a few [token_chunk, vocab_chunk] blocks, whatever T
    # Without token chunking the working memory is a [T, vocab_chunk] block: the check above can fail.
    assert _target_distribution_working_bytes(2048, 2048) - long > 2048 * 1000 * 4 / 2


def test_chunked_target_distribution_equals_the_full_softmax_and_argmax():
    from eagle3_ray.drafter.ttt import target_distribution

    d = _drafter()
    w = _lm_head(d)
    h = torch.randn(2, 37, HT, generator=torch.Generator().manual_seed(3))
    p, in_draft = target_distribution(h, w, d.d2t, d.t2d, vocab_chunk=7, token_chunk=5)
    draft_rows = torch.arange(DRAFT) + d.d2t
    torch.testing.assert_close(p, torch.softmax(h @ w[draft_rows].T, dim=-1))
    assert torch.equal(in_draft, d.t2d[(h @ w.T).argmax(dim=-1)])


def test_chain_walk_replays_chain_decoding_over_each_assistant_turn():
    """Hand-worked: cycles draft from the token before each turn's first (the prefill's), accept the
    leading hits (capped at the turn's end) and commit one more; a turn that opens its sample (no
    prompt to prefill) and padding are not walked."""
    from eagle3_ray.drafter.ttt_metrics import chain_walk

    T, F = True, False
    # sample 0 (0..11): prompt 0..2, turn 3..9, user token 10, one-token turn 11; sample 1 (12..16): a turn
    # opening the sample at 12, prompt 13, turn 14..16; padding 17..19.
    mask = [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1, 0, 0, 0]
    seq = [0] * 12 + [1] * 5 + [-1] * 3
    hits = [[T, T, T] for _ in range(20)]  # every other position: all three drafts right
    hits[2] = [T, T, F]  # turn 3..9, from t=2: 2 accepted -> x4..x6 committed, next from t=5
    hits[5] = [F, T, T]  # a miss first: nothing accepted, the later hits do not count -> x7, next t=6
    hits[6] = [T, T, T]  # 3 right but 1 token left before x9: 1 accepted + x9; the turn is done (3 cycles)
    hits[13] = [T, F, T]  # turn 14..16 from t=13: 1 accepted -> x15, x16 (1 cycle)
    h = torch.tensor(hits).T[:, None, :]  # [K=3, B=1, T=20]
    got = chain_walk(h, torch.tensor([mask]), torch.tensor([seq]))
    assert got.tolist() == [6 + 2, 3 + 1]
    # rows of a batch add up
    got2 = chain_walk(h.expand(3, 2, 20), torch.tensor([mask] * 2), torch.tensor([seq] * 2))
    assert got2.tolist() == [16, 8]
    # no hits at all: one cycle per committed token
    assert chain_walk(torch.zeros_like(h), torch.tensor([mask]), torch.tensor([seq])).tolist() == [8, 8]


def test_held_out_metrics_give_the_walked_tau_as_tokens_per_cycle():
    from eagle3_ray.drafter.ttt_metrics import HELD_OUT_WIDTH, held_out_metrics

    sums = torch.zeros(HELD_OUT_WIDTH, dtype=torch.float64)
    sums[-3:] = torch.tensor([100.0, 30.0, 12.0])  # tokens, walk tokens, walk cycles
    assert held_out_metrics(sums, "/g")["val_tau_walk3/g"] == pytest.approx(2.5)
    sums[-2:] = 0  # a forward that did not walk: no walked figure
    assert "val_tau_walk3" not in held_out_metrics(sums)
