"""The capture audit's parts (eagle3_ray/audit, extract/capture_audit.py), each against an independent
reference: the vocab-parallel merge against the logits of the whole vocab, the norm check against a
real transformers RMSNorm, the shard judgement and its one line, the store writer that refuses a
failing shard, and the greedy mark carried from the generate stage's records to the prepared data.
No Ray. Faults in real captures: tests/test_capture_audit_faults.py."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from eagle3_ray.audit.figures import (
    AUX_RMS_ROWS,
    MIN_ROWS,
    AuditPolicy,
    SampleAudit,
    ShardAudit,
    audit_sample,
    merged_json,
    sums_from_json,
)
from eagle3_ray.audit.rows import (
    NORM_TOLERANCE,
    RowFigures,
    audit_positions,
    combine_partials,
    normed_rms,
    row_figures,
    vocab_partials,
)
from eagle3_ray.errors import AuditFailed
from eagle3_ray.features.store import FeatureStoreWriter, StoreMeta, completed_ids, manifest

POLICY = AuditPolicy(min_agreement=0.8, max_nll_excess=1.0, max_unnormed=0.001)


def _reference(hidden, weight, nxt):
    """The figures from the full [n, V] logits, written out directly."""
    z = hidden.double() @ weight.double().T
    logp = torch.log_softmax(z, -1)
    return -logp.gather(1, nxt[:, None])[:, 0], -(logp.exp() * logp).sum(-1), z.argmax(-1)


@pytest.mark.parametrize("cuts", [[0, 103], [0, 40, 103], [0, 1, 50, 77, 103]], ids=["1", "2", "4"])
def test_vocab_slices_merge_to_the_figures_of_the_whole_vocab(cuts):
    torch.manual_seed(0)
    hidden, weight = torch.randn(50, 16), torch.randn(103, 16) * 2
    nxt = torch.randint(0, 103, (50,))
    parts = torch.stack([vocab_partials(hidden, weight[a:b], nxt, vocab_start=a) for a, b in zip(cuts, cuts[1:])])
    nll, entropy, argmax = combine_partials(parts)
    want_nll, want_entropy, want_argmax = _reference(hidden, weight, nxt)
    assert torch.allclose(nll.double(), want_nll, atol=1e-4)
    assert torch.allclose(entropy.double(), want_entropy, atol=1e-4)
    assert torch.equal(argmax, want_argmax)


def test_a_tie_across_slices_goes_to_the_lowest_id_as_argmax_does(monkeypatch):
    weight = torch.zeros(8, 2)
    weight[2] = weight[6] = torch.tensor([1.0, 0.0])  # ids 2 and 6 tie, in different slices
    hidden = torch.tensor([[3.0, 0.0]])
    monkeypatch.setattr("eagle3_ray.audit.rows.LOGIT_CHUNK_BYTES", 4)  # one row per chunk: the chunking runs
    parts = torch.stack([vocab_partials(hidden, weight[a:a + 4], torch.tensor([6]), a) for a in (0, 4)])
    assert int(combine_partials(parts)[2][0]) == 2 == int((hidden @ weight.T).argmax())


def test_row_figures_in_bf16_match_the_logits_computed_in_bf16():
    torch.manual_seed(1)
    hidden, weight = torch.randn(20, 32).bfloat16(), (torch.randn(64, 32) * 0.5).bfloat16()
    nxt = torch.randint(0, 64, (20,))
    fig = row_figures(hidden, weight, nxt, torch.arange(20))
    z = (hidden @ weight.T).float()  # what SGLang's logits processor computes in bf16
    assert torch.allclose(fig.nll, torch.logsumexp(z, -1) - z.gather(1, nxt[:, None])[:, 0], atol=1e-5)
    assert torch.equal(fig.argmax, z.argmax(-1))
    assert torch.equal(RowFigures.unpacked(fig.packed()).argmax, fig.argmax)  # the SGLang hook's hand-over


def test_audit_positions_spread_the_share_over_the_rows_with_a_next_token():
    rows = audit_positions(1001, 0.1)
    assert 95 <= len(rows) <= 105 and int(rows.max()) <= 999
    assert np.diff(rows.numpy()).max() <= 20  # spread, no long gap
    assert torch.equal(rows, audit_positions(1001, 0.1))  # the same rows every time (live audit and verify)
    assert torch.equal(audit_positions(5, 1.0), torch.arange(4))  # the last row predicts nothing
    assert len(audit_positions(100, 0.0)) == 0 and len(audit_positions(1, 1.0)) == 0


def test_the_norm_check_is_one_on_a_real_rmsnorm_and_far_from_it_before_the_norm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(2)
    norm = LlamaRMSNorm(576, eps=1e-5)  # SmolLM2's width
    with torch.no_grad():
        norm.weight.uniform_(0.2, 3.0)
        norm.weight[5] = 0.0  # a dead dimension is left out, not divided by
        residual = torch.randn(30, 576) * 7.0
        out = norm(residual).bfloat16()
    rms = normed_rms(out, norm.weight)
    assert (rms - 1).abs().max() < NORM_TOLERANCE / 4
    assert ((normed_rms(residual, norm.weight) - 1).abs() > 0.5).all()
    assert (normed_rms(torch.zeros(3, 576), norm.weight) == 0).all()  # rows never written


def _sample(sid: str, agree: int, greedy_rows: int, excess: float, rows: int = 100, **kw) -> SampleAudit:
    return SampleAudit(sid, greedy=greedy_rows > 0, rows=rows, nll=(2.0 + excess) * rows, entropy=2.0 * rows,
                       excess_sq=(excess ** 2 + 2.5 ** 2) * rows, greedy_rows=greedy_rows, agree=agree,
                       norm_rows=rows + 20, **kw)


def test_a_healthy_shard_passes_and_each_fault_fails_on_its_figure():
    healthy = ShardAudit([_sample("a", 95, 100, 0.1), _sample("b", 0, 0, 0.3)])
    assert POLICY.failing(healthy) is None
    assert POLICY.failing(ShardAudit([_sample("a", 2, 100, 9.0)])) == "agreement"
    assert POLICY.failing(ShardAudit([_sample("a", 0, 0, 9.0)])) == "nll_excess"
    assert POLICY.failing(ShardAudit([_sample("a", 95, 100, 0.1, unnormed=16)])) == "unnormed"


def test_a_figure_fails_only_past_its_threshold_by_three_standard_errors():
    # mean excess 1.3 with a row's std 2.5: past 1.0 with 400 rows, not with 40
    assert POLICY.failing(ShardAudit([_sample("a", 0, 0, 1.3, rows=400)])) is None
    assert POLICY.failing(ShardAudit([_sample("a", 0, 0, 1.6, rows=400)])) == "nll_excess"
    assert POLICY.failing(ShardAudit([_sample("a", 0, 0, 1.6, rows=40)])) is None
    # agreement 0.65: caught with 200 rows (upper bound 0.75), not with 40 (0.88)
    assert POLICY.failing(ShardAudit([_sample("a", 130, 200, 0.0)])) == "agreement"
    assert POLICY.failing(ShardAudit([_sample("a", 26, 40, 0.0)])) is None
    # fewer rows than MIN_ROWS are reported, never judged
    assert POLICY.failing(ShardAudit([_sample("a", 0, MIN_ROWS - 1, 50.0, rows=MIN_ROWS - 1)])) is None


def test_the_failure_is_one_line_naming_the_shard_figure_worst_sample_and_causes_in_order():
    shard = ShardAudit([_sample("good", 95, 100, 0.1), _sample("bad-7", 1, 100, 9.0)])
    with pytest.raises(AuditFailed) as e:
        POLICY.check("shard b123-000000", shard)
    line = str(e.value)
    assert "\n" not in line and line.startswith("shard b123-000000 fails the capture audit: agreement 0.480")
    assert "extract.audit_min_agreement=0.8 over 200 rows" in line and "worst sample 'bad-7': 0.010" in line
    causes = [line.index(w) for w in ("off by one position", "aux/last layer mapping", "unreduced tensor-parallel",
                                      "skipped prefix (radix cache, chunked prefill)")]
    assert causes == sorted(causes)
    assert "rerun the same command to resume" in line


def test_shard_figures_survive_the_marker_and_merge_exactly():
    shards = [ShardAudit([_sample("a", 95, 100, 0.1)]), ShardAudit([_sample("b", 40, 50, 0.5, rows=300)])]
    merged = merged_json([json.loads(json.dumps(s.to_json())) for s in shards])
    direct = ShardAudit([s.merged() for s in shards]).to_json()
    for key in ("rows", "greedy_rows", "norm_rows"):
        assert merged[key] == direct[key]
    for key in ("nll", "entropy", "nll_excess", "nll_excess_std", "agreement", "unnormed"):
        assert merged[key] == pytest.approx(direct[key], abs=1e-4)
    assert sums_from_json(merged).rows == 400


def test_audit_sample_counts_assistant_rows_and_greedy_agreement_from_the_engine_figures():
    ids = torch.tensor([5, 6, 7, 8, 9, 10])
    mask = torch.tensor([0, 0, 1, 1, 1, 0])  # rows 1..3 predict assistant tokens 7, 8, 9
    fig = RowFigures(torch.tensor([0, 1, 2, 3, 4]), torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]),
                     torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0]), torch.tensor([6, 7, 0, 9, 10]))
    got = audit_sample("s", ids, mask, fig, greedy=True)
    assert (got.rows, got.nll, got.entropy, got.greedy_rows, got.agree) == (3, 9.0, 3.0, 3, 2)
    assert audit_sample("s", ids, mask, fig, greedy=False).greedy_rows == 0


def test_the_aux_layers_rms_reads_a_few_audited_rows_a_sample_spread_over_it():
    """aux_rms is reported, not judged: it reads at most AUX_RMS_ROWS of the audited rows (the host's gather of
    [rows, 3H] bf16 was most of the audit's cost at the 8B shape), first and last among them, and each layer's
    mean RMS is still that layer's (here every row of layer k has RMS k + 1)."""
    n, hidden = 400, 8
    aux = torch.cat([torch.full((n, hidden), float(k + 1)) for k in range(3)], dim=-1).to(torch.bfloat16)
    aux[:, :hidden] *= torch.linspace(0.5, 1.5, n)[:, None].to(torch.bfloat16)  # layer 0's RMS varies over rows
    positions = torch.arange(0, n - 1, 3)  # 133 audited rows
    fig = RowFigures(positions, torch.ones(len(positions)), torch.ones(len(positions)), torch.zeros(len(positions), dtype=torch.long))
    got = audit_sample("s", torch.arange(n), torch.ones(n), fig, greedy=False, aux_hidden=aux)
    assert got.aux_rows == AUX_RMS_ROWS < len(positions)
    means = [v / got.aux_rows for v in got.aux_rms]
    assert means[1] == pytest.approx(2.0, rel=1e-2) and means[2] == pytest.approx(3.0, rel=1e-2)
    assert means[0] == pytest.approx(1.0, rel=0.05)  # evenly spread: the mean of 0.5 .. 1.5
    few = RowFigures(positions[:5], torch.ones(5), torch.ones(5), torch.zeros(5, dtype=torch.long))
    assert audit_sample("s", torch.arange(n), torch.ones(n), few, greedy=False, aux_hidden=aux).aux_rows == 5


def _record(sid: str, n: int = 6, hidden: int = 8) -> dict:
    return {"sample_id": sid, "input_ids": torch.arange(n, dtype=torch.int32), "loss_mask": torch.ones(n, dtype=torch.uint8),
            "aux_hidden": torch.zeros(n, 3 * hidden, dtype=torch.bfloat16),
            "last_hidden": torch.zeros(n, hidden, dtype=torch.bfloat16)}


def test_the_writer_commits_no_shard_the_audit_refuses_and_keeps_the_ones_before(tmp_path):
    meta = StoreMeta(hidden_size=8, aux_layers=[1, 2, 3], target_fingerprint="t", model_type="llama", vocab_size=64)

    def judge(name, notes):
        POLICY.check(f"shard {name}", ShardAudit(notes))
        return {"audit": ShardAudit(notes).to_json(), "greedy_ids": [n.sample_id for n in notes if n.greedy]}

    with FeatureStoreWriter(tmp_path, meta, writer_id="w", shard_max_bytes=None, on_shard=judge) as w:
        w.add(_record("ok-1"), _sample("ok-1", 95, 100, 0.1))
    with pytest.raises(AuditFailed, match=r"shard w-000001 fails"):
        with FeatureStoreWriter(tmp_path, meta, writer_id="w", shard_max_bytes=None, on_shard=judge) as w:
            w.add(_record("bad-1"), _sample("bad-1", 1, 100, 9.0))
    assert completed_ids(tmp_path) == {"ok-1"}
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == ["w-000000.done.json", "w-000000.safetensors"]
    marker = manifest(tmp_path)[0]
    assert marker["greedy_ids"] == ["ok-1"] and marker["audit"]["agreement"] == 0.95


def test_greedy_answers_carry_the_targets_fingerprint_into_the_prepared_rows(tmp_path):
    """generate's record -> read_samples -> prepare's TokenizeUDF (called in-process): greedy_by travels;
    a conversation mixing given and written answers is not marked."""
    from eagle3_ray.data.distill import _greedy_mark, _record
    from eagle3_ray.data.sources import Sample, read_samples
    from eagle3_ray.engines.targets import smollm2_dir
    from eagle3_ray.extract.udfs import TokenizeUDF

    user = [{"role": "user", "content": "Hi"}]
    answered = [*user, {"role": "assistant", "content": "Hello there."}]
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": "c1",
                                                                 "function": {"name": "f", "arguments": "{}"}}]}
    with_tools = [*user, call, {"role": "tool", "content": "42", "tool_call_id": "c1"}]  # ends on a result
    given = [(Sample("g", user, "f:1"), "fp123"),  # answered here, greedily
             (Sample("s#s1", user, "f:2"), ""),  # answered here, sampled
             (Sample("h", answered, "f:3", greedy_by="fp0"), "fp123"),  # passed through with its mark
             (Sample("t", with_tools, "f:4"), "fp123")]  # its tool call is the data's, the reply the target's
    lines = [_record(s, answered, _greedy_mark(s, by, False)) for s, by in given]
    path = tmp_path / "conversations.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    samples = list(read_samples(path))
    assert [s.greedy_by for s in samples] == ["fp123", "", "fp0", ""]
    udf = TokenizeUDF(str(smollm2_dir()), max_length=64, truncate=False)
    table = udf({"sample_id": np.array([s.sample_id for s in samples], dtype=object),
                 "messages": np.array([json.dumps(s.messages) for s in samples], dtype=object),
                 "source": np.array([s.source for s in samples], dtype=object),
                 "greedy_by": np.array([s.greedy_by for s in samples], dtype=object)})
    assert table.column("greedy_by").to_pylist() == ["fp123", "", "fp0", ""]


def test_the_sigma_bound_is_the_normal_bound():
    s = _sample("a", 0, 0, 1.6, rows=400)
    assert s.bound("nll_excess") == pytest.approx(1.6 - 3 * 2.5 / math.sqrt(400), abs=1e-9)
