"""The target's aux states are HF ``hidden_states[k]`` under every transformers the project meets.

A selective ``output_hidden_states=[k, ...]`` means ``hidden_states[k]`` in transformers 5.24 (this
environment) and ``hidden_states[k + 1]`` in 5.17 (the H200 image's): there every capture (the HF
engine's features, the StaticTarget's and the TargetRunner's aux states) was one layer deeper than its
ids said, and nothing here could see it. Each check below compares the three captures with a full
``output_hidden_states=True`` forward of the same tokens, in this environment and in a subprocess that
imports transformers 5.17 from ``.deps/transformers-5.17`` (``make transformers-5.17``, part of
``make setup-dev``), which must report the other offset: the test fails if that transformers is absent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEPS_517 = ROOT / ".deps" / "transformers-5.17"
AUX = [1, 3, 7]

CHECK = r'''
import json, sys
import torch, transformers
from eagle3_ray.config import TargetConfig
from eagle3_ray.engines.hf import HFEngine
from eagle3_ray.decode.static import StaticTarget
from eagle3_ray.decode.target import TargetRunner

aux = json.loads(sys.argv[1])
eng = HFEngine(TargetConfig(model="random:builtin:tiny-llama", aux_layers=aux, dtype="float32"), device="cpu")
model = eng.target.model
ids = torch.arange(5, 25)
with torch.inference_mode():
    full = model(input_ids=ids[None], output_hidden_states=True).hidden_states
    want = torch.cat([full[k][0] for k in aux], -1)
    engine_aux, _ = eng.forward_states(ids[None], torch.ones(1, ids.shape[0], dtype=torch.long))
    runner = TargetRunner(model, aux)
    runner_aux = torch.cat([runner.forward(ids[:12]).aux, runner.forward(ids[12:]).aux])
    static = StaticTarget(model, aux, max_length=64, prefill_width=8).runner(aux)
    static_aux = torch.cat([static.forward(ids[:12]).aux, static.forward(ids[12:]).aux])
err = lambda a: float((a - want).abs().max() / want.abs().max())
print(json.dumps({"transformers": transformers.__version__, "offset": eng._select.offset,
                  "engine": err(engine_aux[0]), "runner": err(runner_aux), "static": err(static_aux)}))
'''


def _check(env: dict[str, str] | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", CHECK, json.dumps(AUX)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _assert_exact(result: dict) -> None:
    # fp32, the same tokens: only the order of floating-point sums differs between the forwards.
    for capture in ("engine", "runner", "static"):
        assert result[capture] < 1e-4, f"{capture} aux states are not hidden_states{AUX}: {result}"


def test_captures_are_the_named_hidden_states_in_this_environment():
    import transformers

    result = _check()
    assert result["transformers"] == transformers.__version__
    _assert_exact(result)


def test_captures_are_the_named_hidden_states_under_transformers_5_17():
    assert (DEPS_517 / ".installed").is_file(), (
        f"{DEPS_517} is missing: run `make transformers-5.17` (part of `make setup-dev`)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(DEPS_517), str(ROOT)]))
    result = _check(env)
    assert result["transformers"] == "5.17.0", result
    assert result["offset"] == 1, f"5.17's selective capture is one layer deeper; detected {result}"
    _assert_exact(result)


def test_hidden_state_offset_is_measured_once_per_model(tiny_llama_config):
    import torch
    from transformers import LlamaForCausalLM

    from eagle3_ray.engines.hidden_states import HiddenStateSelection, hidden_state_offset

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config).eval()
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    first = hidden_state_offset(model)
    assert len(calls) == 2 and hidden_state_offset(model) == first and len(calls) == 2
    select = HiddenStateSelection(model, [2, 5])
    with torch.inference_mode():
        full = model(input_ids=torch.tensor([[3, 4, 5]]), output_hidden_states=True).hidden_states
        picked = select.take(model(input_ids=torch.tensor([[3, 4, 5]]), output_hidden_states=select.request).hidden_states)
    for k, h in zip([2, 5], picked):
        torch.testing.assert_close(h, full[k])
