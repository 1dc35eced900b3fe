"""Every shipped preset in configs/ loads against the schema, and each GPU preset is consistent:
what it asks of one machine fits what it declares (CPUs), and every GPU stage is on the GPU."""

from pathlib import Path

import pytest

from eagle3_ray.config import load_config

PRESETS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def test_presets_found():
    assert {p.stem for p in PRESETS} >= {"ci-tiny", "demo-smollm2", "smollm2-h200", "llama3.1-8b", "kimi-k2.5"}


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_preset_loads(path):
    cfg = load_config(path)
    assert cfg.name


def test_smollm2_h200_is_a_one_gpu_run():
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "smollm2-h200.yaml")
    assert cfg.extract.num_gpus_per_actor == 1 and cfg.train.use_gpu and cfg.bench.num_gpus == 1
    # stages run one after another, so each must fit the machine's CPUs on its own
    for need in (cfg.extract.num_actors * cfg.extract.num_cpus_per_actor,
                 cfg.train.num_workers * cfg.train.cpus_per_worker, cfg.bench.num_cpus):
        assert need <= cfg.ray.num_cpus
    assert cfg.data.path is None  # the training prompts are the user's: passed with --data
    assert cfg.train.lr == 1e-3  # the measured choice for a SmolLM2-sized drafter (docs/drafter.md)
