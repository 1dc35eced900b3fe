"""Every shipped preset in configs/ loads against the schema, and each GPU preset is consistent:
what it asks of one machine fits what it declares (CPUs), and every GPU stage is on the GPU."""

from pathlib import Path

import pytest

from eagle3_ray.config import load_config

PRESETS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def test_presets_found():
    assert {p.stem for p in PRESETS} >= {"ci-tiny", "demo-smollm2", "demo-smollm2-chat", "smollm2-h200", "llama3.1-8b", "kimi-k2.5"}


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


@pytest.mark.parametrize("preset,size", [("demo-smollm2", 220), ("demo-smollm2-chat", 300)])
def test_the_demo_takes_its_shipped_answers_and_cites_its_gpu_record(tmp_path, preset, size):
    """The demo's generate stage takes the shipped answers only while its answer settings are theirs: a
    preset edit that changes an answer (length, target, seed, ...) needs the answers written again with
    the command their meta names. Its report's opening cites the GPU record with that record's figures."""
    import json

    from eagle3_ray.bench.report import reference_sentence
    from eagle3_ray.config import config_to_dict
    from eagle3_ray.data.sources import read_samples
    from eagle3_ray.extract.generate_stage import answer_settings, answers_files, answers_of, loaded_dtype

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / f"{preset}.yaml")
    answers, meta_file = answers_files(cfg.generate.answers)
    meta = json.loads(meta_file.read_text())
    settings = {**answer_settings(cfg), "target.dtype": loaded_dtype(cfg)}
    assert {k: meta.get(k) for k in settings} == settings, f"re-run the command of {meta_file}: {meta['command']}"
    prompts = list(read_samples(cfg.data.path))
    earlier = {s.sample_id: s for s in read_samples(str(answers))}
    assert all(answers_of(p, earlier[p.sample_id]) for p in prompts) and len(earlier) == len(prompts) == size

    text = reference_sentence(config_to_dict(cfg)["bench"]["reference"], tmp_path)
    record = json.loads((Path(__file__).resolve().parents[1] / cfg.bench.reference.record).read_text())
    assert f"tau {record['values']['tau_chain3_mtbench']:.2f}" in text and "[product8](" in text
