"""HFEngine: captured states are exactly HF's hidden_states / lm_head input; generation is greedy-exact."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from eagle3_ray.config import TargetConfig
from eagle3_ray.engines.base import TargetEngine
from eagle3_ray.engines.hf import HFEngine, cut_at_eos, plan_groups
from eagle3_ray.errors import ConfigError, EngineError

_SMALL = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              bos_token_id=1, eos_token_id=2, pad_token_id=2)
RANDOM_CONFIGS = {
    "qwen2": dict(_SMALL, model_type="qwen2", tie_word_embeddings=True),
    "deepseek_v3": dict(
        _SMALL, model_type="deepseek_v3", num_key_value_heads=4, moe_intermediate_size=32,
        first_k_dense_replace=1, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
        topk_group=1, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        tie_word_embeddings=False,
    ),
}
SEQS = [[1, 17, 300, 4000, 9, 9, 120], [5, 6], [7] * 13, [49151, 0, 42]]


def _random_spec(tmp_path_factory, model_type: str) -> str:
    if model_type == "llama":
        return "random:builtin:tiny-llama"
    path = tmp_path_factory.mktemp(model_type) / "config.json"
    path.write_text(json.dumps(RANDOM_CONFIGS[model_type]))
    return f"random:{path}"


@pytest.fixture(scope="module", params=["llama", "qwen2", "deepseek_v3"])
def engine(request, tmp_path_factory, smollm2_dir):
    eng = HFEngine(TargetConfig(model=_random_spec(tmp_path_factory, request.param), seed=3), device="cpu")
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def smol_engine(smollm2_dir):
    eng = HFEngine(TargetConfig(model=str(smollm2_dir)), device="cpu")
    yield eng
    eng.close()


def _reference(model, ids: list[int], aux_layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent full CausalLM forward: HF hidden_states[k] and the lm_head input (by hook)."""
    seen = {}
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: seen.setdefault("x", args[0]))
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        hook.remove()
    aux = torch.cat([out.hidden_states[k][0] for k in aux_layers], dim=-1)  # [T, 3H]
    return aux, seen["x"][0]  # [T, H]


# Capture vs reference tolerance. A padded batch runs the same fp32 math as a lone sequence but with
# other matmul shapes, so BLAS may sum each dot product (length K = 576..1536 for SmolLM2) in another
# order. Reordering a fp32 sum changes it by a few units of fp32 rounding of its largest terms, and
# the residual stream carries that error, not multiplies it: measured on SmolLM2 (30 layers, whose
# outlier channels reach 2.2e4) the worst element is 5 eps of its row's largest magnitude. The bound
# is 64 eps of the row's max |value|: 13x that, and ~1e4x below the gap to a neighbouring layer's
# states (checked below, so a wrong layer cannot pass). A lone sequence runs the reference's exact
# shapes and order: there the capture must be bit-exact.
ROW_TOL = 64 * torch.finfo(torch.float32).eps


def assert_rows_close(got: torch.Tensor, ref: torch.Tensor, what: str) -> float:
    """|got - ref| <= ROW_TOL * max|ref row| element-wise; returns the worst ratio to the row scale."""
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    scale = ref.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    worst = ((got - ref).abs() / scale).max().item()
    assert worst <= ROW_TOL, f"{what}: error {worst / ROW_TOL * 64:.1f} eps of the row scale (allowed 64)"
    return worst


def _assert_capture_matches(eng: HFEngine, seqs: list[list[int]], bit_exact_alone: bool = False) -> None:
    caps = eng.capture(seqs)
    assert len(caps) == len(seqs)
    for ids, cap in zip(seqs, caps):
        aux, last = _reference(eng.target.model, ids, eng.info.aux_layers)
        assert cap.aux_hidden.shape == (len(ids), 3 * eng.info.hidden_size)
        assert cap.last_hidden.shape == (len(ids), eng.info.hidden_size)
        assert cap.aux_hidden.device.type == "cpu" and cap.aux_hidden.dtype == torch.float32
        assert_rows_close(cap.aux_hidden, aux, "aux_hidden")
        assert_rows_close(cap.last_hidden, last, "last_hidden")
        if bit_exact_alone:
            (lone,) = eng.capture([ids])
            assert torch.equal(lone.aux_hidden, aux) and torch.equal(lone.last_hidden, last)


