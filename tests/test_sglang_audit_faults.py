"""The SGLang fault hooks of the capture audit (tests/sglang_audit_faults.py, issue 61) break the rows the way
the HF engine's switches do (tests/audit_faults.py), request by request in SGLang's packed layout, and go
ahead of the capture's own hooks in the engine's kwargs. The hooks run here on real torch modules through
torch's own hook registry; SGLang's engine cannot run without CUDA (the GPU run: benchmarks/capture_audit.py
--backend sglang --faults); tests/sglang_contract/test_audit_fault_hooks.py pins the SGLang signatures they
rely on."""

from __future__ import annotations

import pytest
import torch

import sglang_audit_faults as sf
from eagle3_ray.engines import sglang_hooks
from eagle3_ray.engines.sglang_args import engine_kwargs
from eagle3_ray.engines.sglang_modules import sglang_module_paths


class TextModel(torch.nn.Module):
    """Stands in for SGLang's text model only in its call signature: forward(input_ids, positions,
    forward_batch) -> rows [N, H] (here the rows are given as input_ids' embedding, a fixed table)."""

    def __init__(self, hidden: int = 4):
        super().__init__()
        self.table = torch.arange(64 * hidden, dtype=torch.float32).view(64, hidden)

    def forward(self, input_ids, positions, forward_batch):
        return self.table[input_ids]


def _run(fault: str, config: dict | None = None):
    model = TextModel()
    model.register_forward_hook(sf.model_fault_factory({"fault": fault, **(config or {})}))
    lens = [5, 3]  # two requests packed one after the other, as SGLang lays out an extend batch
    positions = torch.cat([torch.arange(n) for n in lens])
    ids = torch.arange(sum(lens))
    return model.table[ids], model(ids, positions, None), lens


@pytest.mark.parametrize("fault", ["late", "early"])
def test_a_shift_stays_inside_each_request_as_the_hf_switch_does_per_sample(fault):
    import audit_faults

    rows, got, lens = _run(fault)
    start = 0
    for n in lens:  # the HF switch on each request as its own [1, T, H] sample
        sample = rows[start:start + n][None]
        want = {"late": torch.cat([sample[:, :1], sample[:, :-1]], 1),
                "early": torch.cat([sample[:, 1:], sample[:, -1:]], 1)}[fault][0]
        assert torch.equal(got[start:start + n], want), (fault, start)
        start += n
    assert hasattr(audit_faults, fault)  # the same fault names on both engines


def test_prefix_zero_zeroes_each_requests_first_rows():
    rows, got, _ = _run("prefix_zero")
    assert got.abs().sum() == 0  # every row of these short requests is below PREFIX_K
    model = TextModel()
    model.register_forward_hook(sf.model_fault_factory({"fault": "prefix_zero"}))
    positions = torch.cat([torch.arange(20), torch.arange(18)])
    out = model(torch.arange(38) % 64, positions, None)
    assert torch.equal((out.abs().sum(-1) == 0), positions < sf.PREFIX_K)


def test_aux_as_last_hands_on_the_rows_the_capture_layer_hook_parked(tmp_path):
    parked = torch.full((8, 4), 7.0)
    sglang_hooks._LAYER_ROWS.setdefault(str(tmp_path), {})[2] = parked
    try:
        _, got, _ = _run("aux_as_last", {"dir": str(tmp_path), "last_slot": 2})
    finally:
        sglang_hooks._LAYER_ROWS.pop(str(tmp_path), None)
    assert torch.equal(got, parked)
    with pytest.raises(RuntimeError, match="no aux rows parked"):
        _run("aux_as_last", {"dir": str(tmp_path), "last_slot": 2})


def test_half_sum_is_one_of_two_ranks_shares_of_a_row_parallel_linear():
    class RowParallel(torch.nn.Linear):  # SGLang's RowParallelLinear returns (output, bias)
        def forward(self, x):
            return super().forward(x), None

    torch.manual_seed(0)
    lin = RowParallel(8, 6, bias=False)
    x = torch.randn(5, 8)
    whole = lin(x)[0]
    lin.register_forward_hook(sf.half_share_factory({}))
    half, bias = lin(x)
    other = torch.nn.functional.linear(x[:, 4:], lin.weight[:, 4:])
    assert bias is None and torch.allclose(half + other, whole, atol=1e-6)  # the all-reduce it skipped
    assert not torch.allclose(half, whole, atol=1e-3)


def test_the_fault_hooks_go_ahead_of_the_capture_hooks_on_the_modules_sglang_builds(tmp_path, smollm2_dir):
    from eagle3_ray.config import TargetConfig
    from eagle3_ray.engines.describe import describe_target

    target = TargetConfig(model=str(smollm2_dir), backend="sglang")
    info = describe_target(target)
    kwargs = engine_kwargs(target, "capture", info=info, capture_dir=tmp_path, fields=frozenset(), audit_share=0.1)
    paths = sglang_module_paths(info.architectures, {})
    built = {}

    def fake_engine(**kw):  # a FAKE sglang.Engine: records the kwargs it is built with
        built.update(kw)
        return "engine"

    capture = list(kwargs["forward_hooks"])
    for fault in sf.FAULTS:
        assert sf.faulty_factory(fault, paths, info.num_layers, fake_engine)(**kwargs) == "engine"
        hooks = built["forward_hooks"]
        assert hooks[len(hooks) - len(capture):] == capture  # the capture's hooks unchanged, after the fault's
        first = hooks[0]
        if fault == "half_sum":
            last = f"model.layers.{info.num_layers - 1}"
            assert first["target_modules"] == [f"{last}.self_attn.o_proj", f"{last}.mlp.down_proj"]
        else:
            assert first["target_modules"] == ["model"] and first["config"]["dir"] == str(tmp_path)
            assert first["config"]["last_slot"] == len(info.aux_layers) - 1
    with pytest.raises(ValueError, match="unknown fault"):
        sf.fault_specs("sideways", capture, "model", "model.layers.0")
