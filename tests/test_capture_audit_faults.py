"""Fault injection for the capture audit (issue 61), on CPU, through the product: the real SmolLM2 and
the tiny random target in the HF engine, answers written by the generate stage's ``self_distill``,
figures summed and judged by the capture actor's ``CaptureAudit``, stores written by the extraction
actor (``CaptureWriteUDF``, called in-process) and checked by ``eagle3-ray verify``. The faults are the
switches of tests/audit_faults.py, inside the engine: its figures see what a broken capture path
would capture. No Ray. Measured figures of the same runs: benchmarks/capture_audit.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

import audit_faults
from eagle3_ray.audit.figures import ShardAudit
from eagle3_ray.config import ExtractConfig, TargetConfig, load_config
from eagle3_ray.errors import AuditFailed

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMOLLM2 = TargetConfig(model="smollm2", device="cpu", dtype="float32")
TINY = TargetConfig(model="random:builtin:tiny-llama", device="cpu", dtype="float32")
EVERY_ROW = ExtractConfig(audit_rows=1.0)


class Target:
    """A product engine with every row audited, the actor's audit, and tokenized text of two kinds:
    the target's own greedy answers (self_distill, greedy_by set) and builtin:ci_tiny's human answers."""

    def __init__(self, cfg: TargetConfig, tmp, prompts: int, new_tokens: int):
        from eagle3_ray.data.chat import tokenize_conversation
        from eagle3_ray.data.distill import self_distill
        from eagle3_ray.data.sources import read_samples
        from eagle3_ray.engines.describe import describe_target
        from eagle3_ray.engines.factory import build_engine
        from eagle3_ray.extract.capture_audit import CaptureAudit

        self.cfg, self.fingerprint = cfg, describe_target(cfg).fingerprint
        self.engine = build_engine(cfg, batch_tokens=4096, audit_share=1.0)
        self.audit = CaptureAudit(self.engine, cfg, EVERY_ROW, self.fingerprint)
        tok = self.engine.tokenizer
        path = tmp / "greedy.jsonl"
        self_distill(self.engine, tok, list(read_samples("builtin:demo_prompts", max_samples=prompts)), path,
                     new_tokens, batch_size=prompts, progress=lambda *a: None, answered_by=self.fingerprint)
        self.texts = {name: [(tokenize_conversation(tok, s, 1024), s.greedy_by) for s in read_samples(src)]
                      for name, src in (("greedy", path), ("human", "builtin:ci_tiny"))}

    def shard(self, name: str) -> ShardAudit:
        samples = self.texts[name]
        caps = self.engine.capture([t.input_ids for t, _ in samples])
        return ShardAudit([self.audit.sample(t.sample_id, t.input_ids, t.loss_mask, c, g)
                           for (t, g), c in zip(samples, caps)])

    def failing(self, name: str) -> str | None:
        return self.audit.policy.failing(self.shard(name))


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    return Target(SMOLLM2, tmp_path_factory.mktemp("smollm2"), prompts=8, new_tokens=32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return Target(TINY, tmp_path_factory.mktemp("tiny"), prompts=8, new_tokens=32)


def test_healthy_captures_pass_with_the_figures_the_thresholds_were_set_from(smollm2, tiny):
    greedy, human = smollm2.shard("greedy"), smollm2.shard("human")
    assert greedy.count("agreement") > 200 and greedy.value("agreement") > 0.9
    assert -1.0 < human.value("nll_excess") < 0.5 and greedy.value("unnormed") == 0.0
    assert smollm2.audit.policy.failing(greedy) is None and smollm2.audit.policy.failing(human) is None
    # A random target predicts nothing: NLL = entropy = log V, excess ~0; its greedy answers loop
    tiny_human = tiny.shard("human")
    assert tiny_human.value("nll_excess") == pytest.approx(0.0, abs=0.1)
    assert tiny.failing("greedy") is None and tiny.audit.policy.failing(tiny_human) is None


# (fault, SmolLM2 greedy answers, SmolLM2 human text, tiny random target)
CAUGHT = [
    ("late", "agreement", "nll_excess", None),
    ("early", "agreement", "nll_excess", None),
    ("aux_as_last", "unnormed", "unnormed", "unnormed"),
    ("half_sum", "agreement", "any", None),
    ("prefix_zero", "unnormed", "unnormed", "unnormed"),
]


@pytest.mark.parametrize("fault, on_greedy, on_human, on_tiny", CAUGHT, ids=[c[0] for c in CAUGHT])
def test_each_fault_is_caught_by_the_figure_that_sees_it(smollm2, tiny, fault, on_greedy, on_human, on_tiny):
    switch = audit_faults.FAULTS[fault]
    with switch(smollm2.engine):
        got = {"greedy": smollm2.failing("greedy"), "human": smollm2.failing("human")}
    with switch(tiny.engine):
        got["tiny"] = tiny.failing("greedy") or tiny.failing("human")
    assert got["greedy"] == on_greedy
    if on_human != "any":  # a half sum's NLL excess (1.9 nats) needs ~190 rows: this text has 187
        assert got["human"] == on_human
    # The random target's lm_head predicts nothing, so it cannot see a shift or a half sum (documented);
    # the norm check still sees states that are not the final norm's output.
    assert got["tiny"] == on_tiny


@pytest.mark.parametrize("which", ["smollm2", "tiny"])
def test_aux_ids_off_by_one_are_invisible_to_the_lm_head_and_caught_by_the_reference_capture(which, request):
    from eagle3_ray.extract.capture_audit import check_aux_layers

    target = request.getfixturevalue(which)
    with audit_faults.aux_off_by_one(target.engine):
        assert target.failing("greedy") is None  # aux_hidden never meets the lm_head
        with pytest.raises(AuditFailed, match=r"hidden_states \[3, .*not target.aux_layers=\[2, "):
            check_aux_layers(target.engine)
    check_aux_layers(target.engine)  # and healthy again


def _batch(samples) -> dict[str, np.ndarray]:
    obj = lambda xs: np.array(xs, dtype=object)  # noqa: E731
    return {"sample_id": obj([t.sample_id for t, _ in samples]), "source": obj(["test"] * len(samples)),
            "input_ids": obj([np.asarray(t.input_ids, np.int32) for t, _ in samples]),
            "loss_mask": obj([np.asarray(t.loss_mask, np.uint8) for t, _ in samples]),
            "greedy_by": obj([g for _, g in samples])}


def _store_udf(root, extract: ExtractConfig):
    from eagle3_ray.engines.describe import describe_target
    from eagle3_ray.extract.udfs import CaptureWriteUDF
    from eagle3_ray.features.store import StoreMeta

    meta = StoreMeta.from_engine_info(describe_target(SMOLLM2))
    return CaptureWriteUDF(SMOLLM2, 4096, str(root), meta, extract=extract)


def test_a_failing_shard_is_not_written_the_earlier_ones_stay_and_a_rerun_resumes(smollm2, tmp_path):
    from eagle3_ray.features.store import completed_ids, manifest

    udf = _store_udf(tmp_path, EVERY_ROW)
    first, second = smollm2.texts["greedy"][:4], smollm2.texts["greedy"][4:]
    assert set(udf(_batch(first))["status"]) == {"ok"}
    with audit_faults.late(udf.engine), pytest.raises(AuditFailed) as e:
        udf(_batch(second))
    assert str(e.value).startswith("shard b") and "-000000 fails the capture audit: agreement" in str(e.value)
    assert completed_ids(tmp_path) == {t.sample_id for t, _ in first}  # listed, valid
    out = udf(_batch(second))  # the cause fixed: the same batch goes through
    assert set(out["status"]) == {"ok"} and out["audit_greedy_rows"].sum() > 0
    markers = manifest(tmp_path)
    assert len(markers) == 2 and all(m["audit"]["agreement"] > 0.9 and m["greedy_ids"] for m in markers)


def test_verify_audits_a_store_and_exits_2_naming_the_shard_a_fault_wrote(smollm2, tmp_path, capsys):
    """A store written with the audit off (as before it existed) and a late capture in one batch."""
    from eagle3_ray.cli import main

    udf = _store_udf(tmp_path / "store", ExtractConfig(audit_rows=0.0, audit_max_unnormed=1.0))
    udf(_batch(smollm2.texts["greedy"][:4]))
    with audit_faults.late(udf.engine):
        bad = udf(_batch(smollm2.texts["human"]))
    cfg = tmp_path / "smollm2.yaml"
    cfg.write_text(json.dumps({"target": SMOLLM2.model_dump()}))
    capsys.readouterr()
    assert main(["verify", "--features", str(tmp_path / "store"), "-c", str(cfg), "--rows", "1"]) == 2
    out = capsys.readouterr().out.splitlines()
    table = [line for line in out if line.startswith("b")]
    assert len(table) == 2 and sum(line.endswith(" ok") for line in table) == 1
    assert sum(line.endswith("FAIL nll_excess") for line in table) == 1
    failure = next(line for line in out if "fails the capture audit" in line)
    assert failure.startswith("shard b") and "fails the capture audit: nll_excess" in failure
    assert any(str(sid) in failure for sid in bad["sample_id"])  # the worst sample is one of that batch
    assert out[-1].startswith("[verify] 1/2 shards pass")
    assert main(["verify", "--features", str(tmp_path / "store"), "-c", str(cfg),
                 "extract.audit_max_nll_excess=1000"]) == 0


def test_verify_refuses_a_store_of_another_target(smollm2, tmp_path, capsys):
    from eagle3_ray.cli import main

    udf = _store_udf(tmp_path / "store", ExtractConfig(audit_rows=0.0))
    udf(_batch(smollm2.texts["greedy"][:2]))
    cfg = load_config("configs/ci-tiny.yaml")  # the tiny random target's config
    path = tmp_path / "tiny.yaml"
    path.write_text(json.dumps({"target": cfg.target.model_dump()}))
    assert main(["verify", "--features", str(tmp_path / "store"), "-c", str(path)]) == 2
    assert "was extracted from another target" in capsys.readouterr().err


@pytest.mark.ray
def test_extract_stops_with_one_line_and_exit_2_on_a_bad_shard_and_resumes_after_the_fix(ci_tiny_prepared, tmp_path,
                                                                                        monkeypatch, capsys):
    """`eagle3-ray extract` on the real local Ray: from its second batch the engine actor's captures
    lose their first 16 rows (a skipped prefix: rows never written). The stage stops on that shard
    with exit status 2 and one line; the shard before it stays committed; a rerun resumes."""
    from eagle3_ray.cli import main
    from eagle3_ray.extract import udfs
    from eagle3_ray.extract.pipeline import run_extract
    from eagle3_ray.features import open_store

    class PrefixLostFromTheSecondBatch(udfs.CaptureWriteUDF):  # sent to the actor by value (cloudpickle)
        def __call__(self, batch):
            self.calls = getattr(self, "calls", 0) + 1
            if self.calls == 2:
                real = self.engine.forward_states

                def lost_prefix(ids, mask):
                    aux, last = real(ids, mask)
                    aux, last = aux.clone(), last.clone()
                    aux[:, :16], last[:, :16] = 0, 0
                    return aux, last

                self.engine.forward_states = lost_prefix
            return super().__call__(batch)

    PrefixLostFromTheSecondBatch.__name__ = "CaptureWriteUDF"
    monkeypatch.setattr(udfs, "CaptureWriteUDF", PrefixLostFromTheSecondBatch)
    out, prepared = tmp_path / "features", str(ci_tiny_prepared[0])
    capsys.readouterr()
    rc = main(["extract", "-c", "configs/ci-tiny.yaml", "--data", prepared, "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, "\n".join(err[-20:])
    last = err[-1]
    assert last.startswith("eagle3-ray extract: error: shard b") and "fails the capture audit: unnormed" in last
    assert "skipped prefix" in last and "rerun the same command to resume" in last and "Traceback" not in last
    kept = open_store(out, verify=True)
    assert 0 < len(kept) < 12 and all(m for m in kept.sample_ids)

    monkeypatch.undo()
    summary = run_extract(load_config("configs/ci-tiny.yaml"), prepared, out)
    assert summary.skipped_done == len(kept) and summary.samples == 12
    assert summary.audit["unnormed"] == 0.0


@pytest.mark.parametrize("mode", ["online", "hybrid"])
def test_online_and_hybrid_capture_actors_stop_on_a_bad_batch(smollm2, tmp_path, mode):
    """The training-side engine actor (PackCaptureUDF, in-process) judges each call's samples (online)
    or each shard before it is committed (hybrid), on the prepared data's greedy answers."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle3_ray.engines.describe import describe_target
    from eagle3_ray.extract.udfs import PackCaptureUDF
    from eagle3_ray.features.store import StoreMeta, completed_ids, create_store

    samples = sorted(smollm2.texts["greedy"], key=lambda s: s[0].sample_id)  # the prepared file's order
    pq.write_table(pa.table({
        "sample_id": [t.sample_id for t, _ in samples], "source": ["test"] * len(samples),
        "greedy_by": [g for _, g in samples],
        "input_ids": pa.array([t.input_ids for t, _ in samples], pa.list_(pa.int32())),
        "loss_mask": pa.array([t.loss_mask for t, _ in samples], pa.list_(pa.uint8())),
        "num_tokens": [len(t.input_ids) for t, _ in samples]}), tmp_path / "prepared.parquet")
    meta = StoreMeta.from_engine_info(describe_target(SMOLLM2))
    store = tmp_path / "store" if mode == "hybrid" else None
    if store is not None:
        create_store(store, meta)
    udf = PackCaptureUDF(str(tmp_path / "prepared.parquet"), SMOLLM2, 4096, meta, extract=EVERY_ROW,
                         store_root=str(store) if store else None)

    def call(keys, packs):
        batch = np.empty(len(packs), dtype=object)
        batch[:] = [np.asarray(p) for p in packs]
        return udf({"key": np.asarray(keys), "samples": batch})

    assert len(call(["0:0", "0:1"], [[0, 1], [2, 3]])["key"]) == 2
    with audit_faults.early(udf.engine), pytest.raises(AuditFailed) as e:
        call(["0:2", "0:3"], [[4, 5], [6, 7]])
    where = "shard h" if mode == "hybrid" else "the online capture of packs 0:2, 0:3"
    assert str(e.value).startswith(where) and "fails the capture audit: agreement" in str(e.value)
    if store is not None:
        assert completed_ids(store) == {t.sample_id for t, _ in samples[:4]}
