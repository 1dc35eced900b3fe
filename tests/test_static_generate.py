"""StaticBatchGenerator (batched decoding on a preallocated KV cache, the step as a CUDA graph):
greedy output equal to transformers' ``generate`` with left padding and EOS, storage reuse across
batch shapes, the split of a call's prompts by length (plan_groups) and the shapes kept across
calls, sampling that follows the softmax / top-p, graph safety of the step (no host sync),
and the engine's use of it. The graph capture needs CUDA (run by benchmarks on the H200); off CUDA
the same step function runs eagerly."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaForCausalLM

import itertools
import random

from eagle3_ray.engines.static_generate import (
    GRAIN,
    KEEP_SHAPES,
    STEP_OVERHEAD_SLOTS,
    StaticBatchGenerator,
    plan_groups,
    unsupported_reason,
)
from eagle3_ray.errors import EngineError

from test_spec_static import NoHostSync


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tiny_llama_config):
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config).eval()


def _prompts(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _hf_greedy(model, prompts, n, eos, pad):
    """transformers generate, one prompt at a time (no padding at all), cut after the first EOS."""
    outs = []
    for p in prompts:
        out = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                             pad_token_id=pad)[0, len(p):].tolist()
        cut = next((i + 1 for i, t in enumerate(out) if t in eos), len(out))
        outs.append(out[:cut])
    return outs


def test_greedy_equals_generate_with_left_padding_eos_and_reused_storage(tiny):
    vocab = tiny.config.vocab_size
    prompts = _prompts([3, 17, 9, 30], vocab)
    free_run = _hf_greedy(tiny, prompts, 24, eos=[2], pad=2)
    # EOS ids that the free run produces mid-answer: rows must stop there, others go on.
    eos = [free_run[1][5], free_run[3][11]]
    ref = _hf_greedy(tiny, prompts, 24, eos=eos, pad=2)
    assert any(len(r) < 24 for r in ref) and any(len(r) == 24 for r in ref)  # the case is non-trivial
    gen = StaticBatchGenerator(tiny, eos, pad_id=2)
    assert gen.generate(prompts, 24) == ref
    # A second batch of another shape (new storage), then the first shape again.
    other = _prompts([40, 2], vocab, seed=1)
    assert gen.generate(other, 7) == _hf_greedy(tiny, other, 7, eos=eos, pad=2)
    assert gen.generate(prompts[::-1], 24) == ref[::-1]
    assert gen.captures == 0  # no graphs off CUDA
    # A KV budget of two rows: the batch runs in two groups, longest prompts first.
    small = StaticBatchGenerator(tiny, eos, pad_id=2, kv_budget_bytes=2 * gen.kv_bytes(1, 9 + 24))
    assert small._groups([3, 17, 9, 30], 24) == [[3, 1], [2, 0]]
    assert small.generate(prompts, 24) == ref
    with pytest.raises(EngineError, match="shorten the prompt"):
        StaticBatchGenerator(tiny, eos, pad_id=2, kv_budget_bytes=gen.kv_bytes(1, 20) // 2).generate(prompts, 24)


def test_smollm2_greedy_answers_equal_generate(smollm2):
    model, tok = smollm2
    chats = ["What is the capital of France?", "Write a haiku about the sea.", "2+2="]
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True) for c in chats]
    prompts = [p["input_ids"] if not isinstance(p, list) else p for p in prompts]
    eos = [tok.eos_token_id]
    gen = StaticBatchGenerator(model, eos, pad_id=tok.pad_token_id or tok.eos_token_id)
    assert gen.generate(prompts, 20) == _hf_greedy(model, prompts, 20, eos=eos, pad=eos[0])


def test_sampling_follows_temperature_and_top_p(tiny):
    prompt = _prompts([6], tiny.config.vocab_size)[0]
    with torch.no_grad():
        logits = tiny(torch.tensor([prompt])).logits[0, -1].float()
    gen = StaticBatchGenerator(tiny, [2], pad_id=2)
    rows, temp = 4000, 0.05  # a sharp softmax over the random model's logits
    probs = (logits / temp).softmax(-1)
    torch.manual_seed(0)
    first = torch.tensor([r[0] for r in gen.generate([prompt] * rows, 1, temperature=temp)])
    for t in probs.topk(3).indices.tolist():  # empirical frequency within 5 sigma of the softmax
        p = float(probs[t])
        assert abs(float((first == t).float().mean()) - p) < 5 * (p * (1 - p) / rows) ** 0.5 + 1e-3
    # top-p keeps the smallest prefix of likely tokens whose mass reaches p: here the first three.
    sorted_p, order = (logits / 0.1).softmax(-1).sort(descending=True)
    top_p = float(sorted_p[:2].sum() + sorted_p[2] / 2)
    torch.manual_seed(1)
    nucleus = {r[0] for r in gen.generate([prompt] * 500, 1, temperature=0.1, top_p=top_p)}
    assert nucleus <= set(order[:3].tolist()) and len(nucleus) > 1
    # Seeded: the same draw twice; a tiny top-p is greedy.
    torch.manual_seed(3)
    a = gen.generate([prompt] * 4, 8, temperature=1.0)
    torch.manual_seed(3)
    assert gen.generate([prompt] * 4, 8, temperature=1.0) == a
    assert gen.generate([prompt], 8, temperature=1.0, top_p=1e-6) == gen.generate([prompt], 8)


def test_the_decode_step_has_no_host_sync(tiny):
    gen = StaticBatchGenerator(tiny, [2], pad_id=2)
    prompts = _prompts([4, 9], tiny.config.vocab_size)
    gen.generate(prompts, 3)  # leaves a batch state behind
    with torch.inference_mode(), NoHostSync():
        gen._step(gen._batch, 0.0, 1.0)
        gen._step(gen._batch, 0.8, 0.9)


def test_user_errors_and_unsupported_models(tiny, tiny_llama_config):
    with pytest.raises(EngineError, match="non-empty prompts"):
        StaticBatchGenerator(tiny, [2], pad_id=2).generate([[5], []], 4)
    eager = LlamaForCausalLM(copy.deepcopy(tiny_llama_config)).eval()  # the model holds its config: copy it
    eager.config._attn_implementation = "flash_attention_2"  # not maskable: generate's job then
    assert "attn_implementation" in unsupported_reason(eager)
    with pytest.raises(EngineError, match="use model.generate"):
        StaticBatchGenerator(eager, [2], pad_id=2)


def test_decode_attention_reads_grouped_heads_without_repeating_them():
    from transformers.integrations.sdpa_attention import repeat_kv

    from eagle3_ray.engines.static_generate import _decode_sdpa

    class Attn(torch.nn.Module):
        num_key_value_groups, is_causal = 3, True

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=g) for s in ((4, 6, 1, 8), (4, 2, 10, 8), (4, 2, 10, 8)))
    visible = torch.arange(10)[None] < torch.tensor([3, 10, 7, 1])[:, None]  # [B, S] per-row lengths
    mask = torch.zeros(4, 10).masked_fill(~visible, torch.finfo(torch.float32).min)[:, None, None]
    out, _ = _decode_sdpa(Attn(), q, k, v, mask, scaling=0.3)
    ref = torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k, 3), repeat_kv(v, 3), attn_mask=mask,
                                                           scale=0.3).transpose(1, 2)
    assert out.shape == (4, 1, 6, 8) and torch.allclose(out, ref, atol=1e-6)


def _plan_cost(groups, lengths, max_new, overhead):
    storage = lambda n: -(-(n + max_new) // GRAIN) * GRAIN  # noqa: E731
    return sum(len(g) * max(storage(lengths[i]) for i in g) + overhead for g in groups)


def test_plan_groups_keeps_one_long_prompt_from_widening_every_row():
    # The product's case: 512 prompts of ~100 tokens and one of 11,000 (SmolLM2 prompt sets have
    # such tails). One group would attend over an 11,264-slot storage for all 512 rows each step.
    lengths = [90 + i % 40 for i in range(511)] + [11_000]
    groups = plan_groups(lengths, 256)
    assert groups == [[511], sorted(range(511), key=lambda i: -lengths[i])]
    # Prompts of similar lengths stay one batch (a split would only add steps' fixed cost).
    assert len(plan_groups([60, 300, 120, 200], 256)) == 1
    assert plan_groups([], 8) == []


def test_plan_groups_is_the_cheapest_split_into_runs():
    rng = random.Random(0)
    for _ in range(40):
        lengths = [rng.choice([5, 40, 300, 700, 2000, 5000]) + rng.randrange(30) for _ in range(rng.randrange(1, 8))]
        overhead = rng.choice([0, 512, 4096, STEP_OVERHEAD_SLOTS])
        groups = plan_groups(lengths, 64, overhead)
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        assert [i for g in groups for i in g] == order  # longest first, every prompt once
        best = min(
            _plan_cost([order[a:b] for a, b in zip((0, *cuts), (*cuts, len(order)))], lengths, 64, overhead)
            for k in range(len(order))
            for cuts in itertools.combinations(range(1, len(order)), k)
        )
        assert _plan_cost(groups, lengths, 64, overhead) == best


def test_split_groups_and_kept_shapes_answer_as_generate(tiny):
    vocab = tiny.config.vocab_size
    prompts = _prompts([3, 300, 9, 12], vocab, seed=2)
    ref = _hf_greedy(tiny, prompts, 6, eos=[2], pad=2)
    # No fixed step cost: every storage length is its own group (the 300-token prompt alone).
    gen = StaticBatchGenerator(tiny, [2], pad_id=2, step_overhead_slots=0)
    assert gen._groups([len(p) for p in prompts], 6) == [[1], [3, 2, 0]]
    assert gen.generate(prompts, 6) == ref
    assert gen.builds == 2
    # Alternating calls (the two turns of multi-turn batches) reuse their kept states.
    short = prompts[2:]
    for _ in range(3):
        assert gen.generate(short, 6) == [ref[2], ref[3]]
        assert gen.generate(prompts, 6) == ref
    assert gen.builds == 3  # + the 2-row shape, built once
    # Beyond KEEP_SHAPES the least recently used shape goes.
    for rows in range(1, KEEP_SHAPES + 2):
        gen.generate(prompts[:1] * rows, 6)
    assert len(gen._batches) == KEEP_SHAPES and gen._batch.key[0] == KEEP_SHAPES + 1
    # A KV budget that holds one shape at a time: the old storage is freed before the new one.
    one = StaticBatchGenerator(tiny, [2], pad_id=2, kv_budget_bytes=gen.kv_bytes(4, 12 + 6))
    one.generate(short, 6)
    one.generate(prompts[2:] * 2, 6)
    assert len(one._batches) == 1 and one._batch.key[0] == 4
