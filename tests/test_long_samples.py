"""The long-sample memory options of the TTT step (drafter/ttt.py; train.loss_chunk_tokens,
train.recompute_ttt_steps, every TTT step or the first k): the same loss and gradients as the plain step,
less kept for the backward.

Exactness (CPU, fp32, a tiny drafter, packed batches of several samples and padding, as one row and
laid out as rows): the loss and per-step stats equal the plain step's to 1e-6 relative, every
parameter gradient within torch.testing.assert_close(rtol=1e-5, atol=1e-6) (the largest difference
seen: 3e-7 of the gradient's largest entry: the lm_head gradient summed over chunks in another order).
flex has no CPU backward: its chunked loss is compared without gradients, and
benchmarks/train_step.py --check compares every mode with the options on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from eagle3_ray.drafter import DrafterConfig, Eagle3Drafter
from eagle3_ray.drafter.ttt import split_rows, ttt_forward
from tests.test_ttt import _LiveBytes, _drafter, _lm_head, _pack, _sample

pytestmark = pytest.mark.usefixtures("one_torch_thread")

OPTIONS = {
    "chunked": dict(loss_chunk_tokens=8),  # 45 tokens: 6 chunks, the last one short
    "chunk_of_5": dict(loss_chunk_tokens=5),  # chunks narrower than the last steps' shift
    "recomputed": dict(recompute_steps=True),
    "both": dict(loss_chunk_tokens=7, recompute_steps=True),
    "first_2_recomputed": dict(recompute_steps=2),  # of 4 steps: recomputed steps, then plain ones
    "both_first_3": dict(loss_chunk_tokens=7, recompute_steps=3),
}


def _run(batch, attention: str, steps: int = 4, **options):
    d = _drafter(seed=5)
    out = ttt_forward(d, batch, _lm_head(d, seed=5), ttt_steps=steps, attention=attention, **options)
    out.loss.backward()
    return out, {n: p.grad for n, p in d.named_parameters() if p.requires_grad}


def _assert_same(out, grads, ref, ref_grads) -> None:
    assert out.loss.item() == pytest.approx(ref.loss.item(), rel=1e-6)
    torch.testing.assert_close(out.stats, ref.stats, rtol=1e-6, atol=1e-7)  # ce_i, acc_i, count_i, served acc_i
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("attention,rows", [("sdpa", None), ("sdpa", 16), ("varlen", None), ("varlen", 16)])
def test_loss_and_gradients_equal_the_plain_step(attention, rows, option):
    batch = _pack([_sample(n, 40 + n) for n in (13, 5, 9, 11)], pad_to=45)  # 4 samples + 7 padding tokens
    if rows:
        batch = split_rows(batch, rows)
        assert batch["seq_ids"].shape[0] > 1
    _assert_same(*_run(batch, attention, **OPTIONS[option]), *_run(batch, attention))


def test_flex_chunked_loss_equals_the_plain_loss_without_gradients():
    batch = _pack([_sample(37, 1), _sample(50, 2), _sample(20, 3)], pad_to=120)
    d = _drafter()
    w = _lm_head(d)
    with torch.no_grad():
        plain = ttt_forward(d, batch, w, ttt_steps=3, attention="flex")
        chunked = ttt_forward(d, batch, w, ttt_steps=3, attention="flex", loss_chunk_tokens=50,
                              recompute_steps=True)  # recompute is a no-op without gradients
    assert chunked.loss.item() == pytest.approx(plain.loss.item(), rel=1e-6)
    torch.testing.assert_close(chunked.stats, plain.stats, rtol=1e-6, atol=1e-7)


def test_evaluation_with_the_options_gives_the_same_metrics():
    batch = _pack([_sample(n, 50 + n) for n in (12, 8)], pad_to=24)
    d = _drafter(seed=2)
    w = _lm_head(d, seed=2)
    with torch.no_grad():
        plain = ttt_forward(d, batch, w, ttt_steps=3, walk_steps=3)
        both = ttt_forward(d, batch, w, ttt_steps=3, walk_steps=3, loss_chunk_tokens=5, recompute_steps=True)
    assert both.metrics == pytest.approx(plain.metrics, rel=1e-6)
    assert torch.equal(both.walk, plain.walk)


# ------------------------------------------------------------------ what is held


WIDE_VOCAB, WIDE_DRAFT, WIDE_H = 8192, 4096, 16  # logits dominate: draft vocab 256x the hidden size


def _wide_drafter(intermediate: int = 32) -> Eagle3Drafter:
    torch.manual_seed(0)
    cfg = DrafterConfig(
        hidden_size=WIDE_H, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        intermediate_size=intermediate, vocab_size=WIDE_VOCAB, draft_vocab_size=WIDE_DRAFT,
        target_hidden_size=WIDE_H, aux_layers=[2, 3, 4],
    )
    d = Eagle3Drafter(cfg)
    d.bind_embedding(torch.randn(WIDE_VOCAB, WIDE_H))
    return d


def _one_sample(t: int, hidden: int, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(t)
    return {
        "input_ids": torch.randint(0, vocab, (1, t), generator=g),
        "aux_hidden": torch.randn(1, t, 3 * hidden, generator=g),
        "last_hidden": torch.randn(1, t, hidden, generator=g),
        "loss_mask": torch.ones(1, t, dtype=torch.long),
        "position_ids": torch.arange(t)[None],
        "seq_ids": torch.zeros(1, t, dtype=torch.long),
    }


class _VocabRows:
    """The most rows of any [.., draft vocab] tensor an op allocates (views are not allocations),
    forward and backward, outside ``target_distribution`` (whose output, p [T, draft vocab], is held
    whole by design; it computes it in chunks of its own)."""

    def __init__(self, vocab: int, monkeypatch):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        from eagle3_ray.drafter import ttt

        tracker = self
        self.most, self.paused = 0, False
        target_distribution = ttt.target_distribution

        def paused(*args, **kwargs):
            tracker.paused = True
            try:
                return target_distribution(*args, **kwargs)
            finally:
                tracker.paused = False

        monkeypatch.setattr(ttt, "target_distribution", paused)

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if not func.is_view and not tracker.paused:
                    for t in tree_flatten(out)[0]:
                        if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == vocab:
                            tracker.most = max(tracker.most, t.numel() // vocab)
                return out

        self.mode = Mode()


@pytest.mark.parametrize("rows_of", [None, 32])
def test_chunked_loss_never_allocates_a_whole_steps_logits(rows_of, monkeypatch):
    """With loss_chunk_tokens=C no op, forward or backward, allocates more than C rows of draft-vocab
    logits or probabilities (one [B, T] batch or rows of it); the plain step does ([B*T] rows)."""
    t, chunk = 96, 16
    batch = _one_sample(t, WIDE_H, WIDE_VOCAB)
    if rows_of:  # three samples as rows of 32: the chunk spans every row, C // B positions of each
        batch["seq_ids"] = torch.arange(t)[None] // rows_of
        batch["position_ids"] = torch.arange(t)[None] % rows_of
        batch = split_rows(batch, rows_of)
        assert batch["seq_ids"].shape == (3, rows_of)
    lm_head = torch.randn(WIDE_VOCAB, WIDE_H, generator=torch.Generator().manual_seed(1))
    most = {}
    for c in (0, chunk):
        d = _wide_drafter()
        rows = _VocabRows(WIDE_DRAFT, monkeypatch)
        with rows.mode:
            ttt_forward(d, batch, lm_head, ttt_steps=3, loss_chunk_tokens=c).loss.backward()
        most[c] = rows.most
    assert most[0] >= t  # the plain step: a whole step's logits at once
    assert 0 < most[chunk] <= chunk, most


def _kept_after_forward(t: int, intermediate: int = 32, **options) -> int:
    """Bytes the TTT forward allocates and still holds when it returns (what the backward will read,
    and the outputs), for one sample of ``t`` tokens through the wide drafter (varlen attention: its
    CPU reference keeps no [T, T] scores, sdpa's math kernel would)."""
    d = _wide_drafter(intermediate)
    batch = _one_sample(t, WIDE_H, WIDE_VOCAB)
    lm_head = torch.randn(WIDE_VOCAB, WIDE_H, generator=torch.Generator().manual_seed(1))
    mem = _LiveBytes(lm_head, *batch.values(), *d.parameters(), *d.buffers())
    with mem.mode:
        out = ttt_forward(d, batch, lm_head, ttt_steps=3, attention="varlen", **options)
    kept = mem.live
    out.loss.backward()
    return kept


def test_chunked_loss_keeps_no_logits_for_the_backward():
    """Per token, the plain step keeps the target distribution (4 bytes x draft vocab) and, per step,
    the fp32 log-probabilities of the torch loss (4 bytes x draft vocab more); chunked, only the
    target distribution and [T, H]-sized tensors: less than half a draft-vocab fp32 row per token
    over all 3 steps beyond the target distribution."""
    per_token = {c: (_kept_after_forward(128, loss_chunk_tokens=c) - _kept_after_forward(64, loss_chunk_tokens=c)) / 64
                 for c in (0, 16)}
    row = 4 * WIDE_DRAFT
    assert per_token[0] > row * (1 + 3), per_token
    assert per_token[16] < row * 1.5, per_token


def test_recomputed_steps_keep_less_for_the_backward():
    """With a wide MLP (its activations dominate a step's), recompute keeps under a tenth of what the
    plain step keeps beyond the target distribution: only each step's hidden states and keys/values
    (and the loss's [T]-sized outputs) stay."""
    t, wide_mlp = 64, 512
    kept = {r: _kept_after_forward(t, wide_mlp, loss_chunk_tokens=16, recompute_steps=r) for r in (False, True)}
    target = t * 4 * WIDE_DRAFT
    assert kept[True] - target < 0.1 * (kept[False] - target), kept


def test_recomputing_the_first_k_steps_keeps_less_the_more_steps():
    """recompute_steps=k (of 3 steps) keeps strictly less than no recompute and strictly more than all:
    k times a third of what recomputing all steps saves; k = ttt_steps is True."""
    t, wide_mlp = 64, 512
    # keyed by repr: True == 1 and False == 0 as dict keys
    kept = {repr(r): _kept_after_forward(t, wide_mlp, loss_chunk_tokens=16, recompute_steps=r)
            for r in (False, 1, 2, 3, True)}
    assert kept["False"] > kept["1"] > kept["2"] > kept["True"], kept
    assert kept["3"] == kept["True"], kept
    step = (kept["False"] - kept["True"]) / 3  # what one plain step keeps beyond a recomputed one
    for k in (1, 2):
        assert kept["False"] - kept[str(k)] == pytest.approx(k * step, rel=0.1), kept


@pytest.mark.parametrize("recompute,steps", [(True, [0, 1, 2, 3]), (False, []), (0, []), (1, [0]), (3, [0, 1, 2])])
def test_recompute_steps_k_recomputes_the_first_k_steps(recompute, steps, monkeypatch):
    """Which TTT steps run under activation checkpointing: all (True), none (False, 0) or 0..k-1; none
    without gradients."""
    from eagle3_ray.drafter import ttt

    seen = []

    def recomputed_step(drafter, ids, hidden, pos, mask, cache):
        seen.append(int(pos[0, 0]))  # pos + i: the sample starts at position 0
        return real(drafter, ids, hidden, pos, mask, cache)

    real = ttt.recomputed_step
    monkeypatch.setattr(ttt, "recomputed_step", recomputed_step)
    batch = _pack([_sample(12, 3), _sample(9, 4)])
    _run(batch, "sdpa", steps=4, recompute_steps=recompute)
    assert seen == steps
    seen.clear()
    d = _drafter()
    with torch.no_grad():
        ttt_forward(d, batch, _lm_head(d), ttt_steps=4, recompute_steps=recompute)
    assert seen == []


def test_the_options_reach_the_step_from_the_config():
    from eagle3_ray.config import TrainConfig
    from eagle3_ray.train.step import StepConfig

    default = StepConfig.from_train(TrainConfig(), "sdpa")
    assert default.loss_chunk_tokens == 0 and default.recompute_steps is False
    on = StepConfig.from_train(TrainConfig(loss_chunk_tokens=4096, recompute_ttt_steps=True), "varlen")
    assert on.loss_chunk_tokens == 4096 and on.recompute_steps is True
    with pytest.raises(ValueError):
        TrainConfig(loss_chunk_tokens=-1)
    assert StepConfig.from_train(TrainConfig(recompute_ttt_steps=3), "varlen").recompute_steps == 3


def test_recompute_ttt_steps_takes_true_false_or_the_first_k():
    """true stays True (not 1) and k stays k, from YAML overrides too; k past ttt_steps, or negative, is
    refused with a message naming the setting."""
    from eagle3_ray.config import TrainConfig, load_config
    from eagle3_ray.errors import ConfigError

    for raw, want in (("true", True), ("false", False), ("1", 1), ("3", 3), ("0", 0), ("7", 7)):
        got = load_config(None, [f"train.recompute_ttt_steps={raw}"]).train.recompute_ttt_steps
        assert got == want and type(got) is type(want), (raw, got)
    assert TrainConfig(recompute_ttt_steps=True).recompute_ttt_steps is True
    assert TrainConfig(recompute_ttt_steps=False).recompute_ttt_steps is False
    assert TrainConfig(ttt_steps=4, recompute_ttt_steps=4).recompute_ttt_steps == 4
    for bad in (["train.recompute_ttt_steps=8"], ["train.recompute_ttt_steps=-1"],
                ["train.ttt_steps=3", "train.recompute_ttt_steps=4"]):
        with pytest.raises(ConfigError, match="recompute_ttt_steps"):
            load_config(None, bad)
    with pytest.raises(ValueError, match=r"train.recompute_ttt_steps=5: .* train.ttt_steps=4"):
        TrainConfig(ttt_steps=4, recompute_ttt_steps=5)
    with pytest.raises(ValueError, match="recompute_ttt_steps=-1"):
        TrainConfig(recompute_ttt_steps=-1)


def test_the_benchmarks_recompute_flag_takes_every_step_or_the_first_k():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "train_step.py"
    spec = importlib.util.spec_from_file_location("train_step_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def options(*argv):
        return bench._memory_options(bench.parse_args([*argv, "--device", "cpu"]))["recompute_steps"]

    assert options() is False
    assert options("--recompute-ttt-steps") is True
    assert options("--recompute-ttt-steps", "--json", "x.json") is True
    assert options("--recompute-ttt-steps", "3") == 3
    with pytest.raises(SystemExit):
        options("--recompute-ttt-steps", "8")  # more than --ttt-steps 7
