"""What tests/sglang_audit_faults.py (the capture audit's faults inside an SGLang engine, issue 61) relies on
in SGLang's own Llama source: the text model is called with the positions second and returns the final
norm's rows (the hook on ``model`` changes what ``logits_processor`` gets), and the last layer's o_proj and
down_proj are row-parallel linears returning (output, bias)."""

from __future__ import annotations

import ast

from test_contract import _method  # noqa: E402

LLAMA = "models/llama.py"


def _calls(fn: ast.AST, callee: str) -> list[ast.Call]:
    return [c for c in ast.walk(fn) if isinstance(c, ast.Call) and ast.unparse(c.func) == callee]


def test_the_text_model_gets_the_positions_second_and_hands_its_rows_to_the_logits_processor():
    args = [a.arg for a in _method(LLAMA, "LlamaModel", "forward").args.args][1:]
    assert args[:3] == ["input_ids", "positions", "forward_batch"]
    causal = _method(LLAMA, "LlamaForCausalLM", "forward")
    calls = _calls(causal, "self.model")
    assert calls and all([ast.unparse(a) for a in c.args[:3]] == ["input_ids", "positions", "forward_batch"]
                         for c in calls)
    body = ast.unparse(causal)
    assert "hidden_states = self.model(" in body and "self.logits_processor(" in body
    model = _method(LLAMA, "LlamaModel", "forward")
    assert "self.norm" in ast.unparse(model)  # applied in forward (0.5.17 directly, 0.5.23 through a helper)
    returns = {ast.unparse(r.value) for r in ast.walk(model) if isinstance(r, ast.Return) and r.value is not None}
    # the rows alone, or (rows, aux states): the hook changes the rows either way (a PP proxy is no forward of ours)
    assert {"hidden_states", "(hidden_states, aux_hidden_states)"} <= returns


def test_o_proj_and_down_proj_return_output_and_bias():
    attn = ast.unparse(_method(LLAMA, "LlamaAttention", "forward"))
    mlp = ast.unparse(_method(LLAMA, "LlamaMLP", "forward"))
    assert "output, _ = self.o_proj(attn_output)" in attn
    assert "x, _ = self.down_proj(x)" in mlp
