"""The learning-rate schedule: linear warmup, cosine decay, and warmup as a share of the run."""

from __future__ import annotations

import pytest

from eagle3_ray.config import load_config
from eagle3_ray.errors import ConfigError
from eagle3_ray.train.schedule import warmup_cosine, warmup_steps_of


def test_warmup_then_cosine_to_the_floor():
    assert warmup_cosine(0, 4, 104, 0.1) == pytest.approx(0.25)
    assert warmup_cosine(3, 4, 104, 0.1) == pytest.approx(1.0)
    assert warmup_cosine(54, 4, 104, 0.1) == pytest.approx(0.55)
    assert warmup_cosine(104, 4, 104, 0.1) == pytest.approx(0.1)


def test_a_warmup_ratio_is_the_same_share_of_any_run():
    assert warmup_steps_of(100, None, 87) == 100  # the fixed count, longer than the run
    assert warmup_steps_of(100, 0.023, 4314) == 99
    assert warmup_steps_of(100, 0.023, 87) == 2
    assert warmup_steps_of(100, 0.023, 10) == 1  # never zero when asked for a share
    assert warmup_steps_of(100, 0.0, 87) == 0


def test_the_smollm2_preset_warms_up_a_short_run_briefly():
    """A short run (669 optimizer steps, the side-by-side run's epoch in packs of 2,048 tokens) reaches its peak
    rate early and decays; the preset's 5-epoch run warms up over the ~1.6M tokens it was measured with
    (100 steps of 16,384 tokens then, ~790 of 2,048 now)."""
    t = load_config("configs/smollm2-h200.yaml").train
    assert t.batch_tokens == 2048  # record specforge_packs_h100
    short = warmup_steps_of(t.warmup_steps, t.warmup_ratio, 669)
    assert short <= 16
    assert warmup_cosine(668, short, 669, t.min_lr_ratio) < 0.1
    warm_tokens = warmup_steps_of(t.warmup_steps, t.warmup_ratio, 4314 * 16384 // t.batch_tokens) * t.batch_tokens
    assert abs(warm_tokens - 100 * 16384) <= 2 * 16384


def test_a_warmup_ratio_of_one_or_more_is_refused():
    with pytest.raises(ConfigError, match="warmup_ratio"):
        load_config("configs/ci-tiny.yaml", ["train.warmup_ratio=1.5"])
