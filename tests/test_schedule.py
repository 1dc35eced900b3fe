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
    """A short run (87 optimizer steps, the side-by-side run's epoch) reaches its peak rate early and decays;
    the preset's 5-epoch run keeps the ~100 warmup steps it was measured with."""
    t = load_config("configs/smollm2-h200.yaml").train
    short = warmup_steps_of(t.warmup_steps, t.warmup_ratio, 87)
    assert short <= 3
    assert warmup_cosine(86, short, 87, t.min_lr_ratio) < 0.1
    assert abs(warmup_steps_of(t.warmup_steps, t.warmup_ratio, 4314) - 100) <= 2


def test_a_warmup_ratio_of_one_or_more_is_refused():
    with pytest.raises(ConfigError, match="warmup_ratio"):
        load_config("configs/ci-tiny.yaml", ["train.warmup_ratio=1.5"])
