"""The one training step (train/step.py) on a plain torch model + optimizer: it is the hand-written
accumulate / clip / AdamW / schedule loop, and its evaluation is the held-out metrics of ttt_forward."""

from __future__ import annotations

import pytest
import torch

from eagle3_ray.drafter import DrafterConfig, Eagle3Drafter, ttt_forward
from eagle3_ray.drafter.ttt_metrics import held_out_metrics, held_out_sums
from eagle3_ray.train.step import StepConfig, TorchEngine, TrainStep, adamw

H, VOCAB, DRAFT = 16, 40, 24

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _drafter() -> Eagle3Drafter:
    torch.manual_seed(0)
    cfg = DrafterConfig(
        hidden_size=H, num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=32,
        vocab_size=VOCAB, draft_vocab_size=DRAFT, target_hidden_size=H, aux_layers=[2, 3, 4], rms_norm_eps=1e-5,
    )
    d = Eagle3Drafter(cfg)
    d.bind_embedding(torch.randn(VOCAB, H))
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:DRAFT].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    d.set_vocab_map(ids - torch.arange(DRAFT), t2d)
    return d


def _batch(t: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, VOCAB, (1, t), generator=g),
        "aux_hidden": torch.randn(1, t, 3 * H, generator=g),
        "last_hidden": torch.randn(1, t, H, generator=g) * 3,
        "loss_mask": torch.ones(1, t, dtype=torch.long),
        "position_ids": torch.arange(t)[None],
        "seq_ids": torch.zeros(1, t, dtype=torch.long),
    }


def _lm_head() -> torch.Tensor:
    return torch.randn(VOCAB, H, generator=torch.Generator().manual_seed(5))


def _params(d):
    return [p for p in d.parameters() if p.requires_grad]


def test_the_step_is_the_accumulate_clip_adamw_schedule_loop():
    batches = [_batch(12, s) for s in range(4)]
    lm_head, clip, lr = _lm_head(), 0.05, 1e-2

    ref = _drafter()
    opt = torch.optim.AdamW(_params(ref), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    for pair in (batches[:2], batches[2:]):
        for b in pair:
            (ttt_forward(ref, b, lm_head, 3, 0.8).loss / 2).backward()
        torch.nn.utils.clip_grad_norm_(_params(ref), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()

    d = _drafter()
    opt2 = adamw(_params(d), lr=lr)
    engine = TorchEngine(d, opt2, torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0 / (s + 1)),
                         grad_accum=2, grad_clip=clip)
    step = TrainStep(engine, lm_head, StepConfig(ttt_steps=3, loss_decay=0.8, grad_accum=2))
    before = [p.detach().clone() for p in _params(d)]
    stepped = []
    for i, b in enumerate(batches):
        step(b)
        stepped.append(step.stepped)
        if i == 0:  # mid-window: gradients accumulate, the weights stay
            assert all(torch.equal(p, q) for p, q in zip(_params(d), before))
    assert stepped == [False, True, False, True]
    assert engine.get_lr() == [pytest.approx(lr / 3)]
    assert not any(torch.equal(p, q) for p, q in zip(_params(d), before))
    for p, q in zip(_params(d), _params(ref)):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_evaluate_is_the_held_out_metrics_of_the_same_forward_and_keeps_the_mode():
    d, lm_head = _drafter(), _lm_head()
    step = TrainStep(TorchEngine(d, adamw(_params(d), lr=1e-3)), lm_head, StepConfig(ttt_steps=2, row_tokens=8))
    pairs = [(_batch(10, s), 10) for s in (7, 8)]
    for b, _ in pairs:
        b["loss_mask"][0, :3] = 0  # a prompt, then the answer: a turn the walk replays
    want = held_out_metrics(held_out_sums(d, pairs, lambda b: ttt_forward(d, b, lm_head, 2, 0.8, row_tokens=8,
                                                                           walk_steps=2)))
    d.train()
    got = step.evaluate(pairs)
    assert d.training
    assert got == pytest.approx(want)
    assert got["val_tokens"] == 20
    assert 1.0 <= got["val_tau_walk3"] <= 3.0  # a chain of min(3, ttt_steps) = 2 drafts


def test_accumulation_must_be_positive():
    d = _drafter()
    with pytest.raises(ValueError, match="grad_accum"):
        TorchEngine(d, adamw(_params(d), lr=1e-3), grad_accum=0)


def test_accumulated_gradients_are_the_mean_over_the_window():
    """With SGD (no normalisation, unlike Adam) the update shows the loss scaling: the window's mean gradient."""
    batches, lm_head, lr = [_batch(12, s) for s in (1, 2)], _lm_head(), 0.1
    ref = _drafter()
    for b in batches:
        ttt_forward(ref, b, lm_head, 2, 0.8).loss.backward()
    with torch.no_grad():
        for p in _params(ref):
            p -= lr * p.grad / 2

    d = _drafter()
    step = TrainStep(TorchEngine(d, torch.optim.SGD(_params(d), lr=lr), grad_accum=2), lm_head,
                     StepConfig(ttt_steps=2, grad_accum=2))
    for b in batches:
        step(b)
    for p, q in zip(_params(d), _params(ref)):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
