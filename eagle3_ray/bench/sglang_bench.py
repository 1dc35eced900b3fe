"""EAGLE-3 speculative decoding on SGLang vs plain SGLang decoding, per prompt category. No Ray in here.

Two engines run one after the other on the same GPUs (each holds the whole KV-cache budget): a
baseline (``engine_kwargs(mode="generate")``) and one with ``speculative_algorithm="EAGLE3"`` and the
exported drafter (``mode="spec"``, shape from ``cfg.bench``). Every conversation is replayed turn by
turn at batch size 1, each engine answering from its own history, as MT-bench measures latency.

tau = completion_tokens / spec_verify_ct (SGLang's ``spec_accept_length``, bonus token included),
totalled over turns; tokens/s = completion tokens / wall seconds of the generate calls.
Call it in a process that owns ``target.tp_size`` GPUs (e.g. inside a Ray task with num_gpus=tp).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from eagle3_ray.config import PipelineConfig
from eagle3_ray.engines.sglang import check_server_args, engine_kwargs, generate_sampling, import_sglang

Turn = dict[str, Any]  # {"completion_tokens", "seconds", "spec_verify_ct" (spec runs)}


def turn_record(out: dict[str, Any], seconds: float) -> Turn:
    """One generate() output of SGLang reduced to what the benchmark totals."""
    meta = out["meta_info"]
    return {
        "completion_tokens": int(meta["completion_tokens"]),
        "spec_verify_ct": int(meta["spec_verify_ct"]) if "spec_verify_ct" in meta else None,
        "seconds": seconds,
    }


def summarize_turns(turns: list[Turn]) -> dict[str, Any]:
    """tau, tokens/s and totals of a list of turns (None where a quantity is absent)."""
    tokens = sum(t["completion_tokens"] for t in turns)
    seconds = sum(t["seconds"] for t in turns)
    verified = [t for t in turns if t.get("spec_verify_ct")]
    verify_ct = sum(t["spec_verify_ct"] for t in verified)
    return {
        "tau": sum(t["completion_tokens"] for t in verified) / verify_ct if verify_ct else None,
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "completion_tokens": tokens,
        "spec_verify_ct": verify_ct if verified else None,
        "seconds": seconds,
        "turns": len(turns),
    }


def summarize_run(per_category: dict[str, list[Turn]], baseline: dict[str, Any] | None = None) -> dict[str, Any]:
    """Overall and per-category summaries; ``speedup`` divides by the baseline's tokens/s."""

    def speedup(row: dict[str, Any], base: dict[str, Any] | None) -> float | None:
        tps, base_tps = row["tokens_per_s"], (base or {}).get("tokens_per_s")
        return tps / base_tps if tps and base_tps else None

    cats = {cat: summarize_turns(turns) for cat, turns in per_category.items()}
    overall = summarize_turns([t for turns in per_category.values() for t in turns])
    if baseline is not None:
        for cat, row in cats.items():
            row["speedup"] = speedup(row, baseline["per_category"].get(cat))
        overall["speedup"] = speedup(overall, baseline)
    return {**overall, "per_category": cats}


def replay(
    answer: Callable[[list[int]], tuple[list[int], Turn]],
    render: Callable[[list[dict[str, str]]], list[int]],
    decode: Callable[[list[int]], str],
    prompt_sets: dict[str, list[list[str]]],
) -> dict[str, list[Turn]]:
    """Answer every conversation turn by turn; the model's own replies become its history."""
    out: dict[str, list[Turn]] = {}
    for cat, conversations in prompt_sets.items():
        out[cat] = []
        for turns in conversations:
            messages: list[dict[str, str]] = []
            for text in turns:
                messages.append({"role": "user", "content": text})
                new_ids, record = answer(render(messages))
                messages.append({"role": "assistant", "content": decode(new_ids)})
                out[cat].append(record)
    return out


def _timed_answer(engine: Any, sampling: dict[str, Any]) -> Callable[[list[int]], tuple[list[int], Turn]]:
    def answer(ids: list[int]) -> tuple[list[int], Turn]:
        start = time.perf_counter()
        out = engine.generate(input_ids=ids, sampling_params=dict(sampling))
        return list(out["output_ids"]), turn_record(out, time.perf_counter() - start)

    return answer


def _run_engine(kwargs: dict[str, Any], cfg: PipelineConfig, prompt_sets: dict[str, list[list[str]]]):
    from eagle3_ray.data.chat import render_generation_prompt
    from eagle3_ray.engines.describe import load_tokenizer

    sglang = import_sglang()
    check_server_args(kwargs)
    tok = load_tokenizer(cfg.target)
    b = cfg.bench
    sampling = generate_sampling(b.max_new_tokens, b.temperature, 1.0, cfg.generate.seed)
    engine = sglang.Engine(**kwargs)
    try:
        answer = _timed_answer(engine, sampling)
        first = next(turns[0] for convs in prompt_sets.values() for turns in convs)
        answer(render_generation_prompt(tok, [{"role": "user", "content": first}]))  # warm-up, not timed
        return replay(
            answer,
            lambda messages: render_generation_prompt(tok, messages),
            lambda ids: tok.decode(ids, skip_special_tokens=True),
            prompt_sets,
        )
    finally:
        engine.shutdown()


def run_sglang_bench(
    cfg: PipelineConfig, drafter_dir: str, prompt_sets: dict[str, list[list[str]]]
) -> dict[str, Any]:
    """``{"baseline": {...}, "eagle3": {"tau", "tokens_per_s", "speedup", "per_category", ...}}``."""
    base_turns = _run_engine(engine_kwargs(cfg.target, "generate"), cfg, prompt_sets)
    spec_kwargs = engine_kwargs(cfg.target, "spec", drafter_dir=drafter_dir, bench=cfg.bench)
    spec_turns = _run_engine(spec_kwargs, cfg, prompt_sets)
    baseline = summarize_run(base_turns)
    return {
        "baseline": baseline,
        "eagle3": summarize_run(spec_turns, baseline),
        "device": "cuda",
        "engine": {k: spec_kwargs[k] for k in spec_kwargs if k.startswith("speculative_")},
    }