def test_engine_implements_protocol_with_default_aux_layers(engine):
    assert isinstance(engine, TargetEngine)
    assert engine.info.num_layers == 8
    assert engine.info.aux_layers == [2, 4, 5]  # [2, L//2, L-3]
    assert engine.info.hidden_size == 64 and engine.info.vocab_size == 49152
    assert engine.info.dtype == "float32"


def test_capture_equals_hf_hidden_states_and_lm_head_input(engine):
    _assert_capture_matches(engine, SEQS)


def test_capture_with_configured_aux_layers(smollm2_dir):
    eng = HFEngine(TargetConfig(model="random:builtin:tiny-llama", aux_layers=[1, 3, 7]), device="cpu")
    assert eng.info.aux_layers == [1, 3, 7]
    _assert_capture_matches(eng, SEQS[:2])


def test_batching_and_padding_do_not_change_results(engine):
    alone = [engine.capture([s])[0] for s in SEQS]
    engine.batch_tokens = 16  # forces several padded groups, and the 13-token sequence nearly alone
    try:
        batched = engine.capture(SEQS)
    finally:
        engine.batch_tokens = 8192
    for a, b, ids in zip(alone, batched, SEQS):
        assert b.aux_hidden.shape[0] == len(ids)
        assert_rows_close(b.aux_hidden, a.aux_hidden, "aux_hidden")
        assert_rows_close(b.last_hidden, a.last_hidden, "last_hidden")


