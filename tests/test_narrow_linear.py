"""The CPU verify forward's narrow linear (decode/narrow_linear.py): the same function as ``F.linear``
within fp32 rounding, taken by a target forward of 2..NARROW_MAX_ROWS new tokens on the CPU and by
no other forward (plain decoding, a longer prompt), and decoding through it stays lossless."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from eagle3_ray.decode import generate, prepare_drafter, target_generate
from eagle3_ray.decode import narrow_linear as nl
from eagle3_ray.decode.target import TargetRunner
from eagle3_ray.drafter.model import DrafterConfig, Eagle3Drafter

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_narrow_linear_is_linear_within_fp32_rounding():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    for shape in [(1, 4, 64), (3, 64), (2, 5, 64)]:
        x = torch.randn(*shape, generator=g)
        out = nl.narrow_linear(x, w, b)
        assert out.shape == (*shape[:-1], 96) and out.is_contiguous()
        torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(nl.narrow_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_only_a_cpu_forward_of_a_few_new_tokens_takes_it(tiny_llama_config, monkeypatch):
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config).eval()
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    calls = []
    real = nl.narrow_linear
    monkeypatch.setattr(nl, "narrow_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    runner = TargetRunner(model, [1, 2])
    with torch.inference_mode():
        runner.forward(torch.arange(3, 4 + nl.NARROW_MAX_ROWS))  # a prompt of more rows: torch's path
        runner.forward(torch.tensor([5]))  # a plain decoding step
        assert calls == []
        before = runner.forward(torch.tensor([6, 7, 8, 9])).logits
        assert len(calls) == linears and {shape[:-1] for shape in calls} == {(1, 4)}  # every linear, 4 rows
        runner.crop(runner.length - 4)
        with monkeypatch.context() as m:
            m.setattr(nl, "NARROW_MAX_ROWS", 1)  # torch's own path, for the reference
            torch.testing.assert_close(runner.forward(torch.tensor([6, 7, 8, 9])).logits, before,
                                       rtol=1e-4, atol=1e-4)
        runner.forward(torch.arange(3, 4 + nl.NARROW_MAX_ROWS))  # over the cap again
    assert len(calls) == linears
    assert nl.narrow_rows(torch.device("meta"), 4).__class__.__name__ == "nullcontext"  # other devices: as is


def test_decoding_through_it_equals_plain_greedy_decoding(tiny_llama_config):
    torch.manual_seed(0)
    target = LlamaForCausalLM(tiny_llama_config).eval()
    layers = tiny_llama_config.num_hidden_layers
    cfg = DrafterConfig.from_target(tiny_llama_config, tiny_llama_config.vocab_size, [1, layers // 2, layers - 1])
    torch.manual_seed(1)
    drafter = prepare_drafter(Eagle3Drafter(cfg).eval(), target)
    prompt = torch.randint(3, tiny_llama_config.vocab_size, (12,), generator=torch.Generator().manual_seed(2))
    plain, _ = target_generate(target, prompt, 24, eos_token_id=[])
    for mode, opts in (("chain", {"num_steps": 5}), ("tree", {"topk": 3, "depth": 3, "total_tokens": 8})):
        tokens, _ = generate(target, drafter, prompt, 24, mode=mode, eos_token_id=[], **opts)
        assert tokens == plain, mode