def test_concurrent_captures_from_threads_equal_sequential(engine):
    # Ray Data runs up to extract.concurrent_batches capture calls of one actor in threads.
    batches = [SEQS[:2], SEQS[2:], SEQS[1:3]]
    sequential = [engine.capture(b) for b in batches]
    with ThreadPoolExecutor(max_workers=3) as pool:
        threaded = list(pool.map(engine.capture, batches))
    for seq_caps, thr_caps in zip(sequential, threaded):
        for a, b in zip(seq_caps, thr_caps):
            torch.testing.assert_close(b.aux_hidden, a.aux_hidden, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(b.last_hidden, a.last_hidden, atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the pinned, per-thread-stream capture path")
def test_cuda_capture_lands_in_pinned_host_memory_and_matches_default_stream(smollm2_dir):
    eng = HFEngine(TargetConfig(model="random:builtin:tiny-llama", dtype="bfloat16"), device="cuda")
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            caps = [c for b in pool.map(eng.capture, [SEQS[:2], SEQS[2:]]) for c in b]
        for ids, cap in zip(SEQS, caps):
            assert cap.aux_hidden.device.type == "cpu" and cap.aux_hidden.is_pinned()
            assert cap.aux_hidden.dtype == torch.bfloat16 and cap.last_hidden.shape == (len(ids), 64)
            with torch.inference_mode():  # the plain default-stream forward, one sequence at a time
                aux, last = eng.forward_states(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
            torch.testing.assert_close(cap.aux_hidden, aux[0].cpu(), atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(cap.last_hidden, last[0].cpu(), atol=2e-2, rtol=2e-2)
    finally:
        eng.close()


def test_plan_groups_respects_budget_and_covers_every_index():
    lengths = [5, 40, 3, 3, 12, 100, 7]
    groups = plan_groups(lengths, batch_tokens=30)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        longest = max(lengths[i] for i in g)
        assert lengths[g[0]] == longest
        assert len(g) * longest <= 30 or len(g) == 1
    assert [5] in groups and [1] in groups  # longer than the budget: alone
    assert plan_groups([4, 4, 4], batch_tokens=8) == [[0, 1], [2]]  # ties keep input order


def test_out_of_range_aux_layers_raise_config_error(smollm2_dir):
    # hidden_states[L] is post-norm in HF but raw in SGLang/vLLM: the last valid id is L-1 (= 7 here).
    with pytest.raises(ConfigError, match=r"\[1, 7\]"):
        HFEngine(TargetConfig(model="random:builtin:tiny-llama", aux_layers=[2, 4, 8]), device="cpu")


def test_capture_rejects_bad_token_ids(engine):
    with pytest.raises(EngineError, match="49152"):
        engine.capture([[1, 2], [49152]])
    with pytest.raises(EngineError, match="non-empty"):
        engine.capture([[]])
    with pytest.raises(EngineError, match="batch_tokens"):
        HFEngine(TargetConfig(model="random:builtin:tiny-llama"), batch_tokens=0)


@pytest.fixture(params=["transformers", "static"])
def generate_path(request, engine):
    """generate() through transformers' generate, then through the StaticBatchGenerator (CUDA's default)."""
    engine.static_generate = request.param == "static"
    yield request.param
    engine.static_generate = False


def test_greedy_generate_equals_per_prompt_generate(engine, generate_path):
    prompts = [[1, 17, 300, 4000], [5, 6], [7, 8, 9, 10, 11, 12]]
    got = engine.generate(prompts, max_new_tokens=6)
    if generate_path == "static" and engine.info.model_type != "deepseek_v3":
        assert engine._static_gen is not None  # it really ran (MLA targets fall back to transformers)
    model = engine.target.model
    for prompt, out in zip(prompts, got):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=2, pad_token_id=2)
        assert out == cut_at_eos(ref[0, len(prompt):].tolist(), {2})


def test_sampling_is_seeded_and_leaves_global_rng_alone(engine, generate_path):
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = engine.generate([[1, 2, 3]], max_new_tokens=8, temperature=1.0, seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    assert a == engine.generate([[1, 2, 3]], max_new_tokens=8, temperature=1.0, seed=7)
    assert a != engine.generate([[1, 2, 3]], max_new_tokens=8, temperature=1.0, seed=8)
    with pytest.raises(EngineError, match="temperature"):
        engine.generate([[1]], max_new_tokens=4, temperature=-1.0)


def test_cut_at_eos_keeps_first_eos_and_drops_padding():
    assert cut_at_eos([5, 6, 2, 2, 2], {2}) == [5, 6, 2]
    assert cut_at_eos([5, 2, 7, 9], {2, 9}) == [5, 2]
    assert cut_at_eos([5, 6], {2}) == [5, 6]


def test_smollm2_capture_is_exact_with_default_layers(smol_engine):
    tok = smol_engine.tokenizer
    assert smol_engine.info.aux_layers == [2, 15, 27]
    texts = ["The capital of France is", "def fib(n):\n    return"]
    seqs = [tok(t)["input_ids"] for t in texts]
    assert len(set(map(len, seqs))) > 1  # one padded batch of different lengths
    _assert_capture_matches(smol_engine, seqs, bit_exact_alone=True)
    # The tolerance still tells the layers apart: each aux block against its neighbours' states.
    with torch.no_grad():
        states = smol_engine.target.model(torch.tensor([seqs[1]]), output_hidden_states=True).hidden_states
    (cap,) = smol_engine.capture([seqs[1]])
    H = smol_engine.info.hidden_size
    for j, k in enumerate(smol_engine.info.aux_layers):
        block = cap.aux_hidden[:, j * H:(j + 1) * H]
        for wrong in (k - 1, k + 1):
            with pytest.raises(AssertionError, match="eps of the row scale"):
                assert_rows_close(block, states[wrong][0], f"aux {k} vs hidden_states[{wrong}]")


def test_smollm2_batched_chat_generation_matches_and_stops_at_im_end(smol_engine):
    tok = smol_engine.tokenizer
    assert tok.eos_token == "<|im_end|>" and smol_engine.eos_ids == {2}
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]
        for q in ("What is 2+2?", "Write a long poem about the sea.")
    ]
    got = smol_engine.generate(prompts, max_new_tokens=16)
    assert got[0][-1] == 2 and 2 not in got[0][:-1]  # stopped at <|im_end|> and kept it
    assert len(got[1]) == 16 and 2 not in got[1]  # unfinished: no pad (= <|im_end|>) tokens
    for prompt, out in zip(prompts, got):
        with torch.no_grad():
            ref = smol_engine.target.model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
        assert out == cut_at_eos(ref[0, len(prompt):].tolist(), {2})
